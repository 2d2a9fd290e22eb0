"""linear_logprobs against the dense float64 reference: every path (chunked torch; cuBLAS + Triton row passes; fused
Triton GEMMs; both Triton paths interpreted on CPU), every gradient, adversarial logits, every kind of upstream
gradient, ignore_index, input checks, the memory bound, and the vocab-parallel tp_group over 2 gloo processes.

Run: `pytest tests/kernels/ops/test_linear_logprobs.py` (CPU, ~1-2 min, most of it the Triton interpreter);
the `gpu`-marked tests run real vocab sizes, N·V > 2^31 and the 0.3 GiB peak-memory goal on a CUDA machine.
Interpreted shapes stay small (N ≤ 37, V ≤ 1007, H ≤ 64) and use blocks of 256: one interpreted fwd+bwd costs ~3 s.
"""

from __future__ import annotations

import math
import socket

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rltrain_kernels.ops.linear_logprobs import ChunkConfig, linear_logprobs, naive_linear_logprobs, workspace_bytes
from tests.helpers import REL_THRESHOLD, ON_GPU, assert_finite, assert_rel_close, case_id, dtype_id, spy_launches

IGNORE = -100
# Small tiles so CPU shapes cross token-chunk, vocab-chunk and block edges: 37 rows → chunks of 13/13/11,
# V=1007 → vocab chunks 504/503 → blocks 256 + 248.
TILED = ChunkConfig(token_chunk=16, vocab_chunk=512, block_v=256, align=1)
IMPLS = ["torch", "triton"]


def make_inputs(shape, vocab, hidden_size, dtype, device, logit_std=3.0, ignore_frac=0.15, offset=0.0):
    """hidden ~ N(0,1), weight ~ N(0, std²/H): logits have std ≈ logit_std; `offset` shifts every logit."""
    hidden = torch.randn(*shape, hidden_size, device=device)
    weight = torch.randn(vocab, hidden_size, device=device) * (logit_std / math.sqrt(hidden_size))
    if offset:
        hidden[..., 0] = 1.0
        weight[:, 0] = offset
    labels = torch.randint(0, vocab, shape, device=device)
    labels[torch.rand(shape, device=device) < ignore_frac] = IGNORE
    return hidden.to(dtype), weight.to(dtype), labels


def reference(hidden, weight, labels, temperature, g_logprob, g_entropy, return_entropy=True, row_chunk=None):
    """float64 outputs and gradients from the dense formula, optionally row-chunked (for the big GPU cases)."""
    h64 = hidden.detach().reshape(-1, hidden.shape[-1]).double()
    w64 = weight.detach().double().requires_grad_()
    lab = labels.reshape(-1)
    n = lab.numel()
    row_chunk = row_chunk or max(n, 1)
    lps, ents, ghs = [], [], []
    for r0 in range(0, n, row_chunk):
        h = h64[r0:r0 + row_chunk].clone().requires_grad_()
        lp, ent = naive_linear_logprobs(h, w64, lab[r0:r0 + row_chunk], temperature, IGNORE, return_entropy)
        loss = h.new_zeros(())
        if g_logprob is not None:
            loss = loss + (lp * g_logprob.reshape(-1)[r0:r0 + row_chunk].double()).sum()
        if g_entropy is not None and ent is not None:
            loss = loss + (ent * g_entropy.reshape(-1)[r0:r0 + row_chunk].double()).sum()
        if loss.requires_grad:
            loss.backward()
        lps.append(lp.detach())
        ents.append(ent.detach() if ent is not None else None)
        ghs.append(h.grad if h.grad is not None else torch.zeros_like(h))
    lp = torch.cat(lps).view(labels.shape)
    ent = torch.cat(ents).view(labels.shape) if return_entropy else None
    gw = w64.grad if w64.grad is not None else torch.zeros_like(w64)
    return lp, ent, torch.cat(ghs).view(hidden.shape), gw


def run(hidden, weight, labels, temperature, g_logprob, g_entropy, impl, config=None, return_entropy=True):
    """Ours: outputs, then backward with exactly the given upstream gradients (None: that output unused)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    lp, ent = linear_logprobs(h, w, labels, temperature, IGNORE, return_entropy, impl=impl, chunk_config=config)
    outs, grads = [], []
    for out, g in ((lp, g_logprob), (ent, g_entropy)):
        if out is not None and g is not None:
            outs.append(out)
            grads.append(g)
    if outs:
        torch.autograd.backward(outs, grads)
    return lp, ent, h.grad, w.grad


def check(hidden, weight, labels, temperature, impl, config=None, g_kind="dense", return_entropy=True,
          threshold=None, forward_threshold=None):
    """Ours vs the float64 reference: outputs within forward_threshold (default: threshold, default: by dtype),
    gradients within threshold. Returns (grad_hidden, grad_weight, their references), None without a backward."""
    g_logprob, g_entropy = upstream_grads(g_kind, labels.shape, labels.device)
    if not return_entropy:
        g_entropy = None
    lp, ent, gh, gw = run(hidden, weight, labels, temperature, g_logprob, g_entropy, impl, config, return_entropy)
    ref_lp, ref_ent, ref_gh, ref_gw = reference(hidden, weight, labels, temperature, g_logprob, g_entropy,
                                                return_entropy)
    dtype = hidden.dtype
    assert lp.dtype == torch.float32 and lp.shape == labels.shape
    forward_threshold = forward_threshold or threshold
    assert_rel_close(lp, ref_lp, dtype=dtype, threshold=forward_threshold, name="logprobs")
    if return_entropy:
        assert ent.dtype == torch.float32
        assert_rel_close(ent, ref_ent, dtype=dtype, threshold=forward_threshold, name="entropy")
    else:
        assert ent is None
    ignored = labels == IGNORE
    assert (lp[ignored] == 0).all() and (ent is None or (ent[ignored] == 0).all())
    if g_logprob is None and g_entropy is None:
        return None
    assert gh.dtype == hidden.dtype and gw.dtype == weight.dtype
    assert_rel_close(gh, ref_gh, dtype=dtype, threshold=threshold, name="grad_hidden")
    assert_rel_close(gw, ref_gw, dtype=dtype, threshold=threshold, name="grad_weight")
    assert (gh[ignored] == 0).all(), "ignored rows must get exactly zero gradient"
    return gh, gw, ref_gh, ref_gw


def upstream_grads(kind, shape, device):
    """(g_logprob, g_entropy) of every layout autograd can hand a backward."""
    n = math.prod(shape)
    if kind == "dense":
        return torch.randn(shape, device=device), torch.randn(shape, device=device)
    if kind == "expanded":  # what .sum() / .mean() produce: stride 0
        return (torch.randn((1,) * len(shape), device=device).expand(shape),
                torch.randn((1,) * len(shape), device=device).expand(shape))
    if kind == "strided":
        return (torch.randn(2 * n, device=device)[::2].view(shape),
                torch.randn(*shape, 3, device=device)[..., 1])
    if kind == "zero":
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)
    if kind == "logprob_only":
        return torch.randn(shape, device=device), None
    if kind == "entropy_only":
        return None, torch.randn(shape, device=device)
    raise ValueError(kind)


# ----------------------------------------------------------------------------------------------------------------
SHAPES = [  # (batch shape, V, H, temperature, logit std, config)
    ((37,), 1007, 64, 0.6, 10.0, TILED),
    ((37,), 1000, 48, 1.3, 1.0, TILED),
    ((1,), 1000, 32, 1.0, 3.0, None),
    ((3, 7), 1007, 64, 1.0, 5.0, TILED),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape,vocab,hidden_size,temperature,std,config", SHAPES,
                         ids=[case_id(N="x".join(map(str, s[0])), V=s[1], H=s[2], T=s[3], std=s[4],
                                      tiled=int(s[5] is not None)) for s in SHAPES])
def test_matches_reference(impl, dtype, shape, vocab, hidden_size, temperature, std, config, device):
    if impl == "triton" and device == "cpu" and dtype == torch.bfloat16 and shape != (37,):
        pytest.skip("CPU time budget: interpreted bf16 runs the two 37-row shapes (the GPU runs all)")
    hidden, weight, labels = make_inputs(shape, vocab, hidden_size, dtype, device, logit_std=std)
    check(hidden, weight, labels, temperature, impl, config)


@pytest.mark.parametrize("impl", IMPLS)
def test_float16_torch_and_triton(impl, device):
    hidden, weight, labels = make_inputs((29,), 1000, 32, torch.float16, device, logit_std=4.0)
    check(hidden, weight, labels, 0.8, impl, TILED)


# fp32 logits at |z| ≈ 200 carry 200·2⁻²⁴ ≈ 1.2e-5 absolute rounding before any kernel runs, so the floor of any
# fp32 implementation scales with the offset; a wrong max/underflow (verl PR #7439) gives O(1) errors or NaN.
OFFSET = 200.0
OFFSET_THRESHOLD = REL_THRESHOLD[torch.float32] * OFFSET / 10
ADVERSARIAL = ["large_negative", "large_positive", "dominating", "all_ignored", "non_contiguous"]


def adversarial_inputs(case, dtype, device):
    """(hidden, weight, labels, temperature, forward threshold) of one adversarial case."""
    shape, vocab, hidden_size = (23,), 1007, 32
    temperature, threshold = 1.0, None
    if case == "large_negative":   # every logit ≈ −200: exp underflows in fp32 unless the max is subtracted
        hidden, weight, labels = make_inputs(shape, vocab, hidden_size, torch.float32, device, offset=-OFFSET)
        threshold = OFFSET_THRESHOLD
    elif case == "large_positive":
        hidden, weight, labels = make_inputs(shape, vocab, hidden_size, torch.float32, device, offset=OFFSET * 0.6)
        temperature, threshold = 0.6, OFFSET_THRESHOLD
    elif case == "dominating":
        # one column ~22 above the rest in every row: entropy ≈ V·e^−22·22 ≈ 1e-5 ≈ 0. Stored as Σexp in fp32,
        # 1 + 3e-7 would lose its log-sum term (1/22 of H); u = Σexp − 1 keeps it. (Larger margins push the float64
        # reference itself past its precision: log_softmax's log(1 + 1e-23) rounds to 0.)
        hidden, weight, labels = make_inputs(shape, vocab, hidden_size, torch.float32, device, logit_std=1.0)
        hidden[:, 1] = 1.0
        weight[:, 1] = 0.0
        weight[vocab // 2, 1] = 25.0
        labels[:5] = vocab // 2
    elif case == "all_ignored":
        hidden, weight, labels = make_inputs(shape, vocab, hidden_size, torch.float32, device)
        labels.fill_(IGNORE)
    else:                          # hidden is a transposed view: [T, B, H] seen as [B, T, H]
        base, weight, labels = make_inputs((5, 4), vocab, hidden_size, torch.float32, device)
        hidden = base.transpose(0, 1).contiguous().transpose(0, 1)
    # the offsets (±200, 25) and ones are exact in bf16: the half cases keep the same logits up to input rounding
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    if case == "non_contiguous":
        assert not hidden.is_contiguous()
    return hidden, weight, labels, temperature, threshold


def check_adversarial(case, impl, dtype, device):
    hidden, weight, labels, temperature, threshold = adversarial_inputs(case, dtype, device)
    if case == "all_ignored":
        g_lp, g_ent = upstream_grads("dense", labels.shape, device)
        lp, ent, gh, gw = run(hidden, weight, labels, temperature, g_lp, g_ent, impl, TILED)
        assert (lp == 0).all() and (ent == 0).all() and (gh == 0).all() and (gw == 0).all()
        return
    if case == "dominating":
        _, ent = linear_logprobs(hidden, weight, labels, impl=impl, chunk_config=TILED)
        assert 0 < ent.max() < 1e-3
    if dtype == torch.float32:
        check(hidden, weight, labels, temperature, impl, TILED, threshold=threshold)
    else:
        # fp32 logits of half inputs: outputs at the fp32 bound. Gradients go through dlogits in the input dtype,
        # whose rows sum to 0 only up to rounding; at a common logit offset c that rounding reaches grad_hidden
        # scaled by c along the offset's direction: ~0.1 relative error at c = 200 in bf16 on every path (torch
        # 0.11, cuBLAS + row pass 0.096, fused 0.096; up to 0.13 over seeds). Those cases bound the whole of it at
        # 0.2 and hold grad_weight and grad_hidden off the offset's column (hidden[..., 0]) to the dtype's bound.
        grads = check(hidden, weight, labels, temperature, impl, TILED, threshold=0.2 if threshold else None,
                      forward_threshold=threshold or REL_THRESHOLD[torch.float32])
        if threshold:
            gh, gw, ref_gh, ref_gw = grads
            assert_rel_close(gh[..., 1:], ref_gh[..., 1:], dtype=dtype, name="grad_hidden off the offset column")
            assert_rel_close(gw, ref_gw, dtype=dtype, name="grad_weight")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ADVERSARIAL)
def test_adversarial(case, impl, device):
    check_adversarial(case, impl, torch.float32, device)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("g_kind", ["expanded", "strided", "zero", "logprob_only", "entropy_only", "no_entropy"])
def test_upstream_gradients(g_kind, impl, device):
    hidden, weight, labels = make_inputs((4, 5), 1000, 32, torch.float32, device)
    if g_kind == "no_entropy":
        check(hidden, weight, labels, 1.0, impl, TILED, g_kind="logprob_only", return_entropy=False)
    else:
        check(hidden, weight, labels, 1.0, impl, TILED, g_kind=g_kind)


def test_loss_reductions_and_frozen_weight(device):
    """`.sum()`/`.mean()` losses (expanded grads from autograd itself), and a weight that needs no grad."""
    hidden, weight, labels = make_inputs((2, 9), 1000, 32, torch.float32, device)
    h = hidden.clone().requires_grad_()
    lp, ent = linear_logprobs(h, weight, labels, impl="torch", chunk_config=TILED)
    (lp.sum() + 0.1 * ent.mean()).backward()
    h64 = hidden.double().requires_grad_()
    ref_lp, ref_ent = naive_linear_logprobs(h64, weight.double(), labels)
    (ref_lp.sum() + 0.1 * ref_ent.mean()).backward()
    assert_rel_close(h.grad, h64.grad, dtype=torch.float32, name="grad_hidden")


def test_no_grad_and_impls_agree(device):
    hidden, weight, labels = make_inputs((37,), 1007, 64, torch.float32, device)
    with torch.no_grad():
        a = linear_logprobs(hidden, weight, labels, impl="torch")
        b = linear_logprobs(hidden, weight, labels, impl="triton", chunk_config=TILED)
    for x, y, name in zip(a, b, ("logprobs", "entropy")):
        assert_rel_close(x, y.double(), threshold=1e-6, name=name)


# ---------------------------------------------------------------------------------------------------- impl="fused"
# Triton GEMMs with the row passes in their epilogues (fused.py): half inputs only, TMA operands. On CPU through the
# interpreter with 16 × 32 × 16 blocks, so the shapes cross row-, column- and K-block edges (H = 48 is 3 K blocks).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("shape,vocab,hidden_size,temperature,std,config", SHAPES,
                         ids=[case_id(N="x".join(map(str, s[0])), V=s[1], H=s[2], T=s[3], std=s[4],
                                      tiled=int(s[5] is not None)) for s in SHAPES])
def test_fused_matches_reference(dtype, shape, vocab, hidden_size, temperature, std, config, device):
    if device == "cpu" and dtype == torch.float16 and shape != (37,):
        pytest.skip("CPU time budget: interpreted fp16 runs the two 37-row shapes (the GPU runs all)")
    hidden, weight, labels = make_inputs(shape, vocab, hidden_size, dtype, device, logit_std=std)
    # outputs: fp32 logits from half inputs, so the fp32 bound against the reference on the same inputs
    check(hidden, weight, labels, temperature, "fused", config, forward_threshold=REL_THRESHOLD[torch.float32])


@pytest.mark.parametrize("subtile,flatten", [(False, False), (True, True)])
def test_fused_epilogue_variants(subtile, flatten, device, monkeypatch):
    """The forward epilogue over the whole block and in two column halves (the default; V = 1007 leaves the last
    block's second half past the end), with and without a flattened persistent loop (ChunkConfig.gemm, seen to
    reach the launches); H = 40 ends in half a K block (TMA fills the rest with zeros)."""
    from dataclasses import replace

    from rltrain_kernels.ops.common import vocab_gemm
    from rltrain_kernels.ops.common.vocab_tiles import GemmConfig

    launched = set()
    spy_launches(monkeypatch, vocab_gemm, "_gemm_stats_kernel",
                 lambda args, kwargs: launched.add((kwargs["SUBTILE"], kwargs["FLATTEN"])))
    config = replace(TILED, gemm=replace(GemmConfig.default(), subtile=subtile, flatten=flatten))
    hidden, weight, labels = make_inputs((37,), 1007, 40, torch.bfloat16, device, logit_std=10.0)
    check(hidden, weight, labels, 0.6, "fused", config, forward_threshold=REL_THRESHOLD[torch.float32])
    assert launched == {(subtile, flatten)}


@pytest.mark.parametrize("case", ADVERSARIAL)
def test_fused_adversarial(case, device):
    check_adversarial(case, "fused", torch.bfloat16, device)


@pytest.mark.parametrize("g_kind", ["expanded", "strided", "zero", "logprob_only", "entropy_only", "no_entropy"])
def test_fused_upstream_gradients(g_kind, device):
    hidden, weight, labels = make_inputs((4, 5), 1000, 32, torch.bfloat16, device)
    if g_kind == "no_entropy":
        check(hidden, weight, labels, 1.0, "fused", TILED, g_kind="logprob_only", return_entropy=False)
    else:
        check(hidden, weight, labels, 1.0, "fused", TILED, g_kind=g_kind)


def test_fused_input_errors(device):
    hidden, weight, labels = make_inputs((4,), 100, 16, torch.float32, device)
    with pytest.raises(ValueError, match="impl='fused' takes bfloat16 or float16 inputs"):
        linear_logprobs(hidden, weight, labels, impl="fused")
    hidden, weight, labels = make_inputs((4,), 100, 36, torch.bfloat16, device)   # rows of 72 B
    with pytest.raises(ValueError, match="hidden size 36 must be a multiple of 8"):
        linear_logprobs(hidden, weight, labels, impl="fused")


def test_wave_fitted_vocab_chunks():
    """The backward's vocabulary split: whole column blocks, within the workspace bound, covering V once; at the
    benchmark shape the launches fill whole waves of 132 SMs."""
    from rltrain_kernels.ops.common.vocab_tiles import GemmConfig
    from rltrain_kernels.ops.linear_logprobs.fused import wave_fitted_bounds

    gemm = GemmConfig()
    bounds = wave_fitted_bounds(151936, 2048, 2 * 16384, gemm, 132)
    assert [b - a for a, b in bounds] == [25344] * 5 + [151936 - 5 * 25344]
    assert (2048 // 128) * (25344 // 256) % 132 == 0
    for vocab, rows, limit, sms in [(1000, 37, 512, 4), (151936, 300, 32768, 132), (7, 1, 256, 132),
                                    (152071, 2048, 4096, 114)]:
        bounds = wave_fitted_bounds(vocab, rows, limit, gemm, sms)
        assert bounds[0][0] == 0 and bounds[-1][1] == vocab
        assert all(b0[1] == b1[0] for b0, b1 in zip(bounds, bounds[1:]))
        assert all(b - a <= max(limit, gemm.block_n) and (a % gemm.block_n == 0) for a, b in bounds)


# ----------------------------------------------------------------------------------------------------------------
def test_gemm_fallbacks_when_fp32_output_is_missing():
    """The CUDA-only fp32-output GEMMs (mm/baddbmm `out_dtype`) fall back, with one warning per kind, when torch
    lacks them: exercised on CPU by GEMMs that take CPU half tensors for the native path (where the overloads do
    not exist). The fallbacks: mm upcasts (fp32 products of bf16 inputs: exact but for the fp32 sum), the
    accumulation adds the product rounded to bf16."""
    import warnings

    from rltrain_kernels.ops.common.vocab_tiles import Fp32OutputGemms

    gemms = Fp32OutputGemms(native_device="cpu")
    a, b = torch.randn(37, 64, dtype=torch.bfloat16), torch.randn(64, 45, dtype=torch.bfloat16)
    exact = a.double() @ b.double()
    out = torch.full((37, 45), math.nan)
    with pytest.warns(RuntimeWarning, match=r"fp32-output GEMM \(mm\)"):
        gemms.mm(a, b, out)
    assert_rel_close(out, exact, threshold=1e-6, name="mm fallback")
    acc = torch.full((37, 45), math.nan)
    with pytest.warns(RuntimeWarning, match=r"fp32-output GEMM \(accumulate\)"):
        gemms.addmm(acc, a, b, beta=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # each kind warns once
        gemms.addmm(acc, a, b, beta=1.0)
        gemms.mm(a, b, out)
    # bf16 rounding of each product: 1.7e-3 relative here, not the exact sum
    assert 1e-4 < assert_rel_close(acc, 2 * exact, threshold=4e-3, name="accumulate fallback")
    assert gemms.native == {"mm": False, "accumulate": False}


def test_input_errors(device):
    hidden, weight, labels = make_inputs((4,), 100, 16, torch.float32, device)
    with pytest.raises(ValueError, match="weight has hidden size 8 but hidden has 16"):
        linear_logprobs(hidden, weight[:, :8], labels)
    with pytest.raises(ValueError, match=r"labels shape \(3,\) must equal hidden.shape\[:-1\]"):
        linear_logprobs(hidden, weight, labels[:3])
    with pytest.raises(TypeError, match="labels must be an int64 tensor"):
        linear_logprobs(hidden, weight, labels.int())
    with pytest.raises(TypeError, match="weight dtype torch.bfloat16 differs"):
        linear_logprobs(hidden, weight.bfloat16(), labels)
    with pytest.raises(TypeError, match="hidden must be bfloat16, float16 or float32"):
        linear_logprobs(hidden.double(), weight.double(), labels)
    with pytest.raises(ValueError, match="weight must have shape"):
        linear_logprobs(hidden, weight[0], labels)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        linear_logprobs(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="impl must be one of"):
        linear_logprobs(hidden, weight, labels, impl="cuda")
    if device == "cpu":
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 100\)"):
            linear_logprobs(hidden, weight, torch.full_like(labels, 100))


# ----------------------------------------------------------------------------------------------------------------
class _LargestStorage(TorchDispatchMode):
    """Records the largest storage (bytes) behind any tensor an aten op returns: allocations and views of them."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


def test_memory_bound_torch_path():
    """No op in forward or backward produces anything larger than one tile, an input or an output, while the
    tokens × vocab product is 15× the tile."""
    n, vocab, hidden_size = 300, 1000, 16
    config = ChunkConfig(token_chunk=64, vocab_chunk=320, block_v=256, align=1)
    hidden, weight, labels = make_inputs((n,), vocab, hidden_size, torch.bfloat16, "cpu")
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    with _LargestStorage() as probe:
        lp, ent = linear_logprobs(h, w, labels, impl="torch", chunk_config=config)
        (lp.sum() + ent.sum()).backward()
    allowed = max(64 * 320 * 4, vocab * hidden_size * 2, n * hidden_size * 4)   # fp32 tile, bf16 weight, ...
    assert probe.nbytes <= allowed < n * vocab * 4 / 10, (probe.nbytes, allowed)


def test_workspace_bound_is_independent_of_tokens():
    """CUDA paths' scratch at the real shape: the larger tile (cuBLAS: fp32 2048 × 15232; fused: bf16 dlogits of
    2048 × ≤ 32768) + one fp32 grad_hidden accumulator, any N."""
    sizes = {n: workspace_bytes(n, 151936, 4096, torch.bfloat16) for n in (8192, 32768, 10**6)}
    assert len(set(sizes.values())) == 1, sizes
    bound = sizes[32768]
    assert bound == 2048 * 32768 * 2 + 2048 * 4096 * 4
    assert bound <= 2048 * (16384 + 4096) * 4 < 0.3 * 2**30
    assert workspace_bytes(32768, 151936, 4096, torch.bfloat16, backward=False) == 2048 * 15232 * 4
    assert workspace_bytes(100, 1000, 64, torch.float32) == 100 * 1000 * 4  # fp32: no accumulator, tile ≤ N×V


# ----------------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_tp_group_gloo_two_ranks(tmp_path):
    """Vocab split unevenly over 2 CPU ranks (gloo, torch path), fp32 and bf16 in one spawn: outputs and
    grad_hidden equal the unsplit computation on both ranks, and the two grad_weight slices concatenate to the
    unsplit grad_weight."""
    from tests.kernels.ops.linear_logprobs_tp_worker import run_two_ranks

    vocab, split, temperature = 1007, 450, 0.8
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        hidden, weight, labels = make_inputs((3, 11), vocab, 32, dtype, "cpu", logit_std=5.0)
        cases[dtype_id(dtype)] = dict(hidden=hidden, weight=weight, labels=labels,
                                      g_logprob=torch.randn(labels.shape), g_entropy=torch.randn(labels.shape))
    results = run_two_ranks(tmp_path, _free_port(), cases, split, temperature, timeout_s=120)
    for name, case in cases.items():
        dtype = case["hidden"].dtype
        ref_lp, ref_ent, ref_gh, ref_gw = reference(case["hidden"], case["weight"], case["labels"], temperature,
                                                    case["g_logprob"], case["g_entropy"])
        for rank, res in enumerate(results):
            got = res[name]
            assert_rel_close(got["logprobs"], ref_lp, dtype=dtype, name=f"{name} rank{rank} logprobs")
            assert_rel_close(got["entropy"], ref_ent, dtype=dtype, name=f"{name} rank{rank} entropy")
            assert_rel_close(got["grad_hidden"], ref_gh, dtype=dtype, name=f"{name} rank{rank} grad_hidden")
        grad_weight = torch.cat([results[0][name]["grad_weight"], results[1][name]["grad_weight"]])
        assert_rel_close(grad_weight, ref_gw, dtype=dtype, name=f"{name} grad_weight")


# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [151936, 152064 + 7])
@pytest.mark.parametrize("impl", IMPLS + ["fused"])
def test_gpu_real_vocab(vocab, impl):
    hidden, weight, labels = make_inputs((1000,), vocab, 1024, torch.bfloat16, "cuda", logit_std=5.0)
    check(hidden, weight, labels, 0.7, impl, forward_threshold=REL_THRESHOLD[torch.float32] if impl == "fused" else None)
    config = ChunkConfig(token_chunk=256, vocab_chunk=40000)
    if impl == "fused":   # half inputs only; the same ragged tiling in fp16
        hidden, weight, labels = make_inputs((999,), vocab, 256, torch.float16, "cuda", logit_std=5.0)
        check(hidden, weight, labels, 1.3, impl, config, forward_threshold=REL_THRESHOLD[torch.float32])
        return
    hidden, weight, labels = make_inputs((999,), vocab, 256, torch.float32, "cuda", logit_std=5.0)
    check(hidden, weight, labels, 1.3, impl, config)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 37])
@pytest.mark.parametrize("impl", IMPLS + ["fused"])
def test_gpu_half_dlogits_in_place_many_draws(rows, impl):
    """Half inputs turn each fp32 logits row into dlogits written over its own first half; the row pass's warps
    must not overwrite logits another warp has yet to read (a race the interpreter cannot show: 40% of 1-row bf16
    draws were off by up to 0.8 before the fence). Many fresh draws, each within the bf16 bound."""
    for _ in range(40):
        hidden, weight, labels = make_inputs((rows,), 4096, 64, torch.bfloat16, "cuda", logit_std=3.0)
        check(hidden, weight, labels, 1.0, impl)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ADVERSARIAL)
def test_gpu_fused_adversarial(case):
    check_adversarial(case, "fused", torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_gpu_auto_picks_fused_for_half_inputs():
    from rltrain_kernels.ops.linear_logprobs import function
    from rltrain_kernels.ops.linear_logprobs.fused import FusedTiles
    from rltrain_kernels.ops.common.row_pass import TritonTiles

    hidden, weight, _ = make_inputs((8,), 100, 64, torch.bfloat16, "cuda")
    expected = FusedTiles if torch.cuda.get_device_capability()[0] >= 9 else TritonTiles
    assert type(function._tiles("auto", hidden, weight, ChunkConfig())) is expected
    assert type(function._tiles("auto", hidden.float(), weight.float(), ChunkConfig())) is TritonTiles
    # rows starting 2 B past a 16 B boundary: TMA cannot address them
    assert type(function._tiles("auto", hidden[:, 1:], weight[:, 1:], ChunkConfig())) is TritonTiles


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """N·V = 16384 · 152071 ≈ 2.49e9 > 2^31, default tiles."""
    n, vocab = 16384, 152064 + 7
    assert n * vocab > 2**31
    hidden, weight, labels = make_inputs((n,), vocab, 64, torch.bfloat16, "cuda", logit_std=5.0)
    g_lp, g_ent = upstream_grads("dense", labels.shape, "cuda")
    lp, ent, gh, gw = run(hidden, weight, labels, 1.0, g_lp, g_ent, "auto")
    ref = reference(hidden, weight, labels, 1.0, g_lp, g_ent, row_chunk=1024)
    for ours, theirs, name in zip((lp, ent, gh, gw), ref, ("logprobs", "entropy", "grad_hidden", "grad_weight")):
        assert_rel_close(ours, theirs, dtype=torch.bfloat16, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("return_entropy", [True, False])
def test_gpu_peak_memory(return_entropy):
    """Extra peak memory of forward + backward at the benchmark's N=32768 shape stays ≤ 0.3 GiB: peak minus
    (inputs + outputs + gradients)."""
    n, vocab, hidden_size = 32768, 151936, 4096
    hidden, weight, labels = make_inputs((n,), vocab, hidden_size, torch.bfloat16, "cuda")
    hidden.requires_grad_()
    weight.requires_grad_()
    warm_lp, warm_ent = linear_logprobs(hidden[:64], weight, labels[:64])  # Triton compile, cuBLAS workspace
    (warm_lp.sum() + warm_ent.sum()).backward()
    hidden.grad = weight.grad = None
    del warm_lp, warm_ent
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = linear_logprobs(hidden, weight, labels, return_entropy=return_entropy)
    loss = lp.sum() + (ent.sum() if ent is not None else 0)
    loss.backward()
    torch.cuda.synchronize()
    necessary = hidden.numel() * 2 + weight.numel() * 2 + 2 * n * 4
    extra = torch.cuda.max_memory_allocated() - base - necessary
    assert extra <= 0.3 * 2**30, f"extra peak {extra / 2**30:.3f} GiB"
    assert_finite(hidden.grad, "grad_hidden")
    assert_finite(weight.grad, "grad_weight")
