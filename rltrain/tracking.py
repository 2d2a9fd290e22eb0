"""Metric sinks: console (a progress line per step), jsonl (<output_dir>/metrics.jsonl), tensorboard, wandb.

Every record is a flat dict with a `step`; train records and validation records (keys starting with `val/`) go to
the same sinks. The console's train line ends with where the step's time went (the time/*_s keys the trainer logs):

    [train    3/300] |....................| reward 0.062 ... | 0.7 s/step, ETA 208 s | rollout 0.31s | reward 0.02s |
    old_lp 0.05s | ref 0.00s | update 0.19s | sync 0.04s
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# (label on the console, the record's key): the phases of a train step, in order
PHASES = (("wait", "time/rollout_wait_s"),  # asynchronous modes: the step waiting for the producer's batch
          ("rollout", "time/rollout_s"), ("reward", "time/reward_s"), ("old_lp", "time/old_logprob_s"),
          ("ref", "time/ref_s"), ("update", "time/update_s"), ("sync", "time/weight_sync_s"))


class Tracker:
    def __init__(self, backends: list[str], output_dir: str, total_steps: int, project: str = "rltrain",
                 run_name: str = "rltrain", config: dict | None = None):
        unknown = [b for b in backends if b not in LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger {unknown[0]!r}; known: {', '.join(LOGGERS)}")
        self.backends, self.total_steps = backends, total_steps
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._start, self._first_step = time.monotonic(), None
        self._tb = self._wandb = None
        if "tensorboard" in backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError(f"trainer.logger lists tensorboard, but it is not installed ({exc}); "
                                  "pip install tensorboard") from None
            self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))
        if "wandb" in backends:
            try:
                import wandb
            except ImportError:
                raise ImportError("trainer.logger lists wandb, but it is not installed; pip install wandb") from None
            self._wandb = wandb.init(project=project, name=run_name, config=config, dir=output_dir)

    def log(self, record: dict) -> None:
        step = record["step"]
        if "jsonl" in self.backends:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if "console" in self.backends:
            self._console(record)

    def _console(self, record: dict) -> None:
        step = record["step"]
        if any(k.startswith("val/") for k in record):
            n = record.get("val/n", 1)
            passed = f" pass@{n} {record[f'val/pass@{n}']:.3f}" if n > 1 and f"val/pass@{n}" in record else ""
            samples = f" × {n}" if n > 1 else ""
            calls = record.get("val/tool/calls_per_episode")
            calls = "" if calls is None else f" calls {calls:.2f}"
            print(f"[val  step {step:>4}] reward {record.get('val/reward_mean', float('nan')):.3f}{passed}{calls} "
                  f"({record.get('val/count', 0)} prompts{samples})", flush=True)
            return
        if self._first_step is None:
            self._first_step, self._start = step - 1, time.monotonic() - record.get("time/step_s", 0.0)
        done = step - self._first_step
        per_step = (time.monotonic() - self._start) / max(done, 1)
        eta = per_step * (self.total_steps - step)
        filled = int(20 * step / max(self.total_steps, 1))
        bar = "#" * filled + "." * (20 - filled)
        print(f"[train {step:>4}/{self.total_steps}] |{bar}| reward {record.get('train/reward_mean', 0):.3f} "
              f"kl {record.get('actor/ppo_kl', 0):+.4f} entropy {record.get('actor/entropy', 0):.3f} "
              f"len {record.get('train/response_len_mean', 0):.1f}{tool_calls(record)}{reward_errors(record)} | "
              f"{per_step:.1f} s/step, ETA {eta:.0f} s"
              f"{time_split(record)}", file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def tool_calls(record: dict) -> str:
    """' calls 0.43' (tool calls per episode) in multi-turn runs, else ''."""
    calls = record.get("tool/calls_per_episode")
    return "" if calls is None else f" calls {calls:.2f}"


def reward_errors(record: dict) -> str:
    """' reward errors 5 (2 timed out, 1 worker died)' when the step's reward function failed on samples, else ''."""
    errors = record.get("reward/errors", 0)
    if not errors:
        return ""
    kinds = [f"{record[key]:.0f} {label}" for key, label in (("reward/timeouts", "timed out"),
             ("reward/memory_errors", "out of memory"), ("reward/worker_deaths", "worker died")) if record.get(key)]
    return f" reward errors {errors:.0f}" + (f" ({', '.join(kinds)})" if kinds else "")


def time_split(record: dict) -> str:
    """' | rollout 12.1s | old_lp 1.2s | ...' for the phases the record times, and the actor's MFU where logged."""
    parts = [f"{label} {record[key]:.2f}s" for label, key in PHASES if key in record]
    if "perf/actor_mfu" in record:
        parts.append(f"mfu {100 * record['perf/actor_mfu']:.1f}%")
    return "".join(f" | {part}" for part in parts)
