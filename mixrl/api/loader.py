"""Reading RLRun and SamplerPool manifests from YAML, with one line per problem.

The components read the *resolved* run instead, each through :func:`load_resolved` (one loader, one
error line).

Every RLRun file mixrl reads (``mixrl validate``, ``mixrl run``, ``mixrl simulate``) goes through
:func:`read_documents`, whose YAML loader is safe against hostile or careless input: it reads at
most :data:`MAX_FILE_BYTES` (``/dev/zero`` ends at once), expands at most :data:`MAX_ALIASES`
aliases into at most :data:`MAX_NODES` nodes (a "billion laughs" alias bomb is refused, not
expanded), nests at most :data:`MAX_DEPTH` levels (PyYAML's composer recurses, so deeper input
would end in a RecursionError), refuses integers longer than Python converts in linear time, and
refuses a key given twice in one mapping (PyYAML would silently keep the last value).  Each refusal
is one line naming the line of the file.

It also reads floats as Kubernetes' YAML parser does: ``1e-6`` is a number there, while PyYAML's
YAML 1.1 rules make it a string; the models take no strings for numbers, so without this the same
manifest would mean different things to ``mixrl validate`` and ``kubectl apply``.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import yaml
from pydantic import ValidationError
from yaml.composer import Composer
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode
from yaml.resolver import Resolver

from mixrl.api.errors import InvalidSpec, Problem, got_value, problems_from_validation_error
from mixrl.api.models import API_VERSION, RLRun, SamplerPool
from mixrl.api.names import shown
from mixrl.api.plain_text import plain_text
from mixrl.api.resolve import ResolvedRun

if TYPE_CHECKING:
    from yaml._yaml import Mark as _LibyamlMark
    from yaml.events import Event

    YamlMark: TypeAlias = yaml.Mark | _LibyamlMark
    """Where a node or event starts: PyYAML's own mark, or libyaml's (the same fields) from its parser."""

KINDS: dict[str, type[RLRun] | type[SamplerPool]] = {"RLRun": RLRun, "SamplerPool": SamplerPool}

MAX_FILE_BYTES = 1024 * 1024
"""Largest manifest file: an RLRun is a few KiB; the API server's own limit on an object is ~1.5 MiB."""
MAX_DEPTH = 64
"""Deepest nesting of collections; an RLRun nests about 7 levels."""
MAX_ALIASES = 256
"""Most ``*alias`` references per file: anchors for shared scheduling blocks are fine, bombs are not."""
MAX_NODES = 100_000
"""Most YAML nodes per file with every alias expanded (what pydantic would walk); a large RLRun has
about 2,000. It also bounds the loader's memory: PyYAML keeps every node, with its marks, until the
document is built."""
MAX_INT_DIGITS = 4300
"""Longest integer scalar: Python's own limit for converting decimal strings (quadratic beyond)."""

_MERGE_TAG = "tag:yaml.org,2002:merge"
NOT_JSON_TAGS = ("binary", "timestamp", "set", "omap", "pairs")
"""YAML types a JSON document cannot hold: refused where they appear, never coerced to a string."""
_FLOAT_TAG = "tag:yaml.org,2002:float"


class ManifestUnreadable(ValueError):
    """The file itself cannot be used (missing, unreadable, not YAML, beyond the loader's limits): a
    usage error, not a spec error.  A ValueError, like InvalidSpec, so that callers catching bad input
    (``mixrl simulate SPEC``) print its one line instead of a traceback."""


class LimitExceeded(yaml.MarkedYAMLError):
    """The document breaks one of the safe loader's limits, or repeats a key."""

    if TYPE_CHECKING:
        # types-PyYAML types MarkedYAMLError's marks as PyYAML's own; libyaml's events carry libyaml's
        def __init__(self, *, problem: str, problem_mark: YamlMark | None) -> None: ...


# The mixin's methods extend a PyYAML loader's; type checkers see it as one.
if TYPE_CHECKING:
    _LoaderBase: TypeAlias = yaml.SafeLoader
else:
    _LoaderBase = object


class _Limits(_LoaderBase):
    """The limits, duplicate keys and exponent floats, mixed into a PyYAML loader (pure Python or
    libyaml events).  One instance reads one file."""

    if TYPE_CHECKING:
        # types-PyYAML leaves these unannotated in the pure-Python Parser and BaseConstructor
        def peek_event(self) -> Event | None: ...
        def check_data(self) -> bool: ...

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0
        self._expanded = 0
        """Nodes so far with every alias counted as the whole subtree it stands for."""
        self._anchored_sizes: dict[int, int] = {}
        """id(anchored node) -> its expanded size, known once the node is complete."""

    def _count(self, nodes: int, node_mark: YamlMark | None) -> None:
        self._expanded += nodes
        if self._expanded > MAX_NODES:
            raise LimitExceeded(
                problem=f"more than {MAX_NODES} YAML nodes with aliases expanded", problem_mark=node_mark
            )

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()
        assert event is not None  # the composer composes a node only where an event comes next
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise LimitExceeded(problem=f"more than {MAX_ALIASES} aliases", problem_mark=event.start_mark)
            node = super().compose_node(parent, index)
            size = self._anchored_sizes.get(id(node))
            if size is None:  # the anchor's own node is still open: the alias is inside it
                raise LimitExceeded(
                    problem=f"alias *{event.anchor} refers to a node that contains it (a recursive document)",
                    problem_mark=event.start_mark,
                )
            self._count(size, event.start_mark)
            return node
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise LimitExceeded(
                problem=f"nested more than {MAX_DEPTH} levels deep", problem_mark=event.start_mark
            )
        before = self._expanded
        self._count(1, event.start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if getattr(event, "anchor", None) is not None:
            self._anchored_sizes[id(node)] = self._expanded - before
        return node

    def compose_document(self) -> Node | None:
        node = super().compose_document()
        self._anchored_sizes.clear()  # anchors are per document; the node and alias budgets per file
        return node

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as exc:
            # A scalar that matched a resolver but not its constructor (a date 2024-13-45): PyYAML
            # raises a bare ValueError, without the line.
            value = node.value if isinstance(node, ScalarNode) else node.tag
            raise ConstructorError(
                None, None, f"cannot read {shown(str(value))} ({exc})", node.start_mark
            ) from None

    def construct_not_json(self, node: Node) -> Any:
        """A value JSON has no form for (bytes, a date, a set): a run is JSON, as Kubernetes stores it."""
        kind = node.tag.rsplit(":", 1)[-1]
        raise LimitExceeded(
            problem=f"a !!{kind} value is not JSON; write it as a string, number, list or mapping",
            problem_mark=node.start_mark,
        )

    def construct_yaml_int(self, node: ScalarNode) -> int:
        if len(node.value) > MAX_INT_DIGITS:
            raise LimitExceeded(
                problem=f"an integer of {len(node.value)} digits (at most {MAX_INT_DIGITS})",
                problem_mark=node.start_mark,
            )
        return int(super().construct_yaml_int(node))

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        # Before merge keys are flattened in: a key set explicitly may override a merged one (YAML
        # merge semantics), but not another explicit one.
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = key in first_line
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if seen:
                raise LimitExceeded(
                    problem=f"duplicate key {shown(str(key))} (first at line {first_line[key] + 1})",
                    problem_mark=key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


class PureSafeLoader(_Limits, yaml.SafeLoader):
    """The safe loader on PyYAML's pure-Python scanner and parser (when PyYAML has no libyaml)."""


LOADERS: list[type[_Limits]] = [PureSafeLoader]
SafeLoader: type[_Limits] = PureSafeLoader
"""What read_documents uses: the libyaml one where PyYAML has libyaml; both read every document
alike (tests/api check both)."""

if yaml.__with_libyaml__:
    from yaml._yaml import CParser as _CParser

    class _LibyamlEvents(Composer, _CParser, SafeConstructor, Resolver):
        """libyaml's scanner and parser (about 5x faster than PyYAML's) under PyYAML's Python
        composer, whose compose_node the limits hook into (libyaml's own composer cannot be hooked)."""

        def __init__(self, stream: str) -> None:
            _CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

    class LibyamlSafeLoader(_Limits, _LibyamlEvents):
        """The safe loader on libyaml's scanner and parser."""

    LOADERS.append(LibyamlSafeLoader)
    SafeLoader = LibyamlSafeLoader

_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
# YAML 1.1's numbers without its base 60 (1:30 = 90), which Kubernetes' parser (go-yaml) reads as a
# string: `mixrl validate` would accept what `kubectl apply` refuses.
_INT_TAG = "tag:yaml.org,2002:int"
_INT = re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
for _loader in LOADERS:
    _loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
        for first, resolvers in _loader.yaml_implicit_resolvers.items()
    }
    _loader.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
    _loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))
    # PyYAML looks constructors up in a table of plain functions, so the override must be registered.
    _loader.add_constructor("tag:yaml.org,2002:int", _Limits.construct_yaml_int)
    for _tag in NOT_JSON_TAGS:
        _loader.add_constructor(f"tag:yaml.org,2002:{_tag}", _Limits.construct_not_json)
    _loader.add_implicit_resolver(_FLOAT_TAG, _EXPONENT_FLOAT, list("-+0123456789."))


def _describe(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: where (line) and what."""
    if isinstance(exc, yaml.reader.ReaderError):
        return f"not YAML: unacceptable character #x{exc.character:04x} at byte {exc.position}"
    mark = getattr(exc, "problem_mark", None)
    reason = getattr(exc, "problem", None) or "invalid YAML"
    if isinstance(exc, LimitExceeded):
        return f"line {mark.line + 1}: {reason}" if mark is not None else reason
    where = f" at line {mark.line + 1}" if mark is not None else ""
    return f"not YAML{where}: {reason}"


@dataclass(frozen=True)
class Document:
    source: str
    index: int
    """Position of the document in its file (0-based)."""
    data: Any

    @property
    def label(self) -> str:
        return self.source if self.index == 0 else f"{self.source}#{self.index}"


def read_text(path: str | Path) -> str:
    """A manifest file's text, reading at most MAX_FILE_BYTES + 1 bytes of it whatever it is (a
    device, a pipe, a file being written)."""
    path = Path(path)
    try:
        with path.open("rb") as stream:
            data = stream.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ManifestUnreadable(f"{path}: no such file") from None
    except OSError as exc:
        raise ManifestUnreadable(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) > MAX_FILE_BYTES:
        raise ManifestUnreadable(f"{path}: larger than {MAX_FILE_BYTES} bytes (an RLRun is a few KiB)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestUnreadable(f"{path}: not UTF-8 text (byte {exc.start})") from None


def parse_yaml(text: str, source: str, loader_class: type[_Limits] | None = None) -> list[Document]:
    """Every non-empty YAML document of ``text``, through the safe loader."""
    raw: list[Any] = []
    loader = None
    try:
        loader = (loader_class or SafeLoader)(text)  # PyYAML's reader checks the characters here already
        while loader.check_data():
            raw.append(loader.get_data())
    except yaml.YAMLError as exc:
        raise ManifestUnreadable(f"{source}: {_describe(exc)}".replace("\n", " ")) from None
    finally:
        if loader is not None:
            loader.dispose()
    return [Document(source, i, data) for i, data in enumerate(raw) if data is not None]


def read_documents(path: str | Path) -> list[Document]:
    """Every non-empty YAML document in a file."""
    return parse_yaml(read_text(path), str(path))


def parse_document(data: Any) -> RLRun | SamplerPool:
    """Validate one manifest; raises InvalidSpec listing every problem."""
    if not isinstance(data, dict):
        raise InvalidSpec([Problem("", f"expected a mapping (an RLRun manifest), got {type(data).__name__}")])
    if data.get("kind") == "List" and "items" in data:
        raise InvalidSpec(
            [Problem("kind", "List: a list of objects (as kubectl get -o yaml prints) is not read; give one"
                     " RLRun or SamplerPool per YAML document (separated by ---)")]
        )  # fmt: skip
    api_version = data.get("apiVersion", API_VERSION)
    if api_version != API_VERSION:
        raise InvalidSpec([Problem("apiVersion", f"expected {API_VERSION}, got {_shown_value(api_version)}")])
    kind = data.get("kind", "RLRun")
    model = KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise InvalidSpec([Problem("kind", f"expected one of {', '.join(KINDS)}, got {_shown_value(kind)}")])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidSpec(problems_from_validation_error(exc)) from None
    except RecursionError:  # a dict built in Python (the operator's) may nest deeper than YAML can
        raise InvalidSpec([Problem("", "nested too deeply")]) from None


def _shown_value(value: Any) -> str:
    return shown(value) if isinstance(value, str) else got_value(value)


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


class RunConfigError(ValueError):
    """A component cannot use its ``--config``: one line naming the flag, the file, the field and why."""


CONFIG_HELP = "resolved run JSON (written by mixrl run or the operator)"


def component_parser(prog: str, doc: str | None, config_help: str = CONFIG_HELP) -> argparse.ArgumentParser:
    """The command line of a component that reads the resolved run: ``--help`` shows its module's
    docstring ``doc`` as written, and ``--config`` names the run (:func:`load_resolved`)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=plain_text(doc), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help=config_help)
    return parser


def load_resolved(path: str | Path, flag: str = "--config") -> ResolvedRun:
    """A component's view of the run: the resolved run (``ResolvedRun`` as JSON) that ``mixrl run``
    writes and the operator mounts from the run's ConfigMap.  Every component reads its part of the
    run through this, validated once by :func:`~mixrl.api.resolve.resolve` before it was written;
    raises :class:`RunConfigError` (``--config PATH: field: reason``)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise RunConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise RunConfigError(f"{flag} {path}: not UTF-8 text (byte {exc.start})") from None
    try:
        return ResolvedRun.model_validate_json(text)
    except ValidationError as exc:
        problems = problems_from_validation_error(exc)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RunConfigError(f"{flag} {path}: not a resolved run: {problems[0]}{more}") from None
