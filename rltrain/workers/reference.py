"""ReferenceWorker: a frozen model's per-token log-probs of the responses. Two roles use it: the reference (a copy
of the initial policy, for the KL term; started when algorithm.loss.kl_coef > 0) and the teacher of on-policy
distillation (algorithm.distill.teacher_path, a model with the policy's tokenizer; `check_teacher`). It cuts batches
like the actor (`actor.micro_batch_size`, `use_remove_padding`, `max_tokens_per_micro_batch`). FSDPReferenceWorker is
the same role sharded like the actor (actor.strategy=fsdp2; rltrain/workers/fsdp.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rltrain_kernels.registry import KernelConfig
from tensordict import TensorDict

from rltrain.config import ConfigError
from rltrain.workers.fsdp import FSDPConfig, ShardedPolicy
from rltrain.workers.packing import MicroBatching
from rltrain.workers.policy import (
    load_policy, load_tokenizer, release_cached_memory, resolve_batching, response_logprobs, set_threads,
)

TEACHER_KEY = "algorithm.distill.teacher_path"


def check_teacher(path: str, tokenizer, key: str = TEACHER_KEY, role: str = "teacher") -> None:
    """Refuse, naming the key, a model directory (config.json checked by its config section) that cannot read the
    policy's token ids — the teacher of distillation, the critic: no tokenizer, a tokenizer other than the policy's
    (its scores would be of other tokens) or a vocabulary without a row for every token id of it."""
    try:
        other = load_tokenizer(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: {path!r} holds no tokenizer to compare with the policy's "
                          f"({type(err).__name__}: {str(err).splitlines()[0]})") from None
    if other.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"{key}: the {role}'s tokenizer ({len(other)} tokens) is not the policy's "
                          f"({len(tokenizer)}): the {role} reads the policy's responses as the same token ids")
    fields = json.loads((Path(path) / "config.json").read_text())
    vocab = fields.get("vocab_size", fields.get("text_config", {}).get("vocab_size"))
    if vocab is not None and vocab < len(tokenizer):
        raise ConfigError(f"{key}: the {role}'s vocab_size {vocab} has no row for token ids "
                          f"{vocab}..{len(tokenizer) - 1} of the tokenizer")


class ReferenceWorker:
    def __init__(self, model_path: str, dtype: str, kernel_config: KernelConfig | None, temperature: float,
                 batching: MicroBatching, device: str = "cpu", torch_threads: int = 0,
                 attn_implementation: str = "auto"):
        set_threads(torch_threads)
        self.model = load_policy(model_path, dtype, kernel_config, device, attn_implementation)
        self.model.eval().requires_grad_(False)
        self.temperature, self.batching = temperature, resolve_batching(self.model, batching)

    def compute_logprobs(self, batch: TensorDict) -> torch.Tensor:
        try:
            return response_logprobs(self.model, batch, self.temperature, self.batching)
        finally:
            release_cached_memory()   # this process's only work in a step: the colocated engine wakes later


class FSDPReferenceWorker(ShardedPolicy):
    """The frozen reference, sharded like the actor (its sequence parallelism too, actor.ulysses_sequence_parallel_size):
    response log-probs for the KL term."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str, dtype: str,
                 kernel_config: KernelConfig | None, temperature: float, batching: MicroBatching, fsdp: FSDPConfig,
                 device: str = "cpu", torch_threads: int = 0, attn_implementation: str = "auto",
                 sequence_parallel_size: int = 1):
        set_threads(torch_threads)
        self.temperature = temperature
        self._setup(rank, world_size, master_addr, master_port, model_path, dtype, kernel_config, device, fsdp,
                    batching, attn_implementation, sequence_parallel_size=sequence_parallel_size)
        self.model.eval().requires_grad_(False)

    def compute_logprobs(self, batch: TensorDict) -> torch.Tensor | None:
        try:
            return self._sharded_logprobs(batch, self.temperature)
        finally:
            self.offload()   # param_offload: idle until the next step's call
            release_cached_memory()
