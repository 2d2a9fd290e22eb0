"""Export a checkpoint as an HF model directory, which AutoModelForCausalLM.from_pretrained and vLLM load.

    python -m rltrain.export outputs/grpo/checkpoints/step_000300 exported/
    python -m rltrain.export outputs/grpo/checkpoints/step_000300 exported/ --max-shard-size 2GB --dtype float32
    python -m rltrain.export outputs/grpo/checkpoints/step_000300 merged/ --base /models/Qwen3-0.6B   # a LoRA run's

CHECKPOINT is a checkpoint directory (rltrain/checkpoint.py), whatever strategy and world size wrote it: its model/
is read whole into this process's memory (the model once, at the trained fp32). OUT receives the weights as
safetensors, `model.safetensors` or, above --max-shard-size (default 5GB, the Hub's), shards
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`; config.json with its dtype set to the
weights'; and the checkpoint's generation_config.json and tokenizer (hf/). The checkpoint of a LoRA run
(actor.lora) holds adapters: they are merged into their base model (the one hf/adapter_config.json names, the run's
model.path; or --base), loaded in fp32, and the merged model is written alike.

--dtype: auto (config.json's, the dtype the model was released in: bfloat16 for most) | float32 (the trained weights
exactly) | bfloat16 | float16. A path that is not a readable checkpoint, or an OUT that already holds weights, exits
with status 2 and says which.

--format: auto | checkpoint | qwen3_next. A checkpoint of rltrain_kernels' hybrid_delta family whose layers are
Gated DeltaNet and attention is written as a Qwen3-Next model (model_type qwen3_next: transformers'
Qwen3NextForCausalLM and vLLM load it without rltrain_kernels, with the same logits; the mapping:
rltrain_kernels/models/hybrid_delta/qwen3_next.py); `auto` does that where it can and writes every other checkpoint
in its own model type; `checkpoint` always keeps the own type; `qwen3_next` exits 2 naming the config key where the
model has no Qwen3-Next form (Gated DeltaProduct or IPLR layers, allow_neg_eigval).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import rltrain_kernels.models  # noqa: F401  (registers the delta-rule families with the Auto classes)
import torch
import transformers as tf
from huggingface_hub import save_torch_state_dict
from rltrain_kernels.models.hybrid_delta import HybridDeltaConfig
from rltrain_kernels.models.hybrid_delta.qwen3_next import qwen3_next_config, qwen3_next_refusal, qwen3_next_state_dict

from rltrain.checkpoint import HF_DIR, INDEX_FILE, MODEL_DIR, holds_adapters
from rltrain.distributed_checkpoint import CheckpointError, read_state, unreadable_reason
from rltrain.workers.hf_config import from_pretrained
from rltrain.workers.lora import load_adapters, peft_checkpoint_name
from rltrain.workers.policy import DTYPES, untied_state_dict

ADAPTER_CONFIG, CONFIG = "adapter_config.json", "config.json"
DEFAULT_SHARD_SIZE = "5GB"
FORMATS = ("auto", "checkpoint", "qwen3_next")


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model/ whole (CheckpointError naming the path when it cannot be read)."""
    if not (checkpoint / HF_DIR / CONFIG).is_file():
        raise CheckpointError(f"{checkpoint}: no {HF_DIR}/{CONFIG}; expected a checkpoint directory "
                              "(<output_dir>/checkpoints/step_N) of rltrain")
    reason = unreadable_reason(checkpoint / MODEL_DIR)
    if reason is not None:
        raise CheckpointError(f"{checkpoint}: {MODEL_DIR}/{reason}")
    return read_state(checkpoint / MODEL_DIR)


def base_model_dir(hf: Path, base: str | None) -> str:
    """--base, or the base model directory hf/adapter_config.json names; it must be a transformers model directory."""
    if base is None:
        base = json.loads((hf / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        if not base:
            raise CheckpointError(f"{hf / ADAPTER_CONFIG} names no base model; pass --base")
    if not (Path(base) / CONFIG).is_file():
        raise CheckpointError(f"base model {base!r} is not a transformers model directory (no {CONFIG}); pass "
                              "--base with the model the adapters were trained on")
    return str(base)


def merge_adapters(adapters: dict[str, torch.Tensor], hf: Path, base: str | None) -> dict[str, torch.Tensor]:
    """The base model's weights with the LoRA adapters (names in the wrapped transformers model, as the checkpoint
    holds them) merged in, in fp32; a tied weight once."""
    import peft  # optional: LoRA only (rltrain/workers/lora.py)

    model = from_pretrained(tf.AutoModelForCausalLM, base_model_dir(hf, base), dtype=torch.float32)
    wrapped = peft.get_peft_model(model, peft.LoraConfig.from_pretrained(str(hf)), autocast_adapter_dtype=False)
    try:
        load_adapters(wrapped, {peft_checkpoint_name(name): tensor for name, tensor in adapters.items()})
    except ValueError as err:
        raise CheckpointError(f"{hf.parent}: {err}") from None
    return untied_state_dict(wrapped.merge_and_unload())


def in_format(weights: dict[str, torch.Tensor], config: tf.PreTrainedConfig, form: str, files: Path):
    """(weights, config) in the format --format asks for: a hybrid_delta model converted to Qwen3-Next (module
    docstring), or as they are. CheckpointError naming the config where `qwen3_next` cannot be had."""
    if form not in FORMATS:
        raise CheckpointError(f"format {form!r} is not one of {', '.join(FORMATS)}")
    if form == "checkpoint" or (form == "auto" and not isinstance(config, HybridDeltaConfig)):
        return weights, config
    if not isinstance(config, HybridDeltaConfig):
        raise CheckpointError(f"{files / CONFIG}: model_type {config.model_type!r} has no Qwen3-Next form (only "
                              f"rltrain_kernels' {HybridDeltaConfig.model_type} family converts); drop --format")
    reason = qwen3_next_refusal(config)
    if reason is None:
        return qwen3_next_state_dict(config, weights), qwen3_next_config(config)
    if form == "auto":
        return weights, config
    raise CheckpointError(f"{files / CONFIG}: no Qwen3-Next form, so vLLM cannot serve it: {reason}; export with "
                          "--format checkpoint (transformers loads it after `import rltrain_kernels.models`)")


def write_hf_model(weights: dict[str, torch.Tensor], files: Path, out: Path, max_shard_size: int | str,
                   dtype: str, form: str = "checkpoint") -> Path:
    """`weights` as an HF model directory `out`: safetensors (sharded with an index above max_shard_size), the
    config of the directory `files` (in `form`: in_format) with its dtype set, and that directory's other files but
    weights (generation config, tokenizer, chat template)."""
    weights, config = in_format(weights, tf.AutoConfig.from_pretrained(files), form, files)
    if dtype == "auto":
        stated = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
        dtype = str(stated).removeprefix("torch.")
    if dtype not in DTYPES:
        raise CheckpointError(f"{files / CONFIG}: dtype {dtype!r} is not one of {', '.join(DTYPES)}; pass --dtype")
    out.mkdir(parents=True, exist_ok=True)
    for file in sorted(files.iterdir()):
        weight = file.suffix == ".safetensors" or file.name in (INDEX_FILE, ADAPTER_CONFIG, CONFIG)
        if file.is_file() and not weight:
            shutil.copyfile(file, out / file.name)
    config.dtype = DTYPES[dtype]
    config.save_pretrained(out)
    cast = {name: t.to(DTYPES[dtype]) if t.is_floating_point() else t for name, t in weights.items()}
    save_torch_state_dict(cast, out, max_shard_size=max_shard_size, metadata={"format": "pt"})
    return out


def export(checkpoint: str | Path, out: str | Path, max_shard_size: int | str = DEFAULT_SHARD_SIZE,
           dtype: str = "auto", base: str | None = None, form: str = "auto") -> Path:
    """The checkpoint's policy (a LoRA run's merged into its base) as an HF model directory `out` in format `form`
    (--format); returns it."""
    checkpoint, out = Path(checkpoint), Path(out)
    if out.is_dir() and any(out.glob("*.safetensors")):   # old shards beside new ones would mix two models
        raise FileExistsError(f"{out} already holds safetensors weights; export into a new or empty directory")
    tf.utils.logging.disable_progress_bar()
    weights = checkpoint_weights(checkpoint)
    if holds_adapters(checkpoint):
        weights = merge_adapters(weights, checkpoint / HF_DIR, base)
    return write_hf_model(weights, checkpoint / HF_DIR, out, max_shard_size, dtype, form)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory: <output_dir>/checkpoints/step_N")
    parser.add_argument("out", help="directory for the HF model")
    parser.add_argument("--max-shard-size", default=DEFAULT_SHARD_SIZE,
                        help="shard the safetensors above this size, e.g. 5GB, 500MB (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="the weights' dtype; auto: config.json's (default: %(default)s)")
    parser.add_argument("--base", default=None, help="a LoRA run's base model (default: the one its adapters name)")
    parser.add_argument("--format", default="auto", choices=FORMATS,
                        help="qwen3_next: a hybrid_delta model of Gated DeltaNet and attention as Qwen3-Next; auto: "
                             "that where it can, else the checkpoint's own model type (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, args.max_shard_size, args.dtype, args.base, args.format)
    except (CheckpointError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"HF model written to {out} (model_type {json.loads((out / CONFIG).read_text())['model_type']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
