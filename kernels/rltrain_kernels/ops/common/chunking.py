"""Chunk bookkeeping for packed variable-length batches, computed on the host and cached.

Every delta-rule kernel works on the flattened token axis [total_tokens, heads, dim]. A padded batch [B, T] is the
packed batch with B equal lengths, so one code path serves both. A chunk never straddles two sequences: each
sequence is cut into ceil(len / chunk_size) chunks of its own, so no state leaks between sequences.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

# The chunk the delta-rule ops' chunked kernels run at by default: the one they are tuned and timed at.
CHUNK_SIZE = 64


@dataclass(frozen=True)
class ChunkLayout:
    """Where every sequence and chunk lives in the flattened token axis.

    cu_seqlens: [N+1] int32 token offsets (device). chunk_indices: [NC, 2] int32 (sequence n, chunk index within
    n) for every chunk, in order (device). chunk_offsets: [N+1] int32 cumulative chunk counts (device), used to
    address per-chunk states [NC, HV, K, V]. num_chunks: NC. num_seqs: N. max_len: the longest sequence.
    """

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    num_chunks: int
    num_seqs: int
    max_len: int
    chunk_size: int


def chunk_layout(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int, device,
                 steps: int = 1) -> ChunkLayout:
    """The layout of B sequences of T tokens, or of the packed sequences cu_seqlens delimits, each token spanning
    `steps` rows of the flattened axis (the gated delta product's n_h sub-steps). Built, or reused from a cache.
    Building reads the lengths on the host (for cu_seqlens on a GPU, a sync that drains the queue of kernels before
    it) and copies three small tensors to the device, so a training step would stall at every linear-attention
    layer. Padded batches are cached by shape; packed ones by the cu_seqlens tensor itself (as long as it lives and
    is not modified in place), which a model computes once per forward and hands to every layer: one sync per
    forward, not one per layer and pass. (An inference-mode cu_seqlens has no version counter and is read every
    call.)"""
    device = torch.device(device)
    if cu_seqlens is None:
        return _padded_layout(B, T * steps, chunk_size, device)
    if cu_seqlens.is_inference():  # no version counter to tell an in-place change: built every call
        return _build([int(x) * steps for x in cu_seqlens.tolist()], chunk_size, device)
    key = (cu_seqlens._version, chunk_size, steps, device)
    for i, (ref, cached_key, layout) in enumerate(_packed_cache):
        if ref() is cu_seqlens and cached_key == key:
            _packed_cache.insert(0, _packed_cache.pop(i))
            return layout
    layout = _build([int(x) * steps for x in cu_seqlens.tolist()], chunk_size, device)
    _packed_cache.insert(0, (weakref.ref(cu_seqlens), key, layout))
    del _packed_cache[PACKED_CACHE_SIZE:]
    return layout


# The most recently used packed layouts, newest first: (weak reference to cu_seqlens, (its version counter when read,
# chunk size, steps, device), layout). A weak reference, so a freed tensor whose id or memory is reused never matches.
PACKED_CACHE_SIZE = 8
_packed_cache: list[tuple[weakref.ref, tuple, ChunkLayout]] = []


@functools.lru_cache(maxsize=64)
def _padded_layout(B: int, T: int, chunk_size: int, device: torch.device) -> ChunkLayout:
    return _build([b * T for b in range(B + 1)], chunk_size, device)


def _build(offsets: list[int], chunk_size: int, device) -> ChunkLayout:
    lengths = [e - s for s, e in zip(offsets[:-1], offsets[1:])]
    counts = [(n + chunk_size - 1) // chunk_size for n in lengths]
    chunk_indices = [(n, i) for n, c in enumerate(counts) for i in range(c)]
    chunk_offsets = [0]
    for c in counts:
        chunk_offsets.append(chunk_offsets[-1] + c)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return ChunkLayout(
        cu_seqlens=as_tensor(offsets),
        chunk_indices=as_tensor(chunk_indices).reshape(-1, 2),
        chunk_offsets=as_tensor(chunk_offsets),
        num_chunks=len(chunk_indices),
        num_seqs=len(lengths),
        max_len=max(lengths) if lengths else 0,
        chunk_size=chunk_size,
    )
