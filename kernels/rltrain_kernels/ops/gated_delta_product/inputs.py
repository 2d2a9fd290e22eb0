"""The gated delta product's argument checks for its three entry points (naive, fused recurrent, chunked), on the
delta-rule checks in common/inputs.py, so every entry point rejects the same bad inputs with the same messages naming
the argument.
"""

from __future__ import annotations

from ..common.inputs import (check_head_groups, check_initial_state, check_packing, check_query, check_tensors,
                             default_scale)


def check_inputs(q, k, v, g, beta, num_householder, scale, initial_state, cu_seqlens) -> tuple[int, int, float]:
    """Validate shapes/dtypes/devices; return (number of sequences N, GVA group size HV // H, scale)."""
    check_tensors((("q", q), ("k", k), ("v", v), ("beta", beta)) + ((("g", g),) if g is not None else ()), q.device)
    if not isinstance(num_householder, int) or num_householder < 1:
        raise ValueError(f"num_householder must be an int >= 1, got {num_householder!r}")
    B, T, H, K = check_query(q)
    TN = T * num_householder
    if k.shape != (B, TN, H, K):
        raise ValueError(f"k must be [B, T*num_householder, H, K] = {(B, TN, H, K)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != (B, TN):
        raise ValueError(f"v must be [B, T*num_householder, HV, V] with B={B}, T*num_householder={TN}, "
                         f"got {tuple(v.shape)}")
    HV = v.shape[2]
    group = check_head_groups(HV, H)
    if beta.shape != (B, TN, HV):
        raise ValueError(f"beta must be [B, T*num_householder, HV] = {(B, TN, HV)}, got {tuple(beta.shape)}")
    if g is not None and g.shape != (B, T, HV):
        raise ValueError(f"g must be [B, T, HV] = {(B, T, HV)} (one gate per token), got {tuple(g.shape)}")
    N = check_packing(B, T, cu_seqlens, "tokens of q")
    check_initial_state(initial_state, (N, HV, K, v.shape[-1]), "[N, HV, K, V]", q.device)
    return N, group, default_scale(scale, K)
