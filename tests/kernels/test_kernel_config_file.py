"""config/kernel_config/default.yaml is valid input for apply_kernel_config and applies the device defaults."""

from pathlib import Path

import yaml

from rltrain_kernels.registry import apply_kernel_config, get_applied_kernels
from tests.model_factory import tiny_causal_lm

CONFIG = Path(__file__).resolve().parents[2] / "config" / "kernel_config" / "default.yaml"


def test_default_kernel_config_applies_every_default_kernel():
    config = yaml.safe_load(CONFIG.read_text())
    assert config == {"name": "auto", "include_kernels": "auto", "delta_rule_recurrence_dot": "auto"}
    model = tiny_causal_lm("qwen3")
    applied = get_applied_kernels(apply_kernel_config(model, config))
    assert set(applied) == {"fused_rmsnorm", "fused_swiglu", "fused_rope"}
    assert all(count > 0 for count in applied.values())
