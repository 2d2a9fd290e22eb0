"""rltrain.plot: a PNG from metrics.jsonl (resumed steps keep their last value); clear errors for bad input."""

import json

from rltrain.plot import main, series


def test_plot_writes_png_and_dedups_resumed_steps(tmp_path):
    records = [{"step": 0, "val/reward_mean": 0.2}, {"step": 1, "train/reward_mean": 0.1, "actor/entropy": 1.0},
               {"step": 2, "train/reward_mean": 0.3}, {"step": 2, "train/reward_mean": 0.4},
               {"step": 2, "val/reward_mean": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert series(records, "train/reward_mean") == ([1, 2], [0.1, 0.4])
    assert main([str(tmp_path)]) == 0
    png = (tmp_path / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_plot_errors_name_the_problem(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl: no metrics file" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{oops\n')
    assert main([str(tmp_path)]) == 2
    assert "line 2: invalid JSON" in capsys.readouterr().err
