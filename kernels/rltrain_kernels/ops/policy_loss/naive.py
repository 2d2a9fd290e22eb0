"""Plain-torch policy loss that materialises the [B, T, V] logits: the ground truth in tests (run in float64) and
the CPU/NPU path for small inputs. Same signature as `fused_policy_loss`; gradients by ordinary autograd.

Written to read like the definitions in the issue (and `fused_policy_loss`'s docstring), not like the fused maths:
the aggregation is spelled out per loss_agg, the GSPO ratio is a per-sequence mean, ties are left to autograd.
"""

from __future__ import annotations

import torch

from rltrain_kernels.ops.policy_loss.options import (
    K3_BOUND, K3_LOG_RATIO_BOUND, Metrics, PolicyLossOptions, PolicyLossOutput, check_inputs, check_label_range,
)


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, kl_type: str) -> torch.Tensor:
    """k1 = logp − ref, k2 = ½(logp − ref)², k3 = exp(ref − logp) − (ref − logp) − 1 (Schulman's estimators); k3
    as verl's low_var_kl: ref − logp clamped to ±K3_LOG_RATIO_BOUND and the result to <= K3_BOUND, so one token
    whose reference probability vanishes cannot blow up the loss (no gradient where a bound acts)."""
    if kl_type == "k1":
        return logp - ref
    if kl_type == "k2":
        return 0.5 * (logp - ref) ** 2
    x = (ref - logp).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (torch.exp(x) - x - 1.0).clamp(max=K3_BOUND)


def _masked_total(x: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    return torch.where(denom > 0, x / torch.where(denom > 0, denom, 1.0), 0.0)


def _aggregate(per_token: torch.Tensor, m: torch.Tensor, opts: PolicyLossOptions) -> torch.Tensor:
    """The four loss_agg modes, literally; a zero denominator (nothing masked in) gives 0."""
    B, T = m.shape
    seq_tokens = m.sum(-1)
    seq_sum = (per_token * m).sum(-1)
    if opts.loss_agg == "token-mean":
        denom = m.sum() if opts.norm_tokens is None else m.new_tensor(opts.norm_tokens)
        return _masked_total((per_token * m).sum(), denom)
    if opts.loss_agg == "seq-mean-token-sum-norm":
        norm_len = T if opts.norm_len is None else opts.norm_len
        return (per_token * m).sum() / (B * norm_len)
    valid = seq_tokens > 0
    per_seq = seq_sum if opts.loss_agg == "seq-mean-token-sum" else _masked_total(seq_sum, seq_tokens)
    return _masked_total(torch.where(valid, per_seq, 0.0).sum(), valid.sum().to(m.dtype))


def reference_policy_loss(hidden, weight, labels, mask, advantages, old_logprobs, ref_logprobs=None, *,
                          clip_low=0.2, clip_high=0.2, dual_clip=None, kl_coef=0.0, kl_type="k3", entropy_coef=0.0,
                          loss_agg="token-mean", importance_level="token", temperature=1.0, norm_tokens=None,
                          norm_len=None, cu_seqlens=None, loss_weights=None,
                          compute_dtype: torch.dtype | None = None) -> PolicyLossOutput:
    """The policy loss of `fused_policy_loss` (see its docstring for the definitions), by autograd over dense
    logits. compute_dtype: float64 for float64 inputs, else float32 (inputs are upcast before the GEMM).
    cu_seqlens (a packed row): the sequences are cut out into padded rows and the loss taken over those.
    loss_weights: Σ w·L in place of the aggregation."""
    opts = PolicyLossOptions(clip_low, clip_high, dual_clip, kl_coef, kl_type, entropy_coef, loss_agg,
                             importance_level, temperature, norm_tokens, norm_len)
    check_inputs(hidden, weight, labels, mask, advantages, old_logprobs, ref_logprobs, opts, cu_seqlens, loss_weights)
    if cu_seqlens is not None:
        return _packed_as_rows(hidden, weight, labels, mask, advantages, old_logprobs, ref_logprobs, cu_seqlens,
                               opts, compute_dtype)
    cd = compute_dtype or (torch.float64 if hidden.dtype == torch.float64 else torch.float32)
    B, T, _ = hidden.shape
    valid = mask != 0
    check_label_range(labels, valid, weight.shape[0])
    m = mask.to(cd)

    logits = (hidden.to(cd) @ weight.to(cd).T) / opts.temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    safe_labels = torch.where(valid, labels.long(), 0)
    logp = log_probs.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    logp = torch.where(valid, logp, 0.0)
    entropy = torch.where(valid, entropy, 0.0)

    old = logp.detach() if old_logprobs is None else old_logprobs.to(cd)   # None: on-policy, π_old = π_θ
    adv = advantages.to(cd)
    adv = adv.unsqueeze(1).expand(B, T) if adv.dim() == 1 else adv
    # masked positions: log-ratio 0 (old_logprobs there may be padding; exp of it must not reach the loss)
    log_ratio = torch.where(valid, logp - old, 0.0)
    if opts.importance_level == "sequence":   # GSPO: one ratio per sequence, exp(mean over its tokens)
        seq_log_ratio = _masked_total((log_ratio * m).sum(-1), m.sum(-1))
        log_ratio = seq_log_ratio.unsqueeze(1).expand(B, T)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - opts.clip_low, 1.0 + opts.clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    if opts.dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * opts.dual_clip), pg)

    per_token = pg
    ref_kl = torch.zeros_like(logp)
    if ref_logprobs is not None:
        ref = torch.where(valid, ref_logprobs.to(cd), logp.detach())   # masked: logp − ref = 0
        ref_kl = kl_penalty(logp, ref, "k3")
        if opts.kl_coef != 0.0:
            per_token = per_token + opts.kl_coef * kl_penalty(logp, ref, opts.kl_type)
    if opts.entropy_coef != 0.0:
        per_token = per_token - opts.entropy_coef * entropy
    if loss_weights is None:
        loss = _aggregate(per_token, m, opts)
    else:
        loss = (torch.where(valid, per_token, 0.0) * loss_weights.to(cd)).sum()

    with torch.no_grad():
        n = m.sum()
        values = torch.stack([(clipped.to(cd) * m).sum(), (torch.where(valid, old - logp, 0.0) * m).sum(),
                              (ref_kl * m).sum(), (entropy * m).sum()])
        values = _masked_total(values, n)
    return PolicyLossOutput(loss, logp.detach(), entropy.detach(), Metrics(values))


def _packed_as_rows(hidden, weight, labels, mask, advantages, old_logprobs, ref_logprobs, cu_seqlens, opts,
                    compute_dtype) -> PolicyLossOutput:
    """A packed row [1, T] as padded rows [N, max length] (mask 0 on the padding), the loss over those, and the
    per-token outputs back in the packed layout."""
    lengths = cu_seqlens.diff().long()
    positions = torch.arange(int(lengths.max()), device=hidden.device)
    valid = positions[None] < lengths[:, None]                          # [N, width]
    index = torch.where(valid, cu_seqlens[:-1, None].long() + positions[None], 0)
    width = valid.shape[1]

    def rows(x, fill=0):   # one gather (its backward one scatter-add), not a copy per sequence
        x = x[0] if x.dim() > 1 else x.expand(hidden.shape[1])
        return torch.where(valid.view(valid.shape + (1,) * (x.dim() - 1)), x[index], fill)

    advantages = advantages if advantages.dim() == 2 else advantages.expand(1, hidden.shape[1])
    kwargs = {k: getattr(opts, k) for k in opts.__dataclass_fields__}
    kwargs["norm_len"] = width if opts.norm_len is None else opts.norm_len
    if kwargs["loss_agg"] != "seq-mean-token-sum-norm":
        kwargs["norm_len"] = None
    out = reference_policy_loss(rows(hidden), weight, rows(labels), rows(mask), rows(advantages),
                                None if old_logprobs is None else rows(old_logprobs),
                                None if ref_logprobs is None else rows(ref_logprobs), compute_dtype=compute_dtype,
                                **kwargs)

    def packed(y):
        return y[valid][None]

    return PolicyLossOutput(out.loss, packed(out.logprobs), packed(out.entropy), out.metrics)
