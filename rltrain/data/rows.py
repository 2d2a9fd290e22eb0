"""Prompt rows in verl's format, loaded from parquet or jsonl, validated with errors that name file, row and field.

A row holds:
- `prompt`: a string, or chat messages `[{"role": ..., "content": ...}, ...]` (rendered with the tokenizer's chat
  template by `render_prompt`);
- `data_source`: a string naming the task (selects a built-in scorer, and is passed to reward functions);
- the ground truth: `reward_model.ground_truth` (verl) or a top-level `ground_truth`;
- `extra_info`: an optional dict passed through to reward functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq


@dataclass
class PromptRow:
    prompt: str | list[dict]
    data_source: str
    ground_truth: object
    extra_info: dict | None = None


class DataError(ValueError):
    """A data file or row is malformed; the message names the file, the row (1-based) and the field."""


def _read_records(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:
            raise DataError(f"{path}: not a readable parquet file: {exc}") from None
    if suffix in (".jsonl", ".json"):
        records = []
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(f"{path}: row {lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                                    f"{exc.start + 1})") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}: row {lineno}: invalid JSON: {exc.msg}") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}: row {lineno}: expected a JSON object, got {type(record).__name__}")
                records.append(record)
        return records
    raise DataError(f"{path}: unsupported file type {suffix!r}; use .parquet or .jsonl")


def parse_row(record: dict, where: str) -> PromptRow:
    """Validate one record; `where` ("file: row N") prefixes every error."""
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: field 'prompt' is empty")
    elif isinstance(prompt, list):
        if not prompt:
            raise DataError(f"{where}: field 'prompt' is an empty message list")
        for i, message in enumerate(prompt):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise DataError(f"{where}: field 'prompt[{i}]' must be a message with string 'role' and 'content'")
    else:
        raise DataError(f"{where}: field 'prompt' must be a string or a list of chat messages, "
                        f"got {type(prompt).__name__}")
    data_source = record.get("data_source", "unknown")
    if not isinstance(data_source, str):
        raise DataError(f"{where}: field 'data_source' must be a string, got {type(data_source).__name__}")
    reward_model = record.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        field, ground_truth = "reward_model.ground_truth", reward_model["ground_truth"]
    elif "ground_truth" in record:
        field, ground_truth = "ground_truth", record["ground_truth"]
    else:
        raise DataError(f"{where}: field 'reward_model.ground_truth' (or 'ground_truth') is missing")
    if ground_truth is None:  # parquet fills a column's gaps with null
        raise DataError(f"{where}: field '{field}' is null")
    extra_info = record.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        raise DataError(f"{where}: field 'extra_info' must be a dict, got {type(extra_info).__name__}")
    return PromptRow(prompt, data_source, ground_truth, extra_info)


def load_rows(files: str | list[str]) -> list[PromptRow]:
    """All rows of one file or several, in order. Raises DataError naming file, row and field."""
    paths = [files] if isinstance(files, str) else list(files)
    if not paths:
        raise DataError("no data files given")
    rows = []
    for name in paths:
        path = Path(name).expanduser()
        if path.is_dir():
            raise DataError(f"{path}: a directory, not a data file: name its .parquet or .jsonl files")
        if not path.is_file():
            raise DataError(f"{path}: no such data file")
        records = _read_records(path)
        if not records:
            raise DataError(f"{path}: holds no rows")
        rows.extend(parse_row(record, f"{path}: row {i}") for i, record in enumerate(records, 1))
    return rows


def render_prompt(prompt: str | list[dict], tokenizer, tools: list[dict] | None = None) -> str:
    """A row's prompt as text: strings as they are, messages through the tokenizer's chat template (with `tools`,
    the multi-turn rollout's tool schemas, for templates that show them)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)


def prompt_ids(prompt: str | list[dict], tokenizer, tools: list[dict] | None = None) -> list[int]:
    """A row's prompt as the rollout gets it, in token ids. A chat template writes its own special tokens (Llama 3's
    `{{ bos_token }}`), so rendered messages are tokenized without the tokenizer's (whose post-processor would put
    a second <|begin_of_text|> in front); plain text gets them as the tokenizer adds them."""
    return tokenizer(render_prompt(prompt, tokenizer, tools), add_special_tokens=isinstance(prompt, str)).input_ids
