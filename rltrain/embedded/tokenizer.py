"""A character-level tokenizer built in code (no hub): digits, operators, a few letters, <pad>/<eos>/<unk>.

It is a transformers `PreTrainedTokenizerFast`, so it saves and loads like any hub tokenizer, and its chat
template concatenates message contents (chat-format prompts render to the same text as plain ones).

With `tools=True` (the embedded tool task, data.task.kind=tool_arithmetic) it also holds the pieces of the Hermes
tool-call format as single tokens, the way a BPE vocabulary holds them: the tags `<tool_call>`, `</tool_call>`,
`<tool_response>`, `</tool_response>`, the words of the calculator's call and the JSON punctuation between them, so
the call `<tool_call>{"name":"calculator","arguments":{"expression":"37*45"}}</tool_call>` is 17 tokens rather than
79 characters. They are ordinary vocabulary entries, not special tokens: decoding with skip_special_tokens keeps
them, so the tool-call parser reads them. Its chat template renders the tools handed to it as one line,
`tools: calculator(expression)`, then the messages: user and assistant contents as they are (an assistant's calls
as compact Hermes calls), tool answers as `<tool_response>{content}</tool_response>`, with no role headers, so a
tool turn joins the context as exactly those tokens and the model answers right after it.

With `code=True` (the embedded code task, data.task.kind=code_arithmetic) it also holds CODE_CHARS, the characters of
math notation the default vocabulary lacks (`^`, as in `3x^2`), after the default ones.
"""

from __future__ import annotations

import re

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHARS = list("0123456789+-*=() ,.?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:\n")
SPECIAL = ["<pad>", "<eos>", "<unk>"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# multi-character tokens of the tool vocabulary: the tags, the calculator call's words and its JSON punctuation
TOOL_TOKENS = TOOL_TAGS + ["name", "arguments", "calculator", "expression", '{"', '":"', '","', '":{"', '"}}']
TOOL_CHARS = list('{}"')
CODE_CHARS = list("^")   # the code task's formulas write powers as x^2 (Python's ** needs no new character)
# A tool's schema is shown as name(arguments), not its description: a tiny char-level model cannot read prose, and
# the calculator's 150-character description would triple every prompt's length.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{{- 'tools: ' }}{%- for tool in tools %}{%- set f = tool.function or tool %}"
    "{{- f.name + '(' + (f.parameters.properties or {}) | list | join(',') + ')' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- '\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{- '<tool_response>' + m.content + '</tool_response>' }}"
    "{%- else %}{{- m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}{%- set c = call.function or call %}"
    "{{- '<tool_call>{\"name\":' + c.name | tojson + ',\"arguments\":' }}"
    "{%- for key, value in (c.arguments or {}).items() %}{{- ('{' if loop.first else ',') + key | tojson + ':' }}"
    "{{- value | tojson }}{%- else %}{{- '{' }}{%- endfor %}{{- '}}</tool_call>' }}{%- endfor %}"
    "{%- endif %}{%- endfor %}")


def build_char_tokenizer(extra_chars: str = "", tools: bool = False, code: bool = False):
    """`extra_chars`: characters added after the default ones (tests of tool calls need `<>{}"_/`). `tools`: add the
    tool-call tokens and the tool chat template (module docstring); `code`: add CODE_CHARS. The ids of the default
    vocabulary stay as they are, the new tokens follow them."""
    words = TOOL_TOKENS if tools else []
    tokens = SPECIAL + CHARS + words + [c for c in TOOL_CHARS if tools and c not in CHARS]
    tokens += [c for c in CODE_CHARS if code and c not in tokens]
    tokens += [c for c in dict.fromkeys(extra_chars) if c not in tokens]
    vocab = {token: i for i, token in enumerate(tokens)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # longest pieces first, so `":{"` is one token rather than `":"` + `{`; any other character stands alone
    pieces = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(f"{pieces}|[\\s\\S]" if pieces else r"[\s\S]"),
                                              behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", padding_side="left")
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE
    return tokenizer
