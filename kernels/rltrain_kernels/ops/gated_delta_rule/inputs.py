"""Argument checks and small shared helpers for the three gated delta rule entry points (naive, fused recurrent,
chunked), so every entry point rejects the same bad inputs with the same messages naming the argument.
"""

from __future__ import annotations

import torch

from ..common.inputs import check_initial_state, check_packing

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x²) + eps) over the last dim, computed in fp32 (fla's `l2norm` convention), cast back."""
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens) -> tuple[int, int, float]:
    """Validate shapes/dtypes/devices; return (number of sequences N, GVA group size HV // H, scale)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32/float16/bfloat16, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T}, got {tuple(v.shape)}")
    HV = v.shape[2]
    if HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's H={H}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV] = {(B, T, HV)}, got {tuple(t.shape)}")
    N = check_packing(B, T, cu_seqlens)
    check_initial_state(initial_state, (N, HV, K, v.shape[-1]), "[N, HV, K, V]", q.device)
    if scale is None:
        scale = K ** -0.5
    return N, HV // H, float(scale)


def sequence_bounds(B: int, T: int, cu_seqlens) -> list[tuple[int, int]]:
    """(start, end) token offsets of every sequence in the flattened [B*T] token axis."""
    if cu_seqlens is None:
        return [(b * T, (b + 1) * T) for b in range(B)]
    offsets = cu_seqlens.tolist()
    return list(zip(offsets[:-1], offsets[1:]))
