"""The delta rules in plain PyTorch, one step per position for all sequences at once: what the linear-attention
layers run when continuing from a cache (decoding) where the registry swapped in no Triton kernel (CPU, or
`kernel_config.include_kernels` leaving them out). Whole sequences go through the chunked forms (layers/chunked.py),
which share this file's bodies (`gated_delta_product_rows`, `iplr_rows`) around their own cores.

Same arguments, layout and results as the ops' chunked and fused-recurrent functions (`rltrain_kernels.ops.*`),
so a layer calls either through one name. Unlike the ops' naive references (one Python step per token of every
sequence: the ground truth), these step once per position for all sequences at once: a packed row (`cu_seqlens`)
is gathered into [N, L] rows first, zeros at its padding steps, which makes them the identity (β = 0, no decay;
b = k = 0 for IPLR), so outputs and final states are exact. A core takes no state for a zero initial state and
returns none unless the final state is asked for, so the chunked forms skip the terms of either. Computed in fp32
(float64 for float64 inputs), differentiable by autograd. tests/kernels/layers/test_recurrence.py checks them against
the naive references.
"""

from __future__ import annotations

import torch

from rltrain_kernels.ops.gated_delta_product.inputs import check_inputs as check_product_inputs
from rltrain_kernels.ops.gated_delta_rule.inputs import check_inputs as check_rule_inputs
from rltrain_kernels.ops.iplr_delta_rule.inputs import check_inputs as check_iplr_inputs
from rltrain_kernels.ops.kda.inputs import check_inputs as check_kda_inputs

from .common import l2norm


class _Gather(torch.autograd.Function):
    """out = x[index] with the rows at `blank` zeroed, x [R, ...] → [len(index), ...], where every row of x is taken
    once (at inverse[r]) or not at all (at its `inverse_blank`): the map between a packed row and padded rows, either
    way. Its gradient is the gather back, grad[inverse] with the rows at `inverse_blank` zeroed: exact, as the
    blank rows depend on no x. Advanced indexing's backward (an accumulating index_put) ran 4× slower on CPU."""

    @staticmethod
    def forward(ctx, x, index, blank, inverse, inverse_blank):
        ctx.save_for_backward(index, blank, inverse, inverse_blank)
        out = x.index_select(0, index)
        return out.index_fill_(0, blank, 0) if blank.numel() else out

    @staticmethod
    def backward(ctx, grad):
        index, blank, inverse, inverse_blank = ctx.saved_tensors
        dx = _Gather.apply(grad, inverse, inverse_blank, index, blank) if ctx.needs_input_grad[0] else None
        return dx, None, None, None, None


class _Rows:
    """The map between a [B, T, ...] call and [N, L, ...] rows of whole sequences: the identity without cu_seqlens,
    else a gather of each packed sequence into a row (right-padded to the longest with zeros)."""

    def __init__(self, B: int, T: int, cu_seqlens: torch.Tensor | None, device):
        self.packed = cu_seqlens is not None
        if not self.packed:
            return
        starts, lengths = cu_seqlens[:-1].long(), cu_seqlens.diff().long()
        self.shape = (len(lengths), int(lengths.max()) if len(lengths) else 0)
        positions = torch.arange(self.shape[1], device=device)
        valid = positions[None] < lengths[:, None]                                     # [N, L]
        self.index = torch.where(valid, starts[:, None] + positions[None], 0).flatten()      # row entry ← token
        valid = valid.flatten()
        self.blank = (~valid).nonzero()[:, 0]                                          # padding entries
        self.inverse = valid.nonzero()[:, 0]                                           # token ← row entry

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] → [N, L, ...], 0 at padding steps."""
        if not self.packed:
            return x
        x = _Gather.apply(x[0], self.index, self.blank, self.inverse, self.blank[:0])
        return x.view(*self.shape, *x.shape[1:])

    def scatter(self, o: torch.Tensor) -> torch.Tensor:
        """[N, L, ...] → [B, T, ...]."""
        if not self.packed:
            return o
        return _Gather.apply(o.flatten(0, 1), self.inverse, self.blank[:0], self.index, self.blank)[None]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[N, L, ..., HV, D] → [L, ..., N·HV, D] contiguous: one slice per step."""
    N, L = x.shape[:2]
    x = x.movedim(0, -3)                              # [L, ..., N, HV, D]
    return x.reshape(*x.shape[:-3], N * x.shape[-2], x.shape[-1]).contiguous()


def _final(state: torch.Tensor | None, N: int, HV: int, K: int, V: int, acc, device) -> torch.Tensor:
    """A core's final state [N·HV, K, V] (None: zero) as [N, HV, K, V]."""
    if state is None:
        return torch.zeros(N, HV, K, V, dtype=acc, device=device)
    return state.reshape(N, HV, K, V)


def _delta_steps(q, k, v, g, beta, state):
    """The delta rule with n sub-steps per position, over rows. q [L, M, K] (scaled), k [L, n, M, K],
    v [L, n, M, V], beta [L, n, M], g [L, M] or None, state [M, K, V] (M = N·HV) → (o [L, M, V], state).

    Per position, with α = e^g and S the state before it: sub-step j writes δ_j = β_j (v_j − k_jᵀ S_{j−1}), where
    k_jᵀ S_{j−1} = α k_jᵀ S + Σ_{i<j} (k_j·k_i) δ_i; then S' = α S + Σ_j k_j δ_jᵀ and o = S'ᵀ q = α Sᵀ q +
    Σ_j (q·k_j) δ_j. So the state is read once (for every k_j and q) and written once per position, whatever n:
    decoding is bound by those passes over [M, K, V]."""
    outputs = []
    n = k.shape[1]
    for t in range(q.shape[0]):
        keys = k[t].transpose(0, 1)                                               # [M, n, K]
        keys_and_query = torch.cat([keys, q[t][:, None]], 1)                      # [M, n + 1, K]
        reads = torch.bmm(keys_and_query, state)                                  # k_jᵀ S and qᵀ S: [M, n + 1, V]
        decay = None if g is None else g[t].exp()[:, None, None]                  # [M, 1, 1]
        if decay is not None:
            reads = reads * decay
        overlaps = torch.bmm(keys_and_query, keys.transpose(1, 2))               # k_j·k_i and q·k_i: [M, n + 1, n]
        deltas = []
        for j in range(n):
            delta = v[t, j] - reads[:, j]
            for i in range(j):
                delta = delta - overlaps[:, j, i, None] * deltas[i]
            deltas.append(delta * beta[t, j][:, None])
        delta = torch.stack(deltas, 1)                                            # [M, n, V]
        if decay is None:
            state = torch.baddbmm(state, keys.transpose(1, 2), delta)
        else:
            state = (state * decay).baddbmm_(keys.transpose(1, 2), delta)
        outputs.append(reads[:, n] + torch.bmm(overlaps[:, n:], delta)[:, 0])
    return torch.stack(outputs) if outputs else q.new_zeros(0, q.shape[1], v.shape[-1]), state


def gated_delta_product_rows(core, q, k, v, g, beta, num_householder: int, scale, initial_state,
                             output_final_state: bool, cu_seqlens, use_qk_l2norm_in_kernel: bool):
    """The gated delta product's body around a core: checks, l2norm, GVA, rows with neutral padding steps (β = 0,
    g = 0), fp32 (float64 for float64 inputs). core(q [N, L, HV, K] scaled, k [N, L, n, HV, K], v [N, L, n, HV, V],
    g [N, L, HV] or None, beta [N, L, n, HV], state [N·HV, K, V] or None (zero), final: whether to return the final
    state) → (o [N, L, HV, V], final state or None (zero, or not asked for))."""
    N, group, scale = check_product_inputs(q, k, v, g, beta, num_householder, scale, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    HV, V, n, out_dtype = v.shape[2], v.shape[3], num_householder, v.dtype
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    rows = _Rows(B, T, cu_seqlens, q.device)
    # to the value heads (GVA), per token: k, v, beta [B, T, n, HV, ·]
    q = rows.gather(q.to(acc).repeat_interleave(group, 2)) * scale
    k = rows.gather(k.to(acc).reshape(B, T, n, H, K).repeat_interleave(group, 3))
    v = rows.gather(v.to(acc).reshape(B, T, n, HV, V))
    beta = rows.gather(beta.to(acc).reshape(B, T, n, HV))
    g = rows.gather(g.to(acc)) if g is not None else None
    state = None if initial_state is None else initial_state.to(acc).reshape(N * HV, K, V)
    o, state = core(q, k, v, g, beta, state, output_final_state)
    return rows.scatter(o).to(out_dtype), (_final(state, N, HV, K, V, acc, q.device) if output_final_state else None)


def iplr_rows(core, q, k, v, a, b, scale, initial_state, output_final_state: bool, cu_seqlens):
    """The IPLR delta rule's body around a core: checks, rows with neutral padding steps (b = k = 0), fp32 (float64
    for float64 inputs). core(q [N, L, H, K] scaled, k, a, b [N, L, H, K], v [N, L, H, V], state [N·H, K, V] or
    None, final) → (o [N, L, H, V], state or None), states as in gated_delta_product_rows."""
    N, scale = check_iplr_inputs(q, k, v, a, b, scale, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    rows = _Rows(B, T, cu_seqlens, q.device)
    # padding steps (zeros): no erase (b = 0), no write (k = 0)
    q, k, v, a, b = (rows.gather(x.to(acc)) for x in (q, k, v, a, b))
    state = None if initial_state is None else initial_state.to(acc).reshape(N * H, K, V)
    o, state = core(q * scale, k, v, a, b, state, output_final_state)
    return rows.scatter(o).to(out_dtype), (_final(state, N, H, K, V, acc, q.device) if output_final_state else None)


def _zero_state(q: torch.Tensor, v: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    """state, or the zero state [N·HV, K, V] of rows q [N, L, HV, K], v [N, L, ..., HV, V]."""
    if state is not None:
        return state
    return q.new_zeros(q.shape[0] * q.shape[2], q.shape[-1], v.shape[-1])


def _product_steps(q, k, v, g, beta, state, final: bool):
    """gated_delta_product_rows' core, one step per position: o [N, L, HV, V]."""
    N, L, HV = q.shape[:3]
    state = _zero_state(q, v, state)
    o, state = _delta_steps(_heads_first(q), _heads_first(k), _heads_first(v),
                            None if g is None else _heads_first(g[..., None])[..., 0],
                            _heads_first(beta[..., None])[..., 0], state)
    return o.reshape(L, N, HV, -1).movedim(1, 0), state


def _iplr_steps(q, k, v, a, b, state, final: bool):
    """iplr_rows' core, one step per position: o [N, L, H, V]. S' = S + b (aᵀ S) + k vᵀ and o = S'ᵀ q = Sᵀ q +
    (q·b) Sᵀ a + (q·k) v: one read of the state (for a and q) and one write per position."""
    N, L, H = q.shape[:3]
    state = _zero_state(q, v, state)
    q, k, v, a, b = (_heads_first(x) for x in (q, k, v, a, b))
    outputs = []
    for t in range(L):
        reads = torch.bmm(torch.stack([a[t], q[t]], 1), state)                   # aᵀ S, qᵀ S: [M, 2, V]
        written = torch.stack([reads[:, 0], v[t]], 1)                             # [M, 2, V]
        columns = torch.stack([b[t], k[t]], 2)                                    # [M, K, 2]
        state = torch.baddbmm(state, columns, written)
        outputs.append(reads[:, 1] + torch.bmm(q[t][:, None], columns)[:, 0, :, None].mul(written).sum(1))
    o = torch.stack(outputs) if outputs else q.new_zeros(0, N * H, v.shape[-1])
    return o.reshape(L, N, H, -1).movedim(1, 0), state


def recurrent_gated_delta_product(q, k, v, g, beta, num_householder: int, scale: float | None = None,
                                  initial_state=None, output_final_state: bool = False, cu_seqlens=None,
                                  use_qk_l2norm_in_kernel: bool = False):
    """`chunk_gated_delta_product`'s function: q [B, T, H, K]; k [B, T·n_h, H, K]; v [B, T·n_h, HV, V];
    beta [B, T·n_h, HV]; g [B, T, HV] or None; initial_state [N, HV, K, V]; cu_seqlens [N+1] token offsets of q
    with B = 1. Returns (o [B, T, HV, V] in v's dtype, final state [N, HV, K, V] fp32 or None)."""
    return gated_delta_product_rows(_product_steps, q, k, v, g, beta, num_householder, scale, initial_state,
                                    output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)


def recurrent_gated_delta_rule(q, k, v, g, beta, scale: float | None = None, initial_state=None,
                               output_final_state: bool = False, cu_seqlens=None,
                               use_qk_l2norm_in_kernel: bool = False):
    """`chunk_gated_delta_rule`'s function: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV];
    initial_state [N, HV, K, V]; cu_seqlens [N+1] with B = 1. Returns (o [B, T, HV, V] in v's dtype, final state
    [N, HV, K, V] fp32 or None). The gated delta product with one sub-step per token."""
    check_rule_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return recurrent_gated_delta_product(q, k, v, g, beta, 1, scale, initial_state, output_final_state, cu_seqlens,
                                         use_qk_l2norm_in_kernel)


def recurrent_iplr_delta_rule(q, k, v, a, b, scale: float | None = None, initial_state=None,
                              output_final_state: bool = False, cu_seqlens=None):
    """`chunk_iplr_delta_rule`'s function, S_t = S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ, o_t = S_tᵀ (scale q_t):
    q, k, a, b [B, T, H, K]; v [B, T, H, V]; initial_state [N, H, K, V]; cu_seqlens [N+1] with B = 1. Returns
    (o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32 or None)."""
    return iplr_rows(_iplr_steps, q, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens)


def recurrent_kda(q, k, v, g, beta, scale: float | None = None, initial_state=None, output_final_state: bool = False,
                  cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False):
    """`chunk_kda`'s function, S_t = (I − β k kᵀ) Diag(e^{g_t}) S_{t−1} + β k vᵀ, o_t = S_tᵀ (scale q_t): q, k
    [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (a log decay per key channel); beta [B, T, HV]; initial_state
    [N, HV, K, V]; cu_seqlens [N+1] with B = 1. Returns (o [B, T, HV, V] in v's dtype, final state [N, HV, K, V]
    fp32 or None). One step per position for all rows at once; padding steps are zeros (no decay, β = 0)."""
    N, group, scale = check_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    HV, V, out_dtype = v.shape[2], v.shape[3], v.dtype
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    rows = _Rows(B, T, cu_seqlens, q.device)
    q = _heads_first(rows.gather(q.to(acc).repeat_interleave(group, 2)) * scale)   # [L, N·HV, K]
    k = _heads_first(rows.gather(k.to(acc).repeat_interleave(group, 2)))
    v, g = _heads_first(rows.gather(v.to(acc))), _heads_first(rows.gather(g.to(acc)))
    beta = _heads_first(rows.gather(beta.to(acc))[..., None])[..., 0]               # [L, N·HV]
    state = (torch.zeros(N * HV, K, V, dtype=acc, device=q.device) if initial_state is None
             else initial_state.to(acc).reshape(N * HV, K, V))
    outputs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[..., None]                                       # each key channel's own decay
        delta = (v[t] - torch.bmm(k[t][:, None], state)[:, 0]) * beta[t][:, None]
        state = state.baddbmm(k[t][:, :, None], delta[:, None])
        outputs.append(torch.bmm(q[t][:, None], state)[:, 0])
    L = q.shape[0]
    o = torch.stack(outputs) if outputs else q.new_zeros(0, N * HV, V)
    o = rows.scatter(o.reshape(L, -1, HV, V).movedim(1, 0)).to(out_dtype)
    return o, (_final(state, N, HV, K, V, acc, q.device) if output_final_state else None)
