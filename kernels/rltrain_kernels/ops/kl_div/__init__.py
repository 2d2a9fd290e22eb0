"""Fused linear → KL divergence to a teacher (on-policy distillation), never materialising tokens × vocab logits.

    from rltrain_kernels.ops.kl_div import linear_kl_div
    loss = linear_kl_div(hidden, lm_head.weight, teacher_hidden, teacher_lm_head.weight, temperature=1.0,
                         reduction="batchmean", direction="forward", labels=labels)

Layers: kernel.py (the Triton row pass over a chunk's two fp32 logits tiles, imported lazily) → chunk.py (the
token-chunked driver with its cuBLAS GEMMs, the torch row pass, KLDivChunkConfig) → function.py (autograd Functions,
checks, `linear_kl_div`, `LinearKLDivLoss`); naive.py is the dense reference. The cuBLAS GEMMs with an fp32 result
come from ops/common/vocab_tiles.py, the backward's scaling from ops/common/scale.py. README.md has the maths, the
GEMM count and the memory bound.
"""

from rltrain_kernels.ops.kl_div.chunk import KLDivChunkConfig, workspace_bytes
from rltrain_kernels.ops.kl_div.function import (
    LinearKLDivFunction, LinearKLDivLoss, LinearKLDivPerTokenFunction, linear_kl_div,
)
from rltrain_kernels.ops.kl_div.naive import naive_linear_kl_div

__all__ = ["KLDivChunkConfig", "LinearKLDivFunction", "LinearKLDivLoss", "LinearKLDivPerTokenFunction",
           "linear_kl_div", "naive_linear_kl_div", "workspace_bytes"]
