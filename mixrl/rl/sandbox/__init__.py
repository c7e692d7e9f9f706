"""Sandboxes: model-generated code never runs outside one (docs/sandbox.md).

The local backend is bubblewrap: a fresh set of namespaces per command, a private tmpfs as the only
writable place, no network, rlimits, a wall clock and output caps.
"""

from mixrl.rl.sandbox.command import SandboxConfig
from mixrl.rl.sandbox.limits import Limits
from mixrl.rl.sandbox.runner import FINISH_REASONS, FinishReason, Sandbox, SandboxResult, SandboxUnavailable

__all__ = [
    "FINISH_REASONS",
    "FinishReason",
    "Limits",
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
]
