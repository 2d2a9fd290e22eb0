"""Chunk bookkeeping for packed variable-length batches: computed on the host and cached (ChunkLayout), and read in
the kernels by two @triton.jit prologues, one per kind of program.

Every delta-rule kernel works on the flattened token axis [total_tokens, heads, dim]. A padded batch [B, T] is the
packed batch with B equal lengths, so one code path serves both. A chunk never straddles two sequences: each
sequence is cut into ceil(len / chunk_size) chunks of its own, so no state leaks between sequences.

- `chunk_program`: a chunk-parallel program (grid axis 0 over the layout's chunks: the WY kernels, the output and
  gradient passes, the cumsums) finds its chunk's sequence and token rows.
- `state_program`: a state-pass program (grid (sequences × value heads, V blocks): the sequential passes over a
  sequence's chunks) finds its sequence, heads and [BK, BV] state tile.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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


def flatten_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] → [B*T, ...], contiguous: the flattened token axis the chunk kernels address."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def sequence_offsets(B: int, T: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """[N + 1] int32 token offsets of the sequences: cu_seqlens's (read as a dense array, whatever the caller's view),
    or B rows of T. Built on the device, no host sync: what the fused-recurrent (decoding) kernels read in place of a
    chunk layout."""
    if cu_seqlens is not None:
        return cu_seqlens.to(torch.int32).contiguous()
    if T > 0:
        return torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
    return torch.zeros(B + 1, dtype=torch.int32, device=device)


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


@triton.jit
def chunk_program(cu_seqlens, chunk_indices, BT: tl.constexpr):
    """This chunk-parallel program's chunk (grid axis 0 over the layout's chunks): (i_c its index, i_n its sequence,
    i_t its index within the sequence, bos and eos the sequence's token offsets (int64), o_i the chunk's rows [BT],
    o_t their tokens, m_t the rows that hold a token of the sequence)."""
    i_c = tl.program_id(0)
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_i = tl.arange(0, BT)
    o_t = bos + i_t * BT + o_i
    return i_c, i_n, i_t, bos, eos, o_i, o_t, o_t < eos


@triton.jit
def state_program(cu_seqlens, chunk_offsets, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """This state-pass program's sequence and tile (grid (sequences × value heads on axis 0: no 65535 limit, V
    blocks)): (i_n the sequence, i_hv its value head, i_h the q/k head (GVA), bos and eos its token offsets (int64),
    c0 its first chunk's index among the chunk states, o_i a chunk's rows [BT], o_k, o_v the state tile's key and
    value columns [BK], [BV], m_k, m_v their masks, m_h the tile's mask, state_offset the tile's offsets within one
    [K, V] state)."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_i, o_k = tl.arange(0, BT), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    state_offset = o_k[:, None] * V + o_v[None, :]
    return i_n, i_hv, i_h, bos, eos, c0, o_i, o_k, o_v, m_k, m_v, m_h, state_offset
