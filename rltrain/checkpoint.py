"""Checkpoints: written to a temporary directory of this run's own (rltrain/output_dir.py) and renamed into place,
so a kill at any moment leaves the previous checkpoint intact; loading never unpickles arbitrary objects
(safetensors, torch.load(weights_only=True) and JSON only).

    <output_dir>/checkpoints/step_000010/
        hf/               the policy in HF format (model.safetensors, or shards + model.safetensors.index.json above
                          save_pretrained's max_shard_size; config; tokenizer): transformers and vLLM load it;
                          with actor.lora, its adapters in PEFT's format instead (adapter_model.safetensors +
                          adapter_config.json naming the base model's directory, + tokenizer): PeftModel.from_pretrained
                          loads them, `python -m rltrain.export_lora` merges them into a full HF model
        optimizer.pt      optimizer state (tensors and numbers only)
        trainer_state.json  step, data position, RNG states, the actor's LR schedule position; written last

A checkpoint is complete (`incomplete_reason` is None) when its weights, optimizer.pt and a readable
trainer_state.json are all there: the state file is the last thing a save writes before the rename. trainer.resume=auto
takes the newest complete one (`newest_complete_checkpoint`), passing over directories a crash or an older
version's concurrent runs left incomplete.

RNG states are the controller's: Python's `random`, numpy's global generator, torch's CPU generator and, where this
process has initialised CUDA, every visible GPU's generator, all as JSON lists of integers. The workers' generators
are not saved: each sampling call seeds its own from (trainer.seed, step, round), which is what makes a resumed run
replay an uninterrupted one; the actor seeds its update's draws (the mini-batch order; LoRA dropout) from (trainer.seed,
step, pass) alike.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from rltrain.output_dir import temporary_dir, temporary_name

STEP_DIR = re.compile(r"^step_(\d{6,})$")
MODEL_FILE, ADAPTER_FILE, STATE_FILE = "model.safetensors", "adapter_model.safetensors", "trainer_state.json"
INDEX_FILE = "model.safetensors.index.json"   # transformers shards a save above max_shard_size (50 GB by default)


def checkpoint_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def holds_adapters(path: Path) -> bool:
    """Whether a checkpoint directory holds LoRA adapters (actor.lora) rather than a full model."""
    return (Path(path) / "hf" / ADAPTER_FILE).is_file()


def weight_files(hf: Path) -> list[str]:
    """The weight files of a checkpoint's hf/ directory, relative to it: the adapters, model.safetensors, or the
    shards its index names (a policy over save_pretrained's max_shard_size, e.g. 14B parameters as fp32 masters).
    Raises ValueError for an unreadable index."""
    if (hf / ADAPTER_FILE).is_file():
        return [ADAPTER_FILE]
    if not (hf / INDEX_FILE).is_file():
        return [MODEL_FILE]
    try:
        index = json.loads((hf / INDEX_FILE).read_text())
        return sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"hf/{INDEX_FILE} is unreadable ({err!r})") from None


def incomplete_reason(path: Path) -> str | None:
    """Why the checkpoint directory `path` cannot be resumed from ('hf/model.safetensors is missing', ...), or None
    when it is complete."""
    path = Path(path)
    try:
        weights = [f"hf/{name}" for name in weight_files(path / "hf")]
    except ValueError as err:
        return str(err)
    for needed in (*weights, "optimizer.pt", STATE_FILE):
        file = path / needed
        if not file.is_file() or file.stat().st_size == 0:
            return f"{needed} is {'empty' if file.is_file() else 'missing'}"
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        return f"{STATE_FILE} is unreadable ({err})"
    return None if isinstance(state, dict) and "step" in state else f"{STATE_FILE} records no step"


def newest_complete_checkpoint(output_dir: str) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest complete checkpoint or None, [(incomplete checkpoint newer than it, why)] newest first).
    Temporary directories of unfinished saves are not checkpoints and are not listed."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None, []
    steps = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()),
                   reverse=True)
    skipped = []
    for _, path in steps:
        reason = incomplete_reason(path)
        if reason is None:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def latest_checkpoint(output_dir: str) -> Path | None:
    """The newest complete checkpoint, or None."""
    return newest_complete_checkpoint(output_dir)[0]


def rng_state() -> dict:
    """This process's RNG states, JSON-safe. CUDA's only where this process has initialised CUDA already: reading it
    would otherwise create a CUDA context (hundreds of MB on the GPU the colocated roles share) in the controller,
    whose CUDA generators are then untouched and replay from their default seed anyway."""
    version, python_state, _ = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": list(python_state), "python_version": version, "torch": torch.get_rng_state().tolist(),
             "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached_gaussian)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    """Restore rng_state()'s output (checkpoints from before numpy/CUDA states were saved restore what they have).
    CUDA states go to the first min(saved, visible) GPUs, lazily: torch applies them when CUDA initialises."""
    random.setstate((state["python_version"], tuple(state["python"]), None))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "numpy" in state:
        saved = state["numpy"]
        np.random.set_state((saved["kind"], np.array(saved["keys"], dtype=np.uint32), saved["pos"],
                             saved["has_gauss"], saved["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        for device, saved in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.tensor(saved, dtype=torch.uint8), device)


def save_checkpoint(output_dir: str, step: int, save_policy, optimizer_state: dict, tokenizer,
                    trainer_state: dict) -> Path:
    """save_policy(path) writes the HF-format policy (called on the actor, which holds the weights). Everything
    goes to this process's temporary directory, trainer_state.json last and synced, then one rename publishes it; a
    save that raises removes its temporary."""
    root = checkpoint_root(output_dir)
    final = root / f"step_{step:06d}"
    tmp = temporary_dir(root, final.name)
    try:
        (tmp / "hf").mkdir()
        save_policy(str(tmp / "hf"))
        tokenizer.save_pretrained(tmp / "hf")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        with open(tmp / STATE_FILE, "w") as f:
            f.write(json.dumps(dict(trainer_state, step=step, rng=rng_state())))
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes the checkpoint count as complete
        if final.exists():  # a re-run of the same step (or an incomplete leftover) is replaced
            replaced = temporary_name(root, f"replaced_{final.name}")
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
            tmp.rename(final)
            shutil.rmtree(replaced)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """(policy state_dict, or the LoRA adapters in PEFT's format where the checkpoint holds them (holds_adapters);
    optimizer state; trainer state) of a checkpoint directory."""
    path = Path(path)
    reason = incomplete_reason(path)
    if reason is not None:
        raise FileNotFoundError(f"checkpoint {path} is incomplete: {reason}")
    model_state = {}
    for name in weight_files(path / "hf"):
        model_state.update(load_file(path / "hf" / name))
    optimizer_state = torch.load(path / "optimizer.pt", weights_only=True)
    trainer_state = json.loads((path / STATE_FILE).read_text())
    return model_state, optimizer_state, trainer_state
