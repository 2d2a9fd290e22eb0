"""What both rollout engines sample with, in one place: the end-of-sequence ids of a checkpoint, the response seeds,
which `rollout.*` settings make the sampled distribution differ from the one the actor scores, and the hf engine's
record of the sampled tokens' log-probs.

Sampling is the config's alone: a checkpoint's generation_config.json (Qwen3: temperature 0.6, top_k 20, top_p
0.95; Qwen2.5-Instruct: repetition_penalty 1.05, ...) is read for its special-token ids only, and its sampling
defaults are logged once as ignored. End-of-sequence is a set: the generation config's ids (Qwen3, Qwen2.5 and
Llama-3.x ship lists), config.json's and the tokenizer's, so a response ends at the first of any of them.

The actor scores tokens under softmax(logits / temperature). Rollout log-probs stand for that distribution only when
nothing else reshapes it (`distortions`: top_p < 1, top_k, min_p, repetition_penalty != 1); the job refuses settings
that read rollout log-probs as the behaviour policy together with such a distortion (rltrain/job.py).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from rltrain.workers.policy import load_tokenizer

logger = logging.getLogger(__name__)

# generation_config.json keys that carry token ids, not sampling behaviour
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def response_seeds(seed: int, first: int, count: int) -> torch.Tensor:
    """The sampling seeds of responses first .. first + count - 1 of a step's batch (prompt-major, n per prompt):
    the same for a response whichever replica generates it."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31 - 1, (first + count,), generator=generator)[first:]


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


@dataclass(frozen=True)
class EndOfSequence:
    """A checkpoint's end-of-sequence ids (generation config first, in its order, then config.json's and the
    tokenizer's) and the pad id that fills a finished row (the generation config's or tokenizer's pad, else the
    first end-of-sequence id)."""
    ids: tuple[int, ...]
    pad_id: int

    @classmethod
    def of(cls, generation: dict, config: dict, tokenizer) -> "EndOfSequence":
        ids: list[int] = []
        for value in (generation.get("eos_token_id"), config.get("eos_token_id"), tokenizer.eos_token_id):
            ids += [i for i in _ids(value) if i not in ids]
        if not ids:
            raise ValueError("the model directory names no end-of-sequence token (generation_config.json, "
                             "config.json and the tokenizer have no eos_token_id)")
        pad = next((p for p in (generation.get("pad_token_id"), tokenizer.pad_token_id) if p is not None), ids[0])
        return cls(tuple(ids), int(_ids(pad)[0]))


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def generation_defaults(model_path: str) -> dict:
    """The model directory's generation_config.json ({} without one)."""
    return _read_json(os.path.join(model_path, "generation_config.json"))


def end_of_sequence(model_path: str, tokenizer=None) -> EndOfSequence:
    """The end-of-sequence set of a model directory (its tokenizer is loaded unless given)."""
    if tokenizer is None:
        tokenizer = load_tokenizer(model_path)
    return EndOfSequence.of(generation_defaults(model_path), _read_json(os.path.join(model_path, "config.json")),
                            tokenizer)


def log_ignored_defaults(model_path: str) -> dict:
    """Log (once per engine) the checkpoint's generation defaults that sampling ignores; returns them."""
    ignored = {key: value for key, value in generation_defaults(model_path).items()
               if key not in SPECIAL_TOKEN_KEYS and key != "transformers_version"}
    if ignored:
        logger.info("sampling follows rollout.* only; ignored from %s/generation_config.json: %s", model_path,
                    ", ".join(f"{key}={value}" for key, value in sorted(ignored.items())))
    return ignored


def response_mask_and_truncation(response_ids: torch.Tensor, eos_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(response_mask [B,R]: 1 up to and including the first end-of-sequence token of `eos_ids` (an id or a
    collection); truncated [B]: none at all, i.e. the response hit max_new_tokens and is kept whole in the mask;
    algorithm.overlong_filter masks those out)."""
    eos = torch.tensor(_ids(eos_ids), dtype=response_ids.dtype, device=response_ids.device)
    is_eos = torch.isin(response_ids, eos).long()
    before_eos = (is_eos.cumsum(1) - is_eos) == 0
    return before_eos.long(), ~is_eos.bool().any(1)


def distortions(config) -> list[str]:
    """The rollout settings (`rollout.*` keys with their values) under which the sampled distribution is not
    softmax(logits / temperature), the one the actor scores: then the engines' log-probs of the sampled tokens
    are not that distribution's either."""
    found = []
    if config.top_p < 1:
        found.append(f"rollout.top_p={config.top_p}")
    if config.top_k > 0:
        found.append(f"rollout.top_k={config.top_k}")
    if config.min_p > 0:
        found.append(f"rollout.min_p={config.min_p}")
    if config.repetition_penalty != 1:
        found.append(f"rollout.repetition_penalty={config.repetition_penalty}")
    return found


class SampledLogprobs:
    """A transformers logits processor that records log softmax(logits / temperature) at each sampled token, one
    step at a time ([rows, vocab] fp32 held for one step, not generate's output_scores, which keeps every step's:
    256 × 1024 × 152k fp32 = 160 GB). generate runs custom processors after its penalties and before temperature
    and truncation, so with neutral penalties it sees the model's logits. Step t's token is input_ids[:, -1] at the
    call of step t + 1; `finish(tokens)` takes the last one."""

    def __init__(self, temperature: float):
        self.temperature, self.previous, self.columns = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1:])
        self.previous = (scores.float() / self.temperature).log_softmax(-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.columns.append(self.previous.gather(1, tokens))
            self.previous = None

    def finish(self, tokens: torch.Tensor) -> torch.Tensor:
        """[rows, generated] log-probs of `tokens`, the generated tokens generate returned."""
        self._take(tokens[:, -1:])
        if not self.columns:
            return torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        return torch.cat(self.columns, 1)
