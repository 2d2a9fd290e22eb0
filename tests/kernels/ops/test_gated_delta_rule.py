"""Gated delta rule: the naive reference against an independent float64 loop and closed forms, then the
fused-recurrent and chunked Triton kernels (interpreted on CPU, native on GPU) against the naive reference.

Run: `pytest tests/kernels/ops/test_gated_delta_rule.py` (CPU, ~1-3 min through the Triton interpreter);
the `gpu`-marked tests run real sizes in bf16 on a CUDA machine.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from rltrain_kernels.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)
from tests.helpers import (
    assert_rel_close,
    case_id,
    state_pass_batch,
    spy_launches,
)


def make_inputs(B, T, H, K, V, HV=None, dtype=torch.float32, device="cpu", gate="normal", N=None,
                initial_state=False, requires_grad=False):
    """Fresh random inputs in fla's conventions: l2-normalised k, g = logsigmoid(·) ≤ 0, beta = sigmoid(·)."""
    HV = HV or H
    q = torch.randn(B, T, H, K, device=device)
    k = F.normalize(torch.randn(B, T, H, K, device=device, dtype=torch.float64), p=2, dim=-1)
    v = torch.randn(B, T, HV, V, device=device)
    if gate == "normal":
        g = F.logsigmoid(torch.randn(B, T, HV, device=device))
    elif gate == "near_zero":
        g = -1e-3 * torch.rand(B, T, HV, device=device)
    else:  # strongly negative: the state forgets almost everything each step
        g = -8.0 - 4.0 * torch.rand(B, T, HV, device=device)
    beta = torch.rand(B, T, HV, device=device).sigmoid()
    h0 = torch.randn(N or B, HV, K, V, device=device) if initial_state else None
    tensors = [q, k, v, g, beta]
    tensors = [t.to(dtype) for t in tensors]
    if h0 is not None:
        h0 = h0.to(torch.float64 if dtype == torch.float64 else torch.float32)
    if requires_grad:
        for t in tensors:
            t.requires_grad_(True)
        if h0 is not None:
            h0.requires_grad_(True)
    return (*tensors, h0)


def loop_reference(q, k, v, g, beta, scale, h0):
    """An independent float64 loop, one head and one token at a time, with the Householder matrix written out."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    finals = torch.zeros(B, HV, K, V, dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    for b in range(B):
        for hv in range(HV):
            h = hv // (HV // H)
            S = h0[b, hv].double() if h0 is not None else torch.zeros(K, V, dtype=torch.float64)
            for t in range(T):
                kt, qt = k[b, t, h].double(), q[b, t, h].double()
                bt, at = beta[b, t, hv].double(), g[b, t, hv].double().exp()
                S = at * (eye - bt * torch.outer(kt, kt)) @ S + bt * torch.outer(kt, v[b, t, hv].double())
                o[b, t, hv] = S.T @ (scale * qt)
            finals[b, hv] = S
    return o, finals


# ---------------------------------------------------------------------------------------------------------------
# 1. The naive reference
# ---------------------------------------------------------------------------------------------------------------

NAIVE_SHAPES = [(2, 7, 1, 1, 4, 4), (1, 5, 2, 4, 3, 5), (2, 1, 1, 2, 4, 2)]


@pytest.mark.parametrize("B,T,H,HV,K,V", NAIVE_SHAPES,
                         ids=[case_id(B=B, T=T, H=H, HV=HV, K=K, V=V) for B, T, H, HV, K, V in NAIVE_SHAPES])
@pytest.mark.parametrize("gate", ["normal", "near_zero", "strong"])
def test_naive_matches_float64_loop(B, T, H, HV, K, V, gate):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, HV=HV, dtype=torch.float64, gate=gate, initial_state=True)
    o, ht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.7, initial_state=h0,
                                             output_final_state=True)
    o_ref, ht_ref = loop_reference(q, k, v, g, beta, 0.7, h0)
    assert_rel_close(o, o_ref, threshold=1e-12, name="o")
    assert_rel_close(ht, ht_ref, threshold=1e-12, name="final_state")


def test_naive_fp32_matches_float64_loop():
    q, k, v, g, beta, h0 = make_inputs(2, 20, 2, 8, 6, HV=4, initial_state=True)
    o, ht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = loop_reference(q, k, v, g, beta, 8 ** -0.5, h0)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    assert_rel_close(o, o_ref, threshold=1e-5, name="o")
    assert_rel_close(ht, ht_ref, threshold=1e-5, name="final_state")


def test_naive_closed_forms():
    q, k, v, g, beta, h0 = make_inputs(1, 6, 1, 4, 3, dtype=torch.float64, initial_state=True)
    # g = 0, beta = 0: the state never changes and o_t = h0ᵀ (scale q_t).
    o, ht = naive_recurrent_gated_delta_rule(q, k, v, torch.zeros_like(g), torch.zeros_like(beta), scale=1.0,
                                             initial_state=h0, output_final_state=True)
    assert_rel_close(ht, h0, threshold=1e-14, name="unchanged state")
    assert_rel_close(o, torch.einsum("kv,btk->btv", h0[0, 0], q[:, :, 0])[:, :, None], threshold=1e-14, name="o")
    # Full forgetting (α = 0), beta = 1: S_t = k_t v_tᵀ, so o_t = (k_t · q_t) v_t.
    o, ht = naive_recurrent_gated_delta_rule(q, k, v, torch.full_like(g, -torch.inf), torch.ones_like(beta),
                                             scale=1.0, initial_state=h0, output_final_state=True)
    assert_rel_close(o, (k * q).sum(-1, keepdim=True) * v, threshold=1e-14, name="o (alpha=0)")
    assert_rel_close(ht[0, 0], torch.outer(k[0, -1, 0], v[0, -1, 0]), threshold=1e-14, name="state (alpha=0)")
    # beta = 1 with a unit key replaces the value stored along k exactly: Sᵀ k = v afterwards (g = 0).
    _, ht = naive_recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], torch.zeros_like(g[:, :1]),
                                             torch.ones_like(beta[:, :1]), initial_state=h0, output_final_state=True)
    assert_rel_close(ht[0, 0].T @ k[0, 0, 0], v[0, 0, 0], threshold=1e-12, name="delta rule write")


def test_naive_varlen_is_per_sequence_and_l2norm():
    lengths = [3, 1, 5]
    T = sum(lengths)
    q, k, v, g, beta, h0 = make_inputs(1, T, 1, 4, 3, HV=2, dtype=torch.float64, N=3, initial_state=True)
    k = k * 3.0  # l2norm must undo this scaling
    cu = torch.tensor([0, 3, 4, 9])
    o, ht = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                             cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    # fla's in-kernel l2norm: x / sqrt(Σx² + 1e-6).
    qn, kn = (x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for x in (q, k))
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_ref, ht_ref = loop_reference(qn[:, s:e], kn[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], 0.5,
                                       h0[n:n + 1])
        assert_rel_close(o[:, s:e], o_ref, threshold=1e-10, name=f"o seq{n}")
        assert_rel_close(ht[n:n + 1], ht_ref, threshold=1e-10, name=f"state seq{n}")


def test_inputs_are_validated_with_the_argument_name():
    q, k, v, g, beta, _ = make_inputs(1, 4, 2, 4, 4, HV=2)
    with pytest.raises(ValueError, match="HV=3"):
        naive_recurrent_gated_delta_rule(q, k, v[:, :, :1].expand(-1, -1, 3, -1), g, beta)
    with pytest.raises(ValueError, match="beta"):
        naive_recurrent_gated_delta_rule(q, k, v, g, beta[:, :3])
    with pytest.raises(ValueError, match="initial_state"):
        naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 4, 4))
    with pytest.raises(ValueError, match="cu_seqlens"):
        naive_recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 2, 3]))


# ---------------------------------------------------------------------------------------------------------------
# Shared case lists for the kernels (tiny head dims on the CPU interpreter)
# ---------------------------------------------------------------------------------------------------------------

# (B, T, H, HV, K, V): T around the chunk size 64, GVA (HV > H), K != V.
CPU_CASES = [
    (2, 1, 2, 2, 32, 32),
    (1, 63, 1, 2, 16, 32),
    (2, 64, 2, 2, 32, 16),
    (1, 65, 2, 4, 16, 16),
    (1, 200, 1, 1, 32, 32),
]
CPU_IDS = [case_id(B=b, T=t, H=h, HV=hv, K=k, V=v) for b, t, h, hv, k, v in CPU_CASES]
# The same cases, each with a gate regime (normal logsigmoid, near 0, strongly negative), for the forward tests.
GATED_CASES = [(*case, gate) for case, gate in zip(CPU_CASES, ["normal", "strong", "near_zero", "normal", "strong"])]
GATED_IDS = [f"{i}-{gate}" for i, (*_, gate) in zip(CPU_IDS, GATED_CASES)]
VARLEN = [15, 64, 30, 1]


def reference(q, k, v, g, beta, h0, cu_seqlens=None, l2norm=False, scale=None):
    """The naive recurrence in float64 on the inputs' device."""
    to64 = lambda t: None if t is None else t.detach().double()  # noqa: E731
    return naive_recurrent_gated_delta_rule(
        to64(q), to64(k), to64(v), to64(g), to64(beta), scale=scale, initial_state=to64(h0),
        output_final_state=True, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=l2norm)


# ---------------------------------------------------------------------------------------------------------------
# 2. The fused-recurrent kernel (forward)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["fused_recurrent", "chunk"])
@pytest.mark.parametrize("B,T,H,HV,K,V,gate", GATED_CASES, ids=GATED_IDS)
def test_forward_matches_naive(B, T, H, HV, K, V, gate, impl, device, poison_allocations):
    """The fused-recurrent (section 2) and chunked (section 3b) forwards against the naive recurrence."""
    fn = fused_recurrent_gated_delta_rule if impl == "fused_recurrent" else chunk_gated_delta_rule
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, HV=HV, gate=gate, device=device, initial_state=True)
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = reference(q, k, v, g, beta, h0)
    assert_rel_close(o, o_ref, threshold=1e-5, name="o")
    assert_rel_close(ht, ht_ref, threshold=1e-5, name="final_state")


@pytest.mark.parametrize("impl", ["fused_recurrent", "chunk"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_inputs_keep_fp32_states(impl, dtype, device):
    """bf16 / fp16 inputs: o comes back in v's dtype, the final state in fp32 (from an fp32 initial state), both
    against the float64 recurrence on the same rounded inputs."""
    fn = fused_recurrent_gated_delta_rule if impl == "fused_recurrent" else chunk_gated_delta_rule
    q, k, v, g, beta, h0 = make_inputs(2, 70, 2, 16, 32, HV=4, dtype=dtype, device=device, initial_state=True)
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert (o.dtype, ht.dtype, o.shape, ht.shape) == (dtype, torch.float32, v.shape, h0.shape)
    o_ref, ht_ref = reference(q, k, v, g, beta, h0)
    assert_rel_close(o, o_ref, threshold=5e-3, name="o")
    # the fused-recurrent state stays fp32 in registers; the chunked one passes bf16 dot operands / tf32 (fp16)
    assert_rel_close(ht, ht_ref, threshold=1e-5 if impl == "fused_recurrent" else 5e-3, name="final_state")


@pytest.mark.parametrize("l2norm", [False, True], ids=["l2norm-off", "l2norm-on"])
def test_fused_recurrent_varlen_l2norm_no_initial_state(l2norm, device):
    T = sum(VARLEN)
    cu = torch.tensor([0, *torch.tensor(VARLEN).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k, v, g, beta, _ = make_inputs(1, T, 2, 16, 32, HV=4, device=device)
    k = k * 2.5
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                             use_qk_l2norm_in_kernel=l2norm)
    o_ref, ht_ref = reference(q, k, v, g, beta, None, cu_seqlens=cu, l2norm=l2norm)
    assert_rel_close(o, o_ref, threshold=1e-5, name="o")
    assert_rel_close(ht, ht_ref, threshold=1e-5, name="final_state")


def test_fused_recurrent_decode_step_continues_the_sequence(device):
    """Prefill T tokens, then decode one token from the returned state: equals running T+1 tokens at once."""
    q, k, v, g, beta, h0 = make_inputs(3, 9, 2, 16, 16, HV=4, device=device, initial_state=True)
    o_all, ht_all = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    _, ht = fused_recurrent_gated_delta_rule(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8],
                                             initial_state=h0, output_final_state=True)
    o_step, ht_step = fused_recurrent_gated_delta_rule(q[:, 8:], k[:, 8:], v[:, 8:], g[:, 8:], beta[:, 8:],
                                                       initial_state=ht, output_final_state=True)
    assert_rel_close(o_step, o_all[:, 8:], threshold=1e-6, name="o")
    assert_rel_close(ht_step, ht_all, threshold=1e-6, name="final_state")


# ---------------------------------------------------------------------------------------------------------------
# 3. The chunked kernels: the shared pieces (ops/common), then the whole forward
# ---------------------------------------------------------------------------------------------------------------

def test_common_cumsum_and_wy_match_torch(device):
    """Chunk-local cumsum and the UT transform T = (I + A)⁻¹ against torch, chunk by chunk (varlen)."""
    from rltrain_kernels.ops.common.chunking import chunk_layout
    from rltrain_kernels.ops.common.cumsum import chunk_local_cumsum
    from rltrain_kernels.ops.common.wy import gated_wy_fwd

    lengths, K, HV = [70, 5, 64], 16, 2
    cu = torch.tensor([0, 70, 75, 139], device=device)
    layout = chunk_layout(1, sum(lengths), cu, 64, device)
    k = F.normalize(torch.randn(sum(lengths), 1, K, device=device), dim=-1) * 1.5  # |β k kᵀ| up to ~2
    g = F.logsigmoid(torch.randn(sum(lengths), HV, device=device))
    beta = torch.rand(sum(lengths), HV, device=device)
    G = chunk_local_cumsum(g, layout)
    Ai = gated_wy_fwd(k, beta, G, layout, dot_prec="ieee")  # fp32 inputs' DOT_PREC
    G_reverse = chunk_local_cumsum(g, layout, reverse=True)
    for s, e in [(0, 64), (64, 70), (70, 75), (75, 139)]:
        n = e - s
        G_ref = g[s:e].double().cumsum(0)
        assert_rel_close(G[s:e], G_ref, threshold=1e-6, name=f"G[{s}:{e}]")
        assert_rel_close(G_reverse[s:e], g[s:e].double().flip(0).cumsum(0).flip(0), threshold=1e-6, name="reverse")
        for hv in range(HV):
            kk, bb, gg = k[s:e, 0].double(), beta[s:e, hv].double(), G_ref[:, hv]
            A = (bb[:, None] * (kk @ kk.T) * (gg[:, None] - gg[None, :]).exp()).tril(-1)
            T = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + A.cpu()).to(A.device)
            assert_rel_close(Ai[s:e, hv, :n], T, threshold=1e-6, name=f"T[{s}:{e}]")



@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_common_state_pass_matches_torch(gated, device):
    """S ← γ_last S + (diag(e^{G_last − G}) K)ᵀ (u − w S) per chunk, with G=None meaning no gate (IPLR-style), the pass
    forming δ = T diag(β)(V − diag(γ) K S) from T, v and β (u = T diag(β) V and w = T diag(βγ) K in the reference)."""
    from rltrain_kernels.ops.common.chunking import chunk_layout
    from rltrain_kernels.ops.common.state_pass import state_pass_fwd

    T, K, V = 100, 16, 32
    chunks = [(0, 64), (64, 100)]
    layout = chunk_layout(1, T, None, 64, device)
    k, w = torch.randn(T, 1, K, device=device) * 0.3, torch.empty(T, 1, K, device=device)
    u = torch.empty(T, 1, V, device=device)
    G = torch.cat([F.logsigmoid(torch.randn(n, 1, device=device)).cumsum(0) for n in (64, 36)]) if gated else None
    h0 = torch.randn(1, 1, K, V, device=device)
    v, beta = torch.randn(T, 1, V, device=device), torch.rand(T, 1, device=device)
    Ai = torch.zeros(T, 1, 64, device=device)
    for s, e in chunks:
        Ai[s:e, 0, :e - s] = (torch.eye(e - s, device=device)
                              + 0.2 * torch.randn(e - s, e - s, device=device).tril(-1))
        Tc = Ai[s:e, 0, :e - s].double()
        gamma = G[s:e, 0].double().exp() if gated else 1.0
        u[s:e, 0] = (Tc @ (v[s:e, 0].double() * beta[s:e].double())).float()
        w[s:e, 0] = (Tc @ (k[s:e, 0].double() * (beta[s:e, 0].double() * gamma)[:, None])).float()
    h, v_new, ht = state_pass_fwd(k, v, beta, Ai, G, h0, True, layout, dot_prec="ieee")  # fp32 inputs' DOT_PREC
    S = h0[0, 0].double()
    for i, (s, e) in enumerate(chunks):
        assert_rel_close(h[i, 0], S, threshold=1e-6, name=f"h[{i}]")
        delta = u[s:e, 0].double() - w[s:e, 0].double() @ S
        assert_rel_close(v_new[s:e, 0], delta, threshold=1e-5, name="v_new")
        if gated:
            decay, total = (G[e - 1, 0] - G[s:e, 0]).exp().double(), G[e - 1, 0].exp().double()
        else:
            decay, total = torch.ones(e - s, dtype=torch.float64, device=device), 1.0
        S = total * S + (k[s:e, 0].double() * decay[:, None]).T @ delta
    assert_rel_close(ht[0, 0], S, threshold=1e-5, name="final state")

# ---------------------------------------------------------------------------------------------------------------
# 3b. The chunked forward
# ---------------------------------------------------------------------------------------------------------------

# (covered by test_forward_matches_naive[chunk] above)


def test_chunk_forward_without_states_and_custom_scale(device):
    q, k, v, g, beta, _ = make_inputs(2, 70, 2, 16, 16, device=device)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3)
    assert ht is None
    assert_rel_close(o, reference(q, k, v, g, beta, None, scale=0.3)[0], threshold=1e-5, name="o")


# ---------------------------------------------------------------------------------------------------------------
# 4. Gradients (chunked backward; the fused-recurrent path delegates to it) vs autograd through naive in float64
# ---------------------------------------------------------------------------------------------------------------

GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def check_gradients(fn, q, k, v, g, beta, h0, *, cu_seqlens=None, l2norm=False, threshold, dg_threshold=None,
                    dtype=None):
    """Run fn and the float64 naive reference with the same random upstream gradients for o and the final state
    (non-contiguous do, to check any upstream layout is accepted); compare o, final state and every gradient."""
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens,
               use_qk_l2norm_in_kernel=l2norm)
    do = torch.randn(o.shape[::-1], device=o.device).to(o.dtype).permute(3, 2, 1, 0)
    dht = torch.randn_like(ht)
    (o.float() * do.float()).sum().add((ht * dht).sum()).backward()
    inputs = [q, k, v, g, beta, h0]
    ref_inputs = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    o_ref, ht_ref = naive_recurrent_gated_delta_rule(
        *ref_inputs[:5], initial_state=ref_inputs[5], output_final_state=True,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=l2norm)
    (o_ref * do.double()).sum().add((ht_ref * dht.double()).sum()).backward()
    assert_rel_close(o, o_ref, threshold=threshold[0], name="o")
    assert_rel_close(ht, ht_ref, threshold=threshold[0], name="final_state")
    for name, t, r in zip(GRAD_NAMES, inputs, ref_inputs):
        if t is None:
            continue
        limit = dg_threshold if (name == "g" and dg_threshold is not None) else threshold[1]
        assert t.grad is not None, f"no gradient for {name}"
        assert t.grad.dtype == t.dtype, f"d{name} dtype {t.grad.dtype} != {t.dtype}"
        assert_rel_close(t.grad, r.grad, threshold=limit, name=f"d{name}")


@pytest.mark.parametrize("B,T,H,HV,K,V", CPU_CASES, ids=CPU_IDS)
def test_chunk_gradients_match_naive_float64(B, T, H, HV, K, V, device, poison_allocations):
    inputs = make_inputs(B, T, H, K, V, HV=HV, device=device, initial_state=True, requires_grad=True)
    check_gradients(chunk_gated_delta_rule, *inputs, threshold=(1e-5, 2e-5))


PACKED_LENGTHS = [70, 15, 64]  # varlen with a partial chunk


def packed_case(V: int, dtype, device):
    """(inputs, cu_seqlens) for the launch tests: PACKED_LENGTHS, GVA (H=1, HV=2), K=32 != V."""
    cu = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    inputs = make_inputs(1, sum(PACKED_LENGTHS), 1, 32, V, HV=2, dtype=dtype, device=device,
                         N=len(PACKED_LENGTHS), initial_state=True, requires_grad=True)
    return inputs, cu


def launch_cases(dtype, device):
    """(V, inputs, cu_seqlens) of packed_case for the launch tests: V = 16 (the narrow state passes) and 64
    (wide on the interpreter), and at V = 64 once more with g = 0 (no decay; the op still takes the gated kernels)."""
    for V, gate in ((16, "normal"), (64, "normal"), (64, "none")):
        inputs, cu = packed_case(V, dtype, device)
        if gate == "none":
            inputs[3].data.zero_()
        yield V, inputs, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunk_gradients_in_both_state_pass_launches(dtype, device, monkeypatch):
    """The state passes' narrow launch (V = 16), where local_dv_kernel forms the chunk-local Pᵀ dO first, and wide one
    (V = 64 on the interpreter), where the reverse pass forms it itself; the backward reuses the forward's T and
    launches no WY kernel. Gradients against float64: varlen with a partial chunk, GVA, K != V, with and without the
    gate's decay."""
    from rltrain_kernels.ops.common import state_pass, wy

    launches = []
    spy_launches(monkeypatch, state_pass, "local_dv_kernel", lambda args, kwargs: launches.append("local_dv"))
    spy_launches(monkeypatch, wy, "gated_wy_fwd_kernel", lambda args, kwargs: launches.append("wy"))
    for V, inputs, cu in launch_cases(dtype, device):
        wide = state_pass.state_launch("state_pass_bwd", len(PACKED_LENGTHS) * 2, 32, V, torch.device(device))[0]
        wide = wide.endswith("_wide")
        if device == "cpu":  # the interpreter counts one SM: both launches are reached here
            assert wide == (V == 64)
        # bf16: dg is the remainder of per-chunk terms that cancel (README), so its error reaches 1e-2 for some seeds
        check_gradients(chunk_gated_delta_rule, *inputs, cu_seqlens=cu,
                        threshold=(1e-5, 2e-5) if dtype == torch.float32 else (5e-3, 1e-2),
                        dg_threshold=None if dtype == torch.float32 else 2e-2)
        assert launches == (["wy"] if wide else ["wy", "local_dv"]), launches  # the forward's solve only
        launches.clear()


@pytest.mark.parametrize("gate", ["near_zero", "strong"])
def test_chunk_gradients_extreme_gates(gate, device):
    inputs = make_inputs(2, 100, 1, 16, 16, HV=2, gate=gate, device=device, initial_state=True, requires_grad=True)
    # With strong gates the true dg is ~1e-3 of the O(1) per-chunk terms that cancel to form it (‖dg‖ ≈ 2e-3 vs
    # ‖dv‖ ≈ 8), so fp32 roundoff of those terms sets a ~1e-3 relative floor on dg; every other gradient stays tight.
    check_gradients(chunk_gated_delta_rule, *inputs, threshold=(1e-5, 2e-5),
                    dg_threshold=1e-2 if gate == "strong" else None)


@pytest.mark.parametrize("l2norm", [False, True], ids=["l2norm-off", "l2norm-on"])
def test_chunk_varlen_gradients(l2norm, device, poison_allocations):
    T = sum(VARLEN)
    cu = torch.tensor([0, *torch.tensor(VARLEN).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k, v, g, beta, h0 = make_inputs(1, T, 1, 16, 32, HV=2, device=device, N=len(VARLEN), initial_state=True)
    k = (k * 2.0).requires_grad_()
    for t in (q, v, g, beta, h0):
        t.requires_grad_()
    check_gradients(chunk_gated_delta_rule, q, k, v, g, beta, h0, cu_seqlens=cu, l2norm=l2norm,
                    threshold=(1e-5, 2e-5))


def test_chunk_gradients_without_initial_state(device):
    q, k, v, g, beta, _ = make_inputs(1, 40, 2, 16, 16, device=device, requires_grad=True)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    o.sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, g, beta)]
    naive_recurrent_gated_delta_rule(*ref)[0].sum().backward()
    for name, t, r in zip(GRAD_NAMES, (q, k, v, g, beta), ref):
        assert_rel_close(t.grad, r.grad, threshold=2e-5, name=f"d{name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunk_low_precision_inputs(dtype, device):
    # bf16 dots and bf16 chunk states (common/precision.py), rounded to nearest on the interpreter as on the GPU.
    inputs = make_inputs(1, 80, 1, 16, 16, HV=2, dtype=dtype, device=device, initial_state=True,
                         requires_grad=True)
    check_gradients(chunk_gated_delta_rule, *inputs, threshold=(5e-3, 1e-2))


def test_chunk_tf32_dots(device):
    """dot="tf32", the other dot precision of ops/common/precision.py for bf16 inputs (the benchmark's --precision
    sweep times it; the default is bf16 dots), stays within the issue's bf16 bar, the chunk states stored bf16 either
    way (test_delta_rule_common checks that it reaches every launch)."""
    from rltrain_kernels.ops.common.chunking import chunk_layout
    from rltrain_kernels.ops.common.cumsum import chunk_local_cumsum
    from rltrain_kernels.ops.common.precision import op_dot_precision
    from rltrain_kernels.ops.common.state_pass import chunk_states_fwd

    inputs = make_inputs(1, 80, 1, 16, 16, HV=2, dtype=torch.bfloat16, device=device, initial_state=True,
                         requires_grad=True)
    check_gradients(functools.partial(chunk_gated_delta_rule, dot="tf32"), *inputs, threshold=(5e-3, 1e-2))
    _, k, v, g, beta, h0 = (t.detach() for t in inputs)
    layout = chunk_layout(1, 80, None, 64, k.device)
    G = chunk_local_cumsum(g.flatten(0, 1).contiguous(), layout)
    flat = [t.flatten(0, 1).contiguous() for t in (k, v, beta)]
    _, h, v_new, _ = chunk_states_fwd(*flat, G, h0, False, layout,
                                      dot_prec=op_dot_precision(torch.bfloat16, "tf32"))
    assert h.dtype == v_new.dtype == torch.bfloat16


def test_fused_recurrent_gradients_via_chunk_backward(device):
    inputs = make_inputs(1, 30, 1, 16, 16, HV=2, device=device, initial_state=True, requires_grad=True)
    check_gradients(fused_recurrent_gated_delta_rule, *inputs, l2norm=True, threshold=(1e-5, 2e-5))


# ---------------------------------------------------------------------------------------------------------------
# 5. Call-site compatibility with transformers' Qwen3-Next (the registry adapter itself lives with the registry)
# ---------------------------------------------------------------------------------------------------------------

def test_qwen3_next_logits_gradients_and_generate(device):
    """The registry's gated_delta_rule kernel in a tiny Qwen3-Next: logits and every gradient match
    transformers' float64 torch path, and greedy generation (decode steps on the fused-recurrent kernel) agrees."""
    import rltrain_kernels.ops.gated_delta_rule as gdr
    from rltrain_kernels.registry import apply_kernel, get_applied_kernels

    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)
    config._experts_implementation = "eager"  # the grouped-mm experts refuse float64
    model = modeling.Qwen3NextForCausalLM(config).to(device)
    with torch.no_grad():  # moderate decays (α ≈ 0.5-0.9): with init's up-to-16× rates dg is all cancellation
        model.model.layers[0].linear_attn.A_log.uniform_(-2.5, -0.5)
    reference_model = copy.deepcopy(model).double()  # transformers' torch path in float64: the ground truth
    ids = torch.randint(0, config.vocab_size, (2, 16), device=device)

    def logits_and_grads(m):
        m.zero_grad()
        logits = m(ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    ref_logits, ref_grads = logits_and_grads(reference_model)
    ref_tokens = model.generate(ids[:, :6], max_new_tokens=4, do_sample=False)  # fp32 torch path
    apply_kernel("gated_delta_rule", model, device="cuda")
    assert get_applied_kernels(model) == {"gated_delta_rule": 1}  # the one linear-attention layer
    calls = []
    with pytest.MonkeyPatch.context() as mp:  # record which kernel each call reaches (adapters import at call time)
        for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
            real = getattr(gdr, name)
            mp.setattr(gdr, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
        logits, grads = logits_and_grads(model)
        tokens = model.generate(ids[:, :6], max_new_tokens=4, do_sample=False)
    assert_rel_close(logits, ref_logits, threshold=1e-5, name="logits")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_rel_close(grad, ref_grads[name], threshold=1e-4, name=f"grad {name}")
    assert torch.equal(tokens, ref_tokens)
    assert calls.count("fused_recurrent_gated_delta_rule") >= 3 and "chunk_gated_delta_rule" in calls, calls

# ---------------------------------------------------------------------------------------------------------------
# Real sizes on the GPU, bf16 (the thresholds: 5e-3 outputs, 1e-2 gradients vs float64)
# ---------------------------------------------------------------------------------------------------------------

GPU_CASES = [(2, 1000, 8, 8, 128, 128), (1, 2048, 4, 8, 64, 64), (2, 1100, 2, 4, 128, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,HV,K,V", GPU_CASES, ids=[case_id(B=b, T=t, H=h, HV=hv, K=k, V=v)
                                                         for b, t, h, hv, k, v in GPU_CASES])
@pytest.mark.parametrize("l2norm", [False, True], ids=["l2norm-off", "l2norm-on"])
def test_chunk_bf16_real_sizes(B, T, H, HV, K, V, l2norm, device):
    inputs = make_inputs(B, T, H, K, V, HV=HV, dtype=torch.bfloat16, device=device, initial_state=True,
                         requires_grad=True)
    check_gradients(chunk_gated_delta_rule, *inputs, l2norm=l2norm, threshold=(5e-3, 1e-2))


@pytest.mark.gpu
@pytest.mark.parametrize("value_block", ["wide", "narrow"])
def test_chunk_bf16_reruns_are_bit_identical(value_block, device):
    """The state passes' wide and narrow launches (tests/helpers.py: state_pass_batch) at a real K = V =
    128 on the GPU: within the bars, and the same gradients on a rerun (for the scratch tile of common/scratch.py: a barrier that fails to order its store before the transposed load would show
    as a moving result)."""
    inputs = make_inputs(state_pass_batch(value_block, 8, 128, device), 1000, 4, 128, 128, HV=8, dtype=torch.bfloat16, device=device, initial_state=True,
                         requires_grad=True)
    grads = []
    for _ in range(2):  # the same upstream gradients twice: no atomics anywhere, so bit-identical results
        torch.manual_seed(1)
        check_gradients(chunk_gated_delta_rule, *inputs, threshold=(5e-3, 1e-2))
        grads.append([t.grad.clone() for t in inputs])
        for t in inputs:
            t.grad = None
    for name, a, b in zip(GRAD_NAMES, *grads):
        assert torch.equal(a, b), f"d{name} changed between two identical runs"


@pytest.mark.gpu
def test_chunk_bf16_varlen_real_sizes(device):
    lengths = [15, 256, 500, 1]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    inputs = make_inputs(1, sum(lengths), 4, 128, 128, HV=8, dtype=torch.bfloat16, device=device,
                         N=len(lengths), initial_state=True, requires_grad=True)
    check_gradients(chunk_gated_delta_rule, *inputs, cu_seqlens=cu, threshold=(5e-3, 1e-2))


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["near_zero", "strong"])
def test_chunk_bf16_extreme_gates(gate, device):
    inputs = make_inputs(2, 1000, 4, 128, 128, HV=4, dtype=torch.bfloat16, gate=gate, device=device,
                         initial_state=True, requires_grad=True)
    # Strong gates: see test_chunk_gradients_extreme_gates for why dg's relative floor is higher.
    check_gradients(chunk_gated_delta_rule, *inputs, threshold=(5e-3, 1e-2),
                    dg_threshold=5e-2 if gate == "strong" else None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_fused_recurrent_decode_real_size(dtype, device):
    q, k, v, g, beta, h0 = make_inputs(64, 1, 16, 128, 128, dtype=dtype, device=device, initial_state=True)
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert (o.dtype, ht.dtype) == (dtype, torch.float32)
    o_ref, ht_ref = reference(q, k, v, g, beta, h0)
    assert_rel_close(o, o_ref, threshold=1e-5 if dtype == torch.float32 else 5e-3, name="o")
    assert_rel_close(ht, ht_ref, threshold=1e-5, name="final_state")
    q, k, v, g, beta, h0 = make_inputs(2, 300, 4, 128, 128, HV=8, dtype=dtype, device=device, initial_state=True)
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = reference(q, k, v, g, beta, h0)
    assert_rel_close(o, o_ref, threshold=1e-5 if dtype == torch.float32 else 5e-3, name="o (T=300)")
    assert_rel_close(ht, ht_ref, threshold=1e-4, name="final_state (T=300)")
