"""The multi-turn agent loop (rltrain/workers/agent_loop.py), in process, without Ray:

- with a scripted policy (a Turns API that answers each episode's context with given text): response_mask is 1
  exactly on the generated tokens, the tool's output is in response_ids under mask 0, the episode's messages and
  counts; every episode's calls of a turn go to one call_many; malformed calls get an error tool turn and the
  episode goes on; a hanging tool costs one timeout, not the batch; max_turns and the token budget hold;
- the actor: tokens under mask 0 get no gradient (perturbing their advantages / old log-probs leaves the update
  bit-identical, perturbing a model token's does not), and the padded and packed paths agree on a multi-turn batch
  (both read the tool tokens inside a response);
- the real hf engine: RolloutWorker with multi_turn on draws what the single-turn engine draws when the model calls
  no tool; HFTurns keeps each context's own budget;
- tool turns through a chat template; the reward gets the whole episode text and extra_info["messages"];
- config: the section loads from config/grpo.yaml; rollout.stop and tensor_parallel_size > 1 with it are refused
  naming the key (rollout.engine=vllm runs it: tests/rltrain/workers/test_vllm_turns.py).

Run: `pytest tests/rltrain/workers/test_agent_loop.py` (CPU, about half a minute).
"""

import time
from dataclasses import replace

import pytest
import torch

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.config import ConfigError
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.tools import MultiTurnConfig, ToolPool
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.agent_loop import AgentLoop, ToolTurns, Turn, episode_metrics
from rltrain.workers.hf_engine import HFTurns
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.rltrain.tiny_job import save_tiny_policy

EXTRA = '<>{}"_/[]'
CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
SLEEP_TOOL = '''
from rltrain.tools import tool
import time

@tool(description="Sleep.", parameters={"type": "object", "properties": {"s": {"type": "number"}},
                                         "required": ["s"]})
def nap(s):
    time.sleep(s)
    return "slept"
'''


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(EXTRA)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_tiny_policy(tmp_path_factory.mktemp("policy"), tokenizer)


@pytest.fixture(scope="module")
def calculator_pool():
    with ToolPool([{"builtin": "calculator"}], timeout_s=5.0, num_workers=2) as pool:
        yield pool


class SpyPool:
    """A ToolPool that records every call_many batch."""

    def __init__(self, pool):
        self.pool, self.batches = pool, []

    def call_many(self, calls):
        self.batches.append(list(calls))
        return self.pool.call_many(calls)


class ScriptedTurns:
    """The Turns API with a scripted policy: script(context text, turn index) -> the turn's text (then <eos>),
    cut to the context's budget like an engine."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, contexts, budgets, temperature, seeds):
        self.calls.append(len(contexts))
        turns = []
        for context, budget in zip(contexts, budgets):
            text = self.tokenizer.decode(context, skip_special_tokens=True)
            ids = self.tokenizer(self.script(text, len(self.calls) - 1), add_special_tokens=False).input_ids
            ids = ids + [self.tokenizer.eos_token_id]
            turns.append(Turn(ids[:budget], None, len(ids) <= budget))
        return turns


def _prompts(tokenizer, texts):
    encoded = [tokenizer(t).input_ids for t in texts]
    width = max(map(len, encoded))
    ids = torch.full((len(texts), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(texts), width), dtype=torch.long)
    for i, seq in enumerate(encoded):
        ids[i, width - len(seq):], mask[i, width - len(seq):] = torch.tensor(seq), 1
    return ids, mask


def _loop(tokenizer, script, pool, max_new_tokens=200, **config):
    config = MultiTurnConfig(enabled=True, tools=[{"builtin": "calculator"}], **config)
    turns = ScriptedTurns(tokenizer, script)
    return AgentLoop(config, turns, tokenizer, max_new_tokens, pool=pool), turns


def _calc_then_answer(text, turn):
    """Turn 0: the prompt's product through the calculator; then answer with what the tool said."""
    return "ok " + CALC % text.split("=")[0] if turn == 0 else "answer " + text.rsplit("</tool_call>", 1)[-1]


def test_mask_is_one_exactly_on_generated_tokens(tokenizer, calculator_pool):
    spy = SpyPool(calculator_pool)
    loop, turns = _loop(tokenizer, _calc_then_answer, spy)
    ids, mask = _prompts(tokenizer, ["12*34=", "7*8="])
    batch = loop.generate(ids, mask, 2, 1.0, seed=0)
    assert turns.calls == [4, 4] and len(spy.batches) == 1 and len(spy.batches[0]) == 4  # one call_many for all
    assert batch["group_ids"].tolist() == [0, 0, 1, 1] and not batch["truncated"].any()
    for i, expected in enumerate(["408", "408", "56", "56"]):
        response, keep = batch["response_ids"][i], batch["response_mask"][i]
        length = int((response != tokenizer.pad_token_id).sum())
        generated = tokenizer.decode(response[keep.bool()].tolist())
        assert generated == f"ok {CALC % ('12*34' if i < 2 else '7*8')}<eos>answer {expected}<eos>"
        tool_tokens = response[:length][keep[:length] == 0]
        assert tokenizer.decode(tool_tokens.tolist()) == expected  # the tool's output, in the response, mask 0
        assert keep[length:].sum() == 0
        messages = batch["messages"][i]
        assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
        assert messages[0]["tool_calls"][0]["function"]["name"] == "calculator" and messages[1]["content"] == expected
    assert batch["tool_calls"].tolist() == [1] * 4 and batch["turns"].tolist() == [2] * 4
    metrics = episode_metrics(batch)
    assert metrics["tool/calls_per_episode"] == 1.0 and metrics["tool/turns_per_episode"] == 2.0
    assert metrics["tool/errors"] == metrics["tool/timeouts"] == metrics["tool/invalid_calls"] == 0


def test_malformed_call_gets_an_error_turn_and_the_episode_goes_on(tokenizer, calculator_pool):
    script = lambda text, turn: '<tool_call>{"name": calculator}</tool_call>' if turn == 0 else "done"  # noqa: E731
    loop, _ = _loop(tokenizer, script, calculator_pool)
    batch = loop.generate(*_prompts(tokenizer, ["1+1="]), 1, 1.0, seed=0)
    messages = batch["messages"][0]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"] and messages[2]["content"] == "done"
    assert messages[1]["content"].startswith("Error: the tool call is not valid JSON")
    assert batch["tool_invalid_calls"].tolist() == [1] and batch["turns"].tolist() == [2]
    text = tokenizer.decode(batch["response_ids"][0][batch["response_mask"][0] == 0].tolist(),
                            skip_special_tokens=True)
    assert text.startswith("Error: the tool call is not valid JSON")


def test_a_hanging_tool_costs_one_timeout_not_the_batch(tokenizer, tmp_path):
    (tmp_path / "nap.py").write_text(SLEEP_TOOL)
    call = '<tool_call>{"name": "nap", "arguments": {"s": %s}}</tool_call>'
    script = lambda text, turn: (call % ("30" if text.startswith("1") else "0")) if turn == 0 else "done"  # noqa
    tools = [{"path": str(tmp_path / "nap.py"), "name": "nap"}]
    config = MultiTurnConfig(enabled=True, tools=tools, tool_timeout_s=1.0, num_workers=2)
    with config.build_pool() as pool:
        loop = AgentLoop(config, ScriptedTurns(tokenizer, script), tokenizer, 200, pool=pool)
        start = time.monotonic()
        batch = loop.generate(*_prompts(tokenizer, ["1=", "2="]), 1, 1.0, seed=0)
        elapsed = time.monotonic() - start
    assert elapsed < 6.0, elapsed  # one 1 s timeout (and a worker restart), not 30 s
    assert batch["tool_timeouts"].tolist() == [1, 0] and batch["turns"].tolist() == [2, 2]
    assert "did not finish within 1 s" in batch["messages"][0][1]["content"]
    assert batch["messages"][1][1]["content"] == "slept"


def test_max_turns_and_the_token_budget(tokenizer, calculator_pool):
    always = lambda text, turn: CALC % "2*3"  # noqa: E731
    loop, turns = _loop(tokenizer, always, calculator_pool, max_new_tokens=400, max_turns=3)
    batch = loop.generate(*_prompts(tokenizer, ["1="]), 1, 1.0, seed=0)
    assert turns.calls == [1, 1, 1] and batch["turns"].tolist() == [3] and batch["tool_calls"].tolist() == [2]
    assert not batch["truncated"].any()  # stopped by max_turns, its last turn complete

    turn_tokens = len(CALC % "2*3") + 1
    budget = 2 * turn_tokens  # room for turn 1 and its answer, then turn 2 is cut
    loop, turns = _loop(tokenizer, always, calculator_pool, max_new_tokens=budget, max_turns=4)
    batch = loop.generate(*_prompts(tokenizer, ["1="]), 1, 1.0, seed=0)
    length = int((batch["response_ids"][0] != tokenizer.pad_token_id).sum())
    assert length == budget and batch["truncated"].tolist() == [True] and batch["turns"].tolist() == [2]
    assert batch["response_mask"][0].sum() == budget - 1  # all but the tool's one token "6"

    loop, _ = _loop(tokenizer, always, calculator_pool, max_new_tokens=turn_tokens + 1, max_turns=4)
    batch = loop.generate(*_prompts(tokenizer, ["1="]), 1, 1.0, seed=0)  # the answer would leave no room
    assert batch["truncated"].tolist() == [True] and batch["response_mask"][0].tolist() == [1] * turn_tokens
    assert batch["tool_calls"].tolist() == [1]  # called, answered, but the answer does not join the context


def _actor(model_dir, **config):
    return ActorWorker(ActorConfig(torch_threads=1, lr=1e-2, **config), LossConfig(), model_dir, "float32", None,
                       temperature=1.0, seed=0)


def _episode_batch(tokenizer, calculator_pool):
    loop, _ = _loop(tokenizer, _calc_then_answer, calculator_pool)
    batch = loop.generate(*_prompts(tokenizer, ["12*34=", "7*8="]), 2, 1.0, seed=0)
    del batch["messages"]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    batch["advantages"] = compute_advantages("grpo", rewards, batch["response_mask"], batch["group_ids"])
    return batch


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_tool_tokens_get_no_gradient(model_dir, tokenizer, calculator_pool, packed):
    batch = _episode_batch(tokenizer, calculator_pool)
    tool = (batch["response_mask"] == 0) & (batch["response_ids"] != tokenizer.pad_token_id)
    assert tool.any()

    def updated(perturb) -> dict:
        actor = _actor(model_dir, use_remove_padding=packed)
        b = batch.clone()
        b["old_logprobs"] = actor.compute_logprobs(b)
        perturb(b)
        actor.update(b, 1)
        return {k: v.clone() for k, v in actor.model.state_dict().items()}

    def on(where):
        def perturb(b):
            b["advantages"] = torch.where(where, 50.0, b["advantages"])
            b["old_logprobs"] = torch.where(where, -9.0, b["old_logprobs"])
        return perturb

    reference = updated(lambda b: None)
    same = updated(on(tool))
    assert all(torch.equal(reference[k], same[k]) for k in reference)
    model_token = torch.zeros_like(tool)
    model_token[0, 2] = True
    moved = updated(on(model_token))
    assert any(not torch.equal(reference[k], moved[k]) for k in reference)


def test_padded_and_packed_agree_on_a_multi_turn_batch(model_dir, tokenizer, calculator_pool):
    batch = _episode_batch(tokenizer, calculator_pool)
    packed = _actor(model_dir, use_remove_padding=True).compute_logprobs(batch)
    padded = _actor(model_dir, use_remove_padding=False).compute_logprobs(batch)
    keep = batch["response_mask"] != 0
    torch.testing.assert_close(padded[keep], packed[keep], rtol=1e-5, atol=1e-5)
    assert (packed[~keep] == 0).all()


def test_hf_engine_without_calls_draws_the_single_turn_responses(model_dir):
    config = RolloutConfig(n=2, max_new_tokens=6, torch_threads=1)
    tokenizer = build_char_tokenizer(EXTRA)
    ids, mask = _prompts(tokenizer, ["12+3=", "4+5="])
    single = RolloutWorker(config, model_dir, "float32", None).generate(ids, mask, 2, 1.0, seed=3)
    multi_config = replace(config, multi_turn=MultiTurnConfig(enabled=True, tools=[{"builtin": "calculator"}],
                                                              num_workers=1))
    worker = RolloutWorker(multi_config, model_dir, "float32", None)
    multi = worker.generate(ids, mask, 2, 1.0, seed=3)
    worker.agent_loop.close()
    assert multi["turns"].tolist() == [1] * 4 and multi["tool_calls"].sum() == 0
    torch.testing.assert_close(multi["response_mask"], single["response_mask"][:, :multi["response_mask"].shape[1]])
    keep = single["response_mask"].bool()
    assert torch.equal(multi["response_ids"][keep[:, :multi["response_ids"].shape[1]]], single["response_ids"][keep])
    assert torch.equal(multi["truncated"], single["truncated"])


def test_hf_turns_keep_each_contexts_budget(model_dir):
    config = RolloutConfig(max_new_tokens=8, torch_threads=1)
    engine = RolloutWorker(config, model_dir, "float32", None).engine
    turns = HFTurns(engine)
    contexts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    torch.manual_seed(0)
    out = turns.generate(contexts, [1, 3, 8], 1.0, [0, 0, 0])
    eos = set(engine.eos_token_ids)
    for turn, budget in zip(out, [1, 3, 8]):
        assert 1 <= len(turn.token_ids) <= budget and turn.logprobs is None
        assert turn.finished == (turn.token_ids[-1] in eos) and not eos & set(turn.token_ids[:-1])


def test_hf_turns_report_the_sampled_log_probs(model_dir):
    """With logprobs on, each turn's log-probs are log softmax(logits / T) of its context at its tokens."""
    engine = RolloutWorker(RolloutConfig(max_new_tokens=8, torch_threads=1), model_dir, "float32", None,
                           logprobs=True).engine
    contexts, temperature = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], 1.7
    torch.manual_seed(0)
    for context, turn in zip(contexts, HFTurns(engine).generate(contexts, [2, 5, 8], temperature, [0, 0, 0])):
        assert len(turn.logprobs) == len(turn.token_ids)
        with torch.no_grad():
            logits = engine.model(torch.tensor([context + turn.token_ids])).logits[0, len(context) - 1:-1]
        expected = (logits.double() / temperature).log_softmax(-1).gather(1, torch.tensor(turn.token_ids)[:, None])
        torch.testing.assert_close(torch.tensor(turn.logprobs, dtype=torch.float64), expected[:, 0], rtol=0,
                                   atol=2e-5)


def test_tool_turns_through_a_chat_template_and_cut_to_max_tokens(tokenizer):
    from tests.rltrain.tools.test_chat import QWEN_STYLE

    templated = build_char_tokenizer(EXTRA + "|")
    templated.chat_template = QWEN_STYLE
    turns = ToolTurns(templated, max_tokens=4)
    tokens = turns.render([{"role": "tool", "name": "calculator", "content": "42"}])
    assert templated.decode(tokens) == "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    assert turns.cut("123456789") == "1234" and turns.cut("12") == "12"
    plain = build_char_tokenizer(EXTRA)
    plain.chat_template = None
    assert plain.decode(ToolTurns(plain, 4).render([{"role": "tool", "content": "42"}])) == \
        "\n<tool_response>\n42\n</tool_response>\n"


def test_reward_gets_the_episode(tokenizer, calculator_pool, tmp_path):
    from rltrain.data.rows import PromptRow
    from rltrain.workers.reward import RewardConfig, RewardWorker, response_texts

    (tmp_path / "reward.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    tools = [m['content'] for m in extra_info['messages'] if m['role'] == 'tool']\n"
        "    return {'score': float(ground_truth in tools), 'seen': float(ground_truth in solution_str),\n"
        "            'index': float(extra_info['index'])}\n")
    loop, _ = _loop(tokenizer, _calc_then_answer, calculator_pool)
    batch = loop.generate(*_prompts(tokenizer, ["12*34=", "7*8="]), 1, 1.0, seed=0)
    rows = [PromptRow("12*34=", "t", "408", {"index": 0}), PromptRow("7*8=", "t", "56", {"index": 1})]
    worker = RewardWorker(RewardConfig(path=str(tmp_path / "reward.py"), name="score", num_workers=1))
    texts = response_texts(tokenizer, batch["response_ids"], batch["response_mask"])
    try:
        rewards, extras, errors = worker.score(texts, rows, batch["messages"].tolist())
    finally:
        worker.close()
    assert errors.errors == 0 and errors.samples == 2 and rewards.tolist() == [1.0, 1.0]
    assert [e["seen"] for e in extras] == [1.0, 1.0] and [e["index"] for e in extras] == [0.0, 1.0]
    assert texts[0].startswith("ok <tool_call>") and "408" in texts[0]  # the whole episode, tool output included


def test_config_section_and_engine_check():
    from rltrain.job import load_job_config
    from tests.rltrain.tiny_job import compose

    assert load_job_config(compose()).rollout.multi_turn == MultiTurnConfig()
    job = load_job_config(compose("rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[{builtin: calculator}]"))
    assert job.rollout.multi_turn.enabled and job.rollout.multi_turn.tools == [{"builtin": "calculator"}]
    on = ("rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[{builtin: calculator}]")
    with pytest.raises(ConfigError, match=r"^rollout\.stop: must be empty with rollout\.multi_turn\.enabled"):
        load_job_config(compose(*on, "rollout.stop=[x]"))
    with pytest.raises(ConfigError, match=r"^rollout\.tensor_parallel_size: must be 1 with rollout\.multi_turn"):
        load_job_config(compose(*on, "rollout.tensor_parallel_size=2"))
    with pytest.raises(ConfigError, match=r"^rollout\.multi_turn\.tools: must list at least one tool"):
        load_job_config(compose("rollout.multi_turn.enabled=true"))
    # the hf engine's turns report their log-probs (test_hf_turns_report_the_sampled_log_probs): off-policy runs too
    for off_policy in ("trainer.mode=one_step_off", "algorithm.old_logprobs=rollout", "algorithm.loss.decoupled=true"):
        assert load_job_config(compose(*on, off_policy, "rollout.placement=separate")).rollout_reports_logprobs
