"""Fused MoE: the Triton grouped GEMMs (interpreted on CPU, native on GPU) against a float64 run of the per-expert
loop (naive.py), the output and every gradient (hidden states, both expert weights, routing weights); the loop
against transformers' own Qwen3-MoE experts module.

Run: `pytest tests/kernels/ops/test_fused_moe.py` (CPU through the Triton interpreter: about a minute); `gpu`-marked
tests run Qwen3-30B-A3B's expert shapes on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from rltrain_kernels.ops.fused_moe import fused_moe, naive_fused_moe
from tests.helpers import assert_rel_close, case_id, dtype_id

# (tokens, hidden, intermediate, experts, top-k): H and I off the interpreter's 32-wide blocks (ragged N and K
# edges), tokens giving several 16-row tiles per expert and a partial last one.
SHAPES = [(11, 40, 48, 4, 2), (23, 64, 48, 8, 2), (9, 32, 48, 6, 2)]


def shape_id(shape) -> str:
    tokens, hidden, intermediate, experts, top_k = shape
    return case_id(T=tokens, H=hidden, I=intermediate, E=experts, k=top_k)


def make_inputs(tokens, hidden, intermediate, experts, top_k, dtype, device, empty_experts=(0,),
                weights_dtype=None):
    """Leaves (x, gate_up_proj, down_proj, top_k_weights) in `dtype` (weights in weights_dtype, default `dtype`) and
    top_k_index [T, k] from a softmax top-k over random logits in which `empty_experts` never win a slot."""
    x = torch.randn(tokens, hidden, device=device)
    gate_up = torch.randn(experts, 2 * intermediate, hidden, device=device) / hidden ** 0.5
    down = torch.randn(experts, hidden, intermediate, device=device) / intermediate ** 0.5
    logits = torch.randn(tokens, experts, device=device)
    logits[:, list(empty_experts)] = -torch.inf
    weights, index = torch.topk(logits.softmax(-1), top_k)
    leaves = [t.to(dtype).requires_grad_() for t in (x, gate_up, down)]
    return (*leaves, index, weights.to(weights_dtype or dtype).requires_grad_())


def reference(x, gate_up, down, index, weights, d_out):
    """The float64 loop's output and gradients (x, gate_up, down, weights) on the same values."""
    leaves = [t.detach().double().requires_grad_() for t in (x, gate_up, down, weights)]
    out = naive_fused_moe(leaves[0], leaves[1], leaves[2], index, leaves[3])
    return out, torch.autograd.grad(out, leaves, d_out.double())


def check_against_reference(x, gate_up, down, index, weights, d_out, dtype, threshold=None):
    out = fused_moe(x, gate_up, down, index, weights)
    grads = torch.autograd.grad(out, (x, gate_up, down, weights), d_out)
    ref_out, ref_grads = reference(x, gate_up, down, index, weights, d_out)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_rel_close(out, ref_out, dtype=dtype, threshold=threshold, name="out")
    for name, grad, ref, leaf in zip(("dx", "d gate_up_proj", "d down_proj", "d top_k_weights"), grads, ref_grads,
                                     (x, gate_up, down, weights)):
        assert grad.dtype == leaf.dtype, name
        assert_rel_close(grad, ref, dtype=dtype, threshold=threshold, name=name)
    return grads


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_fused_moe_matches_float64_reference(shape, dtype, device):
    x, gate_up, down, index, weights = make_inputs(*shape, dtype, device)
    d_out = torch.randn(x.shape, device=device).to(dtype)
    _, d_gate_up, d_down, _ = check_against_reference(x, gate_up, down, index, weights, d_out, dtype)
    # expert 0 receives no token: its gradients are exact zeros (written, not left as the poisoned allocation)
    assert not (index == 0).any()
    assert torch.equal(d_gate_up[0], torch.zeros_like(d_gate_up[0]))
    assert torch.equal(d_down[0], torch.zeros_like(d_down[0]))


@pytest.mark.usefixtures("poison_allocations")
def test_fused_moe_fp16(device):
    shape, dtype = SHAPES[0], torch.float16
    x, gate_up, down, index, weights = make_inputs(*shape, dtype, device)
    check_against_reference(x, gate_up, down, index, weights, torch.randn(x.shape, device=device).to(dtype), dtype)


@pytest.mark.usefixtures("poison_allocations")
def test_fp32_routing_weights_with_bf16_experts(device):
    """Mixtral's router hands the experts fp32 weights beside bf16 hidden states: the output stays bf16 and the
    routing weights' gradient comes back fp32."""
    dtype = torch.bfloat16
    x, gate_up, down, index, weights = make_inputs(*SHAPES[0], dtype, device, weights_dtype=torch.float32)
    check_against_reference(x, gate_up, down, index, weights, torch.randn(x.shape, device=device).to(dtype), dtype)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("layout", ["transposed-x", "expanded-grad", "3d-tokens", "frozen-experts"])
def test_strided_inputs_and_partial_gradients(layout, device):
    """Hidden states with a non-unit column stride (copied), an expanded upstream gradient (row stride 0, read in
    place), [B, S, H] hidden states with [B·S, k] routing, and experts that need no gradient (LoRA-style)."""
    tokens, hidden, intermediate, experts, top_k = SHAPES[0]
    dtype = torch.float32
    x, gate_up, down, index, weights = make_inputs(tokens, hidden, intermediate, experts, top_k, dtype, device)
    d_out = torch.randn(x.shape, device=device)
    if layout == "transposed-x":
        x = x.detach().T.contiguous().T.requires_grad_()
        assert x.stride(-1) != 1
    elif layout == "expanded-grad":
        d_out = torch.randn(hidden, device=device).expand(tokens, hidden)
    elif layout == "3d-tokens":
        x = x.detach()[:10].reshape(2, 5, hidden).requires_grad_()
        index, weights = index[:10], weights.detach()[:10].requires_grad_()
        d_out = d_out[:10].reshape(2, 5, hidden)
    if layout == "frozen-experts":
        gate_up.requires_grad_(False)
        down.requires_grad_(False)
        out = fused_moe(x, gate_up, down, index, weights)
        dx, d_weights = torch.autograd.grad(out, (x, weights), d_out)
        ref_out, (ref_dx, _, _, ref_d_weights) = reference(x, gate_up, down, index, weights, d_out)
        assert_rel_close(out, ref_out, dtype=dtype, name="out")
        assert_rel_close(dx, ref_dx, dtype=dtype, name="dx")
        assert_rel_close(d_weights, ref_d_weights, dtype=dtype, name="d top_k_weights")
        return
    check_against_reference(x, gate_up, down, index, weights, d_out, dtype)


@pytest.mark.usefixtures("poison_allocations")
def test_forward_without_gradient_is_the_same(device):
    """Under no_grad (rollout, reference log-probs) the forward skips storing gate|up: the same output bits."""
    x, gate_up, down, index, weights = make_inputs(*SHAPES[0], torch.bfloat16, device)
    with torch.no_grad():
        inference = fused_moe(x, gate_up, down, index, weights)
    assert torch.equal(inference, fused_moe(x, gate_up, down, index, weights).detach())


def test_naive_matches_transformers_qwen3_moe_experts(device):
    """naive_fused_moe is transformers' Qwen3MoeExperts (eager loop): same output and gradients in fp32, so the
    layout (gate rows before up rows, down [H, I]) and the weighting are transformers'."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(hidden_size=40, moe_intermediate_size=48, num_experts=6,
                                         num_experts_per_tok=2)
    config._experts_implementation = "eager"
    experts = Qwen3MoeExperts(config).to(device)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    _, _, _, index, weights = make_inputs(9, 40, 48, 6, 2, torch.float32, device)
    x = torch.randn(9, 40, device=device, requires_grad=True)
    d_out = torch.randn(9, 40, device=device)
    expected = experts(x, index, weights)
    expected_grads = torch.autograd.grad(expected, (x, experts.gate_up_proj, experts.down_proj, weights), d_out)
    out = naive_fused_moe(x, experts.gate_up_proj, experts.down_proj, index, weights)
    grads = torch.autograd.grad(out, (x, experts.gate_up_proj, experts.down_proj, weights), d_out)
    assert_rel_close(out, expected, name="out")
    for name, grad, ref in zip(("dx", "d gate_up_proj", "d down_proj", "d weights"), grads, expected_grads):
        assert_rel_close(grad, ref, name=name)


def test_tuning_is_an_argument(device):
    """MoeTuning (the kernels' tiles and launches): validated on construction, refused in any other form, and a
    sweep's setting (64-row tiles at 4 warps, bench_fused_moe.py --sweep) computes what the shipped one does (the
    interpreter runs its own small tiles whatever the setting)."""
    from rltrain_kernels.ops.fused_moe.tuning import MoeTuning

    with pytest.raises(ValueError, match=r"MoeTuning.up_swiglu must be 4 positive int\(s\); got \(64, 64, 8\)"):
        MoeTuning(up_swiglu=(64, 64, 8))
    x, gate_up, down, index, weights = make_inputs(*SHAPES[0], torch.bfloat16, device)
    with pytest.raises(TypeError, match="fused_moe: tuning must be a rltrain_kernels.ops.fused_moe.tuning.MoeTuning"):
        fused_moe(x, gate_up, down, index, weights, tuning={"row_tile": 64})
    tuning = MoeTuning(row_tile=64, up_swiglu=(64, 64, 4, 4), scatter=(128, 64, 4, 4), down_backward=(64, 64, 4, 4))
    d_out = torch.randn(x.shape, device=device).to(torch.bfloat16)
    results = {}
    for label, setting in (("shipped", MoeTuning()), ("swept", tuning)):
        out = fused_moe(x, gate_up, down, index, weights, tuning=setting)
        results[label] = (out, *torch.autograd.grad(out, (x, gate_up, down, weights), d_out))
    for name, a, b in zip(("out", "dx", "d gate_up_proj", "d down_proj", "d top_k_weights"), results["swept"],
                          results["shipped"]):
        assert_rel_close(a, b, dtype=torch.bfloat16, name=name)


def test_fused_moe_validates_and_falls_back(device):
    x, gate_up, down, index, weights = make_inputs(*SHAPES[0], torch.float64, device)
    assert torch.equal(fused_moe(x, gate_up, down, index, weights), naive_fused_moe(x, gate_up, down, index, weights))
    with pytest.raises(ValueError, match="gate_up_proj .* does not match down_proj"):
        fused_moe(x, gate_up[:, :-1], down, index, weights)
    with pytest.raises(ValueError, match="hidden_states' last dim"):
        fused_moe(x[:, :-1], gate_up, down, index, weights)
    with pytest.raises(ValueError, match="top_k_weights .* must have top_k_index's shape"):
        fused_moe(x, gate_up, down, index, weights[:, :1])
    with pytest.raises(ValueError, match="top_k_index .* one row of expert ids per token"):
        fused_moe(x, gate_up, down, index[:-1], weights[:-1])
    with pytest.raises(ValueError, match="top_k_index must hold integer expert ids"):
        fused_moe(x, gate_up, down, index.double(), weights)
    with pytest.raises(ValueError, match="gate_up_proj must be"):
        fused_moe(x, gate_up[0], down, index, weights)


# Qwen3-30B-A3B's experts (hidden 2048, moe_intermediate 768, 128 experts, top-8).
GPU_SHAPES = [(4096, 2048, 768, 128, 8), (1000, 2048, 768, 128, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=shape_id)
def test_fused_moe_gpu_real_sizes(shape, dtype, device):
    x, gate_up, down, index, weights = make_inputs(*shape, dtype, device, empty_experts=(0, 77))
    d_out = torch.randn(x.shape, device=device).to(dtype)
    check_against_reference(x, gate_up, down, index, weights, d_out, dtype)


@pytest.mark.gpu
def test_fused_moe_gpu_skewed_routing_is_deterministic(device):
    """Half the experts take nothing and one expert takes a slot of every token (a tile count far from the even
    split); two runs give the same bits (no atomics anywhere)."""
    tokens, hidden, intermediate, experts, top_k = 3000, 1024, 768, 64, 4
    dtype = torch.bfloat16
    x, gate_up, down, index, weights = make_inputs(tokens, hidden, intermediate, experts, top_k, dtype, device,
                                                   empty_experts=tuple(range(0, experts, 2)))
    index = index.clone()
    index[:, 0] = 1
    index[:, 1:] = torch.where(index[:, 1:] == 1, 3, index[:, 1:])
    d_out = torch.randn(x.shape, device=device).to(dtype)
    first = check_against_reference(x, gate_up, down, index, weights, d_out, dtype)
    out = fused_moe(x, gate_up, down, index, weights)
    second = torch.autograd.grad(out, (x, gate_up, down, weights), d_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
