"""IPLR (identity plus low rank) delta rule linear attention, S_t = S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ:
chunked training kernels with a backward for every input (fla's chunked IPLR is forward-only), a fused-recurrent
decoding kernel, and the plain-PyTorch reference. Same argument names and layout as fla.

    from rltrain_kernels.ops.iplr_delta_rule import chunk_iplr_delta_rule
    o, final_state = chunk_iplr_delta_rule(q, k, v, a, b, output_final_state=True)

Maths in README.md beside this file.
"""

from .function import chunk_iplr_delta_rule, fused_recurrent_iplr_delta_rule
from .naive import naive_recurrent_iplr_delta_rule

__all__ = ["chunk_iplr_delta_rule", "fused_recurrent_iplr_delta_rule", "naive_recurrent_iplr_delta_rule"]
