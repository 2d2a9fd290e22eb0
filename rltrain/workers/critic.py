"""The critic (`algorithm.adv_estimator=gae`, PPO): a value model, V(s_t) for every response token t, trained on the
GAE returns with the clipped value loss.

The value model is the policy's architecture with a scalar head: a causal LM loaded from `critic.model.path` (by
default the policy's own starting checkpoint) whose final hidden states go through `value_head`, a Linear(H, 1)
added to the model (zero at the start, so the first values are 0), instead of the LM head. V(s_t) is read at the
position that predicts response token t (the state before it), the same hidden state the actor's loss reads there.

`CriticWorker` is the actor's worker with another head: everything else — packed rows and token-budget
micro-batches, gradient checkpointing, fp32 masters (actor.mixed_precision), the schedule, `ppo_epochs` and
mini-batches, sharded checkpoints — is ActorWorker's, and `FSDPCriticWorker` shards it like FSDPActorWorker (the
value head sits in the FSDP root, gathered while the head runs). With `critic.lora.rank` > 0 LoRA adapters train on
the backbone and the value head trains whole beside them (its checkpoints hold both; the frozen base is the critic's
model.path). Its ActorConfig is built from the `critic` section
with the actor's batching, precision and strategy (`CriticConfig.worker_config`).

Loss (PPO's, as verl's): with returns R_t, the values of the rollout V_old and the prediction V, the token mean over
the mini-batch's response tokens of ½·max((V − R)², (clip(V, V_old ± cliprange_value) − R)²).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from rltrain.config import require
from rltrain.workers.actor import ActorWorker, FSDPActorWorker
from rltrain.workers.actor_config import ActorConfig, RouterReplayConfig
from rltrain.workers.lora import LoraConfig
from rltrain.workers.packing import Packing
from rltrain.workers.policy import release_cached_memory

VALUE_HEAD = "value_head"


@dataclass
class CriticModelConfig:
    path: str | None = None      # a transformers causal-LM directory with the policy's tokenizer; null = the policy's


@dataclass
class CriticConfig:
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ppo_epochs: int = 1              # passes over each batch
    mini_batch_size: int = 0         # responses per optimizer step; 0 = the whole batch
    micro_batch_size: int = 64       # responses per forward/backward
    cliprange_value: float = 0.5     # V stays within V_old ± this in the clipped term of the loss
    warmup_steps: int = 0            # the first N steps train the critic only (the actor waits for sensible values)
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank > 0: adapters on the backbone, the value head whole

    def validate(self):
        require(self.model.path is None or os.path.isfile(os.path.join(self.model.path, "config.json")),
                "model.path", "must be a transformers model directory (it has no config.json)", self.model.path)
        require(self.lr > 0, "lr", "must be > 0", self.lr)
        require(self.grad_clip > 0, "grad_clip", "must be > 0", self.grad_clip)
        require(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1", self.ppo_epochs)
        require(self.mini_batch_size >= 0, "mini_batch_size", "must be >= 0", self.mini_batch_size)
        require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1", self.micro_batch_size)
        require(self.cliprange_value > 0, "cliprange_value", "must be > 0", self.cliprange_value)
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0", self.warmup_steps)

    def worker_config(self, actor: ActorConfig) -> ActorConfig:
        """The critic worker's ActorConfig: this section's optimisation keys and LoRA, the actor's batching (packing,
        token budget, threads), precision and strategy; a constant learning rate."""
        return dataclasses.replace(actor, lr=self.lr, weight_decay=self.weight_decay, grad_clip=self.grad_clip,
                                   ppo_epochs=self.ppo_epochs, mini_batch_size=self.mini_batch_size,
                                   micro_batch_size=self.micro_batch_size, lr_scheduler="constant",
                                   lr_warmup_steps=0, lr_warmup_ratio=0.0,
                                   gradient_checkpointing=self.gradient_checkpointing, router_aux_loss_coef=0.0,
                                   router_replay=RouterReplayConfig(), lora=self.lora)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange: float, n_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss of [b, R] predictions, summed over the masked tokens and divided by n_tokens (the
    mini-batch's count: micro-batches add up to its token mean); the partial sums of the metrics likewise."""
    keep = (mask != 0).float()
    clipped = old_values + (values - old_values).clamp(-cliprange, cliprange)
    unclipped_error, clipped_error = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * (torch.maximum(unclipped_error, clipped_error) * keep).sum() / n_tokens
    with torch.no_grad():
        clipfrac = ((clipped_error > unclipped_error).float() * keep).sum() / n_tokens
        vpred = (values * keep).sum() / n_tokens
    return loss, {"vf_loss": loss.item(), "vf_clipfrac": clipfrac.item(), "vpred_mean": vpred.item()}


class CriticWorker(ActorWorker):
    """The value model's worker: compute_values (V_old of a batch) and update (the value loss on returns)."""

    def __init__(self, *args, cliprange_value: float, **kwargs):
        self.cliprange_value = cliprange_value
        super().__init__(*args, **kwargs)

    def _extend(self, model) -> list[str]:
        """The value head: Linear(H, 1) in the model's dtype and device, zero (the first values are 0)."""
        embeddings = model.get_input_embeddings().weight
        head = torch.nn.Linear(model.config.get_text_config().hidden_size, 1, dtype=embeddings.dtype,
                               device=embeddings.device)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        setattr(model, VALUE_HEAD, head)
        return [f"{VALUE_HEAD}.weight", f"{VALUE_HEAD}.bias"]

    def _values(self, micro: TensorDict) -> torch.Tensor:
        """[b, R] fp32 values of one micro-batch's response tokens (0 past a row's response)."""
        packing = Packing.of(micro) if self.batching.packed else None
        head = getattr(self.model, VALUE_HEAD)

        def values(hidden, weight):   # the LM head's weight goes unused
            return head(hidden).squeeze(-1).float()

        out = self._run_head(micro, packing, values)
        return out if packing is None else packing.rows(out)

    def compute_values(self, batch: TensorDict) -> torch.Tensor | None:
        """V(s_t) of every response token, [B, R] fp32 on the CPU, 0 where masked (None on ranks other than 0 under
        FSDP2)."""
        with self._scoring(), torch.no_grad():
            rows, micros = self._micro_batches(batch)
            values = [self._values(micro).cpu() for micro in micros]   # FSDP2: filler micro-batches run too
        if getattr(self, "root", None) is not None:
            self.root.reshard()   # the root stays unsharded after a forward that no backward follows
        release_cached_memory()
        return self._assemble_rows(batch, list(zip(rows, values)))

    def update(self, batch: TensorDict, step: int = 0) -> dict:
        """critic.ppo_epochs passes of the value loss over `batch` (values: V_old, returns: the targets);
        metrics critic/vf_loss, vf_clipfrac, vpred_mean, grad_norm, lr."""
        torch.manual_seed(self.seed * 1_000_003 + step * 101 + 29)
        result = self._train(batch, step, "critic")
        release_cached_memory()
        return result

    def _optimizer_step(self, mini_batch: TensorDict) -> dict[str, float]:
        n_tokens = max(int((mini_batch["response_mask"] != 0).sum()), 1)
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"vf_loss": 0.0, "vf_clipfrac": 0.0, "vpred_mean": 0.0}
        _, micros = self._micro_batches(mini_batch)
        for micro in micros:
            loss, stats = value_loss(self._values(micro), micro["values"], micro["returns"], micro["response_mask"],
                                     self.cliprange_value, n_tokens)
            loss.backward()
            for key, value in stats.items():
                sums[key] += value
        return self._step(sums)


class FSDPCriticWorker(CriticWorker, FSDPActorWorker):
    """CriticWorker sharded across the ranks of its WorkerGroup like FSDPActorWorker (rltrain/workers/fsdp.py)."""


def value_metrics(batch: TensorDict) -> dict[str, float]:
    """critic/values_mean, returns_mean and vf_explained_var (1 − Var[R − V] / Var[R] over the response tokens: 1
    is a perfect critic, 0 one no better than the mean) of a batch with values and returns."""
    mask = batch["response_mask"] != 0
    values, returns = batch["values"][mask].double(), batch["returns"][mask].double()
    if values.numel() < 2:
        return {}
    metrics = {"critic/values_mean": values.mean().item(), "critic/returns_mean": returns.mean().item()}
    variance = returns.var()
    if variance > 0:   # all returns alike: nothing to explain
        metrics["critic/vf_explained_var"] = (1.0 - (returns - values).var() / variance).item()
    return metrics
