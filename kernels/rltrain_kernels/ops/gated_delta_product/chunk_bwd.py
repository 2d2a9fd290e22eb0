"""Chunked gated delta product, backward: the chunked backward it shares with the gated delta rule
(common/chunk_bwd.py) on the expanded sub-step sequence with a query stride of n_h (its kernels read q and dO of
length T as the last sub-steps' rows, zero elsewhere, and write dq of length T), then dG → dg by the reverse
chunk-local cumsum, read at each token's first sub-step by the caller.
"""

from __future__ import annotations

from ..common.chunk_bwd import gated_chunk_bwd
from ..common.chunking import ChunkLayout
from ..common.cumsum import chunk_local_cumsum
from ..common.tuning import DEFAULT_TUNING, Tuning


def chunk_gated_delta_product_bwd(q, k, v, beta, scale: float, num_householder: int, initial_state, G, Ai, do, dht,
                                  layout: ChunkLayout, *, dot_prec: str, recurrence_prec: str,
                                  tuning: Tuning = DEFAULT_TUNING):
    """Flattened inputs (as chunk_gated_delta_product_fwd) and the saved G, Ai → (dq [tokens, H, K], dk, dv, dg_sub
    [tokens·n_h, HV] fp32: the gradient of every sub-step's log gate, dbeta, dh0 or None), dtypes as gated_chunk_bwd's.
    dot_prec, recurrence_prec, tuning: the forward's."""
    dq, dk, dv, dG, dbeta, dh0 = gated_chunk_bwd(q, k, v, beta, scale, initial_state, G, Ai, do, dht, layout,
                                                 query_stride=num_householder, dot_prec=dot_prec,
                                                 recurrence_prec=recurrence_prec, tuning=tuning)
    return dq, dk, dv, chunk_local_cumsum(dG, layout, reverse=True), dbeta, dh0
