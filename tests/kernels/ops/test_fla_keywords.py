"""fla's keywords on the delta-rule ops (issue 30, item 3), mirroring fla's own tests of them (tests/ops/test_gdn.py:
test_chunk_gate_in_kernel*, test_chunk_beta_sigmoid_in_kernel, test_chunk_state_v_first, test_chunk_with_chunk_size,
test_fused_recurrent_*_in_kernel*): each keyword, and all of them together, against the naive recurrence in float64
with the same preprocessing, outputs and every gradient (q, k, v, g or the raw a, beta or its logits, A_log, dt_bias,
the initial state); packed sequences; the chunked and fused-recurrent paths against each other; state_v_first bit for
bit against the [K, V] layout, and handed from a chunked prefill to fused-recurrent decoding; the chunk sizes of the
chunked gated delta rule and IPLR; the registry adapters passing the keywords on.

Keywords (fla 0.6, fla.ops.gated_delta_rule): use_gate_in_kernel with A_log, dt_bias (g holds the raw a of
g = −exp(A_log) softplus(a + dt_bias)); use_beta_sigmoid_in_kernel (beta holds logits) and allow_neg_eigval (β =
2·sigmoid); state_v_first (states [N, HV, V, K]); chunk_size (chunked ops only). fla's gated delta product has none.

Run: `pytest tests/kernels/ops/test_fla_keywords.py` (CPU, Triton interpreted: ~3 min); the `gpu`-marked tests run
the issue's real size (B2 T1024 H8 D128, bf16) on CUDA.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from rltrain_kernels.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)
from rltrain_kernels.ops.gated_delta_rule.naive import naive_gdn_gate
from rltrain_kernels.ops.iplr_delta_rule import chunk_iplr_delta_rule
from tests.helpers import assert_rel_close
from tests.kernels.ops import test_iplr_delta_rule as iplr_tests

OPS = {"chunk": chunk_gated_delta_rule, "fused_recurrent": fused_recurrent_gated_delta_rule}
GATE = dict(use_gate_in_kernel=True)
# Keyword settings; "gate" gets a dt_bias unless the name says otherwise.
CONFIGS = {
    "gate": GATE,
    "gate-no-dt-bias": GATE,
    "beta-sigmoid": dict(use_beta_sigmoid_in_kernel=True),
    "neg-eigval": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "state-v-first": dict(state_v_first=True),
    "all": dict(GATE, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True,
                use_qk_l2norm_in_kernel=True),
}
# Error bars against float64: (outputs, gradients, dA_log / ddt_bias). Outputs and gradients by relative error. A_log's
# and dt_bias's gradients sum da_t·∂g_t/∂A_log and da_t over every token of a head, terms of both signs that cancel:
# their error is measured against the sum of the terms' magnitudes (gate_sum_error), which a wrong factor or sign
# of those terms still moves by O(1). bf16, 60 draws of test_keywords_bf16_inputs (K = 16, so few terms average out):
# o up to 5.4e-3, gradients up to 9.0e-3 (dg), the gate sums up to 5.0e-3 (their plain relative error: 9.2e-2).
FP32_BARS = (1e-5, 2e-5, 1e-4)
BF16_BARS = (1e-2, 2e-2, 1e-2)


def keyword_inputs(B, T, H, HV, K, V, options, *, dtype=torch.float32, device="cpu", N=None, gates="mild",
                   dt_bias=True):
    """Fresh leaves for `options` (fla's conventions): l2-normalised k (raw with use_qk_l2norm_in_kernel), the raw
    gate input a ~ N(0, 1) with A_log, dt_bias [HV] (Qwen3-Next's init A = U(1, 16) for gates="strong", milder
    otherwise) or a log gate logsigmoid(·), beta logits N(0, 1) or β = sigmoid(U(0, 1)), an fp32 initial state in
    the layout state_v_first asks for. Token tensors in `dtype`, A_log / dt_bias / the state in fp32."""
    N = N or B
    q = torch.randn(B, T, H, K, device=device)
    k = torch.randn(B, T, H, K, device=device)
    if not options.get("use_qk_l2norm_in_kernel"):
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, device=device)
    leaves = dict(q=q, k=k, v=v)
    if options.get("use_gate_in_kernel"):
        leaves["g"] = torch.randn(B, T, HV, device=device)
        A = torch.empty(HV, device=device).uniform_(1, 16) if gates == "strong" else torch.randn(HV).exp() * 0.5
        leaves["A_log"] = A.log().to(device)
        if dt_bias:
            leaves["dt_bias"] = torch.randn(HV, device=device) * 0.5
    else:
        leaves["g"] = F.logsigmoid(torch.randn(B, T, HV, device=device))
    if options.get("use_beta_sigmoid_in_kernel"):
        leaves["beta"] = torch.randn(B, T, HV, device=device)
    else:
        leaves["beta"] = torch.rand(B, T, HV, device=device).sigmoid()
    leaves["initial_state"] = torch.randn((N, HV, V, K) if options.get("state_v_first") else (N, HV, K, V),
                                          device=device)
    keep = ("initial_state", "A_log", "dt_bias")
    return {name: (t if name in keep else t.to(dtype)).requires_grad_() for name, t in leaves.items()}


def call(fn, leaves, options, cu_seqlens=None, **extra):
    """fn(q, k, v, g, beta, initial_state=..., output_final_state=True, ...) on the leaves, by fla's names."""
    tensors = {name: leaves[name] for name in ("A_log", "dt_bias", "initial_state") if name in leaves}
    return fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], output_final_state=True,
              cu_seqlens=cu_seqlens, **tensors, **options, **extra)


def backward(o, ht, do_dtype=None):
    """Backward of ⟨o, do⟩ + ⟨ht, dht⟩ with fixed random upstream gradients (do non-contiguous, rounded to do_dtype:
    the dtype of the op's o, for the float64 reference too)."""
    gen = torch.Generator().manual_seed(0)
    do = torch.randn(o.shape[::-1], generator=gen).permute(*reversed(range(o.dim()))).to(do_dtype or o.dtype)
    do = do.to(o.device, o.dtype)
    dht = torch.randn(ht.shape, generator=gen).to(ht.device)
    (o.float() * do.float()).sum().add((ht * dht).sum()).backward()


def reference(leaves, options, cu_seqlens=None):
    """The naive recurrence in float64 with the same keywords, on the leaves' device (on a GPU the real sizes' token
    loop runs there, not on its host's CPU): (o, final state, {name: gradient})."""
    ref = {name: t.detach().double().requires_grad_() for name, t in leaves.items()}
    o, ht = call(naive_recurrent_gated_delta_rule, ref, options, cu_seqlens)
    backward(o, ht, do_dtype=leaves["v"].dtype)
    return o, ht, {name: t.grad for name, t in ref.items()}


def check_against_naive(fn, leaves, options, bars, *, cu_seqlens=None, dg_bar=None):
    """fn with `options` on the leaves against the float64 reference: o, the final state (in the initial state's
    layout, fp32) and every leaf's gradient (in the leaf's dtype), within bars (outputs, gradients, A_log / dt_bias;
    dg_bar for g's where given)."""
    o, ht = call(fn, leaves, options, cu_seqlens)
    assert ht.shape == leaves["initial_state"].shape and ht.dtype == torch.float32, (tuple(ht.shape), ht.dtype)
    assert o.dtype == leaves["v"].dtype
    backward(o, ht)
    o_ref, ht_ref, grads = reference(leaves, options, cu_seqlens)
    assert_rel_close(o, o_ref, threshold=bars[0], name="o")
    assert_rel_close(ht, ht_ref, threshold=bars[0], name="final_state")
    for name, t in leaves.items():
        assert t.grad is not None, f"no gradient for {name}"
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape, f"d{name}: {t.grad.dtype} {tuple(t.grad.shape)}"
        if name in ("A_log", "dt_bias"):
            err = gate_sum_error(name, leaves, grads)
            assert err <= bars[2], f"d{name}: error {err:.3e} of the sum of its terms' magnitudes > {bars[2]:.1e}"
        else:
            bar = dg_bar if (name == "g" and dg_bar) else bars[1]
            assert_rel_close(t.grad, grads[name], threshold=bar, name=f"d{name}")


def gate_sum_error(name, leaves, grads) -> float:
    """‖ours − reference‖ of dA_log or ddt_bias over Σ_tokens |term| per head, the terms from the float64 reference:
    da_t for dt_bias, da_t·∂g_t/∂A_log / (∂g_t/∂a_t) = da_t·softplus(z_t)/sigmoid(z_t) for A_log (z = a + dt_bias)."""
    da = grads["g"]
    z = leaves["g"].detach().double() + (leaves["dt_bias"].detach().double() if "dt_bias" in leaves else 0.0)
    terms = da if name == "dt_bias" else da * F.softplus(z) / torch.sigmoid(z)
    scale = terms.abs().flatten(0, -2).sum(0)
    return ((leaves[name].grad.double() - grads[name]).norm() / scale.norm()).item()


def options_of(config: str) -> dict:
    return dict(CONFIGS[config])


def cu_seqlens_of(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------------------------------------------
# 1. The reference: fla's definitions in plain torch
# ---------------------------------------------------------------------------------------------------------------

def test_naive_gate_is_qwen3_next_gate():
    """naive_gdn_gate is transformers' Qwen3-Next line `-A_log.float().exp() * F.softplus(a.float() + dt_bias)`,
    torch's softplus threshold (x > 20 gives x) included."""
    a = torch.tensor([[-40.0, -5.0, 0.0], [3.0, 19.5, 30.0]], dtype=torch.float64)
    A_log, dt_bias = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64), torch.tensor([0.5, 0.0, -0.25],
                                                                                      dtype=torch.float64)
    expected = -A_log.exp() * torch.log1p((a + dt_bias).exp())
    assert_rel_close(naive_gdn_gate(a, A_log, dt_bias), expected, threshold=1e-14, name="gate")
    assert_rel_close(naive_gdn_gate(a, A_log), -A_log.exp() * F.softplus(a), threshold=0.0, name="gate, no bias")
    assert naive_gdn_gate(a.float(), A_log.float()).dtype == torch.float32


def test_naive_keywords_are_the_preprocessing():
    """In float64 the naive recurrence with a keyword equals it on the preprocessed inputs: the gate, 2·sigmoid(beta)
    and the transposed states."""
    leaves = {k: t.detach().double() for k, t in keyword_inputs(2, 9, 1, 2, 4, 3, options_of("all")).items()}
    q, k, v, a, beta, h0 = (leaves[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    o, ht = call(naive_recurrent_gated_delta_rule, leaves, options_of("all"))
    o_ref, ht_ref = naive_recurrent_gated_delta_rule(
        q, k, v, naive_gdn_gate(a, leaves["A_log"], leaves["dt_bias"]), 2 * beta.sigmoid(),
        initial_state=h0.transpose(-1, -2), output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_rel_close(o, o_ref, threshold=1e-14, name="o")
    assert ht.shape == h0.shape and ht.is_contiguous()
    assert_rel_close(ht, ht_ref.transpose(-1, -2), threshold=1e-14, name="final_state")
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        o_old, _ = naive_recurrent_gated_delta_rule(q, k, v, a.sigmoid().log(), beta.sigmoid(), initial_state=h0,
                                                    transpose_state_layout=True)
    o_new, _ = naive_recurrent_gated_delta_rule(q, k, v, a.sigmoid().log(), beta.sigmoid(), initial_state=h0,
                                                state_v_first=True)
    assert torch.equal(o_old, o_new)


# ---------------------------------------------------------------------------------------------------------------
# 2. The gate kernels (gate.py) against torch autograd
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_bias", [True, False], ids=["dt-bias", "no-dt-bias"])
def test_gate_kernels_match_torch(with_bias, device, poison_allocations):
    """gate_chunk_cumsum = chunk-local cumsum of naive_gdn_gate and gate_bwd = its autograd (da, dA_log, ddt_bias),
    on packed sequences with partial chunks, 3 heads (a masked head tile) and gate inputs from −40 to 40 (both ends of
    softplus: e^x underflowing 1 + e^x, and torch's threshold)."""
    from rltrain_kernels.ops.common.chunking import chunk_layout
    from rltrain_kernels.ops.gated_delta_rule.gate import gate_bwd, gate_chunk_cumsum

    lengths, HV = [70, 1, 64, 5], 3
    cu = cu_seqlens_of(lengths, device)
    layout = chunk_layout(1, sum(lengths), cu, 64, device)
    a = torch.randn(sum(lengths), HV) * 3
    a[::7] = torch.rand(a[::7].shape) * 80 - 40  # a sprinkle of |a| up to 40
    A_log, dt_bias = torch.randn(HV), torch.randn(HV) if with_bias else torch.zeros(HV)
    # the reference in float64 on the same fp32 values
    a, A_log, dt_bias = a.double().requires_grad_(), A_log.double().requires_grad_(), dt_bias.double()
    dt_bias.requires_grad_(with_bias)
    g = naive_gdn_gate(a, A_log, dt_bias)
    G_ref = torch.cat([chunk.cumsum(0) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())
                       for chunk in g[s:e].split(64)])
    G = gate_chunk_cumsum(a.detach().float().to(device), A_log.detach().float().to(device),
                          dt_bias.detach().float().to(device) if with_bias else None, layout)
    assert G.dtype == torch.float32
    assert_rel_close(G, G_ref, threshold=2e-6, name="G")
    dG = torch.randn_like(G_ref).float().double()
    G_ref.backward(dG)
    da, dA_log, ddt_bias = gate_bwd(dG.float().to(device), a.detach().float().to(device),
                                    A_log.detach().float().to(device),
                                    dt_bias.detach().float().to(device) if with_bias else None, layout)
    assert_rel_close(da, a.grad, threshold=4e-6, name="da")
    # (30 draws on the interpreter: worst G 2e-7, da 4e-7.) dA_log, ddt_bias sum terms of both signs over every token:
    # cancellation lifts their fp32 error (worst 1e-6) above the elementwise one
    assert_rel_close(dA_log, A_log.grad, threshold=2e-5, name="dA_log")
    if with_bias:
        assert_rel_close(ddt_bias, dt_bias.grad, threshold=2e-5, name="ddt_bias")
    else:
        assert ddt_bias is None


# ---------------------------------------------------------------------------------------------------------------
# 3. The ops with each keyword against the naive recurrence (float64)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("impl", list(OPS))
def test_keywords_match_naive(impl, config, device, poison_allocations):
    """B2 T70 (a partial second chunk), GVA (H1 HV2), K16 != V32, an initial state: outputs and every gradient."""
    options = options_of(config)
    leaves = keyword_inputs(2, 70, 1, 2, 16, 32, options, device=device, dt_bias=config != "gate-no-dt-bias")
    check_against_naive(OPS[impl], leaves, options, FP32_BARS)


@pytest.mark.parametrize("impl", list(OPS))
def test_keywords_varlen(impl, device, poison_allocations):
    """Every keyword on packed sequences (one spanning two chunks, one of a single token), each with its own
    initial state."""
    lengths = [70, 1, 20]
    options = options_of("all")
    leaves = keyword_inputs(1, sum(lengths), 1, 2, 16, 16, options, device=device, N=len(lengths))
    check_against_naive(OPS[impl], leaves, options, FP32_BARS, cu_seqlens=cu_seqlens_of(lengths, device))


@pytest.mark.parametrize("impl", list(OPS))
def test_keywords_bf16_inputs(impl, device):
    """bf16 tokens (the raw a and the beta logits included) with fp32 A_log, dt_bias and state: every gradient in its
    leaf's dtype, within the bf16 bars."""
    options = options_of("all")
    leaves = keyword_inputs(1, 80, 1, 2, 16, 16, options, dtype=torch.bfloat16, device=device)
    check_against_naive(OPS[impl], leaves, options, BF16_BARS)


def test_chunk_qwen3_next_strong_gates(device):
    """Qwen3-Next's A_log init (A ~ U(1, 16)): decays down to e^-20 per token. dg then cancels O(1) per-chunk terms
    to a small value (test_gated_delta_rule.py: test_chunk_gradients_extreme_gates), so dg and the gate parameters'
    gradients get its floor; the rest stays at the fp32 bars."""
    options = options_of("gate")
    leaves = keyword_inputs(2, 100, 1, 2, 16, 16, options, device=device, gates="strong")
    check_against_naive(chunk_gated_delta_rule, leaves, options, (1e-5, 2e-5, 1e-2), dg_bar=1e-2)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunk_sizes_match_naive(chunk_size, device, poison_allocations):
    """fla's chunk sizes (test_chunk_with_chunk_size) with every keyword, packed sequences ending inside a chunk."""
    lengths = [50, 31]
    options = options_of("all")
    leaves = keyword_inputs(1, sum(lengths), 1, 2, 16, 32, options, device=device, N=len(lengths))
    check_against_naive(functools.partial(chunk_gated_delta_rule, chunk_size=chunk_size), leaves, options,
                        FP32_BARS, cu_seqlens=cu_seqlens_of(lengths, device))


def test_chunk_and_fused_recurrent_agree(device):
    """The two paths on the same leaves with every keyword: outputs and every gradient (fp32) within fp32 rounding of
    each other."""
    options = options_of("all")
    leaves = keyword_inputs(2, 40, 2, 4, 16, 16, options, device=device)
    results = []
    for fn in OPS.values():
        fresh = {name: t.detach().clone().requires_grad_() for name, t in leaves.items()}
        o, ht = call(fn, fresh, options)
        backward(o, ht)
        results.append((o, ht, {name: t.grad for name, t in fresh.items()}))
    (o_c, ht_c, g_c), (o_f, ht_f, g_f) = results
    assert_rel_close(o_f, o_c, threshold=2e-6, name="o")
    assert_rel_close(ht_f, ht_c, threshold=2e-6, name="final_state")
    for name in leaves:  # the fused path's backward runs the chunked kernels: the same numbers up to the forward
        assert_rel_close(g_f[name], g_c[name], threshold=2e-5, name=f"d{name}")


# ---------------------------------------------------------------------------------------------------------------
# 4. state_v_first: exact, and handed from prefill to decoding
# ---------------------------------------------------------------------------------------------------------------

def check_state_v_first_exact(impl, kv, options, exact=True):
    """The [N, HV, V, K] call on h0ᵀ against the [N, HV, K, V] call on h0 (the same leaves otherwise): its output,
    its final state transposed and every gradient (dh0 transposed, the upstream dht transposed), bit for bit where
    `exact`, else within fp32 rounding (1e-6; bf16 outputs 1e-4: a misread layout is off by O(1))."""
    def same(a, b, name):
        if exact:
            assert torch.equal(a, b), f"{name} differs between the state layouts"
        else:   # bf16 outputs: an fp32 difference at rounding flips a few elements by one bf16 step
            assert_rel_close(a, b, threshold=1e-6 if a.dtype == torch.float32 else 1e-4, name=name)

    vk = {name: t.detach().clone().requires_grad_() for name, t in kv.items()}
    vk["initial_state"] = kv["initial_state"].detach().transpose(-1, -2).contiguous().requires_grad_()
    o, ht = call(OPS[impl], kv, options)
    o_t, ht_t = call(OPS[impl], vk, dict(options, state_v_first=True))
    assert ht_t.is_contiguous() and ht_t.shape == ht.shape[:2] + ht.shape[2:][::-1]
    same(o_t, o, "o")
    same(ht_t, ht.transpose(-1, -2), "final_state (transposed)")
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    (o.float() * do.float()).sum().add((ht * dht).sum()).backward()
    (o_t.float() * do.float()).sum().add((ht_t * dht.transpose(-1, -2)).sum()).backward()
    for name in kv:
        expected = kv[name].grad.transpose(-1, -2) if name == "initial_state" else kv[name].grad
        same(vk[name].grad, expected, f"d{name}")


@pytest.mark.parametrize("impl", list(OPS))
def test_state_v_first_is_the_transposed_state_exactly(impl, device):
    """K == V, so no shape tells the layouts apart: the chunked op bit for bit the [K, V] call's results, transposed
    (fla's test_chunk_state_v_first checks 1e-4); the fused-recurrent kernel within fp32 rounding (its [V, K] tile
    sums its rows in another order)."""
    check_state_v_first_exact(impl, keyword_inputs(2, 70, 1, 2, 16, 16, GATE, device=device), GATE,
                              exact=impl == "chunk")


@pytest.mark.parametrize("impl", list(OPS))
def test_state_v_first_rejects_a_kv_state(impl, device):
    """K != V: a [N, HV, K, V] state passed with state_v_first (or the reverse) is an error naming initial_state."""
    options = options_of("state-v-first")
    leaves = keyword_inputs(1, 5, 1, 2, 16, 32, options, device=device)
    kv = leaves["initial_state"].detach().transpose(-1, -2).contiguous()
    with pytest.raises(ValueError, match=r"initial_state must be \[N, HV, V, K\]"):
        call(OPS[impl], dict(leaves, initial_state=kv), options)
    with pytest.raises(ValueError, match=r"initial_state must be \[N, HV, K, V\]"):
        call(OPS[impl], leaves, {})


TOKENS = ("q", "k", "v", "g", "beta")


def reference_forward(leaves, options, cu_seqlens=None):
    """The naive recurrence in float64 on the leaves' device, forward only: (o, final state)."""
    ref = {name: t.detach().double() for name, t in leaves.items()}
    return call(naive_recurrent_gated_delta_rule, ref, options, cu_seqlens)


def prefill_then_decode(prefill, decode, options, cu_seqlens=None):
    """Prefill with the chunked op (prefill: token tensors, initial_state, A_log, dt_bias), then decode the token
    tensors of `decode` ([N, steps, ...]) one step at a time with the fused-recurrent op, each step from the state
    the previous call returned, as returned ([N, HV, V, K] under state_v_first). → (prefill o, decode o, state)."""
    gate = {n: prefill[n] for n in ("A_log", "dt_bias") if n in prefill}
    o_prefill, state = chunk_gated_delta_rule(*(prefill[n] for n in TOKENS), initial_state=prefill["initial_state"],
                                              output_final_state=True, cu_seqlens=cu_seqlens, **gate, **options)
    outputs = []
    for t in range(decode["q"].shape[1]):
        o_t, state = fused_recurrent_gated_delta_rule(*(decode[n][:, t:t + 1] for n in TOKENS), initial_state=state,
                                                      output_final_state=True, **gate, **options)
        outputs.append(o_t)
    return o_prefill, torch.cat(outputs, 1), state


def split_tokens(leaves, T_prefill):
    """(prefill leaves: the first T_prefill tokens and the rest, decode token tensors: the tokens after)."""
    prefill = dict(leaves, **{n: leaves[n][:, :T_prefill] for n in TOKENS})
    return prefill, {n: leaves[n][:, T_prefill:] for n in TOKENS}


def test_prefill_then_decode_with_state_v_first(device):
    """Chunked prefill (T = 70) → 3 fused-recurrent decode steps with state_v_first and every keyword, the state
    handed over as the op returns it: the whole sequence's naive outputs and final state."""
    options = options_of("all")
    leaves = {n: t.detach() for n, t in keyword_inputs(2, 73, 1, 2, 16, 32, options, device=device).items()}
    o_pre, o_dec, state = prefill_then_decode(*split_tokens(leaves, 70), options)
    o_ref, ht_ref = reference_forward(leaves, options)
    assert state.shape == leaves["initial_state"].shape
    assert_rel_close(o_pre, o_ref[:, :70], threshold=1e-5, name="prefill o")
    assert_rel_close(o_dec, o_ref[:, 70:], threshold=1e-5, name="decode o")
    assert_rel_close(state, ht_ref, threshold=1e-5, name="final_state")


def test_packed_prefill_then_batched_decode_with_state_v_first(device):
    """Packed prefill of 3 sequences (cu_seqlens) → a decode batch of those 3 sequences, 2 steps: each sequence
    continues from its own state (the N states stay in order through the [N, HV, V, K] layout)."""
    options = options_of("all")
    lengths, steps = [30, 64, 7], 2
    N = len(lengths)
    prefill = {n: t.detach() for n, t in keyword_inputs(1, sum(lengths), 1, 2, 16, 32, options, device=device,
                                                        N=N).items()}
    decode = {n: t.detach() for n, t in keyword_inputs(N, steps, 1, 2, 16, 32, options, device=device).items()
              if n in TOKENS}
    cu = cu_seqlens_of(lengths, device)
    o_pre, o_dec, state = prefill_then_decode(prefill, decode, options, cu)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        whole = dict(prefill, initial_state=prefill["initial_state"][n:n + 1],
                     **{name: torch.cat([prefill[name][:, s:e], decode[name][n:n + 1]], 1) for name in TOKENS})
        o_ref, ht_ref = reference_forward(whole, options)
        assert_rel_close(o_pre[:, s:e], o_ref[:, :e - s], threshold=1e-5, name=f"prefill o seq{n}")
        assert_rel_close(o_dec[n:n + 1], o_ref[:, e - s:], threshold=1e-5, name=f"decode o seq{n}")
        assert_rel_close(state[n:n + 1], ht_ref, threshold=1e-5, name=f"final_state seq{n}")


# ---------------------------------------------------------------------------------------------------------------
# 5. Arguments: fla's rules, and clear errors naming the argument
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [*OPS.values(), naive_recurrent_gated_delta_rule],
                         ids=[*OPS, "naive"])
def test_keyword_errors_name_the_argument(fn, device):
    leaves = {n: t.detach() for n, t in keyword_inputs(1, 4, 1, 2, 16, 16, GATE, device=device).items()}
    q, k, v, a, beta = (leaves[n] for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(ValueError, match="A_log"):
        fn(q, k, v, a, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="A_log must have HV=2 elements"):
        fn(q, k, v, a, beta, use_gate_in_kernel=True, A_log=torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="dt_bias must have HV=2 elements"):
        fn(q, k, v, a, beta, use_gate_in_kernel=True, A_log=leaves["A_log"], dt_bias=torch.zeros(1, device=device))
    with pytest.raises(ValueError, match="allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True"):
        fn(q, k, v, a, beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="state_v_first or its deprecated name transpose_state_layout"):
        fn(q, k, v, a, beta, state_v_first=True, transpose_state_layout=True)


@pytest.mark.parametrize("chunk_size", [8, 48, 128, 0])
def test_unsupported_chunk_size_is_an_error_naming_it(chunk_size, device):
    leaves = {n: t.detach() for n, t in keyword_inputs(1, 4, 1, 1, 16, 16, {}, device=device).items()}
    args = [leaves[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=rf"chunk_size must be one of \(16, 32, 64\), got {chunk_size}"):
        chunk_gated_delta_rule(*args, chunk_size=chunk_size)
    ia = iplr_tests.make_inputs(1, 4, 1, 16, 16, device=device)[:5]
    with pytest.raises(ValueError, match=rf"chunk_size must be one of \(16, 32, 64\), got {chunk_size}"):
        chunk_iplr_delta_rule(*ia, chunk_size=chunk_size)


@pytest.mark.parametrize("impl", list(OPS))
def test_gate_parameters_are_ignored_without_use_gate_in_kernel(impl, device):
    """fla's rule: A_log and dt_bias are read only with use_gate_in_kernel=True (g is then a log gate as usual)."""
    leaves = {n: t.detach() for n, t in keyword_inputs(1, 20, 1, 2, 16, 16, GATE, device=device).items()}
    log_gate = F.logsigmoid(leaves["g"])
    args = [leaves[n] for n in ("q", "k", "v")] + [log_gate, leaves["beta"]]
    o, _ = OPS[impl](*args, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"])
    assert torch.equal(o, OPS[impl](*args)[0])


def test_transpose_state_layout_is_state_v_first(device):
    options = options_of("state-v-first")
    leaves = {n: t.detach() for n, t in keyword_inputs(1, 5, 1, 2, 16, 32, options, device=device).items()}
    for fn in OPS.values():
        with pytest.warns(DeprecationWarning, match="transpose_state_layout is deprecated"):
            o_old, ht_old = call(fn, leaves, {}, transpose_state_layout=True)
        o_new, ht_new = call(fn, leaves, options)
        assert torch.equal(o_old, o_new) and torch.equal(ht_old, ht_new)


def test_float64_chunk_is_the_naive_recurrence_with_its_keywords():
    options = options_of("all")
    leaves = {n: t.detach().double() for n, t in keyword_inputs(1, 30, 1, 2, 16, 16, options).items()}
    o, ht = call(chunk_gated_delta_rule, leaves, options, chunk_size=32)
    o_ref, ht_ref = call(naive_recurrent_gated_delta_rule, leaves, options)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)


# ---------------------------------------------------------------------------------------------------------------
# 6. IPLR: chunk_size (fla's only keyword of the four on chunk_iplr_delta_rule)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_size", [16, 32])
def test_iplr_chunk_sizes_match_naive(chunk_size, device, poison_allocations):
    lengths = [50, 31]
    cu = cu_seqlens_of(lengths, device)
    inputs = iplr_tests.make_inputs(1, sum(lengths), 2, 16, 32, device=device, N=len(lengths), initial_state=True,
                                    requires_grad=True)
    iplr_tests.check_gradients(functools.partial(chunk_iplr_delta_rule, chunk_size=chunk_size), *inputs,
                               cu_seqlens=cu, threshold=(1e-5, 2e-5))


def test_iplr_chunk_size_none_is_64(device):
    """fla's default chunk_size=None: the 64 of the plain call, bit for bit."""
    q, k, v, a, b, h0 = iplr_tests.make_inputs(1, 70, 1, 16, 16, device=device, initial_state=True)
    o, ht = chunk_iplr_delta_rule(q, k, v, a, b, initial_state=h0, output_final_state=True, chunk_size=None)
    o64, ht64 = chunk_iplr_delta_rule(q, k, v, a, b, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o64) and torch.equal(ht, ht64)


# ---------------------------------------------------------------------------------------------------------------
# 7. The registry adapters pass fla's keywords on (never dropped as transformers' extra keywords are)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", list(OPS))
def test_registry_adapters_pass_the_keywords_on(impl, device):
    from rltrain_kernels.integrations.gated_delta_rule import chunk_adapter, recurrent_adapter

    adapter = chunk_adapter if impl == "chunk" else recurrent_adapter
    options = options_of("all")
    leaves = {n: t.detach() for n, t in keyword_inputs(1, 20, 1, 2, 16, 16, options, device=device).items()}
    args = [leaves[n] for n in ("q", "k", "v", "g", "beta")]
    tensors = dict(initial_state=leaves["initial_state"], A_log=leaves["A_log"], dt_bias=leaves["dt_bias"])
    # an attention keyword transformers' Qwen3-Next hands every layer: dropped, as before
    got = adapter(*args, output_final_state=True, recurrence_dot="auto", cu_seq_lens_k=None, scale=0.3,
                  **tensors, **options)
    expected = OPS[impl](*args, output_final_state=True, scale=0.3, **tensors, **options)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    if impl == "chunk":
        with pytest.raises(ValueError, match="chunk_size"):
            adapter(*args, chunk_size=128, recurrence_dot="auto", **tensors, **options)


# ---------------------------------------------------------------------------------------------------------------
# Real sizes on the GPU: the B2 T1024 H8 D128, bf16 (bars 5e-3 outputs, 1e-2 gradients, 2e-2 A_log/dt_bias)
# ---------------------------------------------------------------------------------------------------------------

REAL = dict(B=2, T=1024, H=8, HV=8, K=128, V=128)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["gate", "beta-sigmoid", "state-v-first", "all"])
def test_chunk_keywords_real_size(config, device):
    options = options_of(config)
    leaves = keyword_inputs(*REAL.values(), options, dtype=torch.bfloat16, device=device)
    check_against_naive(chunk_gated_delta_rule, leaves, options, BF16_BARS)


@pytest.mark.gpu
def test_chunk_keywords_varlen_gva_real_size(device):
    lengths = [15, 1000, 500, 1]
    options = options_of("all")
    leaves = keyword_inputs(1, sum(lengths), 4, 8, 128, 128, options, dtype=torch.bfloat16, device=device,
                            N=len(lengths))
    check_against_naive(chunk_gated_delta_rule, leaves, options, BF16_BARS, cu_seqlens=cu_seqlens_of(lengths, device))


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_sizes_real_size(chunk_size, device):
    options = options_of("all")
    leaves = keyword_inputs(*REAL.values(), options, dtype=torch.bfloat16, device=device)
    check_against_naive(functools.partial(chunk_gated_delta_rule, chunk_size=chunk_size), leaves, options,
                        BF16_BARS)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", list(OPS))
def test_state_v_first_exact_real_size(impl, device):
    """The chunked path runs the same kernels on the same contiguous [K, V] state: bit for bit. The fused-recurrent
    kernel reads the state with other addresses, which may give its reductions another register layout on the GPU:
    within fp32 rounding."""
    kv = keyword_inputs(*REAL.values(), GATE, dtype=torch.bfloat16, device=device)
    check_state_v_first_exact(impl, kv, GATE, exact=impl == "chunk")


@pytest.mark.gpu
def test_prefill_then_decode_real_size(device):
    """Chunked prefill of 1020 tokens → 4 decode steps, state_v_first and every keyword, bf16."""
    options = options_of("all")
    leaves = {n: t.detach() for n, t in keyword_inputs(2, 1024, 8, 8, 128, 128, options, dtype=torch.bfloat16,
                                                       device=device).items()}
    o_pre, o_dec, state = prefill_then_decode(*split_tokens(leaves, 1020), options)
    o_ref, ht_ref = reference_forward(leaves, options)
    assert_rel_close(o_pre, o_ref[:, :1020], threshold=5e-3, name="prefill o")
    assert_rel_close(o_dec, o_ref[:, 1020:], threshold=5e-3, name="decode o")
    assert_rel_close(state, ht_ref, threshold=5e-3, name="final_state")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_recurrent_decode_keywords_real_size(dtype, device):
    """A decode batch (B = 64, T = 1, HV = 16, K = V = 128) with every keyword in the kernel: against float64, and
    the [V, K] state call bit for bit against the [K, V] one."""
    options = options_of("all")
    leaves = {n: t.detach() for n, t in keyword_inputs(64, 1, 16, 16, 128, 128, options, dtype=dtype,
                                                       device=device).items()}
    o, ht = call(fused_recurrent_gated_delta_rule, leaves, options)
    o_ref, ht_ref = reference_forward(leaves, options)
    assert_rel_close(o, o_ref, threshold=1e-5 if dtype == torch.float32 else 5e-3, name="o")
    assert_rel_close(ht, ht_ref, threshold=1e-5, name="final_state")
    kv_options = {k: v for k, v in options.items() if k != "state_v_first"}
    o_kv, ht_kv = call(fused_recurrent_gated_delta_rule,
                       dict(leaves, initial_state=leaves["initial_state"].transpose(-1, -2).contiguous()),
                       kv_options)
    # other state addresses, possibly another register layout for the reductions: fp32 rounding apart at most (a
    # bf16 output then differs by one bf16 step in a few elements: 2e-5 to 4e-5 seen on an H100)
    assert_rel_close(o, o_kv, threshold=1e-6 if dtype == torch.float32 else 1e-4, name="o, [K, V] state")
    assert_rel_close(ht, ht_kv.transpose(-1, -2), threshold=1e-6, name="final_state, [K, V] state")


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", [16, 32])
def test_iplr_chunk_sizes_real_size(chunk_size, device):
    inputs = iplr_tests.make_inputs(2, 1024, 8, 128, 128, dtype=torch.bfloat16, device=device, initial_state=True,
                                    requires_grad=True)
    iplr_tests.check_gradients(functools.partial(chunk_iplr_delta_rule, chunk_size=chunk_size), *inputs,
                               threshold=(5e-3, 1e-2))
