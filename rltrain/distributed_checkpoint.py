"""Sharded state on disk with torch.distributed.checkpoint (DCP): what the actor's ranks write and read
(rltrain/workers/actor.py), and what the completeness check (rltrain/checkpoint.py) and the HF export
(rltrain/export.py) read, without unpickling arbitrary objects.

A DCP directory holds `.metadata` (every tensor's full shape and which chunk of it lies where) and one
`__<rank>_0.distcp` file per rank that wrote data. Under FSDP2 each rank writes the shards it holds (no gather, no
host copy on rank 0); a load reads, on each rank, the chunks that overlap its own shards, so a checkpoint written by
2 ranks resumes on 1 or 4, or in a single process (DCP reshards). Where torch.distributed is not initialised (the
single-process actor, the export) the same calls read and write whole tensors.

The states passed here are flat dicts of tensors only (the model's state_dict names; the optimizer's
`<parameter>.<exp_avg|exp_avg_sq|step>`): DCP would read any other value back with torch.load(weights_only=False).
`.metadata` is a pickle in DCP's format; `SafeReader` unpickles only DCP's metadata classes, torch sizes, dtypes and
layouts, and paths.

Every rank must see the directory it saves into or loads from. On one machine it always does; across nodes
trainer.output_dir must be on a filesystem every node shares (NFS, Lustre, a cloud filesystem), which
`check_visible_on_every_rank` checks before each save and load (a collective: every rank raises, naming the ranks and
hosts that cannot see it, rather than some of them waiting in DCP's collectives).
"""

from __future__ import annotations

import pickle
import socket
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

METADATA = ".metadata"
SHOWN = 3   # names listed per kind of mismatch in an error


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read, or that does not fit the model; the message names its path."""


class _MetadataUnpickler(pickle.Unpickler):
    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
               ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str):
        allowed = (module, name) in self.ALLOWED or module == "torch.distributed.checkpoint.metadata" or (
            module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` unpickled by _MetadataUnpickler."""

    def read_metadata(self) -> Metadata:
        with open(Path(self.path) / METADATA, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(directory: str | Path) -> Metadata:
    """A DCP directory's metadata; CheckpointError naming the path when it is missing or unreadable."""
    directory = Path(directory)
    if not (directory / METADATA).is_file():
        raise CheckpointError(f"{directory}: no {METADATA} (not a torch.distributed.checkpoint directory, or a save "
                              "that did not finish)")
    try:
        metadata = SafeReader(directory).read_metadata()
    except Exception as err:  # a truncated or foreign file: whatever unpickling raised, said in one line
        raise CheckpointError(f"{directory / METADATA} is unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{directory / METADATA} is not torch.distributed.checkpoint metadata")
    return metadata


def unreadable_reason(directory: str | Path) -> str | None:
    """Why a DCP directory cannot be read ('.metadata is missing', 'a data file is missing', ...), or None. Checks the
    files the metadata names and their lengths; reads no tensor."""
    directory = Path(directory)
    if not (directory / METADATA).is_file():
        return f"{METADATA} is missing"
    try:
        metadata = read_metadata(directory)
    except CheckpointError as err:
        return str(err).removeprefix(f"{directory}/")
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = directory / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size < end:
            return f"{name} is cut short ({file.stat().st_size} of {end} bytes)"
    return None


def saved_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """The full shape of every tensor a DCP directory holds, by name (CheckpointError if it holds anything else)."""
    metadata = read_metadata(directory)
    others = [name for name, item in metadata.state_dict_metadata.items()
              if not isinstance(item, TensorStorageMetadata)]
    if others:
        raise CheckpointError(f"{directory} holds values that are not tensors ({', '.join(sorted(others)[:SHOWN])}); "
                              "rltrain's checkpoints hold tensors only")
    return {name: tuple(item.size) for name, item in metadata.state_dict_metadata.items()}


def check_fits(state: dict[str, torch.Tensor], directory: str | Path, what: str) -> None:
    """CheckpointError naming `directory` unless it holds exactly `state`'s names with their full shapes. `what`:
    what the state is ('the model', 'the optimizer state'), for the message."""
    saved = saved_shapes(directory)
    expected = {name: tuple(tensor.shape) for name, tensor in state.items()}
    missing = sorted(expected.keys() - saved.keys())
    unexpected = sorted(saved.keys() - expected.keys())
    differ = [f"{name} {saved[name]} vs {expected[name]}" for name in sorted(expected.keys() & saved.keys())
              if saved[name] != expected[name]]
    if missing or unexpected or differ:
        parts = [f"{len(names)} {kind}: {', '.join(names[:SHOWN])}{', ...' if len(names) > SHOWN else ''}"
                 for kind, names in (("missing from it", missing), ("it holds that this run lacks", unexpected),
                                     ("of other shapes (checkpoint vs this run)", differ)) if names]
        raise CheckpointError(f"{directory} does not fit {what} of this run (another model.path or actor.lora?); "
                              f"tensors {'; '.join(parts)}")


@contextmanager
def _quiet_single_process():
    """DCP warns on every call without an initialised process group that it assumes a single process: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is")
        yield


def save_state(state: dict[str, torch.Tensor], directory: str | Path) -> None:
    """Write `state` (plain tensors, or DTensors of which this rank writes its shards) into the DCP directory; under
    torch.distributed every rank calls it (a collective)."""
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(directory))


def load_state(state: dict[str, torch.Tensor], directory: str | Path, what: str) -> None:
    """Read the DCP directory into `state`'s own tensors, in place (for DTensors: this rank's shards), after
    check_fits; under torch.distributed every rank calls it."""
    check_fits(state, directory, what)
    with _quiet_single_process():
        dcp.load(state, storage_reader=SafeReader(directory))


def read_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, whole, in this process's memory on the CPU (the export; tests)."""
    metadata = read_metadata(directory)
    saved_shapes(directory)  # tensors only
    state = {name: torch.empty(item.size, dtype=item.properties.dtype)
             for name, item in metadata.state_dict_metadata.items()}
    with _quiet_single_process():
        dcp.load(state, storage_reader=SafeReader(directory), no_dist=True)
    return state


@torch.no_grad()
def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (AdamW: step, exp_avg, exp_avg_sq), for a load to read into: one step
    on zero gradients at lr 0, which moves no weight (AdamW's decay and update are both scaled by lr). torch's
    get_optimizer_state_dict does the same, but only for parameters that require gradients, which fp32 masters do
    not (rltrain/workers/precision.py)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p in optimizer.state for p in params):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    held = [p.grad for p in params]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for param, grad in zip(params, held):
        param.grad = grad


def check_visible_on_every_rank(directory: str | Path) -> None:
    """Raise CheckpointError (on every rank: a collective under torch.distributed) unless every rank sees
    `directory`, naming the ranks and hosts that do not."""
    visible = Path(directory).is_dir()
    if not (dist.is_available() and dist.is_initialized()):
        everyone = [(visible, socket.gethostname())]
    else:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (visible, socket.gethostname()))
    blind = [f"rank {rank} on {host}" for rank, (seen, host) in enumerate(everyone) if not seen]
    if blind:
        raise CheckpointError(f"{directory} is not visible to {', '.join(blind)}: every rank writes and reads its own "
                              "shards there, so with actor.strategy=fsdp2 over several nodes trainer.output_dir must "
                              "be on a filesystem every node shares")
