"""Chunked gated delta rule, backward: the chunked backward it shares with the gated delta product
(common/chunk_bwd.py: the states recomputed from the stored T, the reverse state pass, the per-chunk and WY
backwards, GVA sums), then dG → dg by the reverse chunk-local cumsum, or, when the op made g from a raw a, by the
gate's own backward (gate.py), which also gives A_log's and dt_bias's gradients.
"""

from __future__ import annotations

from ..common.chunk_bwd import gated_chunk_bwd
from ..common.chunking import ChunkLayout
from ..common.cumsum import chunk_local_cumsum
from ..common.tuning import DEFAULT_TUNING, Tuning
from .gate import gate_bwd


def chunk_gated_delta_rule_bwd(q, k, v, beta, scale: float, initial_state, G, Ai, do, dht, layout: ChunkLayout,
                               gate=None, *, dot_prec: str, recurrence_prec: str, tuning: Tuning = DEFAULT_TUNING):
    """Flattened inputs (as chunk_gated_delta_rule_fwd) and the saved G, Ai → (dq [tokens, H, K], dk, dv
    [tokens, HV, V], dg [tokens, HV], dbeta [tokens, HV], dh0 or None, gate_grads), dtypes as gated_chunk_bwd's, dg
    fp32. gate: (a [tokens, HV], A_log, dt_bias or None) when the forward made g from the raw a (gate.py): dg is then
    a's gradient and gate_grads (dA_log, ddt_bias or None), else None. dot_prec, recurrence_prec: the forward's
    DOT_PRECs (chunk_gated_delta_rule_fwd); tuning: the forward's launch choices (common/tuning.py)."""
    dq, dk, dv, dG, dbeta, dh0 = gated_chunk_bwd(q, k, v, beta, scale, initial_state, G, Ai, do, dht, layout,
                                                 dot_prec=dot_prec, recurrence_prec=recurrence_prec, tuning=tuning)
    if gate is None:
        dg, gate_grads = chunk_local_cumsum(dG, layout, reverse=True), None
    else:
        dg, *gate_grads = gate_bwd(dG, *gate, layout)
    return dq, dk, dv, dg, dbeta, dh0, gate_grads
