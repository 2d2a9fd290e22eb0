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


def tiny_qwen3_next(dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0, **overrides):
    """A 4-layer Qwen3-Next: Gated DeltaNet, attention, Gated DeltaNet, attention (its 1 : 1 variant of the release's
    3 : 1), grouped value heads (2 q/k heads, 4 value heads of width 24), dense MLPs in layers 0-1 and sparse MoE
    blocks (4 experts, top 2, a shared expert) in 2-3; SDPA attention.

    Moderate decays (A_log ∈ [-2.5, -0.5], as test_model_swap's Qwen3-Next tests draw them): at transformers' init
    (A up to 16) its own fp32 chunked delta rule is off by up to 2.3e-3 of Σ|term| in dA_log / ddt_bias against
    float64 (test_model_swap.py), too coarse to hold two paths to each other at 1e-5."""
    import transformers as tf

    dims = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                mlp_only_layers=[0, 1], max_position_embeddings=512, tie_word_embeddings=False)
    config = tf.Qwen3NextConfig(**dict(dims, **overrides))
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-2.5, -0.5)
    return model.to(device)
