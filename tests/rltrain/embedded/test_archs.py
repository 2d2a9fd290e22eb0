"""The delta-rule archs of the embedded default (model.embedded.arch = hybrid | gdp | iplr) against its Qwen3 on the
CPU: one RL step's heavy phases — the rollout worker's generate (32 prompts × 16 responses of up to 8 tokens), the
actor's old log-probs and its update (packed rows) — through the real workers in process, interleaved with the
Qwen3's so both see the same machine. The README's per-arch table (held-out gain of the full default within 10
minutes) rests on these ratios: a delta-rule layer that falls off its fast CPU path (the per-step recurrence in
training, autograd through the conv's shifted masks, advanced-indexing gathers) costs several times more.

    .venv/bin/python -m pytest tests/rltrain/embedded/test_archs.py -q      # about a minute on 2 cores
"""

from __future__ import annotations

import time

import pytest
import torch

from rltrain.algorithms.config import LossConfig
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.model import DEFAULT_LAYERS, EmbeddedModelConfig, embedded_policy_dir
from rltrain.embedded.task import TaskConfig, make_rows
from rltrain.workers.actor import ActorConfig, ActorWorker
from rltrain.workers.rollout import RolloutConfig, RolloutWorker

# Measured (2 cores, one thread, the fastest of 3): the step's phases take 2.4x / 1.8x / 1.5x the Qwen3's; the full
# default then ran in <see README> minutes. The bounds leave room for load, not for a layer off its fast path.
MAX_RATIO = {"hybrid": 3.2, "gdp": 2.5, "iplr": 2.1}
REPEATS = 3


class Step:
    """One arch's workers, warm-start skipped (the same untrained shapes and token counts for every arch)."""

    def __init__(self, arch: str, output_dir: str):
        config = EmbeddedModelConfig(arch=arch, warmstart_steps=0)
        model_dir = str(embedded_policy_dir(output_dir, config, TaskConfig(), seed=0))
        self.rollout = RolloutWorker(RolloutConfig(torch_threads=1), model_dir, "float32", None)
        self.actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), model_dir, "float32", None, 1.0)

    def run(self, ids: torch.Tensor, mask: torch.Tensor) -> float:
        """Seconds for generate + old log-probs + update."""
        started = time.perf_counter()
        batch = self.rollout.generate(ids, mask, 16, 1.0, seed=0)
        batch["old_logprobs"] = self.actor.compute_logprobs(batch)
        batch["advantages"] = torch.randn(batch.batch_size[0], 1).expand_as(batch["response_mask"]).contiguous()
        self.actor.update(batch)
        return time.perf_counter() - started


@pytest.mark.slow
def test_delta_rule_archs_step_time_against_qwen3(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    # the CPU paths a run takes: tests/conftest.py's interpreter would run the gated RMSNorm as a Triton kernel
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    threads = torch.get_num_threads()
    steps = {arch: Step(arch, str(tmp_path)) for arch in ("qwen3", *MAX_RATIO)}
    tokenizer = AutoTokenizer.from_pretrained(next((tmp_path / "warmstart").iterdir()))
    ids, mask = encode_prompts(make_rows(TaskConfig())[0][:32], tokenizer)
    try:
        times = {arch: [] for arch in steps}
        for _ in range(REPEATS + 1):   # the first round warms up
            for arch, step in steps.items():
                times[arch].append(step.run(ids, mask))
    finally:
        torch.set_num_threads(threads)
    best = {arch: min(t[1:]) for arch, t in times.items()}
    ratios = {arch: best[arch] / best["qwen3"] for arch in MAX_RATIO}
    print({arch: f"{seconds:.2f} s" for arch, seconds in best.items()}, ratios)
    for arch, ratio in ratios.items():
        assert ratio <= MAX_RATIO[arch], f"{arch} ({DEFAULT_LAYERS[arch]} layers): {ratio:.2f}x the Qwen3's step"
