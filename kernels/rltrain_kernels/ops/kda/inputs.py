"""KDA's argument checks for its three entry points (naive, fused recurrent, chunked), on the delta-rule checks in
common/inputs.py: the same bad inputs give the same messages naming the argument, and fla's keywords
(use_gate_in_kernel with A_log / dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first and its
deprecated name transpose_state_layout) are read one way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.inputs import (FLOAT_DTYPES, check_head_groups, check_initial_state, check_packing, check_query,
                             check_tensors, default_scale)


def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first: bool = False
                 ) -> tuple[int, int, float]:
    """Validate shapes/dtypes/devices; return (number of sequences N, GVA group size HV // H, scale). g is
    [B, T, HV, K] (one log decay per key channel); the initial state [N, HV, K, V] ([N, HV, V, K] with
    state_v_first)."""
    check_tensors((("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)), q.device)
    B, T, H, K = check_query(q)
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T}, got {tuple(v.shape)}")
    HV = v.shape[2]
    group = check_head_groups(HV, H)
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K] = {(B, T, HV, K)} (a log decay per key channel), got "
                         f"{tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    N = check_packing(B, T, cu_seqlens)
    if state_v_first:
        check_initial_state(initial_state, (N, HV, v.shape[-1], K), "[N, HV, V, K] (state_v_first)", q.device)
    else:
        check_initial_state(initial_state, (N, HV, K, v.shape[-1]), "[N, HV, K, V]", q.device)
    return N, group, default_scale(scale, K)


@dataclass(frozen=True)
class Preprocess:
    """What the ops do to g and beta before the recurrence (fla's keywords). gate: (A_log, dt_bias or None) when g
    holds the raw a of g = −exp(A_log) softplus(a + dt_bias), else None. beta_scale: 0 when beta is β itself, else
    β = beta_scale · sigmoid(beta) (1, or 2 with allow_neg_eigval)."""

    gate: tuple[torch.Tensor, torch.Tensor | None] | None
    beta_scale: float


def check_preprocess(g, use_gate_in_kernel: bool, A_log, dt_bias, use_beta_sigmoid_in_kernel: bool,
                     allow_neg_eigval: bool) -> Preprocess:
    """fla's rules: A_log (HV values) is required with use_gate_in_kernel, dt_bias (HV·K values, one per value head
    and key channel) optional, both ignored without it; allow_neg_eigval needs use_beta_sigmoid_in_kernel. g must
    already have passed check_inputs ([B, T, HV, K])."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (it makes β = "
                         "2·sigmoid(beta))")
    beta_scale = (2.0 if allow_neg_eigval else 1.0) if use_beta_sigmoid_in_kernel else 0.0
    if not use_gate_in_kernel:
        return Preprocess(None, beta_scale)
    HV, K = g.shape[-2:]
    if A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log (the decay parameter, HV values): the gate is "
                         "g = -exp(A_log) * softplus(g + dt_bias)")
    for name, t, n in (("A_log", A_log, HV), ("dt_bias", dt_bias, HV * K)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a float tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.numel() != n:
            per = "one per value head" if name == "A_log" else "one per value head and key channel"
            raise ValueError(f"{name} must have {n} elements ({per}), got shape {tuple(t.shape)}")
        if t.device != g.device:
            raise ValueError(f"{name} is on {t.device} but g is on {g.device}")
    return Preprocess((A_log, dt_bias), beta_scale)
