"""Argument checks every delta-rule op shares (gated delta rule, gated delta product, IPLR): the tensors' types,
dtypes and device, q's shape and the GVA head groups, packed sequences (cu_seqlens), the initial state, the default
scale, the chunk sizes and tile dims of the chunked kernels. Each op's inputs.py checks its own shapes with these, so
the three ops (and each op's naive, fused-recurrent and chunked entry points) reject the same bad inputs with the
same messages naming the argument.
"""

from __future__ import annotations

import warnings
import weakref

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Chunk sizes the chunked kernels take: the solve works in 16-row blocks of a power-of-two chunk (common/wy.py).
CHUNK_SIZES = (16, 32, 64)

# cu_seqlens tensors whose offsets were read and found valid, newest first: (weak reference, (version counter when
# read, T)). Reading them is a host sync (it drains the GPU's queue), so a model that hands one cu_seqlens to every
# layer pays it once per forward, not once per layer and pass (as chunking.chunk_layout caches its layout).
_VALIDATED: list[tuple[weakref.ref, tuple[int, int]]] = []
VALIDATED_CACHE_SIZE = 8


def check_tensors(named, device: torch.device) -> None:
    """Every (name, tensor) of `named` is a torch.Tensor of a FLOAT_DTYPES dtype on `device` (q's)."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32/float16/bfloat16 (float64 for references), got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}")


def check_query(q: torch.Tensor) -> tuple[int, int, int, int]:
    """q's (B, T, H, K)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    return tuple(q.shape)


def check_head_groups(HV: int, H: int) -> int:
    """The GVA group size HV // H: value heads hv = h·(HV/H) + j share q/k head h."""
    if HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's H={H}")
    return HV // H


def default_scale(scale: float | None, K: int) -> float:
    """scale, or K^-0.5 when None."""
    return float(K ** -0.5 if scale is None else scale)


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


def sequence_bounds(B: int, T: int, cu_seqlens) -> list[tuple[int, int]]:
    """(start, end) token offsets of every sequence in the flattened [B*T] token axis (the naive references)."""
    if cu_seqlens is None:
        return [(b * T, (b + 1) * T) for b in range(B)]
    offsets = cu_seqlens.tolist()
    return list(zip(offsets[:-1], offsets[1:]))


def check_chunk_size(chunk_size: int) -> int:
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")
    return int(chunk_size)


def check_chunk_dims(K: int, V: int, keys: str) -> None:
    """The chunked kernels' tl.dot tiles: 16 <= K <= 256 and V >= 16; `keys` names the tensors K belongs to."""
    if not 16 <= K <= 256 or V < 16:
        raise ValueError(f"the chunked kernels need 16 <= K <= 256 and V >= 16 (tl.dot tiles), got "
                         f"K={K} ({keys}) and V={V} (v)")


def resolve_state_v_first(state_v_first: bool, transpose_state_layout: bool | None) -> bool:
    """state_v_first, or fla's deprecated name for it (a DeprecationWarning; both at once is an error, as in fla)."""
    if transpose_state_layout is None:
        return bool(state_v_first)
    if state_v_first:
        raise ValueError("pass state_v_first or its deprecated name transpose_state_layout, not both")
    warnings.warn("transpose_state_layout is deprecated: it is called state_v_first", DeprecationWarning,
                  stacklevel=3)
    return bool(transpose_state_layout)
