"""The delta rules in chunked plain PyTorch (the WY / UT-transform form of fla's naive chunk references): what the
linear-attention layers run on whole sequences (training, prefill) where no Triton kernel is swapped in.

Per head, a chunk of C positions with initial state S0 [K, V], G = the cumulative log gate within the chunk, Γ = e^G:

    gated delta rule   (I + L) U = diag(β) (V − diag(Γ) K S0),   L_ij = β_i e^(G_i − G_j) k_i·k_j   (j < i)
                       O = diag(Γ) Q S0 + (Q Kᵀ ⊙ e^(G_i − G_j) ⊙ [j ≤ i]) U,   S = Γ_C S0 + Kᵀ diag(e^(G_C − G)) U
    delta product      the gated delta rule over the n·C sub-steps, g on each token's first, q_t read at its last
    IPLR               (I − L) W = A S0 + (A Kᵀ ⊙ [j < i]) V,   L_ij = a_i·b_j   (j < i)
                       O = Q S0 + (Q Bᵀ ⊙ [j ≤ i]) W + (Q Kᵀ ⊙ [j ≤ i]) V,   S = S0 + Bᵀ W + Kᵀ V

The triangular inverses and every product that does not involve the state run batched over all chunks of all
sequences × heads; one short loop over chunks carries the state. Inputs, rows, padding and dtypes as the per-step
recurrence (layers/recurrence.py, which decoding keeps using); rows longer than a chunk are zero-padded to whole
chunks (β = g = 0, b = k = 0: identity steps). A zero initial state (every training call) skips the terms that read
it, and the final state is computed only when asked for. Why: on the embedded default's batch (512 sequences × 12
tokens, 4 heads, K = V = 32; 2 CPU cores) forward + backward of one call takes 76 / 126 / 73 ms (rule / product with
n_h = 2 / IPLR; fastest of several runs, which varied by ~25%) against the per-step recurrence's 162 / 240 / 147 ms,
which saves the [M, K, V] state at every step.
tests/kernels/layers/test_recurrence.py checks these against the ops' naive references in float64 (outputs, final
states, every gradient), over several chunks and strong decay.
"""

from __future__ import annotations

import torch

from rltrain_kernels.ops.gated_delta_rule.inputs import check_inputs as check_rule_inputs

from .recurrence import gated_delta_product_rows, iplr_rows

# Tokens per chunk: a sequence of ≤ 64 tokens (the embedded default's 12) is one chunk, so one solve and no loop.
CHUNK = 64


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """[N, L, (n,) HV, D] → [N·HV, L·n, D]: one row of positions (sub-steps) per sequence × head."""
    x = x.movedim(-2, 1)
    return x.reshape(x.shape[0] * x.shape[1], -1, x.shape[-1])


def _split(x: torch.Tensor, chunks: int, size: int) -> torch.Tensor:
    """[M, P, ...] → [M·chunks, size, ...], zero-padded to chunks·size positions; a row's chunks are consecutive."""
    pad = chunks * size - x.shape[1]
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], 1)
    return x.reshape(x.shape[0] * chunks, size, *x.shape[2:])


def _masked_exp(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """e^x where mask, else 0; masked before the exp so no overflow (or NaN gradient) from the upper triangle."""
    return torch.where(mask, x, float("-inf")).exp()


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)⁻¹ for L [.., C, C] strictly lower (the solve reads only that triangle). Inverting then multiplying
    beats solving for the K + V right-hand sides: 4.5 against 10 ms at [2048, 12, 12], K = V = 32 (2 CPU cores)."""
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand_as(L)
    return torch.linalg.solve_triangular(L, eye, upper=False, unitriangular=True)


def _carry(step, state: torch.Tensor | None, chunks: int, final: bool, *per_chunk):
    """Run step(state, carry, *chunk c's slices) → (o_c, state) over the chunks in order: (o [M, chunks·C, V], state).
    state None is the zero state (the terms that read it are skipped); carry: whether the chunk's final state is
    wanted (not after the last chunk unless `final`)."""
    per_chunk = [None if x is None else x.unflatten(0, (-1, chunks)) for x in per_chunk]
    outputs = []
    for c in range(chunks):
        o, state = step(state, c < chunks - 1 or final, *(None if x is None else x[:, c] for x in per_chunk))
        outputs.append(o)
    return torch.cat(outputs, 1) if chunks > 1 else outputs[0], state


def _product_chunks(q, k, v, g, beta, state, final: bool):
    """gated_delta_product_rows' core, chunked: o [N, L, HV, V]."""
    N, L, n, HV = k.shape[:4]
    if L == 0:
        return v.new_zeros(N, 0, HV, v.shape[-1]), state
    C = min(CHUNK, L)
    chunks = -(-L // C)
    reads_state = state is not None or chunks > 1                              # some chunk starts from a state
    if g is None:
        g = q.new_zeros(N, L, HV)
    g = torch.cat([g[:, :, None], g.new_zeros(N, L, n - 1, HV)], 2) if n > 1 else g[:, :, None]
    q = _split(_per_head(q), chunks, C)                                         # [M·chunks, C, K]
    k, v = (_split(_per_head(x), chunks, C * n) for x in (k, v))                # [M·chunks, C·n, K|V]
    g, beta = (_split(_per_head(x[..., None]), chunks, C * n)[..., 0] for x in (g, beta))    # [M·chunks, C·n]
    G = g.cumsum(-1)
    Gq = G[:, n - 1::n]                                                         # at each token's last sub-step
    steps = torch.arange(C * n, device=q.device)
    earlier = steps[None, :] < steps[:, None]                                   # j < i
    read = steps[None, :] < n * (torch.arange(C, device=q.device)[:, None] + 1)     # sub-step j ≤ token i's last
    # (I + L) u = diag(β) V, (I + L) w = diag(β Γ) K: then U = u − w S0
    L_mat = beta[..., None] * (k @ k.transpose(1, 2)) * _masked_exp(G[:, :, None] - G[:, None, :], earlier)
    inverse = _unit_lower_inverse(L_mat) * beta[:, None, :]                     # (I + L)⁻¹ diag(β)
    u = inverse @ v
    w = inverse @ (G.exp()[..., None] * k) if reads_state else None
    attention = (q @ k.transpose(1, 2)) * _masked_exp(Gq[:, :, None] - G[:, None, :], read)
    q_decayed = Gq.exp()[..., None] * q if reads_state else None
    k_decayed = (G[:, -1:] - G).exp()[..., None] * k if final or chunks > 1 else None    # e^(G_C − G_j) k_j
    last = G[:, -1].exp()[:, None, None]

    def step(state, carry, u, w, attention, q_decayed, k_decayed, last):
        U = u if state is None else torch.baddbmm(u, w, state, alpha=-1)
        o = attention @ U if state is None else torch.baddbmm(attention @ U, q_decayed, state)
        if not carry:
            return o, None
        if state is None:
            return o, k_decayed.transpose(1, 2) @ U
        return o, torch.baddbmm(last * state, k_decayed.transpose(1, 2), U)

    o, state = _carry(step, state, chunks, final, u, w, attention, q_decayed, k_decayed, last)
    return o[:, :L].reshape(N, HV, L, -1).transpose(1, 2), state


def _iplr_chunks(q, k, v, a, b, state, final: bool):
    """iplr_rows' core, chunked: o [N, L, H, V]."""
    N, L, H = q.shape[:3]
    V = v.shape[-1]
    if L == 0:
        return v.new_zeros(N, 0, H, V), state
    C = min(CHUNK, L)
    chunks = -(-L // C)
    reads_state = state is not None or chunks > 1
    q, k, v, a, b = (_split(_per_head(x), chunks, C) for x in (q, k, v, a, b))
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    earlier = causal.tril(-1)
    # (I − L) u = (A Kᵀ ⊙ [j < i]) V, (I − L) w = A: then W = u + w S0
    L_mat = (a @ b.transpose(1, 2)) * earlier
    inverse = _unit_lower_inverse(-L_mat)
    u = inverse @ (((a @ k.transpose(1, 2)) * earlier) @ v)
    w = inverse @ a if reads_state else None
    attention_b = (q @ b.transpose(1, 2)) * causal
    written = ((q @ k.transpose(1, 2)) * causal) @ v                            # (Q Kᵀ ⊙ [j ≤ i]) V
    kv = k.transpose(1, 2) @ v if final or chunks > 1 else None

    def step(state, carry, u, w, attention_b, written, q, b, kv):
        W = u if state is None else torch.baddbmm(u, w, state)
        o = torch.baddbmm(written, attention_b, W)
        if state is not None:
            o = torch.baddbmm(o, q, state)
        if not carry:
            return o, None
        return o, torch.baddbmm(kv if state is None else state + kv, b.transpose(1, 2), W)

    o, state = _carry(step, state, chunks, final, u, w, attention_b, written, q, b, kv)
    return o[:, :L].reshape(N, H, L, -1).transpose(1, 2), state


def chunked_gated_delta_product(q, k, v, g, beta, num_householder: int, scale: float | None = None,
                                initial_state=None, output_final_state: bool = False, cu_seqlens=None,
                                use_qk_l2norm_in_kernel: bool = False):
    """`recurrent_gated_delta_product` (layers/recurrence.py), chunked: same arguments and results."""
    return gated_delta_product_rows(_product_chunks, q, k, v, g, beta, num_householder, scale, initial_state,
                                    output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)


def chunked_gated_delta_rule(q, k, v, g, beta, scale: float | None = None, initial_state=None,
                             output_final_state: bool = False, cu_seqlens=None, use_qk_l2norm_in_kernel: bool = False):
    """`recurrent_gated_delta_rule` (layers/recurrence.py), chunked: same arguments and results."""
    check_rule_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return chunked_gated_delta_product(q, k, v, g, beta, 1, scale, initial_state, output_final_state, cu_seqlens,
                                       use_qk_l2norm_in_kernel)


def chunked_iplr_delta_rule(q, k, v, a, b, scale: float | None = None, initial_state=None,
                            output_final_state: bool = False, cu_seqlens=None):
    """`recurrent_iplr_delta_rule` (layers/recurrence.py), chunked: same arguments and results."""
    return iplr_rows(_iplr_chunks, q, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens)
