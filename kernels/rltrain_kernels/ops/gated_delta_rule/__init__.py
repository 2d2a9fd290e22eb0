"""Gated delta rule linear attention (Gated DeltaNet, Qwen3-Next): chunked training kernels with backward,
a fused-recurrent decoding kernel, and the plain-PyTorch reference. Same argument names and layout as fla.

    from rltrain_kernels.ops.gated_delta_rule import chunk_gated_delta_rule
    o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)

Maths in README.md beside this file.
"""

from .function import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .naive import naive_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "naive_recurrent_gated_delta_rule"]
