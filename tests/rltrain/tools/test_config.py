"""MultiTurnConfig through from_mapping: defaults, and messages that name the full key (scalars, tool entries,
the python tool's wall clock against the pool's timeout)."""

import pytest
from omegaconf import OmegaConf

from rltrain.config import ConfigError, from_mapping
from rltrain.tools import MultiTurnConfig, ToolPool
from tests.helpers import sandbox_unavailable

PREFIX = "rollout.multi_turn"


def _build(**section):  # the job hands from_mapping plain containers (OmegaConf.to_container), as here
    return from_mapping(MultiTurnConfig, OmegaConf.to_container(OmegaConf.create(section)), PREFIX)


@pytest.mark.skipif(sandbox_unavailable() is not None, reason="the python tool is refused where no sandbox works "
                    "(tests/rltrain/sandbox/test_sandbox.py tests that)")
def test_defaults_and_a_valid_section():
    assert not _build().enabled
    config = _build(enabled=True, tools=[{"builtin": "calculator"}, {"builtin": "python", "kwargs": {"wall_s": 2}}])
    specs = config.tool_specs()
    assert [s.builtin for s in specs] == ["calculator", "python"] and specs[1].kwargs == {"wall_s": 2}
    pool = config.build_pool()
    assert isinstance(pool, ToolPool) and list(pool.schemas) == ["calculator", "python"]
    pool.close()


@pytest.mark.parametrize("section, message", [
    ({"max_turns": 0}, "rollout.multi_turn.max_turns: must be >= 1 (got 0)"),
    ({"max_tool_response_tokens": 0}, "rollout.multi_turn.max_tool_response_tokens: must be >= 1"),
    ({"parser": "llama"}, "rollout.multi_turn.parser: unknown tool-call parser; known: hermes (got 'llama')"),
    ({"tool_timeout_s": 0}, "rollout.multi_turn.tool_timeout_s: must be > 0"),
    ({"num_workers": 0}, "rollout.multi_turn.num_workers: must be >= 1"),
    ({"max_output_chars": 0}, "rollout.multi_turn.max_output_chars: must be >= 1"),
    ({"enabled": True}, "rollout.multi_turn.tools: must list at least one tool when enabled"),
    ({"tools": [{"builtin": "shell"}]}, "rollout.multi_turn.tools[0].builtin: unknown built-in tool 'shell'; known: "
                                       "calculator, python"),
    ({"tools": [{"builtin": "calculator"}, {"path": "/no/such/tools.py", "name": "f"}]},
     "rollout.multi_turn.tools[1].path: no such file '/no/such/tools.py'"),
    ({"tools": [{"builtin": "python", "kwargs": {"wall_s": 20}}]},
     "rollout.multi_turn.tool_timeout_s: must exceed the python tool's wall-clock limit (tools[0].kwargs.wall_s = 20)"),
    ({"tools": [{"builtin": "python", "kwargs": {"memory_mb": -1}}]},
     "rollout.multi_turn.tools[0].kwargs: built-in 'python' could not be built"),
    ({"turns": 3}, "rollout.multi_turn.turns: unknown key"),
], ids=["max_turns", "tokens", "parser", "timeout", "workers", "chars", "no-tools", "builtin", "path", "wall",
        "kwargs", "unknown-key"])
def test_errors_name_the_key(section, message):
    with pytest.raises(ConfigError) as err:
        _build(**section)
    assert str(err.value).startswith(message)
