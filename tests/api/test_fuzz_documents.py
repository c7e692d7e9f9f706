"""Fuzzing RLRun documents: success or clear lines, never a traceback or a hang.

Every case goes through what `mixrl validate` runs on a file: YAML text -> the safe loader
(:func:`mixrl.api.loader.parse_yaml`) -> :func:`mixrl.api.loader.parse_document`.  The properties:

- the only exceptions are ManifestUnreadable (one line naming the file) and InvalidSpec;
- every problem is one line of bounded length that names a field (a document that is a mapping
  always gets a path);
- a single wrong leaf in a valid example gives exactly one line;
- an accepted document resolves (``resolve()``, and back from the JSON the components read), is
  finite, and passes the CRD's schema, so the API server would not refuse what `mixrl validate`
  accepted;
- for in-range mutations (numbers within their schema bounds, enum values), the CRD's CEL rules
  refuse exactly what the models refuse, with the same line (tests/api/test_cel_rules.py's
  evaluator);
- each case finishes within the hypothesis deadline.

Run with ``-s`` to print the tally (cases, accepted, clear errors, crashes), recorded in
docs/benchmarks.md.
"""

from __future__ import annotations

import copy
import math
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixrl.api.crd import openapi_to_jsonschema, rlrun_crd
from mixrl.api.errors import MAX_LINE, InvalidSpec
from mixrl.api.loader import MAX_ALIASES, MAX_NODES, ManifestUnreadable, parse_document, parse_yaml
from mixrl.api.models import RLRun
from mixrl.api.resolve import ResolvedRun, resolve

from .conftest import ROOT
from .test_cel_rules import admission_problems

SOURCE = "fuzz.yaml"
EXAMPLES = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("*.yaml"))]
CRD = rlrun_crd()
ROOT_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
JSON_SCHEMA = openapi_to_jsonschema(ROOT_SCHEMA)
TALLY: Counter[str] = Counter()
FUZZ = settings(
    deadline=5000,  # ms per case (a case takes ~20 ms; shared CI cores are slow): a hang fails here
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,  # the same cases on every machine, nothing written into the checkout
    derandomize=True,
)

Doc = dict[str, Any]
Path = tuple[str | int, ...]


# ----------------------------------------------------------------------------- the property


def clear(line: str) -> bool:
    return (
        "\n" not in line and "\r" not in line and 0 < len(line) <= MAX_LINE + 200 and "Traceback" not in line
    )


def check(text: str) -> list[list[str]]:
    """The validate path on one file's text: per document, [] if accepted, else its problem lines."""
    TALLY["cases"] += 1
    try:
        documents = parse_yaml(text, SOURCE)
    except ManifestUnreadable as exc:
        line = str(exc)
        assert clear(line) and line.startswith(f"{SOURCE}: "), line
        TALLY["clear errors"] += 1
        TALLY["unreadable files"] += 1
        return [[line]]
    if not documents:
        TALLY["empty files"] += 1  # `mixrl validate` reports "no documents" (a usage error)
    results = []
    for document in documents:
        try:
            resource = parse_document(document.data)
        except InvalidSpec as exc:
            lines = [str(p) for p in exc.problems]
            assert lines, "InvalidSpec without a problem"
            for problem, line in zip(exc.problems, lines, strict=True):
                assert clear(line), line
                assert problem.path or not isinstance(document.data, dict), f"names no field: {line}"
            TALLY["clear errors"] += 1
            results.append(lines)
            continue
        TALLY["accepted"] += 1
        if isinstance(resource, RLRun):
            accepted_is_sound(document.data, resource)
        results.append([])
    return results


def accepted_is_sound(data: Doc, run: RLRun) -> None:
    resolved = resolve(run)  # what the operator and `mixrl run` do next must work
    assert all(math.isfinite(v) for v in _numbers(run.model_dump(mode="json")))
    assert resolved.trainer.world_size >= 1
    # the components read the resolved run back from JSON (the run's ConfigMap, or a file locally)
    assert ResolvedRun.model_validate_json(resolved.model_dump_json()) == resolved
    jsonschema.validate(data, JSON_SCHEMA)  # and the API server's schema takes it too


def _numbers(value: Any) -> Iterator[float]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield float(value)


def dump(doc: Any) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    crashes = 0  # any other exception fails the test that raised it
    print(
        f"\nfuzz: {TALLY['cases']} cases, {TALLY['accepted']} documents accepted, {TALLY['clear errors']} clear"
        f" errors ({TALLY['unreadable files']} unreadable files), {TALLY['empty files']} empty files,"
        f" {crashes} crashes"
    )


# ----------------------------------------------------------------------------- strategies


def leaves(node: Any, path: Path = ()) -> list[Path]:
    if isinstance(node, dict):
        return [p for key, value in node.items() for p in leaves(value, (*path, key))]
    if isinstance(node, list) and node:
        return [p for index, value in enumerate(node) for p in leaves(value, (*path, index))]
    return [path]


def mappings(node: Any, path: Path = ()) -> list[Path]:
    found = [path] if isinstance(node, dict) else []
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in children:
        found += mappings(value, (*path, key))
    return found


def set_at(doc: Any, path: Path, value: Any) -> None:
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def get_at(doc: Any, path: Path) -> Any:
    for key in path:
        doc = doc[key]
    return doc


huge_ints = st.one_of(
    st.integers(),
    st.integers(min_value=2**31 - 2, max_value=2**31 + 2),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.integers(min_value=1, max_value=400).map(lambda digits: 10**digits - 1),
)
awkward_strings = st.sampled_from(
    ["", "lots", "-5Gi", "0", "8Ei", "1e20", "1e1.5", "NaN", ".inf", "true", "null", "~", "RLRun", "A100",
     "nvfp4", "a b", "x" * 300, "é", "\t", "{", "*a", "&a", "- x", "500Gi", "100m", "Default"]
)  # fmt: skip
scalars = st.one_of(
    huge_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=20),
    awkward_strings,
)
garbage = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=4),
    ),
    max_leaves=12,
)


@st.composite
def leaf_mutation(draw: st.DrawFn) -> tuple[Doc, Path]:
    """A valid example with one leaf replaced by a scalar of any type or size."""
    doc = copy.deepcopy(draw(st.sampled_from(EXAMPLES)))
    path = draw(st.sampled_from([p for p in leaves(doc) if p != ("kind",)]))
    value = draw(scalars)
    set_at(doc, path, value)
    return doc, path


@st.composite
def structural_mutation(draw: st.DrawFn) -> str:
    """A valid example with subtrees replaced by garbage, fields added or removed, or nesting deep."""
    doc = copy.deepcopy(draw(st.sampled_from(EXAMPLES)))
    deep = ""
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        kind = draw(st.sampled_from(["replace", "add", "delete", "deep"]))
        if kind == "delete":
            path = draw(st.sampled_from([p for p in leaves(doc) if p]))
            parent = get_at(doc, path[:-1])
            if isinstance(parent, dict):
                del parent[path[-1]]
            continue
        target = draw(st.sampled_from(mappings(doc)))
        if kind == "add":
            get_at(doc, target)[draw(st.text(min_size=1, max_size=12))] = draw(garbage)
        elif kind == "replace" and target:
            set_at(doc, target, draw(garbage))
        elif kind == "deep":
            depth = draw(st.integers(min_value=1, max_value=5000))
            deep = "[" * depth + "]" * depth
            get_at(doc, target)["deep"] = "__DEEP__"
    text = dump(doc)
    return text.replace("__DEEP__", deep) if deep else text


yaml_text = st.one_of(
    st.text(alphabet="{}[]:,-&*!|>'\"#?%@`\n\t 0123456789abcxyze.+~", max_size=200),
    st.text(max_size=100),
    st.binary(max_size=100).map(lambda b: b.decode("utf-8", errors="replace")),
)


def _bounded(schema: dict[str, Any]) -> st.SearchStrategy[Any] | None:
    """A value within a schema node's bounds (None: not a node to mutate in range)."""
    kind = schema.get("type")
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    low, high = schema.get("minimum"), schema.get("maximum")
    if kind == "integer":
        low = -(2**31) if low is None else low + (1 if schema.get("exclusiveMinimum") else 0)
        high = 2**31 - 1 if high is None else high - (1 if schema.get("exclusiveMaximum") else 0)
        return st.one_of(st.integers(low, min(high, low + 64)), st.integers(low, high))
    if kind == "number":
        return st.floats(
            min_value=low if low is not None else -1e6,
            max_value=high if high is not None else 1e6,
            exclude_min=bool(schema.get("exclusiveMinimum")),
            exclude_max=bool(schema.get("exclusiveMaximum")),
            allow_nan=False,
            allow_infinity=False,
        )
    return None


def schema_leaves(doc: Any, schema: dict[str, Any], path: Path = ()) -> list[tuple[Path, dict[str, Any]]]:
    if isinstance(doc, dict) and "properties" in schema:
        found = []
        for key, value in doc.items():
            if key in schema["properties"]:
                found += schema_leaves(value, schema["properties"][key], (*path, key))
        return found
    if isinstance(doc, list) and "items" in schema:
        return [p for i, item in enumerate(doc) for p in schema_leaves(item, schema["items"], (*path, i))]
    return [(path, schema)] if _bounded(schema) is not None else []


@st.composite
def in_range_mutation(draw: st.DrawFn) -> Doc:
    """A valid example with one to three numbers or enum values changed within the schema's bounds:
    whatever fails now fails a cross-field rule."""
    doc = copy.deepcopy(draw(st.sampled_from(EXAMPLES)))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        path, schema = draw(st.sampled_from(schema_leaves(doc, ROOT_SCHEMA)))
        strategy = _bounded(schema)
        assert strategy is not None
        set_at(doc, path, draw(strategy))
    return doc


# ----------------------------------------------------------------------------- tests


# 300: the 7 example documents hold 359 leaves; 300 derandomized cases put a hostile value (huge
# numbers, awkward strings, nested junk) at most of them once, in ~7 s on 2 shared cores.
@settings(FUZZ, max_examples=300)
@given(leaf_mutation())
def test_one_wrong_leaf_gives_success_or_one_line(case: tuple[Doc, Path]) -> None:
    doc, _ = case
    [result] = check(dump(doc))
    assert len(result) <= 1, result


# 200: 4 kinds of structural change (replace, add, delete, deep) x 7 documents = 28 pairs, ~7
# cases each; ~4 s.
@settings(FUZZ, max_examples=200)
@given(structural_mutation())
def test_garbage_subtrees_give_clear_lines(text: str) -> None:
    check(text)


# 400: a case is one YAML parse that mostly fails early (well under 1 ms of validation), so many
# cheap cases cover the parser's error paths; ~1 s.
@settings(FUZZ, max_examples=400)
@given(yaml_text)
def test_random_text_gives_clear_lines(text: str) -> None:
    check(text)


# 30: cel-python takes ~0.3 s a document (5.5 s in all); each case changes several in-range leaves
# at once, so 30 cases still compare the models with most CEL rules the examples reach.
@settings(FUZZ, max_examples=30, deadline=30_000)  # cel-python takes ~0.3 s a document, more under load
@given(in_range_mutation())
def test_in_range_mutations_agree_with_the_api_server_rules(doc: Doc) -> None:
    [result] = check(dump(doc))
    admission = admission_problems(doc, CRD)
    if len(result) == 1 and "-parameter model" in result[0]:
        # Whether the weights fit a GPU (mixrl.api.memory) has no CEL twin: it is checked last,
        # so nothing else is wrong, and the API server accepts the document.
        assert admission == [], (result, admission)
        return
    # The same refusals; in which order two violations are listed is each validator's own (the API
    # server evaluates a list item's rules before a later field's, pydantic in field order).
    assert sorted(result) == sorted(admission), (result, admission)


# ------------------------------------------------- the loader's limits, on generated documents
# (issue #14 item 4: duplicate keys and alias expansion, beyond the hand-written cases of
# tests/api/test_loader.py)

KEY_LINE = re.compile(r"^(?P<indent>(?:  )*)(?P<key>[A-Za-z][A-Za-z0-9]*): \S")


@st.composite
def duplicated_key(draw: st.DrawFn) -> tuple[str, str]:
    """A valid example's YAML with one ``key: value`` line repeated right below itself, the copy
    holding any scalar: the loader must name the key, whatever the value."""
    lines = dump(copy.deepcopy(draw(st.sampled_from(EXAMPLES)))).splitlines()
    candidates = [i for i, line in enumerate(lines) if KEY_LINE.match(line)]
    index = draw(st.sampled_from(candidates))
    match = KEY_LINE.match(lines[index])
    assert match is not None
    value = yaml.safe_dump(draw(scalars), default_flow_style=True).splitlines()[0].removesuffix(" ...")
    lines.insert(index + 1, f"{match['indent']}{match['key']}: {value}")
    return "\n".join(lines) + "\n", match["key"]


# 60: a duplicated key at 60 places drawn over the 7 documents' mappings (top level, nested,
# in lists); the property is one line naming the key, the same code path for any depth; <1 s.
@settings(FUZZ, max_examples=60)
@given(duplicated_key())
def test_a_duplicated_key_anywhere_is_one_line_naming_it(case: tuple[str, str]) -> None:
    text, key = case
    [result] = check(text)
    assert len(result) == 1 and f"duplicate key '{key}'" in result[0], result


@st.composite
def alias_bomb(draw: st.DrawFn) -> tuple[str, int, int]:
    """A valid example with one unknown top-level key holding a ladder of anchors, each rung
    ``width`` aliases of the one below: ``width ** depth`` nodes once expanded, from a handful to
    far beyond any limit."""
    width, depth = draw(st.integers(1, 12)), draw(st.integers(1, 14))
    rungs = ["bomb:", "  l0: &l0 [lol]"]
    rungs += [f"  l{d}: &l{d} [{', '.join([f'*l{d - 1}'] * width)}]" for d in range(1, depth + 1)]
    spec = dump(copy.deepcopy(draw(st.sampled_from(EXAMPLES))))
    return spec + "\n".join(rungs) + "\n", width, depth


# 40: ladders of widths x depths spread from harmless to well past the reader's limit; each
# case that is refused costs the deadline check only; <1 s.
@settings(FUZZ, max_examples=40)
@given(alias_bomb())
def test_alias_ladders_are_read_or_refused_in_one_line_within_the_deadline(
    case: tuple[str, int, int],
) -> None:
    text, width, depth = case
    [result] = check(text)
    assert len(result) == 1, result
    refused = result[0].startswith(f"{SOURCE}: ")
    if width * depth > MAX_ALIASES or width**depth > 10 * MAX_NODES:
        assert refused and ("aliases" in result[0] or "nodes" in result[0]), result
    elif width**depth < MAX_NODES // 10:
        assert result == ["bomb: unknown field (check the spelling; unknown fields are rejected)"], result
