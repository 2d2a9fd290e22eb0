"""Kimi Delta Attention (KDA, Kimi Linear): the gated delta rule with a decay per key channel. Chunked training
kernels with backward, a fused-recurrent decoding kernel, and the plain-PyTorch reference; fla's argument names and
layout.

    from rltrain_kernels.ops.kda import chunk_kda
    o, final_state = chunk_kda(q, k, v, g, beta, output_final_state=True)   # g: [B, T, HV, K]

Maths in README.md beside this file.
"""

from .function import chunk_kda, fused_recurrent_kda
from .naive import naive_kda_gate, naive_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda", "naive_kda_gate", "naive_recurrent_kda"]
