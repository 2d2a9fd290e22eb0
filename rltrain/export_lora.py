"""Export a LoRA run's checkpoint (actor.lora) as a full HF model: the adapters merged into the base weights.

    python -m rltrain.export_lora outputs/grpo/checkpoints/step_000300 merged/      # the base its adapters name
    python -m rltrain.export_lora outputs/grpo/checkpoints/step_000300 merged/ --base /models/Qwen3-0.6B

CHECKPOINT is a checkpoint directory of a run with actor.lora.rank > 0 (its hf/ holds the adapters in PEFT's format:
adapter_config.json, adapter_model.safetensors, and the tokenizer), or any PEFT LoRA adapter directory. The base model
is the directory adapter_config.json names (base_model_name_or_path: the run's model.path, or its embedded default's
warm-start directory), or --base. OUT receives the merged model (safetensors, in the base's dtype) and the tokenizer,
loadable with AutoModelForCausalLM / vLLM like any HF model. A bad path exits with status 2 and says which.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import peft
import rltrain_kernels.models  # noqa: F401  (registers the delta-rule families with the Auto classes)
import transformers as tf

from rltrain.workers.policy import load_tokenizer

ADAPTER_CONFIG = "adapter_config.json"


def adapter_dir(checkpoint: str | Path) -> Path:
    """The directory holding the adapters: CHECKPOINT/hf for a checkpoint directory, else CHECKPOINT itself."""
    path = Path(checkpoint)
    for candidate in (path / "hf", path):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    if (path / "hf" / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path} holds a full model (a run without actor.lora), not LoRA adapters: its hf/ "
                                "loads as it is")
    raise FileNotFoundError(f"{path}: no {ADAPTER_CONFIG} there or in {path / 'hf'}; expected a checkpoint of a run "
                            "with actor.lora.rank > 0")


def base_model_dir(adapters: Path, base: str | None) -> str:
    """--base, or the base model directory adapter_config.json names; it must be a transformers model directory."""
    if base is None:
        base = json.loads((adapters / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        if not base:
            raise FileNotFoundError(f"{adapters / ADAPTER_CONFIG} names no base model; pass --base")
    if not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"base model {base!r} is not a transformers model directory (no config.json); pass "
                                "--base with the model the adapters were trained on")
    return str(base)


def export_lora(checkpoint: str | Path, out: str | Path, base: str | None = None) -> Path:
    """Merge the adapters of `checkpoint` into their base model and save it under `out`; returns `out`."""
    adapters = adapter_dir(checkpoint)
    base = base_model_dir(adapters, base)
    tf.utils.logging.disable_progress_bar()
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = peft.PeftModel.from_pretrained(model, str(adapters)).merge_and_unload()
    out = Path(out)
    merged.save_pretrained(out)
    has_tokenizer = any((adapters / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    load_tokenizer(str(adapters) if has_tokenizer else base).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltrain.export_lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory of a run with actor.lora (or its hf/)")
    parser.add_argument("out", help="directory for the merged HF model")
    parser.add_argument("--base", default=None, help="the base model directory (default: the one the adapters name)")
    args = parser.parse_args(argv)
    try:
        out = export_lora(args.checkpoint, args.out, args.base)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"merged model written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
