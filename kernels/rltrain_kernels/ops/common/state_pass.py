"""The sequential inter-chunk state pass of the chunked delta rule, forward and backward.

Forward, per (sequence, value head, V block), chunk by chunk with the [K, BV] fp32 state S in registers:
    store S (the state at the chunk's start, for the output pass and the backward)
    δ = u − w S = T diag(β)(V − diag(γ) K S)     (the chunk's corrected values, "v_new", formed from T, v, β and
                                                  the k tile: neither u nor w is ever stored)
    S ← γ_last S + (diag(exp(G_last − G)) K)ᵀ δ   (γ_last = exp(G_last), the chunk's total decay)

Backward, chunks in reverse, with dS = ∂L/∂(state at the chunk's end) (the final-state gradient to start):
    store dS (per chunk: the gradient of the state the chunk hands on)
    dδ = Pᵀ dO + diag(exp(G_last − G)) K dS,      P_ij = scale q_iᵀk_j exp(G_i − G_j) (j ≤ i)
    dS ← γ_last dS + scale (diag(γ) Q)ᵀ dO − wᵀ dδ   (wᵀ dδ = Kᵀ diag(βγ) Tᵀ dδ, formed from T: no w read;
                                                  IPLR: −wᵀ dδ = Aᵀ Y with Y = Tᵀ dδ stored in dδ's place)
and the dS left after the first chunk is the initial-state gradient. The chunk-local term Pᵀ dO needs no state:
in the wide launch the reverse pass forms it itself off the chunk's chain; in the narrow one a chunk-parallel
kernel (local_dv_kernel) computes it first (once per chunk, not once per V block inside the latency-bound loop).
With a query stride NH > 1 (the gated delta product's n_h sub-steps per token) q and dO hold one row per token,
the query of row t·NH + NH − 1 of the expanded axis, and the other rows' queries are zero: the backward kernels
read them in place (query_rows) instead of from zero-scattered expanded copies.
Dot precision: both passes take the recurrence's DOT_PREC as `dot_prec` from the op (common/precision.py
recurrence_dot_precision; IPLR its own), as the WY kernels do (common/wy.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .chunking import ChunkLayout, chunk_program, state_program
from .launch import tile
from .precision import (
    cast_for_store,
    mm,
    mma,
    operand_dtype,
    raw_precision,
    work_dtype,
)
from .tuning import DEFAULT_TUNING, Tuning
from .wy import gated_wy_fwd

# Why the passes form u, w S and wᵀ dδ from T rather than reading u and w: the forward writes and reads neither (3 of
# its ~14 passes over a [tokens, heads, 128] tensor; H100, bf16 B8 T2048 H16 K=V=128, --profile: fwd+bwd 2.55 → 2.43
# ms), the WY kernel stores only T, and the backward launches no w recomputation. V − diag(γ) K S cancels in fp32
# before anything is rounded.
# The chunk-local Pᵀ dO of the reverse pass: formed inside the pass in the wide launch (throughput-bound: the extra
# dots fill its stalls), computed first by the chunk-parallel local_dv_kernel in the narrow one, which is
# latency-bound (B2 T8192: fused 0.46 ms against 0.42 for the two kernels), into dδ's own buffer and dtype.


@triton.jit
def state_pass_fwd_kernel(
    k, v, beta, Ai, G, h, v_new, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_n, i_hv, i_h, bos, eos, c0, o_i, o_k, o_v, m_k, m_v, m_h, state_offset = state_program(
        cu_seqlens, chunk_offsets, H, HV, K, V, BT, BK, BV)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + (i_n * HV + i_hv).to(tl.int64) * K * V + state_offset, mask=m_h, other=0.0)
    for i_t in range(tl.cdiv(eos - bos, BT)):
        tl.store(h + ((c0 + i_t) * HV + i_hv) * K * V + state_offset, cast_for_store(b_h, h, DOT_PREC), mask=m_h)
        o_t = bos + i_t * BT + o_i
        m_t = o_t < eos
        p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        if USE_G:
            last = tl.minimum(bos + (i_t + 1) * BT, eos) - 1
            b_G_last = tl.load(G + last * HV + i_hv)
            b_G = tl.load(G + o_t * HV + i_hv, mask=m_t, other=0.0)
        # T and k feed only dots: loaded as stored, they reach the tensor cores from shared memory (mm)
        b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_T = tl.load(Ai + (o_t[:, None] * HV + i_hv) * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
        b_beta = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        b_vin = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        # δ = T diag(β) (V − diag(γ) K S)
        b_ks = mm(b_k, b_h, DOT_PREC)
        if USE_G:
            b_ks = b_ks * tl.exp(b_G)[:, None]
        b_v = mm(b_T, (b_vin - b_ks) * b_beta[:, None], DOT_PREC)
        tl.store(v_new + p_v, cast_for_store(b_v, v_new, DOT_PREC), mask=m_t[:, None] & m_v[None, :])
        if USE_G:
            b_v = b_v * tl.where(m_t, tl.exp(b_G_last - b_G), 0.0)[:, None]
            b_h *= tl.exp(b_G_last)
        b_h = mma(tl.trans(b_k), b_v, b_h, DOT_PREC)
    if STORE_FINAL_STATE:
        tl.store(ht + (i_n * HV + i_hv).to(tl.int64) * K * V + state_offset, b_h, mask=m_h)


@triton.jit
def query_rows(o_t, m_t, NH: tl.constexpr):
    """(rows of q / dO, mask) for the expanded-axis rows o_t: every row when NH == 1, else row o_t // NH where
    o_t % NH == NH − 1 (sequence offsets are multiples of NH) and nothing elsewhere."""
    if NH == 1:
        return o_t, m_t
    return o_t // NH, m_t & (o_t % NH == NH - 1)


@triton.jit
def local_pt(b_q, b_k, b_G, m_t, scale, BT: tl.constexpr, USE_G: tl.constexpr, RAW_PREC: tl.constexpr):
    """The chunk's Pᵀ (fp32 [BT, BT]): Pᵀ[j, i] = scale k_jᵀq_i exp(G_i − G_j) for i ≥ j, zero elsewhere."""
    o_i = tl.arange(0, BT)
    m_A = (o_i[:, None] <= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    b_At = mm(b_k, tl.trans(b_q), RAW_PREC) * scale
    if USE_G:
        b_At = b_At * tl.exp(tl.where(m_A, b_G[None, :] - b_G[:, None], 0.0))
    return tl.where(m_A, b_At, 0.0)


@triton.jit
def local_dv_kernel(
    q, k, G, do, dv, cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, DOT_PREC: tl.constexpr, RAW_PREC: tl.constexpr,
    NH: tl.constexpr,
):
    """dv = Pᵀ dO per chunk (in dv's dtype), the part of dδ that needs no state."""
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_c, i_n, i_t, bos, eos, o_i, o_t, m_t = chunk_program(cu_seqlens, chunk_indices, BT)
    o_k = tl.arange(0, BK)
    o_q, m_q = query_rows(o_t, m_t, NH)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    # q, k and dO feed only dots: loaded as stored (mm)
    b_q = tl.load(q + (o_q[:, None] * H + i_h) * K + o_k[None, :], mask=m_q[:, None] & (o_k < K)[None, :],
                  other=0.0)
    b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    b_G = None
    if USE_G:
        b_G = tl.load(G + o_t * HV + i_hv, mask=m_t, other=0.0)
    b_At = local_pt(b_q, b_k, b_G, m_t, scale, BT, USE_G, RAW_PREC)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_do = tl.load(do + (o_q[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_q[:, None] & (o_v < V)[None, :],
                       other=0.0)
        tl.store(dv + p_v, cast_for_store(mm(b_At, b_do, DOT_PREC), dv, DOT_PREC), mask=m_tv)


@triton.jit
def state_pass_bwd_kernel(
    q, k, Ai, beta, a, G, do, dv, dh, dht, dh0, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
    STORE_INITIAL_STATE_GRADIENT: tl.constexpr, DOT_PREC: tl.constexpr, NH: tl.constexpr,
    FUSE_LOCAL: tl.constexpr, LOCAL_PREC: tl.constexpr, RAW_PREC: tl.constexpr, W_FROM_A: tl.constexpr,
    A_IN_REGISTERS: tl.constexpr,
):
    i_n, i_hv, i_h, bos, eos, c0, o_i, o_k, o_v, m_k, m_v, m_h, state_offset = state_program(
        cu_seqlens, chunk_offsets, H, HV, K, V, BT, BK, BV)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + (i_n * HV + i_hv).to(tl.int64) * K * V + state_offset, mask=m_h, other=0.0)
    NT = tl.cdiv(eos - bos, BT)
    for i_r in range(NT):
        i_t = NT - 1 - i_r
        tl.store(dh + ((c0 + i_t) * HV + i_hv) * K * V + state_offset, cast_for_store(b_dh, dh, DOT_PREC),
                 mask=m_h)
        o_t = bos + i_t * BT + o_i
        m_t = o_t < eos
        o_q, m_q = query_rows(o_t, m_t, NH)
        m_tk = m_t[:, None] & m_k[None, :]
        # q, k and T feed only dots, loaded as stored (see the forward); the gates scale the dots' other operand
        # or result rows instead: dO's rows (64 × BV rather than q's 64 × K), and k dS's rows after the dot
        b_q = tl.load(q + (o_q[:, None] * H + i_h) * K + o_k[None, :], mask=m_q[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        # wᵀ dδ = Kᵀ diag(β γ) Tᵀ dδ: T and β in place of w (IPLR: −wᵀ dδ = Aᵀ Tᵀ dδ, T and a)
        b_T = tl.load(Ai + (o_t[:, None] * HV + i_hv) * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
        if W_FROM_A:
            b_a = tl.load(a + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
            if A_IN_REGISTERS:
                b_a = b_a.to(tl.float32)
        else:
            b_wscale = tl.load(beta + o_t * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = tl.load(do + (o_q[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_q[:, None] & m_v[None, :],
                       other=0.0)
        b_kdh = mm(b_k, b_dh, DOT_PREC)
        if USE_G:
            last = tl.minimum(bos + (i_t + 1) * BT, eos) - 1
            b_G_last = tl.load(G + last * HV + i_hv)
            b_G = tl.load(G + o_t * HV + i_hv, mask=m_t, other=0.0)
            b_kdh = b_kdh * tl.where(m_t, tl.exp(b_G_last - b_G), 0.0)[:, None]
            b_dos = b_do.to(tl.float32) * (tl.exp(b_G) * scale)[:, None]
            if not W_FROM_A:
                b_wscale = b_wscale * tl.exp(b_G)
        else:
            b_G = None
            b_dos = b_do.to(tl.float32) * scale
        if FUSE_LOCAL:  # Pᵀ dO here, off the chunk's chain (q, k and dO are loaded anyway)
            b_dv = mma(local_pt(b_q, b_k, b_G, m_t, scale, BT, USE_G, RAW_PREC), b_do, b_kdh, LOCAL_PREC)
        else:  # dv holds Pᵀ dO from local_dv_kernel, in dv's dtype
            b_dv = tl.load(dv + p_v, mask=m_tv, other=0.0) + b_kdh
        if W_FROM_A:  # IPLR: Y = Tᵀ dδ stored in dδ's place (every later consumer of dδ reads it through Tᵀ)
            b_dv = mm(tl.trans(b_T), b_dv, DOT_PREC)
        tl.store(dv + p_v, cast_for_store(b_dv, dv, DOT_PREC), mask=m_tv)
        if USE_G:
            b_dh *= tl.exp(b_G_last)
        b_dh = mma(tl.trans(b_q), b_dos, b_dh, DOT_PREC)
        if W_FROM_A:
            b_dh = mma(tl.trans(b_a), b_dv, b_dh, DOT_PREC)
        else:
            b_ndx = mm(tl.trans(b_T), -b_dv, DOT_PREC) * b_wscale[:, None]  # −diag(β γ) Tᵀ dδ
            b_dh = mma(tl.trans(b_k), b_ndx, b_dh, DOT_PREC)
    if STORE_INITIAL_STATE_GRADIENT:
        tl.store(dh0 + (i_n * HV + i_hv).to(tl.int64) * K * V + state_offset, b_dh, mask=m_h)


# Value columns per program of the narrow launch, per pass (32 where not listed). The narrow launch is latency-bound
# (fewer programs than SMs at 64 columns): more, thinner programs shorten each chunk's chain. The forward pass at 16
# (H100, bf16 B2 T8192 H16 K=V=128): 0.48 ms for its two calls against 0.57 at 32; the reverse pass stays at 32.
NARROW_BV: dict[str, int] = {"state_pass_fwd": 16}


def state_launch(name: str, programs: int, K: int, V: int, device: torch.device, sm_count: int | None = None,
                 value_block: str = "auto") -> tuple[str, int, int]:
    """(LAUNCH entry, BK, BV) for a state pass over `programs` sequence-heads: the whole key dim in registers, and
    64 value columns per program (the entry's *_wide settings) when K ≤ 128 and programs × V/64 still fill every
    SM (`sm_count`, default the device's: 1 on the interpreter) or `value_block` (Tuning.value_block) says "wide",
    else NARROW_BV's (a [128, 32] fp32 state tile plus [64, 128] operand tiles fit 4 warps without spilling at
    K=128)."""
    if K > 256:
        raise ValueError(f"the chunked state pass keeps the whole key dim in registers: K={K} must be <= 256")
    BK = tile(K)
    # swept at K=128 only: a [256, 64] fp32 state tile would spill at the *_wide warps, so wider keys stay at 32
    sm_count = _sm_count(device) if sm_count is None else sm_count
    fills = value_block == "wide" or (value_block == "auto" and programs * triton.cdiv(V, 64) >= sm_count)
    if BK <= 128 and V >= 64 and fills:
        return f"{name}_wide", BK, 64
    return name, BK, min(NARROW_BV.get(name, 32), tile(V))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: exercise the wide path whenever V allows it
    return torch.cuda.get_device_properties(device).multi_processor_count


def state_pass_fwd(k, v, beta, Ai, G, initial_state, output_final_state: bool, layout: ChunkLayout, *,
                   dot_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """k [tokens, H, K], v [tokens, HV, V], beta [tokens, HV], the T matrices Ai [tokens, HV, BT] → (h [chunks, HV,
    K, V] chunk-start states, v_new [tokens, HV, V] (both in work_dtype(k.dtype)), final state (fp32) or None);
    δ = T diag(β)(V − diag(γ) K S) formed in the pass. dot_prec: the recurrence's DOT_PREC (the WY kernel's);
    tuning: the launch choices (common/tuning.py)."""
    TT, H, K = k.shape
    HV, V = v.shape[1:]
    N = layout.num_seqs
    name, BK, BV = state_launch("state_pass_fwd", N * HV, K, V, k.device, tuning.sm_count, tuning.value_block)
    if initial_state is not None:
        # The kernel addresses the state as dense [N, HV, K, V]; callers pass any layout (engines keep states
        # [V, K] and hand in the transposed view, caches slice them out of larger buffers): one state-sized copy.
        initial_state = initial_state.contiguous()
    h = torch.empty(layout.num_chunks, HV, K, V, dtype=work_dtype(k.dtype), device=k.device)
    v_new = torch.empty(TT, HV, V, dtype=work_dtype(k.dtype), device=k.device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=k.device) if output_final_state else None
    state_pass_fwd_kernel[(N * HV, triton.cdiv(V, BV))](
        k, v, beta, Ai, G, h, v_new, initial_state, ht, layout.cu_seqlens, layout.chunk_offsets, H=H, HV=HV,
        K=K, V=V, BT=layout.chunk_size, BK=BK, BV=BV, USE_G=G is not None,
        USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=output_final_state,
        DOT_PREC=tuning.dot(state_pass_fwd_kernel, dot_prec), **tuning.launch(name))
    return h, v_new, ht


def chunk_states_fwd(k, v, beta, G, initial_state, output_final_state: bool, layout: ChunkLayout, Ai=None, *,
                     dot_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """The WY kernel's solve (skipped with Ai given: the backward's recomputation) then the forward state pass →
    (Ai, h, v_new, final state or None), both in the recurrence's DOT_PREC `dot_prec`."""
    if Ai is None:
        Ai = gated_wy_fwd(k, beta, G, layout, dot_prec=dot_prec, tuning=tuning)
    h, v_new, ht = state_pass_fwd(k, v, beta, Ai, G, initial_state, output_final_state, layout, dot_prec=dot_prec,
                                  tuning=tuning)
    return Ai, h, v_new, ht


def state_pass_bwd(q, k, G, do, dht, scale: float, need_dh0: bool, layout: ChunkLayout, Ai, beta=None, a=None, *,
                   dot_prec: str, local_prec: str, dh_dtype: torch.dtype | None = None,
                   dv_dtype: torch.dtype | None = None, query_stride: int = 1, tuning: Tuning = DEFAULT_TUNING):
    """→ (dh [chunks, HV, K, V] in dh_dtype (default work_dtype(k.dtype)): gradient of each chunk's end state,
    dv [tokens, HV, V] in dv_dtype (default operand_dtype(k.dtype, dot_prec)): ∂L/∂δ, dh0 [N, HV, K, V] fp32 or
    None). dot_prec: the reverse pass's DOT_PREC (the recurrence's, the forward's); local_prec: the chunk-local
    Pᵀ dO's (the output pass's); tuning: the launch choices. dv feeds only dots downstream, so storing it in their
    operand dtype changes no number; its chunk-local part is formed in the reverse pass (wide launch) or by
    local_dv_kernel into dv first (narrow launch).
    query_stride NH: q [tokens / NH, H, K] and do [tokens / NH, HV, V] hold the queries of every NH-th row (see the
    module docstring); k, G and the outputs span every row.
    w is formed from Ai (T): the gated WY's w = T diag(β γ) K with beta, or with `a` [tokens, H, K] given instead
    (IPLR, no gate) w = −T A: then dS gets Aᵀ Y and dv holds Y = Tᵀ dδ instead of dδ."""
    TT, H, K = k.shape
    HV, V = do.shape[1], do.shape[2]
    N = layout.num_seqs
    if (beta is None) == (a is None):
        raise ValueError("state_pass_bwd: it forms wᵀ dδ from T and either beta (gated WY) or a (IPLR): pass one")
    if a is not None and G is not None:
        raise ValueError("state_pass_bwd: a (IPLR's w = −T A) goes without a gate")
    if q.shape[0] * query_stride != TT or do.shape[0] * query_stride != TT:
        raise ValueError(f"state_pass_bwd: q and do need k's {TT} rows / query_stride {query_stride}, got "
                         f"{q.shape[0]} and {do.shape[0]}")
    name, BK, BV = state_launch("state_pass_bwd", N * HV, K, V, k.device, tuning.sm_count, tuning.value_block)
    if dht is not None:
        dht = dht.contiguous()  # read as dense [N, HV, K, V]; autograd may hand it in expanded or strided
    dh = torch.empty(layout.num_chunks, HV, K, V, dtype=dh_dtype or work_dtype(k.dtype), device=k.device)
    dv = torch.empty(TT, HV, V, dtype=dv_dtype or operand_dtype(k.dtype, dot_prec), device=k.device)
    dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=k.device) if need_dh0 else None
    kind = "wide" if name.endswith("_wide") else "narrow"
    fuse_local = kind == "wide"  # Pᵀ dO formed in the reverse pass: see the note above state_pass_fwd_kernel
    if layout.num_chunks and not fuse_local:
        local_dv_kernel[(layout.num_chunks, HV)](
            q, k, G, do, dv, layout.cu_seqlens, layout.chunk_indices, scale, H=H, HV=HV, K=K, V=V,
            BT=layout.chunk_size, BK=BK, BV=tile(V, 64), USE_G=G is not None,
            DOT_PREC=tuning.dot(local_dv_kernel, local_prec), RAW_PREC=raw_precision(q.dtype), NH=query_stride,
            **tuning.launch("local_dv"))
    state_pass_bwd_kernel[(N * HV, triton.cdiv(V, BV))](
        q, k, Ai, beta, a, G, do, dv, dh, dht, dh0, layout.cu_seqlens, layout.chunk_offsets, scale, H=H,
        HV=HV, K=K, V=V, BT=layout.chunk_size, BK=BK, BV=BV, USE_G=G is not None,
        USE_FINAL_STATE_GRADIENT=dht is not None, STORE_INITIAL_STATE_GRADIENT=need_dh0,
        DOT_PREC=tuning.dot(state_pass_bwd_kernel, dot_prec), NH=query_stride, W_FROM_A=a is not None,
        A_IN_REGISTERS=K > 128 or tuning.iplr_a_in_registers[kind], FUSE_LOCAL=fuse_local, LOCAL_PREC=local_prec,
        RAW_PREC=raw_precision(q.dtype), **tuning.launch(name))
    return dh, dv, dh0
