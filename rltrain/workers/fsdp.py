"""FSDP2 for the actor and reference (`actor.strategy=fsdp2`): the `actor.fsdp` config (FSDPConfig), joining the
process group, sharding a policy, each rank's share of a batch, and `ShardedPolicy`, what both sharded roles share.
The roles themselves sit beside their single-process counterparts: `FSDPActorWorker` in rltrain/workers/actor.py,
`FSDPReferenceWorker` in rltrain/workers/reference.py (they subclass those and import this module, which imports
neither).

One rank per placement-group bundle (rltrain/workers/group.py), the model sharded with torch's `fully_shard` (each
decoder layer a unit, the rest in the root), data parallel over the ranks. `actor.fsdp.fsdp_size` (verl's name) shards
within groups of that many ranks and replicates across the groups (HSDP: a 2-D mesh, replicate × shard): each
parameter's all-gather stays inside a group (one node, say) and only the gradients cross groups. Every rank receives the whole batch and
takes its own share of the rows (contiguous rows, or, with packed micro-batches, a share balanced by tokens:
rltrain/workers/packing.py). With `actor.ulysses_sequence_parallel_size` > 1 the ranks are a data × sequence mesh:
each data rank takes a share of the rows and the ranks of its sequence group split each packed row's tokens
(rltrain/workers/ulysses.py), FSDP2 still sharding over all ranks. With `actor.expert_parallel_size` > 1 (the actor
only) groups of ranks split an MoE policy's experts, each experts module an FSDP2 unit over the ranks holding the same
experts (rltrain/workers/expert_parallel.py).

Gradients equal the single-process ones: every normaliser (token count, sequence count, rows) is the mini-batch's
global one, which each rank computes from the whole batch, the per-rank losses are partial sums of the global loss,
and the reduce-scatter sums (divide factor 1) instead of averaging. FSDP's collectives must pair up across ranks, so
each rank runs as many micro-batches as the rank with the most, padding with one-row micro-batches whose response
mask is zero (loss and gradient 0). The model and the loss head run inside the forward of the sharded root
(`PolicyWithHead`), so the embeddings and the LM head weight are gathered while the loss uses them and no logits are
materialised. tests/rltrain/workers/test_fsdp.py checks the gradients against the single process over gloo.

Precision (actor.mixed_precision, rltrain/workers/precision.py): the actor's shards, gradients and optimizer state are
fp32, and each unit's gathered parameters are cast to model.dtype for the forward and backward (MixedPrecisionPolicy,
gradients reduced in fp32); the frozen reference is sharded in model.dtype itself. With LoRA (actor.lora) the actor
attaches its adapters before sharding: the frozen base is sharded in model.dtype and only the adapters are fp32.

Weights leave full: the trainer's weight push asks for `bucket_names(bucket_mb)` once, then exports each bucket
(rltrain/workers/weight_sync.py): `full_weights(names)` gathers those DTensor shards (`full_tensor()`) on every rank,
and each rank hands them to the rollout process on its GPU by CUDA IPC (rank 0 also returns a host copy where a
rollout process needs one). Checkpoints do not gather: each rank writes its own shards with
torch.distributed.checkpoint, in the layout the single process writes too, and a resume on any world size or strategy
reads what its shards cover (ActorWorker.save_checkpoint / load_checkpoint, rltrain/distributed_checkpoint.py).

Known cost: every rank loads the full model into CPU memory before sharding it (8 ranks of a 7B fp32 model: 8 × 28
GB of host memory for a moment); loading on the meta device with rank 0 broadcasting would remove it.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from rltrain_kernels.registry import KernelConfig
from tensordict import TensorDict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from rltrain.config import ConfigError, require
from rltrain.workers.expert_parallel import ExpertParallel
from rltrain.workers.packing import MicroBatching, balanced_groups, response_lengths, sequence_lengths
from rltrain.workers.policy import (DTYPES, assemble_rows, load_policy, micro_logprobs, policy_hidden,
                                    release_cached_memory, resolve_batching)
from rltrain.workers.ulysses import check_model, sequence_parallel_batching, sequence_parallel_group

logger = logging.getLogger(__name__)

# A rank that fails leaves its peers inside a collective; they give up after this long (torch's default is 30 min).
DIST_TIMEOUT_S = 600


@dataclass
class FSDPConfig:
    cpu_offload: bool = False      # keep the sharded params, grads and optimizer state in CPU memory (GPU only)
    param_offload: bool = False    # GPU: the sharded params (and grads) in CPU memory while the role is idle
    optimizer_offload: bool = False  # GPU: the optimizer state in CPU memory outside the optimizer step
    fsdp_size: int = -1            # ranks a parameter is sharded over; -1 = all (FSDP); else groups of this many
                                   # ranks each hold a full copy in shards, replicated across groups (HSDP)

    def validate(self):
        require(self.fsdp_size == -1 or self.fsdp_size >= 1, "fsdp_size", "must be -1 (all ranks) or >= 1",
                self.fsdp_size)
        require(not (self.cpu_offload and (self.param_offload or self.optimizer_offload)), "cpu_offload",
                "keeps the params and optimizer state in CPU memory all the time already; set it, or "
                "param_offload / optimizer_offload (in CPU memory only between phases), not both", self.cpu_offload)

    @property
    def offloads(self) -> list[str]:
        """The offload keys set (each needs a CUDA device)."""
        return [key for key in ("cpu_offload", "param_offload", "optimizer_offload") if getattr(self, key)]

    def mesh_shape(self, world_size: int) -> tuple[int, ...]:
        """The device mesh: (world_size,) for FSDP, (replicas, fsdp_size) for HSDP (fully_shard shards over the last
        dimension and replicates over the first)."""
        size = world_size if self.fsdp_size in (-1, world_size) else self.fsdp_size
        if world_size % size:
            raise ConfigError(f"actor.fsdp.fsdp_size: must divide the {world_size} ranks (got {size})")
        return (world_size,) if size == world_size else (world_size // size, size)


class PolicyWithHead(torch.nn.Module):
    """The FSDP root: the model up to the response hidden states, then `head(hidden, LM head weight)`, all in one
    forward, so the root's parameters (embeddings, final norm, LM head) are unsharded while they are used."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, micro: TensorDict, packing, head):
        return head(policy_hidden(self.model, micro, packing), self.model.get_output_embeddings().weight)


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, device: str,
                     mesh_shape: tuple[int, ...] | None = None):
    """Join the process group (nccl on GPU, gloo on CPU) unless this process already has, and return the device
    mesh of all ranks, 1-D or FSDPConfig.mesh_shape's (the actor and reference ranks in one process share the
    group)."""
    if device == "cuda":
        # Ray shows each rank only its own GPU; launchers that show every GPU set LOCAL_RANK
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        # on GPU, collectives of CPU tensors (CPU-offloaded shards and optimizer state) go over gloo
        dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", rank=rank,
                                world_size=world_size, init_method=f"tcp://{master_addr}:{master_port}",
                                timeout=timedelta(seconds=DIST_TIMEOUT_S))
    shape = mesh_shape or (world_size,)
    return init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard")[-len(shape):])


def shard_policy(model, mesh, device: str, config: FSDPConfig, compute_dtype: torch.dtype | None = None,
                 root: type[torch.nn.Module] = PolicyWithHead,
                 inner_units: tuple[tuple[torch.nn.Module, DeviceMesh], ...] = ()) -> torch.nn.Module:
    """fully_shard each decoder layer (the classes in the model's `_no_split_modules`), then the root, `root(model)`
    (PolicyWithHead; the reward model's ScoringRoot). With a
    compute_dtype other than some weights' (actor.mixed_precision: fp32 shards, model.dtype compute), each unit's
    gathered parameters are cast to it for the forward and backward, and gradients are reduced and kept in fp32
    (on CPU over gloo too). `inner_units`: (module, mesh) pairs sharded first as their own units, over their own
    mesh (expert parallelism's experts over their replicas, rltrain/workers/expert_parallel.py)."""
    # fp32 inputs (advantages, old log-probs) must reach the loss unrounded: no casting of forward inputs.
    # LoRA's fp32 adapters on a model.dtype base mix dtypes within a unit: FSDP2 asks one dtype of the trainable
    # parameters only, and casts every parameter to param_dtype (the base's own) before the all-gather
    if compute_dtype is not None and any(param.dtype != compute_dtype for param in model.parameters()):
        precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                         cast_forward_inputs=False)
    else:
        precision = MixedPrecisionPolicy(cast_forward_inputs=False)
    if config.offloads and device != "cuda":
        raise ConfigError(f"actor.fsdp.{config.offloads[0]}: needs a CUDA device (trainer.device resolved to "
                          f"{device})")
    offload = CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy()
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class in _no_split_modules; FSDP2 needs one")
    for module, unit_mesh in inner_units:
        fully_shard(module, mesh=unit_mesh, mp_policy=precision, offload_policy=offload)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=precision, offload_policy=offload)
    root = root(model)
    fully_shard(root, mesh=mesh, mp_policy=precision, offload_policy=offload)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            # sum the ranks' partial gradients, do not average them; plain SUM (gloo has no PREMUL_SUM)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root


def rank_micro_batches(batch: TensorDict, rank: int, world_size: int, batching: MicroBatching):
    """(this rank's micro-batches as row indices of `batch`, how many micro-batches every rank runs: the most any
    rank has). Rows go to ranks contiguously (sizes differ by at most one), or, packed, balanced by tokens; each
    rank then cuts its share as `batching` says."""
    if batching.packed:
        scored = (response_lengths(batch) > 0).nonzero().flatten()
        lengths = sequence_lengths(batch)[scored].tolist()
        shares = [scored[torch.tensor(g, dtype=torch.long)] for g in balanced_groups(lengths, world_size)]
    else:
        shares = list(torch.arange(batch.batch_size[0]).tensor_split(world_size))
    per_rank = [[share[g] for g in batching.groups(batch[share])] if len(share) else [] for share in shares]
    return per_rank[rank], max(len(groups) for groups in per_rank)


class ShardedPolicy:
    """What the FSDP2 actor and reference share: joining the group, loading and sharding, sharded log-probs."""

    sequence_parallel = None   # SequenceParallel: this rank's group sharing each packed row (ulysses.py), or None
    expert_parallel = None     # ExpertParallel: this rank's experts and their groups (expert_parallel.py), or None

    def _setup(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str, dtype: str,
               kernel_config: KernelConfig | None, device: str, fsdp: FSDPConfig, batching: MicroBatching,
               attn_implementation: str, checkpointing: bool = False, compute_dtype: str | None = None,
               prepare: Callable[[torch.nn.Module], None] | None = None, sequence_parallel_size: int = 1,
               expert_parallel_size: int = 1):
        """The model loaded in `dtype`; forward and backward in compute_dtype (default: the same). `prepare(model)`
        runs on the whole model before sharding (the actor's LoRA adapters go in there). sequence_parallel_size:
        actor.ulysses_sequence_parallel_size; expert_parallel_size: actor.expert_parallel_size (the actor's)."""
        self.rank, self.world_size, self.device = rank, world_size, device
        mesh = init_distributed(rank, world_size, master_addr, master_port, device, fsdp.mesh_shape(world_size))
        # the rows are shared by data rank: every rank of a sequence group gets the same ones
        self.data_rank, self.data_size = rank, world_size
        if sequence_parallel_size > 1:
            self.sequence_parallel, self.data_rank = sequence_parallel_group(rank, world_size, sequence_parallel_size,
                                                                             device)
            self.data_size = world_size // sequence_parallel_size
        self.model = load_policy(model_path, dtype, kernel_config, "cpu", attn_implementation)
        if prepare is not None:
            prepare(self.model)
        self.batching = resolve_batching(self.model, batching)
        if self.sequence_parallel is not None:
            if not self.batching.packed:
                raise ConfigError(f"actor.ulysses_sequence_parallel_size: splits packed rows, but "
                                  f"{type(self.model).__name__} runs padded ones (actor.use_remove_padding)")
            check_model(self.model, sequence_parallel_size)
            self.batching = sequence_parallel_batching(self.batching, sequence_parallel_size)
        if checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        inner_units = ()
        if expert_parallel_size > 1:
            self.expert_parallel = ExpertParallel(rank, world_size, expert_parallel_size, device)
            replicas = self.expert_parallel.replicas
            inner_units = tuple((module, replicas) for module in self.expert_parallel.shard(self.model))
        self.root = shard_policy(self.model, mesh, device, fsdp, DTYPES[compute_dtype or dtype],
                                 inner_units=inner_units)
        self.fsdp = fsdp
        if fsdp.param_offload:  # prepended: the shards return before FSDP's own pre-forward all-gathers them
            self.root.register_forward_pre_hook(self._reload_params, prepend=True)
        logger.info("rank %d/%d: sharded %s over %s", rank, world_size, type(self.model).__name__, device)

    # ------------------------------------------------------------------ param_offload / optimizer_offload
    params_offloaded = False

    def offload(self) -> None:
        """actor.fsdp.param_offload: this rank's shards (and gradients) to CPU memory, where they wait until the
        role's next forward brings them back (_reload_params), so that the colocated rollout engine has the GPU
        memory while the role is idle. Full weights and checkpoints read offloaded shards as they are (their
        collectives of CPU tensors go over gloo). A no-op without param_offload."""
        if self.fsdp.param_offload and not self.params_offloaded:
            self.root.to("cpu")   # FSDP2 re-registers the moved shards (FSDPModule._apply)
            self.params_offloaded = True
            release_cached_memory()

    def _reload_params(self, *_) -> None:
        if self.params_offloaded:
            self.root.to(self.device)
            self.params_offloaded = False

    def _rank_micro_batches(self, batch: TensorDict) -> tuple[list[torch.Tensor], list[TensorDict]]:
        """(this rank's row indices per micro-batch, its micro-batches on the device): as many as every rank runs,
        FSDP's collectives pairing up across ranks, padded with one-row micro-batches whose response mask is 0."""
        rows, count = rank_micro_batches(batch, self.data_rank, self.data_size, self.batching)
        micros = [self.batching.take(batch, r) for r in rows]
        if len(micros) < count:
            filler = self.batching.take(batch, torch.arange(1))
            filler["response_mask"] = torch.zeros_like(filler["response_mask"])
            micros += [filler] * (count - len(micros))
        return rows, [m.to(self.device) for m in micros]

    @torch.no_grad()
    def _sharded_logprobs(self, batch: TensorDict, temperature: float, around=None):
        """Response log-probs of the whole batch on rank 0 (None elsewhere), each rank computing its own rows.
        `around(micro)`: a context each micro-batch's forward runs in (the actor's routing replay)."""
        rows, micros = self._rank_micro_batches(batch)
        logps = []
        for micro in micros:
            with around(micro) if around is not None else nullcontext():
                logps.append(micro_logprobs(self.model, micro, self.batching.packed, temperature, head=self.root,
                                            sequence_parallel=self.sequence_parallel).float().cpu())
        logps = logps[:len(rows)]
        self.root.reshard()  # the root stays unsharded after a forward that no backward follows
        return self._gather_rows(batch, list(zip(rows, logps)))

    def _gather_rows(self, batch: TensorDict, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """Every rank's (row indices, values [rows, ≤ R]) parts as one [B, R] fp32 tensor on rank 0 (None
        elsewhere; a collective), 0 where the response mask is. A sequence group's ranks hold the same rows: its
        first rank's parts stand for them."""
        if self.sequence_parallel is not None and self.sequence_parallel.rank:
            parts = []
        width = batch["response_ids"].shape[1]
        values = [torch.nn.functional.pad(v.float().cpu(), (0, width - v.shape[1])) for _, v in parts]  # trimmed
        local = (torch.cat([r for r, _ in parts]) if parts else torch.zeros(0, dtype=torch.long),
                 torch.cat(values) if values else torch.zeros(0, width))
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        return assemble_rows(batch, gathered) if self.rank == 0 else None


def move_optimizer_state(optimizer: torch.optim.Optimizer, device) -> None:
    """Every tensor of the optimizer's state to `device` (actor.fsdp.optimizer_offload), but AdamW's step counts,
    which torch keeps on the CPU."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def keyed_by_index(state: dict, names: list[str]) -> dict:
    """get_optimizer_state_dict's name-keyed full optimizer state → torch.optim's own layout (parameter indices), as
    the single process's optimizer_state() returns it."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [dict(group, params=[index[n] for n in group["params"]])
                             for group in state["param_groups"]]}

