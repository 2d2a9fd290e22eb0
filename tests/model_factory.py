"""Tiny transformers causal LMs built from configs (no hub access), shared by kernel and framework tests."""

from __future__ import annotations

import torch

TINY_DIMS = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)

MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def tiny_causal_lm(model_type: str, dtype: torch.dtype = torch.float32, device="cpu", **overrides):
    """A 2-layer model of the given family with GQA (4 query heads, 2 kv heads), eager attention."""
    import transformers as tf

    dims = dict(TINY_DIMS, **overrides)
    if model_type == "llama":
        config = tf.LlamaConfig(**dims)
    elif model_type == "qwen2":
        config = tf.Qwen2Config(**dims)
    elif model_type == "qwen3":
        config = tf.Qwen3Config(**dims)
    elif model_type == "qwen3_moe":
        # layer 0 dense (a Qwen3MoeMLP the SwiGLU kernel swaps), layer 1 sparse
        config = tf.Qwen3MoeConfig(**dims, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   mlp_only_layers=[0])
    else:
        raise ValueError(f"unknown model_type {model_type!r}; expected one of {MODEL_TYPES}")
    config._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device)


def forward_backward(model, input_ids: torch.Tensor, grad_logits: torch.Tensor):
    """Logits and every parameter's gradient for the loss sum(logits * grad_logits)."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids).logits
    (logits.float() * grad_logits).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads
