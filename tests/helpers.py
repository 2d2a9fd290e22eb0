"""Shared test helpers: relative-error asserts with per-dtype thresholds, NaN checks, poisoned buffers, case ids.

The error metric is ‖actual − expected‖ / ‖expected‖ computed in float64 (fla's convention), which is scale-free
and does not hide large errors in a few elements the way a loose atol does.
"""

from __future__ import annotations

import os

import torch

# Per-dtype relative-error thresholds for element-wise / row-wise kernels compared against a float64 reference.
REL_THRESHOLD = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖₂ / ‖expected‖₂ in float64 (plain ‖actual‖ when expected is all zeros)."""
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def assert_finite(t: torch.Tensor, name: str = "tensor") -> None:
    bad = ~torch.isfinite(t.detach())
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{name}: {int(bad.sum())} non-finite values (first at {idx}) of {t.numel()}")


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None,
                     threshold: float | None = None, name: str = "tensor") -> float:
    """Assert shape match, no NaN/inf, and relative error within the threshold for `dtype` (default: actual's)."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert_finite(actual, name)
    if threshold is None:
        threshold = REL_THRESHOLD[dtype or actual.dtype]
    err = rel_error(actual, expected)
    assert err <= threshold, f"{name}: relative error {err:.3e} > {threshold:.1e}"
    return err


def poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer filled with NaN, so any element a kernel fails to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def case_id(**dims) -> str:
    """Readable parametrize ids: case_id(B=2, T=75) -> 'B2-T75'."""
    return "-".join(f"{k}{v}" for k, v in dims.items())


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def outputs_and_grads_per_setting(fn, inputs, do, settings, apply) -> dict:
    """{setting: [o, final state, every input's gradient]} of fn on fresh leaf copies of `inputs` (the op's five
    tensors, then the initial state) for the loss ⟨o, do⟩ + Σ final state², after apply(setting) for each setting:
    the same call under switches that must not change a number."""
    results = {}
    for setting in settings:
        apply(setting)
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        ((o.float() * do.float()).sum() + ht.square().sum()).backward()
        results[setting] = [o, ht] + [t.grad for t in leaves]
    return results


def assert_bitwise_equal(first: list, second: list, names: list[str], what: str) -> None:
    """Each pair of tensors identical to the bit; the message names the first that differs and by how much."""
    for name, a, b in zip(names, first, second, strict=True):
        assert torch.equal(a, b), f"{name} changed with {what}: {(a.float() - b.float()).abs().max()}"


def state_pass_batch(value_block: str, heads: int, V: int, device) -> int:
    """The batch size (sequences of `heads` heads, `V` value columns) at which ops/common/state_pass.py launches its
    state passes with 64 value columns per program ("wide": enough sequence-heads to fill every SM, as at the timed
    B8 H16) or its NARROW_BV ("narrow": 2 sequences), chosen by the shape as the host code chooses, and asserted.
    Triton 3.6 miscompiled one launch setting of a state pass on Hopper (1 stage, bf16 dots, no gate:
    ops/common/launch.py), so the GPU tests hold every launch the host can pick."""
    from rltrain_kernels.ops.common import state_pass

    device = torch.device(device)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    batch = -(-sm_count // (heads * -(-V // 64))) if value_block == "wide" else 2
    name = state_pass.state_launch("state_pass_bwd", batch * heads, 128, V, device)[0]
    assert name.endswith("_wide") == (value_block == "wide"), (value_block, batch, name)
    return batch


def spy_launches(monkeypatch, module, name: str, record) -> None:
    """Replace the Triton kernel module.name by one that calls record(args, kwargs) before each launch, then launches:
    a test's check that a switch reaches (or skips) a kernel."""
    kernel = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                record(args, kwargs)
                return kernel[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(module, name, Spy())
