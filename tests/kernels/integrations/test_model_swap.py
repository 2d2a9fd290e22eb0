"""Model-level: swapping kernels into Llama / Qwen2 / Qwen3 / Qwen3-MoE (and Qwen3-Next's gated output norms) built
from configs keeps logits and every gradient, and never touches weights, parameter names or state_dict keys.

`impl="cuda"` runs the Triton kernels — natively on a GPU, through the interpreter on CPU (how CI checks them);
`impl="cpu"` runs the plain-torch references.
"""

import copy
import inspect

import pytest
import torch

from rltrain_kernels.integrations.families import restore_original_modules
from rltrain_kernels.registry import apply_default_kernels, apply_kernel, get_applied_kernels
from tests.helpers import assert_decay_grad_close, assert_rel_close, record_decay_terms, rel_error
from tests.model_factory import MODEL_TYPES, forward_backward, tiny_causal_lm

ALL = {"fused_rmsnorm", "fused_swiglu", "fused_rope"}


def _inputs(model, batch=2, seq=11):
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=model.device)
    grad_logits = torch.randn(batch, seq, model.config.vocab_size, device=model.device)
    return ids, grad_logits


def _expected_swaps(model_type):
    layers = 2
    norms = layers * (4 if model_type in ("qwen3", "qwen3_moe") else 2) + 1
    mlps = 1 if model_type == "qwen3_moe" else layers  # the MoE model's second layer is sparse
    moe = {"fused_moe": 1} if model_type == "qwen3_moe" else {}   # its experts module
    return {"fused_rmsnorm": norms, "fused_swiglu": mlps, "fused_rope": layers, **moe}


@pytest.mark.parametrize("impl", ["cuda", "cpu"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_swapped_model_matches_fp32(model_type, impl, device):
    if impl == "cpu":
        device = "cpu"
    model = tiny_causal_lm(model_type, device=device)
    patched = copy.deepcopy(model)
    assert apply_default_kernels(patched, "auto", device=impl) is patched
    assert get_applied_kernels(patched) == _expected_swaps(model_type)

    ids, grad_logits = _inputs(model)
    ref_logits, ref_grads = forward_backward(model, ids, grad_logits)
    logits, grads = forward_backward(patched, ids, grad_logits)
    assert_rel_close(logits, ref_logits, name="logits")
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert_rel_close(grads[name], g, name=f"grad {name}")


def test_swap_keeps_weights_names_and_state_dict():
    model = tiny_causal_lm("qwen3")
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    apply_default_kernels(model, "auto", device="cuda")
    after = model.state_dict()
    assert list(after) == list(before)
    assert [n for n, _ in model.named_parameters()] == names
    for k, (ptr, value) in before.items():
        assert after[k].data_ptr() == ptr and torch.equal(after[k], value), k


def test_swap_is_idempotent_visible_and_reversible():
    model = tiny_causal_lm("llama")
    first = get_applied_kernels(apply_default_kernels(model, "auto", device="cuda"))
    apply_default_kernels(model, "auto", device="cuda")
    assert get_applied_kernels(model) == first
    assert "kernel=fused_rmsnorm/cuda" in repr(model)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"  # class name kept for tooling that matches on it
    # switching a module to another device's implementation replaces, not stacks
    apply_kernel("fused_rmsnorm", model, device="cpu")
    assert get_applied_kernels(model) == first
    assert type(model.model.norm).__mro__[1].__name__ == "LlamaRMSNorm"
    assert restore_original_modules(model) == sum(first.values())
    assert "kernel=" not in repr(model)


def test_swap_is_per_model_not_process_wide():
    patched, untouched = tiny_causal_lm("qwen2"), tiny_causal_lm("qwen2")
    apply_kernel("fused_rope", patched, device="cuda")
    # the module's own forward under any decorators (transformers 5.24 wraps it in deprecate_kwarg)
    untouched_forward = inspect.unwrap(type(untouched.model.layers[0].self_attn).forward)
    patched_forward = inspect.unwrap(type(patched.model.layers[0].self_attn).forward)
    assert untouched_forward.__globals__["apply_rotary_pos_emb"].__module__.startswith("transformers.")
    assert patched_forward.__globals__["apply_rotary_pos_emb"].__module__.startswith("rltrain_kernels.")
    assert type(patched.model.layers[0].self_attn).__name__ == "Qwen2Attention"


def test_swap_into_a_loaded_model(tmp_path):
    import transformers as tf

    tiny_causal_lm("qwen3").save_pretrained(tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    reference = copy.deepcopy(loaded)
    apply_default_kernels(loaded, "fused_rmsnorm,fused_swiglu,fused_rope", device="cuda")
    assert set(get_applied_kernels(loaded)) == {"fused_rmsnorm", "fused_swiglu", "fused_rope"}
    ids, grad_logits = _inputs(loaded)
    ref_logits, _ = forward_backward(reference, ids, grad_logits)
    logits, _ = forward_backward(loaded, ids, grad_logits)
    assert_rel_close(logits, ref_logits, name="logits")


def test_swiglu_leaves_non_silu_mlps_alone():
    model = tiny_causal_lm("llama", hidden_act="gelu")
    apply_kernel("fused_swiglu", model, device="cuda")
    assert get_applied_kernels(model) == {}


def tiny_qwen3_next(device="cpu"):
    """Three layers (two Gated DeltaNet, one full attention), MoE MLPs; fp32."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=24, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32)
    config._attn_implementation = "eager"
    return modeling.Qwen3NextForCausalLM(config).to(device)


@pytest.mark.parametrize("impl", ["cuda", "cpu"])
def test_qwen3_next_gated_norm_swap_matches_fp32(impl, device):
    """fused_gated_rmsnorm swaps both GatedDeltaNet output norms (head_v_dim 24: not a power of two) and the model
    keeps transformers' logits and every gradient; on "cuda" every norm call runs the Triton kernel (interpreted on
    CPU)."""
    import rltrain_kernels.ops.rmsnorm as rmsnorm_ops

    if impl == "cpu":
        device = "cpu"
    model = tiny_qwen3_next(device)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.norm.weight.normal_(1.0, 0.5)  # non-trivial, so a dropped or misplaced weight shows
                # decays α ≈ 0.45-0.9 as test_layers draws them: at transformers' init (A up to 16, α down to e⁻²⁰)
                # its chunked delta rule, fp32 even in a float64 model, is itself off by up to 2.3e-3 of Σ|term| in
                # dA_log / ddt_bias against a float64 recurrence (24 seeds), which no kernel swapped here changes
                layer.linear_attn.A_log.uniform_(-2.5, -0.5)
    patched = copy.deepcopy(model)
    apply_kernel("fused_gated_rmsnorm", patched, device=impl)
    assert get_applied_kernels(patched) == {"fused_gated_rmsnorm": 2}
    assert repr(patched).count(f"kernel=fused_gated_rmsnorm/{impl}") == 2

    ids, grad_logits = _inputs(model)
    ref_logits, ref_grads = forward_backward(model, ids, grad_logits)
    calls = []
    real_apply = rmsnorm_ops.GatedRMSNormFunction.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rmsnorm_ops.GatedRMSNormFunction, "apply",
                   staticmethod(lambda *args: calls.append(args[0].shape) or real_apply(*args)))
        logits, grads = forward_backward(patched, ids, grad_logits)
    assert len(calls) == (2 if impl == "cuda" else 0)
    assert_rel_close(logits, ref_logits, name="logits")
    assert set(grads) == set(ref_grads)
    assert any(".norm.weight" in name and "linear_attn" in name for name in grads)
    # Against float64, every gradient by fp32's 1e-5; dA_log and ddt_bias are sums over every token whose terms can
    # cancel, so their relative error can pass any fp32 bar at random: they are judged by ‖error‖ over
    # ‖Σ_tokens |term|‖ (record_decay_terms), at most 8e-7 over 24 seeds; a wrong term is off by far more.
    exact = copy.deepcopy(model).double()
    exact.config._experts_implementation = "eager"  # torch's grouped_mm has no float64
    decay_terms = record_decay_terms(exact)
    _, exact_grads = forward_backward(exact, ids, grad_logits.double())
    assert len(decay_terms) == 4, sorted(decay_terms)  # dt_bias and A_log of both Gated DeltaNet layers
    for name, g in exact_grads.items():
        if name in decay_terms:
            assert_decay_grad_close(grads[name], g, decay_terms[name], 1e-5, f"grad {name}")
        else:
            assert_rel_close(grads[name].double(), g, threshold=1e-5, name=f"grad {name}")


def test_qwen3_next_defaults_include_gated_norm_idempotent_and_reversible():
    model = tiny_qwen3_next()
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    first = get_applied_kernels(apply_default_kernels(model, "auto", device="cuda"))
    assert first["fused_gated_rmsnorm"] == 2 and "fused_rmsnorm" not in first  # (1 + w) norms are left alone
    norm = model.model.layers[0].linear_attn.norm
    assert type(norm).__name__ == "Qwen3NextRMSNormGated" and "kernel=fused_gated_rmsnorm/cuda" in repr(norm)
    apply_default_kernels(model, "auto", device="cuda")
    assert get_applied_kernels(model) == first
    after = model.state_dict()
    assert list(after) == list(before)
    for k, (ptr, value) in before.items():
        assert after[k].data_ptr() == ptr and torch.equal(after[k], value), k
    apply_kernel("fused_gated_rmsnorm", model, device="cpu")
    assert get_applied_kernels(model) == first  # replaces, does not stack
    assert type(norm).__mro__[1].__name__ == "Qwen3NextRMSNormGated"
    assert restore_original_modules(model) == sum(first.values())
    assert "kernel=" not in repr(model)


def test_gated_norm_kernel_needs_a_family_with_gated_norms():
    from rltrain_kernels.registry import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="gated_rmsnorm"):
        apply_kernel("fused_gated_rmsnorm", tiny_causal_lm("qwen3"), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_swapped_bf16_model_is_no_less_accurate_than_eager(model_type):
    """bf16 on the GPU at a less tiny size: the fused model's error against an fp32 copy is within 1.5× (+1e-3) of
    the unfused bf16 model's error, for logits and gradients."""
    dims = dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=4,
                head_dim=64, vocab_size=4096)
    fp32 = tiny_causal_lm(model_type, dtype=torch.float32, device="cuda", **dims)
    eager = copy.deepcopy(fp32).to(torch.bfloat16)
    fused = copy.deepcopy(eager)
    apply_default_kernels(fused, "auto", device="cuda")
    ids, grad_logits = _inputs(fp32, batch=4, seq=256)
    ref_logits, ref_grads = forward_backward(fp32, ids, grad_logits)
    eager_logits, eager_grads = forward_backward(eager, ids, grad_logits)
    fused_logits, fused_grads = forward_backward(fused, ids, grad_logits)
    assert rel_error(fused_logits, ref_logits) <= 1.5 * rel_error(eager_logits, ref_logits) + 1e-3
    for name, g in ref_grads.items():
        fused_err, eager_err = rel_error(fused_grads[name], g), rel_error(eager_grads[name], g)
        assert fused_err <= 1.5 * eager_err + 1e-3, f"{name}: fused {fused_err:.2e} vs eager {eager_err:.2e}"
