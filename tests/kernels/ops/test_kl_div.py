"""linear_kl_div against the dense float64 reference (naive.py): both paths (chunked torch; cuBLAS + the Triton row
pass, interpreted on CPU), both directions, every reduction, the loss and both gradients; temperature, a teacher
hidden size unlike the student's, vocabularies that are not a multiple of the block, ignored tokens, every layout
of upstream gradient, adversarial logits, identical student and teacher, input checks and the memory bound.

Run: `pytest tests/kernels/ops/test_kl_div.py` (CPU, ~1-2 min, most of it the Triton interpreter). Interpreted
shapes stay small (N ≤ 21, V ≤ 1007) with 256-wide blocks, so rows cross block edges and chunks cross token edges.
The `gpu`-marked tests run the real vocabulary and the peak-memory goal at N = 8192, V = 151936 on a CUDA machine.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rltrain_kernels.ops.kl_div import (
    KLDivChunkConfig, LinearKLDivLoss, linear_kl_div, naive_linear_kl_div, workspace_bytes,
)
from tests.helpers import REL_THRESHOLD, assert_finite, assert_rel_close, case_id, dtype_id

IGNORE = -100
# 21 tokens in chunks of 7; V = 1007 in 256-wide blocks: 3 full blocks and one of 239.
TILED = KLDivChunkConfig(token_chunk=7, align=1, block_v=256)
IMPLS = ["torch", "triton"]
DIRECTIONS = ["forward", "reverse"]
REDUCTIONS = ["none", "sum", "mean", "batchmean"]


def make_inputs(shape, vocab, hidden_size, teacher_size, dtype, device, std=3.0, ignore_frac=0.2, offset=0.0):
    """Student and teacher with independent random heads: logits of std ≈ `std` each; ~ignore_frac of the labels
    set to IGNORE; `offset` shifts every student and teacher logit (hidden[..., 0] = 1, weight[:, 0] = offset)."""
    def side(size):
        hidden = torch.randn(*shape, size, device=device)
        weight = torch.randn(vocab, size, device=device) * (std / math.sqrt(size))
        if offset:
            hidden[..., 0] = 1.0
            weight[:, 0] = offset
        return hidden.to(dtype), weight.to(dtype)

    hidden, weight = side(hidden_size)
    teacher_hidden, teacher_weight = side(teacher_size)
    labels = torch.randint(0, vocab, shape, device=device)
    labels[torch.rand(shape, device=device) < ignore_frac] = IGNORE
    return hidden, weight, teacher_hidden, teacher_weight, labels


def upstream(kind: str, reduction: str, shape, device):
    """The upstream gradient of the output: a scalar for a reduced loss, else every layout autograd can hand over."""
    if reduction != "none":
        return torch.tensor(1.0 if kind == "one" else -0.37, device=device)
    n = math.prod(shape)
    if kind == "dense":
        return torch.randn(shape, device=device)
    if kind == "expanded":   # what .sum() / .mean() produce: stride 0
        return torch.randn((1,) * len(shape), device=device).expand(shape)
    if kind == "strided":
        return torch.randn(2 * n, device=device)[::2].view(shape)
    if kind == "zero":
        return torch.zeros(shape, device=device)
    raise ValueError(kind)


def reference(inputs, g, **options):
    """float64 output and gradients (grad_hidden, grad_weight) of ⟨output, g⟩ from the dense formula."""
    hidden, weight, teacher_hidden, teacher_weight, labels = inputs
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    out = naive_linear_kl_div(h, w, teacher_hidden.double(), teacher_weight.double(), labels=labels,
                              ignore_index=IGNORE, compute_dtype=torch.float64, **options)
    (out * g.double()).sum().backward()
    return out.detach(), h.grad, w.grad


def run(inputs, g, impl, config=TILED, **options):
    """Ours on fresh leaves; backward with exactly the upstream gradient g."""
    hidden, weight, teacher_hidden, teacher_weight, labels = inputs
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    out = linear_kl_div(h, w, teacher_hidden, teacher_weight, labels=labels, ignore_index=IGNORE, impl=impl,
                        chunk_config=config, **options)
    out.backward(g)
    return out.detach(), h.grad, w.grad


def check(inputs, impl, g_kind="dense", config=TILED, threshold=None, forward_threshold=None, **options):
    """Ours vs the float64 reference: output within forward_threshold (default: the fp32 bound: the logits are fp32
    whatever the inputs), gradients within threshold (default: by dtype). Returns ours and the reference."""
    hidden, labels = inputs[0], inputs[4]
    g = upstream(g_kind, options.get("reduction", "batchmean"), labels.shape, hidden.device)
    out, gh, gw = run(inputs, g, impl, config, **options)
    ref, ref_gh, ref_gw = reference(inputs, g, **options)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert_rel_close(out, ref, threshold=forward_threshold or REL_THRESHOLD[torch.float32], name="kl")
    assert gh.dtype == hidden.dtype and gw.dtype == inputs[1].dtype
    assert_rel_close(gh, ref_gh, dtype=hidden.dtype, threshold=threshold, name="grad_hidden")
    assert_rel_close(gw, ref_gw, dtype=hidden.dtype, threshold=threshold, name="grad_weight")
    ignored = labels == IGNORE
    assert (gh[ignored] == 0).all(), "ignored tokens must get exactly zero gradient"
    if out.dim():
        assert (out[ignored] == 0).all(), "ignored tokens must give exactly zero KL"
    return (out, gh, gw), (ref, ref_gh, ref_gw)


def rounding_bounds(inputs, g, temperature: float, direction: str):
    """Elementwise bounds on |ours − float64| of the per-token KL, grad_hidden and grad_weight from fp32 rounding
    alone, for answers that are cancellations of fp32 logits. Each logit may be off by ε = γ_H·ℓ ≈ H·u·ℓ (u = 2⁻²⁴,
    ℓ = max_j Σ_i |h_i W_ji| / T): the worst case of a length-H dot product in any order, FMA or not, ~√H above
    the typical error, which covers the O(1) factors left out of what follows. Such errors move a token's KL by
    ≲ ε·(1 + KL), each dlogit by ≲ ε·(p_s + p_t) (forward) or ε·p_s·(1 + |log p_s − log p_t| + KL) (reverse), and
    GEMMs 3-4 carry the dlogits' errors through |W| and |h| (their own rounding, γ_V relative to |dlogits|·|W|, is
    smaller while H·ℓ > V, as here). Ignored tokens get a bound of 0."""
    hidden, weight, teacher_hidden, teacher_weight, labels = (x.detach().double().cpu() if x.is_floating_point()
                                                              else x.cpu() for x in inputs)
    u = 2.0 ** -24
    valid = (labels != IGNORE).double()
    log_s = (hidden @ weight.T / temperature).log_softmax(-1)
    log_t = (teacher_hidden @ teacher_weight.T / temperature).log_softmax(-1)
    p_s, p_t, log_ratio = log_s.exp(), log_t.exp(), log_s - log_t
    kl = valid * ((p_t * -log_ratio).sum(-1) if direction == "forward" else (p_s * log_ratio).sum(-1))
    eps = u * torch.maximum(hidden.shape[-1] * (hidden.abs() @ weight.abs().T).amax(-1),
                            teacher_hidden.shape[-1] * (teacher_hidden.abs() @ teacher_weight.abs().T).amax(-1))
    eps = eps * valid / temperature
    if direction == "forward":
        dlogit_size = p_s + p_t
    else:
        dlogit_size = p_s * (1 + log_ratio.abs() + kl[..., None])
    dlogit_bound = (eps * g.detach().double().cpu().abs() / temperature)[..., None] * dlogit_size
    grad_hidden = dlogit_bound @ weight.abs()
    grad_weight = dlogit_bound.reshape(-1, weight.shape[0]).T @ hidden.abs().reshape(-1, hidden.shape[-1])
    return eps * (1 + kl), grad_hidden, grad_weight


def assert_within(actual, expected, bound, name):
    """|actual − expected| ≤ bound elementwise (exactly equal where bound is 0); the message names the worst."""
    assert actual.shape == expected.shape == bound.shape, (name, actual.shape, expected.shape, bound.shape)
    assert_finite(actual, name)
    err = (actual.detach().double().cpu() - expected.double().cpu()).abs()
    over = err - bound
    worst = int(over.flatten().argmax())
    assert over.max() <= 0, (f"{name}: |error| {err.flatten()[worst]:.3e} > bound {bound.flatten()[worst]:.3e} "
                             f"at flat index {worst}")


def check_within_rounding(inputs, impl, temperature: float, direction: str):
    """reduction="none", dense upstream gradient: KL and both gradients against float64 within rounding_bounds, and
    ignored tokens exactly 0. Returns ours."""
    labels = inputs[4]
    g = upstream("dense", "none", labels.shape, labels.device)
    options = dict(reduction="none", direction=direction, temperature=temperature)
    out, gh, gw = run(inputs, g, impl, **options)
    ref, ref_gh, ref_gw = reference(inputs, g, **options)
    kl_bound, gh_bound, gw_bound = rounding_bounds(inputs, g, temperature, direction)
    assert out.dtype == torch.float32 and gh.dtype == inputs[0].dtype and gw.dtype == inputs[1].dtype
    assert_within(out, ref, kl_bound, "kl")
    assert_within(gh, ref_gh, gh_bound, "grad_hidden")
    assert_within(gw, ref_gw, gw_bound, "grad_weight")
    ignored = labels == IGNORE
    assert (out[ignored] == 0).all() and (gh[ignored] == 0).all(), "ignored tokens must give exactly zero"
    return out, gh, gw


# ----------------------------------------------------------------------------------------------------------------
SHAPES = [  # (token shape, V, H, H_teacher, temperature, logit std, config)
    ((21,), 1007, 32, 48, 0.7, 5.0, TILED),
    ((3, 7), 1000, 48, 16, 1.3, 1.0, TILED),
    ((2,), 500, 32, 32, 1.0, 3.0, None),
]
SHAPE_IDS = [case_id(N="x".join(map(str, s[0])), V=s[1], H=s[2], Ht=s[3], T=s[4], std=s[5],
                     tiled=int(s[6] is not None)) for s in SHAPES]


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape,vocab,hidden_size,teacher_size,temperature,std,config", SHAPES, ids=SHAPE_IDS)
def test_matches_reference(impl, direction, dtype, shape, vocab, hidden_size, teacher_size, temperature, std, config,
                           device):
    """Loss and both gradients; bf16 inputs: the loss at the fp32 bound (fp32 logits of the same bf16 inputs),
    gradients at bf16's 1e-2 (dlogits round to bf16 once, grad_weight sums chunks in bf16)."""
    inputs = make_inputs(shape, vocab, hidden_size, teacher_size, dtype, device, std=std)
    check(inputs, impl, config=config, temperature=temperature, direction=direction, reduction="batchmean")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_reductions(reduction, direction, impl, device):
    """Every reduction; a reduced loss with an upstream gradient of −0.37 (the backward's in-place scaling)."""
    inputs = make_inputs((3, 5), 300, 32, 24, torch.float32, device)
    check(inputs, impl, temperature=0.9, direction=direction, reduction=reduction)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("g_kind,reduction", [("expanded", "none"), ("strided", "none"), ("zero", "none"),
                                              ("one", "sum"), ("one", "mean")])
def test_upstream_gradients(g_kind, reduction, impl, device):
    inputs = make_inputs((4, 5), 300, 32, 40, torch.float32, device)
    g = upstream(g_kind, reduction, (4, 5), device)
    out, gh, gw = run(inputs, g, impl, reduction=reduction, direction="reverse")
    ref, ref_gh, ref_gw = reference(inputs, g, reduction=reduction, direction="reverse")
    assert_rel_close(out, ref, name="kl")
    if g_kind == "zero":
        assert (gh == 0).all() and (gw == 0).all()
        return
    assert_rel_close(gh, ref_gh, name="grad_hidden")
    assert_rel_close(gw, ref_gw, name="grad_weight")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_tokens_ignored(reduction, impl, device):
    """Every label ignored: loss 0 (mean: 0, not 0/0), zero gradients, finite everywhere."""
    hidden, weight, teacher_hidden, teacher_weight, labels = make_inputs((6,), 300, 16, 16, torch.float32, device)
    labels.fill_(IGNORE)
    inputs = (hidden, weight, teacher_hidden, teacher_weight, labels)
    out, gh, gw = run(inputs, upstream("dense", reduction, (6,), device), impl, reduction=reduction)
    assert (out == 0).all() and (gh == 0).all() and (gw == 0).all()



@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_no_tokens(reduction, device):
    hidden, weight, teacher_hidden, teacher_weight, labels = make_inputs((0,), 300, 16, 24, torch.float32, device)
    out, gh, gw = run((hidden, weight, teacher_hidden, teacher_weight, labels),
                      upstream("dense", reduction, (0,), device), "torch", reduction=reduction)
    assert out.shape == ((0,) if reduction == "none" else ()) and (out == 0).all()
    assert gh.shape == (0, 16) and (gw == 0).all()


@pytest.mark.parametrize("reduction,teacher_gemms", [("sum", 3), ("none", 6)])
def test_teacher_gemms_per_chunk(reduction, teacher_gemms, monkeypatch):
    """A reduced loss runs the teacher's GEMM once per chunk (the gradients come from the forward); "none" runs it
    again in the backward. 3 chunks of 7 tokens; the teacher's hidden size (24) tells its GEMMs apart."""
    from rltrain_kernels.ops.kl_div import chunk

    calls = []
    real = chunk.mm_fp32
    monkeypatch.setattr(chunk, "mm_fp32", lambda a, b, out: calls.append(a.shape[1]) or real(a, b, out=out))
    inputs = make_inputs((21,), 300, 32, 24, torch.float32, "cpu")
    run(inputs, upstream("dense", reduction, (21,), "cpu"), "torch", reduction=reduction)
    assert calls.count(24) == teacher_gemms, calls

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_identical_teacher_gives_zero(direction, impl, device):
    """Student = teacher (same hidden and head): every token's KL and the gradients are 0 in exact arithmetic. Here
    (torch, the interpreter) exactly 0: the cross term relative to both maxima and the matching normalisers cancel
    exactly, not to within rounding. Natively the two tiles come from separate cuBLAS calls and Triton may fuse
    z·(1/T) − m into an FMA, so there they are 0 to within the rounding of the logits (rounding_bounds)."""
    hidden, weight, _, _, labels = make_inputs((2, 5), 1007, 32, 32, torch.float32, device, std=8.0)
    out, gh, gw = check_within_rounding((hidden, weight, hidden, weight, labels), impl, 0.8, direction)
    if device == "cpu":
        assert (out == 0).all() and (gh == 0).all() and (gw == 0).all(), (out.abs().max(), gh.abs().max())


# fp32 logits at |z| ≈ 200 carry 200·2⁻²⁴ ≈ 1.2e-5 absolute rounding before any kernel runs; a max not subtracted
# (exp underflow/overflow) gives O(1) errors or NaN.
OFFSET = 200.0
ADVERSARIAL = ["large_negative", "large_positive", "dominating", "non_contiguous"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", ADVERSARIAL)
def test_adversarial(case, direction, impl, device):
    options = dict(direction=direction, reduction="none")
    if case in ("large_negative", "large_positive"):
        offset = -OFFSET if case == "large_negative" else 0.6 * OFFSET
        inputs = make_inputs((9,), 1007, 32, 16, torch.float32, device, offset=offset)
        # the common offset cancels in every difference, leaving each logit's rounding at |z| ≈ 200, so the error
        # is judged against it elementwise (rounding_bounds; CPU: at most 0.3 of the bound over 300 draws)
        check_within_rounding(inputs, impl, 0.6 if offset > 0 else 1.0, direction)
        return
    if case == "dominating":
        # one column ~25 above the rest for both, on different columns in some rows: KL ≈ 25 there, ≈ 0 elsewhere
        hidden, weight, teacher_hidden, teacher_weight, labels = make_inputs((9,), 1007, 32, 32, torch.float32,
                                                                             device, std=1.0)
        for h, w, column in ((hidden, weight, 500), (teacher_hidden, teacher_weight, 500)):
            h[:, 1] = 1.0
            w[:, 1] = 0.0
            w[column, 1] = 25.0
        teacher_hidden[:3, 1] = 0.0   # three rows where the teacher does not share the student's peak
        labels[:3] = labels[:3].clamp(min=0)   # and count them: with all three ignored the KL is rounding alone
        inputs = (hidden, weight, teacher_hidden, teacher_weight, labels)
    else:   # hidden and teacher_hidden as transposed views: [T, B, H] seen as [B, T, H]
        base = make_inputs((4, 3), 300, 32, 24, torch.float32, device)
        inputs = tuple(x.transpose(0, 1).contiguous().transpose(0, 1) if x.dim() == 3 else x for x in base[:4])
        inputs += (base[4].transpose(0, 1).contiguous().transpose(0, 1),)
        assert not inputs[0].is_contiguous() and not inputs[2].is_contiguous()
    check(inputs, impl, **options)


@pytest.mark.parametrize("impl", IMPLS)
def test_float16(impl, device):
    inputs = make_inputs((11,), 700, 32, 48, torch.float16, device, std=4.0)
    check(inputs, impl, temperature=0.8, direction="forward", reduction="mean")



def test_grad_weight_fp32_accumulation():
    """bf16 inputs over 48 chunks: grad_weight summed in bf16 rounds once per chunk (~6.5e-3 off float64 here),
    with grad_weight_fp32 once in all (~2.8e-3, what dlogits' own bf16 rounding leaves); grad_hidden unchanged."""
    inputs = make_inputs((96,), 300, 32, 24, torch.bfloat16, "cpu", ignore_frac=0.0)
    g = upstream("one", "sum", None, "cpu")
    _, ref_gh, ref_gw = reference(inputs, g, reduction="sum")
    errors = {}
    for fp32 in (False, True):
        config = KLDivChunkConfig(token_chunk=2, align=1, grad_weight_fp32=fp32)
        _, gh, gw = run(inputs, g, "torch", config, reduction="sum")
        assert gw.dtype == torch.bfloat16
        assert_rel_close(gh, ref_gh, name="grad_hidden")
        errors[fp32] = assert_rel_close(gw, ref_gw, name="grad_weight")
    assert errors[True] < 4e-3 and errors[False] > 1.5 * errors[True], errors

# ----------------------------------------------------------------------------------------------------------------
def test_no_grad_frozen_weight_and_module(device):
    """Without autograd the values are the same; a frozen LM head gets no gradient and hidden's is unchanged;
    LinearKLDivLoss is the function with its options fixed."""
    inputs = make_inputs((3, 5), 300, 32, 24, torch.float32, device)
    hidden, weight, teacher_hidden, teacher_weight, labels = inputs
    options = dict(temperature=0.7, direction="reverse", reduction="mean", labels=labels)
    with torch.no_grad():
        plain = linear_kl_div(hidden, weight, teacher_hidden, teacher_weight, **options, impl="triton",
                              chunk_config=TILED)
        per_token = linear_kl_div(hidden, weight, teacher_hidden, teacher_weight, **dict(options, reduction="none"))
    assert plain.shape == () and per_token.shape == (3, 5)
    h = hidden.clone().requires_grad_()
    module = LinearKLDivLoss(temperature=0.7, direction="reverse", reduction="mean", chunk_config=TILED)
    loss = module(h, weight, teacher_hidden, teacher_weight, labels)
    loss.backward()
    ref, ref_gh, _ = reference(inputs, torch.tensor(1.0), temperature=0.7, direction="reverse", reduction="mean")
    for value in (plain, loss.detach(), per_token.sum() / (labels != IGNORE).sum()):
        assert_rel_close(value, ref, name="loss")
    assert_rel_close(h.grad, ref_gh, name="grad_hidden")
    assert "reduction='mean'" in repr(module)


def test_single_backward():
    inputs = make_inputs((4,), 100, 16, 16, torch.float32, "cpu")
    h = inputs[0].clone().requires_grad_()
    loss = linear_kl_div(h, *inputs[1:4])
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through it twice"):
        loss.backward()


BAD_INPUTS = [  # (what to change, message)
    ("teacher_vocab", "teacher_weight has 99 vocabulary rows but weight has 100"),
    ("teacher_requires_grad", "teacher_hidden requires grad"),
    ("teacher_weight_requires_grad", "teacher_weight requires grad"),
    ("teacher_hidden_size", "teacher_weight has hidden size 24 but teacher_hidden has 20"),
    ("hidden_size", "weight has hidden size 8 but hidden has 16"),
    ("teacher_tokens", r"teacher_hidden shape \(3, 24\) must have hidden's leading shape \(4,\)"),
    ("weight_dtype", "weight dtype torch.bfloat16 differs from hidden dtype torch.float32"),
    ("teacher_dtype", "teacher_hidden must be bfloat16, float16 or float32"),
    ("labels_shape", r"labels shape \(3,\) must equal hidden.shape\[:-1\]"),
    ("labels_dtype", "labels must be an integer tensor"),
    ("weight_dim", "weight must have shape"),
    ("temperature", "temperature must be a finite number > 0"),
    ("reduction", "reduction must be one of none, sum, mean, batchmean"),
    ("direction", "direction must be one of forward, reverse"),
    ("impl", "impl must be one of auto, triton, torch"),
    ("chunk_config", "chunk_config must be a KLDivChunkConfig"),
]


@pytest.mark.parametrize("change,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_input_errors(change, message):
    hidden, weight, teacher_hidden, teacher_weight, labels = make_inputs((4,), 100, 16, 24, torch.float32, "cpu")
    args = dict(hidden=hidden, weight=weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight)
    options = dict(labels=labels)
    if change == "teacher_vocab":
        args["teacher_weight"] = teacher_weight[:99]
    elif change == "teacher_requires_grad":
        args["teacher_hidden"] = teacher_hidden.clone().requires_grad_()
    elif change == "teacher_weight_requires_grad":
        args["teacher_weight"] = teacher_weight.clone().requires_grad_()
    elif change == "teacher_hidden_size":
        args["teacher_hidden"] = teacher_hidden[:, :20]
    elif change == "hidden_size":
        args["weight"] = weight[:, :8]
    elif change == "teacher_tokens":
        args["teacher_hidden"] = teacher_hidden[:3]
    elif change == "weight_dtype":
        args["weight"] = weight.bfloat16()
    elif change == "teacher_dtype":
        args["teacher_hidden"], args["teacher_weight"] = teacher_hidden.double(), teacher_weight.double()
    elif change == "labels_shape":
        options["labels"] = labels[:3]
    elif change == "labels_dtype":
        options["labels"] = labels.float()
    elif change == "weight_dim":
        args["weight"] = weight[0]
    elif change == "chunk_config":
        options["chunk_config"] = dict(token_chunk=8)
    else:
        options[change] = {"temperature": 0.0, "reduction": "token-mean", "direction": "both", "impl": "cuda"}[change]
    with pytest.raises((ValueError, TypeError), match=message):
        linear_kl_div(**args, **options)


def test_chunk_config_and_workspace_bound():
    """Default chunks at the benchmark's shape: 640 rows, two fp32 tiles + the fp32 grad_hidden accumulator, under
    1 GiB and the same for any N; explicit token_chunk and bad values."""
    for n in (8192, 32768, 10**6):
        assert workspace_bytes(n, 151936, 2048, torch.bfloat16) == 2 * 640 * 151936 * 4 + 640 * 2048 * 4
    assert workspace_bytes(8192, 151936, 2048, torch.bfloat16) < 2**30 < 8192 * 151936 * 4 / 4
    assert workspace_bytes(100, 1000, 64, torch.float32) == 2 * 100 * 1000 * 4   # fp32: no accumulator
    fp32_weight = KLDivChunkConfig(grad_weight_fp32=True)
    assert (workspace_bytes(8192, 151936, 2048, torch.bfloat16, fp32_weight)
            == workspace_bytes(8192, 151936, 2048, torch.bfloat16) + 151936 * 2048 * 4)
    assert KLDivChunkConfig(token_chunk=300).rows(151936) == 300
    assert KLDivChunkConfig(workspace_bytes=1).rows(151936) == 128
    with pytest.raises(ValueError, match="KLDivChunkConfig.token_chunk must be a positive int"):
        KLDivChunkConfig(token_chunk=0)
    with pytest.raises(ValueError, match="KLDivChunkConfig.block_v must be a power of two"):
        KLDivChunkConfig(block_v=300)
    with pytest.raises(ValueError, match="KLDivChunkConfig.grad_weight_fp32 must be a bool"):
        KLDivChunkConfig(grad_weight_fp32=1)


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


@pytest.mark.parametrize("reduction", ["batchmean", "none"])
def test_memory_bound_torch_path(reduction):
    """No op in forward or backward produces anything larger than the two fp32 tiles, an input or an output, while
    the tokens × vocab product is 12× those tiles."""
    n, vocab, hidden_size = 300, 1000, 16
    config = KLDivChunkConfig(token_chunk=12, align=1)
    hidden, weight, teacher_hidden, teacher_weight, labels = make_inputs((n,), vocab, hidden_size, 24,
                                                                          torch.bfloat16, "cpu")
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    with _LargestStorage() as probe:
        out = linear_kl_div(h, w, teacher_hidden, teacher_weight, labels=labels, reduction=reduction, impl="torch",
                            chunk_config=config)
        out.sum().backward()
    allowed = max(2 * 12 * vocab * 4, vocab * 24 * 2, n * 24 * 4)   # the tiles, the teacher's head, ...
    assert probe.nbytes <= allowed < n * vocab * 4 / 10, (probe.nbytes, allowed)


# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("vocab", [151936, 152064 + 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_gpu_real_vocab(dtype, vocab, direction):
    """The real vocabulary (and a ragged one) on the GPU with the default chunks crossed: 1000 tokens, 10% ignored;
    the float64 reference on the same inputs."""
    inputs = make_inputs((1000,), vocab, 256, 512, dtype, "cuda", std=5.0, ignore_frac=0.1)
    config = KLDivChunkConfig(token_chunk=384)
    check(inputs, "triton", config=config, temperature=0.7, direction=direction, reduction="mean")
    check(inputs, "triton", g_kind="strided", config=config, direction=direction, reduction="none")


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["batchmean", "none"])
def test_gpu_peak_memory(reduction):
    """Forward + backward at N = 8192, V = 151936, H = 2048 (student) / 4096 (teacher), bf16: the peak beyond the
    inputs and the gradients stays ≤ 1 GiB (the default workspace is 0.73 GiB), far below the 4.6 GiB that one
    tokens × vocab fp32 logits tensor would take."""
    n, vocab = 8192, 151936
    hidden, weight, teacher_hidden, teacher_weight, labels = make_inputs((n,), vocab, 2048, 4096, torch.bfloat16,
                                                                          "cuda", ignore_frac=0.1)
    hidden.requires_grad_()
    weight.requires_grad_()
    warm = linear_kl_div(hidden[:64], weight, teacher_hidden[:64], teacher_weight, reduction=reduction)
    warm.sum().backward()   # Triton compile, cuBLAS workspace
    hidden.grad = weight.grad = None
    del warm
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = linear_kl_div(hidden, weight, teacher_hidden, teacher_weight, labels=labels, reduction=reduction)
    out.sum().backward()
    torch.cuda.synchronize()
    grads = hidden.numel() * 2 + weight.numel() * 2
    extra = torch.cuda.max_memory_allocated() - base - grads
    assert extra <= 2**30, f"extra peak beyond the gradients {extra / 2**30:.3f} GiB"
    assert extra + grads < n * vocab * 4 / 3
    assert_finite(hidden.grad, "grad_hidden")
    assert_finite(weight.grad, "grad_weight")
    assert (hidden.grad[labels == IGNORE] == 0).all()
