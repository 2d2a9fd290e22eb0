"""Argument checks shared by the three IPLR delta rule entry points (naive, fused recurrent, chunked), so each
rejects the same bad inputs with the same messages naming the argument.
"""

from __future__ import annotations

import torch

from ..common.inputs import check_initial_state, check_packing

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_inputs(q, k, v, a, b, scale, initial_state, cu_seqlens) -> tuple[int, float]:
    """Validate shapes/dtypes/devices; return (number of sequences N, scale)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32/float16/bfloat16 (float64 for references), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    for name, t in (("k", k), ("a", a), ("b", b)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with B={B}, T={T}, H={H}, got {tuple(v.shape)}")
    N = check_packing(B, T, cu_seqlens)
    check_initial_state(initial_state, (N, H, K, v.shape[-1]), "[N, H, K, V]", q.device)
    if scale is None:
        scale = K ** -0.5
    return N, float(scale)


def sequence_bounds(B: int, T: int, cu_seqlens) -> list[tuple[int, int]]:
    """(start, end) token offsets of every sequence in the flattened [B*T] token axis."""
    if cu_seqlens is None:
        return [(i * T, (i + 1) * T) for i in range(B)]
    offsets = cu_seqlens.tolist()
    return list(zip(offsets[:-1], offsets[1:]))
