"""Data rows (verl format) from jsonl and parquet; malformed input names file, row and field; the sampler's order
is deterministic and resumable."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rltrain.data.rows import DataError, load_rows, render_prompt
from rltrain.data.sampler import PromptSampler, encode_prompts
from rltrain.embedded.config import TaskConfig
from rltrain.embedded.task import make_rows
from rltrain.embedded.tokenizer import build_char_tokenizer

GOOD = [
    {"prompt": "1+1=", "data_source": "rltrain/arithmetic", "reward_model": {"ground_truth": "2"}},
    {"prompt": [{"role": "user", "content": "2+2="}], "data_source": "openai/gsm8k", "ground_truth": "4",
     "extra_info": {"split": "train"}},
]


def _jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_jsonl_and_parquet_load_the_same_rows(tmp_path):
    from_jsonl = load_rows(_jsonl(tmp_path / "a.jsonl", GOOD))
    table = pa.Table.from_pylist([{"prompt": "1+1=", "data_source": "rltrain/arithmetic",
                                   "reward_model": {"ground_truth": "2"}}])
    pq.write_table(table, tmp_path / "b.parquet")
    from_parquet = load_rows([str(tmp_path / "b.parquet")])
    assert from_parquet[0] == from_jsonl[0]
    assert from_jsonl[1].ground_truth == "4" and from_jsonl[1].extra_info == {"split": "train"}
    tokenizer = build_char_tokenizer()
    assert render_prompt(from_jsonl[1].prompt, tokenizer) == "2+2="


@pytest.mark.parametrize("record, message", [
    ({"data_source": "x", "ground_truth": "1"}, "row 2: field 'prompt' must be a string or a list"),
    ({"prompt": "", "ground_truth": "1"}, "row 2: field 'prompt' is empty"),
    ({"prompt": [{"role": "user"}], "ground_truth": "1"}, r"row 2: field 'prompt\[0\]' must be a message"),
    ({"prompt": "q", "data_source": 3, "ground_truth": "1"}, "row 2: field 'data_source' must be a string"),
    ({"prompt": "q"}, r"row 2: field 'reward_model.ground_truth' \(or 'ground_truth'\) is missing"),
    ({"prompt": "q", "reward_model": {"ground_truth": None}}, "row 2: field 'reward_model.ground_truth' is null"),
    ({"prompt": "q", "ground_truth": "1", "extra_info": [1]}, "row 2: field 'extra_info' must be a dict"),
])
def test_malformed_rows_name_file_row_and_field(tmp_path, record, message):
    path = _jsonl(tmp_path / "bad.jsonl", [GOOD[0], record])
    with pytest.raises(DataError, match=f"bad.jsonl: {message}"):
        load_rows(path)


@pytest.mark.parametrize("record, message", [
    ({"prompt": None, "ground_truth": "1"}, "row 2: field 'prompt' must be a string or a list"),
    ({"prompt": "q", "ground_truth": None}, "row 2: field 'ground_truth' is null"),
    ({"prompt": [{"role": "user", "content": None}], "ground_truth": "1"},
     r"row 2: field 'prompt\[0\]' must be a message"),
], ids=["prompt-null", "ground_truth-null", "message-content-null"])
def test_malformed_parquet_rows_name_file_row_and_field(tmp_path, record, message):
    first = {"prompt": [{"role": "user", "content": "1+1="}] if isinstance(record["prompt"], list) else "1+1=",
             "ground_truth": "2"}
    pq.write_table(pa.Table.from_pylist([first, record]), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=f"bad.parquet: {message}"):
        load_rows(str(tmp_path / "bad.parquet"))


def test_bad_files(tmp_path):
    with pytest.raises(DataError, match="no such data file"):
        load_rows(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_rows(str(tmp_path / "x.csv"))
    (tmp_path / "broken.jsonl").write_text(json.dumps(GOOD[0]) + "\n{not json\n")
    with pytest.raises(DataError, match="broken.jsonl: row 2: invalid JSON"):
        load_rows(str(tmp_path / "broken.jsonl"))
    latin1 = '{"prompt": "caf\u00e9"}\n'.encode("latin-1")   # é as one byte, 0xe9, the 16th
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps(GOOD[0]).encode() + b"\n" + latin1)
    with pytest.raises(DataError, match=r"latin1.jsonl: row 2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        load_rows(str(tmp_path / "latin1.jsonl"))
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(DataError, match="folder.jsonl: a directory, not a data file"):
        load_rows(str(tmp_path / "folder.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no rows"):
        load_rows(str(tmp_path / "empty.jsonl"))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet file"):
        load_rows(str(tmp_path / "junk.parquet"))


def test_sampler_is_deterministic_and_resumable():
    rows, _ = make_rows(TaskConfig(max_operand=9, num_val=10))
    a = PromptSampler(rows, seed=3)
    first = [a.next(7) for _ in range(20)]  # crosses epoch boundaries (90 rows)
    b = PromptSampler(rows, seed=3)
    for _ in range(11):
        b.next(7)
    c = PromptSampler(rows, seed=3)
    c.load_state_dict(b.state_dict())
    assert [c.next(7) for _ in range(9)] == first[11:]
    assert PromptSampler(rows, seed=4).next(7) != first[0]


def test_task_split_is_disjoint_and_prompts_left_padded():
    train, val = make_rows(TaskConfig(max_operand=9, num_val=10))
    assert len(train) == 90 and len(val) == 10
    assert not {r.prompt for r in train} & {r.prompt for r in val}
    tokenizer = build_char_tokenizer()
    ids, mask = encode_prompts([train[0], val[0]], tokenizer)
    assert mask[:, -1].all() and tokenizer.decode(ids[0][mask[0].bool()]) == train[0].prompt


def test_long_prompts_are_measured_with_the_tools_they_carry():
    """Multi-turn chat prompts render the tools' schemas into the prompt (render_prompt's tools): drop_long_prompts
    counts them, so a prompt that fits alone but not with its tools is dropped, as the rollout would receive it."""
    from rltrain.data.rows import PromptRow
    from rltrain.data.sampler import drop_long_prompts
    from rltrain.tools import chat_template_tools
    from rltrain.tools.builtin.calculator import calculator
    from tests.rltrain.tools.test_chat import QWEN_STYLE

    tokenizer = build_char_tokenizer(extra_chars='<>{}"_|#')
    tokenizer.chat_template = QWEN_STYLE
    tools = chat_template_tools([calculator.schema])
    rows = [PromptRow([{"role": "user", "content": "1+2="}], "arith", "3")]
    alone = len(tokenizer(render_prompt(rows[0].prompt, tokenizer)).input_ids)
    with_tools = len(tokenizer(render_prompt(rows[0].prompt, tokenizer, tools)).input_ids)
    assert with_tools > alone
    assert drop_long_prompts(rows, tokenizer, alone, "data.train_files") == rows
    with pytest.raises(DataError, match="every row is longer than data.max_prompt_length"):
        drop_long_prompts(rows, tokenizer, alone, "data.train_files", tools)
    assert drop_long_prompts(rows, tokenizer, with_tools, "data.train_files", tools) == rows
