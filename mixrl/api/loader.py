"""Reading RLRun and SamplerPool manifests from YAML, with one line per problem."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from mixrl.api.errors import InvalidSpec, Problem, problems_from_validation_error
from mixrl.api.models import API_VERSION, RLRun, SamplerPool

KINDS: dict[str, type[RLRun] | type[SamplerPool]] = {"RLRun": RLRun, "SamplerPool": SamplerPool}


class ManifestUnreadable(Exception):
    """The file itself cannot be used (missing, unreadable, not YAML): a usage error, not a spec error."""


@dataclass(frozen=True)
class Document:
    source: str
    index: int
    """Position of the document in its file (0-based)."""
    data: Any

    @property
    def label(self) -> str:
        return self.source if self.index == 0 else f"{self.source}#{self.index}"


def read_documents(path: str | Path) -> list[Document]:
    """Every non-empty YAML document in a file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestUnreadable(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestUnreadable(f"{path}: cannot read ({exc})") from None
    try:
        raw = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        reason = getattr(exc, "problem", None) or "invalid YAML"
        raise ManifestUnreadable(f"{path}: not YAML{where}: {reason}") from None
    return [Document(str(path), i, data) for i, data in enumerate(raw) if data is not None]


def parse_document(data: Any) -> RLRun | SamplerPool:
    """Validate one manifest; raises InvalidSpec listing every problem."""
    if not isinstance(data, dict):
        raise InvalidSpec([Problem("", f"expected a mapping (an RLRun manifest), got {type(data).__name__}")])
    api_version = data.get("apiVersion", API_VERSION)
    if api_version != API_VERSION:
        raise InvalidSpec([Problem("apiVersion", f"expected {API_VERSION}, got {api_version!r}")])
    kind = data.get("kind", "RLRun")
    model = KINDS.get(kind)
    if model is None:
        raise InvalidSpec([Problem("kind", f"expected one of {', '.join(KINDS)}, got {kind!r}")])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidSpec(problems_from_validation_error(exc)) from None


def load_rlrun(path: str | Path) -> RLRun:
    """The single RLRun of a file (``mixrl run``); raises InvalidSpec or ManifestUnreadable."""
    documents = [
        d for d in read_documents(path) if not isinstance(d.data, dict) or d.data.get("kind") != "SamplerPool"
    ]
    if len(documents) != 1:
        raise ManifestUnreadable(f"{path}: expected exactly one RLRun document, found {len(documents)}")
    run = parse_document(documents[0].data)
    assert isinstance(run, RLRun)
    return run
