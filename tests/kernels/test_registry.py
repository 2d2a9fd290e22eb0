"""The kernel registry: registration rules, discovery, device-neutral ids, include_kernels parsing, config form."""

import logging
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from rltrain_kernels import registry
from rltrain_kernels.registry import (BaseKernel, KernelConfig, apply_default_kernels, apply_kernel,
                                      apply_kernel_config, discover_kernels, get_applied_kernels, get_default_kernels,
                                      get_kernel, known_kernel_ids, parse_include_kernels, register_kernel)
from rltrain_kernels.utils import detect_device

BUILTIN_IDS = {"fused_rmsnorm", "fused_swiglu", "fused_rope"}


@pytest.fixture
def scratch_registry(monkeypatch):
    """Register test kernels without leaking them into other tests."""
    discover_kernels()
    monkeypatch.setattr(registry, "_REGISTRY", {k: dict(v) for k, v in registry._REGISTRY.items()})
    monkeypatch.setattr(registry, "_DISCOVERED", set(registry._DISCOVERED))


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.hits = []


def make_kernel(kernel_id, device, default=True, deps=True):
    class K(BaseKernel):
        @classmethod
        def check_deps(cls):
            return deps

        @classmethod
        def apply(cls, model, **kwargs):
            model.hits.append((cls.kernel_id, cls.device, kwargs))
            return 1

    K.kernel_id, K.device, K.default = kernel_id, device, default
    K.__name__ = K.__qualname__ = f"K_{kernel_id}_{device}"
    return K


def test_builtin_ids_are_device_neutral_and_cover_every_device():
    assert BUILTIN_IDS <= set(known_kernel_ids())
    for kid in BUILTIN_IDS:
        assert set(registry._REGISTRY[kid]) == {"cuda", "npu", "cpu"}, kid


def test_defaults_on_cpu_and_detected_device():
    assert BUILTIN_IDS <= set(get_default_kernels("cpu"))
    assert set(get_default_kernels()) == set(get_default_kernels(detect_device()))


def test_duplicate_registration_is_rejected(scratch_registry):
    register_kernel(make_kernel("dup_test", "cpu"))
    with pytest.raises(ValueError, match="already registered"):
        register_kernel(make_kernel("dup_test", "cpu"))
    register_kernel(make_kernel("dup_test", "cuda"))  # same id, another device: fine


def test_registration_validates_the_class(scratch_registry):
    with pytest.raises(ValueError, match="unknown device"):
        register_kernel(make_kernel("bad_device", "tpu"))
    with pytest.raises(ValueError, match="kernel_id is empty"):
        register_kernel(make_kernel("", "cpu"))

    class NoApply(BaseKernel):
        kernel_id, device = "no_apply", "cpu"

    with pytest.raises(TypeError, match="does not implement apply"):
        register_kernel(NoApply)


def test_unknown_id_lists_known_ids():
    with pytest.raises(ValueError, match=r"unknown kernel id 'fused_nope'.*fused_rmsnorm"):
        get_kernel("fused_nope")
    with pytest.raises(ValueError, match=r"unknown kernel id\(s\) 'fused_nope'.*fused_rope"):
        apply_default_kernels(nn.Linear(2, 2), ["fused_rmsnorm", "fused_nope"])


@pytest.mark.parametrize("value, expected", [
    (None, None), (False, None), ("", None), ("none", None), ([], None),
    (True, "auto"), ("auto", "auto"),
    ("a,b", ["a", "b"]), (" a , b ,", ["a", "b"]), (["a", "b"], ["a", "b"]), (("a",), ["a"]),
], ids=repr)
def test_parse_include_kernels(value, expected):
    assert parse_include_kernels(value) == expected


def test_parse_include_kernels_rejects_other_types():
    with pytest.raises(TypeError, match="include_kernels"):
        parse_include_kernels(3)


def test_apply_default_kernels_selection(scratch_registry, caplog):
    register_kernel(make_kernel("t_default", "cpu"))
    register_kernel(make_kernel("t_optional", "cpu", default=False))
    register_kernel(make_kernel("t_cuda_only", "cuda"))
    register_kernel(make_kernel("t_missing_deps", "cpu", deps=False))
    model = Counter()
    assert apply_default_kernels(model, None, device="cpu") is model   # the API returns the model, in place
    assert model.hits == []

    # a stand-in model has no family adapter: the built-in kernels skip it in auto mode, ours apply
    assert apply_default_kernels(model, "auto", device="cpu") is model
    assert [h[0] for h in model.hits] == ["t_default"]

    model.hits.clear()
    with caplog.at_level(logging.INFO, logger="rltrain_kernels.registry"):
        apply_default_kernels(model, "t_optional,t_cuda_only,t_missing_deps", device="cpu")
    assert [h[0] for h in model.hits] == ["t_optional"]
    assert any("kernels applied on cpu: t_optional ×1" in r.getMessage() for r in caplog.records)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert any("t_cuda_only" in m and "cpu" in m for m in skipped), skipped
    assert any("t_missing_deps" in m for m in skipped), skipped

    with pytest.raises(ValueError, match="no usable implementation on 'cpu'.*cuda"):
        apply_kernel("t_cuda_only", model, device="cpu")
    assert apply_kernel("t_cuda_only", model, device="cuda", flag=1) is model
    assert model.hits[-1] == ("t_cuda_only", "cuda", {"flag": 1})


def test_explicit_kernel_on_unsupported_model_raises_but_auto_skips():
    with pytest.raises(ValueError, match="no adapter for model_type"):
        apply_default_kernels(nn.Linear(2, 2), ["fused_rmsnorm"], device="cpu")
    linear = nn.Linear(2, 2)
    assert apply_default_kernels(linear, "auto", device="cpu") is linear
    assert get_applied_kernels(linear) == {}


def test_kernel_config_form(scratch_registry):
    register_kernel(make_kernel("t_cfg", "cpu"))
    register_kernel(make_kernel("t_cfg", "cuda"))
    model = Counter()
    assert apply_kernel_config(model, {"name": "cpu", "include_kernels": "t_cfg"}) is model
    assert apply_kernel_config(model, {"name": "cuda", "include_kernels": ["t_cfg"]}) is model
    assert [h[1] for h in model.hits] == ["cpu", "cuda"]
    assert apply_kernel_config(model, None) is model
    with pytest.raises(ValueError, match="unknown key.*include"):
        apply_kernel_config(model, {"name": "auto", "include": "auto"})
    with pytest.raises(ValueError, match="kernel_config.name.*'gpu'"):
        apply_kernel_config(model, {"name": "gpu"})
    assert apply_kernel_config(model, KernelConfig(name="cpu", include_kernels=["t_cfg"])) is model
    assert [h[1] for h in model.hits] == ["cpu", "cuda", "cpu"]


@pytest.mark.parametrize("fields, message", [
    ({"name": "gpu"}, r"kernel_config.name: must be auto, cuda, npu or cpu \(got 'gpu'\)"),
    ({"include_kernels": 5}, r"kernel_config.include_kernels: must be auto, none, a comma-separated string or a list "
                             r"of kernel ids \(got 5\)"),
    ({"include_kernels": "fused_rmsnorm,fused_nope"},
     r"kernel_config.include_kernels: unknown kernel id\(s\) 'fused_nope'; known kernel ids: .*fused_rmsnorm"),
    ({"delta_rule_recurrence_dot": "fp8"}, r"kernel_config.delta_rule_recurrence_dot: must be auto, bf16, tf32"),
], ids=["name", "include-type", "include-unknown-id", "recurrence-dot"])
def test_kernel_config_is_validated_on_construction(fields, message):
    """The typed config form checks every key when built (no model needed), naming it; so does its mapping."""
    with pytest.raises(ValueError, match=message):
        KernelConfig(**fields)
    with pytest.raises(ValueError, match=message):
        KernelConfig.from_mapping(fields)


def test_kernel_config_from_mapping_defaults_and_unknown_keys():
    assert KernelConfig.from_mapping({}) == KernelConfig(name="auto", include_kernels="auto",
                                                         delta_rule_recurrence_dot="auto")
    assert KernelConfig.from_mapping({"include_kernels": ["fused_rope"]}).include_kernels == ["fused_rope"]
    with pytest.raises(ValueError, match="kernel_config: unknown key\\(s\\) include; expected "
                                         "delta_rule_recurrence_dot, include_kernels, name"):
        KernelConfig.from_mapping({"include": "auto"})


# The kernels that carry each layer's recurrence, by (ops module, kernel name): the gated delta rule / product's WY and
# state passes (forward and backward), KDA's intra-chunk solve and state passes.
COMMON_RECURRENCE = (("common.wy", "gated_wy_fwd_kernel"), ("common.state_pass", "state_pass_fwd_kernel"),
                     ("common.state_pass", "state_pass_bwd_kernel"), ("common.wy_bwd", "gated_wy_bwd_kernel"))
RECURRENCE_KERNELS = {"rule": COMMON_RECURRENCE, "product": COMMON_RECURRENCE,
                      "kda": (("kda.intra", "kda_intra_fwd_kernel"), ("kda.chunk_fwd", "kda_state_fwd_kernel"),
                              ("kda.chunk_bwd", "kda_state_bwd_kernel"))}
DELTA_RULE_KERNELS = "gated_delta_rule,gated_delta_product,kda"


def delta_rule_model() -> nn.ModuleDict:
    """A GatedDeltaNet, a GatedDeltaProduct (n_h = 2) and a KimiDeltaAttention layer (K = V = 16), bf16: the inputs
    the mode applies to."""
    from rltrain_kernels.layers import GatedDeltaNet, GatedDeltaProduct, KimiDeltaAttention

    torch.manual_seed(0)
    return nn.ModuleDict({"rule": GatedDeltaNet(32, num_heads=1, head_dim=16),
                          "product": GatedDeltaProduct(32, num_heads=1, head_dim=16),
                          "kda": KimiDeltaAttention(32, num_heads=1, head_dim=16)}).to(torch.bfloat16)


def test_delta_rule_recurrence_dot_holds_per_model(monkeypatch, device):
    """kernel_config.delta_rule_recurrence_dot goes to the gated delta rule / product and KDA kernels of the model it
    is applied to, bound into its swapped layers' op calls: two models in one process, configured differently, each
    launch their recurrence kernels (WY and state passes; KDA's intra-chunk solve and state passes) with their own
    DOT_PREC, forward and backward, whatever ran before (a spy on the launches: the interpreter ignores
    input_precision, so the outputs cannot show it). A mapping without the key gets the default; the swapped layers'
    repr names the mode; applying the same config again changes nothing."""
    import importlib

    from tests.helpers import spy_launches

    accurate = apply_kernel_config(delta_rule_model().to(device), KernelConfig(name="cuda", include_kernels=DELTA_RULE_KERNELS,
                                                                    delta_rule_recurrence_dot="tf32"))
    shipped = apply_kernel_config(delta_rule_model().to(device), {"name": "cuda", "include_kernels": DELTA_RULE_KERNELS})
    for model, mode in ((accurate, "tf32"), (shipped, "auto")):
        assert get_applied_kernels(model) == {"gated_delta_rule": 1, "gated_delta_product": 1, "kda": 1}
        assert all(f"recurrence_dot={mode}" in repr(layer) for layer in model.values())
    launched: dict[str, set[str]] = {}
    for module, name in {entry for entries in RECURRENCE_KERNELS.values() for entry in entries}:
        spy_launches(monkeypatch, importlib.import_module(f"rltrain_kernels.ops.{module}"), name,
                     lambda args, kwargs, name=name: launched.setdefault(name, set()).add(
                         kwargs["DOT_PREC"].removesuffix("_interpreted")))
    for model, dot_prec in ((accurate, "tf32"), (shipped, "bf16"), (accurate, "tf32")):
        for kind, layer in model.items():
            launched.clear()
            out, _ = layer(torch.randn(1, 20, 32, dtype=torch.bfloat16, device=device, requires_grad=True))
            out.float().square().sum().backward()
            assert launched == {name: {dot_prec} for _, name in RECURRENCE_KERNELS[kind]}, (kind, launched)
    assert get_kernel("gated_delta_rule", "cuda").apply(accurate, recurrence_dot="tf32") == 0
    assert get_kernel("gated_delta_product", "cuda").apply(shipped, recurrence_dot="tf32") == 1  # now it runs tf32
    assert get_kernel("kda", "cuda").apply(accurate, recurrence_dot="tf32") == 0
    assert "recurrence_dot=tf32" in repr(shipped["product"]) and "recurrence_dot=auto" in repr(shipped["rule"])
    assert "recurrence_dot=auto" in repr(shipped["kda"])


@pytest.mark.parametrize("kernel_id", ["gated_delta_rule", "gated_delta_product", "kda"])
def test_delta_rule_kernels_name_a_bad_recurrence_dot(kernel_id):
    """A bad mode handed to a kernel directly is a ValueError naming the argument, before any module changes (the
    config form names its key: test_kernel_config_is_validated_on_construction)."""
    model = delta_rule_model()
    with pytest.raises(ValueError, match=r"recurrence_dot must be one of auto, bf16, tf32; got 'fp8'"):
        apply_kernel(kernel_id, model, device="cuda", recurrence_dot="fp8")
    assert get_applied_kernels(model) == {}


def test_layer_kernels_refuse_options_they_do_not_take():
    """An option a layer kernel has no use for is a TypeError naming it (IPLR's ops take no recurrence_dot), before
    any module changes, rather than a silently ignored setting."""
    from rltrain_kernels.layers import IPLRLinearAttention

    model = torch.nn.ModuleDict({"iplr": IPLRLinearAttention(32, num_heads=1, head_dim=16)})
    with pytest.raises(TypeError, match=r"iplr_delta_rule: apply\(\) takes no option\(s\) 'recurrence_dot'"):
        apply_kernel("iplr_delta_rule", model, device="cuda", recurrence_dot="tf32")
    with pytest.raises(TypeError, match=r"kda: apply\(\) takes no option\(s\) 'chunk_size'"):
        apply_kernel("kda", delta_rule_model(), device="cuda", chunk_size=32)
    assert get_applied_kernels(model) == {}


def test_discovery_survives_a_broken_module(tmp_path, monkeypatch, scratch_registry, caplog):
    pkg = tmp_path / "fake_kernel_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text(textwrap.dedent("""
        from rltrain_kernels.registry import BaseKernel, register_kernel

        @register_kernel
        class Good(BaseKernel):
            kernel_id, device = "t_discovered", "cpu"

            @classmethod
            def apply(cls, model, **kwargs):
                return 0
    """))
    (pkg / "broken.py").write_text("import a_module_that_does_not_exist_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="rltrain_kernels.registry"):
        failed = discover_kernels("fake_kernel_pkg")
    assert failed == ["fake_kernel_pkg.broken"]
    assert "t_discovered" in known_kernel_ids()
    assert any("fake_kernel_pkg.broken" in r.getMessage() for r in caplog.records)
    assert discover_kernels("fake_kernel_pkg") == []  # once only
    sys.modules.pop("fake_kernel_pkg.good", None)
    sys.modules.pop("fake_kernel_pkg", None)
