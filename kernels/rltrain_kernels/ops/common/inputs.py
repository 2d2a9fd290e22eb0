"""Argument checks every delta-rule op shares (gated delta rule, IPLR, gated delta product): packed sequences
(cu_seqlens) and the initial state, with the same messages naming the argument."""

from __future__ import annotations

import weakref

import torch

# cu_seqlens tensors whose offsets were read and found valid, newest first: (weak reference, (version counter when
# read, T)). Reading them is a host sync (it drains the GPU's queue), so a model that hands one cu_seqlens to every
# layer pays it once per forward, not once per layer and pass (as chunking.chunk_layout caches its layout).
_VALIDATED: list[tuple[weakref.ref, tuple[int, int]]] = []
VALIDATED_CACHE_SIZE = 8


def check_packing(B: int, T: int, cu_seqlens: torch.Tensor | None, what: str = "") -> int:
    """The number of sequences N: B, or len(cu_seqlens) - 1 for a packed batch (B = 1, offsets 0 .. T).
    `what` says what T counts, for the message (e.g. "tokens of q"). The offsets are read once per cu_seqlens tensor
    and T (again after an in-place change; every call for an inference-mode tensor, which has no version counter)."""
    if cu_seqlens is None:
        return B
    if B != 1:
        raise ValueError(f"cu_seqlens requires B=1 (sequences packed along T), got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor [0, ..., T] of length N+1 >= 2")
    key = None if cu_seqlens.is_inference() else (cu_seqlens._version, T)
    if key is not None and any(ref() is cu_seqlens and seen == key for ref, seen in _VALIDATED):
        return cu_seqlens.numel() - 1
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in zip(offsets, offsets[1:])):
        counting = f" count {what}:" if what else ""
        raise ValueError(f"cu_seqlens must{counting} start at 0, be non-decreasing and end at T={T}, got {offsets}")
    if key is not None:
        _VALIDATED.insert(0, (weakref.ref(cu_seqlens), key))
        del _VALIDATED[VALIDATED_CACHE_SIZE:]
    return len(offsets) - 1


def check_initial_state(initial_state: torch.Tensor | None, shape: tuple[int, ...], names: str,
                        device: torch.device) -> None:
    """initial_state, when given, has `shape` (described by `names`, e.g. "[N, HV, K, V]") and lives on `device`."""
    if initial_state is None:
        return
    if initial_state.shape != shape:
        raise ValueError(f"initial_state must be {names} = {shape}, got {tuple(initial_state.shape)}")
    if initial_state.device != device:
        raise ValueError(f"initial_state is on {initial_state.device} but q is on {device}")
