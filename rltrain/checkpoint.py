"""Checkpoints: written to a temporary directory of this run's own (rltrain/output_dir.py) and renamed into place,
so a kill at any moment leaves the previous checkpoint intact; loading never unpickles arbitrary objects
(torch.distributed.checkpoint's tensors, its metadata through a restricted unpickler, and JSON;
rltrain/distributed_checkpoint.py).

    <output_dir>/checkpoints/step_000010/
        model/            the trained weights (fp32 under actor.mixed_precision; with actor.lora the adapters alone),
                          by state_dict name, in torch.distributed.checkpoint's format: .metadata + one
                          __<rank>_0.distcp per actor rank, each rank writing the shards it holds
        optimizer/        the AdamW state by parameter name (<name>.exp_avg, <name>.exp_avg_sq, <name>.step), alike
        hf/               the model's config.json, generation_config.json and tokenizer (with actor.lora also
                          adapter_config.json naming the base model); with trainer.save_hf also its weights, making it
                          an HF model directory (safetensors, sharded with an index above save_pretrained's
                          max_shard_size) or, with actor.lora, a PEFT adapter directory
        critic/           algorithm.adv_estimator=gae: the critic's model/ and optimizer/ (its value head included)
        trainer_state.json  step, data position, RNG states, the actor's LR schedule position, β; written last

Both actor strategies write this layout with the same code (rltrain/workers/actor.py): the single process writes
whole tensors, FSDP2's ranks their shards. A resume may use another strategy or world size: each rank reads the parts
of the saved tensors its own shards cover. Why no HF weights by default (trainer.save_hf=false), as verl and
torchtitan: writing them gathers every full tensor onto rank 0, the very cost sharded saves remove, at every save;
`python -m rltrain.export CHECKPOINT OUT` (rltrain/export.py) writes an HF model directory from model/ when one is
wanted. Every rank must see the checkpoint directory: across nodes, trainer.output_dir on a shared filesystem (checked
before each save and load, naming the ranks that cannot).

A checkpoint is complete (`incomplete_reason` is None) when model/ and optimizer/ have their metadata and every data
file it names, the hf/ weights an index names (trainer.save_hf) are there, and trainer_state.json is readable: the
state file is the last thing a save writes before the rename. trainer.resume=auto takes the newest complete one
(`newest_complete_checkpoint`), passing over directories a crash, an older version's concurrent runs or an older
layout (hf/ + optimizer.pt, whose hf/ stays usable as model.path) left.

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

from rltrain.distributed_checkpoint import saved_shapes, unreadable_reason
from rltrain.output_dir import temporary_dir, temporary_name
from rltrain.workers.lora import LoraConfig, is_adapter_weight, peft_config

STEP_DIR = re.compile(r"^step_(\d{6,})$")
MODEL_DIR, OPTIMIZER_DIR, HF_DIR, STATE_FILE = "model", "optimizer", "hf", "trainer_state.json"
CRITIC_DIR = "critic"
MODEL_FILE, ADAPTER_FILE = "model.safetensors", "adapter_model.safetensors"
INDEX_FILE = "model.safetensors.index.json"   # transformers shards a save above max_shard_size
CONFIG_FILES = ("config.json", "generation_config.json")   # copied from model.path into every checkpoint's hf/
FORMER_OPTIMIZER_FILE = "optimizer.pt"   # the layout before sharded checkpoints: hf/ weights + this


def checkpoint_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def holds_adapters(path: Path) -> bool:
    """Whether a checkpoint holds LoRA adapters (actor.lora) rather than a full model: its model/ tensors are
    adapters."""
    return any(is_adapter_weight(name) for name in saved_shapes(Path(path) / MODEL_DIR))


def hf_weight_files(hf: Path) -> list[str]:
    """The weight files of a checkpoint's hf/ directory, relative to it: the adapters, model.safetensors, the shards
    its index names (above save_pretrained's max_shard_size), or none (trainer.save_hf off). Raises ValueError for an
    unreadable index."""
    if (hf / ADAPTER_FILE).is_file():
        return [ADAPTER_FILE]
    if not (hf / INDEX_FILE).is_file():
        return [MODEL_FILE] if (hf / MODEL_FILE).is_file() else []
    try:
        index = json.loads((hf / INDEX_FILE).read_text())
        return sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"hf/{INDEX_FILE} is unreadable ({err!r})") from None


def incomplete_reason(path: Path) -> str | None:
    """Why the checkpoint directory `path` cannot be resumed from ('model/.metadata is missing', ...), or None when it
    is complete."""
    path = Path(path)
    if not (path / MODEL_DIR).exists() and (path / FORMER_OPTIMIZER_FILE).is_file():
        return (f"it has the layout before sharded checkpoints (hf/ + {FORMER_OPTIMIZER_FILE}), which a resume does "
                f"not read; its hf/ is an HF model: start a run from it with model.path={path / HF_DIR}")
    parts = [MODEL_DIR, OPTIMIZER_DIR]
    if (path / CRITIC_DIR).exists():
        parts += [f"{CRITIC_DIR}/{MODEL_DIR}", f"{CRITIC_DIR}/{OPTIMIZER_DIR}"]
    for part in parts:
        reason = unreadable_reason(path / part)
        if reason is not None:
            return f"{part}/{reason}"
    try:
        weights = [f"{HF_DIR}/{name}" for name in hf_weight_files(path / HF_DIR)]
    except ValueError as err:
        return str(err)
    for needed in (*weights, STATE_FILE):
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


def write_hf_files(hf: Path, model_dir: str, tokenizer, lora: LoraConfig | None = None) -> None:
    """What a checkpoint's hf/ holds besides weights: model.path's config.json and generation_config.json as they
    are, the tokenizer, and with LoRA its adapter_config.json naming model.path as the base."""
    for name in CONFIG_FILES:
        if (Path(model_dir) / name).is_file():
            shutil.copyfile(Path(model_dir) / name, hf / name)
    tokenizer.save_pretrained(hf)
    if lora is not None and lora.enabled:
        peft_config(lora, str(model_dir)).save_pretrained(str(hf))


def save_checkpoint(output_dir: str, step: int, save_state, model_dir: str, tokenizer, trainer_state: dict,
                    lora: LoraConfig | None = None) -> Path:
    """save_state(path) has the actor write model/ and optimizer/ (every rank its own part), and with trainer.save_hf
    the weights into hf/, of the checkpoint directory `path`. Everything goes to this process's temporary directory,
    trainer_state.json last and synced, then one rename publishes it; a save that raises removes its temporary."""
    root = checkpoint_root(output_dir)
    final = root / f"step_{step:06d}"
    tmp = temporary_dir(root, final.name)
    try:
        (tmp / HF_DIR).mkdir()
        write_hf_files(tmp / HF_DIR, model_dir, tokenizer, lora)
        save_state(tmp)   # after the files above: an HF save's own config.json (its weights' dtype) wins
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


def load_trainer_state(path: Path) -> dict:
    """The trainer state of a complete checkpoint directory (FileNotFoundError naming it and what is wrong
    otherwise); the actor reads model/ and optimizer/ itself (ActorWorker.load_checkpoint)."""
    path = Path(path)
    reason = incomplete_reason(path)
    if reason is not None:
        raise FileNotFoundError(f"checkpoint {path} is incomplete: {reason}")
    return json.loads((path / STATE_FILE).read_text())
