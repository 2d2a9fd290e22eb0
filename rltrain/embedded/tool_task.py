"""The warm start of the embedded tool task (data.task.kind=tool_arithmetic): supervised examples that teach the
Hermes tool-call format well but the habit of calling only weakly, so that RL starts from a model that rarely calls
the calculator and learns to (tool/calls_per_episode rises from about 0 towards 1).

Each warm-start example is, drawn at random:
- with probability 1 - DEMO_SHARE a direct answer, `prompt` -> `1665<eos>`: the model's in-head guess, mostly wrong
  on multi-digit products it has not seen;
- else a demonstration of a whole episode as the agent loop runs it: `prompt` ->
  `<tool_call>{"name":"calculator","arguments":{"expression":"37*45"}}</tool_call><eos>`, the tool turn
  `<tool_response>1665</tool_response>` (rendered by the agent loop's own ToolTurns; no loss on it, as RL's mask
  has none), then `1665<eos>`. Its first token `<tool_call>`, the decision to call, is a label in only CALL_SHARE of
  all examples; the rest of every demonstration trains the format and the copying (the operands into the call, the
  tool's answer into the final answer).

So the model learns to call well but opens a call on about CALL_SHARE / (CALL_SHARE + 1 - DEMO_SHARE) ≈ 6% of its
samples (the preset, seeds 0 and 1: 3.6% and 4.2% after the warm start, 2.9% and 3.3% of the first RL step's
episodes), and never greedily. The warm start stops once `forced_call_accuracy` (greedy episodes made to open with
`<tool_call>`, the calculator run in process) reaches model.embedded.warmstart_target_accuracy on the training
problems it probes.
"""

from __future__ import annotations

import random

import torch

from rltrain.data.rows import PromptRow, prompt_ids
from rltrain.rewards.builtin import tool_arithmetic_reward
from rltrain.tools.builtin.calculator import CalculatorError, calculator
from rltrain.tools.chat import chat_template_tools
from rltrain.tools.parsers import parse_hermes
from rltrain.workers.agent_loop import ToolTurns
from rltrain.workers.batch import left_pad, supervised_batch

DEMO_SHARE = 0.5     # examples that demonstrate a calculator episode: half, so the format is learned in ~100 steps
CALL_SHARE = 0.03    # examples whose <tool_call> opening is a label: calls start at ~6% of samples
CALL_TOKENS = 24     # greedy budget of a forced call: the call is 12 tokens + the expression + </tool_call> <eos>
ANSWER_TOKENS = 8    # greedy budget of the final answer (products of two 2-digit numbers have at most 4 digits)


def calculator_tools() -> list[dict]:
    """The tools the warm start renders into prompts: the calculator, as rollout.multi_turn hands it over."""
    return chat_template_tools([calculator.schema])


def expression(row: PromptRow) -> str:
    """The row's arithmetic: its user message without the trailing '='."""
    return row.prompt[-1]["content"].rstrip("=")


def call_text(expr: str) -> str:
    """A compact Hermes call of the calculator, as the tool tokenizer encodes it in 17 tokens for 'a*b'."""
    return f'<tool_call>{{"name":"calculator","arguments":{{"expression":"{expr}"}}}}</tool_call>'


def tool_turn_ids(tokenizer, content: str) -> list[int]:
    """The tokens of the tool turn answering with `content`, exactly as the agent loop renders it."""
    return ToolTurns(tokenizer, max_tokens=256).render([{"role": "tool", "name": "calculator", "content": content}])


def run_calculator(expr: str) -> str:
    try:
        return calculator(expr)
    except CalculatorError as exc:
        return f"Error: {exc}"


def sft_batch(rows: list[PromptRow], tokenizer, rng: random.Random):
    """(ids, attention mask, labels) of warm-start examples for `rows` (module docstring), right-padded."""
    tools, eos = calculator_tools(), tokenizer.eos_token_id
    sequences, targets = [], []
    for row in rows:
        prompt = prompt_ids(row.prompt, tokenizer, tools)
        answer = tokenizer(str(row.ground_truth)).input_ids + [eos]
        if rng.random() < DEMO_SHARE:
            call = tokenizer(call_text(expression(row))).input_ids + [eos]
            turn = tool_turn_ids(tokenizer, run_calculator(expression(row)))
            opening = call[0] if rng.random() < CALL_SHARE / DEMO_SHARE else -100
            sequences.append(prompt + call + turn + answer)
            targets.append([-100] * len(prompt) + [opening] + call[1:] + [-100] * len(turn) + answer)
        else:
            sequences.append(prompt + answer)
            targets.append([-100] * len(prompt) + answer)
    return supervised_batch(sequences, targets, tokenizer.pad_token_id)


def _greedy(model, tokenizer, contexts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each context's greedy continuation, through its first <eos> (kept) or the budget."""
    ids, mask = left_pad(contexts, tokenizer.pad_token_id)
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                         max_new_tokens=max_new_tokens,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    turns = []
    for tokens in out[:, ids.shape[1]:].tolist():
        end = tokens.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in tokens else len(tokens)
        turns.append(tokens[:end])
    return turns


@torch.no_grad()
def forced_call_accuracy(model, tokenizer, rows: list[PromptRow]) -> float:
    """Fraction of rows whose greedy episode, made to open with <tool_call>, calls the calculator right and ends
    with the right final answer (scored by the task's reward function)."""
    tools, opening = calculator_tools(), tokenizer.convert_tokens_to_ids("<tool_call>")
    prompts = [prompt_ids(row.prompt, tokenizer, tools) for row in rows]
    calls = [[opening] + tokens for tokens in _greedy(model, tokenizer, [p + [opening] for p in prompts],
                                                      CALL_TOKENS)]
    turns = []
    for call in calls:
        parsed = parse_hermes(tokenizer.decode(call, skip_special_tokens=True))
        good = [c for c in parsed.calls if c.error is None and c.name == "calculator"
                and isinstance(c.arguments.get("expression"), str)]
        content = run_calculator(good[0].arguments["expression"]) if good else "Error: no calculator call"
        turns.append(tool_turn_ids(tokenizer, content))
    answers = _greedy(model, tokenizer, [p + c + t for p, c, t in zip(prompts, calls, turns)], ANSWER_TOKENS)
    texts = [tokenizer.decode(c + t + a, skip_special_tokens=True) for c, t, a in zip(calls, turns, answers)]
    return sum(tool_arithmetic_reward(r.data_source, text, r.ground_truth) for text, r in zip(texts, rows)) / len(rows)


@torch.no_grad()
def call_probability(model, tokenizer, rows: list[PromptRow]) -> float:
    """The mean probability that the model's response opens with <tool_call> (at temperature 1)."""
    tools, opening = calculator_tools(), tokenizer.convert_tokens_to_ids("<tool_call>")
    ids, mask = left_pad([prompt_ids(row.prompt, tokenizer, tools) for row in rows],
                         tokenizer.pad_token_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
    return logits.softmax(-1)[:, opening].mean().item()
