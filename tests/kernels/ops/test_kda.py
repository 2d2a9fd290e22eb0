"""Kimi Delta Attention: the naive reference against an independent float64 loop, closed forms and the gated delta
rule (a decay equal across key channels is Gated DeltaNet), then the chunked and fused-recurrent Triton kernels
(interpreted on CPU, native on GPU) against the naive reference: outputs, final states and the gradient of every
input (A_log and dt_bias with the in-kernel gate), varlen, GVA, chunk sizes, strong decays, fla's keywords.

Run: `pytest tests/kernels/ops/test_kda.py` (CPU, ~1 min through the Triton interpreter).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rltrain_kernels.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
from rltrain_kernels.ops.kda import chunk_kda, fused_recurrent_kda, naive_kda_gate, naive_recurrent_kda
from tests.helpers import assert_decay_grad_close, assert_rel_close, case_id


def make_inputs(B, T, H, K, V, HV=None, N=None, gate="normal", raw_gate=False, dtype=torch.float32, device="cpu",
                state_v_first=False, requires_grad=False):
    """Fresh random inputs in fla's conventions: l2-normalised k, g ≤ 0 per key channel (or the raw a with A_log
    [HV] and dt_bias [HV·K] when raw_gate), beta = sigmoid(·). Returns (q, k, v, g, beta, h0, gate params)."""
    HV = HV or H
    q = torch.randn(B, T, H, K, device=device)
    k = F.normalize(torch.randn(B, T, H, K, device=device), p=2, dim=-1)
    v = torch.randn(B, T, HV, V, device=device)
    if raw_gate:
        g = torch.randn(B, T, HV, K, device=device)
    elif gate == "normal":
        g = F.logsigmoid(torch.randn(B, T, HV, K, device=device))
    elif gate == "mixed":  # channels that forget fast beside channels that barely decay
        fast = torch.rand(B, T, HV, K, device=device) < 0.5
        g = torch.where(fast, -10 * torch.rand(B, T, HV, K, device=device), -1e-3 * torch.rand(B, T, HV, K,
                                                                                                device=device))
    else:  # strong: e^{G} spans far beyond fp32's range within one chunk
        g = -8.0 - 4.0 * torch.rand(B, T, HV, K, device=device)
    beta = torch.rand(B, T, HV, device=device).sigmoid()
    h0 = torch.randn(N or B, HV, *((V, K) if state_v_first else (K, V)), device=device)
    params = [torch.randn(HV, device=device), torch.randn(HV * K, device=device)] if raw_gate else []
    tensors = [t.to(dtype) for t in (q, k, v, g, beta)] + [h0.to(torch.float64 if dtype == torch.float64 else
                                                                 torch.float32)] + params
    for t in tensors if requires_grad else ():
        t.requires_grad_(True)
    return tensors


def loop_reference(q, k, v, g, beta, scale, h0):
    """An independent float64 loop, one head and one token at a time, with the transition written out as matrices:
    S_t = (I − β k kᵀ) Diag(e^{g_t}) S_{t−1} + β k vᵀ."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    finals = torch.zeros(B, HV, K, V, dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    for b in range(B):
        for hv in range(HV):
            h = hv // (HV // H)
            S = h0[b, hv].double()
            for t in range(T):
                kt, bt = k[b, t, h].double(), beta[b, t, hv].double()
                S = (eye - bt * torch.outer(kt, kt)) @ torch.diag(g[b, t, hv].double().exp()) @ S \
                    + bt * torch.outer(kt, v[b, t, hv].double())
                o[b, t, hv] = S.T @ (scale * q[b, t, h].double())
            finals[b, hv] = S
    return o, finals


def reference(tensors, keywords):
    """The naive recurrence in float64 on detached copies with gradients: (o, final state, leaves)."""
    leaves = [t.detach().double().requires_grad_(True) for t in tensors]
    q, k, v, g, beta, h0, *params = leaves
    gate = dict(zip(("A_log", "dt_bias"), params))
    o, ht = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, **gate, **keywords)
    return o, ht, leaves


# ---------------------------------------------------------------------------------------------------------------
# 1. The naive reference
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("B,T,H,HV,K,V", [(2, 7, 1, 1, 4, 4), (1, 5, 2, 4, 3, 5)],
                         ids=[case_id(B=2, T=7, H=1, HV=1, K=4, V=4), case_id(B=1, T=5, H=2, HV=4, K=3, V=5)])
@pytest.mark.parametrize("gate", ["normal", "mixed", "strong"])
def test_naive_matches_float64_loop(B, T, H, HV, K, V, gate):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, HV=HV, gate=gate, dtype=torch.float64)
    o, ht = naive_recurrent_kda(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = loop_reference(q, k, v, g, beta, 0.7, h0)
    assert_rel_close(o, o_ref, threshold=1e-12, name="o")
    assert_rel_close(ht, ht_ref, threshold=1e-12, name="final_state")


def test_naive_closed_forms_and_the_gated_delta_rule():
    q, k, v, g, beta, h0 = make_inputs(1, 6, 2, 4, 3, HV=2, dtype=torch.float64)
    # beta = 0: no writes, each key channel's row of the state decays by its own gates: S = Diag(e^{Σ g}) S0.
    _, ht = naive_recurrent_kda(q, k, v, g, torch.zeros_like(beta), initial_state=h0, output_final_state=True)
    assert_rel_close(ht, h0 * g.sum(1)[0].exp()[..., None], threshold=1e-13, name="decay only")
    # A decay equal across the key channels is the gated delta rule's scalar decay.
    g_head = g[..., 0]
    o, ht = naive_recurrent_kda(q, k, v, g_head[..., None].expand_as(g), beta, initial_state=h0,
                                output_final_state=True)
    o_ref, ht_ref = naive_recurrent_gated_delta_rule(q, k, v, g_head, beta, initial_state=h0, output_final_state=True)
    assert_rel_close(o, o_ref, threshold=1e-13, name="o (scalar decay)")
    assert_rel_close(ht, ht_ref, threshold=1e-13, name="final_state (scalar decay)")


def test_naive_gate_and_keywords():
    q, k, v, a, beta, h0, A_log, dt_bias = make_inputs(1, 5, 1, 4, 3, HV=2, raw_gate=True, dtype=torch.float64)
    A_log, dt_bias = A_log.double(), dt_bias.double()
    g = naive_kda_gate(a, A_log, dt_bias)
    expected = -A_log.exp()[:, None] * torch.log1p((a + dt_bias.view(2, 4)).exp())  # fla's fused_kda_gate
    assert_rel_close(g, expected, threshold=1e-13, name="gate")
    o, ht = naive_recurrent_kda(q, k, v, a, beta, initial_state=h0.transpose(-1, -2), output_final_state=True,
                                use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                                allow_neg_eigval=True, use_qk_l2norm_in_kernel=True, state_v_first=True)
    qn, kn = (x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for x in (q, k))
    o_ref, ht_ref = loop_reference(qn, kn, v, g, 2 * beta.sigmoid(), 4 ** -0.5, h0)
    assert_rel_close(o, o_ref, threshold=1e-12, name="o")
    assert_rel_close(ht, ht_ref.transpose(-1, -2), threshold=1e-12, name="final_state (state_v_first)")


def test_inputs_are_validated_with_the_argument_name():
    q, k, v, g, beta, _ = make_inputs(1, 4, 2, 4, 4, HV=2)
    for fn in (naive_recurrent_kda, chunk_kda, fused_recurrent_kda):
        with pytest.raises(ValueError, match="g must be"):
            fn(q, k, v, g[..., 0], beta)
        with pytest.raises(ValueError, match="beta"):
            fn(q, k, v, g, beta[:, :3])
        with pytest.raises(ValueError, match="initial_state"):
            fn(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 4, 4))
        with pytest.raises(ValueError, match="A_log"):
            fn(q, k, v, g, beta, use_gate_in_kernel=True)
        with pytest.raises(ValueError, match="dt_bias"):
            fn(q, k, v, g, beta, use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(2))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, beta, chunk_size=48)


# ---------------------------------------------------------------------------------------------------------------
# 2. The chunked kernels, forward and backward, against the naive reference
# ---------------------------------------------------------------------------------------------------------------

# (B, T, H, HV, K, V, gate, chunk_size, cu_seqlens): chunk boundaries, GVA, K != V, varlen with a one-token sequence,
# decays strong enough that e^{G} leaves fp32's range inside a chunk, a key width the intra-chunk backward splits
# (K = 48: channel blocks of intra.INTRA_BK = 32, the second one part masked).
CHUNK_CASES = [
    (2, 1, 1, 1, 32, 32, "normal", 64, None),
    (1, 70, 1, 2, 48, 16, "mixed", 64, None),
    (1, 130, 1, 1, 32, 32, "strong", 64, None),
    (1, 130, 2, 4, 16, 16, "mixed", 64, None),
    (1, 110, 1, 2, 16, 32, "normal", 64, [0, 15, 79, 109, 110]),
    (2, 40, 1, 1, 16, 16, "normal", 16, None),
]
CHUNK_IDS = [case_id(B=b, T=t, H=h, HV=hv, K=k, V=v) + f"-{gate}-C{c}" + ("-varlen" if cu else "")
             for b, t, h, hv, k, v, gate, c, cu in CHUNK_CASES]


def check_against_naive(fn, tensors, keywords, threshold, dg_threshold=None, cu_seqlens=None, **op_keywords):
    """fn's outputs and the gradients of every input (loss ⟨o, dO⟩ + ⟨final state, dS⟩) against the float64 naive."""
    q, k, v, g, beta, h0, *params = tensors
    gate = dict(zip(("A_log", "dt_bias"), params))
    o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, **gate,
               **keywords, **op_keywords)
    o_ref, ht_ref, leaves = reference(tensors, dict(keywords, cu_seqlens=cu_seqlens))
    assert_rel_close(o, o_ref, threshold=threshold[0], name="o")
    assert_rel_close(ht, ht_ref, threshold=threshold[0], name="final_state")
    do, dht = torch.randn_like(o_ref), torch.randn_like(ht_ref)
    grads = torch.autograd.grad((o.double() * do.to(o.device)).sum() + (ht.double() * dht.to(o.device)).sum(),
                                tensors)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), leaves)
    for name, grad, grad_ref in zip(("q", "k", "v", "g", "beta", "h0"), grads, grads_ref):
        limit = dg_threshold if name == "g" and dg_threshold else threshold[1]
        assert_rel_close(grad, grad_ref, threshold=limit, name=f"d{name}")
    if params:  # sums over every token whose terms can cancel: judged against Σ|term| (tests/helpers.py)
        dz, z = grads_ref[3], leaves[3].detach() + leaves[7].detach().view(-1, q.shape[-1])
        terms = {"A_log": (dz * F.softplus(z) / torch.sigmoid(z)).abs().sum((0, 1, 3)),
                 "dt_bias": dz.abs().sum((0, 1)).flatten()}
        for (name, term), grad, grad_ref in zip(terms.items(), grads[6:], grads_ref[6:]):
            assert_decay_grad_close(grad, grad_ref, term, threshold[1], name=f"d{name}")


@pytest.mark.parametrize("B,T,H,HV,K,V,gate,chunk_size,cu_seqlens", CHUNK_CASES, ids=CHUNK_IDS)
def test_chunk_matches_naive(B, T, H, HV, K, V, gate, chunk_size, cu_seqlens, device, poison_allocations):
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    tensors = make_inputs(B, T, H, K, V, HV=HV, N=None if cu is None else len(cu_seqlens) - 1, gate=gate,
                          device=device, requires_grad=True)
    # Strong decays: the true dg is a ~1e-3 remainder of O(1) per-chunk terms (as the gated delta rule's README).
    check_against_naive(chunk_kda, tensors, {}, (1e-5, 2e-5), dg_threshold=1e-2 if gate == "strong" else None,
                        cu_seqlens=cu, chunk_size=chunk_size)


def test_chunk_keywords_match_naive(device):
    """use_gate_in_kernel (dA_log, ddt_bias too), the β sigmoid with allow_neg_eigval, the in-kernel l2norm and
    state_v_first, at chunk size 32."""
    tensors = make_inputs(1, 70, 1, 16, 16, HV=2, raw_gate=True, state_v_first=True, device=device,
                          requires_grad=True)
    tensors[4].data = torch.randn_like(tensors[4])  # beta holds logits
    keywords = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                    use_qk_l2norm_in_kernel=True, state_v_first=True)
    check_against_naive(chunk_kda, tensors, keywords, (1e-5, 2e-5), chunk_size=32)


def test_chunk_bf16(device):
    tensors = make_inputs(1, 70, 1, 32, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    check_against_naive(chunk_kda, tensors, {}, (5e-3, 1e-2))


# ---------------------------------------------------------------------------------------------------------------
# 3. The fused-recurrent kernel
# ---------------------------------------------------------------------------------------------------------------

def test_fused_recurrent_matches_naive_with_keywords(device):
    """Forward inside one kernel (the gate, β's sigmoid, l2norm, the [V, K] state); backward through chunk_kda."""
    tensors = make_inputs(1, 20, 1, 16, 32, HV=2, N=3, raw_gate=True, state_v_first=True, device=device,
                          requires_grad=True)
    tensors[4].data = torch.randn_like(tensors[4])
    keywords = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True,
                    state_v_first=True)
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32, device=device)
    check_against_naive(fused_recurrent_kda, tensors, keywords, (1e-5, 2e-5), cu_seqlens=cu)


def test_fused_recurrent_decode_step_continues_the_sequence(device):
    q, k, v, g, beta, h0 = make_inputs(2, 9, 1, 16, 16, HV=2, gate="mixed", device=device)
    o_all, ht_all = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    _, ht_prefix = chunk_kda(q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], initial_state=h0,
                             output_final_state=True)
    o_step, ht_step = fused_recurrent_kda(q[:, 8:], k[:, 8:], v[:, 8:], g[:, 8:], beta[:, 8:],
                                          initial_state=ht_prefix, output_final_state=True)
    assert_rel_close(o_step, o_all[:, 8:], threshold=1e-5, name="o")
    assert_rel_close(ht_step, ht_all, threshold=1e-5, name="final_state")
    o_ref, ht_ref, _ = reference([q, k, v, g, beta, h0], {})
    assert_rel_close(o_all, o_ref, threshold=1e-5, name="o (whole)")
    assert_rel_close(ht_all, ht_ref, threshold=1e-5, name="final_state (whole)")
