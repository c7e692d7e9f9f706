"""Fuzzing the buffer's logs on start (mixrl/rl/buffer/store.py): damaged files are loaded or
refused in one line, and no complete record is ever lost.

A real buffer directory is made once: 9 trajectories in 4 full groups and a partial one, step 1
batched and committed, step 2 batched (its last group ends the trajectory log), two held-out
evaluations.  Each case copies it, damages one or two of its logs (a torn last write, a missing
final newline, binary garbage, wrong-shaped records, inserted or duplicated lines, a line of
megabytes), and starts a :class:`TrajectoryBuffer` on it.  Either:

- it loads: every newline-terminated line of each damaged log is still there, byte for byte; an
  unterminated last line is kept (its newline added) or moved to ``<log>.damaged``, and it is
  never cut when it is a complete record of the original log; every batch it serves is one the
  trainer can read (``Batch.from_json``); when the trajectory and assignment
  logs still begin with their original content, steps 1 and 2 are served exactly as before;
- or it refuses with ``BufferLogError``: one line, ``log <file> is damaged at line N: <reason>``,
  with the same guarantee for what stays on disk, and never because of the evaluation log alone
  (telemetry never blocks a start).

Any other exception is a crash.  Starting a second time gives the same outcome and changes no file.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixrl.rl.buffer.client import Batch
from mixrl.rl.buffer.store import (
    ASSIGNMENTS,
    DAMAGED_SUFFIX,
    EVALUATIONS,
    TRAJECTORIES,
    BufferLogError,
    Evaluation,
    TrajectoryBuffer,
)

from ..buffer.conftest import group_of
from .conftest import FUZZ, any_json, tally

LOGS = (TRAJECTORIES, ASSIGNMENTS, EVALUATIONS)
SIZES = {"prompts_per_update": 2, "samples_per_prompt": 2}
DAMAGED_LINE = re.compile(r"log (?P<path>\S+) is damaged at line (?P<line>\d+): \S.*")
COUNTS = tally("buffer logs")
COUNTS.update({"crashes": 0, "data lost": 0})


class Original:
    """The undamaged directory: its files, and what steps 1 and 2 serve."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files = {name: (directory / name).read_bytes() for name in LOGS}
        self.lines = {name: self.files[name].split(b"\n")[:-1] for name in LOGS}
        with TrajectoryBuffer(directory, **SIZES) as buffer:
            self.batches = {step: served(buffer, step) for step in (1, 2)}
            self.evaluations = list(buffer.evaluations)


def served(buffer: TrajectoryBuffer, step: int) -> bytes:
    payload = buffer.batch(step, reserve=False)
    assert payload is not None, f"step {step} has no batch"
    return payload.body


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Original:
    directory = tmp_path_factory.mktemp("buffer")
    with TrajectoryBuffer(directory, **SIZES) as buffer:
        for prompt in ("a", "b", "c"):
            buffer.append(group_of(prompt, 2))
        buffer.append(group_of("partial", 1))
        buffer.append(group_of("d", 2))  # its group is batched at step 2 and ends the log
        assert buffer.batch(1) is not None
        assert buffer.commit(1)
        assert buffer.batch(2) is not None
        for step in (1, 2):
            buffer.add_evaluation(Evaluation(step=step, weight_version=step, pass_at_k={"1": 0.5}))
    return Original(directory)


# ----------------------------------------------------------------------------- damage


awkward = st.one_of(
    st.sampled_from(
        [None, True, -1, 2**64, 10**30, 1.5, float("inf"), "", "x", [], {}, [[]], [[-1]], [[999]]]
    ),
    st.text(max_size=6),
    st.lists(st.integers(-2, 20), max_size=3),
)
json_garbage = any_json(max_text=8, max_leaves=8)


@st.composite
def wrong_shape(draw: st.DrawFn, lines: list[bytes]) -> bytes:
    """An original record with one field (or one item of a list field) replaced, or dropped."""
    record: dict[str, Any] = json.loads(draw(st.sampled_from(lines)))
    key = draw(st.sampled_from(sorted(record)))
    choice = draw(st.sampled_from(["replace", "drop", "item"]))
    if choice == "drop":
        del record[key]
    elif choice == "item" and isinstance(record[key], list) and record[key]:
        index = draw(st.integers(0, len(record[key]) - 1))
        record[key][index] = draw(awkward)
    else:
        record[key] = draw(awkward)
    return json.dumps(record).encode()


def garbage_lines(lines: list[bytes]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=80).map(lambda b: b.replace(b"\n", b"")),
        json_garbage.map(lambda v: json.dumps(v).encode()),
        wrong_shape(lines),
        st.sampled_from(
            [
                b"",
                b"\x00" * 16,
                b"\xff\xfe\xfd",
                b"[" * 100_000,
                b"x" * 3_000_000,
                b'{"prompt_id": "' + b"y" * 3_000_000 + b'"}',
                b"1e400",
                b"NaN",
            ]
        ),
    )


@st.composite
def damage(draw: st.DrawFn, name: str, data: bytes) -> bytes:
    """``data`` (a log's bytes) damaged in one to three ways; never left unchanged."""
    lines = data.split(b"\n")[:-1]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(
                ["drop final newline", "cut", "append", "replace line", "insert line", "flip", "duplicate"]
            )
        )
        if kind == "drop final newline" and data.endswith(b"\n"):
            data = data[:-1]
        elif kind == "cut" and data:
            data = data[: draw(st.integers(0, len(data) - 1))]
        elif kind == "flip" and data:
            at = draw(st.integers(0, len(data) - 1))
            data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
        else:
            rows = data.split(b"\n")
            line = draw(garbage_lines(lines))
            if kind == "duplicate" and lines:
                line = draw(st.sampled_from(lines))
            if kind == "replace line" and len(rows) > 1:
                rows[draw(st.integers(0, len(rows) - 2))] = line
            elif kind in ("insert line", "duplicate"):
                rows.insert(draw(st.integers(0, len(rows) - 1)), line)
            else:  # append, terminated or not
                rows[-1] += line
                if draw(st.booleans()):
                    rows.append(b"")
            data = b"\n".join(rows)
    return data


@st.composite
def damaged_logs(draw: st.DrawFn, files: dict[str, bytes]) -> dict[str, bytes]:
    """One or two of the logs damaged (the others as they were); at least one differs."""
    names = draw(st.lists(st.sampled_from(LOGS), min_size=1, max_size=2, unique=True))
    out = dict(files)
    for name in names:
        out[name] = draw(damage(name, files[name]))
    if out == files:
        out[names[0]] = files[names[0]] + b"\n"  # an empty line: damage all the same
    return out


# ----------------------------------------------------------------------------- the property


def written(directory: Path, logs: dict[str, bytes]) -> None:
    for name, data in logs.items():
        (directory / name).write_bytes(data)


def on_disk(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def start(directory: Path) -> TrajectoryBuffer | BufferLogError:
    try:
        return TrajectoryBuffer(directory, **SIZES)
    except BufferLogError as exc:
        return exc
    except Exception:
        COUNTS["crashes"] += 1
        raise


def nothing_complete_lost(
    name: str, damaged_data: bytes, after: dict[str, bytes], original: Original
) -> None:
    """Every terminated line is kept; the unterminated last one is kept or quarantined (never cut
    when it is a complete record of the original log)."""
    now = after.get(name, b"")
    side = after.get(name + DAMAGED_SUFFIX)
    tail = damaged_data[damaged_data.rfind(b"\n") + 1 :]
    head = damaged_data[: len(damaged_data) - len(tail)]
    if not tail or now == damaged_data:
        kept = now == damaged_data and side is None  # nothing to repair, or not read (refused before)
    elif now == damaged_data + b"\n":
        kept = side is None
    else:
        kept = now == head and side == tail + b"\n" and tail not in original.lines[name]
    if not kept:
        COUNTS["data lost"] += 1
        raise AssertionError(f"{name}: a record was lost or changed on start (side file {side is not None})")
    if side is not None:
        COUNTS["last lines quarantined"] += 1
    elif tail and now == damaged_data + b"\n":
        COUNTS["unterminated records kept"] += 1


def outcome(result: TrajectoryBuffer | BufferLogError) -> str:
    if isinstance(result, BufferLogError):
        return str(result)
    result.close()
    return "loaded"


# 300: each case damages the logs in several places (truncation, bit flips, junk lines, lost
# files) over a few hundred records; cheap in process (~6 s), so many combinations.
@settings(FUZZ, max_examples=300)
@given(st.data())
def test_damaged_logs_load_or_give_one_line_and_lose_no_record(
    original: Original, data: st.DataObject
) -> None:
    logs = data.draw(damaged_logs(original.files))
    COUNTS["cases"] += 1
    with tempfile.TemporaryDirectory(prefix="fuzz-buffer-") as temporary:
        directory = Path(temporary)
        written(directory, logs)
        result = start(directory)
        verdict = str(result) if isinstance(result, BufferLogError) else "loaded"
        after = on_disk(directory)
        for name in LOGS:
            nothing_complete_lost(name, logs[name], after, original)
        if isinstance(result, BufferLogError):
            message = str(result)
            match = DAMAGED_LINE.fullmatch(message)
            assert match and "\n" not in message and len(message) <= 600, message
            path = Path(match["path"])
            assert path.parent == directory and path.name in (TRAJECTORIES, ASSIGNMENTS), message
            assert 1 <= int(match["line"]) <= after[path.name].count(b"\n") + 1, message
            assert any(logs[name] != original.files[name] for name in (TRAJECTORIES, ASSIGNMENTS)), (
                f"the evaluation log alone stopped the start: {message}"
            )
            COUNTS["clear errors"] += 1
        else:
            with result:
                for step in result.state.assigned:  # what it serves, the trainer can read
                    Batch.from_json(json.loads(served(result, step)))
                intact = all(
                    after[name].startswith(original.files[name]) for name in (TRAJECTORIES, ASSIGNMENTS)
                )
                if intact:
                    assert {step: served(result, step) for step in (1, 2)} == original.batches
                    assert 1 in result.state.committed
                    COUNTS["batches served as before"] += 1
                if after[EVALUATIONS].startswith(original.files[EVALUATIONS]):
                    assert result.evaluations[: len(original.evaluations)] == original.evaluations
            COUNTS["accepted"] += 1
        # A second start finds nothing more to repair and reaches the same verdict.
        assert outcome(start(directory)) == verdict
        assert on_disk(directory) == after


def test_a_missing_final_newline_keeps_the_batched_trajectory(original: Original, tmp_path: Path) -> None:
    """The case issue #14 found by hand: the log's last record lacks only its newline."""
    shutil.copytree(original.directory, tmp_path / "buffer")
    log = tmp_path / "buffer" / TRAJECTORIES
    log.write_bytes(original.files[TRAJECTORIES][:-1])
    with TrajectoryBuffer(tmp_path / "buffer", **SIZES) as buffer:
        assert served(buffer, 2) == original.batches[2]
    assert log.read_bytes() == original.files[TRAJECTORIES]
    assert not log.with_name(TRAJECTORIES + DAMAGED_SUFFIX).exists()


def test_a_trajectory_the_trainer_cannot_read_is_refused_at_start(original: Original, tmp_path: Path) -> None:
    """Found by the fuzzing above: a line right in the fields grouping reads but wrong elsewhere
    used to load, and its batch then failed in the trainer (``Batch.from_json``) on every retry."""
    shutil.copytree(original.directory, tmp_path / "buffer")
    log = tmp_path / "buffer" / TRAJECTORIES
    lines = original.lines[TRAJECTORIES]
    record = json.loads(lines[2])
    record["reward"] = "lots"
    damaged_log = b"\n".join([*lines[:2], json.dumps(record).encode(), *lines[3:]]) + b"\n"
    log.write_bytes(damaged_log)
    with pytest.raises(BufferLogError) as caught:
        TrajectoryBuffer(tmp_path / "buffer", **SIZES)
    assert str(caught.value).startswith(f"log {log} is damaged at line 3: reward: "), caught.value
    assert log.read_bytes() == damaged_log  # refused, and nothing rewritten
