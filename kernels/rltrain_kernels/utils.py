"""Device detection and small helpers shared by the ops and the registry.

Kept free of triton imports so that `detect_device()` works on machines without triton (NPU hosts, macOS).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

DEVICES = ("cuda", "npu", "cpu")


@functools.lru_cache(maxsize=1)
def npu_available() -> bool:
    """True when torch_npu is importable and reports an Ascend NPU."""
    if not module_available("torch_npu"):
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def detect_device() -> str:
    """The accelerator this process computes on: 'cuda' (NVIDIA or ROCm), 'npu' (Ascend), else 'cpu'."""
    if torch.cuda.is_available():
        return "cuda"
    if npu_available():
        return "npu"
    return "cpu"


def triton_interpreted() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1, how CI tests them)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
    return device


def module_available(name: str) -> bool:
    """True when `import name` would succeed (already imported counts, including test stand-ins)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
