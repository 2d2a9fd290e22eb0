"""`fused_moe` in tiny Qwen3-MoE and Mixtral models built from configs: with the kernel swapped in, the logits, every
layer's router logits, the auxiliary load-balancing loss and every parameter's gradient equal the unswapped model's
(fp32); what is swapped (the experts modules, nothing else), its reversal, the modules left alone, and the NPU path
through a stand-in torch_npu.

`impl="cuda"` runs the Triton kernels (natively on a GPU, through the interpreter on CPU); `impl="cpu"` the loop.
Run: `pytest tests/kernels/integrations/test_moe_swap.py` (CPU, about a minute).
"""

import copy
import sys

import pytest
import torch

from rltrain_kernels import utils
from rltrain_kernels.integrations.families import restore_original_modules
from rltrain_kernels.registry import apply_default_kernels, apply_kernel, get_applied_kernels
from tests.helpers import assert_rel_close
from tests.kernels.integrations import standin_torch_npu

transformers = pytest.importorskip("transformers")

DIMS = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
            router_aux_loss_coef=0.1, output_router_logits=True)


def tiny_moe(model_type: str, device="cpu", **overrides):
    """Two sparse layers of 8 experts (I = 48, off the interpreter's blocks), top-2, eager attention; the unswapped
    experts run transformers' per-expert loop (the path fused_moe replaces; its grouped_mm path takes bf16 only on
    some torch builds)."""
    if model_type == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**DIMS, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
                                             num_experts_per_tok=2, norm_topk_prob=True, **overrides)
    elif model_type == "mixtral":
        config = transformers.MixtralConfig(**DIMS, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                            **overrides)
    elif model_type == "qwen3_next":   # a Gated DeltaNet layer, then attention; each MoE beside a shared expert
        config = transformers.Qwen3NextConfig(**DIMS, intermediate_size=48, moe_intermediate_size=48, num_experts=8,
                                              num_experts_per_tok=2, shared_expert_intermediate_size=32,
                                              layer_types=["linear_attention", "full_attention"],
                                              linear_num_key_heads=2, linear_num_value_heads=4,
                                              linear_key_head_dim=16, linear_value_head_dim=16, **overrides)
    else:
        raise ValueError(model_type)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.config._experts_implementation == "eager"
    with torch.no_grad():   # routers start at zero in some versions: spread the routing
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.normal_(0, 0.5)
    return model.to(device)


def run(model, ids, labels, grad_logits):
    """(logits, router logits per layer, aux loss, {name: grad}) of loss + Σ logits · grad_logits."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    (out.loss + (out.logits.float() * grad_logits).sum()).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), [r.detach() for r in out.router_logits], out.aux_loss.detach(), grads


def _inputs(model, device, batch=2, seq=11):
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return ids, torch.randint(0, vocab, (batch, seq), device=device), torch.randn(batch, seq, vocab, device=device)


def assert_same_model_outputs(swapped_run, reference_run):
    logits, router_logits, aux, grads = swapped_run
    ref_logits, ref_router_logits, ref_aux, ref_grads = reference_run
    assert_rel_close(logits, ref_logits, name="logits")
    # the first layer's router sees the embeddings only: its logits are the same bits
    assert torch.equal(router_logits[0], ref_router_logits[0])
    for layer, (got, ref) in enumerate(zip(router_logits, ref_router_logits)):
        assert_rel_close(got, ref, name=f"router logits of layer {layer}")
    assert_rel_close(aux, ref_aux, name="aux loss")
    assert set(grads) == set(ref_grads)
    assert any("gate_up_proj" in name for name in grads) and any("mlp.gate.weight" in name for name in grads)
    for name, grad in ref_grads.items():
        # Qwen3-Next's gate parameters sum a term over every token, and those terms cancel: the fused experts' other
        # fp32 summation order moves that small sum by up to ~1e-4 of itself (seed-dependent)
        decay = name.endswith(("linear_attn.dt_bias", "linear_attn.A_log"))
        assert_rel_close(grads[name], grad, threshold=1e-3 if decay else None, name=f"grad {name}")


@pytest.mark.parametrize("impl", ["cuda", "cpu"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen3_next"])
def test_fused_moe_keeps_logits_router_logits_aux_loss_and_gradients(model_type, impl, device):
    if impl == "cpu":
        device = "cpu"
    model = tiny_moe(model_type, device)
    swapped = apply_kernel("fused_moe", copy.deepcopy(model), device=impl)
    assert get_applied_kernels(swapped) == {"fused_moe": 2}
    ids, labels, grad_logits = _inputs(model, device)
    assert_same_model_outputs(run(swapped, ids, labels, grad_logits), run(model, ids, labels, grad_logits))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_auto_set_includes_fused_moe_for_moe_families_only(model_type):
    model = tiny_moe(model_type)
    swapped = apply_default_kernels(copy.deepcopy(model), "auto", device="cpu")
    applied = get_applied_kernels(swapped)
    assert applied["fused_moe"] == 2 and applied["fused_rmsnorm"] > 0 and applied["fused_rope"] == 2
    ids, labels, grad_logits = _inputs(model, "cpu")
    assert_same_model_outputs(run(swapped, ids, labels, grad_logits), run(model, ids, labels, grad_logits))
    dense = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(intermediate_size=96, **{
        k: v for k, v in DIMS.items() if k not in ("router_aux_loss_coef", "output_router_logits")}))
    assert "fused_moe" not in get_applied_kernels(apply_default_kernels(dense, "auto", device="cpu"))
    with pytest.raises(ValueError, match="fused_moe: model_type 'qwen3' has no experts modules"):
        apply_kernel("fused_moe", dense, device="cpu")


def test_swap_touches_only_the_experts_and_reverses():
    model = tiny_moe("qwen3_moe")
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    assert apply_kernel("fused_moe", model, device="cuda") is model
    assert apply_kernel("fused_moe", model, device="cuda") is model         # twice is once
    assert get_applied_kernels(model) == {"fused_moe": 2}
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "Qwen3MoeExperts" and "kernel=fused_moe/cuda" in repr(experts)
    assert "kernel=" not in repr(model.model.layers[0].mlp.gate)               # the router stays transformers'
    after = model.state_dict()
    assert list(after) == list(before)
    for k, (ptr, value) in before.items():
        assert after[k].data_ptr() == ptr and torch.equal(after[k], value), k
    assert restore_original_modules(model) == 2 and get_applied_kernels(model) == {}


def test_experts_the_op_does_not_compute_are_left_alone():
    """A GELU-gated model keeps transformers' experts; a module switched to expert parallelism after the swap runs
    transformers' forward (its ids may point past this rank's experts)."""
    gelu = tiny_moe("qwen3_moe", hidden_act="gelu")
    assert get_applied_kernels(apply_kernel("fused_moe", gelu, device="cpu")) == {}

    model = tiny_moe("qwen3_moe")
    swapped = apply_kernel("fused_moe", copy.deepcopy(model), device="cpu")
    for module in (model, swapped):
        for layer in module.model.layers:
            layer.mlp.experts._is_expert_parallel = True
    ids, labels, _ = _inputs(model, "cpu")
    with torch.no_grad():
        assert torch.equal(swapped(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.fixture
def fake_npu(monkeypatch):
    """The stand-in torch_npu (see standin_torch_npu.py), installed after the test built its models."""
    monkeypatch.setitem(sys.modules, "torch_npu", standin_torch_npu)
    monkeypatch.setattr(torch, "npu", standin_torch_npu.npu, raising=False)
    utils.npu_available.cache_clear()
    standin_torch_npu.calls.clear()
    yield standin_torch_npu.calls
    utils.npu_available.cache_clear()


def test_npu_fused_moe_runs_grouped_matmuls_and_matches(request):
    model = tiny_moe("qwen3_moe")
    ids, labels, grad_logits = _inputs(model, "cpu")
    reference = run(model, ids, labels, grad_logits)
    calls = request.getfixturevalue("fake_npu")
    swapped = apply_kernel("fused_moe", copy.deepcopy(model), device="npu")
    assert get_applied_kernels(swapped) == {"fused_moe": 2}
    result = run(swapped, ids, labels, grad_logits)
    grouped = [args for name, args in calls if name == "npu_grouped_matmul"]
    # per sparse layer: gate|up and down forward; each backward: dx (groups along M) and dW (groups along K)
    assert [a["group_type"] for a in grouped].count(0) == 2 * 2 * 2
    assert [a["group_type"] for a in grouped].count(2) == 2 * 2
    routed = ids.numel() * 2
    # x of the forward GEMMs ([TK, H], [TK, I]) and dy of their dx GEMMs ([TK, 2I], [TK, H])
    assert {a["x"] for a in grouped if a["group_type"] == 0} == {(routed, 64), (routed, 48), (routed, 96)}
    assert_same_model_outputs(result, reference)
