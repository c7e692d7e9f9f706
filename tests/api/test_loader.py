"""The safe YAML loader: limits on size, aliases, depth and integers, no duplicate keys, Kubernetes'
exponent floats; and `mixrl validate` on the inputs that used to crash it or take GBs and minutes.

The limits are checked on both loaders (libyaml's parser and PyYAML's pure-Python one, which
`read_documents` falls back to without libyaml); the crash cases go through the real command.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mixrl.api import loader
from mixrl.api.loader import (
    LOADERS,
    MAX_ALIASES,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    ManifestUnreadable,
    parse_yaml,
    read_documents,
)

from .conftest import ROOT


def validate(*paths: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "validate", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def refusal(text: str, loader_class: type) -> str:
    with pytest.raises(ManifestUnreadable) as info:
        parse_yaml(text, "f.yaml", loader_class)
    return str(info.value)


def nested(depth: int) -> str:
    return "a: " + "[" * depth + "]" * depth + "\n"


def bomb(levels: int, width: int = 9) -> str:
    """The "billion laughs": each level an anchored list of ``width`` aliases of the level below."""
    lines = ['l0: &l0 ["lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


LOADER_IDS = [c.__name__ for c in LOADERS]


@pytest.fixture(params=LOADERS, ids=LOADER_IDS)
def loader_class(request: pytest.FixtureRequest) -> type:
    return request.param  # type: ignore[no-any-return]


def test_both_loaders_exist_here() -> None:
    # Without libyaml the pure loader alone would be tested, and the one users get would not be.
    assert loader.SafeLoader.__name__ == "LibyamlSafeLoader" and len(LOADERS) == 2


# ----------------------------------------------------------------------------- limits


def test_alias_bomb_is_refused_not_expanded(loader_class: type) -> None:
    start = time.perf_counter()
    line = refusal(bomb(9), loader_class)  # 9^9 = 387 million strings if expanded
    assert line == "f.yaml: line 6: more than 100000 YAML nodes with aliases expanded"
    assert time.perf_counter() - start < 5


def test_too_many_aliases(loader_class: type) -> None:
    text = "a: &a 1\nb: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]\n"
    assert refusal(text, loader_class) == f"f.yaml: line 2: more than {MAX_ALIASES} aliases"


def test_a_few_aliases_are_fine(loader_class: type) -> None:
    # Anchors for a shared block (the same tolerations on every pool) are ordinary YAML.
    text = "x: &t [{key: gpu}]\npools: [{t: *t}, {t: *t}]\nmerged: {<<: {a: 1}, b: 2}\n"
    [document] = parse_yaml(text, "f.yaml", loader_class)
    assert document.data["pools"][1]["t"] == [{"key": "gpu"}]
    assert document.data["merged"] == {"a": 1, "b": 2}


def test_recursive_alias(loader_class: type) -> None:
    line = refusal("a: &a [1, *a]\n", loader_class)
    assert line == "f.yaml: line 1: alias *a refers to a node that contains it (a recursive document)"


def test_depth(loader_class: type) -> None:
    assert parse_yaml(nested(MAX_DEPTH - 1), "f.yaml", loader_class)  # the mapping is one level
    line = refusal(nested(MAX_DEPTH), loader_class)
    assert line == f"f.yaml: line 1: nested more than {MAX_DEPTH} levels deep"


def test_depth_ten_thousand(loader_class: type) -> None:
    # libyaml has a nesting limit of its own (1000), which answers first at this depth
    line = refusal(nested(10_000), loader_class)
    assert line in (
        f"f.yaml: line 1: nested more than {MAX_DEPTH} levels deep",
        "f.yaml: not YAML at line 1: exceeded maximum nesting depth",
    )


def test_long_integers(loader_class: type) -> None:
    assert parse_yaml("n: " + "9" * 4300, "f.yaml", loader_class)[0].data["n"] == int("9" * 4300)
    line = refusal("a: 1\nn: " + "9" * 5000 + "\n", loader_class)
    assert line == "f.yaml: line 2: an integer of 5000 digits (at most 4300)"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("a: 1\nb: 2\na: 3\n", "f.yaml: line 3: duplicate key 'a' (first at line 1)"),
        (
            "spec:\n  trainer:\n    nodes: 1\n    nodes: 2\n",
            "f.yaml: line 4: duplicate key 'nodes' (first at line 3)",
        ),
        ("a: {x: 1, x: 2}\n", "f.yaml: line 1: duplicate key 'x' (first at line 1)"),
        ("- {1: a, 1: b}\n", "f.yaml: line 1: duplicate key '1' (first at line 1)"),
    ],
)
def test_duplicate_keys_name_the_key_and_line(loader_class: type, text: str, line: str) -> None:
    assert refusal(text, loader_class) == line


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("metadata:\n  name: !!binary cXVpY2tzdGFydA==\n", "f.yaml: line 2: a !!binary value is not JSON"),
        ("labels: {day: 2024-01-01}\n", "f.yaml: line 1: a !!timestamp value is not JSON"),
        ("args: !!set {a: null}\n", "f.yaml: line 1: a !!set value is not JSON"),
        ("args: !!omap [{a: 1}]\n", "f.yaml: line 1: a !!omap value is not JSON"),
    ],
)
def test_values_json_cannot_hold_are_refused_in_one_line_never_coerced(
    loader_class: type, text: str, line: str
) -> None:
    """Before, ``name: !!binary …`` became bytes, which pydantic turned into the name."""
    refused = refusal(text, loader_class)
    assert refused.startswith(line) and "\n" not in refused, refused
    assert parse_yaml("day: '2024-01-01'\n", "f.yaml", loader_class)[0].data == {"day": "2024-01-01"}


def test_an_explicit_key_may_override_a_merged_one(loader_class: type) -> None:
    [document] = parse_yaml("base: &b {x: 1, y: 2}\nm: {<<: *b, x: 3}\n", "f.yaml", loader_class)
    assert document.data["m"] == {"x": 3, "y": 2}


@pytest.mark.parametrize(
    ("scalar", "value"),
    [("1e-6", 1e-6), ("1e20", 1e20), ("1.5e3", 1500.0), ("-2E+2", -200.0), (".5e1", 5.0), ("1.0e-6", 1e-6),
     ("'1e3'", "1e3"), ("1e", "1e"), ("0x10", 16), ("1_000", 1000), (".inf", float("inf")),
     ("1:30", "1:30"), ("1:30.5", "1:30.5"), ("-12:30:45", "-12:30:45")],  # base 60: go-yaml reads text
)  # fmt: skip
def test_numbers_as_kubernetes_reads_them(loader_class: type, scalar: str, value: object) -> None:
    [document] = parse_yaml(f"v: {scalar}\n", "f.yaml", loader_class)
    assert document.data["v"] == value and type(document.data["v"]) is type(value)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            "a: 2024-13-45\n",
            "f.yaml: line 1: a !!timestamp value is not JSON; write it as a string, number, list or mapping",
        ),
        ("a: \x00\n", "f.yaml: not YAML: unacceptable character #x0000 at byte 3"),
        ("spec: [unclosed\n", None),
        ("{[1]: 2}\n", None),
    ],
)
def test_malformed_yaml_is_one_line(loader_class: type, text: str, line: str | None) -> None:
    got = refusal(text, loader_class)
    assert "\n" not in got and got.startswith("f.yaml: ")
    if line is not None:
        assert got == line


def test_both_loaders_read_the_examples_alike() -> None:
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        text = example.read_text()
        pure, fast = (parse_yaml(text, str(example), c) for c in LOADERS)
        assert pure == fast


# ----------------------------------------------------------------------------- reading files


def test_file_size_limit(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * (MAX_FILE_BYTES - 3) + "\n")
    assert read_documents(path) == []  # exactly the limit: read
    path.write_text("# " + "x" * (MAX_FILE_BYTES - 2) + "\n")
    with pytest.raises(ManifestUnreadable) as info:
        read_documents(path)
    assert str(info.value) == f"{path}: larger than {MAX_FILE_BYTES} bytes (an RLRun is a few KiB)"


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ManifestUnreadable) as info:
        read_documents(path)
    assert str(info.value) == f"{path}: not UTF-8 text (byte 9)"


# ----------------------------------------------------------------------------- the command, end to end


def test_validate_alias_bomb(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb(9))
    start = time.perf_counter()
    done = validate(path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [f"{path}: line 6: more than 100000 YAML nodes with aliases expanded"]
    assert time.perf_counter() - start < 20


def test_validate_dev_zero() -> None:
    start = time.perf_counter()
    done = validate("/dev/zero")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        f"/dev/zero: larger than {MAX_FILE_BYTES} bytes (an RLRun is a few KiB)"
    ]
    assert time.perf_counter() - start < 20


def test_validate_endless_fifo(tmp_path: Path) -> None:
    # A pipe that never ends (`mixrl validate <(yes)`): read up to the limit, then refuse.
    fifo = tmp_path / "endless.yaml"
    os.mkfifo(fifo)
    stop = threading.Event()

    def write() -> None:
        try:
            with fifo.open("wb") as stream:
                while not stop.is_set():
                    stream.write(b"a: 1\n" * 4096)
        except (BrokenPipeError, OSError):
            pass  # the reader closed its end: what the test wants

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        done = validate(fifo)
    finally:
        stop.set()
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"{fifo}: larger than {MAX_FILE_BYTES} bytes (an RLRun is a few KiB)"]
    writer.join(timeout=10)


@pytest.mark.parametrize(
    ("text", "code", "line"),
    [
        ("kind: [RLRun]\nmetadata: {name: x}\n", 1, "kind: expected one of RLRun, SamplerPool, got a list"),
        (nested(10_000), 2, None),
        ("spec:\n  trainer:\n    nodes: " + "9" * 5000 + "\n", 2, "line 3: an integer of 5000 digits (at most 4300)"),
        ("spec:\n  model: {path: a}\n  model: {path: b}\n", 2, "line 3: duplicate key 'model' (first at line 2)"),
    ],
    ids=["kind-list", "depth-10000", "5000-digits", "duplicate-key"],
)  # fmt: skip
def test_validate_crash_cases_give_one_line(tmp_path: Path, text: str, code: int, line: str | None) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    done = validate(path)
    output = (done.stdout + done.stderr).splitlines()
    assert done.returncode == code and len(output) == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    if line is not None:
        assert output == [f"{path}: {line}"]
    else:
        assert output[0].startswith(f"{path}: ") and "nest" in output[0]


def test_mixrl_run_reads_through_the_safe_loader(tmp_path: Path) -> None:
    # `mixrl run` (and `mixrl simulate`) load their file with load_rlrun: the same limits apply.
    path = tmp_path / "run.yaml"
    path.write_text(bomb(9))
    with pytest.raises(ManifestUnreadable) as info:
        loader.load_rlrun(path)
    assert str(info.value) == f"{path}: line 6: more than 100000 YAML nodes with aliases expanded"
