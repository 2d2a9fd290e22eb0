"""`linear_logprobs`: input checks, path choice (fused Triton GEMMs or cuBLAS + Triton row passes on CUDA, chunked
torch elsewhere) and the autograd Function."""

from __future__ import annotations

import torch

from rltrain_kernels.ops.common.vocab_tiles import TorchTiles
from rltrain_kernels.ops.linear_logprobs.chunk import (
    DEFAULT_CHUNKS, ChunkConfig, VocabShard, backward_chunks, forward_chunks, vocab_shard,
)

IMPLS = ("auto", "fused", "triton", "torch")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _tiles(impl: str, hidden: torch.Tensor, weight: torch.Tensor, config: ChunkConfig):
    """The tile backend: "fused" (Triton GEMMs carrying the row passes), "triton" (cuBLAS GEMMs, Triton row
    passes) or "torch" (cuBLAS/CPU GEMMs, torch row passes). Triton is imported here, not at package import."""
    if impl == "auto":
        if hidden.device.type != "cuda":
            impl = "torch"
        else:
            from rltrain_kernels.ops.common import vocab_gemm

            impl = "fused" if vocab_gemm.supports(hidden, weight) else "triton"
    if impl == "torch":
        return TorchTiles()
    from rltrain_kernels.ops.common import row_pass

    row_pass.check_runnable(hidden.device)
    if impl == "triton":
        return row_pass.TritonTiles(config.block_v)
    from rltrain_kernels.ops.common import vocab_gemm
    from rltrain_kernels.ops.linear_logprobs.fused import FusedTiles

    vocab_gemm.check_runnable(hidden, weight)
    return FusedTiles(config.gemm)


class LinearLogprobsFunction(torch.autograd.Function):
    """hidden [N, H], weight [V_local, H], labels [N] → (logprobs [N] fp32, entropy [N] fp32 or None)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, ignore_index, return_entropy, shard, tiles, config):
        inv_temp = 1.0 / temperature
        logprobs, entropy, row_max, log_sum = forward_chunks(hidden, weight, labels, inv_temp, ignore_index,
                                                             return_entropy, shard, tiles, config)
        ctx.set_materialize_grads(False)   # an unused output's gradient arrives as None and costs nothing
        ctx.save_for_backward(hidden, weight, labels, row_max, log_sum, entropy)
        ctx.inv_temp, ctx.ignore_index, ctx.shard, ctx.tiles, ctx.config = inv_temp, ignore_index, shard, tiles, config
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logprob, g_entropy):
        hidden, weight, labels, row_max, log_sum, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logprob is None and g_entropy is None) or not (need_hidden or need_weight):
            return None, None, None, None, None, None, None, None, None
        ignored = labels == ctx.ignore_index

        def prepare(g):  # any layout (expanded, strided, zero) → [N] fp32 contiguous, ignored rows zeroed
            if g is None:
                return None
            g = g.reshape(-1).to(torch.float32)
            return torch.where(ignored, 0.0, g).contiguous()

        grad_hidden, grad_weight = backward_chunks(
            hidden, weight, labels, row_max, log_sum, entropy, prepare(g_logprob), prepare(g_entropy), ctx.inv_temp,
            ctx.shard, ctx.tiles, need_hidden, need_weight, ctx.config)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def _check_inputs(hidden, weight, labels, temperature, impl):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise ValueError("hidden must be a tensor of shape [..., H]")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be bfloat16, float16 or float32, got {hidden.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must have shape [V, H], got {tuple(getattr(weight, 'shape', ()))}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight has hidden size {weight.shape[1]} but hidden has {hidden.shape[-1]} "
                         f"(weight {tuple(weight.shape)}, hidden {tuple(hidden.shape)})")
    if weight.shape[0] < 1:
        raise ValueError("weight must have at least one vocabulary row")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64:
        raise TypeError(f"labels must be an int64 tensor, got {getattr(labels, 'dtype', type(labels))}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(f"hidden, weight and labels must be on one device, got {hidden.device}, "
                         f"{weight.device}, {labels.device}")
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")


def _check_label_range(labels: torch.Tensor, ignore_index: int, vocab: int) -> None:
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if labels.is_cuda:
        # no host sync: a device-side assert, as F.cross_entropy does
        torch._assert_async(~bad.any(), f"labels must lie in [0, {vocab}) or equal ignore_index")
    elif bad.any():
        raise ValueError(f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}; "
                         f"got {labels[bad][:5].tolist()}")


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                    ignore_index: int = -100, return_entropy: bool = True, *, tp_group=None, impl: str = "auto",
                    chunk_config: ChunkConfig | None = None):
    """log p(label) and the entropy of softmax(hidden @ weight.T / temperature), never materialising the logits.

    Args:
        hidden: [..., H] bf16/fp16/fp32. weight: [V, H] (this rank's vocab slice when tp_group is set), same dtype.
        labels: [...] int64 global token ids; rows equal to `ignore_index` give 0 and no gradient.
        return_entropy: False skips all entropy work; entropy is then None.
        tp_group: process group splitting the vocabulary (contiguous slices in rank order); the results and
            grad_hidden equal the unsplit computation, grad_weight is this rank's slice of it.
        impl: "auto" (on CUDA: "fused" for bf16/fp16 on sm_90+, else "triton"; "torch" elsewhere), "fused"
            (Triton GEMMs with the row passes in their epilogues), "triton" (cuBLAS GEMMs + Triton row passes)
            or "torch" (chunked torch). "fused"/"triton" on CPU tensors need TRITON_INTERPRET=1.
        chunk_config: tile sizes (see ChunkConfig; they bound the workspace) and the fused path's GemmConfig.

    Returns:
        (logprobs, entropy): fp32 with labels' shape; entropy is None when return_entropy=False.
    """
    _check_inputs(hidden, weight, labels, temperature, impl)
    config = chunk_config or DEFAULT_CHUNKS
    shard = vocab_shard(weight, tp_group) if tp_group is not None else VocabShard(None, 0, weight.shape[0])
    _check_label_range(labels, ignore_index, shard.total)
    out_shape = labels.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    if hidden2d.stride(-1) != 1:
        hidden2d = hidden2d.contiguous()
    tiles = _tiles(impl, hidden2d, weight, config)
    labels1d = labels.reshape(-1).contiguous()  # the row passes read label i at labels + i (a strided view too)
    args = (hidden2d, weight, labels1d, float(temperature), int(ignore_index), bool(return_entropy), shard, tiles,
            config)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        logprobs, entropy = LinearLogprobsFunction.apply(*args)
    else:
        logprobs, entropy, _, _ = forward_chunks(hidden2d, weight, labels1d, 1.0 / float(temperature),
                                              int(ignore_index), bool(return_entropy), shard, tiles, config)
    logprobs = logprobs.view(out_shape)
    return logprobs, (entropy.view(out_shape) if entropy is not None else None)
