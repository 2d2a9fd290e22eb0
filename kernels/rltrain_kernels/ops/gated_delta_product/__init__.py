"""Gated delta product (Gated DeltaProduct): n_h generalized Householder steps per token. Chunked training path
with backward (the gated delta rule's chunk machinery on the expanded T·n_h sub-step sequence, plus a strided
output pass that reads only the T queries), a fused-recurrent decoding kernel, and the plain-PyTorch reference.
Same argument names and layout as fla's `gated_delta_product`.

    from rltrain_kernels.ops.gated_delta_product import chunk_gated_delta_product
    o, final_state = chunk_gated_delta_product(q, k, v, g, beta, num_householder=2, output_final_state=True)

q [B, T, H, K]; k [B, T·n_h, H, K]; v [B, T·n_h, HV, V]; beta [B, T·n_h, HV]; g [B, T, HV] or None.
Maths in README.md beside this file.
"""

from .function import chunk_gated_delta_product, fused_recurrent_gated_delta_product
from .naive import naive_recurrent_gated_delta_product

__all__ = ["chunk_gated_delta_product", "fused_recurrent_gated_delta_product",
           "naive_recurrent_gated_delta_product"]
