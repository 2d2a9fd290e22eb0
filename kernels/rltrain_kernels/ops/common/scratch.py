"""Transposing a [BT, BT] tile that a tensor-core dot produced, through a scratch tile in global memory.

Triton 3.4–3.7.0 miscompiles tl.trans of a dot result on Hopper (fla #640: its layout conversion gave wrong dk), so
the gated delta rule's backward kernels (the WY backward's Bᵀ, the dq/dk/dw/dG pass's dSᵀ) store the tile,
synchronise the program's threads, and load it back with transposed addressing (fla #826's fix of #640): 8 KiB
(bf16) per program through L2, no dot, no extra accumulator. Rebuilding the transpose as dots of its own from loaded
tiles instead (as IPLR's WY backward does for k_iᵀa_j and two T-sandwiches) costs 4–10 more 64×64 products and one
more [64, 64] fp32 accumulator per program: on H100 the scratch takes the gated delta rule's bf16 fwd+bwd from 2.65
to 2.55 ms at B8 T2048 and 2.92 to 2.81 at B2 T8192 (H16 K=V=128), gradients within 1e-5 of the dots' (4.46e-3 vs
the fp32 reference either way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunking import ChunkLayout
from .precision import cast_for_store


def scratch_tiles(layout: ChunkLayout, heads: int, dtype: torch.dtype, device) -> torch.Tensor:
    """One [BT, BT] tile per (chunk, head) program in `dtype`."""
    BT = layout.chunk_size
    return torch.empty(layout.num_chunks, heads, BT, BT, dtype=dtype, device=device)


@triton.jit
def transpose_via_scratch(x, scratch, i_c, i_hv, HV: tl.constexpr, BT: tl.constexpr, DOT_PREC: tl.constexpr):
    """xᵀ for this program's [BT, BT] fp32 tile x (rounded to the scratch's dtype, as a DOT_PREC dot would round it),
    through its own scratch tile."""
    o_i = tl.arange(0, BT)
    p_tile = scratch + (i_c * HV + i_hv).to(tl.int64) * BT * BT
    tl.debug_barrier()  # a kernel transposing twice: every thread has read the tile's last contents before the store
    tl.store(p_tile + o_i[:, None] * BT + o_i[None, :], cast_for_store(x, scratch, DOT_PREC))
    tl.debug_barrier()  # every thread's part of the tile is written before any thread reads another's
    return tl.load(p_tile + o_i[None, :] * BT + o_i[:, None]).to(tl.float32)
