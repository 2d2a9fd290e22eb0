"""Black-box agents as episodes (rollout.multi_turn.agent, rltrain/tools/agent.py): per rollout call, the worker
serves an OpenAI-compatible endpoint (rltrain/workers/chat_endpoint.py) on the async engine's event loop, calls the
agent once per episode with the episode's row and base_url, and turns what the endpoint recorded into the agent
loop's batch: the episode's prompt is its agent's first request as the chat template renders it, its response every
reply's sampled tokens (response_mask 1, rollout_logprobs the engine's) with the tokens of the messages the agent
added between them (mask 0), `messages` the conversation of its last request and reply, `env_reward` the agent's
return value (NaN for None: no extra_info["env_reward"]), `turns` its replies; `tool_calls` and
`tool_invalid_calls` count the calls parsed from replies to requests that passed tools, `env_errors` agents that
raised or ran past timeout_s.

    loop = AgentEpisodes(config.multi_turn, AsyncVLLMTurns(engine), tokenizer, max_new_tokens)
    batch = loop.generate(prompt_ids, prompt_mask, n, temperature, seed, first_prompt, rows)

Scheduling: every episode's agent starts at once; a plain function runs in a daemon thread of its own (so one that
hangs past timeout_s cannot hold up the process's exit), a coroutine function on the event loop. The engine batches
whatever replies are in flight, as for the agent loop's async episodes. An agent that never sends a request leaves
an episode of its dataset prompt and no response tokens (response_mask all 0).

Agents' HTTP clients honour HTTP(S)_PROXY from the environment; where one is set, 127.0.0.1 joins no_proxy in the
rollout process, so their requests reach the endpoint rather than the proxy.

Only the async vLLM engine serves requests as they arrive (rollout.mode=async); rollout.validate refuses the agent on
the hf engine or the synchronous vLLM engine, naming rollout.mode / rollout.engine.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import math
import os
import threading
import traceback

import torch
from tensordict import TensorDict

from rltrain.config import ConfigError
from rltrain.tools.agent import AGENT_KEY, load_agent
from rltrain.tools.config import MultiTurnConfig
from rltrain.tools.parsers import PARSERS
from rltrain.workers.agent_loop import AgentLoop, Episode
from rltrain.workers.batch import left_pad
from rltrain.workers.chat_endpoint import ChatEndpoint
from rltrain.workers.sampling import response_seeds

logger = logging.getLogger(__name__)
PROXY_KEYS = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


class AgentEpisodes(AgentLoop):
    """The agent loop's generate() with a black-box agent per episode (module docstring)."""

    def __init__(self, config: MultiTurnConfig, turns, tokenizer, max_new_tokens: int):
        if not getattr(turns, "asynchronous", False):
            raise ConfigError(f"{AGENT_KEY}: needs rollout.engine=vllm and rollout.mode=async (the agent's requests "
                              "are served one by one as they arrive, on vLLM's async engine)")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{AGENT_KEY}: the policy's tokenizer has no chat template, which the endpoint needs "
                              "to render an agent's messages")
        self.config, self.turns, self.tokenizer, self.max_new_tokens = config, turns, tokenizer, max_new_tokens
        self.env, self.episode_rewards, self.warned = False, True, False
        self.agent = load_agent(config.agent)
        bypass_proxies_for_localhost()
        self.endpoint = ChatEndpoint(turns, tokenizer, PARSERS.get(config.parser), max_new_tokens, config.max_turns)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float, seed: int,
                 first_prompt: int = 0, rows: list[dict] | None = None) -> TensorDict:
        """n episodes per prompt, grouped consecutively, each with its response seed (the agent loop's contract);
        rows: each prompt's data row, which its agents get."""
        if rows is None or len(rows) != prompt_ids.shape[0]:
            raise ValueError(f"{AGENT_KEY}: agents need their episodes' data rows (got "
                             f"{'none' if rows is None else len(rows)} for {prompt_ids.shape[0]} prompts)")
        seeds = response_seeds(seed, first_prompt * n, prompt_ids.shape[0] * n).tolist()
        states, outcomes = self.turns.run(self._run([row for row in rows for _ in range(n)], seeds, temperature))
        dataset_prompts = [ids[mask.bool()].tolist() for ids, mask in
                           zip(prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0))]
        episodes, prompts = [], []
        for state, dataset_prompt, (reward, failed) in zip(states, dataset_prompts, outcomes):
            episode = state.episode if state.episode is not None else Episode(dataset_prompt)
            episode.env_reward = reward
            episode.counts["env_errors"] += failed
            episodes.append(episode)
            prompts.append(state.prompt if state.episode is not None else dataset_prompt)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return self._batch(*left_pad(prompts, pad), episodes, n)

    async def _run(self, rows: list[dict], seeds: list[int], temperature: float):
        """Every episode's agent against the endpoint: (the endpoint's episodes, (reward, failed) per episode)."""
        await self.endpoint.start(temperature)
        states = [self.endpoint.open(seed) for seed in seeds]
        first_error = []
        try:
            outcomes = await asyncio.gather(*(self._episode(state, copy.deepcopy(row), first_error)
                                              for state, row in zip(states, rows)))
        finally:
            await self.endpoint.stop()
        if self.endpoint.ignored:
            counts = ", ".join(f"{key} ×{count}" for key, count in self.endpoint.ignored.most_common())
            (logger.info if self.warned else logger.warning)(
                "%s: the requests' own sampling settings were ignored (%s): rollout.* decide sampling, so the "
                "trainer's log-probs are those of the distribution that sampled", AGENT_KEY, counts)
            self.warned = True
        return states, outcomes

    async def _episode(self, state, row: dict, first_error: list) -> tuple[float, bool]:
        """One agent's run: (its reward, NaN for none; whether it raised or timed out)."""
        url, kwargs = self.endpoint.base_url(state), dict(self.config.agent.kwargs)
        try:
            if inspect.iscoroutinefunction(self.agent):
                call = self.agent(row, url, **kwargs)
            else:
                call = in_daemon_thread(lambda: self.agent(row, url, **kwargs))
            reward = await asyncio.wait_for(call, self.config.agent.timeout_s)
            return (math.nan if reward is None else float(reward)), False
        except Exception as err:
            if not first_error:   # the batch's first, with its traceback
                first_error.append(err)
                what = f"ran past timeout_s={self.config.agent.timeout_s:g}" if isinstance(err, TimeoutError) \
                    else f"raised:\n{traceback.format_exc()}"
                logger.warning("%s: an agent %s; its episode ends as it stands (tool/env_errors counts them)",
                               AGENT_KEY, what)
            return math.nan, True
        finally:
            self.endpoint.close(state)

    def close(self) -> None:
        pass   # the endpoint stops after every rollout call; agents hold nothing between them


def bypass_proxies_for_localhost() -> None:
    """Put 127.0.0.1 on no_proxy where a proxy is set: agents' HTTP clients (httpx under openai, urllib, requests)
    read HTTP(S)_PROXY from the environment, and a cluster's proxy cannot reach the worker's own 127.0.0.1."""
    if not any(os.environ.get(key) for key in PROXY_KEYS):
        return
    for key in ("no_proxy", "NO_PROXY"):
        hosts = [host.strip() for host in os.environ.get(key, "").split(",") if host.strip()]
        if "127.0.0.1" not in hosts:
            os.environ[key] = ",".join(hosts + ["127.0.0.1"])
            logger.info("%s: %s=%s (a proxy is set; the endpoint is local)", AGENT_KEY, key, os.environ[key])


def in_daemon_thread(fn) -> asyncio.Future:
    """fn() in a daemon thread of its own, as a future of the running loop (cancelling it abandons the thread)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if not future.done():   # cancelled meanwhile (the agent's timeout)
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as err:   # reported to the waiting episode, as a raise of the agent
            result, error = None, err
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="rltrain-agent", daemon=True).start()
    return future
