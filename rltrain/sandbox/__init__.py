"""Running model-written programs under OS isolation (`reward.sandbox`): the built-in `code` reward and the `python`
tool run programs here. See rltrain/sandbox/backends.py for what a program can and cannot reach, run.py for a run's
life (probe, limits, kill), launcher.py for the process that builds the sandbox."""

from rltrain.sandbox.config import BACKENDS, SandboxConfig
from rltrain.sandbox.run import Sandbox, SandboxError, SandboxResult, SandboxUnavailable, probe

__all__ = ["BACKENDS", "Sandbox", "SandboxConfig", "SandboxError", "SandboxResult", "SandboxUnavailable", "probe"]
