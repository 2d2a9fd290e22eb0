"""Metric sinks: console (a progress line per step), jsonl (<output_dir>/metrics.jsonl), tensorboard, wandb.

Every record is a flat dict with a `step`; train records and validation records (keys starting with `val/`) go to
the same sinks. A run that resumes from the checkpoint of step S first calls `rewind(S)`: the records a
killed run logged after S leave metrics.jsonl and TensorBoard hides its events after S (the resumed run logs those
steps again); a run that starts over calls `rewind(None)`. wandb: every launch is a run of its own, so a resumed one's
steps start after S. The console's train line ends with where the step's time went (the time/*_s keys the trainer logs):

    [train    3/300] |....................| reward 0.062 ... | 0.7 s/step, ETA 208 s | rollout 0.31s | reward 0.02s |
    old_lp 0.05s | ref 0.00s | update 0.19s | sync 0.04s
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# (label on the console, the record's key): the phases of a train step, in order
PHASES = (("wait", "time/rollout_wait_s"),  # asynchronous modes: the step waiting for the producer's batch
          ("rollout", "time/rollout_s"), ("reward", "time/reward_s"), ("old_lp", "time/old_logprob_s"),
          ("ref", "time/ref_s"), ("values", "time/values_s"), ("critic", "time/critic_s"),
          ("update", "time/update_s"), ("sync", "time/weight_sync_s"))


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
        self._tb_dir, self._purge_step = str(Path(output_dir) / "tensorboard"), None
        if "tensorboard" in backends:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            except ImportError as exc:
                raise ImportError(f"trainer.logger lists tensorboard, but it is not installed ({exc}); "
                                  "pip install tensorboard") from None
            # the writer opens at the first log(), after rewind() has said where the run starts
        if "wandb" in backends:
            try:
                import wandb
            except ImportError:
                raise ImportError("trainer.logger lists wandb, but it is not installed; pip install wandb") from None
            self._wandb = wandb.init(project=project, name=run_name, config=config, dir=output_dir)

    def rewind(self, last_step: int | None) -> None:
        """Before the first record of a run that continues after step `last_step` (None: one that starts over):
        metrics.jsonl keeps the records of steps <= last_step only (none for None), and TensorBoard hides the
        events of later steps (purge_step), so no step is logged twice."""
        self._purge_step = 0 if last_step is None else last_step + 1
        if not self.path.is_file():
            return
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):  # a line a kill cut short
                step = None
            if last_step is not None and isinstance(step, int) and step <= last_step:
                kept.append(line + "\n")
            else:
                dropped += 1
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)  # a kill now leaves the old file or the new, never half of it
        if last_step is not None and dropped:
            logger.info("%s: kept the %d records up to step %d, dropped %d logged after it (they are logged again)",
                        self.path, len(kept), last_step, dropped)

    def log(self, record: dict) -> None:
        step = record["step"]
        if "jsonl" in self.backends:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if "tensorboard" in self.backends and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter  # optional: the tensorboard package

            self._tb = SummaryWriter(self._tb_dir, purge_step=self._purge_step)
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
              f"len {record.get('train/response_len_mean', 0):.1f}{critic_fit(record)}{tool_calls(record)}"
              f"{reward_errors(record)} | "
              f"{per_step:.1f} s/step, ETA {eta:.0f} s"
              f"{time_split(record)}", file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def critic_fit(record: dict) -> str:
    """' vf_ev 0.42' (the critic's explained variance) in PPO runs, else ''."""
    explained = record.get("critic/vf_explained_var")
    return "" if explained is None else f" vf_ev {explained:.2f}"


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
