"""RolloutWorker: generates response groups for a batch of prompts. Engine "hf": transformers' generate with a KV
cache, batched over prompts × n (left-padded prompts). The vLLM engine arrives with the vLLM rollout issue."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rltrain.config import require
from rltrain.workers.policy import load_policy, set_threads

ENGINES = ("hf",)


@dataclass
class RolloutConfig:
    engine: str = "hf"
    n: int = 16                    # responses per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    val_temperature: float = 0.0   # 0 = greedy decoding for validation
    micro_batch_size: int = 256    # sequences per generate() call
    torch_threads: int = 0

    def validate(self):
        require(self.engine in ENGINES, "engine", f"must be one of {', '.join(ENGINES)} "
                "(vllm arrives with the vLLM rollout issue)", self.engine)
        require(self.n >= 1, "n", "must be >= 1", self.n)
        require(self.temperature > 0, "temperature", "must be > 0 for sampling", self.temperature)
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1", self.max_new_tokens)
        require(self.val_temperature >= 0, "val_temperature", "must be >= 0", self.val_temperature)
        require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1", self.micro_batch_size)


class RolloutWorker:
    def __init__(self, config: RolloutConfig, model_path: str, dtype: str, kernel_config: dict | None,
                 device: str = "cpu"):
        set_threads(config.torch_threads)
        self.config = config
        self.model = load_policy(model_path, dtype, kernel_config, device)
        self.model.eval()
        self.device = device
        generation = self.model.generation_config
        self.eos_token_id = generation.eos_token_id if generation.eos_token_id is not None \
            else self.model.config.eos_token_id
        self.pad_token_id = generation.pad_token_id if generation.pad_token_id is not None else self.eos_token_id

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """In-place weight sync from the actor (no disk, no restart)."""
        self.model.load_state_dict(state_dict)

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float,
                 seed: int) -> TensorDict:
        """n responses per prompt, grouped consecutively; group_ids[i] = index of the prompt."""
        torch.manual_seed(seed)
        prompt_ids = prompt_ids.repeat_interleave(n, dim=0).to(self.device)
        prompt_mask = prompt_mask.repeat_interleave(n, dim=0).to(self.device)
        outputs = []
        for start in range(0, prompt_ids.shape[0], self.config.micro_batch_size):
            ids = prompt_ids[start:start + self.config.micro_batch_size]
            mask = prompt_mask[start:start + self.config.micro_batch_size]
            sampling = dict(do_sample=True, temperature=temperature, top_p=self.config.top_p, top_k=0) \
                if temperature > 0 else dict(do_sample=False)
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.config.max_new_tokens,
                                      eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id, **sampling)
            outputs.append(out[:, ids.shape[1]:])
        width = max(o.shape[1] for o in outputs)
        response_ids = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=self.pad_token_id)
                                  for o in outputs])
        response_mask, truncated = self._response_mask(response_ids)
        groups = torch.arange(prompt_ids.shape[0] // n).repeat_interleave(n)
        return TensorDict({"prompt_ids": prompt_ids.cpu(), "prompt_mask": prompt_mask.cpu(),
                           "response_ids": response_ids.cpu(), "response_mask": response_mask.cpu(),
                           "group_ids": groups, "truncated": truncated.cpu()}, batch_size=[prompt_ids.shape[0]])

    def _response_mask(self, response_ids: torch.Tensor):
        """1 up to and including the first <eos>; a response with no <eos> is truncated and fully kept."""
        is_eos = response_ids == self.eos_token_id
        before_eos = (is_eos.long().cumsum(1) - is_eos.long()) == 0
        return before_eos.long(), ~is_eos.any(1)
