"""Gated RMSNorm (Qwen3-Next's output norm, y = rms_norm(x)·w·silu(gate)): the Triton kernels (interpreted on CPU,
native on GPU) against a float64 run of the naive reference, output and every gradient (dx, dgate, dweight); the
naive reference against HF's Qwen3NextRMSNormGated bit for bit.

Run: `pytest tests/kernels/ops/test_gated_rmsnorm.py` (CPU through the Triton interpreter: ~10-20 s); `gpu`-marked
tests run real sizes on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from rltrain_kernels.ops.rmsnorm import GatedRMSNorm, gated_rms_norm
from rltrain_kernels.ops.rmsnorm.naive import naive_gated_rms_norm
from tests.helpers import assert_rel_close, case_id, dtype_id
from tests.kernels.ops.test_rmsnorm import as_float64_leaf, strided_randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Odd and power-of-two head sizes; row counts that are not a multiple of the row block (H=100/128 pack 16 rows per
# program); one row; 3-D (tokens, heads, head_dim) as Qwen3-Next's [B·T·HV, head_v_dim] before the reshape.
SHAPES = [(37, 100), (37, 128), (3, 2048), (1, 4097), (2, 5, 3, 128), (64, 256)]


def grads_of(fn, x, gate, weight, dy, eps):
    """Output of fn(x, gate, weight, eps) and the gradients of the leaves among (x, gate, weight) for dy."""
    y = fn(x, gate, weight, eps)
    leaves = [t for t in (x, gate, weight) if t.requires_grad]
    return y, torch.autograd.grad(y, leaves, dy)


def reference(x, gate, weight, dy, eps):
    leaves = [as_float64_leaf(t) if t.requires_grad else t.double() for t in (x, gate, weight)]
    return grads_of(naive_gated_rms_norm, *leaves, dy.double(), eps)


def assert_matches_reference(x, gate, weight, dy, eps, dtype, names=("dx", "dgate", "dweight")):
    y, grads = grads_of(gated_rms_norm, x, gate, weight, dy, eps)
    assert type(y.grad_fn).__name__ == "GatedRMSNormFunctionBackward"  # the kernel ran, not the fallback
    assert y.dtype == x.dtype
    ref_y, ref_grads = reference(x, gate, weight, dy, eps)
    assert_rel_close(y, ref_y, dtype=dtype, name="y")
    assert len(grads) == len(names)
    for name, got, want in zip(names, grads, ref_grads):
        assert_rel_close(got, want, dtype=dtype, name=name)
    return grads


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: case_id(N="x".join(map(str, s[:-1])), H=s[-1]))
def test_gated_rms_norm_matches_float64_reference(shape, dtype, device):
    eps = 1e-6
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    gate = (2 * torch.randn(shape, device=device)).to(dtype).requires_grad_()  # both silu tails
    weight = (1 + 0.5 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_()
    dy = torch.randn(shape, dtype=dtype, device=device)
    dx, dgate, dweight = assert_matches_reference(x, gate, weight, dy, eps, dtype)
    assert (dx.dtype, dgate.dtype, dweight.dtype) == (dtype, dtype, dtype)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("grad_layout", ["padded", "transposed", "expanded"])
@pytest.mark.parametrize("x_layout", ["contiguous", "padded", "transposed"])
def test_gated_rms_norm_strided_inputs_and_upstream_grads(x_layout, grad_layout, device):
    """Non-contiguous x, gate (a column slice of a wider projection, as Qwen3-Next's z) and upstream gradients;
    fp32 weight on bf16 activations, fp32 gate."""
    shape, dtype, eps = (21, 100), torch.bfloat16, 1e-5
    x = strided_randn(shape, dtype, device, x_layout).requires_grad_()
    gate = torch.randn(shape[0], 3 * shape[-1], device=device)[:, shape[-1]: 2 * shape[-1]].requires_grad_()
    weight = torch.randn(shape[-1], device=device, requires_grad=True)
    if grad_layout == "expanded":
        dy = torch.randn(1, shape[-1], dtype=dtype, device=device).expand(shape)
    else:
        dy = strided_randn(shape, dtype, device, grad_layout)
    dx, dgate, dweight = assert_matches_reference(x, gate, weight, dy, eps, dtype)
    assert (dx.dtype, dgate.dtype, dweight.dtype) == (dtype, torch.float32, torch.float32)


@pytest.mark.parametrize("programs_per_sm", [1, 3])
def test_gated_rms_norm_backward_several_blocks_per_program(programs_per_sm, device):
    """19 rows of H=1000 are 10 two-row blocks over 4 interpreter programs (on a GPU the grid is capped at the
    number of blocks): each program accumulates dweight over several blocks before the partials are reduced."""
    from rltrain_kernels.ops.rmsnorm.gated_kernel import gated_rms_norm_backward, gated_rms_norm_forward

    eps = 1e-6
    x, gate, dy = (torch.randn(19, 1000, device=device) for _ in range(3))
    weight = torch.randn(1000, device=device)
    _, x_rows, g_rows, rstd = gated_rms_norm_forward(x, gate, weight, eps)
    dx, dgate, dw = gated_rms_norm_backward(dy, x_rows, g_rows, weight, rstd, programs_per_sm=programs_per_sm)
    leaves = [as_float64_leaf(t) for t in (x, gate, weight)]
    wants = torch.autograd.grad(naive_gated_rms_norm(*leaves, eps), leaves, dy.double())
    for name, got, want in zip(["dx", "dgate", "dweight"], (dx, dgate, dw), wants):
        assert_rel_close(got, want, name=name)


def test_gated_rms_norm_frozen_weight_and_gate(device):
    """Only x needs a gradient (frozen weight, detached gate): the kernel still runs and skips dweight."""
    x = torch.randn(4, 3, 128, device=device, requires_grad=True)
    gate, dy = torch.randn(4, 3, 128, device=device), torch.randn(4, 3, 128, device=device)
    weight = torch.randn(128, device=device)
    assert_matches_reference(x, gate, weight, dy, 1e-6, torch.float32, names=("dx",))


def test_gated_rms_norm_validates_shapes_and_falls_back_for_float64(device):
    x = torch.randn(3, 10, device=device)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, torch.randn(3, 11, device=device), torch.ones(10, device=device))
    with pytest.raises(ValueError, match="weight"):
        gated_rms_norm(x, x, torch.ones(11, device=device))
    x64, g64, w64 = x.double(), torch.randn(3, 10, device=device, dtype=torch.float64), torch.randn(10, device=device)
    torch.testing.assert_close(gated_rms_norm(x64, g64, w64), naive_gated_rms_norm(x64, g64, w64), rtol=0, atol=0)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_naive_and_module_match_hf_qwen3_next_rmsnorm_gated(weight_dtype, x_dtype, device):
    """naive_gated_rms_norm is HF's Qwen3NextRMSNormGated formula bit for bit (including where it casts), and the
    module takes HF's state dict and attribute names."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    hidden, eps = 96, 1e-6
    hf = modeling.Qwen3NextRMSNormGated(hidden, eps=eps).to(device=device, dtype=weight_dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden))
    x = torch.randn(3, 7, hidden, dtype=x_dtype, device=device)
    gate = torch.randn(3, 7, hidden, dtype=x_dtype, device=device)
    with torch.no_grad():
        want = hf(x, gate)
        assert want.dtype == x_dtype
        assert torch.equal(naive_gated_rms_norm(x, gate, hf.weight, eps), want)
        ours = GatedRMSNorm(hidden, eps=eps).to(device=device, dtype=weight_dtype)
        ours.load_state_dict(hf.state_dict())
        assert (ours.variance_epsilon, ours.activation) == (hf.variance_epsilon, hf.activation)
        assert_rel_close(ours(x, gate), want, dtype=x_dtype, name="module vs HF")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096 * 32, 128), (4096, 4096), (3, 1000, 8, 100)],
                         ids=lambda s: case_id(N="x".join(map(str, s[:-1])), H=s[-1]))
def test_gated_rms_norm_gpu_real_sizes(shape, device):
    """Qwen3-Next's per-head norm at a real size (4096 tokens × 32 value heads of head_v_dim 128), bf16."""
    dtype = torch.bfloat16
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    gate = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    weight = torch.randn(shape[-1], dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(shape, dtype=dtype, device=device)
    assert_matches_reference(x, gate, weight, dy, 1e-6, dtype)
