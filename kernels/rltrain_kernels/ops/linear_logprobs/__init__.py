"""Fused linear → per-token log-probs and entropy, never materialising tokens × vocab logits.

    from rltrain_kernels.ops.linear_logprobs import linear_logprobs
    logprobs, entropy = linear_logprobs(hidden, lm_head.weight, labels, temperature=0.7)

Layers: kernel.py (Triton row passes, imported lazily) → chunk.py (tiling drivers, torch row passes, GEMMs) →
function.py (autograd Function, checks, public function); naive.py is the dense float64 ground truth.
README.md has the maths and the memory bound.
"""

from rltrain_kernels.ops.linear_logprobs.chunk import ChunkConfig, workspace_bytes
from rltrain_kernels.ops.linear_logprobs.function import LinearLogprobsFunction, linear_logprobs
from rltrain_kernels.ops.linear_logprobs.naive import naive_linear_logprobs

__all__ = ["ChunkConfig", "LinearLogprobsFunction", "linear_logprobs", "naive_linear_logprobs", "workspace_bytes"]
