"""Checkpoints: written to a temporary directory and renamed into place, so a kill at any moment leaves the
previous checkpoint intact; loading never unpickles arbitrary objects (safetensors, torch.load(weights_only=True)
and JSON only).

    <output_dir>/checkpoints/step_000010/
        hf/               the policy in HF format (model.safetensors + config + tokenizer): transformers and vLLM load it
        optimizer.pt      optimizer state (tensors and numbers only)
        trainer_state.json  step, data position, RNG states
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import torch

STEP_DIR = re.compile(r"^step_(\d{6,})$")


def checkpoint_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def latest_checkpoint(output_dir: str) -> Path | None:
    """The newest complete checkpoint (temporary directories of interrupted saves are ignored)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()
             and (p / "trainer_state.json").is_file()]
    return max(steps)[1] if steps else None


def rng_state() -> dict:
    return {"torch": torch.get_rng_state().tolist(), "python": random.getstate()[1][:625],
            "python_version": random.getstate()[0]}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    random.setstate((state["python_version"], tuple(state["python"]), None))


def save_checkpoint(output_dir: str, step: int, save_policy, optimizer_state: dict, tokenizer,
                    trainer_state: dict) -> Path:
    """save_policy(path) writes the HF-format policy (called on the actor, which holds the weights)."""
    root = checkpoint_root(output_dir)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "hf").mkdir(parents=True)
    save_policy(str(tmp / "hf"))
    tokenizer.save_pretrained(tmp / "hf")
    torch.save(optimizer_state, tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(dict(trainer_state, step=step, rng=rng_state())))
    if final.exists():  # a re-run of the same step replaces it
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def load_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """(policy state_dict, optimizer state, trainer state) of a checkpoint directory."""
    from safetensors.torch import load_file

    path = Path(path)
    for needed in ("hf/model.safetensors", "optimizer.pt", "trainer_state.json"):
        if not (path / needed).is_file():
            raise FileNotFoundError(f"checkpoint {path} is incomplete: {needed} is missing")
    model_state = load_file(path / "hf" / "model.safetensors")
    optimizer_state = torch.load(path / "optimizer.pt", weights_only=True)
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    return model_state, optimizer_state, trainer_state
