"""The delta-rule layers under Ulysses sequence parallelism (layers/base.py, rltrain_kernels.sequence_parallel) over
gloo: each rank runs its slice of a packed row and gets the whole row's output for its tokens; the input gradients are
the whole row's, and the parameter gradients summed over the ranks are the whole row's. Rows whose sequences cross
the cuts, one whose slices are shorter than the convolution's window (its taps reach two ranks back), 2 and 4 ranks,
fp32 against the same layer on the whole row in one process.

Run: `pytest tests/kernels/layers/test_sequence_parallel.py` (CPU, ~15 s: process starts).
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rltrain_kernels.layers import GatedDeltaNet, GatedDeltaProduct, IPLRLinearAttention, KimiDeltaAttention
from rltrain_kernels.sequence_parallel import SequenceParallel

LAYERS = {"gated_delta_rule": lambda: GatedDeltaNet(32, num_heads=4, head_dim=8),
          "gated_delta_product": lambda: GatedDeltaProduct(32, num_heads=4, head_dim=8, num_householder=2),
          "iplr": lambda: IPLRLinearAttention(32, num_heads=4, head_dim=8),
          "kda": lambda: KimiDeltaAttention(32, num_heads=4, head_dim=8)}
# sequence lengths of a packed row: the cuts fall inside sequences; [3, 2, 1] with 4 ranks: slices of 2 tokens, shorter
# than the conv's 3 taps back
ROWS = {"row13": [5, 7, 1], "row6": [3, 2, 1]}


def whole_row(kind: str, lengths: list[int]):
    """(layer, hidden states [1, T, 32] of the row padded to a multiple of 4 (the padding a sequence of its own),
    cu_seqlens, output weights for the loss), all from a fixed seed."""
    torch.manual_seed(0)
    layer = LAYERS[kind]()
    total = -(-sum(lengths) // 4) * 4
    cu_seqlens = torch.tensor([0] + lengths + ([total - sum(lengths)] if total > sum(lengths) else [])).cumsum(0)
    return layer, torch.randn(1, total, 32), cu_seqlens, torch.randn(1, total, 32)


def _rank_main(rank, world, port, results):
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    torch.set_num_threads(1)
    sp = SequenceParallel(dist.new_group(list(range(world))))
    for (kind, row), _ in results.items():
        layer, x, cu_seqlens, probe = whole_row(kind, ROWS[row])
        mine = slice(rank * x.shape[1] // world, (rank + 1) * x.shape[1] // world)
        local = x[:, mine].clone().requires_grad_(True)
        out, _ = layer(local, cu_seqlens=cu_seqlens.to(torch.int32), sequence_parallel=sp)
        (out * probe[:, mine]).sum().backward()
        grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
        for grad in grads.values():
            dist.all_reduce(grad)
        outs, input_grads = [torch.empty_like(out) for _ in range(world)], [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out.detach().contiguous())
        dist.all_gather(input_grads, local.grad.contiguous())
        if rank == 0:
            torch.save((torch.cat(outs, 1), torch.cat(input_grads, 1), grads), f"{results[(kind, row)]}")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["sp2", "sp4"])
def sharded(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"sp{request.param}")
    paths = {(kind, row): str(root / f"{kind}-{row}.pt") for kind in LAYERS for row in ROWS}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank_main, args=(request.param, port, paths), nprocs=request.param, join=True)
    return {key: torch.load(path) for key, path in paths.items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("kind", list(LAYERS))
def test_slices_match_the_whole_row(sharded, kind, row):
    out, input_grad, grads = sharded[(kind, row)]
    layer, x, cu_seqlens, probe = whole_row(kind, ROWS[row])
    x.requires_grad_(True)
    expected, _ = layer(x, cu_seqlens=cu_seqlens.to(torch.int32))
    (expected * probe).sum().backward()
    assert rel_err(out, expected.detach()) < 1e-5
    assert rel_err(input_grad, x.grad) < 1e-5
    for name, param in layer.named_parameters():
        assert param.grad.norm() > 0, name
        assert rel_err(grads[name], param.grad) < 1e-5, name
