"""Turning validation failures into one line per problem: ``path: reason``."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError


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


def _join_path(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _clean_message(error: dict) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field (check the spelling; unknown fields are rejected)"
    if kind == "missing":
        return "required field is missing"
    message = error["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    if kind == "literal_error":
        return f"{message}, got {error.get('input')!r}"
    return message


def problems_from_validation_error(exc: ValidationError) -> list[Problem]:
    """One Problem per pydantic error, located by camelCase path."""
    problems: list[Problem] = []
    for error in exc.errors(include_url=False):
        loc: list[str | int] = []
        for part in error["loc"]:
            # Tagged unions and function validators insert non-field segments; drop them.
            if isinstance(part, str) and ("[" in part or part.startswith("function-")):
                continue
            loc.append(part)
        if error["type"] == "mixrl_field":
            field = error["ctx"]["field"]
            path = _join_path(loc)
            problems.append(Problem(f"{path}.{field}" if path else field, error["ctx"]["reason"]))
        else:
            problems.append(Problem(_join_path(loc), _clean_message(error)))
    return problems
