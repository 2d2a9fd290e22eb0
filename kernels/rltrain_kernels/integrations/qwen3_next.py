"""Qwen3-Next's Gated DeltaNet on packed rows: a forward for transformers' `Qwen3NextGatedDeltaNet` that takes a packed
row's sequence boundaries, so a Qwen3-Next policy trains on padding-free batches like an attention-only one.

transformers' forward runs a packed row as one sequence: its short conv reads across the boundaries, and its torch
delta rule gets no `cu_seq_lens_q` (5.17-5.19) or ignores it (5.24), so every sequence would start from the previous
one's conv window and state. The forward
here keeps the module's weights and maths (in_proj_qkvz / in_proj_ba split by the module's own
fix_query_key_value_ordering, conv1d + its activation, β = sigmoid(b), g = −exp(A_log)·softplus(a + dt_bias), the
gated norm, out_proj) and, when the call carries `cu_seq_lens_q` (rltrain.workers.attention.varlen_kwargs) and no
cache, runs

    conv1d     the short convolution restarting at every sequence (layers/common.py short_convolution: ops/short_conv's
               kernels on CUDA, plain shifted multiply-adds elsewhere)
    delta rule chunked, varlen (a zero state per sequence), q and k l2-normalised in the op
               (use_qk_l2norm_in_kernel) and the gate computed from the raw a in the op (use_gate_in_kernel with
               A_log, dt_bias: fla's keywords)

Every other call (no cu_seqlens, a cache: prefill and decoding in generate, padded rows) goes to the forward it
wraps, unchanged: transformers' own, or the registry's `gated_delta_rule` copy of it on CUDA.

Two ways in, one forward (`packed_forward(padded_forward, chunk_rule)`):
- `use_packed_linear_attention(model)` (rltrain's load_policy calls it on every policy copy it loads, after the
  kernels, whatever kernel_config says): the delta rule in plain PyTorch (`torch_chunk_gated_delta_rule`:
  layers/chunked.py, the gate computed first, transformers' own line), padded calls to transformers' forward.
  Modules whose forward already takes packed rows are left alone.
- the registry's `gated_delta_rule` kernel (integrations/gated_delta_rule.py, CUDA): its Triton chunked op for packed
  rows, its adapters inside transformers' forward for the rest.

`takes_packed_rows(model)` says whether every Gated DeltaNet layer of the model has such a forward (rltrain's
can_pack reads it). Tests: tests/kernels/integrations/test_qwen3_next_packed.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from rltrain_kernels.integrations.families import family_classes, original_class, swap_forward, wrapped_model

# The families whose linear-attention layers (families.py's `linear_attention` role) packed_forward fits.
PACKED_FAMILIES = ("qwen3_next",)
# swap_forward's tag for use_packed_linear_attention's forward (kernel id / device: the delta rule in plain PyTorch)
PACKED_ROWS_TAG = ("packed_rows", "torch")


def torch_chunk_gated_delta_rule(q, k, v, g, beta, *, use_gate_in_kernel: bool = False, A_log=None, dt_bias=None,
                                 **kwargs):
    """layers/chunked.py's chunked gated delta rule (plain PyTorch, varlen through cu_seqlens) taking the chunked op's
    gate keywords: with use_gate_in_kernel, g holds the raw a and the gate −exp(A_log)·softplus(a + dt_bias) is
    computed first, in fp32 (transformers' own line)."""
    from rltrain_kernels.layers.chunked import chunked_gated_delta_rule
    from rltrain_kernels.ops.gated_delta_rule.naive import naive_gdn_gate

    if use_gate_in_kernel:
        g = naive_gdn_gate(g, A_log, dt_bias)
    return chunked_gated_delta_rule(q, k, v, g, beta, **kwargs)


def _cache_of(args: tuple, kwargs: dict):
    """The cache a Gated DeltaNet call continues: `cache` (transformers 5.24) or `cache_params` (5.17-5.19), by
    keyword as the decoder layer passes it, or the first positional argument after the hidden states."""
    if args:
        return args[0]
    return kwargs.get("cache", kwargs.get("cache_params"))


def packed_forward(padded_forward, chunk_rule):
    """A Qwen3NextGatedDeltaNet forward: a packed row (`cu_seq_lens_q` given, no cache) through `chunk_rule` (the
    chunked op's signature and fla's keywords) with the conv restarting per sequence; every other call to
    `padded_forward(self, hidden_states, ...)` unchanged."""

    @functools.wraps(padded_forward)
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None or _cache_of(args, kwargs) is not None:
            return padded_forward(self, hidden_states, *args, **kwargs)
        return _packed_row(self, hidden_states, cu_seqlens, kwargs.get("attention_mask"), chunk_rule)

    forward.takes_packed_rows = True
    return forward


def _packed_row(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, attention_mask, chunk_rule):
    """transformers' forward without a cache, on one packed row [1, T, hidden] of whole sequences."""
    from rltrain_kernels.layers.common import short_convolution

    B, T, _ = hidden_states.shape
    if B != 1:
        raise ValueError(f"cu_seq_lens_q packs sequences into one row: hidden_states must be [1, T, ·], got B={B}")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("a packed row (cu_seq_lens_q) has no padding: its attention_mask must be None or all ones")
    if self.conv1d.bias is not None or self.activation not in ("silu", "swish"):  # Qwen3-Next's: bias=False, silu
        raise ValueError(f"{type(self).__name__}: the packed forward takes a bias-free conv1d with silu (got "
                         f"bias={self.conv1d.bias is not None}, activation={self.activation!r})")
    query, key, value, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden_states),
                                                                   self.in_proj_ba(hidden_states))
    mixed_qkv = torch.cat([x.reshape(B, T, -1) for x in (query, key, value)], -1)      # [1, T, conv_dim]
    mixed_qkv, _ = short_convolution(mixed_qkv, self.conv1d.weight[:, 0], cu_seqlens=cu_seqlens, activation="silu")
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(B, T, -1, self.head_k_dim)
    key = key.reshape(B, T, -1, self.head_k_dim)
    value = value.reshape(B, T, -1, self.head_v_dim)
    # q, k heads are not repeated for the value heads: the op reads head hv // (HV / H), as repeat_interleave would
    core_attn_out, _ = chunk_rule(query, key, value, g=a, beta=b.sigmoid(), use_gate_in_kernel=True,
                                  A_log=self.A_log, dt_bias=self.dt_bias, use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=cu_seqlens)
    core_attn_out = self.norm(core_attn_out.reshape(-1, core_attn_out.shape[-1]), z.reshape(-1, z.shape[-1]))
    return self.out_proj(core_attn_out.reshape(B, T, -1))


def gated_deltanets(model: nn.Module) -> list[nn.Module]:
    """The linear-attention modules of `model` (or of the model a PEFT wrapper holds) that packed_forward fits:
    Qwen3-Next's Gated DeltaNet layers; [] for any other family."""
    config = getattr(wrapped_model(model), "config", None)
    if getattr(config, "model_type", None) not in PACKED_FAMILIES:
        return []
    classes = family_classes(model, "linear_attention", "packed rows")
    return [m for m in model.modules() if issubclass(original_class(m), classes)]


def takes_packed_rows(model: nn.Module) -> bool:
    """Whether `model` has linear-attention layers and every one of them runs packed rows (packed_forward)."""
    layers = gated_deltanets(model)
    return bool(layers) and all(getattr(type(m).forward, "takes_packed_rows", False) for m in layers)


def use_packed_linear_attention(model: nn.Module) -> int:
    """Give every Gated DeltaNet layer of `model` that lacks one a forward taking packed rows, with the delta rule in
    plain PyTorch (the registry's CUDA kernel brings its own); returns how many changed. Other families: 0. In place
    and for good, like rltrain.workers.attention.use_packed_attention: weights, names and state_dict unchanged."""
    changed = 0
    for module in gated_deltanets(model):
        if getattr(type(module).forward, "takes_packed_rows", False):
            continue
        forward = packed_forward(original_class(module).forward, torch_chunk_gated_delta_rule)
        changed += swap_forward(module, *PACKED_ROWS_TAG, forward)
    return changed


__all__ = ["packed_forward", "takes_packed_rows", "torch_chunk_gated_delta_rule", "use_packed_linear_attention"]
