"""The OpenAI-compatible chat-completions endpoint the rollout worker serves while black-box agents run
(rollout.multi_turn.agent, rltrain/workers/agents.py), token-tracked: every reply is sampled by the rollout engine
from the episode's token context, and the episode keeps exactly those token ids and log-probs.

Routes, on 127.0.0.1 and a free port (rltrain/workers/local_http.py), each episode under a random key:
    POST /episodes/<key>/v1/chat/completions     GET /episodes/<key>/v1/models
Anything else, an unknown or finished episode, or a request the endpoint refuses gets an OpenAI-style JSON error
(404, 405, 400), which the `openai` client raises as NotFoundError / BadRequestError.

An episode is one conversation that every request extends. Its first request's messages (with its `tools`, if any)
go through the tokenizer's chat template: those tokens are the episode's prompt. Each later request must resend that
conversation — every earlier message, and each reply as it came back — and add messages after the last reply; the
check is on messages (role, text content, tool calls' names and arguments), and only the added messages are
rendered (as the tool loop renders tool answers through the template: rltrain/workers/agent_loop.py ToolTurns), so
the context is the previous context followed by the tokens the model sampled and the new messages' tokens. Tokens,
not text, carry the history: re-rendering a reply's text could tokenize differently from what was sampled (a
template that drops a reply's reasoning, a reply cut at a budget, the <eos> a template writes otherwise). A request
that edits or drops earlier messages, or adds none, is refused (400, code "conversation_not_extended"): an episode is
one token sequence trained as one response; an agent that rewrites its history must start that history in an episode
of its own.

Per episode as in the tool loop: response_mask 1 on the sampled tokens (each reply through its <eos>), 0 on the added
messages' tokens; rollout.max_new_tokens bounds the whole response (a reply's max_tokens is the budget left, or the
request's max_tokens / max_completion_tokens where smaller; a request whose messages leave no room is refused with
code "context_length_exceeded"); rollout.multi_turn.max_turns bounds the replies (code "max_turns_reached"); each
reply's seed is the episode's turn seed (agent_loop.turn_seed), so a fixed seed replays the same replies to the same
requests.

Sampling is rollout.*'s (temperature, top_p, top_k, min_p, repetition_penalty): the trainer's log-probs are then those
of the distribution that sampled. A request's own sampling settings (temperature, top_p, seed, stop, ...) are
ignored and counted in the requests served (`ignored`, logged once per rollout by the caller); n > 1 and stream=true
are refused. With `tools` in a request, a reply's text goes through rollout.multi_turn.parser: well-formed calls come
back as the message's `tool_calls` (arguments a JSON string, finish_reason "tool_calls"), the text outside them as
its content; a reply with a malformed call comes back as text. `logprobs: true` returns the sampled tokens'
log-probs in OpenAI's form.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field

from rltrain.workers.agent_loop import Episode, ToolTurns, turn_seed
from rltrain.workers.local_http import HTTPError, LocalHTTPServer, Request

MODEL_ID = "policy"   # what /v1/models lists; a request may name any model, the policy answers
IGNORED_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "seed", "stop", "logit_bias", "top_logprobs", "tool_choice",
                "parallel_tool_calls", "response_format", "reasoning_effort")


@dataclass
class AgentEpisode:
    """The endpoint's side of one episode: its key, its seed, and what it has recorded so far."""
    key: str
    seed: int
    episode: Episode | None = None      # recorded with the first reply (its prompt: `prompt`)
    prompt: list[int] = field(default_factory=list)
    conversation: list[dict] = field(default_factory=list)   # the messages so far, normalized (the prefix check)
    replies: int = 0
    closed: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)   # one request of an episode at a time


class ChatEndpoint:
    """`turns`: an asynchronous Turns API (generate_one: AsyncVLLMTurns); `parse`: the tool-call parser."""

    def __init__(self, turns, tokenizer, parse, max_new_tokens: int, max_turns: int):
        self.turns, self.tokenizer, self.parse = turns, tokenizer, parse
        self.max_new_tokens, self.max_turns = max_new_tokens, max_turns
        self.tool_turns = ToolTurns(tokenizer, max_new_tokens)
        self.server = LocalHTTPServer(self.handle)
        self.episodes: dict[str, AgentEpisode] = {}
        self.temperature, self.ignored = 1.0, Counter()

    async def start(self, temperature: float) -> None:
        """Serve a rollout's episodes, sampled at `temperature` (the ignored-settings count starts afresh)."""
        self.temperature, self.ignored = temperature, Counter()
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()
        self.episodes.clear()

    def open(self, seed: int) -> AgentEpisode:
        state = AgentEpisode(secrets.token_hex(8), seed)
        self.episodes[state.key] = state
        return state

    def base_url(self, state: AgentEpisode) -> str:
        return f"http://127.0.0.1:{self.server.port}/episodes/{state.key}/v1"

    def close(self, state: AgentEpisode) -> None:
        """The episode is over: its later requests get 404."""
        state.closed = True
        self.episodes.pop(state.key, None)

    async def handle(self, request: Request) -> tuple[int, dict]:
        parts = request.path.split("?", 1)[0].strip("/").split("/")
        if len(parts) < 4 or parts[0] != "episodes" or parts[2] != "v1":
            raise HTTPError(404, f"no route {request.path!r}: an episode's API is its base_url "
                                 "(/episodes/<key>/v1) + /chat/completions or /models", "not_found")
        state, route = self.episodes.get(parts[1]), "/".join(parts[3:])
        if state is None:
            raise HTTPError(404, f"no episode {parts[1]!r} is running (it is over, or the key is wrong)",
                            "episode_not_found")
        if route == "models" and request.method == "GET":
            return 200, {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0,
                                                     "owned_by": "rltrain"}]}
        if route == "chat/completions":
            if request.method != "POST":
                raise HTTPError(405, f"{request.method} {request.path}: chat completions are POSTed",
                                "method_not_allowed")
            return 200, await self.complete(state, request.json())
        raise HTTPError(404, f"no route {request.path!r} (served: chat/completions, models)", "not_found")

    async def complete(self, state: AgentEpisode, body) -> dict:
        """One chat completion for the episode (module docstring): checked, extended, sampled, recorded."""
        messages, tools, limit = self._checked(body)
        async with state.lock:
            if state.closed:
                raise HTTPError(404, f"episode {state.key!r} is over", "episode_not_found")
            episode, added, normalized = self._context(state, messages, tools)
            budget = self.max_new_tokens - len(episode.response) - len(added)
            out = await self.turns.generate_one(episode.context + added, min(budget, limit or budget),
                                                self.temperature, turn_seed(state.seed, state.replies))
            if state.episode is None:   # recorded once a reply exists (a failed first request leaves none)
                state.episode, state.prompt = episode, list(episode.context)
            episode.append(added, model=False)
            episode.append(out.token_ids, model=True, logprobs=out.logprobs)
            episode.counts["turns"] += 1
            episode.truncated = not out.finished
            episode.done = len(episode.response) >= self.max_new_tokens
            message, finish = self._reply(episode, state.replies, out, bool(tools))
            state.replies += 1
            self.ignored.update(key for key in IGNORED_KEYS if body.get(key) is not None)   # in served requests
            state.conversation = normalized + [normalize(message, len(normalized))]
            episode.messages = [plain(m) for m in messages] + [message]
        reply = {"id": f"chatcmpl-{state.key}-{state.replies}", "object": "chat.completion",
                 "created": int(time.time()), "model": body.get("model") or MODEL_ID,
                 "choices": [{"index": 0, "message": message, "finish_reason": finish,
                              "logprobs": self._logprobs(out) if body.get("logprobs") else None}],
                 "usage": {"prompt_tokens": len(episode.context) - len(out.token_ids),
                           "completion_tokens": len(out.token_ids), "total_tokens": len(episode.context)}}
        return reply

    def _checked(self, body) -> tuple[list[dict], list | None, int | None]:
        """(messages, tools, max_tokens) of a request; HTTPError 400 for what the endpoint does not serve."""
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise HTTPError(400, "messages: must be a non-empty list of {role, content} objects", "invalid_messages")
        if body.get("n") not in (None, 1):
            raise HTTPError(400, f"n: must be 1 (got {body['n']!r}): an episode is one conversation; the rollout "
                                 "samples rollout.n episodes per prompt", "unsupported_parameter")
        if body.get("stream"):
            raise HTTPError(400, "stream: not served (the reply comes whole)", "unsupported_parameter")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise HTTPError(400, f"max_tokens: must be a positive integer (got {limit!r})", "invalid_value")
        return messages, body.get("tools") or None, limit

    def _context(self, state: AgentEpisode, messages: list[dict], tools) -> tuple[Episode, list[int], list[dict]]:
        """(the episode, the tokens the request adds to its context, the request's messages normalized)."""
        normalized = [normalize(m, i) for i, m in enumerate(messages)]
        if state.episode is None:   # the first request: its rendered messages are the episode's prompt
            return Episode(self._render_prompt(messages, tools)), [], normalized
        episode, seen = state.episode, state.conversation
        if episode.done:
            raise HTTPError(400, f"the episode has used its token budget (rollout.max_new_tokens="
                                 f"{self.max_new_tokens})", "context_length_exceeded")
        if state.replies >= self.max_turns:
            episode.done = True
            raise HTTPError(400, f"the episode has had its {self.max_turns} replies (rollout.multi_turn.max_turns)",
                            "max_turns_reached")
        differs = next((i for i, (a, b) in enumerate(zip(normalized, seen)) if a != b), None)
        if differs is not None or len(normalized) <= len(seen):
            where = f"messages[{differs}] differs from the episode's" if differs is not None else \
                f"the request's {len(normalized)} messages add none to the episode's {len(seen)}"
            raise HTTPError(400, f"{where}: each request must resend the conversation so far (every earlier "
                                 "message, each reply as it came back) and add messages after it",
                            "conversation_not_extended")
        added = self._render_added([plain(m) for m in messages[len(seen):]])
        if len(episode.response) + len(added) >= self.max_new_tokens:
            episode.done = episode.truncated = True
            raise HTTPError(400, f"the added messages ({len(added)} tokens) leave no room for a reply in the "
                                 f"episode's budget (rollout.max_new_tokens={self.max_new_tokens}, "
                                 f"{len(episode.response)} used)", "context_length_exceeded")
        return episode, added, normalized

    def _render_prompt(self, messages: list[dict], tools) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template([plain(m) for m in messages], tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as err:   # the template's own check (a role it has no form for, ...): the agent's to fix
            raise HTTPError(400, f"the chat template cannot render these messages: {type(err).__name__}: {err}",
                            "invalid_messages") from None
        # the template writes its special tokens (as rltrain.data.rows.prompt_ids tokenizes chat prompts)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _render_added(self, messages: list[dict]) -> list[int]:
        """The added messages' tokens, as the tool loop renders tool answers (its plain-Hermes fallback, which would
        show a user's message as a tool response, is refused instead)."""
        try:
            text = self.tool_turns.templated_text(messages)
        except Exception as err:   # the template's own check (roles that must alternate, ...)
            text, why = None, f"{type(err).__name__}: {err}"
        else:
            why = "it renders the earlier conversation differently once they follow"
        if text is None:
            raise HTTPError(400, f"the chat template cannot render the added messages after the conversation so far "
                                 f"({why})", "invalid_messages")
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _reply(self, episode: Episode, index: int, out, tools: bool) -> tuple[dict, str]:
        """The reply's assistant message and finish_reason; with tools, its calls parsed into tool_calls."""
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        message, finish = {"role": "assistant", "content": text}, "stop" if out.finished else "length"
        parsed = self.parse(text) if tools else None
        if parsed is not None and parsed.calls:
            bad = sum(call.error is not None for call in parsed.calls)
            episode.counts["tool_invalid_calls"] += bad
            if not bad:   # a malformed call leaves the whole text as content, for the agent to see
                episode.counts["tool_calls"] += len(parsed.calls)
                message = {"role": "assistant", "content": parsed.content, "tool_calls": [
                    {"id": f"call_{index}_{i}", "type": "function",
                     "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                    for i, call in enumerate(parsed.calls)]}
                finish = "tool_calls" if out.finished else finish
        return message, finish

    def _logprobs(self, out) -> dict:
        tokens = [self.tokenizer.decode([token]) for token in out.token_ids]
        return {"content": [{"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
                            for token, logprob in zip(tokens, out.logprobs or [0.0] * len(tokens))]}


def text_of(content, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of text parts (other parts are refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise HTTPError(400, f"{where}.content: must be a string or a list of text parts", "invalid_messages")


def arguments_of(arguments):
    """A tool call's arguments as an object (OpenAI sends them as a JSON string; templates read a mapping)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return arguments


def plain(message: dict) -> dict:
    """A message as chat templates take it: text content, tool-call arguments as objects, no null fields (an
    OpenAI client's message object carries refusal: null, audio: null, ...)."""
    out = {key: value for key, value in message.items() if value is not None}
    out["content"] = text_of(message.get("content"), "message")
    if message.get("tool_calls"):
        out["tool_calls"] = [{**call, "function": {**call["function"],
                                                   "arguments": arguments_of(call["function"].get("arguments"))}}
                             for call in message["tool_calls"]]   # their shape checked by normalize() first
    return out


def normalize(message: dict, index: int) -> dict:
    """What the prefix check compares: role, text content (ends stripped) and tool calls (names, arguments)."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              for c in calls):
        raise HTTPError(400, f"messages[{index}].tool_calls: must be a list of {{type, function: {{name, "
                             "arguments}}}} objects", "invalid_messages")
    return {"role": message["role"], "content": text_of(message.get("content"), f"messages[{index}]").strip(),
            "tool_calls": [(c["function"].get("name"), arguments_of(c["function"].get("arguments"))) for c in calls]}
