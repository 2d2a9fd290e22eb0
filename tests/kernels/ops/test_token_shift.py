"""Token shift: the Triton kernels (interpreted on CPU, native on GPU) against the naive reference (one subtraction
in x's dtype on both sides, so outputs and gradients are compared exactly) and against float64; packed rows vs a
loop over their sequences; token-by-token calls chained through the cache vs one call; bad arguments.

Run: `pytest tests/kernels/ops/test_token_shift.py` (CPU through the Triton interpreter: ~15 s); `gpu`-marked tests
run real sizes on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from rltrain_kernels.ops.token_shift import naive_token_shift, token_shift
from tests.helpers import assert_rel_close, case_id, dtype_id

# (B, T, D): two channel blocks (D = 130), one token, several token blocks (T = 70).
SHAPES = [(2, 9, 40), (3, 5, 130), (1, 1, 16), (2, 70, 24)]


def outputs_and_grads(fn, x, cache, dy, dcache, cu_seqlens=None):
    """[out, cache_out, dx(, dcache)] for the loss ⟨out, dy⟩ + ⟨cache_out, dcache⟩ (float64 sums)."""
    out, cache_out = fn(x, cu_seqlens, cache, True)
    leaves = [t for t in (x, cache) if t is not None]
    loss = (out.double() * dy.double()).sum() + (cache_out.double() * dcache.double()).sum()
    return [out, cache_out, *torch.autograd.grad(loss, leaves)]


def fresh(t: torch.Tensor | None, dtype=None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(dtype or t.dtype).requires_grad_()


def check(x, cache, cu_seqlens, dtype):
    """Kernel vs the reference on the same dtype (exact) and vs float64 (within the dtype's threshold)."""
    N = x.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    dy = torch.randn_like(x)
    dcache = torch.randn(N, x.shape[-1], dtype=dtype, device=x.device)
    got = outputs_and_grads(token_shift, x, cache, dy, dcache, cu_seqlens)
    same = outputs_and_grads(naive_token_shift, fresh(x), fresh(cache), dy, dcache, cu_seqlens)
    wide = outputs_and_grads(naive_token_shift, fresh(x, torch.float64), fresh(cache, torch.float64), dy, dcache,
                             cu_seqlens)
    names = ["out", "cache_out", "dx", "dcache"]
    assert got[0].dtype == dtype and got[1].dtype == dtype
    for name, a, b, c in zip(names, got, same, wide):
        assert torch.equal(a, b), f"{name}: differs from the reference in {dtype}: {(a.double() - b.double()).abs().max()}"
        assert_rel_close(a, c, dtype=dtype, name=name)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("with_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: case_id(B=s[0], T=s[1], D=s[2]))
def test_token_shift_matches_reference(shape, dtype, with_cache, device):
    B, T, D = shape
    x = torch.randn(B, T, D, dtype=dtype, device=device, requires_grad=True)
    cache = torch.randn(B, D, dtype=dtype, device=device, requires_grad=True) if with_cache else None
    check(x, cache, None, dtype)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("with_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_packed_rows_match_reference_and_each_sequence_alone(dtype, with_cache, device):
    """A packed row with empty and one-token sequences and one spanning several tiles: against the reference, and
    against token_shift on each sequence alone (an empty sequence passes its cache on, or returns zeros)."""
    D = 20
    cu_seqlens = torch.tensor([0, 1, 1, 6, 50, 51], device=device)
    N, T = len(cu_seqlens) - 1, int(cu_seqlens[-1])
    x = torch.randn(1, T, D, dtype=dtype, device=device, requires_grad=True)
    cache = torch.randn(N, D, dtype=dtype, device=device, requires_grad=True) if with_cache else None
    check(x, cache, cu_seqlens, dtype)
    out, cache_out = token_shift(x, cu_seqlens, cache, output_cache=True)
    offsets = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(offsets, offsets[1:])):
        out_n, cache_n = token_shift(x[:, start:end], None, None if cache is None else cache[n:n + 1], True)
        assert torch.equal(out[:, start:end], out_n), f"sequence {n}"
        assert torch.equal(cache_out[n:n + 1], cache_n), f"sequence {n}: cache"


def test_token_by_token_through_the_cache_equals_one_call(device):
    """Decoding: one token per call, each call's returned cache fed to the next, gives the one-call result."""
    B, T, D = 3, 6, 33
    x = torch.randn(B, T, D, device=device)
    cache = torch.randn(B, D, device=device)
    full, final = token_shift(x, cache=cache, output_cache=True)
    steps = []
    for t in range(T):
        out, cache = token_shift(x[:, t:t + 1], cache=cache, output_cache=True)
        steps.append(out)
    assert torch.equal(torch.cat(steps, 1), full) and torch.equal(cache, final)


@pytest.mark.parametrize("used", ["out", "cache"])
def test_one_output_unused(used, device):
    """The loss through out alone (cache_out unused) or through the returned cache alone (out unused)."""
    x = torch.randn(2, 7, 12, device=device, requires_grad=True)
    cache = torch.randn(2, 12, device=device, requires_grad=True)
    grads = []
    for fn in (token_shift, naive_token_shift):
        xs, cs = fresh(x), fresh(cache)
        out, cache_out = fn(xs, None, cs, True)
        loss = (out * out).sum() if used == "out" else (cache_out * cache_out).sum()
        grads.append(torch.autograd.grad(loss, (xs, cs), allow_unused=True, materialize_grads=True))
    for name, a, b in zip(["dx", "dcache"], *grads):
        assert torch.equal(a, b), name


def test_fully_expanded_upstream_gradient(device):
    """out.sum() hands backward a gradient with every stride 0."""
    x = torch.randn(2, 7, 12, dtype=torch.bfloat16, device=device, requires_grad=True)
    (got,) = torch.autograd.grad(token_shift(x).sum(), x)
    xs = fresh(x)
    (want,) = torch.autograd.grad(naive_token_shift(xs).sum(), xs)
    assert torch.equal(got, want)


def test_float64_and_plain_output(device):
    x = torch.randn(2, 5, 3, dtype=torch.float64, device=device)
    assert torch.equal(token_shift(x), naive_token_shift(x))
    y = token_shift(x.float())
    assert isinstance(y, torch.Tensor) and torch.equal(y, naive_token_shift(x.float()))


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(4, 8)), "x must be"),
    (dict(cache=torch.randn(3, 8)), "cache must be"),
    (dict(cache=torch.randn(2, 7)), "cache must be"),
    (dict(cu_seqlens=torch.tensor([0, 2, 5])), "cu_seqlens requires B=1"),
], ids=["x-2d", "cache-count", "cache-width", "cu_seqlens-batch"])
def test_bad_arguments_name_the_argument(bad, match, device):
    args = dict(x=torch.randn(2, 5, 8), cu_seqlens=None, cache=None)
    args.update(bad)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        token_shift(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
def test_token_shift_gpu_real_size(packed, device):
    B, T, D = 4, 4096, 2048
    if packed:
        cuts = sorted(torch.randint(1, B * T, (9,)).tolist())
        cu_seqlens = torch.tensor([0, *cuts, B * T], device=device)
        x = torch.randn(1, B * T, D, dtype=torch.bfloat16, device=device, requires_grad=True)
        N = len(cu_seqlens) - 1
    else:
        cu_seqlens, N = None, B
        x = torch.randn(B, T, D, dtype=torch.bfloat16, device=device, requires_grad=True)
    cache = torch.randn(N, D, dtype=torch.bfloat16, device=device, requires_grad=True)
    check(x, cache, cu_seqlens, torch.bfloat16)
