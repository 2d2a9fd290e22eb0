"""ActorWorker: holds the trained policy and its optimizer; computes old log-probs and runs the policy update with
`rltrain_kernels.fused_policy_loss` (clipped surrogate + KL + entropy, from hidden states, no logits).

An update makes actor.ppo_epochs passes over the batch, each in mini-batches of actor.mini_batch_size responses
(an optimizer step each) drawn in an order seeded by (trainer.seed, step, pass), so a run replays; the learning rate
of each update follows actor.lr_scheduler (LRSchedule), whose position, the number of updates done, is saved with
every checkpoint. Under actor.mixed_precision (the default) the trained weights and the optimizer state are fp32
and the forward and backward run in model.dtype: fp32 master copies beside a model.dtype model here
(rltrain/workers/precision.py), FSDP2's MixedPrecisionPolicy in FSDPActorWorker. With actor.lora.rank > 0 only LoRA
adapters train, and the reference log-probs come from this worker's own model with the adapters disabled
(rltrain/workers/lora.py; under FSDP2 the frozen base is sharded in model.dtype beside fp32 adapter shards). With
algorithm.distill.kl=exact the worker also holds the frozen teacher (in model.dtype), and each micro-batch's loss
gains coef × the exact reverse KL to it (linear_kl_div from both models' hidden states; actor/distill_kl).
FSDPActorWorker is the same role sharded over the ranks of a WorkerGroup (actor.strategy=fsdp2;
rltrain/workers/fsdp.py), with actor.ulysses_sequence_parallel_size > 1 also splitting each packed row's tokens over
groups of ranks (rltrain/workers/ulysses.py), and actor.expert_parallel_size > 1 splitting an MoE policy's experts
over groups of ranks (rltrain/workers/expert_parallel.py). The `actor.*` config: rltrain/workers/actor_config.py;
checkpoints: rltrain/workers/actor_checkpoint.py."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from rltrain_kernels import fused_policy_loss
from rltrain_kernels.ops.kl_div import linear_kl_div
from rltrain_kernels.ops.policy_loss import LossAccumulation, PolicyLossOptions, aggregation_weights
from rltrain_kernels.registry import KernelConfig
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from rltrain.algorithms.config import DistillConfig, LossConfig
from rltrain.perf import ModelShape
from rltrain.workers.actor_checkpoint import ActorCheckpoints
from rltrain.workers.actor_config import ActorConfig, LRSchedule
from rltrain.workers.batch import IGNORE_INDEX, split
from rltrain.workers.fsdp import ShardedPolicy, keyed_by_index, move_optimizer_state
from rltrain.workers.lora import adapter_weights, adapters_disabled, attach_lora, save_peft_adapter
from rltrain.workers.packing import Packing
from rltrain.workers.policy import (
    DTYPES, assemble_rows, load_policy, plan_buckets, policy_hidden, release_cached_memory, resolve_batching,
    response_labels, response_logprobs, set_threads, untied_state_dict,
)
from rltrain.workers.precision import MasterWeights, stored_fp32_weights, trained_dtype
from rltrain.workers.router import ROUTING, RouterBalance, replay_tokens, scored_token_mask, scored_tokens
from rltrain.workers.weight_sync import WeightSource


def owning_modules(names: list[str]) -> tuple[str, ...]:
    """The modules holding the named parameters (_extend's, which LoRA leaves out of the adapters: trained whole)."""
    return tuple(sorted({name.rsplit(".", 1)[0] for name in names}))


def weighted_advantages(batch: TensorDict) -> torch.Tensor:
    """The advantages, times the truncated importance weights where the batch has them
    (algorithm.rollout_correction.mode=truncate).

    fused_policy_loss takes no per-token weight, and scaling A by a detached w >= 0 per token scales exactly that
    token's policy-gradient term: w·max(−A·r, −A·clip(r)) = max(−wA·r, −wA·clip(r)), and the dual clip's
    min(pg, −A·c) likewise; the KL and entropy terms stay unweighted. (clipfrac then skips tokens whose w is 0.)"""
    advantages = batch["advantages"]
    if "rollout_is_weights" not in batch.keys():
        return advantages
    return (advantages if advantages.dim() == 2 else advantages.unsqueeze(1)) * batch["rollout_is_weights"]


def minibatch_order(size: int, seed: int, step: int, epoch: int) -> torch.Tensor:
    """The row order of one pass over a batch of `size` rows: a permutation seeded by (seed, step, pass), the same
    on every FSDP rank and in a resumed run."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + epoch)
    return torch.randperm(size, generator=generator)


class ActorWorker(ActorCheckpoints, WeightSource):
    adapters = None  # the PeftModel wrapping self.model with actor.lora on
    teacher = None   # algorithm.distill.kl=exact: the frozen teacher whose KL joins the loss (FSDPActorWorker: never)
    update_logprobs = None  # an on-policy update's (row indices, log-probs) per micro-batch of this process
    sequence_parallel = None  # FSDPActorWorker's sequence group (actor.ulysses_sequence_parallel_size > 1)
    routers = None   # RouterBalance: an MoE policy's routers (their auxiliary loss and metrics), else None
    master = None    # MasterWeights: the fp32 weights the optimizer trains, where model.dtype is not float32 under
                     # actor.mixed_precision (FSDPActorWorker: never; its shards are fp32 themselves)
    trained_whole = ()  # with LoRA: the modules _extend added, trained whole beside the adapters

    def __init__(self, config: ActorConfig, loss: LossConfig, model_path: str, dtype: str,
                 kernel_config: KernelConfig | None, temperature: float, device: str = "cpu", seed: int = 0,
                 attn_implementation: str = "auto", total_steps: int | None = None,
                 distill: DistillConfig | None = None):
        set_threads(config.torch_threads)
        torch.manual_seed(seed)
        self.config, self.loss, self.temperature, self.device = config, loss, temperature, device
        self._start_schedule(seed, total_steps)
        self.model = load_policy(model_path, dtype, kernel_config, device, attn_implementation)
        added = self._extend(self.model)
        self.routers = RouterBalance.of(self.model, config.router_aux_loss_coef)
        # LoRA: the adapters go in after the kernels; self.model stays the transformers model (with them inside);
        # what _extend added trains whole beside them
        self.trained_whole = owning_modules(added) if config.lora.enabled else ()
        self.adapters = attach_lora(self.model, config.lora, whole=self.trained_whole) if config.lora.enabled else None
        if trained_dtype(dtype, config.mixed_precision) != dtype:  # fp32 masters of the trained parameters
            initial = None if self.adapters else stored_fp32_weights(model_path)
            if initial is not None:  # the checkpoint has no values for what _extend added: the model's own
                initial.update({name: p for name, p in self.model.named_parameters() if name in added})
            self.master = MasterWeights(self.model, initial)
        self.batching = resolve_batching(self.model, config.micro_batching)
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        trained = self.master.parameters() if self.master is not None else \
            [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay)
        if distill is not None:
            self.distill_coef = distill.coef
            self.teacher = load_policy(distill.teacher_path, dtype, kernel_config, device, attn_implementation)
            self.teacher.eval().requires_grad_(False)

    def _extend(self, model) -> list[str]:
        """Modules a role adds to the loaded model before anything else (the critic's value head), trained and
        checkpointed with it (with LoRA too: whole, beside the adapters); the names of the parameters added. The
        actor adds none."""
        return []

    @contextmanager
    def _scoring(self):
        """Eval mode while computing log-probs (LoRA dropout off), training mode after."""
        self.model.eval()
        try:
            yield
        finally:
            self.model.train()

    def compute_logprobs(self, batch: TensorDict) -> torch.Tensor:
        """π_old's log-probs (with routing replay, R3, on the rollout's routing, as the update's)."""
        with self._scoring():
            return self._logprobs(batch, around=self._replaying)

    def _logprobs(self, batch: TensorDict, around=None) -> torch.Tensor:
        """The response log-probs of this strategy (FSDPActorWorker: sharded, on rank 0), each micro-batch's forward
        in around(micro) where given."""
        return response_logprobs(self.model, batch, self.temperature, self.batching, around=around)

    def compute_ref_logprobs(self, batch: TensorDict) -> torch.Tensor:
        """The reference policy's log-probs with actor.lora on: this model with its adapters disabled, i.e. the
        frozen base it started from (what a ReferenceWorker would hold, without a second copy; its own routing)."""
        if self.adapters is None:
            raise RuntimeError("compute_ref_logprobs needs actor.lora.rank > 0; without LoRA the reference is a "
                               "ReferenceWorker")
        with adapters_disabled(self.model), self._scoring():
            return self._logprobs(batch)

    def _start_schedule(self, seed: int, total_steps: int | None) -> None:
        self.seed, self.schedule, self.updates = seed, LRSchedule.of(self.config, total_steps), 0

    def update(self, batch: TensorDict, step: int = 0) -> dict:
        """actor.ppo_epochs passes over `batch` in mini-batches (an optimizer step each; with more than one
        mini-batch the rows are shuffled every pass, seeded by the RL step), at this update's learning rate.
        Returns the metrics averaged over the optimizer steps, and actor/lr. Random draws in the update (LoRA
        dropout) are seeded by (trainer.seed, step), so a resumed run replays them.

        A batch without old_logprobs is on-policy (algorithm.old_logprobs=update): π_old is the policy being trained,
        which holds for one optimizer step only; the result then also holds "old_logprobs", the [B, R] log-probs of
        the update's own forward (on the CPU, 0 where masked)."""
        torch.manual_seed(self.seed * 1_000_003 + step * 101 + 17)
        size = batch.batch_size[0]
        mini = self.config.mini_batch_size or size
        on_policy = "old_logprobs" not in batch.keys()
        if on_policy and (self.config.ppo_epochs > 1 or mini < size):
            raise ValueError(f"a batch without old_logprobs trains on-policy, one optimizer step, but "
                             f"actor.ppo_epochs={self.config.ppo_epochs} and actor.mini_batch_size={mini} over "
                             f"{size} responses make more")
        self.update_logprobs = [] if on_policy else None
        result = self._train(batch, step, "actor")
        if on_policy:
            result["old_logprobs"] = self._assemble_rows(batch, self.update_logprobs)
        release_cached_memory()   # the step's last GPU work here: the colocated engine wakes next
        return result

    def _train(self, batch: TensorDict, step: int, prefix: str) -> dict[str, float]:
        """config.ppo_epochs passes of _optimizer_step over `batch`'s mini-batches at this update's learning rate;
        the metrics averaged over the optimizer steps, and the rate, as `prefix`/name."""
        size = batch.batch_size[0]
        mini = self.config.mini_batch_size or size
        lr = self.config.lr * self.schedule.factor(self.updates)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        totals: dict[str, float] = {}
        steps = 0
        for epoch in range(self.config.ppo_epochs):
            rows = batch if mini >= size else batch[minibatch_order(size, self.seed, step, epoch)]
            for mini_batch in split(rows, mini):
                for key, value in self._optimizer_step(mini_batch).items():
                    totals[key] = totals.get(key, 0.0) + value
                steps += 1
        self.updates += 1
        return {**{f"{prefix}/{k}": v / steps for k, v in totals.items()}, f"{prefix}/lr": lr}

    def _optimizer_step(self, mini_batch: TensorDict) -> dict[str, float]:
        accumulation = LossAccumulation.of(self.loss.loss_agg, mini_batch["response_mask"], self.loss.norm_len)
        n_tokens = max(accumulation.tokens, 1)
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "entropy": 0.0, "ppo_kl": 0.0, "clipfrac": 0.0, "ref_kl": 0.0}
        rows, micros = self._micro_batches(mini_batch)
        routed_tokens = max(scored_tokens(mini_batch), 1)   # MoE: the routers' loss weighs micro-batches by these
        for i, micro in enumerate(micros):
            micro_seqs = int((micro["response_mask"].sum(1) > 0).sum())
            # MoE: the micro-batch's share of the routers' loss (a sequence group's ranks hold a slice each)
            share = scored_tokens(micro) / routed_tokens / (self.sequence_parallel.size if self.sequence_parallel
                                                             else 1)
            with self._routing(micro, share) as routing:
                out, kl_sum, logprobs, micro_tokens = self._policy_loss(micro, accumulation.options())
            for key, value in routing.items():
                sums[key] = sums.get(key, 0.0) + value * share
            if self.update_logprobs is not None and i < len(rows):  # on-policy: π_old's log-probs, for the trainer
                self.update_logprobs.append((rows[i], logprobs.cpu()))
            scale = accumulation.weight(micro.batch_size[0], micro_seqs)
            loss = out.loss * scale
            if kl_sum is not None:  # the exact reverse KL to the teacher, a token mean over the mini-batch
                loss = loss + self.distill_coef * kl_sum / n_tokens
                sums["distill_kl"] = sums.get("distill_kl", 0.0) + kl_sum.item() / n_tokens
            loss.backward()
            sums["loss"] += out.loss.item() * scale
            for key in ("entropy", "ppo_kl", "clipfrac", "ref_kl"):  # token means -> weight by tokens
                sums[key] += out.metrics[key] * micro_tokens / n_tokens
        return self._step(sums)

    def _step(self, sums: dict[str, float]) -> dict[str, float]:
        """After a mini-batch's backward passes: clip, step, refresh the model from the fp32 masters; `sums` (this
        rank's metric sums) summed over the ranks, with the gradient norm."""
        grad_norm = self._clip_grad_norm()
        self.optimizer.step()
        if self.master is not None:
            self.master.copy_to_model()
        sums = self._sum_over_ranks(sums)
        sums["grad_norm"] = float(grad_norm)
        return sums

    def _policy_loss(self, micro: TensorDict, norm: dict):
        """(fused_policy_loss of one micro-batch, on its packed row (cu_seqlens) or its padded rows; with a teacher
        the summed reverse KL to it, else None; the response tokens' log-probs [b, R'] as rows; the response tokens
        the loss scored). GSPO's sequence ratio takes rows: its packed hidden states are gathered into them (one
        [B, R, H] copy). Without old_logprobs the loss is on-policy (fused_policy_loss's old_logprobs=None). Under
        sequence parallelism the loss is this rank's slice's part of the row's: its tokens weighted as the whole
        row's aggregation weighs them (loss_weights), and the tokens scored are the slice's."""
        loss_cfg = self.loss
        options = {**loss_cfg.kernel_options(), "temperature": self.temperature, **norm}
        keys = micro.keys()
        fields = [micro["response_ids"], micro["response_mask"], weighted_advantages(micro),
                  micro["old_logprobs"] if "old_logprobs" in keys else None,
                  micro["ref_logprobs"] if "ref_logprobs" in keys else None]
        packing = Packing.of(micro, self.sequence_parallel) if self.batching.packed else None
        to_rows = packing is not None and loss_cfg.importance_level == "sequence"
        if packing is not None and not to_rows:
            ids, mask, *values = fields
            fields = [packing.labels(ids, mask), packing.tokens(mask)] + \
                     [None if v is None else packing.tokens(v.float()) for v in values]
            if packing.sequence_parallel is None:
                options["cu_seqlens"] = packing.cu_seqlens
            else:
                weights = aggregation_weights(packing.row_tokens(mask).float(), PolicyLossOptions(**options),
                                              packing.cu_seqlens)
                options["loss_weights"] = packing.local(weights)
        tokens = (fields[1] != 0).sum().item()

        def head(hidden, weight):
            out = fused_policy_loss(packing.response_rows(hidden) if to_rows else hidden, weight, *fields, **options)
            return out, None if self.teacher is None else self._teacher_kl(micro, packing, hidden, weight)

        out, kl_sum = self._run_head(micro, packing, head)
        return out, kl_sum, out.logprobs if packing is None or to_rows else packing.rows(out.logprobs), tokens

    def _routing(self, micro: TensorDict, weight: float):
        """Around a micro-batch's forward: an MoE policy's routers weigh their loss by `weight` (the micro-batch's
        share of the mini-batch's tokens), replay the rollout's routing (actor.router_replay.mode=R3) and record
        their metrics into the yielded dict (empty for a dense policy)."""
        if self.routers is None:
            return nullcontext({})
        mask = None if self.batching.packed else scored_token_mask(micro)
        replay = replay_tokens(micro, self.batching.packed) \
            if self.config.router_replay.mode == "R3" and ROUTING[0] in micro.keys() else None
        return self.routers.micro_batch(weight, mask, replay)

    def _replaying(self, micro: TensorDict):
        """Around a micro-batch's forward for π_old's log-probs: the update's routing replay, no loss."""
        return self._routing(micro, 0.0)

    def _teacher_kl(self, micro: TensorDict, packing: Packing | None, hidden: torch.Tensor,
                    weight: torch.Tensor) -> torch.Tensor:
        """Σ over the micro-batch's response tokens of KL(π ‖ π_teacher) at the sampling temperature, from both
        models' hidden states in the same layout (packed row or padded rows), no logits materialised."""
        labels = response_labels(micro, packing)
        with torch.no_grad():
            teacher_hidden = policy_hidden(self.teacher, micro, packing)
        return linear_kl_div(hidden, weight, teacher_hidden, self.teacher.get_output_embeddings().weight,
                             temperature=self.temperature, reduction="sum", direction="reverse", labels=labels,
                             ignore_index=IGNORE_INDEX)

    # the four steps FSDPActorWorker (below) does differently: this rank's micro-batches, the model + loss head
    # inside the sharded root's forward, the global gradient norm, metrics summed over ranks
    def _micro_batches(self, mini_batch: TensorDict) -> tuple[list[torch.Tensor], list[TensorDict]]:
        """(each micro-batch's row indices in mini_batch, the micro-batches on the device)."""
        groups = self.batching.groups(mini_batch)
        return groups, [self.batching.take(mini_batch, rows).to(self.device) for rows in groups]

    def _assemble_rows(self, batch: TensorDict, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """[B, R] fp32 from (row indices, values [rows, ≤ R]) parts, 0 where the response mask is."""
        return assemble_rows(batch, parts)

    def _run_head(self, micro: TensorDict, packing: Packing | None, head):
        """head(hidden states, LM head weight) for one micro-batch (policy_hidden's layout)."""
        return head(policy_hidden(self.model, micro, packing), self.model.get_output_embeddings().weight)

    def _clip_grad_norm(self) -> torch.Tensor:
        trained = [p for group in self.optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(trained, self.config.grad_clip)

    def _sum_over_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        return sums

    def model_shape(self) -> ModelShape:
        """What perf/actor_mfu counts FLOPs with (rltrain/perf.py); under FSDP2 the full model's counts."""
        return ModelShape.of(self.model)

    def pushed_weights(self) -> dict[str, torch.Tensor]:
        """What the weight push sends: the state_dict (a tied weight once), or with LoRA the adapter parameters only."""
        return untied_state_dict(self.model) if self.adapters is None else adapter_weights(self.model)

    def bucket_names(self, bucket_mb: int) -> list[list[str]]:
        """pushed_weights' names in buckets of about bucket_mb MB, for the weight push (same on every rank)."""
        return plan_buckets(self.pushed_weights(), bucket_mb)

    def full_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Full tensors of these pushed_weights entries on the model's device (here: the parameters themselves).
        The weight push exports one bucket of bucket_names at a time (rltrain/workers/weight_sync.py)."""
        state = self.pushed_weights()
        return {name: state[name].detach() for name in names}

class FSDPActorWorker(ShardedPolicy, ActorWorker):
    """ActorWorker whose model is sharded across the ranks of its WorkerGroup (rltrain/workers/fsdp.py says how)."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, config: ActorConfig,
                 loss: LossConfig, model_path: str, dtype: str, kernel_config: KernelConfig | None, temperature: float,
                 device: str = "cpu", seed: int = 0, attn_implementation: str = "auto", total_steps: int | None = None):
        set_threads(config.torch_threads)
        torch.manual_seed(seed)
        self.config, self.loss, self.temperature = config, loss, temperature
        self._start_schedule(seed, total_steps)
        self.compute_dtype = DTYPES[dtype]  # the weight push sends model.dtype tensors, as the single process does
        self.model_path = model_path
        weights = trained_dtype(dtype, config.mixed_precision)
        # LoRA: the base loads in model.dtype and stays frozen; the adapters, in the trained dtype, go in before
        # sharding (after the kernels, as in the single process), so the base is sharded too
        lora = config.lora.enabled

        def prepare(model):
            added = self._extend(model)
            self.routers = RouterBalance.of(model, config.router_aux_loss_coef)
            if lora:
                self.trained_whole = owning_modules(added)
                self.adapters = attach_lora(model, config.lora, DTYPES[weights], whole=self.trained_whole)

        self._setup(rank, world_size, master_addr, master_port, model_path, dtype if lora else weights, kernel_config,
                    device, config.fsdp, config.micro_batching, attn_implementation, config.gradient_checkpointing,
                    compute_dtype=dtype, prepare=prepare,
                    sequence_parallel_size=config.ulysses_sequence_parallel_size,
                    expert_parallel_size=config.expert_parallel_size)
        self.model.train()
        trained = [p for p in self.root.parameters() if p.requires_grad]
        # expert parallelism: the experts (DTensors over their replicas) in a group of their own, as foreach steps
        # take one mesh at a time
        experts = {id(p) for p in self._expert_parameters()}
        groups = [group for group in ([p for p in trained if id(p) not in experts],
                                      [p for p in trained if id(p) in experts]) if group]
        self.optimizer = torch.optim.AdamW([{"params": group} for group in groups], lr=config.lr,
                                           weight_decay=config.weight_decay)

    def _expert_parameters(self) -> list[torch.nn.Parameter]:
        """The experts' parameters under expert parallelism (else none)."""
        names = self.expert_parallel.names if self.expert_parallel is not None else ()
        return [p for name, p in self.model.named_parameters() if name in names]

    def _logprobs(self, batch: TensorDict, around=None) -> torch.Tensor | None:
        return self._sharded_logprobs(batch, self.temperature, around=around)

    def update(self, batch: TensorDict, step: int = 0) -> dict | None:
        metrics = super().update(batch, step)
        return metrics if self.rank == 0 else None

    def _micro_batches(self, mini_batch: TensorDict) -> tuple[list[torch.Tensor], list[TensorDict]]:
        return self._rank_micro_batches(mini_batch)

    def _assemble_rows(self, batch: TensorDict, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        return self._gather_rows(batch, parts)

    def _run_head(self, micro: TensorDict, packing, head):
        return self.root(micro, packing, head)

    def _clip_grad_norm(self) -> torch.Tensor:
        params = [p for p in self.root.parameters() if p.grad is not None]
        if self.expert_parallel is not None:   # the dense part and the experts live on different meshes
            experts = {id(p) for p in self._expert_parameters()}
            parts = [[p for p in params if id(p) not in experts], [p for p in params if id(p) in experts]]
            norm = self.expert_parallel.grad_norm(*[[p.grad for p in part] for part in parts], self.device)
            for part in parts:
                torch.nn.utils.clip_grads_with_norm_(part, self.config.grad_clip, norm)
            return norm
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = norm.to(self.device).full_tensor() if isinstance(norm, DTensor) else norm
        torch.nn.utils.clip_grads_with_norm_(params, self.config.grad_clip, norm)
        return norm

    def _step(self, sums: dict[str, float]) -> dict[str, float]:
        if not self.fsdp.optimizer_offload:
            return super()._step(sums)
        move_optimizer_state(self.optimizer, self.device)   # on the GPU for the step alone
        try:
            return super()._step(sums)
        finally:
            move_optimizer_state(self.optimizer, "cpu")

    def _sum_over_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        values = torch.tensor(list(sums.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(values)
        return dict(zip(sums, values.tolist()))

    # ------------------------------------------------------------------ full weights and checkpoints
    def full_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Full model.dtype tensors of these entries on every rank (a collective: every rank calls it with the same
        names); the fp32 shards are cast before the all-gather, which then moves half the bytes."""
        return self._full_tensors(names, self.compute_dtype)

    def _full_tensors(self, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        return {name: self.gathered(name, state[name].detach(), dtype) for name in names}

    def gathered(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor of the parameter `name` (its value or its gradient) on every rank, in `dtype` where
        given (a collective); an expert-parallel experts tensor gathered over its groups too."""
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if not isinstance(tensor, DTensor):
            return tensor
        # CPU-offloaded shards go to the GPU for the all-gather (NCCL gathers device tensors only)
        tensor = tensor.to(self.device)
        if self.expert_parallel is not None and name in self.expert_parallel.names:
            return self.expert_parallel.full_tensor(tensor)
        return tensor.full_tensor()

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        full = {name: tensor.cpu() for name, tensor in self._full_tensors(list(self.model.state_dict())).items()}
        return full if self.rank == 0 else None

    def optimizer_state(self) -> dict | None:
        if self.expert_parallel is not None:   # get_optimizer_state_dict knows one mesh: gathered by name here
            return self._gathered_optimizer_state()
        state = get_optimizer_state_dict(self.model, self.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return keyed_by_index(state, self._param_names()) if self.rank == 0 else None

    def _gathered_optimizer_state(self) -> dict | None:
        """optimizer_state under expert parallelism: every state tensor gathered (a collective), in the single
        process's layout (one group of every trained parameter, by named_parameters index)."""
        names = self._param_names()
        index, per_param = {name: i for i, name in enumerate(names)}, {}
        for key, tensor in super()._optimizer_checkpoint_state().items():
            name, field = key.rsplit(".", 1)
            per_param.setdefault(index[name], {})[field] = self.gathered(name, tensor).cpu()
        group = {k: v for k, v in self.optimizer.state_dict()["param_groups"][0].items() if k != "params"}
        return {"state": per_param, "param_groups": [dict(group, params=list(range(len(names))))]} \
            if self.rank == 0 else None

    def _model_checkpoint_state(self) -> dict[str, torch.Tensor]:
        state = super()._model_checkpoint_state()
        return state if self.expert_parallel is None else self.expert_parallel.global_views(state)

    def _optimizer_checkpoint_state(self) -> dict[str, torch.Tensor]:
        state = super()._optimizer_checkpoint_state()
        return state if self.expert_parallel is None else self.expert_parallel.global_views(state, suffix=True)

    def pushed_weights(self) -> dict[str, torch.Tensor]:
        state = super().pushed_weights()   # the experts' full shapes, for bucket_names' sizes
        return state if self.expert_parallel is None else self.expert_parallel.global_views(state)

    def save_pretrained(self, path: str) -> None:
        if self.adapters is not None:  # the adapters alone, gathered (in the trained dtype), in PEFT's format
            adapters = self._full_tensors(list(adapter_weights(self.model)))
            if self.rank == 0:
                save_peft_adapter(path, adapters, self.config.lora, self.model_path)
            return
        state = self.state_dict()  # every rank gathers; rank 0 holds the full weights and writes them
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=state)

    def _param_names(self) -> list[str]:
        """The trained parameters' names, in the optimizer's order."""
        return [name for name, param in self.model.named_parameters() if param.requires_grad]
