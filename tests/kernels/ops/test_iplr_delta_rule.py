"""IPLR delta rule: the naive reference against an independent float64 loop, closed forms and the gated delta rule;
then the fused-recurrent and chunked Triton kernels (interpreted on CPU, native on GPU) against the naive reference,
forward and every gradient (q, k, v, a, b, initial_state).

Run: `pytest tests/kernels/ops/test_iplr_delta_rule.py` (CPU, ~1 min through the Triton interpreter);
the `gpu`-marked tests run real sizes in bf16 on a CUDA machine.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from rltrain_kernels.ops.gated_delta_rule import chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
from rltrain_kernels.ops.iplr_delta_rule import (
    chunk_iplr_delta_rule,
    fused_recurrent_iplr_delta_rule,
    naive_recurrent_iplr_delta_rule,
)
from tests.helpers import (
    assert_rel_close,
    case_id,
    state_pass_batch,
    spy_launches,
)

REGIMES = ("delta", "generic")


def make_inputs(B, T, H, K, V, dtype=torch.float32, device="cpu", regime="delta", N=None, initial_state=False,
                requires_grad=False):
    """Fresh random inputs. regime "delta": a = −β k̂, b = k̂ with k̂ l2-normalised and β ∈ (0, 1) (b = λ a with
    λ‖a‖² = −β: the stable regime); "generic": independent a, b ~ N(0, 0.25/K) (‖a‖‖b‖ ≈ 0.25, not parallel).
    k is l2-normalised and q, v are standard normal in both."""
    q = torch.randn(B, T, H, K, device=device)
    k = F.normalize(torch.randn(B, T, H, K, device=device, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, device=device)
    if regime == "delta":
        k_hat = F.normalize(torch.randn(B, T, H, K, device=device, dtype=torch.float64), dim=-1)
        beta = torch.rand(B, T, H, 1, device=device, dtype=torch.float64)
        a, b = -beta * k_hat, k_hat
    else:
        a, b = (torch.randn(B, T, H, K, device=device) * (0.5 / K ** 0.5) for _ in range(2))
    tensors = [t.to(dtype) for t in (q, k, v, a, b)]
    h0 = None
    if initial_state:
        h0 = torch.randn(N or B, H, K, V, device=device, dtype=torch.float64 if dtype == torch.float64 else None)
    if requires_grad:
        for t in tensors + ([h0] if h0 is not None else []):
            t.requires_grad_(True)
    return (*tensors, h0)


def loop_reference(q, k, v, a, b, scale, h0):
    """An independent float64 loop, one head and one token at a time, with the matrix I + b aᵀ written out."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    finals = torch.zeros(B, H, K, V, dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    for i in range(B):
        for h in range(H):
            S = h0[i, h].double() if h0 is not None else torch.zeros(K, V, dtype=torch.float64)
            for t in range(T):
                x = lambda y: y[i, t, h].double()  # noqa: E731
                S = (eye + torch.outer(x(b), x(a))) @ S + torch.outer(x(k), x(v))
                o[i, t, h] = S.T @ (scale * x(q))
            finals[i, h] = S
    return o, finals


def reference(q, k, v, a, b, h0, cu_seqlens=None, scale=None):
    """The naive recurrence in float64 on the inputs' device."""
    to64 = lambda t: None if t is None else t.detach().double()  # noqa: E731
    return naive_recurrent_iplr_delta_rule(
        to64(q), to64(k), to64(v), to64(a), to64(b), scale=scale, initial_state=to64(h0), output_final_state=True,
        cu_seqlens=cu_seqlens)


NAIVE_SHAPES = [(2, 7, 1, 4, 4), (1, 5, 2, 3, 5), (2, 1, 2, 4, 2)]


def cu_seqlens_of(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------------------------------------------
# 1. The naive reference
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("B,T,H,K,V", NAIVE_SHAPES,
                         ids=[case_id(B=B, T=T, H=H, K=K, V=V) for B, T, H, K, V in NAIVE_SHAPES])
def test_naive_matches_float64_loop(B, T, H, K, V, regime):
    q, k, v, a, b, h0 = make_inputs(B, T, H, K, V, dtype=torch.float64, regime=regime, initial_state=True)
    o, ht = naive_recurrent_iplr_delta_rule(q, k, v, a, b, scale=0.7, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = loop_reference(q, k, v, a, b, 0.7, h0)
    assert_rel_close(o, o_ref, threshold=1e-12, name="o")
    assert_rel_close(ht, ht_ref, threshold=1e-12, name="final_state")
    o32, ht32 = naive_recurrent_iplr_delta_rule(*(t.float() for t in (q, k, v, a, b)), scale=0.7,
                                                initial_state=h0.float(), output_final_state=True)
    assert o32.dtype == torch.float32 and ht32.dtype == torch.float32
    assert_rel_close(o32, o_ref, threshold=1e-5, name="o fp32")


def test_naive_closed_forms():
    q, k, v, a, b, h0 = make_inputs(1, 6, 1, 4, 3, dtype=torch.float64, initial_state=True)
    # a = b = 0: plain linear attention, S_t = h0 + Σ_{j≤t} k_j v_jᵀ.
    zero = torch.zeros_like(a)
    o, ht = naive_recurrent_iplr_delta_rule(q, k, v, zero, zero, scale=1.0, initial_state=h0,
                                            output_final_state=True)
    states = h0[0, 0] + torch.einsum("tk,tv->tkv", k[0, :, 0], v[0, :, 0]).cumsum(0)
    assert_rel_close(o[0, :, 0], torch.einsum("tkv,tk->tv", states, q[0, :, 0]), threshold=1e-13, name="o")
    assert_rel_close(ht[0, 0], states[-1], threshold=1e-13, name="state")
    # k = 0, b = −a/‖a‖²: I + b aᵀ projects out a, so aᵀ S_1 = 0 while the orthogonal part of S_0 is kept.
    a1 = a[:, :1]
    b1 = -a1 / a1.pow(2).sum(-1, keepdim=True)
    _, ht = naive_recurrent_iplr_delta_rule(q[:, :1], zero[:, :1], v[:, :1], a1, b1, initial_state=h0,
                                            output_final_state=True)
    assert ht[0, 0].T.matmul(a1[0, 0, 0]).abs().max() < 1e-12
    projector = torch.eye(4, dtype=torch.float64) - torch.outer(a1[0, 0, 0], a1[0, 0, 0]) / a1.pow(2).sum()
    assert_rel_close(ht[0, 0], projector @ h0[0, 0], threshold=1e-13, name="projected state")


def test_naive_delta_rule_special_case():
    """a = −β k, b = k, v ← β v is the (ungated) delta rule."""
    q, k, v, _, _, h0 = make_inputs(2, 9, 2, 5, 3, dtype=torch.float64, initial_state=True)
    beta = torch.rand(2, 9, 2, dtype=torch.float64)
    o, ht = naive_recurrent_iplr_delta_rule(q, k, v * beta[..., None], -beta[..., None] * k, k, initial_state=h0,
                                            output_final_state=True)
    o_ref, ht_ref = naive_recurrent_gated_delta_rule(q, k, v, torch.zeros_like(beta), beta, initial_state=h0,
                                                     output_final_state=True)
    assert_rel_close(o, o_ref, threshold=1e-12, name="o")
    assert_rel_close(ht, ht_ref, threshold=1e-12, name="final_state")


def test_inputs_are_validated_with_the_argument_name():
    q, k, v, a, b, _ = make_inputs(1, 4, 2, 16, 16)
    with pytest.raises(ValueError, match="a must"):
        naive_recurrent_iplr_delta_rule(q, k, v, a[..., :8], b)
    with pytest.raises(ValueError, match="v must"):
        chunk_iplr_delta_rule(q, k, v[:, :, :1], a, b)
    with pytest.raises(ValueError, match="initial_state"):
        fused_recurrent_iplr_delta_rule(q, k, v, a, b, initial_state=torch.zeros(2, 2, 16, 16))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_iplr_delta_rule(q, k, v, a, b, cu_seqlens=torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match="16 <= K <= 256"):
        chunk_iplr_delta_rule(q[..., :8], k[..., :8], v, a[..., :8], b[..., :8])


# ---------------------------------------------------------------------------------------------------------------
# 2. Forward kernels (fused recurrent and chunked) against the naive recurrence
# ---------------------------------------------------------------------------------------------------------------

# (B, T, H, K, V, regime): T around the chunk size 64, K != V, both input regimes; K=48 masks a partial key block,
# K=128, V=96 runs the multi-block K and V loops (and a partial V block) of every kernel.
CPU_CASES = [
    (2, 1, 2, 32, 16, "delta"),
    (1, 63, 1, 48, 32, "generic"),
    (2, 64, 2, 32, 16, "delta"),
    (1, 65, 2, 16, 32, "generic"),
    (1, 200, 1, 32, 16, "delta"),
    (1, 70, 1, 128, 96, "generic"),
]
CPU_IDS = [f"{case_id(B=B, T=T, H=H, K=K, V=V)}-{r}" for B, T, H, K, V, r in CPU_CASES]
VARLEN = [15, 70, 1]


@pytest.mark.parametrize("impl", ["fused_recurrent", "chunk"])
@pytest.mark.parametrize("B,T,H,K,V,regime", CPU_CASES, ids=CPU_IDS)
def test_forward_matches_naive(B, T, H, K, V, regime, impl, device, poison_allocations):
    fn = fused_recurrent_iplr_delta_rule if impl == "fused_recurrent" else chunk_iplr_delta_rule
    q, k, v, a, b, h0 = make_inputs(B, T, H, K, V, regime=regime, device=device, initial_state=True)
    o, ht = fn(q, k, v, a, b, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = reference(q, k, v, a, b, h0)
    assert_rel_close(o, o_ref, threshold=1e-5, name="o")
    assert_rel_close(ht, ht_ref, threshold=1e-5, name="final_state")


@pytest.mark.parametrize("impl", ["fused_recurrent", "chunk"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_inputs_keep_fp32_states(impl, dtype, device):
    """bf16 / fp16 inputs: o in v's dtype, the final state fp32, both against the float64 recurrence."""
    fn = fused_recurrent_iplr_delta_rule if impl == "fused_recurrent" else chunk_iplr_delta_rule
    q, k, v, a, b, h0 = make_inputs(2, 70, 2, 16, 32, dtype=dtype, device=device, initial_state=True)
    o, ht = fn(q, k, v, a, b, initial_state=h0, output_final_state=True)
    assert (o.dtype, ht.dtype, o.shape, ht.shape) == (dtype, torch.float32, v.shape, h0.shape)
    o_ref, ht_ref = reference(q, k, v, a, b, h0)
    assert_rel_close(o, o_ref, threshold=5e-3, name="o")
    assert_rel_close(ht, ht_ref, threshold=1e-5 if impl == "fused_recurrent" else 5e-3, name="final_state")


@pytest.mark.parametrize("with_h0", [False, True], ids=["no-h0", "h0"])
def test_varlen_forward_chunk_vs_fused_vs_naive(with_h0, device, poison_allocations):
    """Packed sequences [15, 70, 1]: no state leaks between them; chunk, fused recurrent and naive agree."""
    cu = cu_seqlens_of(VARLEN, device)
    q, k, v, a, b, h0 = make_inputs(1, sum(VARLEN), 2, 16, 32, regime="generic", device=device, N=len(VARLEN),
                                    initial_state=with_h0)
    o_ref, ht_ref = reference(q, k, v, a, b, h0, cu_seqlens=cu)
    outs = {}
    for name, fn in (("chunk", chunk_iplr_delta_rule), ("fused_recurrent", fused_recurrent_iplr_delta_rule)):
        o, ht = fn(q, k, v, a, b, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        assert_rel_close(o, o_ref, threshold=1e-5, name=f"{name} o")
        assert_rel_close(ht, ht_ref, threshold=1e-5, name=f"{name} final_state")
        outs[name] = (o, ht)
    assert_rel_close(outs["chunk"][0], outs["fused_recurrent"][0], threshold=1e-5, name="chunk vs fused o")
    assert_rel_close(outs["chunk"][1], outs["fused_recurrent"][1], threshold=1e-5, name="chunk vs fused state")
    # Each packed sequence alone gives the same result: nothing leaks across cu_seqlens boundaries.
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, ht_n = chunk_iplr_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], a[:, s:e], b[:, s:e],
                                          initial_state=None if h0 is None else h0[n:n + 1], output_final_state=True)
        assert_rel_close(outs["chunk"][0][:, s:e], o_n, threshold=1e-6, name=f"o seq{n}")
        assert_rel_close(outs["chunk"][1][n:n + 1], ht_n, threshold=1e-6, name=f"state seq{n}")


def test_fused_recurrent_decode_step_continues_the_sequence(device):
    """Prefill T tokens with the chunked kernel, then decode one token from the returned state with the fused
    kernel: equals running T+1 tokens at once."""
    q, k, v, a, b, h0 = make_inputs(3, 9, 2, 16, 16, device=device, initial_state=True)
    o_all, ht_all = fused_recurrent_iplr_delta_rule(q, k, v, a, b, initial_state=h0, output_final_state=True)
    _, ht = chunk_iplr_delta_rule(q[:, :8], k[:, :8], v[:, :8], a[:, :8], b[:, :8], initial_state=h0,
                                  output_final_state=True)
    o_step, ht_step = fused_recurrent_iplr_delta_rule(q[:, 8:], k[:, 8:], v[:, 8:], a[:, 8:], b[:, 8:],
                                                      initial_state=ht, output_final_state=True)
    assert_rel_close(o_step, o_all[:, 8:], threshold=1e-6, name="o")
    assert_rel_close(ht_step, ht_all, threshold=1e-6, name="final_state")


def test_chunk_forward_without_states_and_custom_scale(device):
    q, k, v, a, b, _ = make_inputs(2, 70, 2, 16, 16, regime="generic", device=device)
    o, ht = chunk_iplr_delta_rule(q, k, v, a, b, scale=0.3)
    assert ht is None
    assert_rel_close(o, reference(q, k, v, a, b, None, scale=0.3)[0], threshold=1e-5, name="o")


# ---------------------------------------------------------------------------------------------------------------
# 3. Gradients of the chunked backward (the fused-recurrent path delegates to it) vs autograd through naive, float64
# ---------------------------------------------------------------------------------------------------------------

GRAD_NAMES = ("q", "k", "v", "a", "b", "initial_state")


def check_gradients(fn, q, k, v, a, b, h0, *, cu_seqlens=None, threshold):
    """Run fn and the float64 naive reference with the same random upstream gradients for o and the final state
    (non-contiguous do, to check any upstream layout is accepted); compare o, final state and every gradient."""
    o, ht = fn(q, k, v, a, b, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    do = torch.randn(o.shape[::-1], device=o.device).to(o.dtype).permute(3, 2, 1, 0)
    dht = torch.randn_like(ht)
    (o.float() * do.float()).sum().add((ht * dht).sum()).backward()
    inputs = [q, k, v, a, b, h0]
    ref_inputs = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    o_ref, ht_ref = naive_recurrent_iplr_delta_rule(
        *ref_inputs[:5], initial_state=ref_inputs[5], output_final_state=True,
        cu_seqlens=cu_seqlens)
    (o_ref * do.double()).sum().add((ht_ref * dht.double()).sum()).backward()
    assert_rel_close(o, o_ref, threshold=threshold[0], name="o")
    assert_rel_close(ht, ht_ref, threshold=threshold[0], name="final_state")
    for name, t, r in zip(GRAD_NAMES, inputs, ref_inputs):
        if t is None:
            continue
        assert t.grad is not None, f"no gradient for {name}"
        assert t.grad.dtype == t.dtype, f"d{name} dtype {t.grad.dtype} != {t.dtype}"
        assert_rel_close(t.grad, r.grad, threshold=threshold[1], name=f"d{name}")


@pytest.mark.parametrize("B,T,H,K,V,regime", CPU_CASES, ids=CPU_IDS)
def test_chunk_gradients_match_naive_float64(B, T, H, K, V, regime, device, poison_allocations):
    inputs = make_inputs(B, T, H, K, V, regime=regime, device=device, initial_state=True, requires_grad=True)
    check_gradients(chunk_iplr_delta_rule, *inputs, threshold=(1e-5, 2e-5))


@pytest.mark.parametrize("regime", REGIMES)
def test_chunk_varlen_gradients(regime, device, poison_allocations):
    cu = cu_seqlens_of(VARLEN, device)
    inputs = make_inputs(1, sum(VARLEN), 2, 16, 32, regime=regime, device=device, N=len(VARLEN),
                         initial_state=True, requires_grad=True)
    check_gradients(chunk_iplr_delta_rule, *inputs, cu_seqlens=cu, threshold=(1e-5, 2e-5))


def test_chunk_gradients_without_initial_state(device):
    q, k, v, a, b, _ = make_inputs(1, 40, 2, 16, 16, regime="generic", device=device, requires_grad=True)
    o, _ = chunk_iplr_delta_rule(q, k, v, a, b)
    o.sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, a, b)]
    naive_recurrent_iplr_delta_rule(*ref)[0].sum().backward()
    for name, t, r in zip(GRAD_NAMES, (q, k, v, a, b), ref):
        assert_rel_close(t.grad, r.grad, threshold=2e-5, name=f"d{name}")


def test_delta_rule_special_case_equals_chunk_gated_delta_rule(device):
    """chunk_iplr(q, k, β v, −β k, k) is chunk_gated_delta_rule(q, k, v, g=0, β): outputs, and the gradients
    w.r.t. q, k, v, β, h0 once autograd chains da, db, dv through a = −β k, b = k, v ← β v."""
    B, T, H, K, V = 1, 100, 2, 16, 32
    q, k, v, _, _, h0 = make_inputs(B, T, H, K, V, device=device, initial_state=True)
    beta = torch.rand(B, T, H, device=device)
    do = torch.randn(B, T, H, V, device=device)
    results = []
    for use_iplr in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, beta, h0)]
        ql, kl, vl, bl, hl = leaves
        if use_iplr:
            o, ht = chunk_iplr_delta_rule(ql, kl, vl * bl[..., None], -bl[..., None] * kl, kl, initial_state=hl,
                                          output_final_state=True)
        else:
            o, ht = chunk_gated_delta_rule(ql, kl, vl, torch.zeros_like(bl), bl, initial_state=hl,
                                           output_final_state=True)
        (o * do).sum().add(ht.square().sum()).backward()
        results.append([o, ht] + [t.grad for t in leaves])
    for name, x, y in zip(("o", "final_state", "dq", "dk", "dv", "dbeta", "dh0"), *results):
        assert_rel_close(x, y, threshold=1e-5, name=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunk_low_precision_inputs(dtype, device):
    # As for the gated delta rule: the interpreter rounds fp32 → bf16 toward zero (the GPU rounds to nearest), so
    # CPU bf16 outputs sit nearer the 5e-3 limit than on the GPU.
    inputs = make_inputs(1, 80, 2, 16, 16, dtype=dtype, device=device, initial_state=True, requires_grad=True)
    check_gradients(chunk_iplr_delta_rule, *inputs, threshold=(5e-3, 1e-2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunk_backward_writes_gradients_in_the_inputs_dtypes(dtype, device):
    """The backward kernels write dq, dk, dv, da, db in q's, k's, v's, a's, b's dtype themselves (autograd would
    cast a mismatched one silently, costing a pass over each), and those agree with the backward of the same inputs
    in fp32 (whose dots run at full precision: hence a bar at the dtype's level, not bit equality)."""
    from rltrain_kernels.ops.common.precision import iplr_dot_precision
    from rltrain_kernels.ops.iplr_delta_rule.function import chunk_iplr_delta_rule_bwd_recompute

    q, k, v, a, b, h0 = make_inputs(1, 80, 2, 16, 16, dtype=dtype, device=device, initial_state=True)
    do = torch.randn_like(v)
    grads = chunk_iplr_delta_rule_bwd_recompute(q, k, v, a, b, 0.25, h0, None, do, None,
                                                dot_prec=iplr_dot_precision(dtype))
    assert [g.dtype for g in grads] == [dtype] * 5 + [torch.float32]
    full = chunk_iplr_delta_rule_bwd_recompute(*(t.float() for t in (q, k, v, a, b)), 0.25, h0, None, do.float(),
                                               None, dot_prec=iplr_dot_precision(torch.float32))
    # bf16: the gradient bar (seen 7e-3); fp16 takes tf32 dots, which the interpreter runs exact (seen 2e-4)
    # and a GPU rounds to 10 bits (da 1.6e-3 on an H200)
    bar = 1e-2 if dtype == torch.bfloat16 else 5e-3
    for name, g, ref in zip(("dq", "dk", "dv", "da", "db"), grads, full):
        assert_rel_close(g.float(), ref, threshold=bar, name=name)


@pytest.mark.parametrize("blocks", [(128, 64), (128, 128), (32, 32)])
def test_output_pass_blocks_change_no_result(blocks, device, monkeypatch):
    """iplr_output_fwd's blocks (the output pass's key / value tiles, Tuning.output_blocks; default
    chunk_fwd.OUTPUT_BLOCKS, which the op takes) reach the launch and give the same outputs as the shipped blocks, up
    to fp32 summation order, on the intermediates of the op's forward."""
    from rltrain_kernels.ops.common.chunking import CHUNK_SIZE, chunk_layout
    from rltrain_kernels.ops.common.precision import iplr_dot_precision
    from rltrain_kernels.ops.common.tuning import Tuning
    from rltrain_kernels.ops.iplr_delta_rule import chunk_fwd

    launched = []  # each launch's (BK, BV)
    spy_launches(monkeypatch, chunk_fwd, "iplr_output_fwd_kernel",
                 lambda args, kwargs: launched.append((kwargs["BK"], kwargs["BV"])))
    *tensors, h0 = make_inputs(1, 70, 1, 128, 128, device=device, initial_state=True)
    q, k, v, a, b = (t.flatten(0, 1) for t in tensors)  # [tokens, H, *], as the op's forward flattens them
    layout = chunk_layout(1, 70, None, CHUNK_SIZE, q.device)
    dot_prec = iplr_dot_precision(q.dtype)
    Ai, Ak = chunk_fwd.iplr_solve(k, a, b, layout, dot_prec=dot_prec)
    h, x, _ = chunk_fwd.iplr_state_pass_fwd(k, v, a, b, Ai, Ak, h0, False, layout, dot_prec=dot_prec)
    base = chunk_fwd.iplr_output_fwd(q, k, v, b, x, h, 128 ** -0.5, layout, v.dtype, dot_prec=dot_prec)
    o = chunk_fwd.iplr_output_fwd(q, k, v, b, x, h, 128 ** -0.5, layout, v.dtype, dot_prec=dot_prec,
                                  tuning=Tuning(output_blocks=blocks))
    assert_rel_close(o, base, threshold=1e-6, name="o")
    assert launched == [tuple(chunk_fwd.OUTPUT_BLOCKS), blocks]  # K = V = 128: no cap below


@pytest.mark.parametrize("regime", REGIMES)
def test_bf16_dots_within_the_bars(regime, device):
    """IPLR with bf16 dots (precision.IPLR_LOW_PRECISION_DOT, the default for bf16 inputs): within the bf16 bars, with
    T, w, h, X, dh, dX, dw stored bf16 (they feed nothing but dots that round to bf16 anyway)."""
    from rltrain_kernels.ops.common import precision

    assert precision.operand_dtype(torch.bfloat16, precision.iplr_dot_precision(torch.bfloat16)) == torch.bfloat16
    inputs = make_inputs(1, 100, 2, 32, 16, dtype=torch.bfloat16, regime=regime, device=device,
                         initial_state=True, requires_grad=True)
    check_gradients(chunk_iplr_delta_rule, *inputs, threshold=(5e-3, 1e-2))


def test_tf32_dots_argument_for_bf16_inputs(device, monkeypatch):
    """dot="tf32": every IPLR launch, forward and backward, takes tf32 dots; fp32 intermediates; within the bf16
    bars."""
    from rltrain_kernels.ops.common import precision, state_pass
    from rltrain_kernels.ops.iplr_delta_rule import chunk_bwd, chunk_fwd

    assert precision.operand_dtype(torch.bfloat16, precision.iplr_dot_precision(torch.bfloat16, "tf32")) == (
        torch.float32)
    launched = {}  # kernel → the DOT_PREC values it was launched with
    for module, names in ((chunk_fwd, ("iplr_solve_kernel", "iplr_state_pass_fwd_kernel", "iplr_output_fwd_kernel")),
                          (chunk_bwd, ("iplr_bwd_query_kernel", "iplr_bwd_key_kernel")),
                          (state_pass, ("state_pass_bwd_kernel",))):
        for name in names:
            spy_launches(monkeypatch, module, name, lambda args, kwargs, name=name: launched.setdefault(
                name, set()).add(kwargs["DOT_PREC"].removesuffix("_interpreted")))
    inputs = make_inputs(1, 100, 2, 32, 16, dtype=torch.bfloat16, device=device, initial_state=True,
                         requires_grad=True)
    check_gradients(functools.partial(chunk_iplr_delta_rule, dot="tf32"), *inputs, threshold=(5e-3, 1e-2))
    assert len(launched) == 6 and all(values == {"tf32"} for values in launched.values()), launched


def test_fused_recurrent_gradients_via_chunk_backward(device):
    inputs = make_inputs(1, 30, 2, 16, 16, regime="generic", device=device, initial_state=True, requires_grad=True)
    check_gradients(fused_recurrent_iplr_delta_rule, *inputs, threshold=(1e-5, 2e-5))


# ---------------------------------------------------------------------------------------------------------------
# Real sizes on the GPU, bf16 (thresholds: 5e-3 outputs, 1e-2 gradients, relative RMS vs float64)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("B,T,H,K,V", [(2, 1024, 4, 128, 128), (1, 1100, 2, 128, 64)],
                         ids=[case_id(B=2, T=1024, H=4, K=128, V=128), case_id(B=1, T=1100, H=2, K=128, V=64)])
def test_chunk_bf16_real_sizes(B, T, H, K, V, regime, device):
    inputs = make_inputs(B, T, H, K, V, dtype=torch.bfloat16, regime=regime, device=device, initial_state=True,
                         requires_grad=True)
    check_gradients(chunk_iplr_delta_rule, *inputs, threshold=(5e-3, 1e-2))


@pytest.mark.gpu
@pytest.mark.parametrize("value_block", ["wide", "narrow"])
def test_chunk_bf16_both_state_pass_launches(value_block, device):
    """The state passes' wide and narrow launches (the forward one and the shared reverse one; tests/helpers.py:
    state_pass_batch) at a real K = V = 128."""
    inputs = make_inputs(state_pass_batch(value_block, 4, 128, device), 1024, 4, 128, 128, dtype=torch.bfloat16, device=device, initial_state=True,
                         requires_grad=True)
    check_gradients(chunk_iplr_delta_rule, *inputs, threshold=(5e-3, 1e-2))


@pytest.mark.gpu
@pytest.mark.parametrize("value_block", ["wide", "narrow"])
def test_chunk_fp16_real_sizes(value_block, device):
    # fp16 inputs: raw products in fp16, the rest tf32 with fp32 intermediates (precision.py)
    inputs = make_inputs(state_pass_batch(value_block, 4, 128, device), 300, 4, 128, 128, dtype=torch.float16, device=device, initial_state=True,
                         requires_grad=True)
    check_gradients(chunk_iplr_delta_rule, *inputs, threshold=(5e-3, 1e-2))


@pytest.mark.gpu
def test_chunk_fp32_real_sizes(device):
    # fp32 inputs double every loaded tile (ieee dots): the launch settings must still fit Hopper's shared memory
    inputs = make_inputs(2, 300, 4, 128, 128, dtype=torch.float32, device=device, initial_state=True,
                         requires_grad=True)
    check_gradients(chunk_iplr_delta_rule, *inputs, threshold=(1e-4, 1e-3))


@pytest.mark.gpu
def test_chunk_bf16_wide_keys(device):
    """K = V = 256, the widest key dim: the register paths for K > 128 keep every kernel within Hopper's shared
    memory (the state passes take their narrow launch at every K > 128)."""
    inputs = make_inputs(2, 300, 4, 256, 256, dtype=torch.bfloat16, device=device, initial_state=True,
                         requires_grad=True)
    check_gradients(chunk_iplr_delta_rule, *inputs, threshold=(5e-3, 1e-2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_chunk_wide_keys_in_other_dtypes_raise_a_clear_error(dtype, device):
    q, k, v, a, b, _ = make_inputs(1, 64, 2, 256, 64, dtype=dtype, device=device)
    with pytest.raises(ValueError, match=r"K > 128 only with bfloat16 inputs on a GPU, got K=256 \(q/k/a/b\) in"):
        chunk_iplr_delta_rule(q, k, v, a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("value_block", ["narrow", "wide"])
def test_chunk_bf16_varlen_real_sizes(value_block, device):
    # uneven lengths: the wide forward state pass loads its raw tiles as stored there (chunk_fwd.py BALANCED); the
    # five lengths repeated until the sequence-heads pick the launch
    lengths = [15, 256, 500, 1, 300] * state_pass_batch(value_block, 5 * 4, 128, device)
    inputs = make_inputs(1, sum(lengths), 4, 128, 128, dtype=torch.bfloat16, device=device, N=len(lengths),
                         initial_state=True, requires_grad=True)
    check_gradients(chunk_iplr_delta_rule, *inputs, cu_seqlens=cu_seqlens_of(lengths, device),
                    threshold=(5e-3, 1e-2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_recurrent_real_sizes(dtype, device):
    for B, T in ((64, 1), (2, 300)):
        q, k, v, a, b, h0 = make_inputs(B, T, 8, 128, 128, dtype=dtype, device=device, initial_state=True)
        o, ht = fused_recurrent_iplr_delta_rule(q, k, v, a, b, initial_state=h0, output_final_state=True)
        assert (o.dtype, ht.dtype) == (dtype, torch.float32)
        o_ref, ht_ref = reference(q, k, v, a, b, h0)
        assert_rel_close(o, o_ref, threshold=5e-3 if dtype == torch.bfloat16 else 1e-5, name=f"o (T={T})")
        assert_rel_close(ht, ht_ref, threshold=1e-4, name=f"final_state (T={T})")
        o_chunk, ht_chunk = chunk_iplr_delta_rule(q, k, v, a, b, initial_state=h0, output_final_state=True)
        assert_rel_close(o_chunk, o_ref, threshold=5e-3 if dtype == torch.bfloat16 else 1e-5, name=f"chunk o (T={T})")
        # the chunked path's products run in tf32 for bf16 inputs (7.6e-4 seen on H200): the bf16 output threshold
        assert_rel_close(ht_chunk, ht_ref, threshold=5e-3 if dtype == torch.bfloat16 else 1e-4,
                         name=f"chunk final_state (T={T})")
