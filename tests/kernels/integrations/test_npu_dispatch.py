"""NPU implementations: dispatch and argument handling, checked against a stand-in torch_npu (see its docstring)."""

import copy
import sys

import pytest
import torch

from rltrain_kernels import utils
from rltrain_kernels.registry import apply_default_kernels, get_applied_kernels, get_default_kernels
from tests.helpers import assert_rel_close
from tests.kernels.integrations import standin_torch_npu
from tests.model_factory import forward_backward, tiny_causal_lm


@pytest.fixture
def fake_npu(monkeypatch):
    """Install the stand-in. Tests build their transformers models *before* requesting this fixture's effect
    (transformers probes for torch_npu while building models and would import ops the stand-in lacks)."""
    monkeypatch.setitem(sys.modules, "torch_npu", standin_torch_npu)
    monkeypatch.setattr(torch, "npu", standin_torch_npu.npu, raising=False)
    utils.npu_available.cache_clear()
    standin_torch_npu.calls.clear()
    yield standin_torch_npu.calls
    utils.npu_available.cache_clear()


def test_npu_is_detected_when_no_cuda(fake_npu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert utils.detect_device() == "npu"
    assert {"fused_rmsnorm", "fused_swiglu", "fused_rope"} <= set(get_default_kernels())


def test_npu_kernels_need_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    assert get_default_kernels("npu") == []


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_npu_kernels_dispatch_and_match(request, model_type):
    model = tiny_causal_lm(model_type)
    patched = copy.deepcopy(model)
    fake_npu = request.getfixturevalue("fake_npu")
    applied = get_applied_kernels(apply_default_kernels(patched, device="npu"))
    assert set(applied) == {"fused_rmsnorm", "fused_swiglu", "fused_rope"}
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    grad_logits = torch.randn(2, 9, model.config.vocab_size)
    ref_logits, ref_grads = forward_backward(model, ids, grad_logits)
    fake_npu.clear()
    logits, grads = forward_backward(patched, ids, grad_logits)

    names = [name for name, _ in fake_npu]
    layers = model.config.num_hidden_layers
    norms_per_layer = 4 if model_type == "qwen3" else 2  # qwen3 adds q_norm and k_norm
    assert names.count("npu_rms_norm") == layers * norms_per_layer + 1  # + the final norm
    assert names.count("npu_swiglu") == layers
    assert names.count("npu_rotary_mul") == 2 * layers  # q and k
    rms_eps = {args["epsilon"] for name, args in fake_npu if name == "npu_rms_norm"}
    assert rms_eps == {model.config.rms_norm_eps}
    swiglu = [args for name, args in fake_npu if name == "npu_swiglu"]
    assert all(a["shape"][-1] == 2 * model.config.intermediate_size and a["dim"] == -1 for a in swiglu)
    rotary = [args for name, args in fake_npu if name == "npu_rotary_mul"]
    assert all(a["r1"][1:] == (1, 9, 16) for a in rotary)  # cos unsqueezed on the head dim

    assert_rel_close(logits, ref_logits, name="logits")
    for name, g in ref_grads.items():
        assert_rel_close(grads[name], g, name=f"grad {name}")
