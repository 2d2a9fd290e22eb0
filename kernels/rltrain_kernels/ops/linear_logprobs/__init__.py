"""Fused linear → per-token log-probs and entropy, never materialising tokens × vocab logits.

    from rltrain_kernels.ops.linear_logprobs import linear_logprobs
    logprobs, entropy = linear_logprobs(hidden, lm_head.weight, labels, temperature=0.7)

Layers: the vocabulary tiling shared with the policy loss in ops/common/ (vocab_tiles.py: tile backends, torch row
passes, fp32-output GEMMs; row_pass.py: Triton row passes; vocab_gemm.py: the fused GEMM) → fused.py (this op's
tile backend on the fused GEMM, imported lazily) → chunk.py (tiling drivers) → function.py (autograd Function,
checks, public function); naive.py is the dense float64 ground truth.
README.md has the maths and the memory bound.
"""

from rltrain_kernels.ops.linear_logprobs.chunk import ChunkConfig, workspace_bytes
from rltrain_kernels.ops.linear_logprobs.function import LinearLogprobsFunction, linear_logprobs
from rltrain_kernels.ops.linear_logprobs.naive import naive_linear_logprobs

__all__ = ["ChunkConfig", "LinearLogprobsFunction", "linear_logprobs", "naive_linear_logprobs", "workspace_bytes"]
