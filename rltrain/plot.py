"""Plot a run's curves: `python -m rltrain.plot <output_dir> [--out curves.png]` reads <output_dir>/metrics.jsonl
and writes a PNG (default <output_dir>/curves.png) with reward (train and held-out), entropy, PPO-KL / clip
fraction, response length and step time. Needs matplotlib (`pip install rltrain[plot]`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = [
    ("reward", ["train/reward_mean", "val/reward_mean"]),
    ("entropy", ["actor/entropy"]),
    ("policy drift", ["actor/ppo_kl", "actor/clipfrac", "actor/ref_kl"]),
    ("response length", ["train/response_len_mean"]),
    ("seconds per step", ["time/step_s"]),
    ("gradient norm", ["actor/grad_norm"]),
]


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file (is {output_dir} a run's trainer.output_dir?)")
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {lineno}: invalid JSON: {exc.msg}") from None
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`; a step logged twice (a resumed run redoes steps) keeps its last value."""
    by_step = {r["step"]: r[key] for r in records if key in r}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot(output_dir: str, out: str | None = None) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("rltrain.plot needs matplotlib: pip install 'rltrain[plot]'") from None
    records = read_metrics(Path(output_dir))
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            steps, values = series(records, key)
            if steps:
                ax.plot(steps, values, marker="o" if key.startswith("val/") else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    target = Path(out) if out else Path(output_dir) / "curves.png"
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("output_dir")
    parser.add_argument("--out", default=None, help="PNG path (default: <output_dir>/curves.png)")
    args = parser.parse_args(argv)
    try:
        print(plot(args.output_dir, args.out))
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"rltrain.plot: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
