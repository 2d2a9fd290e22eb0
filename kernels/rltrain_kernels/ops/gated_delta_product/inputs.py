"""Argument checks for the three gated delta product entry points (naive, fused recurrent, chunked), so every entry
point rejects the same bad inputs with the same messages naming the argument.
"""

from __future__ import annotations

import torch

from ..common.inputs import check_initial_state, check_packing

from ..gated_delta_rule.inputs import FLOAT_DTYPES


def check_inputs(q, k, v, g, beta, num_householder, scale, initial_state, cu_seqlens) -> tuple[int, int, float]:
    """Validate shapes/dtypes/devices; return (number of sequences N, GVA group size HV // H, scale)."""
    tensors = (("q", q), ("k", k), ("v", v), ("beta", beta)) + ((("g", g),) if g is not None else ())
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32/float16/bfloat16/float64, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if not isinstance(num_householder, int) or num_householder < 1:
        raise ValueError(f"num_householder must be an int >= 1, got {num_householder!r}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    TN = T * num_householder
    if k.shape != (B, TN, H, K):
        raise ValueError(f"k must be [B, T*num_householder, H, K] = {(B, TN, H, K)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != (B, TN):
        raise ValueError(f"v must be [B, T*num_householder, HV, V] with B={B}, T*num_householder={TN}, "
                         f"got {tuple(v.shape)}")
    HV = v.shape[2]
    if HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's H={H}")
    if beta.shape != (B, TN, HV):
        raise ValueError(f"beta must be [B, T*num_householder, HV] = {(B, TN, HV)}, got {tuple(beta.shape)}")
    if g is not None and g.shape != (B, T, HV):
        raise ValueError(f"g must be [B, T, HV] = {(B, T, HV)} (one gate per token), got {tuple(g.shape)}")
    N = check_packing(B, T, cu_seqlens, "tokens of q")
    check_initial_state(initial_state, (N, HV, K, v.shape[-1]), "[N, HV, K, V]", q.device)
    if scale is None:
        scale = K ** -0.5
    return N, HV // H, float(scale)
