"""Pieces shared by the linear-attention layers (GatedDeltaNet, GatedDeltaProduct, IPLRLinearAttention,
KimiDeltaAttention): the decoding cache, the short causal depthwise convolution with its rolling state, the q/k l2
normalisation, the padding-mask and packed-row rules and the output head.

On CUDA the convolution and the l2 normalisation run as the fused kernels of ops/short_conv and ops/l2norm; elsewhere
as the plain-PyTorch forms below (the same functions).

Padding: a padded token must leave the recurrent state and the conv window as if it were absent. The layers zero
the padded tokens' hidden states (so the conv reads zeros, exactly a fresh conv state for left padding) and make
their state update the identity (β = 0 and no decay, or b = 0 and k = 0). That is exact for left padding and, when
no cache is returned, for right padding; everything else is rejected with a ValueError naming the rule.

Packed rows (`cu_seqlens`, B = 1, the actor's padding-free batches): every sequence starts from a zero state and an
empty conv window; the conv masks the taps that would reach into the previous sequence and the delta-rule op takes
the same `cu_seqlens`. A packed call takes no attention_mask and returns no cache.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from rltrain_kernels.ops.l2norm import naive_l2norm as plain_l2norm
from rltrain_kernels.ops.l2norm import l2norm as fused_l2norm
from rltrain_kernels.ops.rmsnorm import gated_rms_norm
from rltrain_kernels.ops.short_conv import short_conv


@dataclass
class LinearAttentionCache:
    """What one linear-attention layer carries between decoding steps.

    conv_states: per projection name, the last conv_size − 1 conv inputs [B, channels, conv_size − 1];
    recurrent_state: [B, HV, K, V] fp32; seen_tokens: tokens consumed so far (for the padding rules)."""

    conv_states: dict[str, torch.Tensor]
    recurrent_state: torch.Tensor
    seen_tokens: int


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim in fp32, cast back (fla's convention): the fused kernel on CUDA
    (ops/l2norm), the plain form elsewhere."""
    return fused_l2norm(x, eps) if x.is_cuda else plain_l2norm(x, eps)


def _cross_sequence_taps(cu_seqlens: torch.Tensor, T: int, W: int) -> list[torch.Tensor]:
    """Per tap s = 1 .. W − 1 (s tokens back): the tokens of a packed row of T tokens whose tap s would read the
    previous sequence (their index within their sequence is below s)."""
    offsets, tokens = cu_seqlens.long(), torch.arange(T, device=cu_seqlens.device)
    sequence = torch.searchsorted(offsets[1:], tokens, right=True)      # the sequence holding each token
    position = tokens - offsets[sequence]                                # its index within that sequence
    return [(position < shift).nonzero()[:, 0] for shift in range(1, W)]


class _ShiftedConv(torch.autograd.Function):
    """y[b, t] = Σ_s weight[:, W − 1 − s] · full[b, W − 1 + t − s] (s = 0 .. W − 1) for full [B, W − 1 + T, C] (the
    left context, then the T tokens), weight [C, W] → y [B, T, C]; `skipped` (or None): per tap s ≥ 1, flat indices
    b·T + t of the outputs whose tap s is left out (a packed row's taps into the previous sequence). W shifted
    multiply-adds in place, forward and backward: CPU's depthwise conv1d backward ran ~100× slower at the embedded
    default's sizes, and autograd through the shifts and masks kept 3× the passes over x."""

    @staticmethod
    def forward(ctx, full, weight, skipped):
        W = weight.shape[1]
        T = full.shape[1] - (W - 1)
        taps = weight.t().contiguous()       # [W, C]: a strided column would slow every multiply ~3×
        ctx.save_for_backward(full, taps)
        ctx.skipped = skipped
        y = full[:, W - 1:] * taps[-1]
        for shift in range(1, W):
            with _kept(y, None if skipped is None else skipped[shift - 1]):
                y.addcmul_(full[:, W - 1 - shift: W - 1 - shift + T], taps[-1 - shift])
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        full, taps = ctx.saved_tensors
        skipped, W, dy = ctx.skipped, taps.shape[0], dy.contiguous()
        T = full.shape[1] - (W - 1)
        dfull = torch.zeros_like(full) if ctx.needs_input_grad[0] else None
        dtaps = torch.empty_like(taps) if ctx.needs_input_grad[1] else None
        for shift in range(W):
            rows = None if skipped is None or shift == 0 else skipped[shift - 1]
            tap = slice(W - 1 - shift, W - 1 - shift + T)
            if dfull is not None:
                # the skipped outputs' taps read full row W − 1 − shift + t of the packed row (B = 1)
                with _kept(dfull, None if rows is None else rows + (W - 1 - shift)):
                    dfull[:, tap].addcmul_(dy, taps[-1 - shift])
            if dtaps is not None:
                product = dy * full[:, tap]
                if rows is not None and rows.numel():
                    product.view(-1, product.shape[-1]).index_fill_(0, rows, 0)
                dtaps[-1 - shift] = product.sum((0, 1))
        return dfull, None if dtaps is None else dtaps.t(), None


@contextlib.contextmanager
def _kept(x: torch.Tensor, rows: torch.Tensor | None):
    """Rows (flat indices over x's leading dims) of x as they were on entry, restored on exit: the in-place update
    inside skips them exactly."""
    if rows is None or not rows.numel():
        yield
        return
    flat = x.view(-1, x.shape[-1])
    kept = flat.index_select(0, rows)
    yield
    flat.index_copy_(0, rows, kept)


class ShortConvolution(nn.Module):
    """Causal depthwise Conv1d (no bias) followed by SiLU, over [B, T, channels], with a rolling state: the
    previous conv_size − 1 inputs (zeros at the start of a sequence). forward(x, state) -> (y, new_state).
    On CUDA it runs ops/short_conv's kernels (`fused_forward`), elsewhere `plain_forward`'s shifted multiply-adds."""

    def __init__(self, channels: int, conv_size: int = 4):
        super().__init__()
        if conv_size < 2:
            raise ValueError(f"conv_size must be >= 2, got {conv_size}")
        self.channels, self.conv_size = channels, conv_size
        self.weight = nn.Parameter(torch.empty(channels, 1, conv_size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Conv1d's default

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        forward = self.fused_forward if x.is_cuda else self.plain_forward
        return forward(x, state, cu_seqlens)

    def plain_forward(self, x: torch.Tensor, state: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward in plain PyTorch (what it runs off CUDA); the new state is None for a packed call."""
        return plain_short_conv(x, self.weight[:, 0], state, cu_seqlens)

    def fused_forward(self, x: torch.Tensor, state: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward through ops/short_conv (what it runs on CUDA; on CPU tensors the op takes the Triton interpreter
        when TRITON_INTERPRET=1, else its reference): plain_forward's results, with fp32 accumulation and the weight as
        stored (plain_forward rounds it to x's dtype)."""
        return fused_short_conv(x, self.weight[:, 0], state, cu_seqlens)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, conv_size={self.conv_size}"


def short_convolution(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None, activation: str | None = "silu"
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise convolution of x [B, T, C] with weight [C, W] (tap W − 1 is the current token), then
    `activation` (None, or "silu" / "swish": the same), continuing `state` [B, C, W − 1] (None: zeros); a packed row
    (cu_seqlens, B = 1) restarts at every sequence. Returns (y [B, T, C], the new state, None for a packed call):
    ops/short_conv's kernels on CUDA (fused_short_conv), plain_short_conv elsewhere. ShortConvolution's maths, for a
    layer that keeps its own weight (Qwen3-Next's conv1d)."""
    forward = fused_short_conv if x.is_cuda else plain_short_conv
    return forward(x, weight, state, cu_seqlens, activation)


def plain_short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None, activation: str | None = "silu"
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """short_convolution in plain PyTorch, in x's dtype (the weight rounded to it)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    B, T, C = x.shape
    weight = weight.to(x.dtype)
    W = weight.shape[1]
    act = F.silu if activation is not None else (lambda y: y)
    if cu_seqlens is not None:   # one row, zeros in front; taps reaching into the previous sequence read zero
        full = F.pad(x, (0, 0, W - 1, 0))
        return act(_ShiftedConv.apply(full, weight, _cross_sequence_taps(cu_seqlens, T, W))), None
    if state is None:
        state = x.new_zeros(B, C, W - 1)
    full = torch.cat([state.to(x.dtype).transpose(1, 2), x], dim=1)  # [B, W − 1 + T, C]
    return act(_ShiftedConv.apply(full, weight, None)), full[:, -(W - 1):].transpose(1, 2)


def fused_short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None, activation: str | None = "silu"
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """short_convolution through ops/short_conv: fp32 accumulation, the weight as stored."""
    return short_conv(x, weight, initial_state=state, output_final_state=cu_seqlens is None, activation=activation,
                      cu_seqlens=cu_seqlens)


def padding_mask(attention_mask: torch.Tensor | None, batch: int, length: int, cache, use_cache: bool):
    """attention_mask [B, L ≥ T] (1 = token, 0 = padding; the last T columns are this call's tokens) → a float
    [B, T, 1] mask, or None when nothing is padded. Rejects what the layers cannot make exact (module docstring)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < length:
        raise ValueError(f"attention_mask must be [B, L] with B={batch} and L >= T={length} (1 = token, "
                         f"0 = padding), got {tuple(attention_mask.shape)}")
    keep = attention_mask[:, -length:] != 0
    if bool(keep.all()):
        return None
    # One contiguous run of tokens per row: the number of 0→1 steps (with a 0 in front) is at most one.
    starts = (keep.int().diff(dim=1, prepend=torch.zeros_like(keep[:, :1], dtype=torch.int)) == 1).sum(1)
    if bool((starts > 1).any()):
        raise ValueError("attention_mask has padding between tokens; only left or right padding (one contiguous "
                         "run of 1s per row) is supported")
    if use_cache and bool((~keep[:, -1]).any()):
        raise ValueError("attention_mask has right padding with use_cache=True: the conv cache would end on padding "
                         "and the next step would read it; left-pad batches that are decoded further")
    if cache is not None and cache.seen_tokens > 0 and bool((~keep[:, 0]).any()):
        raise ValueError("attention_mask pads the start of a call that continues a cache: padding is only allowed "
                         "at the start of a sequence (left) or at its end (right)")
    return keep[..., None].to(torch.float32)


def check_packed_call(cu_seqlens: torch.Tensor | None, batch: int, attention_mask, cache, use_cache: bool) -> None:
    """A packed call (cu_seqlens given) is one row of whole sequences: no padding mask, no cache in or out."""
    if cu_seqlens is None:
        return
    if batch != 1:
        raise ValueError(f"cu_seqlens packs sequences into one row: hidden_states must be [1, T, ·], got B={batch}")
    if attention_mask is not None or cache is not None or use_cache:
        raise ValueError("a packed call (cu_seqlens) takes no attention_mask and no cache, and returns none "
                         "(use_cache=False): its sequences are whole")


def gated_output(o: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head gated RMSNorm of the attention output: o [B, T, HV, V], gate [B, T, HV·V] → [B, T, HV·V]."""
    B, T, HV, V = o.shape
    return gated_rms_norm(o, gate.view(B, T, HV, V), norm_weight, eps).reshape(B, T, HV * V)
