"""`linear_kl_div` and `LinearKLDivLoss`: input checks, path choice (cuBLAS + the Triton row pass on CUDA, chunked
torch elsewhere) and the two autograd Functions (a reduced loss with its gradients from the forward; per-token KL
with a recomputing backward)."""

from __future__ import annotations

import torch
from torch import nn

from rltrain_kernels.ops.kl_div.chunk import DEFAULT_CHUNKS, KLDivChunkConfig, TorchKLRows, kl_div_chunks

IMPLS = ("auto", "triton", "torch")
REDUCTIONS = ("none", "sum", "mean", "batchmean")
DIRECTIONS = ("forward", "reverse")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _rows_pass(impl: str, device: torch.device, config: KLDivChunkConfig):
    """"triton" (cuBLAS GEMMs + the Triton row pass; "auto" on CUDA) or "torch" (elsewhere). Triton is imported
    here, not at package import."""
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "torch"
    if impl == "torch":
        return TorchKLRows()
    from rltrain_kernels.ops.kl_div import kernel

    kernel.check_runnable(device)
    return kernel.TritonKLRows(config.block_v)


class LinearKLDivFunction(torch.autograd.Function):
    """apply(hidden [N, H], weight [V, H], teacher_hidden [N, H_t], teacher_weight [V, H_t], valid [N], scale [N],
    inv_temp, reverse, rows_pass, config) → Σ scale·KL, a scalar. The gradients w.r.t. hidden and weight are
    computed in the forward (4 GEMMs in all); the backward scales them by the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, valid, scale, inv_temp, reverse, rows_pass,
                config):
        kl, grad_hidden, grad_weight = kl_div_chunks(
            hidden, weight, teacher_hidden, teacher_weight, valid, scale, inv_temp, reverse, rows_pass, config,
            need_grad_hidden=ctx.needs_input_grad[0], need_grad_weight=ctx.needs_input_grad[1])
        ctx.grads, ctx.rows_pass = [grad_hidden, grad_weight], rows_pass
        return torch.dot(kl, scale)

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("linear_kl_div computes its gradients in the forward and hands them over once; "
                               "backward through it twice (retain_graph) is not supported: call it again")
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None   # released with the graph's first use
        # in place, 2·V·H·2 B of traffic over grad_weight (0.6 GB at V=151936, H=2048), skipped on the device for
        # the usual upstream gradient 1.0 (no host sync)
        for g in (grad_hidden, grad_weight):
            if g is not None:
                ctx.rows_pass.scale_unless_one(g, grad_loss)
        return (grad_hidden, grad_weight) + (None,) * 8


class LinearKLDivPerTokenFunction(torch.autograd.Function):
    """apply(hidden, weight, teacher_hidden, teacher_weight, valid, inv_temp, reverse, rows_pass, config) → KL [N]
    fp32. The upstream gradient is per token, known only in the backward, which recomputes both logits tiles: 2
    GEMMs forward, 4 backward."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, valid, inv_temp, reverse, rows_pass, config):
        kl, _, _ = kl_div_chunks(hidden, weight, teacher_hidden, teacher_weight, valid, None, inv_temp, reverse,
                                 rows_pass, config, False, False)
        ctx.save_for_backward(hidden, weight, teacher_hidden, teacher_weight, valid)
        ctx.inv_temp, ctx.reverse, ctx.rows_pass, ctx.config = inv_temp, reverse, rows_pass, config
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_kl):
        hidden, weight, teacher_hidden, teacher_weight, valid = ctx.saved_tensors
        # any layout (expanded, strided) → [N] fp32 contiguous; rows that are not valid get 0 whatever it holds
        scale = torch.where(valid, grad_kl.reshape(-1).to(torch.float32), 0.0).contiguous()
        _, grad_hidden, grad_weight = kl_div_chunks(
            hidden, weight, teacher_hidden, teacher_weight, valid, scale, ctx.inv_temp, ctx.reverse, ctx.rows_pass,
            ctx.config, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return (grad_hidden, grad_weight) + (None,) * 7


def _check_options(temperature, reduction, direction, impl="auto") -> None:
    if not isinstance(temperature, (int, float)) or not 0 < float(temperature) < float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")


def _check_pair(hidden, weight, hidden_name: str, weight_name: str) -> None:
    """One side's hidden [..., H] and LM head [V, H]."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise ValueError(f"{hidden_name} must be a tensor of shape [..., H]")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{hidden_name} must be bfloat16, float16 or float32, got {hidden.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{weight_name} must have shape [V, H], got {tuple(getattr(weight, 'shape', ()))}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{weight_name} has hidden size {weight.shape[1]} but {hidden_name} has {hidden.shape[-1]} "
                         f"({weight_name} {tuple(weight.shape)}, {hidden_name} {tuple(hidden.shape)})")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{weight_name} dtype {weight.dtype} differs from {hidden_name} dtype {hidden.dtype}")


def _check_inputs(hidden, weight, teacher_hidden, teacher_weight, labels, config) -> None:
    _check_pair(hidden, weight, "hidden", "weight")
    _check_pair(teacher_hidden, teacher_weight, "teacher_hidden", "teacher_weight")
    if weight.shape[0] < 1:
        raise ValueError("weight must have at least one vocabulary row")
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"teacher_weight has {teacher_weight.shape[0]} vocabulary rows but weight has "
                         f"{weight.shape[0]}: the student's and the teacher's vocabularies must match (slice off a "
                         "padded LM head's extra rows)")
    if teacher_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"teacher_hidden shape {tuple(teacher_hidden.shape)} must have hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])} (one teacher state per student token)")
    for name, t in (("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):
        if t.requires_grad:
            raise ValueError(f"{name} requires grad: the teacher is frozen and gets no gradient here; pass "
                             f"{name}.detach() (or compute the teacher under torch.no_grad())")
    devices = {t.device for t in (hidden, weight, teacher_hidden, teacher_weight)}
    if labels is not None:
        if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype.is_complex:
            raise TypeError(f"labels must be an integer tensor, got {getattr(labels, 'dtype', type(labels))}")
        if labels.shape != hidden.shape[:-1]:
            raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden.shape[:-1] = "
                             f"{tuple(hidden.shape[:-1])}")
        devices.add(labels.device)
    if len(devices) != 1:
        raise ValueError(f"hidden, weight, teacher_hidden, teacher_weight (and labels) must be on one device, got "
                         f"{', '.join(sorted(map(str, devices)))}")
    if config is not None and not isinstance(config, KLDivChunkConfig):
        raise TypeError(f"chunk_config must be a KLDivChunkConfig, got {type(config).__name__}")


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """[..., D] → [N, D] with unit inner stride (a view when it can be)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def linear_kl_div(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
                  teacher_weight: torch.Tensor, *, temperature: float = 1.0, reduction: str = "batchmean",
                  direction: str = "forward", labels: torch.Tensor | None = None, ignore_index: int = -100,
                  impl: str = "auto", chunk_config: KLDivChunkConfig | None = None) -> torch.Tensor:
    """Per-token KL between the teacher's softmax(teacher_hidden @ teacher_weight.T / T) and the student's
    softmax(hidden @ weight.T / T), reduced, never materialising either tokens × vocab logits (the workspace is
    bounded by one chunk, KLDivChunkConfig). Differentiable w.r.t. hidden and weight; the teacher is frozen.

    Args:
        hidden: [..., H] bf16/fp16/fp32, the student's last hidden states. weight: [V, H], its LM head, same dtype.
        teacher_hidden: [..., H_t] with hidden's leading shape (H_t may differ from H). teacher_weight: [V, H_t]
            (same V), same dtype as teacher_hidden. Neither may require grad.
        temperature: divides both logits (no T² factor: scale the loss yourself for Hinton-style distillation).
        reduction: "none" (KL per token, fp32, hidden.shape[:-1]; 0 for ignored tokens), "sum", "mean" (over
            tokens that are not ignored) or "batchmean" (the sum over all N = hidden.shape[:-1].numel() tokens,
            ignored ones included: torch's and fla's FusedKLDivLoss' "batchmean" for [N, V] inputs).
        direction: "forward" = KL(teacher ‖ student) = Σ p_t (log p_t − log p_s), what F.kl_div(log p_s, log p_t,
            log_target=True) and fla compute; "reverse" = KL(student ‖ teacher), mode-seeking (on-policy
            distillation).
        labels, ignore_index: tokens whose label equals ignore_index give 0 loss and 0 gradient (labels are only
            compared with it); None: every token counts.
        impl: "auto" ("triton" on CUDA, else "torch"), "triton" (cuBLAS GEMMs + a Triton row pass; CPU tensors need
            TRITON_INTERPRET=1) or "torch" (the same chunks with torch row passes).
        chunk_config: tokens per chunk (the workspace: 8·rows·V bytes), see KLDivChunkConfig.

    Returns:
        a scalar fp32 loss, or [...] fp32 per-token KL for reduction="none". A reduced loss computes its gradients
        in the forward (4 GEMMs, the teacher's once) and can be backpropagated once; "none" recomputes both logits
        in its backward (6 GEMMs).

    fla's `fused_kl_div_loss(x, target_x, weight, target_weight, reduction="batchmean")` is
    `linear_kl_div(x, weight, target_x, target_weight)`.
    """
    _check_options(temperature, reduction, direction, impl)
    _check_inputs(hidden, weight, teacher_hidden, teacher_weight, labels, chunk_config)
    config = chunk_config or DEFAULT_CHUNKS
    out_shape = hidden.shape[:-1]
    hidden2d, teacher2d = _rows_of(hidden), _rows_of(teacher_hidden)
    n = hidden2d.shape[0]
    rows_pass = _rows_pass(impl, hidden.device, config)
    if labels is None:
        valid = torch.ones(n, dtype=torch.bool, device=hidden.device)
    else:
        valid = (labels.reshape(-1) != ignore_index).contiguous()
    inv_temp, reverse = 1.0 / float(temperature), direction == "reverse"
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if reduction == "none":
        args = (hidden2d, weight, teacher2d, teacher_weight, valid, inv_temp, reverse, rows_pass, config)
        if needs_grad:
            return LinearKLDivPerTokenFunction.apply(*args).view(out_shape)
        return kl_div_chunks(*args[:5], None, *args[5:], False, False)[0].view(out_shape)
    # loss = Σ scale·KL with the reduction's per-token weights (on the device: no sync for the token count)
    if reduction == "sum":
        scale = valid.to(torch.float32)
    elif reduction == "batchmean":
        scale = valid.to(torch.float32) / max(n, 1)
    else:
        scale = valid.to(torch.float32) / valid.sum().clamp(min=1).to(torch.float32)
    args = (hidden2d, weight, teacher2d, teacher_weight, valid, scale, inv_temp, reverse, rows_pass, config)
    if needs_grad:
        return LinearKLDivFunction.apply(*args)
    kl = kl_div_chunks(*args, False, False)[0]
    return torch.dot(kl, scale)


class LinearKLDivLoss(nn.Module):
    """`linear_kl_div` as a module, its options fixed at construction (fla's FusedKLDivLoss shape, with the student's
    tensors first): loss = LinearKLDivLoss(temperature=1.0, reduction="batchmean", direction="forward")(hidden,
    weight, teacher_hidden, teacher_weight, labels=None)."""

    def __init__(self, temperature: float = 1.0, reduction: str = "batchmean", direction: str = "forward",
                 ignore_index: int = -100, impl: str = "auto", chunk_config: KLDivChunkConfig | None = None):
        super().__init__()
        _check_options(temperature, reduction, direction, impl)
        self.temperature, self.reduction, self.direction = temperature, reduction, direction
        self.ignore_index, self.impl, self.chunk_config = ignore_index, impl, chunk_config

    def forward(self, hidden, weight, teacher_hidden, teacher_weight, labels=None):
        return linear_kl_div(hidden, weight, teacher_hidden, teacher_weight, temperature=self.temperature,
                             reduction=self.reduction, direction=self.direction, labels=labels,
                             ignore_index=self.ignore_index, impl=self.impl, chunk_config=self.chunk_config)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, reduction={self.reduction!r}, direction={self.direction!r}"
