"""The actor's configuration (`actor.*`): ActorConfig with its checks, the MoE routing replay's RouterReplayConfig,
and LRSchedule, actor.lr_scheduler as a factor of actor.lr per update. The critic (`critic.*`,
rltrain/workers/critic.py) reuses ActorConfig for the worker it shares with the actor."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rltrain.config import require
from rltrain.workers.fsdp import FSDPConfig
from rltrain.workers.lora import LoraConfig
from rltrain.workers.packing import MicroBatching

STRATEGIES = ("single", "fsdp2")
LR_SCHEDULERS = ("constant", "cosine", "linear")


ROUTER_REPLAY = ("disabled", "R3")


@dataclass
class RouterReplayConfig:
    mode: str = "disabled"   # disabled | R3: route every token as the rollout engine did (rltrain/workers/router.py)

    def validate(self):
        require(self.mode in ROUTER_REPLAY, "mode", f"must be one of {', '.join(ROUTER_REPLAY)}", self.mode)


@dataclass
class ActorConfig:
    lr: float = 5e-4
    lr_scheduler: str = "constant"   # constant | cosine | linear: after the warm-up, over trainer.total_steps updates
    lr_warmup_steps: int = 0         # the first N updates ramp the rate up linearly; 0 = lr_warmup_ratio decides
    lr_warmup_ratio: float = 0.0     # the warm-up as a share of trainer.total_steps (with lr_warmup_steps 0)
    min_lr_ratio: float = 0.0        # cosine / linear end at lr × this
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ppo_epochs: int = 1          # passes over each batch, mini-batches reshuffled every pass
    mini_batch_size: int = 0     # responses per optimizer step; 0 = the whole batch (one step per pass)
    micro_batch_size: int = 64   # responses per forward/backward (gradient accumulation inside a mini-batch)
    use_remove_padding: bool = True          # pack each micro-batch's sequences into one row (no padding)
    max_tokens_per_micro_batch: int = 16384  # packed: micro-batches by token budget (per rank); 0 = by rows
    torch_threads: int = 0       # 0 = all cores
    strategy: str = "single"     # single: one process | fsdp2: trainer.nnodes × n_gpus_per_node sharded ranks
    gradient_checkpointing: bool = False
    mixed_precision: bool = True  # fp32 trained weights and optimizer state, model.dtype compute; false: in place
    weight_bucket_mb: int = 256  # the weight push sends full tensors in buckets of about this size
    router_aux_loss_coef: float = 0.0  # MoE policies: weight of the routers' load-balancing loss (router.py)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)  # MoE: the rollout's routing
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    ulysses_sequence_parallel_size: int = 1  # fsdp2, packed: ranks that split each packed row's tokens; 1 = off
    expert_parallel_size: int = 1  # fsdp2, MoE: ranks that split each MoE layer's experts (all-to-all); 1 = off
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self):
        require(self.strategy in STRATEGIES, "strategy", f"must be one of {', '.join(STRATEGIES)}", self.strategy)
        require(self.weight_bucket_mb >= 1, "weight_bucket_mb", "must be >= 1", self.weight_bucket_mb)
        require(self.router_aux_loss_coef >= 0, "router_aux_loss_coef", "must be >= 0 (0 = off)",
                self.router_aux_loss_coef)
        require(self.lr > 0, "lr", "must be > 0", self.lr)
        require(self.lr_scheduler in LR_SCHEDULERS, "lr_scheduler", f"must be one of {', '.join(LR_SCHEDULERS)}",
                self.lr_scheduler)
        require(self.lr_warmup_steps >= 0, "lr_warmup_steps", "must be >= 0", self.lr_warmup_steps)
        require(0 <= self.lr_warmup_ratio < 1, "lr_warmup_ratio", "must be in [0, 1)", self.lr_warmup_ratio)
        require(self.lr_warmup_steps == 0 or self.lr_warmup_ratio == 0, "lr_warmup_ratio",
                "set lr_warmup_steps or lr_warmup_ratio, not both", self.lr_warmup_ratio)
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]", self.min_lr_ratio)
        require(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1", self.ppo_epochs)
        require(self.grad_clip > 0, "grad_clip", "must be > 0", self.grad_clip)
        require(self.mini_batch_size >= 0, "mini_batch_size", "must be >= 0", self.mini_batch_size)
        require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1", self.micro_batch_size)
        sp = self.ulysses_sequence_parallel_size
        require(sp >= 1, "ulysses_sequence_parallel_size", "must be >= 1 (1 = off)", sp)
        require(sp == 1 or self.strategy == "fsdp2", "ulysses_sequence_parallel_size",
                f"> 1 needs actor.strategy=fsdp2 (got {self.strategy!r})", sp)
        require(sp == 1 or self.use_remove_padding, "ulysses_sequence_parallel_size",
                "> 1 splits packed rows: needs actor.use_remove_padding=true", sp)
        ep = self.expert_parallel_size
        require(ep >= 1, "expert_parallel_size", "must be >= 1 (1 = off)", ep)
        require(ep == 1 or self.strategy == "fsdp2", "expert_parallel_size",
                f"> 1 needs actor.strategy=fsdp2 (got {self.strategy!r})", ep)
        require(ep == 1 or not self.lora.enabled, "expert_parallel_size",
                "> 1 is not supported with actor.lora (adapters on split experts): set one of them off", ep)
        require(ep == 1 or sp == 1, "expert_parallel_size", "> 1 is not supported with "
                "actor.ulysses_sequence_parallel_size > 1 yet: set one of them to 1", ep)
        require(ep == 1 or self.fsdp.fsdp_size == -1, "expert_parallel_size", "> 1 is not supported with HSDP "
                "(actor.fsdp.fsdp_size) yet: set fsdp_size=-1", ep)
        require(self.max_tokens_per_micro_batch >= 0, "max_tokens_per_micro_batch", "must be >= 0 (0 = by rows)",
                self.max_tokens_per_micro_batch)

    @property
    def micro_batching(self) -> MicroBatching:
        return MicroBatching(self.micro_batch_size, self.use_remove_padding, self.max_tokens_per_micro_batch)


@dataclass(frozen=True)
class LRSchedule:
    """actor.lr_scheduler as a factor of actor.lr for update u = 0, 1, ... of the run. The first `warmup` updates
    ramp up linearly, u -> (u + 1) / warmup; then `constant` stays at 1, and `cosine` / `linear` fall from 1 at
    update `warmup` to min_lr_ratio at update total - 1, the run's last (total: trainer.total_steps, one update per
    step), and stay there."""

    kind: str = "constant"
    total: int = 1
    warmup: int = 0
    min_ratio: float = 0.0

    @classmethod
    def of(cls, config: ActorConfig, total_steps: int | None) -> "LRSchedule":
        if total_steps is None:
            if config.lr_scheduler != "constant" or config.lr_warmup_ratio:
                raise ValueError(f"actor.lr_scheduler={config.lr_scheduler!r} / lr_warmup_ratio need the run's "
                                 "total_steps")
            total_steps = 1
        warmup = config.lr_warmup_steps or round(config.lr_warmup_ratio * total_steps)
        return cls(config.lr_scheduler, total_steps, warmup, config.min_lr_ratio)

    def factor(self, update: int) -> float:
        if update < self.warmup:
            return (update + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (update - self.warmup) / max(1, self.total - 1 - self.warmup))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1 - progress
        return self.min_ratio + (1 - self.min_ratio) * decay


