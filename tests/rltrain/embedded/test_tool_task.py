"""The embedded tool task (data.task.kind=tool_arithmetic, preset task=tool_arithmetic), in process:

- rows: chat prompts of 2-digit products, a disjoint split, and the default task's rows unchanged;
- reward: the final answer after the last tool response, a direct answer too; the arithmetic scorer cannot read
  tool episodes;
- tokenizer: tool calls round-trip through the tool vocabulary (tags and JSON pieces single tokens, kept by
  skip_special_tokens, saved and reloaded), the default vocabulary keeps its ids; the chat template hands the model
  the calculator and renders tool turns as the agent loop appends them;
- parser: reads the call the tiny model writes; a malformed one is answered with the error the model then reads;
- warm start: examples and labels (no loss on prompts and tool answers, the call's opening rarely a label), the
  forced-call accuracy of a model that calls and copies perfectly;
- the agent loop on this tokenizer: response_mask is 0 exactly on the calculator's answer tokens;
- config: the preset composes, and the kind without it is refused naming the preset.

    pytest tests/rltrain/embedded/test_tool_task.py   # a few seconds
"""

import random
import re
from pathlib import Path

import pytest
import torch

from rltrain.config import ConfigError
from rltrain.data.rows import render_prompt
from rltrain.embedded import tool_task
from rltrain.embedded.config import TaskConfig
from rltrain.embedded.task import DATA_SOURCE, TOOL_DATA_SOURCE, make_rows
from rltrain.embedded.tokenizer import CHARS, SPECIAL, TOOL_TOKENS, build_char_tokenizer
from rltrain.job import load_job_config
from rltrain.rewards.builtin import BUILTIN_REWARDS
from rltrain.tools import MultiTurnConfig, ToolPool, parse_hermes
from rltrain.workers.agent_loop import AgentLoop, ToolTurns, Turn, episode_metrics
from tests.rltrain.tiny_job import compose

ROOT = Path(__file__).resolve().parents[3]
TOOL_TASK = TaskConfig(kind="tool_arithmetic", min_operand=10, max_operand=99, operators="*")
CALL = '<tool_call>{"name":"calculator","arguments":{"expression":"37*45"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(tools=True)


def test_rows_are_chat_prompts_of_two_digit_products():
    train, val = make_rows(TOOL_TASK)
    assert len(train) == 90 * 90 - 200 and len(val) == 200
    prompts = lambda rows: {r.prompt[0]["content"] for r in rows}  # noqa: E731
    assert not prompts(train) & prompts(val)
    for row in train[:50] + val[:50]:
        assert [m["role"] for m in row.prompt] == ["user"] and row.data_source == TOOL_DATA_SOURCE
        a, b = map(int, row.prompt[0]["content"].rstrip("=").split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row.ground_truth == str(a * b)
    assert tool_task.expression(train[0]) == train[0].prompt[0]["content"][:-1]


def test_default_task_rows_are_unchanged():
    train, val = make_rows(TaskConfig())
    assert [(r.prompt, r.ground_truth, r.data_source) for r in val[:3]] == [
        ("10+16=", "26", DATA_SOURCE), ("0+38=", "38", DATA_SOURCE), ("19+9=", "28", DATA_SOURCE)]
    assert [r.prompt for r in train[:3]] == ["15+34=", "6+27=", "40+45="] and len(train) == 50 * 50 - 200


@pytest.mark.parametrize("overrides, message", [
    ({"kind": "tools"}, "data.task.kind: must be one of arithmetic, tool_arithmetic"),
    ({"min_operand": 60}, "data.task.max_operand: must be >= 1 and >= min_operand (60)"),
    ({"min_operand": 10, "max_operand": 19, "num_val": 100}, "data.task.num_val: leaves no training problems "
                                                             "(the task has 100)"),
], ids=["unknown-kind", "min-above-max", "no-training-rows"])
def test_task_keys_are_validated(overrides, message):
    task = {"kind": "arithmetic", **overrides}
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_job_config({"data": {"task": task}})


def test_reward_scores_the_final_answer():
    score = BUILTIN_REWARDS.get("default")
    episode = f"{CALL}<tool_response>1665</tool_response>1665"
    assert score(TOOL_DATA_SOURCE, episode, "1665") == 1.0
    assert score(TOOL_DATA_SOURCE, "1665", "1665") == 1.0                     # answered in its head
    assert score(TOOL_DATA_SOURCE, f"{CALL}<tool_response>1665</tool_response>1656", "1665") == 0.0
    assert score(TOOL_DATA_SOURCE, f"{CALL}<tool_response>1665</tool_response>", "1665") == 0.0  # no answer
    assert score(TOOL_DATA_SOURCE, f"{CALL}<tool_response>1665</tool_response>{CALL}", "1665") == 0.0
    assert BUILTIN_REWARDS.get("arithmetic")(DATA_SOURCE, episode, "1665") == 0.0  # why the task has its own


def test_tool_calls_round_trip_through_the_tokenizer(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    ids = tokenizer(CALL).input_ids
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert len(ids) == 17 and pieces[0] == "<tool_call>" and pieces[-1] == "</tool_call>"
    assert pieces[1:10] == ['{"', "name", '":"', "calculator", '","', "arguments", '":{"', "expression", '":"']
    assert tokenizer.unk_token_id not in ids
    text = f"{CALL}<tool_response>1665</tool_response>1665"
    assert tokenizer.decode(tokenizer(text).input_ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text
    assert parse_hermes(tokenizer.decode(ids, skip_special_tokens=True)).calls[0].arguments == {"expression": "37*45"}
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text).input_ids == tokenizer(text).input_ids and loaded.chat_template == tokenizer.chat_template
    # JSON outside the calculator's words still encodes, a character at a time
    other = '{"name": "python", "x": {}}'
    encoded = tokenizer(other).input_ids
    assert tokenizer.decode(encoded) == other and tokenizer.unk_token_id not in encoded


def test_default_vocabulary_keeps_its_ids(tokenizer):
    default = build_char_tokenizer()
    assert len(default) == len(SPECIAL + CHARS) and len(tokenizer) == len(default) + len(TOOL_TOKENS) + 3
    assert all(tokenizer.convert_tokens_to_ids(t) == default.convert_tokens_to_ids(t) for t in SPECIAL + CHARS)
    assert default("name 37*45=").input_ids == [default.convert_tokens_to_ids(c) for c in "name 37*45="]
    assert default.chat_template != tokenizer.chat_template


def test_chat_template_hands_over_the_calculator_and_renders_tool_turns(tokenizer):
    from rltrain.tools import ToolResult, assistant_message, tool_message

    prompt = render_prompt([{"role": "user", "content": "37*45="}], tokenizer, tool_task.calculator_tools())
    assert prompt == "tools: calculator(expression)\n37*45="
    assert tokenizer.unk_token_id not in tokenizer(prompt).input_ids
    assert render_prompt([{"role": "user", "content": "37*45="}], tokenizer) == "37*45="  # no tools, no line
    turn = ToolTurns(tokenizer, max_tokens=256).render([{"role": "tool", "name": "calculator", "content": "1665"}])
    assert tokenizer.decode(turn) == "<tool_response>1665</tool_response>" == \
        tokenizer.decode(tool_task.tool_turn_ids(tokenizer, "1665"))
    messages = [{"role": "user", "content": "37*45="}, assistant_message(parse_hermes(CALL)),
                tool_message(ToolResult("calculator", "1665", call_id="call_0")),
                {"role": "assistant", "content": "1665"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == \
        f"37*45={CALL}<tool_response>1665</tool_response>1665"  # the episode renders back as the model wrote it


def test_malformed_calls_are_answered_with_the_error_the_model_reads(tokenizer):
    unclosed, bad_json = CALL.removesuffix("</tool_call>"), CALL.replace('":{"', '":"', 1)
    calls = [parse_hermes(text).calls[0] for text in (CALL, unclosed, bad_json)]
    assert calls[0].error is None and calls[1].error == "the <tool_call> tag is not closed with </tool_call>"
    assert "not valid JSON" in calls[2].error
    with ToolPool([{"builtin": "calculator"}], timeout_s=5.0, num_workers=1) as pool:
        results = pool.call_many(calls)
    assert [r.status for r in results] == ["ok", "invalid", "invalid"] and results[0].content == "1665"
    turns = ToolTurns(tokenizer, max_tokens=256)
    seen = [tokenizer.decode(turns.render([{"role": "tool", "content": r.content}]), skip_special_tokens=True)
            for r in results[1:]]
    assert seen[0] == "<tool_response>Error: the <tool_call> tag is not closed with </tool_call></tool_response>"
    assert seen[1].startswith("<tool_response>Error: the tool call is not valid JSON (Expecting ")


def test_warm_start_examples_and_labels(tokenizer):
    rows = make_rows(TOOL_TASK)[0][:400]
    rng = random.Random(0)
    ids, mask, labels = tool_task.sft_batch(rows, tokenizer, rng)
    opening, eos = tokenizer.convert_tokens_to_ids("<tool_call>"), tokenizer.eos_token_id
    demos = opened = 0
    for row, seq, keep, label in zip(rows, ids, mask, labels):
        seq, label = seq[keep.bool()].tolist(), label[keep.bool()].tolist()
        prompt = f"tools: calculator(expression)\n{row.prompt[0]['content']}"
        call = CALL.replace("37*45", tool_task.expression(row))
        text = tokenizer.decode(seq)
        trained = tokenizer.decode([t for t in label if t != -100])
        if text.startswith(prompt + "<tool_call>"):
            demos += 1
            turn = f"<tool_response>{row.ground_truth}</tool_response>"
            assert text == f"{prompt}{call}<eos>{turn}{row.ground_truth}<eos>"
            opened += label[len(tokenizer(prompt).input_ids)] == opening
            assert trained in (f"{call}<eos>{row.ground_truth}<eos>", f"{call.removeprefix('<tool_call>')}<eos>"
                                                                       f"{row.ground_truth}<eos>")
        else:
            assert text == f"{prompt}{row.ground_truth}<eos>" and trained == f"{row.ground_truth}<eos>"
        assert label[-1] == eos and all(t == -100 for t in label[:len(tokenizer(prompt).input_ids)])
    assert 150 < demos < 250 and 2 <= opened <= 30  # DEMO_SHARE 0.5 of 400; CALL_SHARE 0.03 of 400 = 12


class PerfectCaller(torch.nn.Module):
    """A 'model' whose generate writes the compact call of its prompt's product, then copies the tool's answer."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer
        self.device = torch.device("cpu")   # where the accuracy sends the prompts

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        tok, out = self.tokenizer, []
        for ids, keep in zip(input_ids, attention_mask):
            text = tok.decode(ids[keep.bool()].tolist())
            if text.endswith("<tool_call>"):
                expr = text.removesuffix("<tool_call>").split("\n")[-1].rstrip("=")
                new = tok(CALL.replace("37*45", expr).removeprefix("<tool_call>")).input_ids
            else:
                new = tok(text.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]).input_ids
            out.append(ids.tolist() + new + [tok.eos_token_id] + [tok.pad_token_id] * max_new_tokens)
        width = min(map(len, out))
        return torch.tensor([seq[:width] for seq in out])


def test_forced_call_accuracy_of_a_perfect_caller(tokenizer):
    rows = make_rows(TOOL_TASK)[1][:16]
    assert tool_task.forced_call_accuracy(PerfectCaller(tokenizer), tokenizer, rows) == 1.0
    wrong = [type(r)(r.prompt, r.data_source, str(int(r.ground_truth) + 1)) for r in rows[:4]] + rows[4:]
    assert tool_task.forced_call_accuracy(PerfectCaller(tokenizer), tokenizer, wrong) == 0.75


class ScriptedTurns:
    """The Turns API answering each context with script(context text, turn) + <eos>."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.turn = tokenizer, script, -1

    def generate(self, contexts, budgets, temperature, seeds):
        self.turn += 1
        out = []
        for context, budget in zip(contexts, budgets):
            text = self.tokenizer.decode(context, skip_special_tokens=True)
            ids = self.tokenizer(self.script(text, self.turn)).input_ids + [self.tokenizer.eos_token_id]
            out.append(Turn(ids[:budget], None, len(ids) <= budget))
        return out


def test_loss_mask_is_zero_on_the_calculators_answer(tokenizer):
    """Episodes in the tiny model's format through the agent loop with the preset's settings: the calculator's
    answer joins the response under mask 0, the model's call and final answer (with their <eos>) under mask 1."""
    train = make_rows(TOOL_TASK)[0][:2]
    def script(text, turn):
        expr = text.split("\n")[1].split("=")[0]
        return CALL.replace("37*45", expr) if turn == 0 else text.rsplit("<tool_response>", 1)[1].split("<")[0]

    config = MultiTurnConfig(enabled=True, max_turns=2, tools=[{"builtin": "calculator"}], num_workers=1)
    from rltrain.data.sampler import encode_prompts

    ids, mask = encode_prompts(train, tokenizer, tool_task.calculator_tools())
    loop = AgentLoop(config, ScriptedTurns(tokenizer, script), tokenizer, max_new_tokens=32)
    try:
        batch = loop.generate(ids, mask, 2, 1.0, seed=0)
    finally:
        loop.close()
    for i, row in enumerate(r for r in train for _ in range(2)):
        response, keep = batch["response_ids"][i].tolist(), batch["response_mask"][i].tolist()
        answer = f"<tool_response>{row.ground_truth}</tool_response>"
        call = CALL.replace("37*45", tool_task.expression(row))
        assert tokenizer.decode([t for t, k in zip(response, keep) if k]) == f"{call}<eos>{row.ground_truth}<eos>"
        masked = [t for t, k in zip(response, keep) if not k and t != tokenizer.pad_token_id]
        assert tokenizer.decode(masked) == answer
        assert tokenizer.decode(response, skip_special_tokens=True) == f"{call}{answer}{row.ground_truth}"
    assert episode_metrics(batch)["tool/calls_per_episode"] == 1.0 and not batch["truncated"].any()


def test_preset_composes_and_the_kind_alone_is_refused():
    job = load_job_config(compose("task=tool_arithmetic"))
    assert job.data.task == TOOL_TASK and job.rollout.multi_turn.enabled and job.rollout.multi_turn.max_turns == 2
    assert [s.builtin for s in job.rollout.multi_turn.tool_specs()] == ["calculator"]
    assert job.trainer.output_dir != load_job_config(compose()).trainer.output_dir
    assert load_job_config(compose("task=arithmetic")) == load_job_config(compose())
    with pytest.raises(ConfigError, match="data.task.kind: 'tool_arithmetic' runs as multi-turn episodes with a "
                                          "tool named calculator: select the preset task=tool_arithmetic"):
        load_job_config(compose("data.task.kind=tool_arithmetic"))
    # a calculator of the user's (the benchmark's long-tailed one: its schema's name is calculator) serves too
    tool = f"[{{path: {ROOT / 'benchmarks' / 'latency_tool.py'}, name: LatencyCalculator}}]"
    job = load_job_config(compose("task=tool_arithmetic", f"rollout.multi_turn.tools={tool}"))
    assert job.rollout.multi_turn.tool_names() == ["calculator"]
