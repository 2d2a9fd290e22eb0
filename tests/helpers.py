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
