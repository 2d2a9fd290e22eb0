"""ReferenceWorker: a frozen copy of the initial policy; per-token log-probs for the KL term. Started only when
algorithm.loss.kl_coef > 0. It cuts batches like the actor (`actor.micro_batch_size`, `use_remove_padding`,
`max_tokens_per_micro_batch`)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rltrain.workers.packing import MicroBatching
from rltrain.workers.policy import load_policy, resolve_batching, response_logprobs, set_threads


class ReferenceWorker:
    def __init__(self, model_path: str, dtype: str, kernel_config: dict | None, temperature: float,
                 batching: MicroBatching, device: str = "cpu", torch_threads: int = 0,
                 attn_implementation: str = "auto"):
        set_threads(torch_threads)
        self.model = load_policy(model_path, dtype, kernel_config, device, attn_implementation)
        self.model.eval().requires_grad_(False)
        self.temperature, self.batching = temperature, resolve_batching(self.model, batching)

    def compute_logprobs(self, batch: TensorDict) -> torch.Tensor:
        return response_logprobs(self.model, batch, self.temperature, self.batching)
