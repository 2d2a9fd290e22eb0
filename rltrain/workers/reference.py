"""ReferenceWorker: a frozen copy of the initial policy; per-token log-probs for the KL term. Started only when
algorithm.loss.kl_coef > 0. It cuts batches like the actor (`actor.micro_batch_size`, `use_remove_padding`,
`max_tokens_per_micro_batch`). FSDPReferenceWorker is the same role sharded like the actor (actor.strategy=fsdp2;
rltrain/workers/fsdp.py)."""

from __future__ import annotations

import torch
from rltrain_kernels.registry import KernelConfig
from tensordict import TensorDict

from rltrain.workers.fsdp import FSDPConfig, ShardedPolicy
from rltrain.workers.packing import MicroBatching
from rltrain.workers.policy import load_policy, resolve_batching, response_logprobs, set_threads


class ReferenceWorker:
    def __init__(self, model_path: str, dtype: str, kernel_config: KernelConfig | None, temperature: float,
                 batching: MicroBatching, device: str = "cpu", torch_threads: int = 0,
                 attn_implementation: str = "auto"):
        set_threads(torch_threads)
        self.model = load_policy(model_path, dtype, kernel_config, device, attn_implementation)
        self.model.eval().requires_grad_(False)
        self.temperature, self.batching = temperature, resolve_batching(self.model, batching)

    def compute_logprobs(self, batch: TensorDict) -> torch.Tensor:
        return response_logprobs(self.model, batch, self.temperature, self.batching)


class FSDPReferenceWorker(ShardedPolicy):
    """The frozen reference, sharded like the actor: response log-probs for the KL term."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str, dtype: str,
                 kernel_config: KernelConfig | None, temperature: float, batching: MicroBatching, fsdp: FSDPConfig,
                 device: str = "cpu", torch_threads: int = 0, attn_implementation: str = "auto"):
        set_threads(torch_threads)
        self.temperature = temperature
        self._setup(rank, world_size, master_addr, master_port, model_path, dtype, kernel_config, device, fsdp,
                    batching, attn_implementation)
        self.model.eval().requires_grad_(False)

    def compute_logprobs(self, batch: TensorDict) -> torch.Tensor | None:
        return self._sharded_logprobs(batch, self.temperature)
