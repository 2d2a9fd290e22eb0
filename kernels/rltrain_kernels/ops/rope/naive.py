"""Plain-PyTorch rotary position embedding, verbatim HF transformers semantics: the ground truth the Triton kernels
are tested against, and the path taken when cos/sin need gradients or no kernel can run.

HF (`transformers.models.llama.modeling_llama.apply_rotary_pos_emb`):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    q_embed = q * cos + rotate_half(q) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) over the last dim, x1/x2 its two halves."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def naive_apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [B or 1, T, D] (unsqueeze_dim=1); [B, T, H, D] with unsqueeze_dim=2.
    Differentiable w.r.t. all four inputs. Dtypes promote as in HF (bf16 q with fp32 cos gives fp32)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
