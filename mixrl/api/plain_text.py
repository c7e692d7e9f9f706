"""Docstrings as the plain text users read: ``kubectl explain`` (the CRDs' descriptions come from
the models' docstrings) and ``--help`` (the commands' descriptions are their modules' docstrings)."""

from __future__ import annotations

import re

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :func:`mixrl.x.y`, :data:`~NAME`
_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(text: str | None) -> str:
    """reStructuredText's ``literal`` and :role:`target` markup as Markdown's single backticks."""
    return _LITERAL.sub(r"`\1`", _ROLE.sub(r"`\1`", text or ""))
