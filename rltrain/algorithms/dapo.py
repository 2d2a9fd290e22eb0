"""DAPO's (Yu et al., 2025) batch-level pieces, pure functions (tests/rltrain/test_dapo.py): dynamic sampling
(`algorithm.dynamic_sampling`: keep only prompt groups whose rewards differ, refilling the batch with more rounds),
overlong filtering (`algorithm.overlong_filter`: truncated responses keep no token in the loss) and the soft
overlong punishment (`algorithm.overlong_buffer`: a length penalty added to the rewards near the length limit)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rltrain.workers.batch import concat_batches


def informative_groups(batch: TensorDict, n: int) -> TensorDict:
    """Dynamic sampling's filter: the groups (n consecutive responses) whose rewards are not all equal. A group
    scored alike has zero advantage on every token, so it adds no gradient and only dilutes the batch."""
    rewards = batch["rewards"].view(-1, n)
    informative = (rewards.max(1).values - rewards.min(1).values) > 0
    return batch[informative.repeat_interleave(n)]


def collect_groups(generate_round, groups: int, n: int, dynamic_sampling: bool,
                   extra_rounds: int) -> tuple[TensorDict, int]:
    """(a batch of `groups` prompt groups of n responses, the rounds generated). generate_round(round_index) returns
    a scored batch of `groups` fresh groups. Without dynamic sampling one round is the batch. With it, each round's
    all-equal groups are dropped (informative_groups) and up to extra_rounds more rounds refill the batch, which is
    cut to `groups` groups, or ends short (possibly empty) when the rounds run out. group_ids are renumbered 0..."""
    kept, total, rounds = [], 0, 0
    for round_ in range(1 + (extra_rounds if dynamic_sampling else 0)):
        batch = generate_round(round_)
        rounds += 1
        if dynamic_sampling:
            batch = informative_groups(batch, n)
        kept.append(batch)
        total += batch.batch_size[0]
        if total >= groups * n:
            break
    batch = concat_batches(kept)[: groups * n]
    batch["group_ids"] = torch.arange(batch.batch_size[0]) // n
    return batch, rounds


def mask_truncated(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: truncated responses (no <eos> within rollout.max_new_tokens) keep no token in the loss,
    so a reward cut off by the length limit does not teach the policy as if the response were complete."""
    return response_mask * (~truncated).unsqueeze(1).to(response_mask.dtype)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, [B] rewards to add: 0 for a response of at most L_max − L_cache tokens,
    then falling linearly, ((L_max − L_cache) − |y|) / L_cache · penalty_factor, to −penalty_factor at L_max (and
    past it), L_max = rollout.max_new_tokens, L_cache = buffer_len, |y| the response's tokens."""
    excess = lengths.double() - (max_new_tokens - buffer_len)
    return -(excess.clamp(min=0) / buffer_len).clamp(max=1.0) * penalty_factor
