"""Where the model roles run: placement groups that reserve the cluster's GPUs (or CPUs), and worker groups of
Ray actors that form one torch.distributed process group (the FSDP2 actor and reference).

Placement: one STRICT_PACK placement group per node (trainer.nnodes of them), each holding trainer.n_gpus_per_node
one-GPU bundles (one-CPU bundles on CPU runs: each rank is then a process that reserves a CPU). Rank r of every role
lands in bundle r, so the actor, reference and rollout ranks with the same index share a GPU (colocated), each asking a
fraction of it (the rollout's processes: rltrain/workers/rollout_group.py). A request the cluster cannot hold fails with
PlacementError naming the keys and what the cluster has, at once when no set of nodes could ever hold it, else after
ray.placement_timeout_s: never a hang. The `ray` config section (RayConfig) says which Ray to use and that timeout.

Worker groups: `WorkerGroup(cls, placement, share, **kwargs)` starts `cls(rank=r, world_size=W, master_addr=...,
master_port=..., **kwargs)` on every bundle; rank 0's node address and a free port come from a task run in bundle 0.
`group.method.remote(*args)` calls the method on every rank (arguments are put in the object store once) and returns
rank 0's ObjectRef, so the controller drives a group exactly like a single Ray actor; `call_each_rank` returns every
rank's (the weight push: each rank exports to the rollout process on its GPU).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rltrain.config import ConfigError, require

logger = logging.getLogger(__name__)

PLACEMENTS = ("colocated", "separate")   # a role shares the model roles' bundles, or holds devices of its own


@dataclass
class RayConfig:
    address: str | None = None       # null = start a local Ray; "auto" or host:port joins a cluster
    num_cpus: int | None = None      # for the local Ray; null = all cores
    placement_timeout_s: float = 120.0  # wait this long for the cluster to hold the placement groups, then fail

    def validate(self):
        require(self.placement_timeout_s > 0, "placement_timeout_s", "must be > 0", self.placement_timeout_s)


class PlacementError(ConfigError):
    """The cluster cannot hold the resources the config asks for (a ConfigError: the entry point exits 2 with it)."""


def cluster_summary() -> str:
    """One line per alive node: its address and total resources (custom ones included)."""
    lines = []
    for node in ray.nodes():
        if node.get("Alive"):
            resources = {k: v for k, v in node["Resources"].items()
                         if not k.startswith(("node:", "memory", "object_store_memory", "accelerator_type"))}
            shown = ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items()))
            lines.append(f"  node {node['NodeManagerAddress']} ({node['NodeID'][:8]}): {shown}")
    return f"{len(lines)} alive node(s):\n" + "\n".join(lines)


@dataclass
class Placement:
    groups: list[PlacementGroup]   # one per node
    ranks_per_node: int
    resource: str                  # "GPU" or "CPU": what one bundle (one rank) holds one of

    @property
    def world_size(self) -> int:
        return len(self.groups) * self.ranks_per_node

    def options(self, rank: int, share: float) -> dict:
        """Ray actor/task options that put a process in rank `rank`'s bundle, asking `share` of its GPU (or CPU)."""
        group = self.groups[rank // self.ranks_per_node]
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank % self.ranks_per_node)
        amount = dict(num_gpus=share, num_cpus=0) if self.resource == "GPU" else dict(num_cpus=share)
        return dict(scheduling_strategy=strategy, **amount)

    def node_ids(self) -> list[str]:
        """The node each placement group landed on."""
        return [ray.util.placement_group_table(g)["bundles_to_node_id"][0] for g in self.groups]

    def remove(self) -> None:
        for group in self.groups:
            remove_placement_group(group)
        self.groups = []


def place_model_roles(nnodes: int, ranks_per_node: int, device: str, timeout_s: float) -> Placement:
    """Reserve nnodes × ranks_per_node bundles of one GPU (device cuda) or one CPU, or raise PlacementError."""
    resource = "GPU" if device == "cuda" else "CPU"
    asked = (f"trainer.nnodes={nnodes} × trainer.n_gpus_per_node={ranks_per_node} asks for {nnodes} placement "
             f"group(s) of {ranks_per_node} {resource} on one node each (trainer.device resolved to {device})")
    placement = reserve(nnodes, ranks_per_node, resource, asked, timeout_s)
    logger.info("placed %d rank(s) on node(s) %s", placement.world_size,
                ", ".join(n[:8] for n in placement.node_ids()))
    return placement


def place_separate(key: str, ranks: int, device: str, timeout_s: float) -> Placement:
    """A role with `key`=separate: `ranks` one-GPU (one-CPU) bundles of its own on one node, beside the model roles'."""
    resource = "GPU" if device == "cuda" else "CPU"
    asked = (f"{key}=separate asks for a placement group of {ranks} {resource} of its own on one node "
             f"(trainer.device resolved to {device})")
    return reserve(1, ranks, resource, asked, timeout_s)


def reserve(count: int, per_group: int, resource: str, asked: str, timeout_s: float) -> Placement:
    """`count` STRICT_PACK placement groups of `per_group` one-`resource` bundles (a Placement over them), or a
    PlacementError starting with `asked` (what the config asks for, naming its keys)."""
    # nodes can hold several groups: count how many groups each node's total could ever hold
    fits = sum(int(node["Resources"].get(resource, 0) // per_group) for node in ray.nodes() if node.get("Alive"))
    if fits < count:
        raise PlacementError(f"{asked}, but the cluster could hold only {fits}; it has {cluster_summary()}")
    groups = [placement_group([{resource: 1}] * per_group, strategy="STRICT_PACK") for _ in range(count)]
    ready, pending = ray.wait([g.ready() for g in groups], num_returns=count, timeout=timeout_s)
    if pending:
        for group in groups:
            remove_placement_group(group)
        raise PlacementError(f"{asked}; {len(pending)} of them could not be reserved within "
                             f"ray.placement_timeout_s={timeout_s:g} s (resources held by other jobs?). "
                             f"Available now: {ray.available_resources()}; the cluster has {cluster_summary()}")
    return Placement(groups, per_group, resource)


@ray.remote(num_cpus=0)
def rendezvous_address() -> tuple[str, int]:
    """This node's address and a port free on it (rank 0 binds it for torch.distributed's TCP store)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return ray.util.get_node_ip_address(), sock.getsockname()[1]


class _GroupMethod:
    def __init__(self, group: WorkerGroup, name: str):
        self.group, self.name = group, name

    def remote(self, *args, **kwargs) -> ray.ObjectRef:
        refs = self.group.call_each(self.name, *args, **kwargs)
        self.group.pending += refs[1:]
        return refs[0]


class WorkerGroup:
    """world_size Ray actors of `cls` forming one process group; `group.method.remote(...)` runs on every rank and
    returns rank 0's result. Every rank receives the whole argument (e.g. the full batch) and takes its share."""

    def __init__(self, cls, placement: Placement, share: float, **kwargs):
        address, port = ray.get(rendezvous_address.options(**placement.options(0, 0)).remote())
        remote_cls = ray.remote(cls)
        world_size = placement.world_size
        self.workers = [remote_cls.options(**placement.options(rank, share)).remote(
            rank=rank, world_size=world_size, master_addr=address, master_port=port, **kwargs)
            for rank in range(world_size)]
        self.pending: list[ray.ObjectRef] = []   # other ranks' results, checked for errors at the next call

    def __getattr__(self, name: str) -> _GroupMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return _GroupMethod(self, name)

    def call_each(self, name: str, *args, **kwargs) -> list[ray.ObjectRef]:
        """name(*args, **kwargs) on every rank (arguments put in the object store once); every rank's ObjectRef."""
        self.raise_earlier_errors()
        args = [a if isinstance(a, ray.ObjectRef) else ray.put(a) for a in args]
        kwargs = {k: v if isinstance(v, ray.ObjectRef) else ray.put(v) for k, v in kwargs.items()}
        return [getattr(worker, name).remote(*args, **kwargs) for worker in self.workers]

    def raise_earlier_errors(self) -> None:
        """Re-raise an error a rank other than 0 hit in an earlier call (rank 0's own errors reach the caller)."""
        if self.pending:
            done, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)
            ray.get(done)

    def kill(self) -> None:
        for worker in self.workers:
            ray.kill(worker)


def kill(handle) -> None:
    """Stop a role: a single Ray actor or a WorkerGroup."""
    if isinstance(handle, WorkerGroup):
        handle.kill()
    elif handle is not None:
        ray.kill(handle)


def start_role(cls, placement: Placement, share: float, sharded: bool, **kwargs):
    """A role's Ray handle: a WorkerGroup over every bundle when `sharded`, else one actor in bundle 0."""
    if sharded:
        return WorkerGroup(cls, placement, share, **kwargs)
    return ray.remote(cls).options(**placement.options(0, share)).remote(**kwargs)


def call_each_rank(handle, name: str, *args) -> list[ray.ObjectRef]:
    """A role's method on each of its ranks: every rank of a WorkerGroup, or the one actor."""
    if isinstance(handle, WorkerGroup):
        return handle.call_each(name, *args)
    return [getattr(handle, name).remote(*args)]
