"""The built-in `python` tool: runs a model-written program in the sandbox (rltrain/sandbox/) and returns what it
printed.

Each call is a fresh sandbox: its own pid, network (no interface but its own loopback), mount and user
namespaces; a read-only view of the system's programs and libraries and of the interpreter, none of the trainer's
files; /scratch, an empty tmpfs, as the only writable place; no capabilities; `python -I -S` (standard library only);
rlimits on CPU time, address space, processes, file size and open files; a wall-clock limit; output capped. When the
program ends, or is killed, every process it started goes too (its pid namespace ends).

Its limits are the constructor's arguments, the keys of rltrain.sandbox.SandboxConfig, here with smaller defaults
(TOOL_DEFAULTS): `{builtin: python, kwargs: {wall_s: 5, memory_mb: 512}}`. Where no sandbox backend works,
`rollout.multi_turn` validation refuses the tool (the run exits 2), and a call answers with the reason.
"""

from __future__ import annotations

from rltrain.config import from_mapping
from rltrain.sandbox import Sandbox, SandboxConfig

TOOL_DEFAULTS = {"wall_s": 5.0, "cpu_s": 3, "memory_mb": 512}


class PythonTool:
    schema = {"name": "python",
              "description": "Run a Python 3 program (standard library only, no network, no input) and return what "
                             "it prints to stdout and stderr. Print the values you need.",
              "parameters": {"type": "object", "required": ["code"],
                             "properties": {"code": {"type": "string", "description": "the program's source"}}}}

    def __init__(self, **limits):
        self.config = from_mapping(SandboxConfig, {**TOOL_DEFAULTS, **limits}, "kwargs")
        self.sandbox = Sandbox(self.config)

    @property
    def wall_s(self) -> float:
        return self.config.wall_s

    def __call__(self, code: str) -> str:
        result = self.sandbox.run(code)   # SandboxUnavailable / SandboxError: the pool answers with the error
        parts = [result.stdout.rstrip("\n")] if result.stdout else []
        if result.stderr:
            parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
        if result.killed:
            parts.append(f"[killed: {result.killed}]")
        elif result.exit_code:
            parts.append(f"[exit code {result.exit_code}]")
        return "\n".join(parts) if parts else f"[no output; ran {result.elapsed_s:.2f} s]"
