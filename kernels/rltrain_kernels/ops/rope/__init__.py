"""Rotary position embedding with HF transformers' semantics: public function and autograd Function.

    from rltrain_kernels.ops.rope import apply_rotary_pos_emb
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)                   # q [B, Hq, T, D], k [B, Hk, T, D]
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)  # q [B, T, Hq, D], k [B, T, Hk, D]

cos/sin are [B, T, D] or [1, T, D] (broadcast over the batch), as HF's rotary embedding returns them; the two halves
of cos/sin may differ. Output dtypes promote as in HF (q's dtype when cos/sin share it, the usual case). Gradients
flow to q and k through the Triton kernels. Falls back to `naive_apply_rotary_pos_emb` (same results, eager speed)
when cos or sin requires grad, for float64 or CPU tensors outside the Triton interpreter, odd head dims, or shapes
other than the two layouts above.
"""

from rltrain_kernels.ops.rope.function import RotaryEmbeddingFunction, apply_rotary_pos_emb
from rltrain_kernels.ops.rope.naive import naive_apply_rotary_pos_emb, rotate_half

__all__ = ["RotaryEmbeddingFunction", "apply_rotary_pos_emb", "naive_apply_rotary_pos_emb", "rotate_half"]
