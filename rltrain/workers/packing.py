"""Padding-free batches for the actor and reference (`actor.use_remove_padding`): sequences concatenated into one
row, and micro-batches cut by a token budget (`actor.max_tokens_per_micro_batch`) instead of by row count.

A batch holds left-padded prompts [B, P] and right-padded responses [B, R]. Sequence i is its prompt tokens then its
first `response_lengths[i]` response tokens; `Packing` lays the selected sequences back to back in one row of T
tokens with per-sequence position ids and `cu_seqlens`, and maps per-token fields between the two layouts:
`packing.tokens(x)` puts a [B, R] field where the row's hidden states predict it (position t holds the value of the
token at t + 1), `packing.rows(y)` brings a [T] result back to [B, R]. With long-tailed response lengths most of a
padded batch is padding (2.86x the tokens in the issue's H100 measurement); a packed row has none.

Sequence parallelism (actor.ulysses_sequence_parallel_size, rltrain/workers/ulysses.py): the row is padded to a
multiple of the group's size (the padding a sequence of its own, label IGNORE_INDEX, mask 0) and each rank of the group
runs its contiguous slice of it; `model_inputs()`, `tokens()` and `labels()` give that slice, position ids and
cu_seqlens stay the whole row's, and `rows()` gathers the slices back first.

Micro-batches: `token_budget_groups` splits rows into the fewest groups of at most `budget` tokens it finds (a
longer sequence alone), balanced by the longest-processing-time rule where that needs no more groups than first-fit
decreasing; `balanced_groups` splits rows into k groups of near-equal tokens (the FSDP ranks' shares).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from rltrain_kernels.sequence_parallel import SequenceParallel
from tensordict import TensorDict

from rltrain.workers.batch import IGNORE_INDEX


def response_lengths(batch: TensorDict) -> torch.Tensor:
    """[B] response tokens each sequence keeps: up to its last nonzero response_mask entry (0 when none, e.g. a
    response the overlong filter masked out: it adds nothing to a loss or a log-prob, so it is not run)."""
    mask = batch["response_mask"] != 0
    if not mask.shape[1]:
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    return (mask.to(torch.long) * torch.arange(1, mask.shape[1] + 1, device=mask.device)).amax(1)


def sequence_lengths(batch: TensorDict) -> torch.Tensor:
    """[B] tokens each sequence occupies in a packed row (prompt + kept response)."""
    return batch["prompt_mask"].sum(1).long() + response_lengths(batch)


@dataclass
class Packing:
    """One packed row of a micro-batch's sequences and the maps between it and the [B, R] layout."""

    input_ids: torch.Tensor      # [1, T]
    position_ids: torch.Tensor   # [1, T], 0.. within each sequence
    cu_seqlens: torch.Tensor     # [N + 1] int32, sequence starts (N = rows of the micro-batch)
    max_seqlen: int
    valid: torch.Tensor          # [B, P + R] bool: which entries of the concatenated rows the row holds, in order
    prompt_width: int
    sequence_parallel: SequenceParallel | None = None   # this rank holds a slice of the row (module docstring)

    @classmethod
    def of(cls, micro: TensorDict, sequence_parallel: SequenceParallel | None = None) -> "Packing":
        prompt_mask = micro["prompt_mask"] != 0
        if micro.batch_size[0] and not prompt_mask.any(1).all():
            raise ValueError("a packed sequence needs at least one prompt token (its first response token is "
                             "predicted from the prompt's last); got an empty prompt")
        width = micro["response_ids"].shape[1]
        kept = torch.arange(width, device=prompt_mask.device) < response_lengths(micro).to(prompt_mask.device)[:, None]
        valid = torch.cat([prompt_mask, kept], dim=1)
        lengths = valid.sum(1)
        cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=valid.device)
        cu_seqlens[1:] = lengths.cumsum(0)
        input_ids = torch.cat([micro["prompt_ids"], micro["response_ids"]], dim=1)[valid]
        position_ids = (valid.cumsum(1) - 1)[valid]
        return cls(input_ids[None], position_ids[None], cu_seqlens, int(lengths.max()) if len(lengths) else 0, valid,
                   micro["prompt_ids"].shape[1], sequence_parallel)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def padded_tokens(self) -> int:
        """The row's length as the sequence-parallel ranks split it: T rounded up to a multiple of their number."""
        size = 1 if self.sequence_parallel is None else self.sequence_parallel.size
        return -(-self.num_tokens // size) * size

    def local(self, values: torch.Tensor, fill=0) -> torch.Tensor:
        """[1, T, ...] of the whole row → this rank's slice of it padded with `fill` (all of it without sequence
        parallelism)."""
        sp = self.sequence_parallel
        if sp is None:
            return values
        pad = torch.full((1, self.padded_tokens - self.num_tokens, *values.shape[2:]), fill, dtype=values.dtype,
                         device=values.device)
        return torch.cat([values, pad], 1).chunk(sp.size, 1)[sp.rank]

    def model_inputs(self) -> dict:
        """What the packed forward takes on this rank: its slice of input_ids and position_ids, the row's sequence
        starts and longest sequence (under sequence parallelism the padding is a sequence of its own: each rank's
        token mixers see the whole padded row) and the group, `sequence_parallel`, which they switch heads over."""
        extra = self.padded_tokens - self.num_tokens
        cu_seqlens = self.cu_seqlens if not extra else torch.cat([self.cu_seqlens, self.cu_seqlens.new_tensor(
            [self.padded_tokens])])
        inputs = dict(input_ids=self.local(self.input_ids), position_ids=self.local(self.position_ids),
                      cu_seqlens=cu_seqlens, max_seqlen=max(self.max_seqlen, extra))
        return inputs if self.sequence_parallel is None else dict(inputs, sequence_parallel=self.sequence_parallel)

    def tokens(self, field: torch.Tensor, fill=0) -> torch.Tensor:
        """row_tokens(field, fill), this rank's slice of it (`local`)."""
        return self.local(self.row_tokens(field, fill), fill)

    def row_tokens(self, field: torch.Tensor, fill=0) -> torch.Tensor:
        """A [B, R] response field (or [B]: one value per sequence) → [1, T], aligned with the hidden state that
        predicts each token; `fill` where the next token is not a response token (prompts, sequence ends)."""
        if field.dim() == 1:
            field = field[:, None].expand(-1, self.valid.shape[1] - self.prompt_width)
        full = torch.nn.functional.pad(field, (self.prompt_width, 0), value=fill)
        packed = full[self.valid]
        shifted = torch.full_like(packed, fill)
        shifted[:-1] = packed[1:]   # a prompt token next (a sequence's start) holds `fill` from the padding
        return shifted[None]

    def labels(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """[1, T] next-token labels: the response tokens the mask keeps, IGNORE_INDEX elsewhere."""
        return self.tokens(response_ids.masked_fill(response_mask == 0, IGNORE_INDEX), IGNORE_INDEX)

    def response_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, T, H] hidden states of the row → [B, R, H] at each response token's predicting position (a gather,
        differentiable; positions past a row's response hold its first token's state, for a mask to drop)."""
        if self.sequence_parallel is not None:
            raise ValueError("response_rows needs the whole row's hidden states; a sequence-parallel rank holds a "
                             "slice of them")
        index = torch.full(self.valid.shape, 1, dtype=torch.long, device=self.valid.device)
        index[self.valid] = torch.arange(self.num_tokens, device=self.valid.device)
        return hidden[0][index[:, self.prompt_width:] - 1]

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        """[1, T] or [T] per-position results (position t: the token at t + 1) → [B, R] per response token, 0 where
        the row has no such token. Under sequence parallelism: this rank's slice, [1, T / ranks], gathered first (a
        collective of the group)."""
        if self.sequence_parallel is not None:
            values = self.sequence_parallel.gather(values.reshape(1, -1), 1)[:, :self.num_tokens]
        values = values.reshape(-1)
        unshifted = torch.zeros_like(values)
        unshifted[1:] = values[:-1]
        full = values.new_zeros(self.valid.shape)
        full[self.valid] = unshifted
        return full[:, self.prompt_width:]


def _lpt(lengths: list[int], k: int) -> list[list[int]]:
    """Longest processing time first: each index, longest first, to the group with the fewest tokens so far."""
    heap = [(0, g) for g in range(k)]
    groups: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (total + lengths[i], g))
    return [sorted(g) for g in groups]


def balanced_groups(lengths: list[int], k: int) -> list[list[int]]:
    """k groups of row indices with near-equal token sums (some may be empty when there are fewer rows than k)."""
    return _lpt(lengths, k)


def _first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Each index, longest first, to the first group it fits in (a new group when none): at most 11/9 of the fewest
    groups possible, plus one (a sequence over budget gets a group of its own)."""
    groups: list[list[int]] = []
    totals: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = next((g for g, total in enumerate(totals) if total + lengths[i] <= budget), None)
        if g is None:
            groups.append([])
            totals.append(0)
            g = len(groups) - 1
        groups[g].append(i)
        totals[g] += lengths[i]
    return [sorted(g) for g in groups]


def token_budget_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices in groups of at most `budget` tokens each (a longer sequence alone in its group), ordered by their
    first row: the balanced split (LPT) into the fewest groups it fits in, unless first-fit decreasing needs fewer
    (LPT wastes room when lengths are close to half the budget), then that one."""
    if not lengths:
        return []
    packed = _first_fit_decreasing(lengths, budget)
    for k in range(max(1, -(-sum(lengths) // budget)), len(packed) + 1):
        groups = [g for g in _lpt(lengths, k) if g]
        if all(sum(lengths[i] for i in g) <= budget or len(g) == 1 for g in groups):
            return sorted(groups, key=lambda g: g[0])
    return sorted(packed, key=lambda g: g[0])


@dataclass(frozen=True)
class MicroBatching:
    """How a role cuts a batch into forward/backward micro-batches (the actor config's keys, shared with the
    reference): `rows` rows each, or, packed, groups of at most `max_tokens` tokens (`max_tokens` 0: `rows` rows)."""

    rows: int = 64           # actor.micro_batch_size
    packed: bool = True      # actor.use_remove_padding
    max_tokens: int = 0      # actor.max_tokens_per_micro_batch

    def groups(self, batch: TensorDict) -> list[torch.Tensor]:
        """Row indices of each micro-batch. Padded: `rows` rows of similar length (rows sorted by length, so each
        micro-batch pads to little more than its own sequences). Packed: rows with no response token to score are
        left out (their log-probs are 0 and they add nothing to a loss)."""
        lengths = sequence_lengths(batch)
        if not self.packed:
            return list(torch.argsort(lengths, stable=True).split(self.rows))
        scored = (response_lengths(batch) > 0).nonzero().flatten()
        if self.max_tokens:
            groups = token_budget_groups(lengths[scored].tolist(), self.max_tokens)
            return [scored[torch.tensor(g)] for g in groups]
        return list(scored.split(self.rows))

    def take(self, batch: TensorDict, rows: torch.Tensor) -> TensorDict:
        """The micro-batch of `rows`, cut to its own padding (trim_padding)."""
        return trim_padding(batch[rows])


def trim_padding(micro: TensorDict) -> TensorDict:
    """`micro` without the prompt columns no row uses (left padding) and the response columns past its longest
    kept response (right padding): a padded forward then runs on the micro-batch's own width, not the batch's.
    Every [B, R] field is cut to the same width; results of width R' go back to columns [:R'] of the batch."""
    prompt_used = (micro["prompt_mask"] != 0).any(0).nonzero()
    start = int(prompt_used[0]) if len(prompt_used) else 0
    width = micro["response_ids"].shape[1]
    keep = max(int(response_lengths(micro).max()) if micro.batch_size[0] else 0, 1)
    out = micro.clone(recurse=False)
    for key, value in micro.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        if key.startswith("prompt_"):
            out[key] = value[:, start:]
        elif value.shape[1] == width:
            out[key] = value[:, :keep]
    return out
