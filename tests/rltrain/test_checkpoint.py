"""Checkpoints without Ray: a save that dies half-way leaves the previous checkpoint the newest complete one, and the
controller's RNG states (Python, numpy, torch CPU; CUDA where initialised) survive a JSON round trip exactly. The
kill of a real run and its resume are in tests/rltrain/test_trainer_e2e.py."""

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from rltrain.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state


class _Tokenizer:
    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")


def _save(output_dir, step, weight: float, fail=False):
    def save_policy(path):
        save_file({"w": torch.full((2, 3), weight)}, f"{path}/model.safetensors")
        if fail:
            raise KeyboardInterrupt("killed mid-save")

    return save_checkpoint(str(output_dir), step, save_policy, {"state": {0: {"step": torch.tensor(step)}}},
                           _Tokenizer(), {"sampler": {"epoch": 0, "index": 4 * step}})


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    _save(tmp_path, 1, 1.0)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, 2.0, fail=True)
    assert (tmp_path / "checkpoints" / ".tmp_step_000002").is_dir()
    assert latest_checkpoint(str(tmp_path)).name == "step_000001"
    model, optimizer, state = load_checkpoint(latest_checkpoint(str(tmp_path)))
    assert torch.equal(model["w"], torch.full((2, 3), 1.0))
    assert optimizer["state"][0]["step"].item() == 1 and state["step"] == 1 and state["sampler"]["index"] == 4

    _save(tmp_path, 2, 2.0)  # the next save of that step replaces the leftover
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert latest_checkpoint(str(tmp_path)).name == "step_000002"


def _draws():
    return (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist(),
            torch.rand(2, device="cuda").tolist() if torch.cuda.is_available() else None)


def test_rng_states_round_trip_through_json():
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    np.random.standard_normal()  # leaves numpy's cached second Gaussian pending: part of the state
    if torch.cuda.is_available():
        torch.cuda.init()
    saved = json.loads(json.dumps(rng_state()))
    assert saved["numpy"]["has_gauss"] == 1
    assert ("cuda" in saved) == torch.cuda.is_available()
    expected = _draws()
    assert _draws() != expected
    set_rng_state(saved)
    assert _draws() == expected


def test_states_saved_before_numpy_and_cuda_still_restore():
    saved = json.loads(json.dumps(rng_state()))
    old = {key: saved[key] for key in ("python", "python_version", "torch")}
    expected = (random.random(), torch.rand(2).tolist())
    set_rng_state(old)
    assert (random.random(), torch.rand(2).tolist()) == expected
