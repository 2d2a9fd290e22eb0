"""The gated delta rule's argument checks for its three entry points (naive, fused recurrent, chunked), on the
delta-rule checks in common/inputs.py, so every entry point rejects the same bad inputs with the same messages naming
the argument and reads fla's keywords (use_gate_in_kernel with A_log / dt_bias, use_beta_sigmoid_in_kernel,
allow_neg_eigval, state_v_first and its deprecated name transpose_state_layout) the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.inputs import (FLOAT_DTYPES, check_head_groups, check_initial_state, check_packing, check_query,
                             check_tensors, default_scale)


def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first: bool = False
                 ) -> tuple[int, int, float]:
    """Validate shapes/dtypes/devices; return (number of sequences N, GVA group size HV // H, scale). The initial
    state is [N, HV, K, V], or [N, HV, V, K] with state_v_first."""
    check_tensors((("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)), q.device)
    B, T, H, K = check_query(q)
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T}, got {tuple(v.shape)}")
    HV = v.shape[2]
    group = check_head_groups(HV, H)
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV] = {(B, T, HV)}, got {tuple(t.shape)}")
    N = check_packing(B, T, cu_seqlens)
    if state_v_first:
        check_initial_state(initial_state, (N, HV, v.shape[-1], K), "[N, HV, V, K] (state_v_first)", q.device)
    else:
        check_initial_state(initial_state, (N, HV, K, v.shape[-1]), "[N, HV, K, V]", q.device)
    return N, group, default_scale(scale, K)


@dataclass(frozen=True)
class Preprocess:
    """What the ops do to g and beta before the recurrence (fla's keywords). gate: (A_log, dt_bias or None) when g
    holds the raw a of g = −exp(A_log) softplus(a + dt_bias), else None (g is the log gate). beta_scale: 0 when beta
    is β itself, else β = beta_scale · sigmoid(beta) (1, or 2 with allow_neg_eigval)."""

    gate: tuple[torch.Tensor, torch.Tensor | None] | None
    beta_scale: float


def check_preprocess(g, use_gate_in_kernel: bool, A_log, dt_bias, use_beta_sigmoid_in_kernel: bool,
                     allow_neg_eigval: bool) -> Preprocess:
    """fla's rules: A_log is required with use_gate_in_kernel (HV elements, as dt_bias), and both are ignored without
    it; allow_neg_eigval needs use_beta_sigmoid_in_kernel. g must already have passed check_inputs ([B, T, HV])."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (it makes β = "
                         "2·sigmoid(beta))")
    beta_scale = (2.0 if allow_neg_eigval else 1.0) if use_beta_sigmoid_in_kernel else 0.0
    if not use_gate_in_kernel:
        return Preprocess(None, beta_scale)
    HV = g.shape[-1]
    if A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log (the decay parameter, HV values): the gate is "
                         "g = -exp(A_log) * softplus(g + dt_bias)")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a float tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.numel() != HV:
            raise ValueError(f"{name} must have HV={HV} elements (one per value head), got shape {tuple(t.shape)}")
        if t.device != g.device:
            raise ValueError(f"{name} is on {t.device} but g is on {g.device}")
    return Preprocess((A_log, dt_bias), beta_scale)
