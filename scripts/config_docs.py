"""Write docs/configuration.md, the configuration reference, from the comments of config/grpo.yaml and of the preset
groups it composes (config/algorithm/, config/kernel_config/, config/task/), so the reference cannot drift from the
config: tests/test_docs.py fails when the committed page differs from what this script writes.

    python scripts/config_docs.py            # rewrite docs/configuration.md
    python scripts/config_docs.py --check    # exit 1 if docs/configuration.md is stale

Each key's row is its line in the YAML file: the default as written and the comment beside it (a comment line
aligned with that comment continues it; a comment block above a key at the key's indentation describes that key).
Every leaf the YAML holds must come out as a row: the parse is checked against yaml.safe_load of the same file.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config"
OUTPUT = ROOT / "docs" / "configuration.md"
COMMAND = "python scripts/config_docs.py"
# the page's order: the composed config's sections, the preset groups' beside the ones they act with
SECTIONS = ("trainer", "model", "data", "rollout", "actor", "critic", "algorithm", "reward", "kernel_config", "ray",
            "hydra")

KEY_LINE = re.compile(r"^(?P<indent> *)(?P<dash>- )?(?P<key>[A-Za-z_][\w]*)(?::(?P<rest>.*))?$")


@dataclass
class Entry:
    """One key of a YAML file: its dotted path, its value as written ('' for a section), and its comment."""
    path: str
    value: str
    comment: list[str] = field(default_factory=list)
    comment_column: int | None = None

    @property
    def is_section(self) -> bool:
        return self.value == ""


@dataclass
class ConfigFile:
    header: list[str]
    entries: list[Entry]
    defaults: list[Entry]


def split_comment(text: str) -> tuple[str, str | None, int | None]:
    """'value   # comment' -> ('value', 'comment', offset of '#' in text); no comment -> (value, None, None)."""
    stripped = text.lstrip()
    if stripped.startswith("#"):
        offset = len(text) - len(stripped)
        return "", stripped[1:].strip(), offset
    match = re.search(r"\s#\s?", text)
    if match is None:
        return text.strip(), None, None
    return text[:match.start()].strip(), text[match.end():].strip(), match.start() + text[match.start():].index("#")


def parse(path: Path) -> ConfigFile:
    """A YAML config file line by line: its header comment, its keys with their values and comments, and the
    entries of its defaults list (the preset groups)."""
    header: list[str] = []
    entries: list[Entry] = []
    defaults: list[Entry] = []
    stack: list[tuple[int, str]] = []   # (indent, key) of the enclosing sections
    pending: list[str] = []             # a comment block waiting for the key below it
    last: Entry | None = None
    in_defaults = False
    for raw in path.read_text().splitlines():
        line = raw.rstrip()
        if not line.strip():
            if last is None and pending:    # the file's header ends at its first blank line
                header += pending
                pending = []
            continue
        if line.lstrip().startswith("#"):
            column = len(line) - len(line.lstrip())
            text = line.lstrip()[1:].strip()
            if text.startswith("@package"):
                continue
            if last is not None and last.comment_column == column:
                last.comment.append(text)
            else:
                pending.append(text)
            continue
        match = KEY_LINE.match(line)
        if match is None:
            raise ValueError(f"{path}: cannot parse line {line!r}")
        indent, key = len(match["indent"]), match["key"]
        value, comment, offset = split_comment(match["rest"] or "")
        if last is None and pending and not entries and not defaults:
            header += pending
            pending = []
        if match["dash"]:                   # an entry of the defaults list
            if not in_defaults:
                raise ValueError(f"{path}: a list entry outside defaults: {line!r}")
            if key == "_self_" or not value:   # _self_, or a preset file's own parent (`- grpo`)
                pending = []
                continue
            entry = Entry(key, value, ([comment] if comment else []),
                          None if offset is None else len(line) - len(match["rest"]) + offset)
            defaults.append(entry)
            last = entry
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        in_defaults = indent == 0 and key == "defaults"
        if in_defaults:
            stack.append((indent, key))
            last = None
            continue
        dotted = ".".join([k for _, k in stack] + [key])
        column = None if offset is None else len(line) - len(match["rest"]) + offset
        entry = Entry(dotted, value, pending + ([comment] if comment else []), column)
        pending = []
        entries.append(entry)
        last = entry
        if entry.is_section:
            stack.append((indent, key))
    check_against_yaml(path, entries)
    return ConfigFile(header, entries, defaults)


def leaves(tree, prefix: str = "") -> dict[str, object]:
    """{dotted key: value} of a YAML mapping's leaves."""
    if isinstance(tree, dict) and tree:
        return {k: v for key, value in tree.items() for k, v in leaves(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def check_against_yaml(path: Path, entries: list[Entry]) -> None:
    """The line parse holds every leaf of the YAML, with its value, and a comment for each."""
    tree = yaml.safe_load(path.read_text()) or {}
    tree.pop("defaults", None)
    expected = leaves(tree) if tree else {}
    parsed = {e.path: e for e in entries if not e.is_section}
    if set(parsed) != set(expected):
        raise ValueError(f"{path}: parsed keys differ from the YAML's: missing {sorted(set(expected) - set(parsed))}, "
                         f"extra {sorted(set(parsed) - set(expected))}")
    for key, entry in parsed.items():
        if yaml.safe_load(entry.value) != expected[key]:
            raise ValueError(f"{path}: {key}: parsed the value {entry.value!r}, the YAML holds {expected[key]!r}")
        if not entry.comment:
            raise ValueError(f"{path}: {key} has no comment: every key is documented where it is set")


def cell(text: str) -> str:
    """Comment text as Markdown for a table cell: no HTML (<tool_call> would vanish), no emphasis, no column break.
    Code spans the comment writes (`...`) stay code; only their | is escaped, as tables need."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part.replace("|", "\\|") if part.startswith("`") else
                   part.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")
                   .replace(">", "&gt;") for part in parts)


def code(value: str) -> str:
    return "`" + value.replace("|", "\\|") + "`"


def table(entries: list[Entry], prefix: str = "", value: str = "default") -> list[str]:
    rows = [f"| key | {value} | meaning |", "|---|---|---|"]
    for entry in entries:
        rows.append(f"| {code(prefix + entry.path)} | {code(entry.value)} | {cell(' '.join(entry.comment))} |")
    return rows


def section_block(section: Entry, entries: list[Entry], prefix: str, level: int) -> list[str]:
    name = prefix + section.path
    out = ["#" * level + f" `{name}`", ""]
    if section.comment:
        out += [cell(" ".join(section.comment)), ""]
    depth = section.path.count(".") + 1
    own = [e for e in entries if e.path.startswith(section.path + ".") and e.path.count(".") == depth]
    keys = [e for e in own if not e.is_section]
    if keys:
        out += table(keys, prefix) + [""]
    for sub in (e for e in own if e.is_section):
        out += section_block(sub, entries, prefix, level + 1)
    return out


def preset_block(path: Path, group: str, prefix: str, level: int) -> list[str]:
    config = parse(path)
    out = ["#" * level + f" `{group}={path.stem}`", "", f"[{path.relative_to(ROOT)}](../{path.relative_to(ROOT)})"
           + (": " + cell(" ".join(config.header)) if config.header else ""), ""]
    keys = [e for e in config.entries if not e.is_section]
    if keys:
        out += table(keys, prefix, value="value") + [""]
    return out


def algorithm_block(default: str) -> list[str]:
    base = parse(CONFIG / "algorithm" / "grpo.yaml")
    out = ["## `algorithm`", "",
           f"Set by the preset group `algorithm` (default `{default}`); every key below is "
           "[config/algorithm/grpo.yaml](../config/algorithm/grpo.yaml)'s, which the other presets start from. "
           "The algorithms and their papers: [algorithms.md](algorithms.md).", ""]
    out += table([e for e in base.entries if not e.is_section and "." not in e.path], "algorithm.") + [""]
    for section in (e for e in base.entries if e.is_section and "." not in e.path):
        out += section_block(section, base.entries, "algorithm.", 3)
    out += ["### Algorithm presets", "", "`algorithm=<preset>`: the keys each preset sets on top of `grpo`.", ""]
    for path in sorted((CONFIG / "algorithm").glob("*.yaml")):
        if path.stem != "grpo":
            out += preset_block(path, "algorithm", "algorithm.", 4)
    return out


def kernel_config_block(default: str) -> list[str]:
    path = CONFIG / "kernel_config" / f"{default}.yaml"
    config = parse(path)
    out = ["## `kernel_config`", "",
           f"Set by the preset group `kernel_config` (default `{default}`, "
           f"[{path.relative_to(ROOT)}](../{path.relative_to(ROOT)})): " + cell(" ".join(config.header))
           + " The kernels: [kernels.md](kernels.md).", ""]
    return out + table([e for e in config.entries if not e.is_section], "kernel_config.") + [""]


def render() -> str:
    main = parse(CONFIG / "grpo.yaml")
    groups = {d.path: d for d in main.defaults}
    top = {e.path: e for e in main.entries if e.is_section and "." not in e.path}
    blocks = {name: section_block(entry, main.entries, "", 2) for name, entry in top.items()}
    blocks["algorithm"] = algorithm_block(groups["algorithm"].value)
    blocks["kernel_config"] = kernel_config_block(groups["kernel_config"].value)
    if set(blocks) != set(SECTIONS):
        raise ValueError(f"SECTIONS lists {sorted(SECTIONS)}, the config has {sorted(blocks)}: update SECTIONS")
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the comments of config/grpo.yaml and config/*/; do not edit. -->",
        "",
        f"Generated from the comments of [config/grpo.yaml](../config/grpo.yaml) and its preset groups by "
        f"`{COMMAND}`: edit the YAML files, then rerun it (`tests/test_docs.py` fails while this page is stale).",
        "",
        cell(" ".join(main.header)),
        "",
        "Every key below can be set on the command line as `section.key=value`; a preset group is picked by its "
        "name. Each component checks its own keys before any work starts, and a bad value, or a key that is not "
        "listed here, exits with status 2 naming it ([troubleshooting.md](troubleshooting.md)).",
        "",
        "```bash",
        "python -m rltrain.main_grpo --cfg job                              # print the resolved config",
        "python -m rltrain.main_grpo trainer.total_steps=50 rollout.n=8     # keys",
        "python -m rltrain.main_grpo algorithm=dapo task=tool_arithmetic    # preset groups",
        "```",
        "",
        "Sections: " + " · ".join(f"[`{name}`](#{name})" for name in SECTIONS) + " · [task presets](#task-presets)",
        "",
        "## Preset groups",
        "",
        "| group | default | meaning |",
        "|---|---|---|",
    ]
    for name, entry in groups.items():
        lines.append(f"| {code(name)} | {code(entry.value)} | {cell(' '.join(entry.comment))} |")
    lines.append("")
    for name in SECTIONS:
        lines += blocks[name]
    lines += ["## Task presets", "",
              "`task=<preset>` picks the embedded default's task; a preset may set keys of any section.", ""]
    for path in sorted((CONFIG / "task").glob("*.yaml")):
        lines += preset_block(path, "task", "", 3)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
