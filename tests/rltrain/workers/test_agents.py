"""Black-box agents through the rollout's OpenAI-compatible endpoint (rltrain/workers/agents.py, chat_endpoint.py),
in process on a fake asynchronous engine (`FakeTurns`: each reply is the digits of its seed, then <eos>, with made-up
log-probs), agents talking plain HTTP (urllib): the real vLLM path and the `openai` client are
tests/rltrain/workers/test_vllm_agents.py's.

- the recorded episode is exactly the engine's: prompt = the first request rendered, response = every sampled reply
  (mask 1, the engine's log-probs) with the added messages' tokens between them (mask 0), each request's context the
  episode's so far, its seed the turn seed, its budget what is left; the agent's return value is env_reward, which
  the reward function gets (none for None) with the conversation;
- tool calls in replies come back as OpenAI tool_calls and a tool answer joins the context as the tool loop renders it;
- refusals are OpenAI-style JSON errors: unknown routes and episodes, n > 1, stream, bad JSON, an edited or
  unextended conversation, added messages the chat template cannot render, max_turns, the token budget; the
  request's own sampling settings are ignored and counted;
- an engine failure is a 500 that records nothing (the retried request is the episode's first);
- agents that raise or time out end their episodes (env_errors, no reward), coroutine agents run on the loop; a
  proxy set in the environment is bypassed for the local endpoint;
- config errors name the key (hf engine, sync mode, tools beside the agent, a missing function, bad kwargs).
"""

import json
import math
import os

import pytest
import torch

from rltrain.config import ConfigError, from_mapping
from rltrain.data.rows import PromptRow
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.tools import MultiTurnConfig
from rltrain.workers.agent_loop import Turn, turn_seed
from rltrain.workers.agents import AgentEpisodes
from rltrain.workers.reward import RewardConfig, RewardWorker, response_texts
from rltrain.workers.rollout import RolloutConfig
from rltrain.workers.sampling import response_seeds
from rltrain.workers.vllm_async import EventLoopThread
from tests.rltrain.workers.test_agent_loop import _prompts

AGENTS = r'''
import asyncio
import json
import time
import urllib.error
import urllib.request


def post(base_url, body=None, path="/chat/completions", method="POST", data=None):
    """(status, JSON reply) of one request."""
    data = data if data is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def record(directory, base_url, what):
    with open(f"{directory}/{base_url.split('/')[-2]}.json", "w") as file:
        json.dump(what, file)


def chat(row, base_url, turns=2, follow_up="more", directory=None, tools=None):
    """turns requests, each resending the conversation so far and adding follow_up (or, after tool calls, the tool's
    answer "3"); returns the number of replies."""
    messages, replies = [{"role": "user", "content": row["prompt"]}], []
    for turn in range(turns):
        if turn and replies[-1]["choices"][0]["message"].get("tool_calls"):
            call = replies[-1]["choices"][0]["message"]["tool_calls"][0]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "3"})
        elif turn:
            messages.append({"role": "user", "content": follow_up})
        status, reply = post(base_url, {"model": "policy", "messages": messages, "logprobs": True, "tools": tools})
        assert status == 200, reply
        replies.append(reply)
        messages.append(dict(reply["choices"][0]["message"], refusal=None))   # as an openai client's model_dump
    if directory:
        record(directory, base_url, replies)
    return float(len(replies))


def probe(row, base_url, directory):
    """Every refusal the endpoint makes, then the limits: each result (status, reply)."""
    first = [{"role": "user", "content": row["prompt"]}]
    out = {"models": post(base_url, path="/models", method="GET"),
           "get_chat": post(base_url, method="GET"),
           "n2": post(base_url, {"messages": first, "n": 2}),
           "stream": post(base_url, {"messages": first, "stream": True}),
           "empty": post(base_url, {"messages": []}),
           "bad_json": post(base_url, data=b"{"),
           "bad_max_tokens": post(base_url, {"messages": first, "max_tokens": 0}),
           "unknown_episode": post(base_url.replace(base_url.split("/")[-2], "0" * 16), {"messages": first}),
           "no_route": post(base_url.split("/episodes")[0] + "/v1", {"messages": first})}
    out["first"] = post(base_url, {"messages": first, "temperature": 0.1, "top_p": 0.5, "max_tokens": 2})
    reply = out["first"][1]["choices"][0]["message"]
    out["edited"] = post(base_url, {"messages": [{"role": "user", "content": "9"}, reply,
                                                 {"role": "user", "content": "x"}]})
    out["nothing_added"] = post(base_url, {"messages": first + [reply]})
    out["bad_role"] = post(base_url, {"messages": first + [reply, {"role": "bad", "content": "x"}]})
    out["second"] = post(base_url, {"messages": first + [reply, {"role": "user", "content": "x"}]})
    second = out["second"][1]["choices"][0]["message"]
    out["long"] = post(base_url, {"messages": first + [reply, {"role": "user", "content": "x"}, second,
                                                       {"role": "user", "content": "y" * 300}]})
    out["after_budget"] = post(base_url, {"messages": first + [reply, {"role": "user", "content": "x"}, second,
                                                               {"role": "user", "content": "z"}]})
    record(directory, base_url, out)


def retries(row, base_url):
    """The first request meets an engine failure (500), the same request again a reply."""
    body = {"messages": [{"role": "user", "content": row["prompt"]}]}
    status, reply = post(base_url, body)
    assert status == 500 and reply["error"]["type"] == "server_error" and "hiccup" in reply["error"]["message"]
    status, reply = post(base_url, body)
    assert status == 200, reply
    return 1.0


def raises(row, base_url):
    raise RuntimeError("the agent broke")


def sleeps(row, base_url):
    time.sleep(30)


async def asks_once(row, base_url):
    """A coroutine agent on the rollout's loop: one request through a thread (urllib blocks)."""
    status, reply = await asyncio.to_thread(post, base_url, {"messages": [{"role": "user", "content": "1"}]})
    assert status == 200, reply
    return None
'''


class FakeTurns:
    """An asynchronous Turns API (AsyncVLLMTurns' shape): a reply is the digits of its seed then <eos>, cut to the
    budget, with log-prob -(i + 1) / 10 for its i-th token; `calls` records (context, budget, temperature, seed)."""

    asynchronous = True

    def __init__(self, tokenizer, script=None):
        self.tokenizer, self.events, self.calls, self.outs = tokenizer, EventLoopThread(), [], []
        self.script = script or (lambda context, seed: str(seed % 1000))

    def run(self, coroutine):
        return self.events.run(coroutine)

    async def generate_one(self, context, budget, temperature, seed):
        text = self.script(self.tokenizer.decode(context), seed)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
        out = Turn(ids[:budget], [-(i + 1) / 10 for i in range(min(budget, len(ids)))], len(ids) <= budget)
        self.calls.append((list(context), budget, temperature, seed))
        self.outs.append(out)
        return out


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def agents(tmp_path):
    (tmp_path / "agents.py").write_text(AGENTS)
    return str(tmp_path / "agents.py")


def _loop(tokenizer, path, name, kwargs=None, max_new_tokens=64, turns=None, **config):
    agent = {"path": path, "name": name, "kwargs": kwargs or {}, "timeout_s": config.pop("timeout_s", 60.0)}
    config = from_mapping(MultiTurnConfig, {"enabled": True, "max_turns": 4, **config, "agent": agent},
                          "rollout.multi_turn")
    turns = turns or FakeTurns(tokenizer)
    return AgentEpisodes(config, turns, tokenizer, max_new_tokens), turns


def _rows(texts):
    return [{"prompt": t, "data_source": "t", "ground_truth": "0", "extra_info": {}} for t in texts]


def _replies(directory):
    return {path.stem: json.loads(path.read_text()) for path in directory.glob("*.json")}


def test_an_agent_episode_is_what_the_engine_sampled(tokenizer, agents, tmp_path):
    (tmp_path / "seen").mkdir()
    loop, turns = _loop(tokenizer, agents, "chat", {"turns": 3, "directory": str(tmp_path / "seen")})
    texts = ["12+7=", "3+4="]
    ids, mask = _prompts(tokenizer, texts)
    batch = loop.generate(ids, mask, 2, 0.7, seed=5, first_prompt=1, rows=_rows(texts))
    seeds, more = response_seeds(5, 2, 4).tolist(), tokenizer("more", add_special_tokens=False).input_ids
    assert batch["turns"].tolist() == [3] * 4 and batch["env_reward"].tolist() == [3.0] * 4
    assert len(turns.calls) == 12 and {c[2] for c in turns.calls} == {0.7}
    for i in range(4):
        prompt = tokenizer(texts[i // 2], add_special_tokens=False).input_ids
        assert batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist() == prompt
        by_seed = {call[3]: (call, out) for call, out in zip(turns.calls, turns.outs)}
        calls = [by_seed[turn_seed(seeds[i], t)] for t in range(3)]   # the episode's turn seeds, in order
        response, pattern, logprobs = [], [], []
        for t, ((context, budget, _, _), out) in enumerate(calls):
            if t:
                response, pattern, logprobs = response + more, pattern + [0] * len(more), logprobs + [0.0] * len(more)
            assert context == prompt + response and budget == 64 - len(response)
            response, pattern, logprobs = response + out.token_ids, pattern + [1] * len(out.token_ids), \
                logprobs + out.logprobs
        width = len(response)
        assert batch["response_ids"][i, :width].tolist() == response
        assert batch["response_mask"][i].tolist() == pattern + [0] * (batch["response_mask"].shape[1] - width)
        assert torch.allclose(batch["rollout_logprobs"][i, :width], torch.tensor(logprobs))
        assert not batch["truncated"][i] and batch["env_errors"][i] == 0
    # what each agent read is the decoded sampled tokens, with their log-probs, and its conversation is `messages`
    seen = _replies(tmp_path / "seen")
    assert len(seen) == 4
    by_seed = {turn_seed(s, 0) % 1000: i for i, s in enumerate(seeds)}
    for replies in seen.values():
        i = by_seed[int(replies[0]["choices"][0]["message"]["content"])]
        contents = [r["choices"][0]["message"]["content"] for r in replies]
        assert contents == [str(turn_seed(seeds[i], t) % 1000) for t in range(3)]
        assert [r["choices"][0]["finish_reason"] for r in replies] == ["stop"] * 3
        assert [p["logprob"] for p in replies[0]["choices"][0]["logprobs"]["content"]] == pytest.approx(
            [-(k + 1) / 10 for k in range(len(contents[0]) + 1)])
        assert batch["messages"][i] == [{"role": "user", "content": texts[i // 2]},
                                        {"role": "assistant", "content": contents[0]},
                                        {"role": "user", "content": "more"},
                                        {"role": "assistant", "content": contents[1]},
                                        {"role": "user", "content": "more"},
                                        {"role": "assistant", "content": contents[2]}]


def test_tool_calls_come_back_as_openai_tool_calls(agents, tmp_path):
    tokenizer = build_char_tokenizer(tools=True)
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"1+2"}}</tool_call>'
    script = (lambda context, seed: "3" if "<tool_response>" in context else call)
    (tmp_path / "seen").mkdir()
    schema = {"type": "function", "function": {"name": "calculator", "description": "d", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
    loop, turns = _loop(tokenizer, agents, "chat", {"turns": 2, "directory": str(tmp_path / "seen"),
                                                    "tools": [schema]}, turns=FakeTurns(tokenizer, script))
    ids, mask = _prompts(tokenizer, ["1+2="])
    batch = loop.generate(ids, mask, 1, 1.0, seed=0, rows=_rows(["1+2="]))
    (replies,) = _replies(tmp_path / "seen").values()
    first = replies[0]["choices"][0]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] == ""
    assert first["message"]["tool_calls"] == [{"id": "call_0_0", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "1+2"}'}}]
    assert replies[1]["choices"][0]["message"] == {"role": "assistant", "content": "3"}
    answer = tokenizer("<tool_response>3</tool_response>", add_special_tokens=False).input_ids
    sampled = turns.outs[0].token_ids
    assert turns.calls[1][0] == turns.calls[0][0] + sampled + answer   # the tool loop's rendering of the answer
    assert turns.calls[0][0] == tokenizer("tools: calculator(expression)\n1+2=", add_special_tokens=False).input_ids
    assert batch["tool_calls"].tolist() == [1] and batch["turns"].tolist() == [2]
    width = len(sampled) + len(answer) + len(turns.outs[1].token_ids)
    assert batch["response_mask"][0, :width].tolist() == [1] * len(sampled) + [0] * len(answer) + \
        [1] * len(turns.outs[1].token_ids)


def test_refusals_are_openai_errors(agents, tmp_path):
    (tmp_path / "seen").mkdir()
    tokenizer = build_char_tokenizer()   # a template that raises on a role it has no form for
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad role') }}"
                               "{% endif %}{{ m.content }}{% endfor %}")
    loop, turns = _loop(tokenizer, agents, "probe", {"directory": str(tmp_path / "seen")}, max_new_tokens=40)
    ids, mask = _prompts(tokenizer, ["5+5="])
    batch = loop.generate(ids, mask, 1, 1.0, seed=3, rows=_rows(["5+5="]))
    (out,) = _replies(tmp_path / "seen").values()
    assert out["models"] == [200, {"object": "list", "data": [{"id": "policy", "object": "model", "created": 0,
                                                                "owned_by": "rltrain"}]}]
    expected = {"get_chat": (405, "method_not_allowed"), "n2": (400, "unsupported_parameter"),
                "stream": (400, "unsupported_parameter"), "empty": (400, "invalid_messages"),
                "bad_json": (400, None), "bad_max_tokens": (400, "invalid_value"),
                "unknown_episode": (404, "episode_not_found"), "no_route": (404, "not_found"),
                "edited": (400, "conversation_not_extended"), "nothing_added": (400, "conversation_not_extended"),
                "bad_role": (400, "invalid_messages"),
                "long": (400, "context_length_exceeded"), "after_budget": (400, "context_length_exceeded")}
    for key, (status, code) in expected.items():
        assert out[key][0] == status and out[key][1]["error"]["code"] == code, (key, out[key])
        assert out[key][1]["error"]["type"] == "invalid_request_error" and out[key][1]["error"]["message"]
    assert "messages[0] differs" in out["edited"][1]["error"]["message"]
    assert "no bad role" in out["bad_role"][1]["error"]["message"]
    # max_tokens 2 cut the first reply (finish_reason length) without ending the episode; the second went through
    assert out["first"][1]["choices"][0]["finish_reason"] == "length" and len(turns.outs[0].token_ids) == 2
    assert out["second"][0] == 200 and [c[1] for c in turns.calls] == [2, 40 - 2 - 1]
    assert batch["turns"].tolist() == [2] and batch["truncated"].tolist() == [True]   # refused for its budget
    assert dict(loop.endpoint.ignored) == {"temperature": 1, "top_p": 1}


def test_max_turns_is_refused(tokenizer, agents, tmp_path):
    (tmp_path / "seen").mkdir()
    loop, turns = _loop(tokenizer, agents, "chat", {"turns": 3}, max_turns=2)
    ids, mask = _prompts(tokenizer, ["5+5="])
    batch = loop.generate(ids, mask, 1, 1.0, seed=3, rows=_rows(["5+5="]))
    # the third request got 400 max_turns_reached, so the agent's assert raised: its episode keeps its two replies
    assert batch["turns"].tolist() == [2] and batch["env_errors"].tolist() == [1]
    assert math.isnan(batch["env_reward"][0]) and len(turns.calls) == 2


def test_agents_that_fail_and_coroutine_agents(tokenizer, agents):
    ids, mask = _prompts(tokenizer, ["1+1="])
    for name, timeout in (("raises", 60.0), ("sleeps", 0.5)):
        loop, turns = _loop(tokenizer, agents, name, timeout_s=timeout)
        batch = loop.generate(ids, mask, 2, 1.0, seed=0, rows=_rows(["1+1="]))
        assert batch["env_errors"].tolist() == [1, 1] and batch["turns"].tolist() == [0, 0], name
        assert torch.isnan(batch["env_reward"]).all() and not batch["response_mask"].any()
        prompt = tokenizer("1+1=").input_ids   # no request: the dataset prompt stands
        assert batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist() == prompt
    loop, turns = _loop(tokenizer, agents, "asks_once")
    batch = loop.generate(ids, mask, 2, 1.0, seed=0, rows=_rows(["1+1="]))
    assert batch["turns"].tolist() == [1, 1] and batch["env_errors"].tolist() == [0, 0]
    assert torch.isnan(batch["env_reward"]).all()   # None: the reward function decides
    assert batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist() == tokenizer("1").input_ids


def test_a_proxy_in_the_environment_is_bypassed(tokenizer, agents, monkeypatch):
    """A cluster's HTTP_PROXY (here a port nothing listens on) would take the agents' requests: 127.0.0.1 joins
    no_proxy, kept beside the hosts already there."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("no_proxy", "example.org")
    monkeypatch.delenv("NO_PROXY", raising=False)
    loop, _ = _loop(tokenizer, agents, "asks_once")
    ids, mask = _prompts(tokenizer, ["1+1="])
    batch = loop.generate(ids, mask, 1, 1.0, seed=0, rows=_rows(["1+1="]))
    assert batch["turns"].tolist() == [1] and batch["env_errors"].tolist() == [0]
    assert os.environ["no_proxy"] == "example.org,127.0.0.1" and os.environ["NO_PROXY"] == "127.0.0.1"


def test_an_engine_failure_is_a_500_and_records_nothing(tokenizer, agents):
    failed = []

    def script(context, seed):
        if not failed:
            failed.append(seed)
            raise RuntimeError("engine hiccup")
        return "7"

    loop, turns = _loop(tokenizer, agents, "retries", turns=FakeTurns(tokenizer, script))
    ids, mask = _prompts(tokenizer, ["1+1="])
    batch = loop.generate(ids, mask, 1, 1.0, seed=0, rows=_rows(["1+1="]))
    assert batch["env_errors"].tolist() == [0] and batch["turns"].tolist() == [1]
    assert batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist() == tokenizer("1+1=").input_ids
    sampled = tokenizer("7", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    assert batch["response_ids"][0].tolist() == sampled and batch["response_mask"][0].tolist() == [1, 1]
    assert turns.calls[0][3] == failed[0]   # the retry is the same turn: the same seed


def test_the_reward_function_gets_the_agents_reward_and_conversation(tokenizer, agents, tmp_path):
    """As the trainer passes them: env_reward where the agent returned one (none for None), the conversation of the
    last request and reply as extra_info["messages"]."""
    (tmp_path / "reward.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': extra_info.get('env_reward', -1.0), 'messages': float(len(extra_info['messages']))}\n")
    worker = RewardWorker(RewardConfig(path=str(tmp_path / "reward.py"), name="score", num_workers=1))
    ids, mask = _prompts(tokenizer, ["2+2="])
    try:
        for name, score, messages in (("chat", 2.0, 4.0), ("asks_once", -1.0, 2.0)):
            loop, _ = _loop(tokenizer, agents, name)
            batch = loop.generate(ids, mask, 1, 1.0, seed=0, rows=_rows(["2+2="]))
            texts = response_texts(tokenizer, batch["response_ids"], batch["response_mask"])
            rewards, extras, errors = worker.score(texts, [PromptRow("2+2=", "t", "4", {})],
                                                   batch["messages"].tolist(), batch["env_reward"].tolist())
            assert errors.errors == 0 and rewards.tolist() == [score] and extras[0]["messages"] == messages, name
    finally:
        worker.close()


@pytest.mark.parametrize("rollout, key", [
    ({"engine": "hf"}, "rollout.multi_turn.agent"),
    ({"engine": "vllm", "mode": "sync"}, "rollout.multi_turn.agent"),
    ({"engine": "vllm", "mode": "async", "multi_turn": {"tools": [{"builtin": "calculator"}]}},
     "rollout.multi_turn.agent"),
    ({"engine": "vllm", "mode": "async", "multi_turn": {"agent": {"name": "missing"}}},
     "rollout.multi_turn.agent.name"),
    ({"engine": "vllm", "mode": "async", "multi_turn": {"agent": {"kwargs": {"nope": 1}}}},
     "rollout.multi_turn.agent.kwargs"),
    ({"engine": "vllm", "mode": "async", "multi_turn": {"agent": {"timeout_s": 0}}},
     "rollout.multi_turn.agent.timeout_s"),
], ids=["hf", "vllm-sync", "tools-beside", "missing-function", "bad-kwargs", "timeout"])
def test_config_errors_name_the_key(agents, monkeypatch, rollout, key):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())   # vllm counts as installed
    multi_turn = rollout.pop("multi_turn", {})
    agent = {"path": agents, "name": "chat", **multi_turn.pop("agent", {})}
    section = {**rollout, "multi_turn": {"enabled": True, **multi_turn, "agent": agent}}
    with pytest.raises(ConfigError) as err:
        from_mapping(RolloutConfig, section, "rollout")
    assert str(err.value).startswith(key + ":"), err.value
