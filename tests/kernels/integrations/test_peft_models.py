"""The registry's swaps on PEFT-wrapped (LoRA) models: swapping the kernels into a model before `get_peft_model`, or
into the PeftModel after it, gives the logits and LoRA gradients of the unswapped PEFT model — for Llama / Qwen2 /
Qwen3 / Qwen3-MoE (RMSNorm, SwiGLU, RoPE; LoRA on every linear layer but the head, adapters non-zero so they count)
and for the hybrid delta-rule family (its gated delta rule / product / IPLR layers' kernels too). rltrain's actor
swaps before wrapping (rltrain/workers/lora.py).

`impl="cuda"`: the Triton kernels (through the interpreter on CPU); `impl="cpu"`: the plain-torch references (no
delta-rule kernels there). Run: `pytest tests/kernels/integrations/test_peft_models.py` (CPU, about a minute).
"""

import copy

import pytest
import torch

from rltrain_kernels.registry import apply_default_kernels, get_applied_kernels
from tests.helpers import assert_rel_close
from tests.model_factory import MODEL_TYPES, tiny_causal_lm

peft = pytest.importorskip("peft")

DELTA_RULE_MIX = ["gated_delta_rule", "gated_delta_product", "iplr", "full_attention"]
DELTA_RULE_KERNELS = {"gated_delta_rule": 1, "gated_delta_product": 1, "iplr_delta_rule": 1}


def _lora(model):
    """LoRA r=4 on every linear layer but the LM head, with lora_B drawn non-zero (PEFT starts it at 0, which would
    make the adapters invisible in the outputs)."""
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    return wrapped


def _hybrid_model():
    from rltrain_kernels.models import HybridDeltaConfig, HybridDeltaForCausalLM

    config = HybridDeltaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, layer_types=DELTA_RULE_MIX,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_heads=2,
                               linear_head_dim=16, num_householder=2, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return HybridDeltaForCausalLM(config)


def _forward_backward(model, ids, grad_logits):
    """Logits, and the gradient of sum(logits * grad_logits) for every trainable (LoRA) parameter."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits.float() * grad_logits).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _check(reference, swapped, expected_swaps, threshold=None):
    assert get_applied_kernels(swapped) == expected_swaps
    assert get_applied_kernels(reference) == {}
    device = next(reference.parameters()).device
    vocab = reference.config.vocab_size
    ids = torch.randint(2, vocab, (2, 11), device=device)
    grad_logits = torch.randn(2, 11, vocab, device=device)
    ref_logits, ref_grads = _forward_backward(reference, ids, grad_logits)
    logits, grads = _forward_backward(swapped, ids, grad_logits)
    assert_rel_close(logits, ref_logits, threshold=threshold, name="logits")
    assert set(grads) == set(ref_grads) and ref_grads and all("lora_" in name for name in ref_grads)
    for name, grad in ref_grads.items():
        assert_rel_close(grads[name], grad, threshold=threshold, name=f"grad {name}")
    # the adapters are live in both: disabling them changes the logits
    with swapped.disable_adapter(), torch.no_grad():
        assert (swapped(input_ids=ids).logits - logits).abs().max() > 1e-2


@pytest.mark.parametrize("order", ["swap-then-wrap", "wrap-then-swap"])
@pytest.mark.parametrize("impl", ["cuda", "cpu"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_kernels_on_a_peft_model_keep_logits_and_lora_gradients(model_type, impl, order, device):
    if impl == "cpu":
        device = "cpu"
    torch.manual_seed(0)
    reference = _lora(tiny_causal_lm(model_type, device=device))
    if order == "swap-then-wrap":
        torch.manual_seed(0)
        swapped = _lora(apply_default_kernels(tiny_causal_lm(model_type, device=device), "auto", device=impl))
    else:
        swapped = apply_default_kernels(copy.deepcopy(reference), "auto", device=impl)
    norms = 2 * (4 if model_type in ("qwen3", "qwen3_moe") else 2) + 1
    moe = {"fused_moe": 1} if model_type == "qwen3_moe" else {}   # the sparse layer's experts (no LoRA on them)
    _check(reference, swapped, {"fused_rmsnorm": norms, "fused_swiglu": 1 if model_type == "qwen3_moe" else 2,
                                "fused_rope": 2, **moe})


@pytest.mark.parametrize("order", ["swap-then-wrap", "wrap-then-swap"])
def test_delta_rule_kernels_on_a_peft_hybrid_model(order, device):
    """The delta-rule layers' kernels (CUDA ids; the interpreter on CPU) in a LoRA-wrapped hybrid model whose
    linear-attention projections carry adapters too."""
    torch.manual_seed(0)
    reference = _lora(_hybrid_model().to(device))
    assert any("q_proj.lora_A" in n and "layers.0." in n for n, _ in reference.named_parameters())
    if order == "swap-then-wrap":
        torch.manual_seed(0)
        swapped = _lora(apply_default_kernels(_hybrid_model().to(device), "auto", device="cuda"))
    else:
        swapped = apply_default_kernels(copy.deepcopy(reference), "auto", device="cuda")
    expected = get_applied_kernels(swapped)
    assert {k: expected.get(k) for k in DELTA_RULE_KERNELS} == DELTA_RULE_KERNELS
    # the chunked kernels sum in another order than the layers' step-by-step PyTorch recurrence: measured 1.0e-5 on
    # a LoRA gradient in fp32 (the interpreter), so 1e-4 here; a lost adapter or kernel bug is O(1)
    _check(reference, swapped, expected, threshold=1e-4)
