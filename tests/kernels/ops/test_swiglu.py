"""SwiGLU: the Triton kernels (interpreted on CPU, native on GPU) against a float64 run of the naive reference,
output and both gradients; the naive reference against HF's LlamaMLP activation.

Run: `pytest tests/kernels/ops/test_swiglu.py` (CPU through the Triton interpreter: ~5-20 s; the three op files
together ~25 s of CPU time); `gpu`-marked tests run real sizes on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from rltrain_kernels.ops.swiglu import SwiGLU, swiglu
from rltrain_kernels.ops.swiglu.naive import naive_swiglu
from tests.helpers import assert_rel_close, case_id, dtype_id

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One element, sizes that are not multiples of the 4096 block (4097: one full block + 1; 11008: Llama-2-7B's
# intermediate size, 2.7 blocks), 3-D.
SHAPES = [(1, 1), (3, 1000), (2, 3, 4097), (2, 11008), (5, 7, 33)]


def make_operands(shape, dtype, device, layout: str):
    """(gate, up) leaves in a given layout: 'contiguous'; 'fused' (the two halves of one gate_up projection output,
    row stride 2·I, read in place); 'transposed' (non-unit column stride, copied by the host)."""
    if layout == "contiguous":
        return [torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(2)]
    if layout == "fused":
        gate_up = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype, device=device, requires_grad=True)
        return list(gate_up.chunk(2, dim=-1))  # non-leaf views; the test reads gradients through autograd.grad
    if layout == "transposed":
        return [torch.randn(tuple(reversed(shape)), dtype=dtype, device=device).permute(
            *reversed(range(len(shape)))).requires_grad_() for _ in range(2)]
    raise ValueError(layout)


def make_upstream(shape, dtype, device, layout: str) -> torch.Tensor:
    if layout == "contiguous":
        return torch.randn(shape, dtype=dtype, device=device)
    if layout == "padded":
        return torch.randn(*shape[:-1], shape[-1] + 5, dtype=dtype, device=device)[..., : shape[-1]]
    if layout == "transposed":
        return torch.randn(tuple(reversed(shape)), dtype=dtype, device=device).permute(*reversed(range(len(shape))))
    if layout == "expanded":
        return torch.randn(shape[-1], dtype=dtype, device=device).expand(shape)
    if layout == "zero":
        return torch.zeros(shape, dtype=dtype, device=device)
    raise ValueError(layout)


def check_against_reference(gate, up, dy, dtype):
    y = swiglu(gate, up)
    dgate, dup = torch.autograd.grad(y, (gate, up), dy)
    gate64, up64 = (t.detach().double().requires_grad_() for t in (gate, up))
    y64 = naive_swiglu(gate64, up64)
    dgate64, dup64 = torch.autograd.grad(y64, (gate64, up64), dy.double())
    assert y.dtype == dtype and dgate.dtype == dtype and dup.dtype == dtype
    assert_rel_close(y, y64, dtype=dtype, name="y")
    assert_rel_close(dgate, dgate64, dtype=dtype, name="dgate")
    assert_rel_close(dup, dup64, dtype=dtype, name="dup")


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: case_id(N="x".join(map(str, s[:-1])), I=s[-1]))
def test_swiglu_matches_float64_reference(shape, dtype, device):
    gate, up = make_operands(shape, dtype, device, "contiguous")
    check_against_reference(gate, up, make_upstream(shape, dtype, device, "contiguous"), dtype)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("grad_layout", ["padded", "transposed", "expanded", "zero"])
@pytest.mark.parametrize("layout", ["contiguous", "fused", "transposed"])
def test_swiglu_strided_inputs_and_upstream_grads(layout, grad_layout, device):
    shape, dtype = (4, 3, 700), torch.bfloat16
    gate, up = make_operands(shape, dtype, device, layout)
    check_against_reference(gate, up, make_upstream(shape, dtype, device, grad_layout), dtype)


def test_swiglu_large_values_stay_finite(device):
    """silu saturates: gate = ±80 must give y ≈ 80·up and 0 without inf/NaN in either gradient."""
    gate = torch.tensor([[-80.0, -20.0, 0.0, 20.0, 80.0]], device=device).repeat(3, 1).requires_grad_()
    up = torch.randn(3, 5, device=device, requires_grad=True)
    check_against_reference(gate, up, torch.randn(3, 5, device=device), torch.float32)


def test_naive_matches_hf_llama_mlp_activation(device):
    """naive_swiglu(g, u) is HF's `act_fn(gate_proj(x)) * up_proj(x)` with ACT2FN['silu']: exact in fp32; in bf16
    HF rounds silu(g) before the product, so both are compared with the float64 value instead."""
    activations = pytest.importorskip("transformers.activations")
    act = activations.ACT2FN["silu"]
    gate, up = torch.randn(2, 9, 64, device=device), torch.randn(2, 9, 64, device=device)
    assert torch.equal(naive_swiglu(gate, up), act(gate) * up)
    exact = naive_swiglu(gate.double(), up.double())
    g16, u16 = gate.bfloat16(), up.bfloat16()
    exact16 = naive_swiglu(g16.double(), u16.double())
    assert_rel_close(naive_swiglu(g16, u16), exact16, name="naive bf16")
    assert_rel_close(act(g16) * u16, exact16, name="HF bf16")
    assert_rel_close(SwiGLU()(gate, up), exact, dtype=torch.float32, name="module")


def test_swiglu_validates_and_falls_back(device):
    with pytest.raises(ValueError, match="must match"):
        swiglu(torch.randn(2, 3, device=device), torch.randn(2, 4, device=device))
    gate, up = torch.randn(3, 10, device=device, dtype=torch.float64), torch.randn(3, 10, device=device,
                                                                                    dtype=torch.float64)
    assert torch.equal(swiglu(gate, up), naive_swiglu(gate, up))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "fused"])
@pytest.mark.parametrize("shape", [(16384, 4096), (4, 2048, 14336)],
                         ids=lambda s: case_id(N="x".join(map(str, s[:-1])), I=s[-1]))
def test_swiglu_gpu_real_sizes(shape, layout, device):
    dtype = torch.bfloat16
    gate, up = make_operands(shape, dtype, device, layout)
    check_against_reference(gate, up, make_upstream(shape, dtype, device, "contiguous"), dtype)
