"""The hermes tool-call parser: well-formed calls, several per turn, and every malformed shape becoming an error
call (never an exception); the registry's unknown-name message."""

import pytest

from rltrain.tools.parsers import PARSERS, parse_hermes


def test_one_call_and_content():
    turn = parse_hermes('Let me add.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n'
                        '</tool_call>')
    assert turn.content == "Let me add."
    assert [(c.name, c.arguments, c.id, c.error) for c in turn.calls] == [
        ("calculator", {"expression": "2+3"}, "call_0", None)]


def test_several_calls_keep_their_order():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>')
    turn = parse_hermes(text)
    assert [(c.name, c.arguments, c.id) for c in turn.calls] == [("a", {"x": 1}, "call_0"),
                                                                 ("b", {"y": [2]}, "call_1")]
    assert turn.content == "and"


def test_text_without_calls():
    turn = parse_hermes("The answer is 42.")
    assert turn.content == "The answer is 42." and turn.calls == [] and not turn.has_calls


@pytest.mark.parametrize("body, message", [
    ('{"name": "a", "arguments": {"x": 1}', "not valid JSON"),
    ("calculator(2+3)", "not valid JSON"),
    ('["a", {}]', "must be a JSON object"),
    ('{"arguments": {"x": 1}}', 'no "name"'),
    ('{"name": "", "arguments": {}}', 'no "name"'),
    ('{"name": "a", "arguments": [1, 2]}', '"arguments" of \'a\' must be a JSON object'),
    ('{"name": "a", "arguments": "not json"}', '"arguments" of \'a\' must be a JSON object'),
], ids=["truncated-json", "python-syntax", "array", "no-name", "empty-name", "list-args", "string-args"])
def test_malformed_calls_become_errors(body, message):
    turn = parse_hermes(f"x <tool_call>{body}</tool_call> y")
    assert len(turn.calls) == 1 and message in turn.calls[0].error
    assert turn.content == "x  y"


def test_unclosed_call_is_an_error_and_good_calls_survive_bad_ones():
    turn = parse_hermes('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>'
                        '<tool_call>{"name": "b", "arguments": {}}')
    assert [c.error is None for c in turn.calls] == [True, False, False]
    assert "not closed" in turn.calls[2].error and turn.calls[2].name == "b"


def test_registry_names_the_known_parsers():
    assert PARSERS.get("hermes") is parse_hermes
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen-xml'; known: hermes"):
        PARSERS.get("qwen-xml")
    with pytest.raises(ValueError, match="already registered"):
        PARSERS.register("hermes")(parse_hermes)
