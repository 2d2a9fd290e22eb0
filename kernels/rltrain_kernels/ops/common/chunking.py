"""Chunk bookkeeping for packed variable-length batches, computed on the host (cached for padded batches).

Every delta-rule kernel works on the flattened token axis [total_tokens, heads, dim]. A padded batch [B, T] is the
packed batch with B equal lengths, so one code path serves both. A chunk never straddles two sequences: each
sequence is cut into ceil(len / chunk_size) chunks of its own, so no state leaks between sequences.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


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


def chunk_layout(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int, device) -> ChunkLayout:
    """Build the layout from (B, T) or from cu_seqlens (one host sync to read the lengths). Padded batches reuse a
    cached layout: building one copies three small tensors to the device, and each copy syncs with the host, which
    in a training step stalls the queue of kernels behind it."""
    if cu_seqlens is None:
        return _padded_layout(B, T, chunk_size, torch.device(device))
    return _build([int(x) for x in cu_seqlens.tolist()], chunk_size, device)


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
