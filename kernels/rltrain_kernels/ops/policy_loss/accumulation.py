"""Gradient accumulation for the policy loss: how a mini-batch's loss splits over micro-batches so that the sum of
the weighted micro-batch losses is the loss of the whole mini-batch, for each aggregation (`loss_agg`).

    acc = LossAccumulation.of(loss_agg, mini_batch_response_mask, norm_len=max_new_tokens)
    for micro in micro_batches:
        out = fused_policy_loss(..., loss_agg=loss_agg, **acc.options())
        (out.loss * acc.weight(micro_rows, micro_sequences)).backward()

token-mean divides by the mini-batch's token count inside each call (weight 1); Dr.GRPO's seq-mean-token-sum-norm
divides by a constant length and by the micro-batch's rows (weight: its share of the rows) — the constant is
`norm_len`, the generation budget in the paper (rltrain passes algorithm.loss.norm_len, by default
rollout.max_new_tokens), so the normaliser is the same at every step; without one it falls back to the mini-batch's
padded response width, which changes with the batch; the other sequence means average over the micro-batch's
sequences that hold a token (weight: its share of those).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossAccumulation:
    loss_agg: str
    tokens: int      # response tokens of the mini-batch
    sequences: int   # its sequences with at least one response token
    rows: int        # its rows
    width: int       # its padded response width
    norm_len: float | None = None   # Dr.GRPO's constant length; None = width

    @classmethod
    def of(cls, loss_agg: str, response_mask: torch.Tensor, norm_len: float | None = None) -> "LossAccumulation":
        """From the mini-batch's [B, R] response mask (and seq-mean-token-sum-norm's constant length)."""
        counts = (response_mask != 0).sum(1)
        return cls(loss_agg, int(counts.sum()), int((counts > 0).sum()), response_mask.shape[0],
                   response_mask.shape[1], norm_len)

    def options(self) -> dict:
        """The normaliser keyword fused_policy_loss takes for this aggregation (none for the sequence means)."""
        if self.loss_agg == "token-mean":
            return dict(norm_tokens=max(self.tokens, 1))
        if self.loss_agg == "seq-mean-token-sum-norm":
            return dict(norm_len=self.width if self.norm_len is None else self.norm_len)
        return {}

    def weight(self, micro_rows: int, micro_sequences: int) -> float:
        """The factor on one micro-batch's loss (its rows, and its sequences that hold a token)."""
        if self.loss_agg == "token-mean":
            return 1.0
        if self.loss_agg == "seq-mean-token-sum-norm":
            return micro_rows / max(self.rows, 1)
        return micro_sequences / max(self.sequences, 1)
