"""Prompt batches in a deterministic, resumable order, and prompt tokenization; the `data` config section
(DataConfig: where the prompts come from, how many per step, how long they may be).

The order is a fresh permutation per epoch drawn from (seed, epoch), so the position (epoch, index) is the whole
state: a resumed run sees exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import torch

from rltrain.config import require
from rltrain.data.rows import DataError, PromptRow, prompt_ids
from rltrain.embedded.config import TaskConfig
from rltrain.workers.batch import left_pad

logger = logging.getLogger(__name__)


@dataclass
class DataConfig:
    train_files: str | list[str] | None = None   # parquet/jsonl in verl's row format; null = the embedded task
    val_files: str | list[str] | None = None
    batch_size: int = 32                         # prompts per step (each gets rollout.n responses)
    max_prompt_length: int = 256                 # longer prompts are dropped with a warning
    val_max_rows: int = 0                        # 0 = every validation row
    task: TaskConfig = field(default_factory=TaskConfig)

    def validate(self):
        require(self.batch_size >= 1, "batch_size", "must be >= 1", self.batch_size)
        require(self.max_prompt_length >= 1, "max_prompt_length", "must be >= 1", self.max_prompt_length)
        require(self.val_max_rows >= 0, "val_max_rows", "must be >= 0", self.val_max_rows)
        require(self.val_files is None or self.train_files is not None, "val_files",
                "needs data.train_files (the embedded task brings its own split)", self.val_files)


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


def drop_long_prompts(rows: list[PromptRow], tokenizer, max_prompt_length: int, what: str,
                      tools: list[dict] | None = None) -> list[PromptRow]:
    """Rows whose prompt, rendered as the rollout gets it (with `tools`: see render_prompt), fits max_prompt_length
    tokens; logs how many were dropped."""
    kept = [row for row in rows
            if len(prompt_ids(row.prompt, tokenizer, tools)) <= max_prompt_length]
    if len(kept) < len(rows):
        logger.warning("%s: dropped %d of %d rows longer than data.max_prompt_length=%d tokens",
                       what, len(rows) - len(kept), len(rows), max_prompt_length)
    if not kept:
        raise DataError(f"{what}: every row is longer than data.max_prompt_length={max_prompt_length} tokens")
    return kept


def encode_prompts(rows: list[PromptRow], tokenizer, tools: list[dict] | None = None) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """Left-padded prompt ids and mask, [len(rows), longest prompt]; `tools`: see render_prompt."""
    return left_pad([prompt_ids(row.prompt, tokenizer, tools) for row in rows],
                    tokenizer.pad_token_id)

