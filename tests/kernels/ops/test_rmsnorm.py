"""RMSNorm (+ fused residual add): the Triton kernels (interpreted on CPU, native on GPU) against a float64 run of
the naive reference, outputs and every gradient; the naive reference against HF's LlamaRMSNorm.

Run: `pytest tests/kernels/ops/test_rmsnorm.py` (CPU through the Triton interpreter: ~5-20 s; the three op files
together ~25 s of CPU time); `gpu`-marked tests run real sizes on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from rltrain_kernels.ops.rmsnorm import RMSNorm, rms_norm
from rltrain_kernels.ops.rmsnorm.naive import naive_rms_norm
from tests.helpers import assert_rel_close, case_id, dtype_id

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Awkward hidden sizes (not powers of two, 4097 = 2^12 + 1), 1 row, narrow rows packed several per program (H=128),
# 3-D inputs.
SHAPES = [(1, 1000), (3, 4097), (37, 128), (2, 5, 1000), (64, 256), (4, 3, 96)]


def strided_randn(shape, dtype, device, layout: str) -> torch.Tensor:
    """Fresh N(0, 1) values in a given memory layout: 'contiguous'; 'padded' (unit column stride, padded rows: the
    kernel reads it in place); 'transposed' (non-unit column stride: the host copies it)."""
    if layout == "contiguous":
        return torch.randn(shape, dtype=dtype, device=device)
    if layout == "padded":
        return torch.randn(*shape[:-1], shape[-1] + 7, dtype=dtype, device=device)[..., : shape[-1]]
    if layout == "transposed":
        return torch.randn(tuple(reversed(shape)), dtype=dtype, device=device).permute(*reversed(range(len(shape))))
    raise ValueError(layout)


def run_and_grad(fn, x, weight, residual, dy, ds, eps):
    """Outputs and gradients of fn(x, weight, eps, residual) for upstream grads dy (and ds for s)."""
    leaves = [t for t in (x, weight, residual) if t is not None]
    out = fn(x, weight, eps, residual)
    if residual is None:
        grads = torch.autograd.grad(out, leaves, dy)
        return (out,), grads
    y, s = out
    grads = torch.autograd.grad((y, s), leaves, (dy, ds))
    return (y, s), grads


def as_float64_leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(torch.float64).requires_grad_()


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: case_id(N="x".join(map(str, s[:-1])), H=s[-1]))
def test_rms_norm_matches_float64_reference(shape, dtype, residual, device):
    eps = 1e-6
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    weight = (1 + 0.5 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_()
    res = torch.randn(shape, dtype=dtype, device=device, requires_grad=True) if residual else None
    dy = torch.randn(shape, dtype=dtype, device=device)
    ds = torch.randn(shape, dtype=dtype, device=device) if residual else None

    outs, grads = run_and_grad(rms_norm, x, weight, res, dy, ds, eps)
    ref_inputs = [as_float64_leaf(t) for t in (x, weight, res)]
    ref_outs, ref_grads = run_and_grad(naive_rms_norm, *ref_inputs, dy.double(), None if ds is None else ds.double(),
                                       eps)
    for name, got, want in zip(["y", "s"], outs, ref_outs):
        assert got.dtype == dtype
        assert_rel_close(got, want, dtype=dtype, name=name)
    for name, got, want in zip(["dx", "dweight", "dresidual"], grads, ref_grads):
        assert_rel_close(got, want, dtype=dtype, name=name)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("grad_layout", ["padded", "transposed", "expanded", "zero"])
@pytest.mark.parametrize("x_layout", ["contiguous", "padded", "transposed"])
def test_rms_norm_strided_inputs_and_upstream_grads(x_layout, grad_layout, device):
    """Non-contiguous x/residual and upstream gradients of every kind, fp32 weight on bf16 activations."""
    shape, dtype, eps = (6, 300), torch.bfloat16, 1e-5
    x = strided_randn(shape, dtype, device, x_layout).requires_grad_()
    res = strided_randn(shape, dtype, device, x_layout).requires_grad_()
    weight = torch.randn(shape[-1], device=device, requires_grad=True)  # fp32 weight, bf16 activations
    if grad_layout == "expanded":
        dy = torch.randn(1, shape[-1], dtype=dtype, device=device).expand(shape)
        ds = torch.randn(shape[0], 1, dtype=dtype, device=device).expand(shape)
    elif grad_layout == "zero":
        dy = torch.zeros(shape, dtype=dtype, device=device)
        ds = torch.zeros(shape, dtype=dtype, device=device)
    else:
        dy, ds = strided_randn(shape, dtype, device, grad_layout), strided_randn(shape, dtype, device, grad_layout)

    outs, grads = run_and_grad(rms_norm, x, weight, res, dy, ds, eps)
    ref_outs, ref_grads = run_and_grad(naive_rms_norm, *[as_float64_leaf(t) for t in (x, weight, res)],
                                       dy.double(), ds.double(), eps)
    assert outs[0].dtype == dtype and grads[1].dtype == torch.float32
    for name, got, want in zip(["y", "s", "dx", "dweight", "dresidual"], [*outs, *grads], [*ref_outs, *ref_grads]):
        assert_rel_close(got, want, dtype=dtype, name=name)


@pytest.mark.parametrize("used", ["y_only", "s_only"])
def test_rms_norm_residual_with_one_output_unused(used, device):
    shape, eps = (5, 200), 1e-6
    x, res = (torch.randn(shape, device=device, requires_grad=True) for _ in range(2))
    weight = torch.randn(shape[-1], device=device, requires_grad=True)
    dout = torch.randn(shape, device=device)
    grads = []
    for fn, leaves in ((rms_norm, (x, weight, res)), (naive_rms_norm, [as_float64_leaf(t) for t in (x, weight, res)])):
        y, s = fn(leaves[0], leaves[1], eps, leaves[2])
        out = y if used == "y_only" else s
        grads.append(torch.autograd.grad(out, leaves, dout.to(out.dtype), allow_unused=True))
    for name, got, want in zip(["dx", "dweight", "dresidual"], *grads):
        if want is None:  # s_only: the weight never reaches the loss
            assert got is None or got.abs().max() == 0, name
        else:
            assert_rel_close(got, want, dtype=torch.float32, name=name)


@pytest.mark.parametrize("programs_per_sm", [1, 3])
def test_rms_norm_backward_host_options(programs_per_sm, device):
    """The backward's prefetching loop with several row blocks per persistent program (19 rows of H=1000 are 10
    two-row blocks over 4 interpreter programs; on a GPU the grid is capped at the number of blocks)."""
    from rltrain_kernels.ops.rmsnorm.kernel import rms_norm_backward, rms_norm_forward

    eps = 1e-6
    x = torch.randn(19, 1000, device=device)
    weight, dy, ds = torch.randn(1000, device=device), torch.randn(19, 1000, device=device), torch.randn(19, 1000,
                                                                                                       device=device)
    _, normed, rstd, _ = rms_norm_forward(x, weight, eps)
    dx, dw = rms_norm_backward(dy, normed, weight, rstd, ds, programs_per_sm=programs_per_sm)
    x64, w64 = as_float64_leaf(x), as_float64_leaf(weight)
    want_dx, want_dw = torch.autograd.grad(naive_rms_norm(x64, w64, eps), (x64, w64), dy.double())
    assert_rel_close(dx, want_dx + ds.double(), name="dx + ds")
    assert_rel_close(dw, want_dw, name="dweight")


def test_rms_norm_frozen_weight_skips_dweight(device):
    x = torch.randn(4, 3, 500, device=device, requires_grad=True)
    weight = torch.randn(500, device=device)
    dy = torch.randn(4, 3, 500, device=device)
    (dx,) = torch.autograd.grad(rms_norm(x, weight), x, dy)
    x64 = as_float64_leaf(x)
    (want,) = torch.autograd.grad(naive_rms_norm(x64, weight.double()), x64, dy.double())
    assert_rel_close(dx, want, dtype=torch.float32, name="dx")


def test_rms_norm_rejects_mismatched_residual(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8, device=device), residual=torch.randn(2, 8, device=device, dtype=torch.bfloat16))


def test_rms_norm_float64_falls_back_to_naive(device):
    x, weight = torch.randn(3, 10, device=device, dtype=torch.float64), torch.randn(10, device=device)
    torch.testing.assert_close(rms_norm(x, weight), naive_rms_norm(x, weight), rtol=0, atol=0)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_naive_and_module_match_hf_llama_rmsnorm(weight_dtype, device):
    """naive_rms_norm is HF's LlamaRMSNorm formula bit for bit (cast to x's dtype when the weight is fp32), and the
    module takes HF's state dict and attribute names."""
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    hidden, eps = 96, 1e-5
    hf = modeling_llama.LlamaRMSNorm(hidden, eps=eps).to(device=device, dtype=weight_dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden))
    x = torch.randn(3, 7, hidden, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        want = hf(x).to(torch.bfloat16)
        assert torch.equal(naive_rms_norm(x, hf.weight, eps), want)
        ours = RMSNorm(hidden, eps=eps).to(device=device, dtype=weight_dtype)
        ours.load_state_dict(hf.state_dict())
        assert ours.variance_epsilon == hf.variance_epsilon
        assert_rel_close(ours(x), want, name="module vs HF")
        y, s = ours(x, residual=x)
        assert torch.equal(s, x + x)
        assert_rel_close(y, hf(x + x).to(torch.bfloat16), name="module residual vs HF")


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", [(16384, 4096), (2, 2048, 5120), (8192, 128), (1, 65536)],
                         ids=lambda s: case_id(N="x".join(map(str, s[:-1])), H=s[-1]))
def test_rms_norm_gpu_real_sizes(shape, residual, device):
    dtype, eps = torch.bfloat16, 1e-6
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    weight = torch.randn(shape[-1], dtype=dtype, device=device, requires_grad=True)
    res = torch.randn(shape, dtype=dtype, device=device, requires_grad=True) if residual else None
    dy = torch.randn(shape, dtype=dtype, device=device)
    ds = torch.randn(shape, dtype=dtype, device=device) if residual else None
    outs, grads = run_and_grad(rms_norm, x, weight, res, dy, ds, eps)
    ref_outs, ref_grads = run_and_grad(naive_rms_norm, *[as_float64_leaf(t) for t in (x, weight, res)],
                                       dy.double(), None if ds is None else ds.double(), eps)
    for name, got, want in zip(["y", "s", "dx", "dweight", "dresidual"], [*outs, *grads], [*ref_outs, *ref_grads]):
        assert_rel_close(got, want, dtype=dtype, name=name)
