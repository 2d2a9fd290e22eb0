"""ActorWorker: holds the trained policy and its optimizer; computes old log-probs and runs the policy update with
`rltrain_kernels.fused_policy_loss` (clipped surrogate + KL + entropy, from hidden states, no logits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rltrain.algorithms.config import LossConfig
from rltrain.config import require
from rltrain.workers.batch import response_hidden, split
from rltrain.workers.policy import load_policy, response_logprobs, set_threads

@dataclass
class ActorConfig:
    lr: float = 5e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    mini_batch_size: int = 0     # responses per optimizer step; 0 = the whole batch (one step per RL step)
    micro_batch_size: int = 64   # responses per forward/backward (gradient accumulation inside a mini-batch)
    torch_threads: int = 0       # 0 = all cores

    def validate(self):
        require(self.lr > 0, "lr", "must be > 0", self.lr)
        require(self.grad_clip > 0, "grad_clip", "must be > 0", self.grad_clip)
        require(self.mini_batch_size >= 0, "mini_batch_size", "must be >= 0", self.mini_batch_size)
        require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1", self.micro_batch_size)


class ActorWorker:
    def __init__(self, config: ActorConfig, loss: LossConfig, model_path: str, dtype: str,
                 kernel_config: dict | None, temperature: float, device: str = "cpu", seed: int = 0):
        set_threads(config.torch_threads)
        torch.manual_seed(seed)
        self.config, self.loss, self.temperature = config, loss, temperature
        self.model = load_policy(model_path, dtype, kernel_config, device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def compute_logprobs(self, batch: TensorDict) -> torch.Tensor:
        return response_logprobs(self.model, batch, self.temperature, self.config.micro_batch_size)

    def update(self, batch: TensorDict) -> dict[str, float]:
        """One pass over `batch` in mini-batches (an optimizer step each). Returns averaged metrics."""
        size = batch.batch_size[0]
        mini = self.config.mini_batch_size or size
        totals: dict[str, float] = {}
        steps = 0
        for mini_batch in split(batch, mini):
            for key, value in self._optimizer_step(mini_batch).items():
                totals[key] = totals.get(key, 0.0) + value
            steps += 1
        return {f"actor/{k}": v / steps for k, v in totals.items()}

    def _optimizer_step(self, mini_batch: TensorDict) -> dict[str, float]:
        from rltrain_kernels import fused_policy_loss

        loss_cfg = self.loss
        weight = self.model.get_output_embeddings().weight
        mask = mini_batch["response_mask"]
        n_tokens = mask.sum().item()
        n_seqs = max(int((mask.sum(1) > 0).sum()), 1)
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "entropy": 0.0, "ppo_kl": 0.0, "clipfrac": 0.0, "ref_kl": 0.0}
        # token-mean normalises by the mini-batch's token count (exact under micro-batching); Dr.GRPO's
        # seq-mean-token-sum-norm by a constant length, the padded response width
        norm = {"token-mean": dict(norm_tokens=max(n_tokens, 1)),
                "seq-mean-token-sum-norm": dict(norm_len=mini_batch["response_ids"].shape[1])}
        norm = norm.get(loss_cfg.loss_agg, {})
        for micro in split(mini_batch, self.config.micro_batch_size):
            micro_tokens = micro["response_mask"].sum().item()
            micro_seqs = int((micro["response_mask"].sum(1) > 0).sum())
            out = fused_policy_loss(
                response_hidden(self.model, micro), weight, micro["response_ids"], micro["response_mask"],
                micro["advantages"], micro["old_logprobs"],
                micro["ref_logprobs"] if "ref_logprobs" in micro.keys() else None,
                clip_low=loss_cfg.clip_low, clip_high=loss_cfg.clip_high, dual_clip=loss_cfg.dual_clip,
                kl_coef=loss_cfg.kl_coef, kl_type=loss_cfg.kl_type, entropy_coef=loss_cfg.entropy_coef,
                loss_agg=loss_cfg.loss_agg, importance_level=loss_cfg.importance_level,
                temperature=self.temperature, **norm)
            # token-mean is normalised by the mini-batch's token count already; the sequence means are per
            # micro-batch: over its sequences with tokens (seq-mean-*) or over all its rows (Dr.GRPO's B·norm_len)
            scale = {"token-mean": 1.0, "seq-mean-token-sum-norm": micro.batch_size[0] / mini_batch.batch_size[0]
                     }.get(loss_cfg.loss_agg, micro_seqs / n_seqs)
            (out.loss * scale).backward()
            sums["loss"] += out.loss.item() * scale
            for key in ("entropy", "ppo_kl", "clipfrac", "ref_kl"):  # token means -> weight by tokens
                sums[key] += out.metrics[key] * micro_tokens / max(n_tokens, 1)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        sums["grad_norm"] = float(grad_norm)
        return sums

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def load_checkpoint(self, model_state: dict, optimizer_state: dict) -> None:
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(optimizer_state)

    def save_pretrained(self, path: str) -> None:
        self.model.save_pretrained(path)
