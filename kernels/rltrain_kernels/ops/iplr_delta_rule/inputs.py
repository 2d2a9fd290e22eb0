"""The IPLR delta rule's argument checks for its three entry points (naive, fused recurrent, chunked), on the
delta-rule checks in common/inputs.py, so each rejects the same bad inputs with the same messages naming the argument.
"""

from __future__ import annotations

from ..common.inputs import check_initial_state, check_packing, check_query, check_tensors, default_scale


def check_inputs(q, k, v, a, b, scale, initial_state, cu_seqlens) -> tuple[int, float]:
    """Validate shapes/dtypes/devices; return (number of sequences N, scale)."""
    check_tensors((("q", q), ("k", k), ("v", v), ("a", a), ("b", b)), q.device)
    B, T, H, K = check_query(q)
    for name, t in (("k", k), ("a", a), ("b", b)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with B={B}, T={T}, H={H}, got {tuple(v.shape)}")
    N = check_packing(B, T, cu_seqlens)
    check_initial_state(initial_state, (N, H, K, v.shape[-1]), "[N, H, K, V]", q.device)
    return N, default_scale(scale, K)
