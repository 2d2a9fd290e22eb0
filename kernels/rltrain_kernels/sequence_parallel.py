"""Ulysses sequence parallelism's all-to-all (DeepSpeed-Ulysses; verl's `ulysses_sequence_parallel_size`): each rank
of a group holds a contiguous slice of a packed row's tokens; a token mixer that needs the whole sequence (softmax
attention, a delta-rule recurrence) switches to a slice of the heads over all the tokens with one all-to-all, runs
unchanged on those heads, and switches back with the reverse one. Every other layer is token-local and runs on the
rank's own tokens; `gather` collects per-token pieces (a short convolution's inputs before the cut, log-probs).

    sp = SequenceParallel(group)            # torch.distributed process group of the ranks sharing a row
    q = sp.gather_sequence(q, head_dim=2, seq_dim=1)   # [1, T/n, H, D] -> [1, T, H/n, D]
    o = sp.scatter_sequence(o, head_dim=2, seq_dim=1)  # [1, T, H/n, D] -> [1, T/n, H, D]

All three are differentiable (the backward of one all-to-all is the other), so gradients come back to the rank whose tokens made
them. The callers (rltrain's attention function, the delta-rule layers) get the object through their forward's
keyword arguments, never from global state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """x cut into `size` chunks along scatter_dim, chunk j sent to rank j; the chunks received, rank order,
    concatenated along gather_dim."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        # every rank's gradient of every part, summed; this rank's part is its input's (gloo has no reduce-scatter)
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), ctx.dim)[dist.get_rank(ctx.group)], None, None


class SequenceParallel:
    """The ranks sharing a row (a torch.distributed group): this rank's place in it and the two all-to-alls."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def gather_sequence(self, x: torch.Tensor, head_dim: int, seq_dim: int) -> torch.Tensor:
        """This rank's tokens of every head → every token of this rank's heads (heads must divide by size)."""
        return _AllToAll.apply(x, head_dim, seq_dim, self.group)

    def scatter_sequence(self, x: torch.Tensor, head_dim: int, seq_dim: int) -> torch.Tensor:
        """Every token of this rank's heads → this rank's tokens of every head (gather_sequence's inverse)."""
        return _AllToAll.apply(x, seq_dim, head_dim, self.group)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x (same shapes), rank order, concatenated along dim; differentiable (each rank's x gets the
        sum of every rank's gradient of its part)."""
        return _AllGather.apply(x, dim, self.group)

    def heads(self, num_heads: int) -> slice:
        """The heads (of num_heads) this rank runs between the two all-to-alls."""
        share = num_heads // self.size
        return slice(self.rank * share, (self.rank + 1) * share)
