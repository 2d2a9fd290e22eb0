"""Rollout replicas: one rollout engine per tensor-parallel group over all of the model roles' placement bundles,
driven by the controller like one rollout worker (`RolloutReplicas`: generate, sleep, the weight update, resume).

Layout (verl's). On GPU the trainer.nnodes × n_gpus_per_node bundles hold one GPU each; rollout.tensor_parallel_size
= tp divides n_gpus_per_node, and replica i spans bundles [i·tp, (i+1)·tp): one RolloutWorker process per bundle,
colocated with the actor (and reference) rank of that bundle and asking the same fraction of its GPU, so there are
world_size / tp replicas. On CPU, rollout.replicas = R engines of one process each: replica i < world_size sits in
bundle i, colocated like on GPU (the roles take turns: the engine waits while the actor trains), and the replicas
beyond the bundles reserve one more CPU each, in a placement group of their own (PACK; reserved like the model
roles' groups, so a cluster that cannot hold them gives a PlacementError naming rollout.replicas, never a hang).
Two replicas thus run side by side on a 2-CPU machine beside one trainer rank. With rollout.torch_threads = 0, CPU
replicas take cores / R threads each instead of all cores, so that they do not oversubscribe the machine.
rollout.placement=separate (`place_rollout`): the replicas get devices of their own, rollout.replicas placement groups
of rollout.tensor_parallel_size GPUs (one CPU on CPU runs) beside the model roles', so the engines can generate while
the actor trains (trainer.mode one_step_off / async); a CPU replica then takes one thread (rollout.torch_threads = 0),
and the engines never sleep (nothing else uses their memory). The weights reach them through host memory.

Generation. A step's prompts are cut into contiguous runs, as even as possible, one per replica: all n responses of
a prompt stay on one engine, whose prefix cache then holds the prompt once. Every process of a replica gets the same
call (vLLM's external_launcher runs the TP ranks in lockstep) and rank 0's result is kept; the replicas' results are
concatenated back in prompt order, group_ids numbering the prompts of the whole batch. Each replica is told where its
run starts (first_prompt), so its seeds are the batch's (rltrain/workers/rollout.py): vLLM seeds each response by
its index in the batch, the same whatever replica runs it; the hf engine seeds one stream per call, so it replays
exactly for a fixed layout.

Weights. Every process takes every bucket (rltrain/workers/weight_sync.py: by CUDA IPC from the actor rank on its
GPU, or through the object store). Processes are numbered replica-major (process j = replica j // tp, TP rank
j % tp), which on GPU is also their bundle, so process j shares its GPU with actor rank j.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from rltrain_kernels.registry import KernelConfig
from tensordict import TensorDict

from rltrain.workers.batch import concat_batches, group_ids
from rltrain.workers.group import Placement, PlacementError, cluster_summary, rendezvous_address, reserve
from rltrain.workers.lora import LoraConfig
from rltrain.workers.rollout import RolloutConfig, RolloutWorker

logger = logging.getLogger(__name__)

PARTIAL_POLL_S = 0.05   # rollout.partial: how often a generation in flight checks for newer weights


def replica_bundles(world_size: int, tensor_parallel_size: int, replicas: int, device: str) -> list[list[int | None]]:
    """Each replica's processes as placement bundles (None: a CPU reserved beyond the model roles' bundles)."""
    if device == "cuda":
        tp = tensor_parallel_size
        return [list(range(i * tp, (i + 1) * tp)) for i in range(world_size // tp)]
    return [[i if i < world_size else None] for i in range(replicas)]


def split_prompts(num_prompts: int, replicas: int) -> list[tuple[int, int]]:
    """[start, stop) of each replica's prompts: contiguous runs in order, sizes differing by at most one."""
    base, larger = divmod(num_prompts, replicas)
    bounds, start = [], 0
    for i in range(replicas):
        stop = start + base + (i < larger)
        bounds.append((start, stop))
        start = stop
    return bounds


def reserve_cpus(count: int, world_size: int, replicas: int, timeout_s: float) -> PlacementGroup:
    """A placement group of `count` one-CPU bundles for the CPU replicas beyond the model roles' bundles."""
    asked = (f"rollout.replicas={replicas}: the {count} replica(s) beyond the trainer.nnodes × "
             f"trainer.n_gpus_per_node = {world_size} bundle(s) ask for a CPU each")
    cpus = sum(node["Resources"].get("CPU", 0) for node in ray.nodes() if node.get("Alive"))
    if cpus < world_size + count:
        raise PlacementError(f"{asked}, {world_size + count} CPUs in all, but the cluster has {cpus:g}; "
                             f"it has {cluster_summary()}")
    group = placement_group([{"CPU": 1}] * count, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementError(f"{asked}; they could not be reserved within ray.placement_timeout_s={timeout_s:g} s "
                             f"(CPUs held by other jobs?). Available now: {ray.available_resources()}; the cluster "
                             f"has {cluster_summary()}")
    return group


def place_rollout(config: RolloutConfig, device: str, timeout_s: float) -> Placement:
    """rollout.placement=separate: rollout.replicas placement groups of rollout.tensor_parallel_size one-GPU (one-CPU)
    bundles of the rollout's own, or a PlacementError naming the keys."""
    resource, tp = ("GPU" if device == "cuda" else "CPU"), config.tensor_parallel_size
    asked = (f"rollout.placement=separate with rollout.replicas={config.replicas} × rollout.tensor_parallel_size={tp} "
             f"asks for {config.replicas} placement group(s) of {tp} {resource} beside the model roles' "
             f"(trainer.device resolved to {device})")
    return reserve(config.replicas, tp, resource, asked, timeout_s)


class RolloutReplicas:
    """The rollout role: replicas of RolloutWorker processes (see the module docstring). Methods block until every
    process is done."""

    def __init__(self, config: RolloutConfig, placement: Placement, share: float, timeout_s: float, *,
                 model_path: str, dtype: str, kernel_config: KernelConfig | None, device: str,
                 attn_implementation: str = "auto", lora: LoraConfig | None = None, logprobs: bool = False,
                 routing: bool = False):
        """`share` of each bundle's GPU (or CPU) per colocated process (rollout.placement=separate: `placement` is
        place_rollout's, share 1); timeout_s: ray.placement_timeout_s; lora: actor.lora (the engines hold the same
        adapters, and the push sends only them); logprobs: the hf engine reports rollout_logprobs too; routing: it
        records an MoE policy's routing (actor.router_replay.mode=R3)."""
        layout = replica_bundles(placement.world_size, config.tensor_parallel_size, config.replicas, device)
        self.separate = config.placement == "separate"
        if device != "cuda" and config.torch_threads == 0 and (len(layout) > 1 or self.separate):
            threads = 1 if self.separate else max(1, (os.cpu_count() or 1) // len(layout))
            config = dataclasses.replace(config, torch_threads=threads)
        extra = sum(bundle is None for bundles in layout for bundle in bundles)
        self.extra_cpus = reserve_cpus(extra, placement.world_size, len(layout), timeout_s) if extra else None
        # rollout.partial on the async engine: a weight update arrives while generate_partial runs, on a second thread
        interruptible = config.partial and config.engine == "vllm" and config.mode == "async"
        worker = ray.remote(max_concurrency=2)(RolloutWorker) if interruptible else ray.remote(RolloutWorker)
        next_extra = 0
        self.replicas: list[list[ray.actor.ActorHandle]] = []
        for bundles in layout:
            rendezvous = None
            if len(bundles) > 1:
                address, port = ray.get(rendezvous_address.options(**placement.options(bundles[0], 0)).remote())
                rendezvous = dict(world_size=len(bundles), master_addr=address, master_port=port)
            processes = []
            for rank, bundle in enumerate(bundles):
                if bundle is None:
                    strategy = PlacementGroupSchedulingStrategy(self.extra_cpus,
                                                                placement_group_bundle_index=next_extra)
                    options, next_extra = dict(scheduling_strategy=strategy, num_cpus=1), next_extra + 1
                else:
                    options = placement.options(bundle, share)
                tensor_parallel = dict(rendezvous, rank=rank) if rendezvous else None
                processes.append(worker.options(**options).remote(
                    config, model_path, dtype, kernel_config, device, attn_implementation, tensor_parallel, lora,
                    logprobs, routing))
            self.replicas.append(processes)
        logger.info("rollout: %d replica(s) of %d process(es) (%s engine) on %s", len(self.replicas),
                    len(layout[0]), config.engine, device)

    @property
    def processes(self) -> list:
        """Every process, replica-major (process j = replica j // tp, TP rank j % tp)."""
        return [process for processes in self.replicas for process in processes]

    def _on_every_process(self, name: str, *args) -> list:
        return ray.get([getattr(process, name).remote(*args) for process in self.processes])

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float,
                 seed: int, max_new_tokens: int | None = None, rows: list[dict] | None = None) -> TensorDict:
        """n responses per prompt, grouped consecutively in prompt order; group_ids[i] = index of the prompt.
        max_new_tokens: this call's limit instead of rollout.max_new_tokens (the hf engine's partial segments);
        rows: the prompts' data rows, for an environment (split with the prompts)."""
        calls = []
        for (start, stop), processes in zip(split_prompts(prompt_ids.shape[0], len(self.replicas)), self.replicas):
            if stop > start:
                ids, mask = prompt_ids[start:stop], prompt_mask[start:stop]
                extra = {"max_new_tokens": max_new_tokens} if max_new_tokens is not None else \
                    {"rows": rows[start:stop]} if rows is not None else {}
                calls.append([p.generate.remote(ids, mask, n, temperature, seed, start, **extra) for p in processes])
        results = ray.get([ref for refs in calls for ref in refs])  # submitted together: the replicas run at once
        per_replica = len(calls[0])
        batch = concat_batches(results[::per_replica])
        batch["group_ids"] = group_ids(batch.batch_size[0], n)
        return batch

    def generate_partial(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float,
                         seed: int, refresh: Callable[[], int]) -> TensorDict:
        """rollout.partial on the async engine: generate()'s batch plus token_versions, every response one request
        that runs until it ends. refresh() -> the version the engines hold, loading newer weights first if any are
        out (RolloutProducer.refresh): called before the requests start and every PARTIAL_POLL_S while they run, so
        that a push aborts them and they resume on the new weights (rltrain/workers/interruptible.py)."""
        version, calls = refresh(), []
        for (start, stop), processes in zip(split_prompts(prompt_ids.shape[0], len(self.replicas)), self.replicas):
            if stop > start:
                calls.append([p.generate_partial.remote(prompt_ids[start:stop], prompt_mask[start:stop], n,
                                                        temperature, seed, start, version) for p in processes])
        refs = [ref for refs in calls for ref in refs]
        pending = refs
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=PARTIAL_POLL_S)
            if pending:
                refresh()
        results = ray.get(refs)
        batch = concat_batches(results[::len(calls[0])])
        batch["group_ids"] = group_ids(batch.batch_size[0], n)
        return batch

    def sleep(self) -> None:
        """Free the engines' memory while the actor trains: colocated only (separate engines keep theirs)."""
        if not self.separate:
            self._on_every_process("sleep")

    def device_infos(self) -> list[tuple[str, str] | None]:
        """Each process's GPU (uuid, name), or None on CPU."""
        return self._on_every_process("device_info")

    def begin_weight_update(self) -> None:
        self._on_every_process("begin_weight_update")

    def load_buckets(self, buckets: list[ray.ObjectRef]) -> list[str]:
        """Process j loads buckets[j] (an actor rank's ExportedBucket); the routes taken, "ipc" or "host"."""
        return ray.get([process.load_bucket.remote(bucket) for process, bucket in zip(self.processes, buckets)])

    def finish_weight_update(self, version: int | None = None) -> None:
        """version: the weights' (trainer.mode=async's snapshots), for partial rollouts' token versions."""
        self._on_every_process("finish_weight_update", version)

    def kill(self) -> None:
        for process in self.processes:
            ray.kill(process)
        if self.extra_cpus is not None:
            remove_placement_group(self.extra_cpus)
            self.extra_cpus = None
