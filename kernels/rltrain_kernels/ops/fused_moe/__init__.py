"""Fused mixture-of-experts MLP (top-k routed SwiGLU experts, Qwen3-MoE / Mixtral): grouped GEMMs over the routed
rows sorted by expert instead of transformers' per-expert Python loop, forward and backward.

    from rltrain_kernels.ops.fused_moe import fused_moe
    out = fused_moe(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights)

The routing (router logits, softmax, top-k, the auxiliary loss) stays with the caller: this op takes its result.
Layout as transformers 5's fused experts modules: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
Gradients reach hidden_states, both weights and top_k_weights. Files: routing.py (the sort and the row tiles),
grouped_gemm.py (the row-tiled kernels), weight_grad.py (the per-expert weight gradients), function.py (autograd and
the public function), naive.py (the reference and CPU fallback), npu.py (Ascend, torch_npu's grouped matmul).
README.md has the maths.
"""

from rltrain_kernels.ops.fused_moe.function import FusedMoEFunction, fused_moe
from rltrain_kernels.ops.fused_moe.naive import naive_fused_moe

__all__ = ["FusedMoEFunction", "fused_moe", "naive_fused_moe"]
