"""Rotary position embedding's public entry: the autograd Function over kernel.py and `apply_rotary_pos_emb` (the
kernel, or naive.py's form for what it cannot take).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from rltrain_kernels.ops.rope.kernel import rope_apply
from rltrain_kernels.ops.rope.naive import naive_apply_rotary_pos_emb
from rltrain_kernels.utils import triton_interpreted

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _to_bhtd(t: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """The [B, H, T, D] view of a q/k in either layout (a free transpose for the [B, T, H, D] one)."""
    return t if unsqueeze_dim == 1 else t.transpose(1, 2)


class RotaryEmbeddingFunction(torch.autograd.Function):
    """apply(q, k, cos, sin, unsqueeze_dim) -> (q_embed, k_embed); gradients for q and k only (cos/sin are
    treated as constants: use the naive function when they need gradients)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        q_out_dtype = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)
        k_out_dtype = torch.promote_types(torch.promote_types(k.dtype, cos.dtype), sin.dtype)
        q_embed, k_embed = rope_apply(_to_bhtd(q, unsqueeze_dim), _to_bhtd(k, unsqueeze_dim), cos, sin,
                                      q_out_dtype, k_out_dtype)
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        ctx.q_dtype, ctx.k_dtype = q.dtype, k.dtype
        ctx.set_materialize_grads(False)  # an unused k_embed (or q_embed) costs no zero tensor and no kernel work
        return _to_bhtd(q_embed, unsqueeze_dim), _to_bhtd(k_embed, unsqueeze_dim)

    @staticmethod
    @once_differentiable  # the backward kernels are not themselves differentiable
    def backward(ctx, dq_embed, dk_embed):
        cos, sin = ctx.saved_tensors
        dim = ctx.unsqueeze_dim
        if dq_embed is None and dk_embed is None:
            return None, None, None, None, None
        dq, dk = rope_apply(_to_bhtd(dq_embed, dim) if dq_embed is not None else None,
                            _to_bhtd(dk_embed, dim) if dk_embed is not None else None,
                            cos, sin, ctx.q_dtype, ctx.k_dtype, backward=True)
        dq = _to_bhtd(dq, dim) if dq is not None else None
        dk = _to_bhtd(dk, dim) if dk is not None else None
        return dq, dk, None, None, None


def _kernel_supported(q, k, cos, sin, unsqueeze_dim) -> bool:
    if unsqueeze_dim not in (1, 2) or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return False
    tensors = (q, k, cos, sin)
    if not all((t.is_cuda or triton_interpreted()) and t.dtype in _KERNEL_DTYPES for t in tensors):
        return False
    if len({t.device for t in tensors}) != 1:
        return False
    qb, kb = _to_bhtd(q, unsqueeze_dim), _to_bhtd(k, unsqueeze_dim)
    batch, _, n_tokens, head_dim = qb.shape
    if kb.shape[0] != batch or kb.shape[2:] != (n_tokens, head_dim) or head_dim % 2:
        return False
    return all(t.shape[0] in (1, batch) and t.shape[1:] == (n_tokens, head_dim) for t in (cos, sin))


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's apply_rotary_pos_emb: (q·cos + rotate_half(q)·sin, k·cos + rotate_half(k)·sin), cos/sin unsqueezed at
    `unsqueeze_dim` (1: q/k are [B, H, T, D]; 2: [B, T, H, D])."""
    if not _kernel_supported(q, k, cos, sin, unsqueeze_dim):
        return naive_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    return RotaryEmbeddingFunction.apply(q, k, cos, sin, unsqueeze_dim)
