"""``tiny:<kind>`` model paths: the tiny models mixrl builds from a config (mixrl.rl.tiny_models).

A leaf module: the models and their rules (mixrl.api.rules) both read it.
"""

from __future__ import annotations

TINY_PREFIX = "tiny:"
TINY_KINDS = ("qwen3", "qwen3_moe")


def tiny_kind(path: str) -> str | None:
    """The kind of a ``tiny:<kind>`` model path (``qwen3``), None for a directory."""
    return path.removeprefix(TINY_PREFIX) if path.startswith(TINY_PREFIX) else None
