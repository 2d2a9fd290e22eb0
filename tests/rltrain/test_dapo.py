"""DAPO's switches without Ray: dynamic sampling (algorithm.dynamic_sampling) drops groups whose rewards are all equal
and refills the batch from further rounds; overlong filtering (algorithm.overlong_filter) zeroes the response mask
of responses that hit rollout.max_new_tokens without <eos>; the soft overlong punishment (algorithm.overlong_buffer)
against the paper's piecewise formula. The trainer runs both through these functions
(rltrain/trainer.py); the `dapo` preset also trains end to end in tests/rltrain/test_trainer_e2e.py."""

import pytest
import torch
from tensordict import TensorDict

from rltrain.algorithms.dapo import collect_groups, informative_groups, mask_truncated, overlong_penalty
from rltrain.workers.sampling import response_mask_and_truncation

N = 2  # responses per group


def _round(round_: int, group_rewards: list[list[float]]) -> TensorDict:
    """A scored round: group g's prompt ids hold 100·round + g (so kept groups can be traced), responses are
    round + 2 tokens wide (so rounds of different widths are concatenated)."""
    groups, width = len(group_rewards), round_ + 2
    tag = torch.tensor([100 * round_ + g for g in range(groups)]).repeat_interleave(N)
    return TensorDict({"prompt_ids": tag.unsqueeze(1).repeat(1, 3), "prompt_mask": torch.ones(groups * N, 3).long(),
                       "response_ids": tag.unsqueeze(1).repeat(1, width) + 1,
                       "response_mask": torch.ones(groups * N, width).long(),
                       "truncated": torch.zeros(groups * N, dtype=torch.bool),
                       "group_ids": torch.arange(groups).repeat_interleave(N),
                       "rewards": torch.tensor([r for group in group_rewards for r in group])}, batch_size=[groups * N])


def _generator(rounds: list[list[list[float]]]):
    calls = []

    def generate_round(round_: int) -> TensorDict:
        calls.append(round_)
        return _round(round_, rounds[round_])

    return generate_round, calls


def test_dynamic_sampling_drops_all_equal_groups_and_refills():
    generate_round, calls = _generator([
        [[1, 1], [0, 1], [0, 0]],          # keeps group 1
        [[1, 0], [1, 1], [0.5, 0.5]],      # keeps group 0
        [[0, 1], [1, 0], [0, 1]],          # all informative: the batch fills and the surplus is cut
        [[0, 1], [0, 1], [0, 1]],          # never generated
    ])
    batch, rounds = collect_groups(generate_round, groups=3, n=N, dynamic_sampling=True, extra_rounds=3)
    assert rounds == 3 and calls == [0, 1, 2]
    assert batch["prompt_ids"][::N, 0].tolist() == [1, 100, 200]  # (round, group): (0, 1), (1, 0), (2, 0)
    assert batch["group_ids"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch["rewards"].tolist() == [0, 1, 1, 0, 0, 1]
    # responses right-padded to the widest round, every real token and mask value in place
    assert batch["response_ids"].shape == (6, 4)
    assert batch["response_mask"].sum(1).tolist() == [2, 2, 3, 3, 4, 4]
    assert batch["response_ids"][2].tolist() == [101, 101, 101, 0] and batch["response_mask"][2, 3] == 0


def test_dynamic_sampling_stops_once_the_batch_is_exactly_full():
    generate_round, calls = _generator([[[0, 1], [1, 1]], [[0, 0], [1, 0]], [[0, 1], [0, 1]]])
    batch, rounds = collect_groups(generate_round, groups=2, n=N, dynamic_sampling=True, extra_rounds=2)
    assert rounds == 2 and calls == [0, 1] and batch["prompt_ids"][::N, 0].tolist() == [0, 101]


def test_without_dynamic_sampling_one_round_keeps_every_group():
    generate_round, calls = _generator([[[1, 1], [0, 1], [0, 0]], [[0, 1]] * 3])
    batch, rounds = collect_groups(generate_round, groups=3, n=N, dynamic_sampling=False, extra_rounds=4)
    assert rounds == 1 and calls == [0]
    assert batch["prompt_ids"][::N, 0].tolist() == [0, 1, 2] and batch["rewards"].tolist() == [1, 1, 0, 1, 0, 0]


@pytest.mark.parametrize("informative_round", [None, 1], ids=["none-informative", "one-informative"])
def test_dynamic_sampling_ends_short_when_the_rounds_run_out(informative_round):
    rounds_spec = [[[1, 1], [0, 0]] for _ in range(3)]
    if informative_round is not None:
        rounds_spec[informative_round] = [[1, 1], [1, 0]]
    generate_round, calls = _generator(rounds_spec)
    batch, rounds = collect_groups(generate_round, groups=2, n=N, dynamic_sampling=True, extra_rounds=2)
    assert rounds == 3 and calls == [0, 1, 2]
    if informative_round is None:
        assert batch.batch_size[0] == 0  # the trainer logs and skips such a step
    else:
        assert batch["prompt_ids"][:, 0].tolist() == [101, 101] and batch["group_ids"].tolist() == [0, 0]


def test_informative_groups_keeps_any_difference():
    batch = _round(0, [[1.0, 1.0 + 1e-6], [0.25, 0.25], [-1.0, 0.0]])
    assert informative_groups(batch, N)["prompt_ids"][::N, 0].tolist() == [0, 2]


def test_overlong_filter_masks_out_responses_truncated_at_max_new_tokens():
    eos, pad = 2, 2  # HF generate pads finished sequences with pad_token_id, which is <eos> for many models
    response_ids = torch.tensor([[5, 2, pad, pad],   # ended early: kept up to and including <eos>
                                 [5, 6, 7, 2],       # <eos> as the last allowed token: complete, kept
                                 [5, 6, 7, 8],       # hit max_new_tokens without <eos>: truncated
                                 [2, pad, pad, pad]])  # <eos> at once: one token
    response_mask, truncated = response_mask_and_truncation(response_ids, eos)
    assert response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, False, True, False]
    filtered = mask_truncated(response_mask, truncated)
    assert filtered.dtype == response_mask.dtype
    assert filtered.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_soft_overlong_punishment_is_the_papers_piecewise_penalty():
    """L_max = 8, L_cache = 4: 0 up to 4 tokens, ((8 − 4) − |y|) / 4 from 5 to 8 tokens, −1 past 8; × the factor."""
    lengths = torch.tensor([1, 4, 5, 6, 7, 8, 9])
    expected = [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    torch.testing.assert_close(overlong_penalty(lengths, 8, 4, 1.0), torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(overlong_penalty(lengths, 8, 4, 0.5),
                               torch.tensor([0.5 * e for e in expected], dtype=torch.float64))
    assert overlong_penalty(torch.tensor([7, 8]), 8, 1, 2.0).tolist() == [0.0, -2.0]
