"""The chat-template hand-off: the tools= form and the tool-turn messages render through a Qwen 2.5-style template
(its tools / tool_calls / tool sections, copied in short) with transformers' apply_chat_template."""

import json

from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.tools import ToolResult, assistant_message, chat_template_tools, parse_hermes, tool_message
from rltrain.tools.builtin.calculator import calculator

QWEN_STYLE = (  # transformers renders with trim_blocks: newlines go in {{ '...' }} expressions, as Qwen's do
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for tc in message.tool_calls or [] %}{%- if tc.function is defined %}{%- set tc = tc.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tc.name + '\", \"arguments\": ' }}{{- tc.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}")


def test_tools_and_tool_turn_render_through_a_template():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = QWEN_STYLE
    tools = chat_template_tools([calculator.schema])
    assert tools == [{"type": "function", "function": calculator.schema}]
    generated = 'I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    turn = parse_hermes(generated)
    messages = [{"role": "user", "content": "What is 6*7?"}, assistant_message(turn),
                tool_message(ToolResult("calculator", "42", call_id="call_0"))]
    assert messages[2] == {"role": "tool", "name": "calculator", "content": "42", "tool_call_id": "call_0"}
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert json.dumps(tools[0]) in text
    assert "<|im_start|>assistant\n" + generated + "<|im_end|>" in text  # the call renders back as the model wrote it
    assert "<tool_response>\n42\n</tool_response>" in text


def test_malformed_calls_stay_out_of_tool_calls():
    turn = parse_hermes('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
                        '<tool_call>not json</tool_call>')
    message = assistant_message(turn)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["calculator"]
    assert "tool_calls" not in assistant_message(parse_hermes("plain answer"))
