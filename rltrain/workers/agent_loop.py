"""The multi-turn agent loop (rollout.multi_turn.enabled, issue 29): episodes in which the model calls tools and
reads their answers — or plays against an environment of the user's (rollout.multi_turn.env) — batched across
episodes, on the rollout engine through one small API. What answers a turn: rltrain/tools/environment.py.

    loop = AgentLoop(config.multi_turn, HFTurns(engine), tokenizer, max_new_tokens=config.max_new_tokens)
    batch = loop.generate(prompt_ids, prompt_mask, n, temperature, seed, first_prompt)   # the engines' TensorDict

The Turns APIs: HFTurns (rltrain/workers/hf_engine.py) and VLLMTurns (rltrain/workers/vllm_engine.py), each
returning a `Turn` (below) per context; both report the sampled tokens' log-probs where their engine does.

rollout.mode=async (a Turns API with `asynchronous = True`, `generate_one` and `run`: AsyncVLLMTurns in
rltrain/workers/vllm_async.py) runs each episode as its own asyncio task instead: the same turns, seeds (`turn_seed`)
and answers, but an episode sends its next turn as soon as its own tools (or environment step) have answered, and its
tool calls run as they come (ToolObservations.respond_one), so no episode waits for another's turn or tools. The
turn logic (`_take`, the answerers, `_observe`) is shared; only the scheduling differs.

One turn (sync): every open episode generates its next assistant turn in one batched engine call (`Turns.generate`:
token contexts in, each with its own token budget); each turn's text goes through the tool-call parser
(rollout.multi_turn.parser); the calls of all episodes of that turn go to ONE `ToolPool.call_many`, so episodes wait
for their tools together; each answer becomes a tool turn appended to its episode, and the episodes still open
generate their next turn together. An episode ends at a turn without calls, at max_turns (the last turn's calls get no
answers), or when its response reaches rollout.max_new_tokens, which counts every response token, the tools' included;
a tool turn that would leave no token for the model's answer ends the episode instead (`truncated`).

Tool turns: rendered through the tokenizer's chat template where it has one (the tokens the template adds for the
tool messages and the next assistant header, found by rendering a fixed one-message conversation with and without
them), else in the plain Hermes form `\\n<tool_response>\\n{content}\\n</tool_response>\\n` per result. Each tool
answer is cut to max_tool_response_tokens tokens before rendering.

A black-box agent (rollout.multi_turn.agent) drives its episode itself through an OpenAI-compatible endpoint:
rltrain/workers/agents.py (AgentEpisodes, this loop's batch and episodes) and rltrain/workers/chat_endpoint.py.

An environment's messages (its opening after the prompt, its answer to each turn) join the context the same way, cut
to max_tool_response_tokens each.

Output: the single-turn fields (rltrain/workers/batch.py) with response_ids holding every turn, and response_mask 1
exactly on the tokens the model sampled (its turns, each with its closing <eos>) and 0 on tool output, template
tokens and padding, so the loss, advantages and log-probs cover model tokens only; rollout_logprobs where the
engine reports them (0 where the mask is 0). Per episode: `turns`, `tool_calls`, `tool_errors` (raised or crashed),
`tool_timeouts`, `tool_invalid_calls`, `tool_worker_deaths` (the errors that were a tool's worker process dying),
`env_errors` (an environment that raised) ([B] tensors; `episode_metrics` turns them into tool/* metrics), with an
environment `env_reward` (the sum of its steps' rewards), and `messages`, the episode after its prompt as chat
messages (assistant turns with their tool_calls, then one tool message per answer, or the environment's messages),
which the reward function receives as extra_info["messages"].
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch
from tensordict import NonTensorStack, TensorDict

from rltrain.tools.chat import chat_template_tools
from rltrain.tools.config import MultiTurnConfig
from rltrain.tools.loader import load_tools
from rltrain.tools.parsers import PARSERS
from rltrain.tools.pool import ToolPool
from rltrain.workers.batch import group_ids, right_pad
from rltrain.tools.environment import EnvObservations, ToolObservations, load_environment
from rltrain.workers.sampling import response_seeds

PLAIN_TOOL_TURN = "\n<tool_response>\n{content}\n</tool_response>\n"
_TEMPLATE_BASE = [{"role": "user", "content": "."}]   # the fixed conversation tool turns are rendered after
EPISODE_FIELDS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_invalid_calls", "tool_worker_deaths",
                  "env_errors")


@dataclass
class Turn:
    """One generated turn: the sampled tokens (through the first <eos> if any), their log-probs if the engine
    reports them, and whether it ended with <eos> (False: it used up its budget)."""
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool


@dataclass
class Episode:
    context: list[int]                                   # prompt + response so far: the next turn's input
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)        # 1 = sampled by the model
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    counts: dict = field(default_factory=lambda: dict.fromkeys(EPISODE_FIELDS, 0))
    done: bool = False
    truncated: bool = False
    env_reward: float = 0.0

    def append(self, tokens: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.context += tokens
        self.response += tokens
        self.mask += [int(model)] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


class ToolTurns:
    """Tool answers → the tokens of the tool turn that joins the context (see the module docstring)."""

    def __init__(self, tokenizer, max_tokens: int):
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self.templated = bool(getattr(tokenizer, "chat_template", None))

    def cut(self, content: str) -> str:
        ids = self.tokenizer(content, add_special_tokens=False).input_ids
        return content if len(ids) <= self.max_tokens else self.tokenizer.decode(ids[:self.max_tokens])

    def render(self, messages: list[dict]) -> list[int]:
        text = self.templated_text(messages) if self.templated else None
        if text is None:  # no template, or one that renders the base differently once more messages follow
            text = "".join(PLAIN_TOOL_TURN.format(content=m["content"]) for m in messages)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def templated_text(self, messages: list[dict]) -> str | None:
        """What the chat template adds for `messages` and the next assistant header after a fixed conversation;
        None where the template renders that conversation differently once more messages follow."""
        base = self.tokenizer.apply_chat_template(_TEMPLATE_BASE, tokenize=False)
        full = self.tokenizer.apply_chat_template(_TEMPLATE_BASE + messages, tokenize=False,
                                                  add_generation_prompt=True)
        return full[len(base):] if full.startswith(base) else None


class AgentLoop:
    """Batched multi-turn episodes on one engine (`turns`: a Turns API such as HFTurns) with one ToolPool."""

    def __init__(self, config: MultiTurnConfig, turns, tokenizer, max_new_tokens: int, pool: ToolPool | None = None):
        self.config, self.turns, self.tokenizer, self.max_new_tokens = config, turns, tokenizer, max_new_tokens
        self.env = config.env.enabled
        self.episode_rewards = self.env   # whether episodes carry env_reward (an agent's do too: agents.py)
        self.answers = EnvObservations(load_environment(config.env), config.env.kwargs) if self.env else \
            ToolObservations(PARSERS.get(config.parser), pool if pool is not None else config.build_pool())
        self.tool_turns = ToolTurns(tokenizer, config.max_tool_response_tokens)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float, seed: int,
                 first_prompt: int = 0, rows: list[dict] | None = None) -> TensorDict:
        """n episodes per prompt, grouped consecutively (the engines' generate() contract, same seeding: one torch
        stream per call for hf, one seed per episode and turn for engines that seed requests). rows: each prompt's
        data row (an environment's reset reads it)."""
        torch.manual_seed(seed if first_prompt == 0 else int(response_seeds(seed, first_prompt * n, 1)))
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0)
        seeds = response_seeds(seed, first_prompt * n, prompt_ids.shape[0]).tolist()
        episodes = [Episode(ids[mask.bool()].tolist()) for ids, mask in zip(prompt_ids, prompt_mask)]
        self.answers.reset(episodes, None if rows is None else [row for row in rows for _ in range(n)],
                           self._observe)
        if getattr(self.turns, "asynchronous", False):   # rollout.mode=async: each episode at its own pace
            self.turns.run(self._all_episodes(episodes, seeds, temperature))
        else:
            self._turn_synchronous(episodes, seeds, temperature)
        return self._batch(prompt_ids, prompt_mask, episodes, n)

    def _turn_synchronous(self, episodes: list[Episode], seeds: list[int], temperature: float) -> None:
        """Turn k of every open episode in one engine call, then all their answers (the module docstring)."""
        for turn in range(self.config.max_turns):
            active = [(i, e) for i, e in enumerate(episodes) if not e.done]
            if not active:
                break
            outs = self.turns.generate([e.context for _, e in active], [self._budget(e) for _, e in active],
                                       temperature, [turn_seed(seeds[i], turn) for i, _ in active])
            replies = [self._take(episode, out) for (_, episode), out in zip(active, outs)]
            self.answers.respond(replies, self._last(turn), self._observe)

    async def _all_episodes(self, episodes: list[Episode], seeds: list[int], temperature: float) -> None:
        tasks = [asyncio.ensure_future(self._episode(e, s, temperature)) for e, s in zip(episodes, seeds)]
        try:
            await asyncio.gather(*tasks)
        finally:   # one episode raised: the others stop too (a cancelled request is aborted in the engine)
            for task in tasks:
                task.cancel()

    async def _episode(self, episode: Episode, seed: int, temperature: float) -> None:
        """One episode as its own task (rollout.mode=async): the same turns, seeds and answers as the turn-synchronous
        loop, each turn one request sent as soon as the episode's previous answer is in."""
        for turn in range(self.config.max_turns):
            if episode.done:
                return
            out = await self.turns.generate_one(episode.context, self._budget(episode), temperature,
                                                turn_seed(seed, turn))
            await self.answers.respond_one(*self._take(episode, out), self._last(turn), self._observe)

    def _budget(self, episode: Episode) -> int:
        return self.max_new_tokens - len(episode.response)

    def _last(self, turn: int) -> bool:
        return turn == self.config.max_turns - 1

    def _take(self, episode: Episode, out: Turn) -> tuple[Episode, str, bool]:
        """Append a generated turn to its episode: (episode, its text, whether it ended at <eos>) for the answerer."""
        episode.append(out.token_ids, model=True, logprobs=out.logprobs)
        episode.counts["turns"] += 1
        return episode, self.tokenizer.decode(out.token_ids, skip_special_tokens=True), out.finished

    def _observe(self, episode: Episode, messages: list[dict]) -> None:
        """Append the turn of `messages` (tool results, an environment's answer; each cut to max_tool_response_tokens),
        or end the episode when it would leave the model no token."""
        messages = [dict(m, content=self.tool_turns.cut(str(m.get("content", "")))) for m in messages]
        tokens = self.tool_turns.render(messages)
        episode.messages += messages
        if len(episode.response) + len(tokens) >= self.max_new_tokens:
            episode.done = episode.truncated = True
            return
        episode.append(tokens, model=False)

    def _batch(self, prompt_ids, prompt_mask, episodes: list[Episode], n: int) -> TensorDict:
        size = len(episodes)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        response_ids = right_pad([e.response for e in episodes], pad, torch.long)
        response_mask = right_pad([e.mask for e in episodes], 0, torch.long)
        logprobs = right_pad([e.logprobs for e in episodes], 0.0, torch.float32)
        fields = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                  "response_mask": response_mask, "group_ids": group_ids(size, n),
                  "truncated": torch.tensor([e.truncated for e in episodes]),
                  "messages": NonTensorStack.from_list([e.messages for e in episodes]),
                  **{key: torch.tensor([e.counts[key] for e in episodes]) for key in EPISODE_FIELDS}}
        if self.episode_rewards:
            fields["env_reward"] = torch.tensor([e.env_reward for e in episodes], dtype=torch.float32)
        if any(e.logprobs and any(e.logprobs) for e in episodes):
            fields["rollout_logprobs"] = logprobs * response_mask
        return TensorDict(fields, batch_size=[size])

    def close(self) -> None:
        self.answers.close()


def turn_seed(seed: int, turn: int) -> int:
    """The seed of an episode's turn `turn` (seed: the episode's response seed), in both modes."""
    return (seed + 7919 * turn) % 2**31


def episode_metrics(batch: TensorDict, prefix: str = "tool") -> dict[str, float]:
    """tool/calls, tool/errors, tool/timeouts, tool/invalid_calls, tool/worker_deaths (sums), tool/calls_per_episode and
    tool/turns_per_episode of a multi-turn batch; {} for a single-turn one."""
    if "tool_calls" not in batch.keys():
        return {}
    episodes = max(batch.batch_size[0], 1)
    metrics = {f"{prefix}/{key.removeprefix('tool_')}": float(batch[key].sum()) for key in EPISODE_FIELDS[1:]}
    metrics[f"{prefix}/calls_per_episode"] = float(batch["tool_calls"].sum()) / episodes
    metrics[f"{prefix}/turns_per_episode"] = float(batch["turns"].sum()) / episodes
    return metrics


def prompt_tools(config: MultiTurnConfig) -> list[dict] | None:
    """The tools' schemas in the form chat templates take (rendered into chat-format prompts), None when off."""
    if not config.enabled or not config.tools:   # off, or an environment's episodes
        return None
    return chat_template_tools(tool.schema for tool in load_tools(config.tool_specs()).values())
