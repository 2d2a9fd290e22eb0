"""The manual stays true to the code: README.md and docs/ (docs/README.md lists the pages).

- Every shell command in README.md and docs/*.md (fenced bash/sh blocks, and inline code that starts with python,
  bash or pip) that runs the job — `python -m rltrain.main_grpo ...` or `bash scripts/quickstart.sh ...`, which
  passes its arguments on — has its Hydra overrides composed against config/ and validated by load_job_config, as the
  entry point does. A command must validate as on one of the machines the docs are written for: a CPU machine, or a
  node of 8 GPUs; vllm and flash-attn count as installed (they are, where those commands are meant to run), and a
  model directory the command names by absolute path, which this machine lacks, is stood in by an empty one.
- Every script, file, directory and `python -m` module such a command names exists.
- Every relative link in README.md, docs/, benchmarks/, kernels/, examples/ and docker/ Markdown reaches a file, and
  every #anchor a heading of its page (GitHub's slugs).
- docs/configuration.md is what scripts/config_docs.py writes from config/ (it cannot go stale).
- README.md stays a summary (≤ 150 lines) whose Quick start is the two commands, the second being CI's.

    .venv/bin/python -m pytest tests/test_docs.py -q        # about 12 s on 2 cores
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from rltrain.job import load_job_config

ROOT = Path(__file__).resolve().parents[1]
COMMAND_DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LINK_DOCS = sorted({ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.md"),
                    *(ROOT / "kernels").glob("**/*.md"), *(ROOT / "examples").glob("**/*.md"),
                    *(ROOT / "docker").glob("*.md")})
SHELL_FENCES = {"bash", "sh", "shell", "console"}
REPO_DIRS = ("benchmarks", "config", "docker", "docs", "examples", "kernels", "rltrain", "scripts", "tests")
# Hydra's flags that take a value (--config-name and kin are passed on as overrides, which Hydra rejects: the docs
# compose config/grpo.yaml only)
HYDRA_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--info", "-i"}
HYDRA_CONFIG_FLAGS = {"--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd"}
MODEL_DIR_KEYS = ("model.path", "algorithm.distill.teacher_path", "reward.model.path", "reward.judge.path",
                  "critic.model.path")
MACHINES = {"a CPU machine": (False, 0), "a node of 8 GPUs": (True, 8)}


def shown(path: Path) -> str:
    """A path as messages show it: relative to the repository (or as is, outside it)."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@dataclass(frozen=True)
class Command:
    doc: Path
    line: int
    argv: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{shown(self.doc)}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


# --- reading Markdown ---------------------------------------------------------------------------------------------

def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(info string, line number of the first content line, content) of each fenced code block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if match is None:
            i += 1
            continue
        fence, info, start = match.group(1), match.group(2).lower(), i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        blocks.append((info, start + 1, "\n".join(lines[start:i])))
        i += 1
    return blocks


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = re.match(r"^\s*(`{3,}|~{3,})", line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            out.append((number, line))
    return out


INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    kept = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LMN"
                   or unicodedata.category(c) == "Pc")   # letters, marks, numbers, connectors (_)
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = path.read_text()
    for _, line in prose_lines(text):
        match = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
    return out


def prose_paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each run of non-blank lines outside fenced code blocks: inline code and links
    may wrap across lines."""
    paragraphs, current, first, last = [], [], 0, -1
    for number, line in prose_lines(text):
        if line.strip() and current and number == last + 1:
            current.append(line)
        else:
            if current:
                paragraphs.append((first, "\n".join(current)))
            current, first = ([line], number) if line.strip() else ([], number)
        last = number
    if current:
        paragraphs.append((first, "\n".join(current)))
    return paragraphs


def inline_code(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each inline code span outside fenced blocks."""
    return [(first + paragraph[:m.start()].count("\n"), " ".join(m.group(2).split()))
            for first, paragraph in prose_paragraphs(text) for m in INLINE_CODE.finditer(paragraph)]


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of the inline links, images and reference definitions outside code."""
    out = []
    for first, paragraph in prose_paragraphs(path.read_text()):
        paragraph = INLINE_CODE.sub(lambda m: "\n" * m.group(0).count("\n"), paragraph)
        for pattern in (r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", r"(?m)^\s*\[[^\]]+\]:\s*<?([^\s>]+)"):
            out += [(first + paragraph[:m.start()].count("\n"), m.group(1)) for m in re.finditer(pattern, paragraph)]
    return out


def link_errors(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the links of `path`, a page of the repository at `root`."""
    errors = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not resolved.is_relative_to(root):
            errors.append(f"{where}: leaves the repository")
        elif not resolved.exists():
            errors.append(f"{where}: no such file or directory")
        elif anchor:
            if resolved.suffix != ".md":
                errors.append(f"{where}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(resolved):
                errors.append(f"{where}: no heading with that anchor in {resolved.relative_to(root)}")
    return errors


# --- reading commands ---------------------------------------------------------------------------------------------

def is_python(token: str) -> bool:
    return re.fullmatch(r"(.*/)?python3?(\.\d+)?", token) is not None


def split_commands(doc: Path, line: int, text: str) -> list[Command]:
    """The simple commands of one shell line: comments dropped, split at && || ; |, leading VAR=value dropped."""
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as err:
        raise AssertionError(f"{shown(doc)}:{line}: not a shell line ({err}): {text}") from None
    commands, current = [], []
    for token in tokens + [";"]:
        if token in ("&&", "||", ";", "|"):
            while current and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", current[0]):
                current.pop(0)
            if current:
                commands.append(Command(doc, line, tuple(current)))
            current = []
        else:
            current.append(token)
    return commands


def doc_commands(doc: Path) -> list[Command]:
    """The shell commands of a page: its fenced shell blocks' lines (continuations joined), and inline code that runs
    python, bash or pip."""
    text = doc.read_text()
    commands = []
    for info, first, block in fenced_blocks(text):
        if info not in SHELL_FENCES:
            continue
        pending, start = "", first
        for number, line in enumerate(block.split("\n"), first):
            if not pending:
                start = number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            if (pending + line).strip():
                commands += split_commands(doc, start, pending + line)
            pending = ""
    for number, code in inline_code(text):
        words = code.split()
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words.pop(0)
        if words and (is_python(words[0]) or words[0] in ("bash", "pip")):
            commands += split_commands(doc, number, code)
    return commands


def job_overrides(command: Command) -> list[str] | None:
    """The Hydra overrides of a command that runs the job, or None for another command. A word that is neither an
    override nor one of Hydra's flags is kept, for Hydra to reject by name."""
    argv = list(command.argv)
    if len(argv) >= 3 and is_python(argv[0]) and argv[1] == "-m" and argv[2] == "rltrain.main_grpo":
        rest = argv[3:]
    elif "rltrain.main_grpo" in argv and argv[argv.index("rltrain.main_grpo") - 1] == "-m":  # another launcher
        rest = argv[argv.index("rltrain.main_grpo") + 1:]
    elif len(argv) >= 2 and argv[0] == "bash" and argv[1] == "scripts/quickstart.sh":
        rest = argv[2:]
    else:
        return None
    overrides, skip = [], False
    for token in rest:
        if skip:
            skip = False
        elif token.startswith("-") and token not in HYDRA_CONFIG_FLAGS:
            skip = token in HYDRA_VALUE_FLAGS
        else:
            overrides.append(token)
    return overrides


def named_paths(command: Command) -> list[str]:
    """Repository paths a command names: the script of bash / python, and any argument (or override value) under
    one of the repository's top-level folders or starting with ./"""
    argv = list(command.argv)
    paths = []
    if argv[0] in ("bash", "sh") and len(argv) > 1:
        paths.append(argv[1])
    if is_python(argv[0]) and len(argv) > 1 and argv[1].endswith(".py"):
        paths.append(argv[1])
    for token in argv[1:]:
        for value in (token, token.split("=", 1)[-1]):
            value = value.split("::")[0]
            if value.startswith("./") or value.split("/")[0] in REPO_DIRS and "/" in value:
                paths.append(value)
    return sorted(set(paths))


def module_exists(name: str) -> bool:
    parts = name.split(".")
    bases = [ROOT, ROOT / "kernels"]
    for base in bases:
        path = base.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__main__.py").is_file():
            return True
    if (ROOT / parts[0]).is_dir() or (ROOT / "kernels" / parts[0]).is_dir():
        return False   # one of ours, and not there
    return importlib.util.find_spec(parts[0]) is not None


def command_errors(command: Command) -> list[str]:
    errors = [f"{command}: {path} does not exist" for path in named_paths(command)
              if not (ROOT / path).exists()]
    argv = list(command.argv)
    for i, token in enumerate(argv[:-1]):
        if is_python(token) and argv[i + 1] == "-m" and i + 2 < len(argv) and not module_exists(argv[i + 2]):
            errors.append(f"{command}: no module {argv[i + 2]}")
    return errors


def code_path_errors(doc: Path, root: Path = ROOT) -> list[str]:
    """Inline code that is a repository path (`rltrain/workers/packing.py`, `config/task/`; the kernel package's own
    paths, `rltrain_kernels/...`, under kernels/) must name something that exists."""
    errors = []
    for number, code in inline_code(doc.read_text()):
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", code) or "/" not in code:
            continue
        top = code.split("/")[0]
        path = root / "kernels" / code if top == "rltrain_kernels" else root / code
        if (top in REPO_DIRS or top == "rltrain_kernels") and not path.exists():
            errors.append(f"{shown(doc)}:{number}: `{code}` does not exist")
    return errors


ALL_COMMANDS = [command for doc in COMMAND_DOCS for command in doc_commands(doc)]
JOB_COMMANDS = [command for command in ALL_COMMANDS if job_overrides(command) is not None]


# --- validating a job's overrides ---------------------------------------------------------------------------------

def stand_in_model_dirs(overrides: list[str], tmp_path: Path) -> list[str]:
    """An absolute model directory this machine lacks becomes an empty one (a config.json of {}): the docs name the
    user's models; the config checks that a directory holds a model."""
    stub = tmp_path / "model"
    stub.mkdir(exist_ok=True)
    (stub / "config.json").write_text(json.dumps({}))
    out = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key in MODEL_DIR_KEYS and value.startswith("/") and not Path(value).exists():
            override = f"{key}={stub}"
        out.append(override)
    return out


def validate_on(machine: str, overrides: list[str], monkeypatch) -> str | None:
    """None if the overrides compose and validate as on `machine`, else the error."""
    cuda, gpus = MACHINES[machine]
    with monkeypatch.context() as patch:
        find_spec = importlib.util.find_spec
        patch.setattr(importlib.util, "find_spec",
                      lambda name, *a: object() if name in ("vllm", "flash_attn") else find_spec(name, *a))
        patch.setattr(torch.cuda, "is_available", lambda: cuda)
        patch.setattr(torch.cuda, "device_count", lambda: gpus)
        patch.setattr(os, "cpu_count", lambda: 64)
        try:
            with initialize_config_dir(config_dir=str(ROOT / "config"), version_base="1.3"):
                load_job_config(compose(config_name="grpo", overrides=overrides))
        except Exception as err:  # a ConfigError, or Hydra's own (an unknown key, a malformed override)
            return f"{type(err).__name__}: {err}"
    return None


def job_config_errors(command: Command, tmp_path: Path, monkeypatch) -> list[str]:
    overrides = stand_in_model_dirs(job_overrides(command), tmp_path)
    failures = {}
    for machine in MACHINES:
        failures[machine] = validate_on(machine, overrides, monkeypatch)
        if failures[machine] is None:
            return []
    return [f"{command}\n" + "\n".join(f"  on {machine}: {error}" for machine, error in failures.items())]


# --- the tests ----------------------------------------------------------------------------------------------------

def test_the_docs_hold_the_commands_they_should():
    """The parsers find the commands (a test over nothing would pass on anything)."""
    pages = {command.doc.name for command in JOB_COMMANDS}
    assert len(JOB_COMMANDS) >= 40 and len(pages) >= 12, pages
    assert {path.name for path in (ROOT / "docs").glob("*.md")} - pages <= {"README.md"}, "a page without a job"


@pytest.mark.parametrize("command", JOB_COMMANDS, ids=lambda c: c.where)
def test_job_commands_compose_and_validate(command, tmp_path, monkeypatch):
    errors = job_config_errors(command, tmp_path, monkeypatch)
    assert not errors, "\n".join(errors)


def test_named_scripts_files_and_modules_exist():
    errors = [error for command in ALL_COMMANDS for error in command_errors(command)]
    errors += [error for doc in COMMAND_DOCS for error in code_path_errors(doc)]
    assert not errors, "\n".join(errors)


def test_links_and_anchors_resolve():
    assert len(LINK_DOCS) >= 20
    errors = [error for path in LINK_DOCS for error in link_errors(path)]
    assert not errors, "\n".join(errors)


def load_config_docs(monkeypatch):
    """scripts/config_docs.py as a module."""
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "scripts" / "config_docs.py")
    config_docs = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "config_docs", config_docs)   # its dataclasses look their module up
    spec.loader.exec_module(config_docs)
    return config_docs


def test_configuration_reference_is_generated_from_the_config(monkeypatch):
    config_docs = load_config_docs(monkeypatch)
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == config_docs.render(), (
        "docs/configuration.md is stale (config/ changed): regenerate it with `python scripts/config_docs.py`")


def test_readme_is_a_summary_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, "README.md grew past 150 lines: move the detail into docs/"
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = [block for info, _, block in fenced_blocks(quick_start) if info in SHELL_FENCES]
    commands = [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()]
    assert [c for c in commands if c] == [["bash", "scripts/quickstart.sh"], ["bash", "scripts/test.sh"]]
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(), "CI no longer runs the README's test command"
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme or page.name == "README.md", f"README.md does not link {page.name}"


# --- the checks catch what they are for -----------------------------------------------------------------------------

def test_the_checks_catch_broken_docs(tmp_path, monkeypatch):
    """A planted page in a small repository of its own: every kind of mistake is reported, and only those."""
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "README.md").write_text("# Project\n\n## Status\n")
    (root / "docs" / "quickstart.md").write_text("# Quick start\n")
    (root / "rltrain").mkdir()
    (root / "rltrain" / "job.py").write_text("")
    page = root / "docs" / "page.md"
    page.write_text("# Title\n\n## A section — with `code`\n\n[ok](#a-section--with-code) [ok](../README.md#status)\n"
                    "[gone](missing.md) [bad anchor](#nope) [bad anchor elsewhere](quickstart.md#nope)\n\n"
                    "```bash\npython -m rltrain.main_grpo rollout.n=0\npython -m rltrain.main_grpo no_such.key=1\n"
                    "python -m rltrain.main_grpo algorithm=dapo \\\n    rollout.n=8   # fine\n"
                    "bash scripts/no_such_script.sh\npython -m rltrain.no_such_module\n```\n"
                    "Inline: `python examples/no_such_example.py`, `rltrain/no_such_file.py`, `rltrain/job.py`.\n")
    errors, commands, code_paths = link_errors(page, root), doc_commands(page), code_path_errors(page, root)
    assert len(code_paths) == 1 and "`rltrain/no_such_file.py`" in code_paths[0], code_paths
    assert [e.split(": ", 2)[1] for e in errors] == ["missing.md", "#nope", "quickstart.md#nope"], errors
    jobs = [c for c in commands if job_overrides(c) is not None]
    assert [list(job_overrides(c)) for c in jobs] == [["rollout.n=0"], ["no_such.key=1"],
                                                      ["algorithm=dapo", "rollout.n=8"]]
    results = [job_config_errors(c, tmp_path, monkeypatch) for c in jobs]
    assert "rollout.n: must be >= 1" in results[0][0] and "no_such" in results[1][0] and results[2] == []
    missing = [e for c in commands for e in command_errors(c)]
    assert len(missing) == 3 and all(("no_such" in e) for e in missing), missing


def test_the_generator_reads_every_key_and_wants_a_comment_for_each(tmp_path, monkeypatch):
    config_docs = load_config_docs(monkeypatch)
    good = tmp_path / "good.yaml"
    good.write_text("# A header.\n\nsection:         # a section\n  key: 1         # the key,\n"
                    "                 # continued\n  other: [a, b]  # a list\n")
    entries = {e.path: e for e in config_docs.parse(good).entries}
    assert entries["section.key"].value == "1" and entries["section.key"].comment == ["the key,", "continued"]
    assert entries["section.other"].value == "[a, b]" and config_docs.parse(good).header == ["A header."]
    bad = tmp_path / "bad.yaml"
    bad.write_text("section:\n  key: 1   # documented\n  undocumented: 2\n")
    with pytest.raises(ValueError, match="section.undocumented has no comment"):
        config_docs.parse(bad)
    assert "| `section.key` | `1` | the key, continued |" in config_docs.table(config_docs.parse(good).entries[1:2])


def test_slugs_follow_github():
    assert slug("Two GPUs (issue 31) — 2026-11-26, 2 × H200, torch 2.11.0+cu130") == \
        "two-gpus-issue-31--2026-11-26-2--h200-torch-2110cu130"
    assert slug("`kernel_config`") == "kernel_config" and slug("`rollout.multi_turn`") == "rolloutmulti_turn"
    assert slug("On a GPU machine without [internet](x.md) access") == "on-a-gpu-machine-without-internet-access"
