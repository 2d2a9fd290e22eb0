"""The delta-rule archs of the embedded default (model.embedded.arch = hybrid | gdp | iplr) against its Qwen3 on the
CPU: one RL step's heavy phases — the rollout worker's generate (32 prompts × 16 responses of up to 8 tokens), the
actor's old log-probs and its update (packed rows) — through the real workers in process, interleaved with the
Qwen3's so both see the same machine. docs/delta-rule.md's per-arch table (held-out gain of the full default within 10
minutes) rests on these ratios: a delta-rule layer that falls off its fast CPU path (the per-step recurrence in
training, autograd through the conv's shifted masks, advanced-indexing gathers) costs several times more. Also: each
arch's default layers, and the warm-start cache keyed by them.

    .venv/bin/python -m pytest tests/rltrain/embedded/test_archs.py -q      # about 40 s on 2 cores
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from rltrain.algorithms.config import LossConfig
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.config import EmbeddedModelConfig, TaskConfig
from rltrain.embedded.model import DEFAULT_LAYERS, embedded_policy_dir, layer_types
from rltrain.embedded.task import make_rows
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.rollout import RolloutConfig, RolloutWorker

# The full default of every arch must end within 10 minutes. The Qwen3's took 4.1 min (0.7 s/step), 3.5 of them in
# its 300 steps, so an arch whose step costs at most 2.5x the Qwen3's ends within 0.6 + 2.5 * 3.5 < 10 min.
# Measured here (2 cores, one thread; one thread's ratios are the higher): hybrid 1.85x, gdp 1.82x, iplr 1.45x,
# whose full defaults took 6.0 / 6.8 / 5.2 min (1.1 / 1.2 / 0.9 s/step). The bounds sit ~20% above those (the
# ratios moved by 2% between runs), under 2.5x: a hybrid training through the per-step recurrence instead of the
# chunked form measured 2.38x; the layers before their CPU path was reworked, 2.11x / 2.24x / 1.71x.
MAX_RATIO = {"hybrid": 2.2, "gdp": 2.2, "iplr": 1.75}
REPEATS = 3


def test_arch_layers_and_the_warm_start_they_key(tmp_path, monkeypatch):
    """Each arch's default mixers (a hybrid ends on attention; more layers repeat Qwen3-Next's 3 : 1), and the
    warm-start cache keyed by the resolved layers: a changed default layer count builds a new model rather than
    reusing the old one's directory."""
    rule, attention = "gated_delta_rule", "full_attention"
    assert layer_types(EmbeddedModelConfig(arch="qwen3")) is None
    assert layer_types(EmbeddedModelConfig(arch="hybrid")) == [rule, rule, attention]
    assert layer_types(EmbeddedModelConfig(arch="hybrid", num_layers=8)) == ([rule] * 3 + [attention]) * 2
    assert layer_types(EmbeddedModelConfig(arch="gdp")) == ["gated_delta_product"] * 2
    assert layer_types(EmbeddedModelConfig(arch="iplr", num_layers=3)) == ["iplr"] * 3
    assert layer_types(EmbeddedModelConfig(arch="kda")) == ["kda", "kda", attention]
    assert layer_types(EmbeddedModelConfig(arch="kda", num_layers=6)) == ["kda"] * 3 + [attention, "kda", attention]
    config = EmbeddedModelConfig(arch="hybrid", warmstart_steps=0)
    first = embedded_policy_dir(str(tmp_path), config, TaskConfig(), 0)
    assert embedded_policy_dir(str(tmp_path), config, TaskConfig(), 0) == first
    monkeypatch.setitem(DEFAULT_LAYERS, "hybrid", 4)
    second = embedded_policy_dir(str(tmp_path), config, TaskConfig(), 0)
    assert second != first
    assert [json.loads((d / "config.json").read_text())["mixer_types"] for d in (first, second)] == [
        [rule, rule, attention], [rule] * 3 + [attention]]


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
