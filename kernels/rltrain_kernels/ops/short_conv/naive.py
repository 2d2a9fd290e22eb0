"""Plain-PyTorch causal depthwise short convolution: the ground truth the Triton kernels are tested against, and the
fallback where they cannot run (CPU outside the Triton interpreter, float64).

One sequence at a time, written the way the maths reads: the W − 1 inputs before the sequence (the initial state,
zeros without one) are put in front of it, and output t is the weighted sum of the W inputs ending at t

    y[t] = act(bias + Σ_w weight[:, w] · xx[t − (W − 1) + w]) (+ residual[t]),   xx = [state, x]

(tap W − 1 is the current token). The final state is the last W − 1 entries of xx. Computed in fp32 (float64 for
float64 inputs), returned in x's dtype; every input is differentiable by autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _activate(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(z) if activation in ("silu", "swish") else z


def naive_short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False, activation: str | None = None, *,
                     cu_seqlens: torch.Tensor | None = None):
    """short_conv's reference: same arguments and results (y [B, T, C], final state [N, C, W − 1] or None).
    initial_state may be wider than W − 1 (its last W − 1 columns are read)."""
    B, T, C = x.shape
    W = weight.shape[1]
    compute = _compute_dtype(x)
    w = weight.to(compute)
    if cu_seqlens is None:
        sequences = [(b, 0, T) for b in range(B)]
    else:
        offsets = cu_seqlens.tolist()
        sequences = [(0, start, end) for start, end in zip(offsets, offsets[1:])]
    outputs, finals = [], []
    for n, (b, start, end) in enumerate(sequences):
        if initial_state is not None:
            before = initial_state[n, :, initial_state.shape[-1] - (W - 1):].transpose(0, 1).to(compute)
        else:
            before = x.new_zeros(W - 1, C, dtype=compute)
        xx = torch.cat([before, x[b, start:end].to(compute)])                    # [W − 1 + L, C]
        L = end - start
        z = sum(xx[tap: tap + L] * w[:, tap] for tap in range(W))
        if bias is not None:
            z = z + bias.to(compute)
        outputs.append(_activate(z, activation))
        finals.append(xx[L:].transpose(0, 1))                                   # [C, W − 1]
    if cu_seqlens is None:
        y = torch.stack(outputs) if outputs else x.new_zeros(0, T, C, dtype=compute)
    else:
        y = torch.cat(outputs)[None]
    if residual is not None:
        y = y + residual.to(compute)
    final = torch.stack(finals).to(x.dtype) if output_final_state else None
    return y.to(x.dtype), final


def naive_short_conv_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """short_conv_update's reference: one token per sequence, x [B, C] (or [B, 1, C]); conv_state [B, C, S ≥ W − 1]
    (its last W − 1 columns are the previous inputs) is shifted left by one with x written last, in place.
    Returns y shaped like x. Differentiable in x, weight and bias (the state update itself is not)."""
    W = weight.shape[1]
    compute = _compute_dtype(x)
    rows = x.reshape(x.shape[0], x.shape[-1])
    window = torch.cat([conv_state[..., conv_state.shape[-1] - (W - 1):].to(compute), rows.to(compute)[..., None]],
                       -1)                                                       # [B, C, W]
    z = (window * weight.to(compute)).sum(-1)
    if bias is not None:
        z = z + bias.to(compute)
    with torch.no_grad():
        conv_state.copy_(torch.cat([conv_state[..., 1:], rows.detach()[..., None].to(conv_state.dtype)], -1))
    return _activate(z, activation).to(x.dtype).reshape(x.shape)
