"""Partial rollouts by abort and resume (rollout.partial with rollout.engine=vllm rollout.mode=async): every response
is one request on vLLM's async engine that runs until it ends; a weight push arriving meanwhile aborts the requests
in flight, keeps every token they returned (each with its log-prob and the weight version that sampled it), loads the
new weights and sends each unfinished response again as prompt + its tokens so far, with what is left of its
max_tokens budget. A response thus carries the versions its tokens were sampled under (`token_versions`).

`Interruptible` is the engine-neutral part, on one asyncio loop: `run(response, stream)` drives a response's
attempts, `pause()` aborts the attempts in flight and holds new ones (the weight update's begin), `resume(version)`
lets them go on the new weights (its finish). `stream(request_id, context, max_tokens, seed)` is the engine's request:
an async iterator of (token ids, log-probs, finish reason or None), the deltas as they are sampled; `abort(request_ids)`
the engine's abort. rltrain/workers/vllm_async.py plugs AsyncLLM in; tests/rltrain/workers/test_interruptible.py runs
it on a stand-in engine.

A pause aborts through the engine (`abort`) and cancels each attempt's task as well: AsyncLLM's generate aborts its
request when its consumer is cancelled, whichever vLLM version reports an abort as a final output or not. Tokens that
the engine sampled but had not yet returned when the abort reached it are dropped and sampled again on the new weights.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from rltrain.workers.batch import right_pad

ABORTED = "abort"   # vLLM's finish reason of an aborted request: the response goes on after the push

Stream = Callable[[str, list[int], int, int], AsyncIterator[tuple[list[int], list[float], str | None]]]


def resume_seed(seed: int, generated: int) -> int:
    """The seed of a response's attempt after `generated` tokens: its own seed first, then one drawn from both, so a
    resumed request does not replay the random numbers its first positions used."""
    return seed if generated == 0 else (seed * 1_000_003 + generated) % (2**31 - 1)


@dataclass
class PartialResponse:
    """One response as its attempts build it: the tokens so far with their log-probs and versions, and why it ended
    (None while unfinished)."""
    prompt: list[int]
    max_tokens: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    attempts: int = 0

    def add(self, token_ids: list[int], logprobs: list[float], version: int, finish_reason: str | None) -> None:
        if len(token_ids) != len(logprobs):
            raise RuntimeError(f"the engine returned {len(token_ids)} token(s) with {len(logprobs)} log-prob(s)")
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.versions += [version] * len(token_ids)
        if finish_reason is not None and finish_reason != ABORTED:
            self.finish_reason = finish_reason
        elif len(self.token_ids) >= self.max_tokens:  # the budget is spent, whatever ended the request
            self.finish_reason = "length"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def next_request(self) -> tuple[list[int], int, int]:
        """(context, max_tokens, seed) of the next attempt: prompt + tokens so far, the budget left."""
        return self.prompt + self.token_ids, self.max_tokens - len(self.token_ids), \
            resume_seed(self.seed, len(self.token_ids))


class Interruptible:
    """Runs responses whose requests a weight update may abort and resume (module docstring). Every method runs on
    the loop that runs the requests."""

    def __init__(self, abort: Callable[[list[str]], Awaitable[None]], prefix: str = "rltrain-partial"):
        self.abort, self.version = abort, 0
        self.ids = (f"{prefix}-{i}" for i in itertools.count())
        self.open = asyncio.Event()
        self.open.set()
        self.in_flight: dict[str, asyncio.Task] = {}   # request id -> its attempt's task

    def hold(self, version: int) -> None:
        """The engine holds at least `version` (a generation's start; a push of a newer one may have overtaken it)."""
        self.version = max(self.version, version)

    async def run(self, response: PartialResponse, stream: Stream) -> PartialResponse:
        while not response.done:
            while not self.open.is_set():  # re-checked: a pause may follow a resume before this task wakes
                await self.open.wait()
            request_id, version = next(self.ids), self.version
            attempt = asyncio.create_task(self._attempt(response, stream, request_id, version))
            self.in_flight[request_id] = attempt
            response.attempts += 1
            try:
                await asyncio.wait([attempt])
            finally:
                self.in_flight.pop(request_id, None)
                attempt.cancel()   # a no-op once it is done; ends it when this response's own task is cancelled
            if not attempt.cancelled() and attempt.exception() is not None:
                raise attempt.exception()
        return response

    @staticmethod
    async def _attempt(response: PartialResponse, stream: Stream, request_id: str, version: int) -> None:
        context, max_tokens, seed = response.next_request()
        finish_reason = None
        async for token_ids, logprobs, finish_reason in stream(request_id, context, max_tokens, seed):
            response.add(token_ids, logprobs, version, finish_reason)
        if finish_reason is None:   # not cancelled, not aborted: resubmitting would loop
            raise RuntimeError(f"request {request_id} ended without a finish reason")

    async def pause(self) -> int:
        """Abort the attempts in flight and hold new ones until resume(); returns how many were aborted."""
        self.open.clear()
        attempts = dict(self.in_flight)
        if attempts:
            await self.abort(list(attempts))
            for task in attempts.values():
                task.cancel()
            await asyncio.gather(*attempts.values(), return_exceptions=True)
        return len(attempts)

    def resume(self, version: int | None = None) -> None:
        """Let the held attempts go, their tokens from now on stamped `version` (None: the version held so far)."""
        if version is not None:
            self.version = version
        self.open.set()


def partial_batch(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: list[PartialResponse],
                  groups: torch.Tensor, pad_token_id: int) -> TensorDict:
    """The rollout batch of finished responses: the engines' fields plus token_versions [B, R] (0 past an end)."""
    if not all(response.done for response in responses):
        raise RuntimeError("partial_batch: a response is unfinished")
    return TensorDict({
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "response_ids": right_pad([r.token_ids for r in responses], pad_token_id, torch.long),
        "response_mask": right_pad([[1] * len(r.token_ids) for r in responses], 0, torch.long),
        "rollout_logprobs": right_pad([r.logprobs for r in responses], 0.0, torch.float32),
        "token_versions": right_pad([r.versions for r in responses], 0, torch.long),
        "group_ids": groups, "truncated": torch.tensor([r.finish_reason == "length" for r in responses]),
    }, batch_size=[len(responses)])
