"""The delta-rule family's shared bookkeeping (ops/common): chunk layouts (padded batches cached by shape, packed ones
by their cu_seqlens tensor), the packed offsets' validation (once per cu_seqlens tensor) and the state passes' choice
of value block."""

import gc

import pytest
import torch

from rltrain_kernels.ops.common import state_pass
from rltrain_kernels.ops.common.chunking import chunk_layout
from rltrain_kernels.ops.common.inputs import check_packing


def test_padded_layouts_are_cached_by_shape():
    a = chunk_layout(2, 130, None, 64, torch.device("cpu"))
    assert chunk_layout(2, 130, None, 64, torch.device("cpu")) is a
    assert a.num_chunks == 6 and a.cu_seqlens.tolist() == [0, 130, 260]
    assert a.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


def test_packed_layouts_are_cached_by_their_cu_seqlens_tensor(monkeypatch):
    """Every layer of a forward gets the same cu_seqlens tensor: its layout is read (a host sync on a GPU) once. An
    in-place change, another tensor with other lengths, another chunk size, an inference-mode tensor and a freed
    tensor whose memory comes back each get a layout of their own lengths."""
    cpu = torch.device("cpu")
    cu = torch.tensor([0, 1, 65, 200])
    packed = chunk_layout(1, 200, cu, 64, cpu)
    assert packed.chunk_offsets.tolist() == [0, 1, 2, 5] and packed.max_len == 135
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real_tolist(t))
    for _ in range(3):
        assert chunk_layout(1, 200, cu, 64, cpu) is packed
    assert reads == []
    assert chunk_layout(1, 200, cu, 32, cpu).chunk_offsets.tolist() == [0, 1, 3, 8]
    steps = chunk_layout(1, 200, cu, 64, cpu, steps=2)  # the gated delta product's n_h rows per token
    assert steps.cu_seqlens.tolist() == [0, 2, 130, 400] and steps.chunk_offsets.tolist() == [0, 1, 3, 8]
    assert chunk_layout(2, 100, None, 64, cpu, steps=3).cu_seqlens.tolist() == [0, 300, 600]
    cu[2] = 100  # in place: the version counter moves
    moved = chunk_layout(1, 200, cu, 64, cpu)
    assert moved.chunk_offsets.tolist() == [0, 1, 3, 5] and moved.max_len == 100
    assert chunk_layout(1, 200, torch.tensor([0, 200]), 64, cpu).num_chunks == 4
    with torch.inference_mode():
        frozen = torch.tensor([0, 7, 200])
        assert chunk_layout(1, 200, frozen, 64, cpu) is not chunk_layout(1, 200, frozen, 64, cpu)
    del cu, moved
    gc.collect()
    again = torch.tensor([0, 150, 200])  # may reuse the freed tensor's id and memory
    assert chunk_layout(1, 200, again, 64, cpu).chunk_offsets.tolist() == [0, 3, 4]


def test_packed_offsets_are_validated_once_per_cu_seqlens_tensor(monkeypatch):
    """The ops' argument checks read cu_seqlens (a host sync on a GPU) once per tensor and T, not at every layer: an
    in-place change is read, and rejected, again; a wrong T or an inference-mode tensor is read every time."""
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real_tolist(t))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert [check_packing(1, 10, cu) for _ in range(3)] == [2, 2, 2]
    assert len(reads) == 1
    with pytest.raises(ValueError, match=r"end at T=12, got \[0, 3, 10\]"):
        check_packing(1, 12, cu)
    cu[1] = 11  # in place: read again, and now wrong
    with pytest.raises(ValueError, match=r"non-decreasing and end at T=10, got \[0, 11, 10\]"):
        check_packing(1, 10, cu)
    with pytest.raises(ValueError, match="non-decreasing"):
        check_packing(1, 10, cu)
    with torch.inference_mode():
        frozen = torch.tensor([0, 4, 10])
    reads.clear()
    assert [check_packing(1, 10, frozen) for _ in range(2)] == [2, 2]
    assert len(reads) == 2


def test_state_pass_value_block(monkeypatch):
    monkeypatch.setattr(state_pass, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    # 8 sequences × 16 heads × 128/64 = 256 programs fill 132 SMs: the 64-column settings
    assert state_pass.state_launch("state_pass_fwd", 128, 128, 128, cpu) == ("state_pass_fwd_wide", 128, 64)
    # 2 × 16 × 2 = 64 programs would leave SMs idle: NARROW_BV's columns (the reverse pass 32, the forward 16)
    assert state_pass.state_launch("state_pass_bwd", 32, 128, 128, cpu) == ("state_pass_bwd", 128, 32)
    assert state_pass.state_launch("state_pass_fwd", 32, 128, 128, cpu) == ("state_pass_fwd", 128, 16)
    assert state_pass.state_launch("iplr_state_pass_fwd", 32, 128, 128, cpu) == ("iplr_state_pass_fwd", 128, 32)
    # wide keys stay narrow; narrow values take V when it is below the narrow width (V >= 16: tl.dot tiles)
    assert state_pass.state_launch("state_pass_bwd", 512, 256, 128, cpu) == ("state_pass_bwd", 256, 32)
    assert state_pass.state_launch("state_pass_bwd", 512, 64, 16, cpu) == ("state_pass_bwd", 64, 16)
    monkeypatch.setattr(state_pass, "NARROW_BV", {})
    assert state_pass.state_launch("state_pass_fwd", 32, 128, 128, cpu) == ("state_pass_fwd", 128, 32)
