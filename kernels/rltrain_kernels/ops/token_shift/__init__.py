"""Token shift (RWKV's time shift; fla's `fla.modules.token_shift.token_shift`): public function, autograd Function
and the plain-PyTorch reference.

    from rltrain_kernels.ops.token_shift import token_shift
    delta = token_shift(x)                                          # x [B, T, D]: delta[t] = x[t − 1] − x[t]
    delta, cache = token_shift(x, cache=cache, output_cache=True)   # x[−1] = cache [N, D]; cache ← last token
    delta = token_shift(row, cu_seqlens=cu_seqlens)                 # packed sequences, each from its own x[−1]

Same signature, defaults and returns as fla 0.6 (fla's `chunk_indices` argument is not taken: tiles here need no
precomputed chunk list). Exact (one subtraction in x's dtype); gradients for x and the cache, and through the
returned cache. Tensors the kernels cannot take (CPU outside the Triton interpreter, float64) go to
`naive_token_shift`, which computes the same function.
"""

from rltrain_kernels.ops.token_shift.function import TokenShiftFunction, token_shift
from rltrain_kernels.ops.token_shift.naive import naive_token_shift

__all__ = ["TokenShiftFunction", "naive_token_shift", "token_shift"]
