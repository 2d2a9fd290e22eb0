"""Entry point: `python -m rltrain.main_grpo [key=value ...]` (Hydra). With no arguments it trains the embedded
default (a small Qwen3 on a synthetic arithmetic task, CPU, no downloads).

    python -m rltrain.main_grpo --cfg job                      # print the resolved config
    python -m rltrain.main_grpo algorithm=dapo rollout.n=16    # an algorithm preset, overrides on top
    python -m rltrain.main_grpo model.path=/ckpt/Qwen3-0.6B data.train_files=train.parquet reward.path=my.py

The config (config/grpo.yaml, every key commented) is validated before any work starts; a bad key or value exits
with status 2 and a message naming it, as does a trainer.output_dir another live run holds (rltrain/output_dir.py).

Exit status: 0 done; 2 bad input (a config key or value, a data row, a model path, a checkpoint to resume from that
is incomplete or does not fit the model: the message names it), before any training; 3 stopped because the reward function failed on more than reward.max_error_rate of the samples (the
message says which function and how); 1 anything else (with its traceback).
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from rltrain.config import ConfigError
from rltrain.data.rows import DataError
from rltrain.distributed_checkpoint import CheckpointError
from rltrain.job import load_job_config
from rltrain.rewards.health import RewardsFailing
from rltrain.trainer import GRPOTrainer


def run(job) -> dict:
    trainer = GRPOTrainer(job)
    try:
        result = trainer.fit()
    except BaseException:
        trainer.close(raise_errors=False)  # the run's own error is the one to report; close's are logged
        raise
    trainer.close()
    return result


@hydra.main(config_path="../config", config_name="grpo", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        job = load_job_config(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    logging.getLogger("rltrain").setLevel(logging.INFO)
    try:
        run(job)
    except (ConfigError, FileNotFoundError, DataError, CheckpointError) as err:  # bad input: say what, no trace
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except RewardsFailing as err:  # no checkpoint of the failing steps is saved
        print(f"error: {err}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
