"""Prompt batches in a deterministic, resumable order, and prompt tokenization.

The order is a fresh permutation per epoch drawn from (seed, epoch), so the position (epoch, index) is the whole
state: a resumed run sees exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import logging
import random

import torch

from rltrain.data.rows import DataError, PromptRow, render_prompt

logger = logging.getLogger(__name__)


class PromptSampler:
    def __init__(self, rows: list[PromptRow], seed: int):
        if not rows:
            raise DataError("no training rows")
        self.rows, self.seed = rows, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, count: int) -> list[PromptRow]:
        out = []
        while len(out) < count:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.rows[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


def drop_long_prompts(rows: list[PromptRow], tokenizer, max_prompt_length: int, what: str) -> list[PromptRow]:
    """Rows whose rendered prompt fits max_prompt_length tokens; logs how many were dropped."""
    kept = [row for row in rows if len(tokenizer(render_prompt(row.prompt, tokenizer)).input_ids) <= max_prompt_length]
    if len(kept) < len(rows):
        logger.warning("%s: dropped %d of %d rows longer than data.max_prompt_length=%d tokens",
                       what, len(rows) - len(kept), len(rows), max_prompt_length)
    if not kept:
        raise DataError(f"{what}: every row is longer than data.max_prompt_length={max_prompt_length} tokens")
    return kept


def encode_prompts(rows: list[PromptRow], tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask, [len(rows), longest prompt]."""
    encoded = [tokenizer(render_prompt(row.prompt, tokenizer)).input_ids for row in rows]
    width = max(map(len, encoded))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, seq in enumerate(encoded):
        ids[i, width - len(seq):] = torch.tensor(seq)
        mask[i, width - len(seq):] = 1
    return ids, mask
