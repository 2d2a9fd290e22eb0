"""Test-wide setup: run Triton kernels through the interpreter when no GPU is present, skip GPU-only tests, and skip
the @pytest.mark.vllm tests where vllm is not installed (scripts/test.sh runs them in .venv-vllm).

TRITON_INTERPRET must be set before triton is first imported, which is why this happens at conftest import time
(pytest imports conftest before any test module). `import torch` does not import triton.

scripts/test.sh runs the suite on pytest-xdist workers. The system tests (SERIAL: whole training jobs, Ray
clusters, subprocesses with their own time bounds) form one scope of xdist's scheduling, run one after another on
one worker, so at most one of them competes with the kernel tests for the machine's cores at any time, and the
kernel tests run at a lower priority. Each worker's own torch ops run on one thread (processes the tests start keep
torch's default).
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


SERIAL = ("tests/rltrain/", "tests/test_scripts.py", "tests/test_docker.py")
KERNEL_TESTS_NICE = 10


@pytest.hookimpl(optionalhook=True)  # an xdist hook: a bare pytest has no xdist
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with one scope for the SERIAL tests and one per test elsewhere. The largest scope
    goes out first (xdist's default reordering), so the system tests start at once on one worker. (The xdist_group
    mark cannot do this under pytest 9: xdist 3.8 renames the test by a private attribute pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SystemTestsInOneScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "system" if nodeid.startswith(SERIAL) else nodeid

    return SystemTestsInOneScope(config, log)


def pytest_runtest_setup(item):
    """Under xdist the kernel tests yield the cores to the system tests (nice 10: only ever raised, and a worker
    runs no system test after a kernel test, since their scope goes out first). Sharing evenly, the embedded
    default's learning run took 574 s of its 600 s bound instead of ~270 s."""
    if os.environ.get("PYTEST_XDIST_WORKER") and not item.nodeid.startswith(SERIAL):
        if os.getpriority(os.PRIO_PROCESS, 0) < KERNEL_TESTS_NICE:
            os.setpriority(os.PRIO_PROCESS, 0, KERNEL_TESTS_NICE)


def pytest_collection_modifyitems(config, items):
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
