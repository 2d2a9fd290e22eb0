"""`fused_policy_loss`: argument checks, path choice, and the autograd Function whose backward only scales the
gradients the forward already computed."""

from __future__ import annotations

import torch

from rltrain_kernels.ops.common.vocab_tiles import TorchTiles
from rltrain_kernels.ops.policy_loss.chunk import (
    DEFAULT_CHUNKS, DenseChunkLogits, LossBuffers, PolicyLossChunkConfig, TorchLossOps, aggregation_weights,
    loss_and_metrics, policy_loss_chunks,
)
from rltrain_kernels.ops.policy_loss.options import (
    Metrics, PolicyLossOptions, PolicyLossOutput, check_inputs, check_label_range,
)
from rltrain_kernels.ops.policy_loss.naive import reference_policy_loss

IMPLS = ("auto", "fused", "triton", "torch", "reference")
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# impl="auto" off CUDA: dense reference up to this many logits (fp32 logits + log-softmax + probs ≈ 12 B each:
# 48 MiB), chunked torch beyond.
_REFERENCE_MAX_LOGITS = 1 << 22


def _backends(impl: str, hidden2d: torch.Tensor, weight: torch.Tensor, config: PolicyLossChunkConfig,
              entropy_bonus: bool = False):
    """(chunk logits, loss ops) of a chunked path: "fused" (the fused Triton GEMM, ops/common/vocab_gemm.py, with
    the statistics in its epilogue; keeping bf16 E = e^(z − R) for the gradient GEMMs, scaled.py, unless the weights
    are fp16 or an entropy bonus needs log p per logit: then fp16 y and a dlogits pass, shifted.py), "triton"
    (cuBLAS + Triton row passes), "auto" (on CUDA: fused where it can run, else triton) or "torch". Triton is
    imported here, not at package import."""
    if impl == "torch":
        return DenseChunkLogits(TorchTiles()), TorchLossOps()
    from rltrain_kernels.ops.common import row_pass, vocab_gemm
    from rltrain_kernels.ops.policy_loss.kernel import TritonLossOps

    row_pass.check_runnable(hidden2d.device)
    if impl == "auto":
        impl = "fused" if vocab_gemm.supports(hidden2d, weight) else "triton"
    if impl == "triton":
        return DenseChunkLogits(row_pass.TritonTiles(config.block_v)), TritonLossOps()
    vocab_gemm.check_runnable(hidden2d, weight)
    fused = vocab_gemm.FusedGemm(config.gemm)
    if weight.dtype == torch.bfloat16 and not entropy_bonus:
        from rltrain_kernels.ops.policy_loss.scaled import ScaledChunkLogits

        return ScaledChunkLogits(fused), TritonLossOps()
    from rltrain_kernels.ops.policy_loss.shifted import ShiftedChunkLogits

    return ShiftedChunkLogits(fused), TritonLossOps()


def _resolve_impl(impl: str, hidden: torch.Tensor, vocab: int) -> str:
    """The path; "auto" on CUDA stays "auto" for `_backends`, which picks fused or triton from the 2-D operands."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {', '.join(repr(i) for i in IMPLS)}")
    if impl == "auto":
        if hidden.dtype not in _FUSED_DTYPES:
            return "reference"
        if hidden.is_cuda:
            return "auto"
        return "reference" if hidden.shape[0] * hidden.shape[1] * vocab <= _REFERENCE_MAX_LOGITS else "torch"
    if impl != "reference" and hidden.dtype not in _FUSED_DTYPES:
        raise TypeError(f"impl={impl!r} takes bfloat16, float16 or float32 hidden/weight, got {hidden.dtype}; "
                        f"use impl='reference' (or 'auto') for {hidden.dtype}")
    return impl


class FusedPolicyLossFunction(torch.autograd.Function):
    """apply(hidden [N, H], weight [V, H], labels [N], buffers, seq_len, opts, chunk_logits, loss_ops, config)
    → (loss, logprobs [N], entropy [N], metrics [4]); only loss is differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, buffers, seq_len, opts, chunk_logits, loss_ops, config):
        grad_hidden, grad_weight = policy_loss_chunks(
            hidden, weight, labels, buffers, seq_len, opts, chunk_logits, loss_ops, config,
            need_grad_hidden=ctx.needs_input_grad[0], need_grad_weight=ctx.needs_input_grad[1])
        loss, metrics = loss_and_metrics(buffers)
        ctx.grads, ctx.loss_ops = [grad_hidden, grad_weight], loss_ops
        ctx.mark_non_differentiable(buffers.logp, buffers.entropy, metrics)
        ctx.set_materialize_grads(False)
        return loss, buffers.logp, buffers.entropy, metrics

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        if ctx.grads is None:
            raise RuntimeError("fused_policy_loss computes its gradients in the forward and hands them over once; "
                               "backward through it twice (retain_graph) is not supported — call it again")
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None   # release them with the graph's first use
        if grad_loss is None:
            return (None,) * 9
        # Scaling in place costs 2·V·H·2 B of traffic (0.6 ms at V=151936, H=4096 on H200, 1.4% of the 3-GEMM
        # floor), skipped for the common upstream gradient 1.0 — decided on the device, not by a host sync
        for g in (grad_hidden, grad_weight):
            if g is not None:
                ctx.loss_ops.scale_unless_one(g, grad_loss)
        return (grad_hidden, grad_weight) + (None,) * 7


def fused_policy_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                      advantages: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
                      *, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                      kl_coef: float = 0.0, kl_type: str = "k3", entropy_coef: float = 0.0,
                      loss_agg: str = "token-mean", importance_level: str = "token", temperature: float = 1.0,
                      norm_tokens: float | None = None, norm_len: float | None = None,
                      cu_seqlens: torch.Tensor | None = None, loss_weights: torch.Tensor | None = None,
                      impl: str = "auto", chunk_config: PolicyLossChunkConfig | None = None) -> PolicyLossOutput:
    """PPO/GRPO/GSPO policy loss straight from the last hidden states, never materialising the [B·T, V] logits;
    the gradients w.r.t. hidden and weight are computed inside this call (3 GEMMs in all) and handed to autograd.

    Args:
        hidden: [B, T, H] bf16/fp16/fp32 (float64: reference path). weight: [V, H] (the LM head), same dtype.
        labels: [B, T] integer token ids (anything where mask == 0). mask: [B, T] bool or 0/1.
        advantages: [B] or [B, T]. old_logprobs, ref_logprobs: [B, T] (ref only needed when kl_coef != 0).
            old_logprobs=None: on-policy, π_old = π_θ (old = logp, detached): the ratio is 1 and its gradient
            that of logp, as in a PPO step whose batch was sampled by the weights being trained.
        cu_seqlens: [N + 1] integer sequence starts for a packed batch (B = 1: the row holds N sequences back to
            back, like the delta-rule ops' varlen form); the sequence aggregations and Dr.GRPO's B count those
            sequences, and norm_len defaults to the longest one. Not with importance_level="sequence".
        loss_weights: [B, T] per-token weights w, loss = Σ w·L, in place of loss_agg's own (which these must be
            0 wherever mask is): for a caller holding part of a row whose weights depend on all of it (sequence
            parallelism: `aggregation_weights` of the whole row, sliced). Token-level importance only.
        impl: "auto" (on CUDA "fused" for bf16/fp16 on sm_90+, else "triton"; off CUDA the dense reference up
            to 4M logits, chunked torch beyond), "fused" (Triton GEMM with the row statistics in its epilogue,
            fp16 shifted logits kept for the gradient pass), "triton" (cuBLAS + Triton row passes over an fp32
            tile; CPU tensors need TRITON_INTERPRET=1 for both), "torch" (chunked) or "reference" (dense).
        chunk_config: tokens per chunk (bounds the workspace: rows·V·4 B, ~rows·V·2 B fused) and the fused path's
            GemmConfig, see PolicyLossChunkConfig.

    Definitions (m = mask; masked tokens contribute nothing and get logp = entropy = 0):
        logp = log_softmax(h·Wᵀ / temperature)[label], entropy = −Σ p log p, ratio = exp(logp − old).
        pg = max(−A·ratio, −A·clamp(ratio, 1 − clip_low, 1 + clip_high)); dual_clip = c (> 1), where A < 0:
            pg = min(pg, −A·c).
        kl (kl_type): k1 = logp − ref, k2 = ½(logp − ref)², k3 = exp(ref − logp) − (ref − logp) − 1
            with ref − logp clamped to ±20 and k3 to <= 10 (verl's low_var_kl; no gradient where a bound acts).
        per-token L = pg + kl_coef·kl − entropy_coef·entropy.
        loss_agg: "token-mean" Σ L·m / Σ m (/ norm_tokens when given: the global token count over micro-batches
            and ranks); "seq-mean-token-sum" mean over sequences with Σm > 0 of Σ_t L·m; "seq-mean-token-mean"
            mean over those sequences of Σ_t L·m / Σ_t m; "seq-mean-token-sum-norm" Σ L·m / (B·norm_len),
            norm_len defaulting to T (Dr.GRPO). A zero denominator gives loss 0.
        importance_level="sequence" (GSPO, use with loss_agg="seq-mean-token-mean"): one ratio per sequence,
            exp(Σ_t m·(logp − old) / Σ_t m), clipped as above and applied to every token of the sequence.
        metrics: clipfrac = fraction of masked tokens with the clipped branch active (−A·clamp(r) > −A·r);
            ppo_kl = mean over masked tokens of old − logp; ref_kl = mean k3 vs ref (0 without ref);
            entropy = mean over masked tokens.

    Returns:
        PolicyLossOutput(loss: scalar differentiable w.r.t. hidden and weight; logprobs, entropy: [B, T] fp32,
        detached; metrics: a Metrics mapping of floats, read from the device at first use). Backward can run once
        per call.
    """
    opts = PolicyLossOptions(clip_low, clip_high, dual_clip, kl_coef, kl_type, entropy_coef, loss_agg,
                             importance_level, temperature, norm_tokens, norm_len)
    check_inputs(hidden, weight, labels, mask, advantages, old_logprobs, ref_logprobs, opts, cu_seqlens, loss_weights)
    if chunk_config is not None and not isinstance(chunk_config, PolicyLossChunkConfig):
        raise TypeError(f"chunk_config must be a PolicyLossChunkConfig, got {type(chunk_config).__name__}")
    impl = _resolve_impl(impl, hidden, weight.shape[0])
    if impl == "reference":
        return reference_policy_loss(hidden, weight, labels, mask, advantages, old_logprobs, ref_logprobs,
                                     cu_seqlens=cu_seqlens, loss_weights=loss_weights,
                                     **{k: getattr(opts, k) for k in opts.__dataclass_fields__})
    config = chunk_config or DEFAULT_CHUNKS
    B, T, H = hidden.shape
    check_label_range(labels, mask != 0, weight.shape[0])
    hidden2d = hidden.reshape(B * T, H)
    if hidden2d.stride(-1) != 1 or hidden2d.stride(0) != H:
        hidden2d = hidden2d.contiguous()
    chunk_logits, loss_ops = _backends(impl, hidden2d, weight, config, entropy_bonus=opts.entropy_coef != 0.0)
    return chunked_policy_loss(hidden2d, weight, labels, mask, advantages, old_logprobs, ref_logprobs, opts,
                               cu_seqlens, config, chunk_logits, loss_ops, loss_weights)


def chunked_policy_loss(hidden2d, weight, labels, mask, advantages, old_logprobs, ref_logprobs,
                        opts: PolicyLossOptions, cu_seqlens, config: PolicyLossChunkConfig, chunk_logits,
                        loss_ops, loss_weights=None) -> PolicyLossOutput:
    """fused_policy_loss on a chunked path past its checks: hidden2d [B·T, H] (rows of H contiguous), the other
    tensors as fused_policy_loss takes them, and the path's (chunk logits, loss ops) as `_backends` builds them
    (tests build them with other settings: scaled.ScaledChunkLogits' safe_gap)."""
    B, T = mask.shape

    def flat(x):
        return x.reshape(-1).to(torch.float32).contiguous()

    m = mask.to(torch.float32)
    w = aggregation_weights(m, opts, cu_seqlens) if loss_weights is None else loss_weights.to(torch.float32)
    adv = advantages.unsqueeze(1).expand(B, T) if advantages.dim() == 1 else advantages
    on_policy = old_logprobs is None   # π_old = π_θ: each chunk copies its logp into `old` as it finalizes
    old = torch.empty_like(flat(m)) if on_policy else flat(old_logprobs)
    buffers = LossBuffers(mask=flat(m), adv=flat(adv), old=old, on_policy=on_policy,
                          ref=None if ref_logprobs is None else flat(ref_logprobs), weight=flat(w),
                          g_entropy=None if opts.entropy_coef == 0.0 else flat(-opts.entropy_coef * w))
    labels1d = labels.reshape(-1).to(torch.int64).contiguous()
    args = (hidden2d, weight, labels1d, buffers, T, opts, chunk_logits, loss_ops, config)
    if torch.is_grad_enabled() and (hidden2d.requires_grad or weight.requires_grad):
        loss, logp, entropy, metrics = FusedPolicyLossFunction.apply(*args)
    else:
        policy_loss_chunks(*args, need_grad_hidden=False, need_grad_weight=False)
        loss, metrics = loss_and_metrics(buffers)
        logp, entropy = buffers.logp, buffers.entropy
    return PolicyLossOutput(loss, logp.view(B, T), entropy.view(B, T), Metrics(metrics))
