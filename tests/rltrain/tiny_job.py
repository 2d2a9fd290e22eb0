"""Tiny settings for trainer tests: a 1-layer embedded model, a few warm-start steps, small batches."""

from __future__ import annotations

import copy

from rltrain.job import JobConfig, load_job_config

TINY = {
    "trainer": {"total_steps": 2, "val_every": 0, "logger": ["jsonl"]},
    "model": {"embedded": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "head_dim": 16,
                           "warmstart_steps": 3, "warmstart_batch_size": 16}},
    "data": {"batch_size": 4, "task": {"max_operand": 9, "num_val": 8}},
    "rollout": {"n": 4, "max_new_tokens": 4, "torch_threads": 1},
    "actor": {"micro_batch_size": 8, "torch_threads": 1},
    "reward": {"num_workers": 1, "timeout_s": 2.0},
}


def merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def tiny_job(output_dir, **sections) -> JobConfig:
    config = merge(TINY, sections)
    config["trainer"]["output_dir"] = str(output_dir)
    return load_job_config(config)
