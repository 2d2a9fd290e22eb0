"""Attention for the policy copies: which transformers implementation a model loads with, and the variable-length
attention that packed (padding-free) batches run through.

`model.attn_implementation` (config): `auto` loads with SDPA (flash / memory-efficient kernels on GPU, no [T, T]
scores kept), `eager` / `sdpa` / `flash_attention_2` / `flex_attention` as named. Eager attention materialises
[batch, heads, T, T] scores in every layer; on one H100 with a 0.6B Qwen3 it ran the actor step at 0.36x the tokens/s
of SDPA and 3.9x its memory, so it is used only when asked for.

Packed rows: after `use_packed_attention(model)`, `model(..., **varlen_kwargs(cu_seqlens, max_seqlen))` runs
every attention layer as causal attention within each of the row's sequences. A model loaded with SDPA or eager is
switched for good to `rltrain_varlen` (registered below; a worker runs its model either packed or padded, and a
checkpointed layer's recomputation in backward must take the same path): torch's flash varlen kernel
(`torch.nn.attention.varlen.varlen_attn`, bf16/fp16 on CUDA) or, elsewhere, one batched causal SDPA over the
sequences gathered into rows. Both take
`cu_seqlens`, so no [T, T] mask is built and no work is spent across sequences. `flash_attention_2` reads the same
keyword arguments natively; `flex_attention` builds its document mask from the per-sequence position ids.

Ulysses sequence parallelism (rltrain/workers/ulysses.py) runs through `rltrain_varlen` only: with a
`sequence_parallel` keyword (rltrain_kernels.sequence_parallel) the function gets this rank's slice of the row's tokens
for every head, switches to every token of a slice of the heads (key/value heads repeated up to the group's size where
there are fewer), attends as above over the whole row, and switches back.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import AttentionInterface

try:  # torch's varlen flash attention: torch >= 2.9
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

VARLEN = "rltrain_varlen"
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention")
# implementations that cannot take cu_seqlens and are switched to VARLEN for a packed forward
_SWITCHED = ("sdpa", "eager")


def resolve_attn_implementation(name: str) -> str:
    """The transformers attn_implementation a policy copy loads with: `auto` = SDPA (every device has it)."""
    return "sdpa" if name == "auto" else name


def varlen_kwargs(cu_seqlens: torch.Tensor, max_seqlen: int) -> dict:
    """The keyword arguments transformers' attention layers pass on to the attention function (the names its
    flash-attention path reads), for a row of sequences starting at cu_seqlens[:-1]."""
    return dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen)


def use_packed_attention(model) -> None:
    """Run `model`'s attention layers as variable-length attention from now on. For good, not for one call: a
    gradient-checkpointed layer recomputes its forward during backward, which must take the same path."""
    register_varlen_attention()
    if model.config._attn_implementation in _SWITCHED:
        model.config._attn_implementation = VARLEN


@functools.cache
def register_varlen_attention() -> None:
    """Register VARLEN with transformers (once per process). It is left out of the mask registry, so the model
    builds no mask for it: the attention function gets cu_seqlens instead."""
    AttentionInterface.register(VARLEN, varlen_attention_forward)


# whether torch's varlen_attn takes enable_gqa (torch >= 2.13)
VARLEN_TAKES_GQA = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, sliding_window: int | None = None, **kwargs):
    """transformers attention-function signature: query [1, Hq, T, D], key/value [1, Hkv, T, D] of a packed row →
    ([1, T, Hq, D], None), causal within each sequence of cu_seq_lens_q. With `sequence_parallel`: T is this rank's
    slice of the row and cu_seq_lens_q the whole row's (module docstring)."""
    sp = kwargs.pop("sequence_parallel", None)
    if sp is not None:   # GQA: as many key/value heads as ranks at least, so that each rank gets whole ones
        repeat = max(1, sp.size // key.shape[1])
        query, key, value = (sp.gather_sequence(t, head_dim=1, seq_dim=2)
                             for t in (query, key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)))
        out, _ = varlen_attention_forward(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                                          **kwargs)
        return sp.scatter_sequence(out, head_dim=2, seq_dim=1), None
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        raise ValueError(f"attn_implementation {VARLEN!r} needs cu_seq_lens_q (a packed batch); "
                         "load the model with sdpa for padded batches")
    if query.shape[0] != 1:
        raise ValueError(f"a packed batch is one row, got query batch size {query.shape[0]}")
    if dropout:
        raise ValueError(f"{VARLEN} attention has no dropout (got {dropout}); the policy runs in eval-style "
                         "attention for RL")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))   # [T, H, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    if varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        gqa = {}
        if k.shape[1] != q.shape[1]:
            if VARLEN_TAKES_GQA:
                gqa = dict(enable_gqa=True)
            else:   # torch < 2.13's kernel wants as many key/value heads as query heads
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
        out = varlen_attn(q, k, v, cu_seqlens.to(torch.int32), cu_seqlens.to(torch.int32),
                          int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), scale=scale, window_size=window,
                          **gqa)
    else:
        out = _padded_sdpa(q, k, v, cu_seqlens, scale, sliding_window)
    return out.unsqueeze(0), None


def _padded_sdpa(q, k, v, cu_seqlens, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Causal SDPA over the row's sequences at once ([T, H, D] in and out): each sequence gathered into a row of
    [N, L] (L the longest), one batched SDPA, the valid positions gathered back. The CPU path. A padded row's keys
    come after its real ones, so causality alone keeps them out of every real query (no mask to build, no NaN)."""
    lengths = cu_seqlens.diff().long()
    if not len(lengths):
        return q.new_zeros(q.shape)
    positions = torch.arange(int(lengths.max()), device=q.device)
    valid = positions[None] < lengths[:, None]                                     # [N, L]
    index = torch.where(valid, cu_seqlens[:-1, None].long() + positions[None], 0)
    qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))                      # [N, H, L, D]
    gqa = dict(enable_gqa=True) if k.shape[1] != q.shape[1] else {}
    if sliding_window is None:
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, **gqa)
    else:
        i = positions[:, None]
        allowed = (positions[None] <= i) & (positions[None] > i - sliding_window)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, **gqa)
    return o.transpose(1, 2)[valid]
