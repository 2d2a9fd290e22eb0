"""LoRA RL (`actor.lora`, rank > 0): the policy trains low-rank adapters (PEFT's LoRA) on a frozen base.

What changes with it on (rank 0 is full fine-tuning, none of this):
- the actor wraps its policy with `peft.get_peft_model` after loading it, so the registry's kernels are already
  swapped in (swapping works on either side of the wrapping: tests/kernels/integrations/test_peft_models.py); only
  the adapters (`lora_A` / `lora_B`) are trainable and in the optimizer, and the LM head stays frozen and outside
  them, so `linear_logprobs` / `fused_policy_loss` take its weight as before;
- the reference policy is that same model with its adapters disabled (`adapters_disabled`): no second copy and no
  ReferenceWorker when algorithm.loss.kl_coef > 0 (ActorWorker.compute_ref_logprobs);
- under actor.strategy=fsdp2 the adapters go in before sharding: the frozen base is sharded in model.dtype, the
  adapters in the trained dtype (fp32 under actor.mixed_precision), and the push gathers the adapters alone;
- the weight push sends the adapter tensors only (`adapter_weights`): into an HF rollout engine that holds the same
  PEFT model, or into a vLLM engine, which loads them as a LoRA adapter from a PEFT-format directory
  (`save_peft_adapter`; rltrain/workers/vllm_lora.py);
- checkpoints hold the adapters alone (the base is model.path's) with their optimizer state, and hf/ an
  adapter_config.json naming the base (rltrain/checkpoint.py); with trainer.save_hf also adapter_model.safetensors
  (PEFT's format: `PeftModel.from_pretrained` loads hf/); `python -m rltrain.export` merges them into a full HF
  model.

The workers hold the transformers model itself (`PeftModel.get_base_model()`, with the LoRA layers inside its
modules), so the code that runs a policy (packing, hidden states, the LM head) is the same with LoRA on or off. peft is
imported only when LoRA is on (its import takes 0.8 s, in every process that imports this module).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import rltrain_kernels.models  # noqa: F401  (registers the delta-rule families with the Auto classes)
import torch
import transformers as tf
from safetensors.torch import save_file

from rltrain.config import ConfigError, require
from rltrain.workers.hf_config import load_config

ALL_LINEAR = "all-linear"


@dataclass
class LoraConfig:
    rank: int = 0              # adapter rank r; 0 = off (full fine-tuning)
    alpha: float = 16.0        # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0       # dropout on the adapters' input during the update
    target_modules: str | list[str] = ALL_LINEAR  # all-linear (every linear layer but the LM head) | names

    def validate(self):
        require(self.rank >= 0, "rank", "must be >= 0", self.rank)
        require(self.alpha > 0, "alpha", "must be > 0", self.alpha)
        require(0 <= self.dropout < 1, "dropout", "must be in [0, 1)", self.dropout)
        if isinstance(self.target_modules, str):
            require(self.target_modules == ALL_LINEAR, "target_modules",
                    f"must be {ALL_LINEAR!r} or a list of module names", self.target_modules)
        else:
            require(bool(self.target_modules) and all(self.target_modules), "target_modules",
                    "must be a non-empty list of module names", self.target_modules)

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def check_target_modules(model, config: LoraConfig, key: str = "actor.lora") -> None:
    """Every name in actor.lora.target_modules matches a module of `model` (PEFT's rule for a list: the module's
    name, or its last components after a dot) and none matches the LM head, whose weight the fused log-prob and loss
    kernels take alone. ConfigError naming the key otherwise. (all-linear: PEFT leaves the head out itself.)"""
    if config.target_modules == ALL_LINEAR:
        return
    head = model.get_output_embeddings()
    names = {module: name for name, module in model.named_modules()}
    for target in config.target_modules:
        matched = [name for name in names.values() if name == target or name.endswith("." + target)]
        if not matched:
            linear = sorted({name.rsplit(".", 1)[-1] for module, name in names.items()
                             if isinstance(module, torch.nn.Linear) and module is not head})
            raise ConfigError(f"{key}.target_modules: {target!r} matches no module of {type(model).__name__}; "
                              f"its linear layers: {', '.join(linear)} (or use {ALL_LINEAR})")
        if head is not None and names.get(head) in matched:
            raise ConfigError(f"{key}.target_modules: {target!r} matches the LM head {names[head]!r}, which "
                              "stays frozen and outside the adapters (the fused log-prob kernels take its weight alone)")


def _meta_model(model_dir: str):
    """The transformers model in `model_dir` built on the meta device from its config: no weights read."""
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(load_config(model_dir))


def check_target_modules_of(model_dir: str, config: LoraConfig, key: str = "actor.lora") -> None:
    """check_target_modules on the model in `model_dir` (on the meta device), so a bad name stops the run before any
    worker starts; errors name `key`."""
    if not config.enabled or config.target_modules == ALL_LINEAR:
        return
    check_target_modules(_meta_model(model_dir), config, key)


def adapter_modules_of(model_dir: str, config: LoraConfig) -> set[str]:
    """The last name component of every module PEFT puts adapters on under `config` (`q_proj`, `embed_tokens`, ...),
    found by wrapping the model in `model_dir` on the meta device: what a rollout engine must take adapters on."""
    with torch.device("meta"):
        model = _meta_model(model_dir)
        attach_lora(model, config)
    return {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in adapter_weights(model)}


def peft_config(config: LoraConfig, base_model: str | None = None, exclude: tuple[str, ...] = ()):
    """actor.lora as PEFT's LoraConfig (what attach_lora wraps with and every adapter_config.json holds); `exclude`:
    modules that take no adapters."""
    import peft  # optional: LoRA only (module docstring)

    return peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, bias="none",
                           target_modules=config.target_modules, base_model_name_or_path=base_model,
                           exclude_modules=list(exclude) or None)


def attach_lora(model, config: LoraConfig, adapter_dtype: torch.dtype | None = None, whole: tuple[str, ...] = ()):
    """Wrap `model` (a transformers causal LM, kernels already swapped in) with fresh LoRA adapters, in place: the
    LoRA layers go inside its modules, its own parameters are frozen. Returns the PeftModel (its get_base_model() is
    `model`). lora_B starts at zero, so the wrapped model computes what `model` did. The adapters take the model's
    dtype (model.dtype), as full fine-tuning trains its weights: PEFT's default fp32 adapters on a bf16 model cast
    every adapted layer's input to fp32 and keep it for the backward (1.7B Qwen3 on an H100, 16k-token micro-batches:
    peak 58.7 GiB and 0.56x the full fine-tuning's tokens/s, RESULTS.md has the bf16 figures). adapter_dtype stores
    them in another dtype: the FSDP2 actor's fp32 adapter shards under actor.mixed_precision, which its
    MixedPrecisionPolicy casts to model.dtype for the forward, so the compute is the same as here. `whole`: modules
    (by name) kept out of the adapters and trained whole beside them, in the adapters' dtype (the critic's value
    head)."""
    import peft  # optional: LoRA only (module docstring)

    check_target_modules(model, config)
    wrapped = peft.get_peft_model(model, peft_config(config, exclude=whole), autocast_adapter_dtype=False)
    for name in whole:
        model.get_submodule(name).requires_grad_(True)
    trained = {**adapter_weights(model), **{n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[0] in whole}}
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    if trainable != set(trained):
        raise RuntimeError(f"LoRA left parameters outside the adapters trainable: "
                           f"{sorted(trainable - set(trained))[:5]}")
    if adapter_dtype is not None:
        for param in trained.values():
            param.data = param.data.to(adapter_dtype)
    return wrapped


@contextmanager
def adapters_disabled(model):
    """The LoRA-wrapped `model` computing its frozen base (every LoRA layer skips its adapters), for the reference
    log-probs. Unlike PeftModel.disable_adapter() it leaves requires_grad alone: under FSDP2 the first forward
    fixes which parameters a unit reduces gradients for, and that forward may be this one
    (algorithm.old_logprobs=update)."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # optional: LoRA only (module docstring)

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    held = [layer._disable_adapters for layer in layers]   # PEFT's flag behind BaseTunerLayer.disable_adapters
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, flag in zip(layers, held):
            layer._disable_adapters = flag


def is_adapter_weight(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (lora_A / lora_B, the modules PEFT inserts)."""
    return any(part.startswith("lora_") for part in name.split("."))


def adapter_weights(model) -> dict[str, torch.Tensor]:
    """The adapter parameters of a LoRA-wrapped transformers model, by their names in it
    (`model.layers.0.self_attn.q_proj.lora_A.default.weight`): what the weight push sends, into the same names on the
    rollout engine's model."""
    return {name: param for name, param in model.named_parameters() if is_adapter_weight(name)}


def peft_checkpoint_name(name: str, adapter: str = "default") -> str:
    """The name PEFT saves an adapter tensor under (get_peft_model_state_dict / save_pretrained), from its name in
    the wrapped transformers model: `base_model.model.` in front, the adapter-name segment after `lora_A` / `lora_B` /
    `lora_embedding_A` ... dropped (`model.layers.0.mlp.up_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.mlp.up_proj.lora_A.weight`)."""
    parts = name.split(".")
    kept = [part for i, part in enumerate(parts)
            if not (part == adapter and i > 0 and parts[i - 1].startswith("lora_"))]
    return "base_model.model." + ".".join(kept)


def save_peft_adapter(directory: str, adapters: dict[str, torch.Tensor], config: LoraConfig,
                      base_model: str | None = None) -> None:
    """Adapters (adapter_weights' names and tensors) as a PEFT adapter directory: adapter_config.json and
    adapter_model.safetensors, loadable by `PeftModel.from_pretrained` and by vLLM's LoRARequest. The tensors file
    is written beside and renamed into place, so a reader never sees half of it."""
    tensors = {peft_checkpoint_name(name): tensor.detach().contiguous() for name, tensor in adapters.items()}
    peft_config(config, base_model).save_pretrained(directory)
    path = os.path.join(directory, "adapter_model.safetensors")
    save_file(tensors, path + ".partial", metadata={"format": "pt"})
    os.replace(path + ".partial", path)


def load_adapters(wrapped, state: dict[str, torch.Tensor]) -> None:
    """Adapters in PEFT's format (a checkpoint's adapter_model.safetensors) into a LoRA-wrapped model, in place;
    every adapter of the model must be in `state` and nothing else."""
    import peft  # optional: LoRA only (module docstring)

    result = peft.set_peft_model_state_dict(wrapped, state)
    missing = [name for name in result.missing_keys if is_adapter_weight(name)]
    if missing or result.unexpected_keys:
        raise ValueError(f"LoRA adapters do not fit the model (actor.lora differs from the checkpoint's?): missing "
                         f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}")
