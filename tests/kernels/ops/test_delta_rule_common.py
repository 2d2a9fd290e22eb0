"""The delta-rule family's shared bookkeeping (ops/common): chunk layouts (padded batches cached, packed ones built
from cu_seqlens every call) and the state passes' choice of value block."""

import torch

from rltrain_kernels.ops.common import state_pass
from rltrain_kernels.ops.common.chunking import chunk_layout


def test_padded_layouts_are_cached_and_packed_ones_are_not():
    a = chunk_layout(2, 130, None, 64, torch.device("cpu"))
    assert chunk_layout(2, 130, None, 64, torch.device("cpu")) is a
    assert a.num_chunks == 6 and a.cu_seqlens.tolist() == [0, 130, 260]
    assert a.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    cu = torch.tensor([0, 1, 65, 200])
    packed = chunk_layout(1, 200, cu, 64, torch.device("cpu"))
    assert chunk_layout(1, 200, cu, 64, torch.device("cpu")) is not packed
    assert packed.chunk_offsets.tolist() == [0, 1, 2, 5] and packed.max_len == 135


def test_state_pass_value_block(monkeypatch):
    monkeypatch.setattr(state_pass, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    # 8 sequences × 16 heads × 128/64 = 256 programs fill 132 SMs: the 64-column settings
    assert state_pass._state_launch("state_pass_fwd", 128, 128, 128, cpu) == ("state_pass_fwd_wide", 128, 64)
    # 2 × 16 × 2 = 64 programs would leave SMs idle: 32 columns, twice the programs
    assert state_pass._state_launch("state_pass_bwd", 32, 128, 128, cpu) == ("state_pass_bwd", 128, 32)
    # wide keys and narrow values stay at 32 (or V)
    assert state_pass._state_launch("state_pass_fwd", 512, 256, 128, cpu) == ("state_pass_fwd", 256, 32)
    assert state_pass._state_launch("state_pass_fwd", 512, 64, 16, cpu) == ("state_pass_fwd", 64, 16)
