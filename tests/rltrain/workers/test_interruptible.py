"""Abort and resume (rltrain/workers/interruptible.py) on a stand-in engine, no vLLM: a pause mid-generation keeps every
token with the version that sampled it, resumes each unfinished response as prompt + tokens so far with the budget
left, leaves the responses finished before it alone, and starts no request while paused; with unchanged weights the
tokens are exactly those of an uninterrupted run. Both ways an engine may end an aborted stream are run: a final
"abort" output (vLLM 0.32) or only the cancellation of its consumer.

    .venv/bin/python -m pytest tests/rltrain/workers/test_interruptible.py -q     # a second
"""

import asyncio

import pytest
import torch

from rltrain.workers.interruptible import ABORTED, Interruptible, PartialResponse, partial_batch, resume_seed

EOS, PAD = 99, 0


class StandIn:
    """A greedy engine: token k of a response is 100·weights + k, log-prob −(weights + 1); prompt [target, 0] ends
    the response with EOS as its target-th token. One token per loop turn; records every request it starts."""

    def __init__(self, final_abort_output: bool):
        self.weights, self.final_abort_output = 0, final_abort_output
        self.events, self.aborted, self.emitted = [], set(), 0

    async def stream(self, request_id, context, max_tokens, seed):
        self.events.append(("start", request_id, list(context), max_tokens, seed))
        target, generated = context[0], len(context) - 2
        for count in range(max_tokens):
            await asyncio.sleep(0)
            if request_id in self.aborted:
                if self.final_abort_output:
                    yield [], [], ABORTED
                    return
                await asyncio.Event().wait()   # as an engine without a final abort output: until cancelled
            position = generated + count
            token = EOS if position == target - 1 else 100 * self.weights + position
            self.emitted += 1
            finish = "stop" if token == EOS else "length" if count == max_tokens - 1 else None
            yield [token], [-(self.weights + 1.0)], finish
            if finish:
                return

    async def abort(self, request_ids):
        self.aborted.update(request_ids)


def _responses(targets, max_tokens=8):
    return [PartialResponse([target, 0], max_tokens, seed=i + 1) for i, target in enumerate(targets)]


async def _generate(engine, runner, responses, push_after=None, new_weights=0):
    """All responses at once; after `push_after` tokens in all, a pause, new weights, resume(version 1)."""
    tasks = [asyncio.create_task(runner.run(r, engine.stream)) for r in responses]
    if push_after is not None:
        while engine.emitted < push_after:
            await asyncio.sleep(0)
        aborted = await runner.pause()
        engine.events.append(("pause", aborted))
        for _ in range(5):   # held: no request starts while paused
            await asyncio.sleep(0)
        engine.weights = new_weights
        engine.events.append(("resume",))
        runner.resume(1)
    await asyncio.gather(*tasks)
    return responses


TARGETS = [2, 6, 12, 9]   # 12, 9 > max_tokens 8: truncated


@pytest.mark.parametrize("final_abort_output", [True, False], ids=["abort-output", "cancel-only"])
def test_an_unchanged_push_gives_the_uninterrupted_tokens_with_versions_switching_at_the_abort(final_abort_output):
    engine = StandIn(final_abort_output)

    async def uninterrupted():
        return await _generate(engine, Interruptible(engine.abort), _responses(TARGETS))

    plain = asyncio.run(uninterrupted())
    engine = StandIn(final_abort_output)

    async def interrupted():
        return await _generate(engine, Interruptible(engine.abort), _responses(TARGETS), push_after=6)

    pushed = asyncio.run(interrupted())
    for before, after in zip(plain, pushed):
        assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
        assert after.finish_reason == before.finish_reason
    assert [r.finish_reason for r in pushed] == ["stop", "stop", "length", "length"]
    assert [len(r.token_ids) for r in pushed] == [2, 6, 8, 8]
    # the first response ended before the push: one attempt, all version 0; the others switch once, at the abort
    assert pushed[0].attempts == 1 and pushed[0].versions == [0, 0]
    for r in pushed[1:]:
        switch = r.versions.index(1)
        assert r.attempts == 2 and 0 < switch and r.versions == [0] * switch + [1] * (len(r.versions) - switch)
    pause = next(i for i, e in enumerate(engine.events) if e[0] == "pause")
    resume = engine.events.index(("resume",))
    # in flight: the three unfinished requests (and the first one's, if its stream had not closed yet)
    assert engine.events[pause][1] in (3, 4) and resume > pause
    starts = [e for e in engine.events if e[0] == "start"]
    assert all(engine.events.index(e) < pause or engine.events.index(e) > resume for e in starts)
    # each resumed request: prompt + its tokens so far, the budget left, a seed of its own
    for index, r in enumerate(pushed[1:], 1):
        switch = r.versions.index(1)
        resumed = next(e for e in starts[4:] if e[2][0] == TARGETS[index])
        assert resumed[2] == [TARGETS[index], 0] + r.token_ids[:switch] and resumed[3] == 8 - switch
        assert resumed[4] == resume_seed(index + 1, switch) != index + 1


def test_changed_weights_reach_the_tokens_after_the_abort():
    engine = StandIn(final_abort_output=True)

    async def interrupted():
        return await _generate(engine, Interruptible(engine.abort), _responses(TARGETS), push_after=6, new_weights=3)

    pushed = asyncio.run(interrupted())
    for r in pushed:
        for position, (token, logprob, version) in enumerate(zip(r.token_ids, r.logprobs, r.versions)):
            weights = 3 if version == 1 else 0
            assert token in (EOS, 100 * weights + position) and logprob == -(weights + 1.0)
    assert sum(v == 1 for r in pushed for v in r.versions) > 0
    batch = partial_batch(torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.long), pushed,
                          torch.arange(4), PAD)
    assert batch["response_mask"].sum(1).tolist() == [2, 6, 8, 8]
    assert batch["truncated"].tolist() == [False, False, True, True]
    assert batch["token_versions"][0].tolist() == [0] * 8   # 0 past the end
    assert batch["token_versions"][3].tolist() == pushed[3].versions
    assert batch["rollout_logprobs"][3].tolist() == pushed[3].logprobs


def test_a_pause_with_nothing_in_flight_aborts_nothing_and_versions_hold():
    engine = StandIn(final_abort_output=True)

    async def scenario():
        runner = Interruptible(engine.abort)
        assert await runner.pause() == 0
        runner.resume(4)
        runner.hold(2)   # a generation that was told version 2 after the push of 4 overtook it
        return await runner.run(_responses([3])[0], engine.stream), engine.aborted

    response, aborted = asyncio.run(scenario())
    assert response.versions == [4, 4, 4] and not aborted


def test_a_stream_that_ends_without_a_finish_reason_is_an_error():
    async def silent(request_id, context, max_tokens, seed):
        yield [5], [-1.0], None

    async def scenario():
        return await Interruptible(StandIn(True).abort).run(_responses([4])[0], silent)

    with pytest.raises(RuntimeError, match="ended without a finish reason"):
        asyncio.run(scenario())


def test_the_budget_ends_a_response_whatever_ended_its_request():
    response = PartialResponse([1, 2], max_tokens=3, seed=9)
    response.add([7, 8], [-0.1, -0.2], 0, ABORTED)
    assert not response.done and response.next_request() == ([1, 2, 7, 8], 1, resume_seed(9, 2))
    response.add([5], [-0.3], 1, ABORTED)
    assert response.finish_reason == "length" and response.versions == [0, 0, 1]
    with pytest.raises(RuntimeError, match="1 token"):
        PartialResponse([1], 2, 0).add([1], [], 0, None)
