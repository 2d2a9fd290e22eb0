"""concat_batches: batches of different prompt/response widths concatenate with prompts left-padded and responses
right-padded, every real token and mask value kept in place (dynamic sampling relies on it)."""

import torch
from tensordict import TensorDict

from rltrain.workers.batch import IGNORE_INDEX, concat_batches, model_inputs, supervised_batch


def _batch(n, p, r, fill):
    return TensorDict({"prompt_ids": torch.full((n, p), fill), "prompt_mask": torch.ones(n, p, dtype=torch.long),
                       "response_ids": torch.full((n, r), fill + 1), "response_mask": torch.ones(n, r, dtype=torch.long),
                       "rewards": torch.full((n,), float(fill))}, batch_size=[n])


def test_concat_pads_prompts_left_and_responses_right():
    out = concat_batches([_batch(2, 3, 4, 10), _batch(1, 5, 2, 20), _batch(0, 7, 9, 30)])
    assert out.batch_size[0] == 3 and out["prompt_ids"].shape == (3, 5) and out["response_ids"].shape == (3, 4)
    assert out["prompt_mask"][0].tolist() == [0, 0, 1, 1, 1] and out["prompt_ids"][0, 2:].tolist() == [10] * 3
    assert out["response_mask"][2].tolist() == [1, 1, 0, 0] and out["response_ids"][2, :2].tolist() == [21, 21]
    assert out["rewards"].tolist() == [10.0, 10.0, 20.0]
    _, attention_mask, position_ids = model_inputs(out)
    assert position_ids[0, 2].item() == 0 and attention_mask[0].sum().item() == 7  # positions start at real tokens


def test_concat_pads_rollout_logprobs_like_responses():
    a, b = _batch(2, 3, 4, 10), _batch(1, 3, 2, 20)
    a["rollout_logprobs"], b["rollout_logprobs"] = -torch.rand(2, 4), -torch.rand(1, 2)
    out = concat_batches([a, b])
    assert out["rollout_logprobs"].shape == (3, 4)
    assert torch.equal(out["rollout_logprobs"][2, :2], b["rollout_logprobs"][0])
    assert (out["rollout_logprobs"][2, 2:] == 0).all()
    assert torch.equal(out["rollout_logprobs"][:2], a["rollout_logprobs"])


def test_concat_pads_recorded_routing_with_minus_one():
    """R3's routing fields ([B, P | R, L, k]): prompts left-padded, responses right-padded, -1 = nothing recorded."""
    a, b = _batch(2, 3, 4, 10), _batch(1, 5, 2, 20)
    for batch, (n, p, r) in ((a, (2, 3, 4)), (b, (1, 5, 2))):
        batch["prompt_routed_experts"] = torch.randint(0, 8, (n, p, 2, 2), dtype=torch.int16)
        batch["response_routed_experts"] = torch.randint(0, 8, (n, r, 2, 2), dtype=torch.int16)
    out = concat_batches([a, b])
    assert out["prompt_routed_experts"].shape == (3, 5, 2, 2) and out["response_routed_experts"].shape == (3, 4, 2, 2)
    assert (out["prompt_routed_experts"][:2, :2] == -1).all()
    assert torch.equal(out["prompt_routed_experts"][:2, 2:], a["prompt_routed_experts"])
    assert torch.equal(out["response_routed_experts"][2, :2], b["response_routed_experts"][0])
    assert (out["response_routed_experts"][2, 2:] == -1).all()


def test_supervised_batch_pads_right_with_ignored_labels():
    ids, mask, labels = supervised_batch([[5, 6, 7], [8]], [[IGNORE_INDEX, 6, 7], [8]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert labels.tolist() == [[IGNORE_INDEX, 6, 7], [8, IGNORE_INDEX, IGNORE_INDEX]]
    assert ids.dtype == mask.dtype == labels.dtype == torch.long
