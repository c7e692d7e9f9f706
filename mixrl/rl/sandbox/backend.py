"""Which sandbox this process runs commands in: the local bubblewrap one, or sandbox pods.

Environments ask :func:`make_sandbox` for theirs instead of building a :class:`Sandbox`, so that the
rollout worker decides where model-generated code runs (``spec.rollout.sandbox``: pods in a cluster,
docs/sandbox.md#sandbox-pods-in-a-cluster) without the environment knowing.  A process-wide choice:
the worker makes it once, before it loads the environment.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from mixrl.rl.sandbox.command import SandboxConfig
from mixrl.rl.sandbox.limits import Limits
from mixrl.rl.sandbox.runner import Sandbox, SandboxResult


class CommandSandbox(Protocol):
    """What an environment needs of a sandbox (both backends have it)."""

    async def run(
        self, command: str, files: Mapping[str, str | bytes] | None = None, limits: Limits | None = None
    ) -> SandboxResult: ...

    def check(self) -> None: ...


SandboxFactory = Callable[[SandboxConfig], CommandSandbox]
_factory: SandboxFactory | None = None


def use_sandbox(factory: SandboxFactory | None) -> SandboxFactory | None:
    """Run this process's sandboxed commands where ``factory`` says (None: the local backend);
    returns the factory it replaces."""
    global _factory
    previous, _factory = _factory, factory
    return previous


def make_sandbox(config: SandboxConfig) -> CommandSandbox:
    """The sandbox an environment should use: the process's backend, else local bubblewrap."""
    return _factory(config) if _factory is not None else Sandbox(config)


class NoCommands:
    """The backend of a process that builds an environment only for its vocabulary and tasks and
    runs no episode (a trainer pod's ``model-init``): there is nothing to check, and a command is a
    bug. A pod like that has no bubblewrap sandbox to build (no user namespaces for uid 1000), and
    needs none."""

    def __init__(self, where: str) -> None:
        self.where = where

    def check(self) -> None:
        return None

    async def run(
        self, command: str, files: Mapping[str, str | bytes] | None = None, limits: Limits | None = None
    ) -> SandboxResult:
        raise RuntimeError(f"{self.where} runs no sandboxed command (asked to run {command!r})")
