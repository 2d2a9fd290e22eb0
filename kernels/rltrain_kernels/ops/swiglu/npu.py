"""SwiGLU on Ascend NPUs through torch_npu.npu_swiglu, which takes gate and up concatenated on the last dim
(first half gated) and needs a contiguous input: the cat provides both."""

import torch


def npu_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    import torch_npu

    return torch_npu.npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)
