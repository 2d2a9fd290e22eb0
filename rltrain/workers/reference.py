"""ReferenceWorker: a frozen copy of the initial policy; per-token log-probs for the KL term. Started only when
algorithm.loss.kl_coef > 0."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rltrain.workers.policy import load_policy, response_logprobs, set_threads


class ReferenceWorker:
    def __init__(self, model_path: str, dtype: str, kernel_config: dict | None, temperature: float,
                 micro_batch_size: int, device: str = "cpu", torch_threads: int = 0):
        set_threads(torch_threads)
        self.model = load_policy(model_path, dtype, kernel_config, device)
        self.model.eval().requires_grad_(False)
        self.temperature, self.micro_batch_size = temperature, micro_batch_size

    def compute_logprobs(self, batch: TensorDict) -> torch.Tensor:
        return response_logprobs(self.model, batch, self.temperature, self.micro_batch_size)
