"""Turning validation failures into one line per problem: ``path: reason``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from mixrl.api.names import shown

MAX_LINE = 400
"""Longest problem line: the message names the field and the rule, never a whole pasted value."""
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_.\-/]{1,80}$")


@dataclass(frozen=True)
class Problem:
    path: str
    """Dotted location in the document, e.g. ``spec.samplerPools[2].weightPrecision``."""
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class InvalidSpec(ValueError):
    """A spec that can never become valid by retrying; carries every problem found."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(map(str, problems)))

    @property
    def first_line(self) -> str:
        more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"{self.problems[0]}{more}"


def one_line(text: str) -> str:
    """``text`` as one line of bounded length, whatever a user's value put into it."""
    text = " ".join(text.splitlines()) if "\n" in text or "\r" in text else text
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 3] + "..."


_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}
"""pydantic's wrong-type errors -> what the field takes; the message adds what it got, since a YAML
``true`` where a count belongs reads as fine otherwise."""


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return shown(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def got_value(value: Any) -> str:
    """A wrong value as YAML would spell it (true, null, 1e+20, 'text'), or its kind for collections."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        text = repr(value)
        return text if len(text) <= 30 else f"an integer of {len(str(abs(value)))} digits"
    if isinstance(value, str):
        return f"the string {_shown(value)}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"


def _join_path(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.match(part):
            out += f".{part}" if out else part
        else:  # a user's map key (a label, a typo'd field) with spaces, newlines or a megabyte of text
            out += f"[{_shown(part)}]"
    return out


def _clean_message(error: ErrorDetails) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field (check the spelling; unknown fields are rejected)"
    if kind == "missing":
        return "required field is missing"
    if kind == "too_long":  # pydantic says "after validation", which reads as if items were dropped
        ctx = error.get("ctx", {})
        return f"at most {ctx.get('max_length')} entries, got {ctx.get('actual_length')}"
    if kind == "too_short":
        ctx = error.get("ctx", {})
        least = ctx.get("min_length")
        return f"at least {least} {'entry' if least == 1 else 'entries'}, got {ctx.get('actual_length')}"
    if kind == "invalid_key":
        return "keys must be strings"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {got_value(error.get('input'))}"
    if kind == "finite_number":
        return f"must be a finite number, got {got_value(error.get('input'))}"
    message = error["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    if kind == "literal_error":
        return f"{message}, got {_shown(error.get('input'))}"
    return message


def problems_from_validation_error(exc: ValidationError) -> list[Problem]:
    """One Problem per pydantic error, located by camelCase path."""
    problems: list[Problem] = []
    for error in exc.errors(include_url=False):
        loc: list[str | int] = []
        parts = error["loc"]
        for index, part in enumerate(parts):
            # Tagged unions and function validators insert non-field segments; drop them.  An
            # unknown field's own name (the last segment) is the user's key, whatever it spells.
            user_key = error["type"] == "extra_forbidden" and index == len(parts) - 1
            if isinstance(part, str) and not user_key and ("[" in part or part.startswith("function-")):
                continue
            loc.append(part)
        if error["type"] == "mixrl_field":
            field = error["ctx"]["field"]
            path = _join_path(loc)
            problems.append(Problem(f"{path}.{field}" if path else field, one_line(error["ctx"]["reason"])))
        else:
            problems.append(Problem(one_line(_join_path(loc)), one_line(_clean_message(error))))
    return problems
