"""Rotary embedding on Ascend NPUs through torch_npu.npu_rotary_mul (x·r1 + rotate_half(x)·r2), with
transformers' apply_rotary_pos_emb signature."""

import torch


def npu_apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    import torch_npu

    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return torch_npu.npu_rotary_mul(q, cos, sin), torch_npu.npu_rotary_mul(k, cos, sin)
