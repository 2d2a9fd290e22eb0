"""Test-wide setup: run Triton kernels through the interpreter when no GPU is present, skip GPU-only tests, and skip
the @pytest.mark.vllm tests where vllm is not installed (scripts/test.sh runs them in .venv-vllm).

TRITON_INTERPRET must be set before triton is first imported, which is why this happens at conftest import time
(pytest imports conftest before any test module). `import torch` does not import triton.

scripts/test.sh runs the suite in two parts (RLTRAIN_TEST_PART): the kernel tests on pytest-xdist workers, each
worker's torch ops on one thread; then the system tests (SYSTEM: whole training jobs, Ray clusters, subprocesses,
wall-clock bounds; the docs' commands composed against config/) in one process with the machine to themselves. Run
beside the kernel tests they lost their bounds, and nice could not help: Ray's processes start sessions of their own,
which Linux's autogroup scheduling shares the cores with evenly whatever the kernel tests' niceness.
"""

import importlib.util
import os
import random

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_VLLM = importlib.util.find_spec("vllm") is not None
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # workers share the cores: 1.7x faster than each spinning up one thread per core


def _pin_transformers_reference_paths() -> None:
    """Transformers binds Qwen3-Next's delta rule and short convolution to fla / causal-conv1d at import time when
    they are installed, on every device (fla's kernels then fail on CPU tensors and in float64, and fla 0.6 refuses
    Triton < 3.7.1 on Hopper). The tests compare against transformers' PyTorch path, so point those names back to
    it: the functions keep their originals as `__wrapped__`."""
    if not any(importlib.util.find_spec(name) for name in ("fla", "causal_conv1d")):
        return
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        fn = getattr(qwen3_next, name, None)
        if fn is not None and hasattr(fn, "__wrapped__"):
            setattr(qwen3_next, name, fn.__wrapped__)


_pin_transformers_reference_paths()


SYSTEM = ("tests/rltrain/", "tests/test_scripts.py", "tests/test_docker.py", "tests/test_docs.py")
PARTS = ("kernels", "system")  # RLTRAIN_TEST_PART: the tests outside SYSTEM, or SYSTEM's alone


def pytest_collection_modifyitems(config, items):
    part = os.environ.get("RLTRAIN_TEST_PART")
    if part:
        if part not in PARTS:
            raise pytest.UsageError(f"RLTRAIN_TEST_PART={part!r}: expected one of {PARTS} (or unset: every test)")
        keep, drop = [], []
        for item in items:
            (keep if item.nodeid.startswith(SYSTEM) == (part == "system") else drop).append(item)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_vllm = pytest.mark.skip(reason="needs vllm: scripts/test.sh runs these in .venv-vllm")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("vllm") is not None and not HAS_VLLM:
            item.add_marker(skip_vllm)


@pytest.fixture
def device() -> str:
    """The device the kernels under test run on: CUDA when present, else CPU (Triton through the interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def poison_allocations(monkeypatch):
    """Fill every float tensor the host code allocates with NaN (torch.empty / empty_like), so an output element
    a kernel fails to write shows up as non-finite instead of passing on a lucky zero."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(real_empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(real_empty_like(*args, **kwargs)))


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Seed every test from fresh entropy and record the seed, so each run draws new inputs yet a failure
    can be replayed with RLTRAIN_TEST_SEED=<seed>."""
    seed = int(os.environ.get("RLTRAIN_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        seed = dict(item.user_properties).get("seed")
        if seed is not None:
            report.sections.append(("seed", f"replay with RLTRAIN_TEST_SEED={seed}"))
