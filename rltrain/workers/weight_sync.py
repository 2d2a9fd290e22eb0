"""Weight sync: after every update the actor's weights go into every rollout process, bucket by bucket
(`actor.weight_bucket_mb`), before the next step generates. The trainer logs the push's time as time/weight_sync_s.

Pairing. Rollout process j (replica j // tp, its tensor-parallel rank j % tp; rltrain/workers/rollout_group.py) sits
in placement bundle j, where actor rank j sits too (actor.strategy=fsdp2: one rank per bundle). The push is planned
once (`plan_sources`): each rollout process takes the bucket from the actor rank on the same GPU, matched by GPU
UUID (`device_info`), not by index, since Ray shows every process its own GPU as cuda:0.

Routes, per rollout process:
- "ipc" (GPU, colocated: the normal case). Every actor rank gathers the bucket's full tensors (under FSDP2 every rank
  calls full_tensor(), so every rank has them), copies them into one flat device buffer and returns a CUDA IPC
  handle to it (torch.multiprocessing.reductions.reduce_tensor: a picklable (rebuild function, args)). The rollout
  process on that GPU opens it, copies into its weights, synchronizes and returns; the rank keeps the buffer alive
  until every receiver of the bucket has returned (the next export_weights drops it, release_weights the last).
  Nothing goes through host memory. One buffer per bucket, so a receiver opens one IPC handle per bucket, not one
  per tensor.
- "host": CPU runs, and any rollout process that shares no GPU with an actor rank (a log line says so, once, when
  the push is planned). Actor rank 0 packs the bucket into one flat buffer (on its GPU, then one device-to-host
  copy) and returns it as a numpy array (`HostBuffer`): Ray writes such an array into its object store with one
  copy, keeps it there once for every host receiver (each is passed the same ObjectRef), and hands it to a receiver
  without a copy; the receiver moves it to its device in one copy and takes views. A dict of tensors would go
  through torch's pickling twice per tensor (on CPU, 340 MB in 1,000 tensors: 1.2 s out, 0.35 s in, against 0.3 s
  and 0.004 s as one array).

Memory per bucket: the actor side holds the gathered tensors and the flat buffer (the single-process actor's
gathered tensors are its parameters themselves; the host route adds the buffer's host copy), the rollout side its
parameters plus the buffer: the host route's copy on its device or, for vLLM through IPC, a clone (the engine's
layerwise reload may keep a partly loaded layer's tensors past the call).

Snapshots (trainer.mode one_step_off / async, rltrain/async_rollout.py): the engines may be generating when an
update ends, so the push is split in two. `snapshot()` has actor rank 0 export every bucket as a host buffer, which
Ray copies into its object store as the call returns (a consistent copy of this version, whatever the actor does
next); `load_snapshot(refs)` loads them into every rollout process later, between two of the producer's batches.
Host route only: asynchronous modes put the rollout on devices of its own (rollout.placement=separate), where no
rollout process shares a GPU with an actor rank anyway.

The worker-side parts (WeightSource, receive, the buffer layout) need no Ray cluster, so an actor and a rollout
engine can exchange buckets in plain processes (tests/rltrain/workers/test_weight_sync.py runs the IPC route on a
GPU that way); WeightPush is the controller's loop over the Ray actors.
"""

from __future__ import annotations

import inspect
import logging
import time
import warnings
from dataclasses import dataclass

import numpy as np
import ray
import torch
from torch.multiprocessing.reductions import reduce_tensor

from rltrain.workers.group import call_each_rank

logger = logging.getLogger(__name__)

ALIGN_BYTES = 256  # each tensor starts at a multiple of this in the flat buffer: any dtype can view it there


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in a flat bucket buffer."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def plan_layout(tensors: dict[str, torch.Tensor]) -> tuple[list[Slot], int]:
    """(a slot per tensor, in order, each aligned to ALIGN_BYTES; the buffer's size in bytes)."""
    slots, offset = [], 0
    for name, tensor in tensors.items():
        slot = Slot(name, tensor.dtype, tuple(tensor.shape), offset)
        slots.append(slot)
        offset += -(-slot.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return slots, offset


def view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The tensor in `slot` of a flat uint8 buffer (a view: no copy)."""
    return buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def pack(tensors: dict[str, torch.Tensor], device: torch.device | str) -> tuple[torch.Tensor, list[Slot]]:
    """The tensors copied into one flat uint8 buffer on `device`, and its layout."""
    slots, size = plan_layout(tensors)
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    for slot in slots:
        view(buffer, slot).copy_(tensors[slot.name])
    return buffer, slots


def unpack(buffer: torch.Tensor, slots: list[Slot]) -> dict[str, torch.Tensor]:
    return {slot.name: view(buffer, slot) for slot in slots}


@dataclass
class IpcBuffer:
    uuid: str          # the GPU the buffer lies on
    handle: tuple      # reduce_tensor(buffer): (rebuild function, its arguments)
    slots: list[Slot]


@dataclass
class HostBuffer:
    """A bucket as one flat uint8 array in host memory and its layout (numpy: Ray's object store takes and gives
    it without pickling each tensor)."""
    data: np.ndarray
    slots: list[Slot]

    def tensors(self, device: torch.device | str = "cpu", own: bool = False) -> dict[str, torch.Tensor]:
        """The bucket's tensors on `device`: views of one copy of the buffer there, or on the CPU views of the array
        itself (read-only when it came from Ray's object store) unless `own` asks for a private copy."""
        with warnings.catch_warnings():  # a read-only array: only ever read through these views unless copied
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            buffer = torch.from_numpy(self.data)
        if torch.device(device).type != "cpu":
            buffer = buffer.to(device)
        elif own:
            buffer = buffer.clone()
        return unpack(buffer, self.slots)


@dataclass
class ExportedBucket:
    """What one actor rank returns for one bucket: an IPC handle (ranks with a colocated receiver), a host copy
    (rank 0, when some receiver needs one), or both."""
    ipc: IpcBuffer | None = None
    host: HostBuffer | None = None


def device_info(device: str) -> tuple[str, str] | None:
    """(GPU UUID, device name) of this process's current CUDA device; None when `device` is not cuda."""
    if device != "cuda":
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return str(props.uuid), props.name


def _visible_index(uuid: str) -> int | None:
    """This process's index of the GPU with this UUID, or None when it does not see that GPU."""
    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None


def open_ipc(ipc: IpcBuffer, index: int) -> torch.Tensor:
    """The sender's buffer, opened in this process on its device `index` (the sender's index may differ)."""
    rebuild, args = ipc.handle
    args = list(args)
    args[list(inspect.signature(rebuild).parameters).index("storage_device")] = index
    return rebuild(*args)


def receive(bucket: ExportedBucket, own: bool, device: str = "cpu") -> tuple[dict[str, torch.Tensor], str]:
    """(the bucket's tensors, the route taken): through IPC when the bucket's GPU is visible here, else its host
    copy, moved to `device` in one copy. own=True gives tensors no other process or buffer shares (an IPC buffer or
    a host array is copied first), for engines that keep loaded tensors past the call."""
    if bucket.ipc is not None:
        index = _visible_index(bucket.ipc.uuid)
        if index is not None:
            buffer = open_ipc(bucket.ipc, index)
            return unpack(buffer.clone() if own else buffer, bucket.ipc.slots), "ipc"
    if bucket.host is None:
        raise RuntimeError(f"weight push: a bucket on GPU {bucket.ipc.uuid if bucket.ipc else '?'} reached a "
                           "process that does not see that GPU, with no host copy")
    return bucket.host.tensors(device, own), "host"


class WeightSource:
    """Mixed into the actor workers: what a push asks of each actor rank. The class provides full_weights(names)
    (full tensors on its device; under FSDP2 a collective every rank calls), `rank` and `device`."""

    rank = 0  # the single-process actor; FSDP2 ranks set their own
    _exported: torch.Tensor | None = None
    _staging: torch.Tensor | None = None

    def device_info(self) -> tuple[str, str] | None:
        return device_info(self.device)

    def export_weights(self, names: list[str], ipc_ranks: list[int], host: bool) -> ExportedBucket | None:
        """This rank's export of one bucket: an IPC handle to a flat device copy if rank in ipc_ranks, a host copy
        on rank 0 if `host`; None when neither. The device copy stays alive until the next export or release."""
        self.release_weights()
        full = self.full_weights(names)
        bucket, packed = ExportedBucket(), None
        if self.rank in ipc_ranks:
            packed = pack(full, torch.cuda.current_device())
            torch.cuda.current_stream().synchronize()  # written before another process reads it
            self._exported = packed[0]
            bucket.ipc = IpcBuffer(device_info("cuda")[0], reduce_tensor(packed[0]), packed[1])
        if host and self.rank == 0:
            bucket.host = self._host_copy(*(packed or pack(full, next(iter(full.values())).device)))
        return bucket if bucket.ipc is not None or bucket.host is not None else None

    def _host_copy(self, buffer: torch.Tensor, slots: list[Slot]) -> HostBuffer:
        """A flat buffer in host memory. From a GPU through a pinned staging buffer kept across calls (H200, 4 GB:
        0.3 s against 3.4 s into pageable memory); it holds this export until the next one, as Ray's object store
        copies a return value before the actor's next call runs."""
        if buffer.device.type != "cuda":
            return HostBuffer(buffer.numpy(), slots)
        if self._staging is None or self._staging.numel() < buffer.numel():
            self._staging = None  # the smaller one freed before the larger is pinned
            self._staging = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=True)
        staged = self._staging[:buffer.numel()]
        staged.copy_(buffer)
        return HostBuffer(staged.numpy(), slots)

    def release_weights(self) -> None:
        if self._exported is not None:
            self._exported = None
            torch.cuda.ipc_collect()  # frees the buffers torch kept for receivers that have let go of them


def plan_sources(actor_gpus: list[str | None], rollout_gpus: list[str | None]) -> list[int | None]:
    """For each rollout process, the actor rank on the same GPU (its IPC source; the lowest such rank), or None:
    it takes rank 0's host copy. Arguments: GPU UUIDs, None for CPU processes."""
    rank_of = {}
    for rank, uuid in enumerate(actor_gpus):
        if uuid is not None:
            rank_of.setdefault(uuid, rank)
    return [rank_of.get(uuid) if uuid is not None else None for uuid in rollout_gpus]


class WeightPush:
    """The controller's loop: plans each rollout process's source once, then pushes the actor's weights into
    every replica bucket by bucket. `actor` is the actor role's handle (a Ray actor or a WorkerGroup), `rollout` a
    RolloutReplicas."""

    def __init__(self, actor, rollout, bucket_mb: int):
        self.actor, self.rollout = actor, rollout
        self.buckets = ray.get(actor.bucket_names.remote(bucket_mb))
        actor_gpus = [info and info[0] for info in ray.get(call_each_rank(actor, "device_info"))]
        rollout_gpus = [info and info[0] for info in rollout.device_infos()]
        self.sources = plan_sources(actor_gpus, rollout_gpus)
        on_host = [j for j, source in enumerate(self.sources) if source is None]
        if on_host and any(rollout_gpus):
            logger.warning("weight push: rollout process(es) %s share no GPU with an actor rank; they take the "
                           "weights through host memory (Ray's object store) instead of CUDA IPC", on_host)
        logger.info("weight push: %d bucket(s) of about %d MB to %d rollout process(es), %d by CUDA IPC",
                    len(self.buckets), bucket_mb, len(self.sources), len(self.sources) - len(on_host))

    def push(self) -> float:
        """Push the actor's current weights into every rollout process; returns the seconds it took."""
        start = time.monotonic()
        ipc_ranks = sorted({source for source in self.sources if source is not None})
        host = None in self.sources
        self.rollout.begin_weight_update()
        for names in self.buckets:
            exports = call_each_rank(self.actor, "export_weights", names, ipc_ranks, host)
            taken = [0 if source is None else source for source in self.sources]
            self.rollout.load_buckets([exports[rank] for rank in taken])  # waits: the next export drops the buffer
            ray.get([ref for rank, ref in enumerate(exports) if rank not in taken])  # None each; raises their errors
        ray.get(call_each_rank(self.actor, "release_weights"))
        self.rollout.finish_weight_update()
        return time.monotonic() - start

    def snapshot(self) -> list:
        """The actor's current weights, one ObjectRef per bucket (rank 0's host export), complete when this returns:
        a later update does not change them."""
        refs = []
        for names in self.buckets:
            exports = call_each_rank(self.actor, "export_weights", names, [], True)
            refs.append(exports[0])
            ray.get(exports[1:])  # the other ranks' part of the gather: None each; raises their errors
        ray.wait(refs, num_returns=len(refs), fetch_local=False)
        return refs

    def load_snapshot(self, refs: list, version: int) -> float:
        """A snapshot() of weight version `version` into every rollout process, bucket by bucket; returns the
        seconds it took. With partial rollouts on the async engine this may land during a generation, which the
        update's begin aborts and its finish resumes."""
        start = time.monotonic()
        self.rollout.begin_weight_update()
        for ref in refs:
            self.rollout.load_buckets([ref] * len(self.sources))
        self.rollout.finish_weight_update(version)
        return time.monotonic() - start
