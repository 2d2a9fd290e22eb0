"""The fields of the TensorDict batches the roles exchange, and helpers to build model inputs from them.

Fields (B responses; P prompt width, left-padded; R response width, right-padded):
  prompt_ids [B,P], prompt_mask [B,P], response_ids [B,R], response_mask [B,R], group_ids [B], truncated [B],
  rewards [B], advantages [B,R], old_logprobs [B,R], ref_logprobs [B,R], rollout_logprobs [B,R] (engines that
  report them), rollout_is_weights [B,R] (algorithm.rollout_correction), token_versions [B,R] (rollout.partial: the
  weight version that sampled each token, 0 past the end; rltrain/async_rollout.py).
Multi-turn rollouts (rltrain/workers/agent_loop.py) add [B] episode counts (turns, tool_calls, ...) and `messages`
(non-tensor); their response_mask is 0 on tool tokens inside a response, which the model still reads.
The rollout engines and the agent loop build these fields from token lists with left_pad, right_pad and group_ids.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

IGNORE_INDEX = -100


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as left-padded ids and mask, [len(sequences), longest]: the layout generate takes."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[i, width - len(seq):] = 1
    return ids, mask


def right_pad(rows: list[list], pad, dtype: torch.dtype) -> torch.Tensor:
    """Lists as one right-padded tensor, [len(rows), longest (at least 1)]: the layout of the response fields."""
    out = torch.full((len(rows), max(1, max(map(len, rows)))), pad, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=dtype)
    return out


def supervised_batch(sequences: list[list[int]], labels: list[list[int]], pad_token_id: int):
    """(ids, attention mask, labels) of supervised examples (the embedded warm starts), right-padded: each sequence's
    labels as long as it, IGNORE_INDEX where no loss is taken."""
    return (right_pad(sequences, pad_token_id, torch.long), right_pad([[1] * len(s) for s in sequences], 0, torch.long),
            right_pad(labels, IGNORE_INDEX, torch.long))


def group_ids(responses: int, n: int) -> torch.Tensor:
    """[responses] the index of each response's prompt, n consecutive responses per prompt."""
    return torch.arange(responses // n).repeat_interleave(n)


def response_context(response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] 1 on the response tokens the model reads: every position up to the last nonzero response_mask entry.
    The mask itself can be 0 inside a response (multi-turn: tool output; token-level rollout correction), where the
    token still stands in the context; past the last one nothing is trained, so nothing needs reading."""
    nonzero = (response_mask != 0).long()
    last = (nonzero * torch.arange(1, nonzero.shape[1] + 1, device=nonzero.device)).amax(1, keepdim=True) \
        if nonzero.shape[1] else nonzero.sum(1, keepdim=True)
    return (torch.arange(nonzero.shape[1], device=nonzero.device) < last).long()


def model_inputs(batch: TensorDict):
    """input_ids, attention_mask and position_ids for the concatenated prompt + response (the response as far as
    response_context reads it, the same tokens the packed path runs: rltrain/workers/packing.py)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], response_context(batch["response_mask"])], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def response_hidden(model, batch: TensorDict) -> torch.Tensor:
    """Final hidden states at the positions that predict each response token: [B, R, H]."""
    input_ids, attention_mask, position_ids = model_inputs(batch)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids).last_hidden_state
    prompt_width, response_width = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
    return hidden[:, prompt_width - 1: prompt_width + response_width - 1]


def split(batch: TensorDict, size: int) -> list[TensorDict]:
    return [batch[i:i + size] for i in range(0, batch.batch_size[0], size)]


def concat_batches(batches: list[TensorDict]) -> TensorDict:
    """Concatenate batches whose prompt/response widths differ: prompts are left-padded, responses right-padded
    (pad id 0 under a zero mask; masked positions are never read)."""
    batches = [b for b in batches if b.batch_size[0] > 0] or batches[:1]
    prompt_width = max(b["prompt_ids"].shape[1] for b in batches)
    response_width = max(b["response_ids"].shape[1] for b in batches)
    padded = []
    for b in batches:
        dp, dr = prompt_width - b["prompt_ids"].shape[1], response_width - b["response_ids"].shape[1]
        fields = dict(b.items())
        fields["prompt_ids"] = torch.nn.functional.pad(b["prompt_ids"], (dp, 0))
        fields["prompt_mask"] = torch.nn.functional.pad(b["prompt_mask"], (dp, 0))
        fields["response_ids"] = torch.nn.functional.pad(b["response_ids"], (0, dr))
        fields["response_mask"] = torch.nn.functional.pad(b["response_mask"], (0, dr))
        for key in ("rollout_logprobs", "token_versions"):
            if key in fields:
                fields[key] = torch.nn.functional.pad(b[key], (0, dr))
        for key, before, after in (("prompt_routed_experts", dp, 0), ("response_routed_experts", 0, dr)):
            if key in fields:   # [B, P | R, L, k] routing (rltrain/workers/router.py); -1: nothing recorded
                fields[key] = torch.nn.functional.pad(b[key], (0, 0, 0, 0, before, after), value=-1)
        padded.append(TensorDict(fields, batch_size=b.batch_size))
    return torch.cat(padded) if len(padded) > 1 else padded[0]
