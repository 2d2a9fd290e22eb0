"""L2 normalisation: the Triton kernels (interpreted on CPU, native on GPU) against a float64 run of the naive
reference, output and gradient; the reference against the layers' plain form; output dtypes, strided inputs,
all-zero rows, bad arguments.

Run: `pytest tests/kernels/ops/test_l2norm.py` (CPU through the Triton interpreter: ~10 s); `gpu`-marked tests run
real sizes on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from rltrain_kernels.ops.l2norm import L2Norm, l2_norm, l2norm, naive_l2norm
from tests.helpers import assert_rel_close, case_id, dtype_id

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# q/k heads (D = 128, several rows per program, a partial last program), an awkward width, one row wider than a
# 4096 tile (4097: 8192 columns, one row per program), tiny rows (D = 1 is left out: there dx = dy·eps/|x|³ is
# all cancellation, in any fp32 form), 4-D [B, T, H, D].
SHAPES = [(3, 5, 128), (7, 100), (2, 4097), (9, 3), (2, 3, 4, 64)]


def shape_id(shape) -> str:
    return case_id(N="x".join(map(str, shape[:-1])), D=shape[-1])


def run(fn, x, dy, **kwargs):
    y = fn(x, **kwargs)
    (dx,) = torch.autograd.grad(y, x, dy.to(y.dtype))
    return y, dx


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_l2norm_matches_float64_reference(shape, dtype, device):
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(shape, dtype=dtype, device=device)
    y, dx = run(l2norm, x, dy)
    y64, dx64 = run(naive_l2norm, x.detach().double().requires_grad_(), dy.double())
    assert y.dtype == dtype and dx.dtype == dtype
    assert_rel_close(y, y64, dtype=dtype, name="y")
    assert_rel_close(dx, dx64, dtype=dtype, name="dx")


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("layout", ["head-slice", "transposed"])
def test_l2norm_output_dtype_and_strided_inputs(layout, device):
    """bf16 in, fp32 out (fla's output_dtype); x as a slice of a fused projection (row stride 3·D, read in place)
    or transposed (copied); a transposed upstream gradient."""
    D = 64
    if layout == "head-slice":
        fused = torch.randn(4, 6, 3 * D, dtype=torch.bfloat16, device=device, requires_grad=True)
        x = fused[..., D:2 * D]
    else:
        fused = torch.randn(D, 6, 4, dtype=torch.bfloat16, device=device, requires_grad=True)
        x = fused.permute(2, 1, 0)
    dy = torch.randn(D, 6, 4, device=device).permute(2, 1, 0)
    y = l2norm(x, output_dtype=torch.float32)
    (dfused,) = torch.autograd.grad(y, fused, dy)
    fused64 = fused.detach().double().requires_grad_()
    x64 = fused64[..., D:2 * D] if layout == "head-slice" else fused64.permute(2, 1, 0)
    y64 = naive_l2norm(x64)
    (dfused64,) = torch.autograd.grad(y64, fused64, dy.double())
    assert y.dtype == torch.float32 and dfused.dtype == torch.bfloat16
    assert_rel_close(y, y64, dtype=torch.float32, threshold=1e-5, name="y (fp32 out)")
    assert_rel_close(dfused, dfused64, dtype=torch.bfloat16, name="dx")


def test_zero_rows_stay_finite(device):
    """An all-zero row (a padded token's q/k) gives y = 0 and a finite gradient dy / sqrt(eps), as the reference."""
    x = torch.zeros(3, 128, device=device, requires_grad=True)
    dy = torch.randn(3, 128, device=device)
    y, dx = run(l2norm, x, dy, eps=1e-6)
    y64, dx64 = run(naive_l2norm, x.detach().double().requires_grad_(), dy.double(), eps=1e-6)
    assert torch.equal(y, torch.zeros_like(y))
    assert_rel_close(dx, dx64, name="dx")


def test_module_and_alias(device):
    """The module and the fla alias compute the function itself; the kernel matches the float64 plain form."""
    x = torch.randn(2, 9, 4, 32, dtype=torch.bfloat16, device=device)
    assert torch.equal(l2_norm(x, 1e-5), L2Norm(eps=1e-5)(x))
    assert_rel_close(l2norm(x), naive_l2norm(x.double()), dtype=torch.bfloat16, name="kernel vs plain form")


def test_float64_falls_back_to_the_reference(device):
    x = torch.randn(3, 10, dtype=torch.float64, device=device)
    assert torch.equal(l2norm(x), naive_l2norm(x))


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.tensor(1.0)), "x must be"),
    (dict(x=torch.ones(3, 4, dtype=torch.int64)), "x must be"),
    (dict(output_dtype=torch.int32), "output_dtype must be"),
    (dict(eps=-1.0), "eps must be"),
], ids=["scalar", "integer", "output_dtype", "eps"])
def test_bad_arguments_name_the_argument(bad, match, device):
    args = dict(x=torch.randn(3, 4), eps=1e-6, output_dtype=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        l2norm(args.pop("x").to(device), **args)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 4096, 16, 128), (4, 4096, 32, 128), (8192, 4096), (2, 3, 65536)],
                         ids=shape_id)
def test_l2norm_gpu_real_sizes(shape, device):
    x = torch.randn(shape, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(shape, dtype=torch.bfloat16, device=device)
    y, dx = run(l2norm, x, dy)
    y64, dx64 = run(naive_l2norm, x.detach().double().requires_grad_(), dy.double())
    assert_rel_close(y, y64, dtype=torch.bfloat16, name="y")
    assert_rel_close(dx, dx64, dtype=torch.bfloat16, name="dx")
