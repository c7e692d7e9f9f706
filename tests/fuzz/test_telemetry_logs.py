"""Fuzzing the telemetry logs a resume reads: they never block it, and lose no good record.

- ``evaluations.jsonl`` in the buffer's directory (held-out results): the buffer starts whatever
  its lines hold, and keeps exactly the lines that are evaluation records, in order.
- ``metrics.jsonl`` (and the run directory's ``evaluations.jsonl``) as ``mixrl run`` reads them
  for its progress lines (:func:`mixrl.local.report.read_jsonl`, ``step_records``,
  :class:`mixrl.local.run.Progress`): no exception, and every good record is read.
- ``metrics.jsonl`` as the trainer's resume rewrites it
  (:meth:`mixrl.rl.trainer.main.TrainerLoop.forget_metrics_after`): no exception; the good records
  of later steps are dropped, every other line is kept byte for byte, and the file ends with a
  newline, so the next step's record (appended next) is read back.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from mixrl.local.report import pass_at_k, pool_series, read_jsonl, series, step_records, summary, write_report
from mixrl.local.run import Progress
from mixrl.rl.buffer.store import EVALUATIONS, Evaluation, TrajectoryBuffer
from mixrl.rl.trainer.main import METRICS, TrainerLoop

from .conftest import FUZZ, any_json, tally

COUNTS = tally("telemetry logs")
COUNTS.update({"crashes": 0, "data lost": 0})


# ----------------------------------------------------------------------------- lines


def good_metrics(step: int) -> bytes:
    return json.dumps({"step": step, "reward": 0.5, "kl_k3": 0.01, "tokens_per_s": 10.0}).encode()


def good_evaluation(step: int) -> bytes:
    return json.dumps({"step": step, "weight_version": step, "pass_at_k": {"1": 0.25}}).encode()


json_garbage = any_json(max_text=8, max_leaves=8)
odd_values = st.sampled_from(
    [None, True, "3", "high", 1e400, float("nan"), -1, 2**70, [], {}, [1], {"1": "most"}]
)
bad_lines = st.one_of(
    st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"")),
    json_garbage.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {},
        optional={
            "step": odd_values,
            "weight_version": odd_values,
            "pass_at_k": odd_values,
            "reward": odd_values,
            "elapsed": odd_values,
            "pools": odd_values,
        },
    ).map(lambda v: json.dumps(v).encode()),
    st.sampled_from(
        [b"", b"[" * 100_000, b'{"step": 1e400}', b'{"step": Infinity}', b"\xff\xfe", b"\r", b"x" * 2_000_000]
    ),
)


@st.composite
def telemetry_log(draw: st.DrawFn, good: Any) -> tuple[bytes, list[tuple[int, bytes]]]:
    """A log of good records (step, line) mixed with bad lines, perhaps ending without a newline.

    Returns the file's bytes and its good records in order (a good record that ends the file
    without its newline counts as good: it is whole).
    """
    lines: list[bytes] = []
    records: list[tuple[int, bytes]] = []
    for _ in range(draw(st.integers(0, 8))):
        if draw(st.booleans()):
            step = draw(st.integers(0, 9))
            lines.append(good(step))
            records.append((step, lines[-1]))
        else:
            lines.append(draw(bad_lines))
    data = b"".join(line + b"\n" for line in lines)
    ending = draw(st.sampled_from(["newline", "no final newline", "torn last line"]))
    if ending == "no final newline" and lines:
        data = data[:-1]
    elif ending == "torn last line":
        data += draw(bad_lines)
    return data, records


def quietly(action: Any) -> Any:
    """Run ``action`` with stdout and stderr captured (progress lines and one warning per bad line)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return action()


def counted(action: Any) -> Any:
    COUNTS["cases"] += 1
    try:
        return action()
    except Exception:
        COUNTS["crashes"] += 1
        raise


# ----------------------------------------------------------------------------- tests


# 150: logs of 0-8 lines, good and bad mixed, x 3 endings (newline, none, torn): ~6 cases per
# (length, ending) pair, each of the bad-line kinds many times; 1.5-3.5 s in process.
@settings(FUZZ, max_examples=150)
@given(telemetry_log(good_evaluation))
def test_the_buffer_starts_whatever_its_evaluation_log_holds(
    log: tuple[bytes, list[tuple[int, bytes]]],
) -> None:
    data, records = log
    with tempfile.TemporaryDirectory(prefix="fuzz-evaluations-") as temporary:
        directory = Path(temporary)
        (directory / EVALUATIONS).write_bytes(data)
        buffer = counted(lambda: TrajectoryBuffer(directory, 1, 1))
        with buffer:
            steps = [e["step"] for e in buffer.evaluations]
            buffer.add_evaluation(Evaluation(step=99, weight_version=1, pass_at_k={"1": 1.0}))
        with TrajectoryBuffer(directory, 1, 1) as again:  # what was appended after it is read back
            assert [e["step"] for e in again.evaluations] == [*steps, 99]
    good = [step for step, _ in records]
    if [s for s in steps if s in good] != good:  # (a bad line may still be a valid evaluation)
        COUNTS["data lost"] += 1
        raise AssertionError(f"evaluations read {steps}, the log held {good}")
    COUNTS["accepted"] += 1


# 150: logs of 0-8 lines, good and bad mixed, x 3 endings (newline, none, torn): ~6 cases per
# (length, ending) pair, each of the bad-line kinds many times; 1.5-3.5 s in process.
@settings(FUZZ, max_examples=150)
@given(telemetry_log(good_metrics), telemetry_log(good_evaluation))
def test_progress_lines_read_whatever_the_run_logs_hold(
    metrics: tuple[bytes, list[tuple[int, bytes]]], evaluations: tuple[bytes, list[tuple[int, bytes]]]
) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-run-") as temporary:
        run_dir = Path(temporary)
        (run_dir / METRICS).write_bytes(metrics[0])
        (run_dir / "evaluations.jsonl").write_bytes(evaluations[0])
        counted(lambda: quietly(lambda: Progress(run_dir, total_steps=10).update(force=True)))
        for name, (_, records) in ((METRICS, metrics), ("evaluations.jsonl", evaluations)):
            read = quietly(lambda name=name: read_jsonl(run_dir / name))
            wanted = [json.loads(line) for _, line in records]
            if [r for r in read if r in wanted] != wanted:
                COUNTS["data lost"] += 1
                raise AssertionError(f"{name}: read {read}, the log held {wanted}")
            assert all(
                isinstance(r["step"], int) for r in quietly(lambda name=name: step_records(run_dir / name))
            )
    COUNTS["accepted"] += 1


# 150: logs of 0-8 lines, good and bad mixed, x 3 endings (newline, none, torn): ~6 cases per
# (length, ending) pair, each of the bad-line kinds many times; 1.5-3.5 s in process.
@settings(FUZZ, max_examples=150)
@given(telemetry_log(good_metrics), st.integers(0, 9))
def test_the_trainer_resumes_whatever_its_metrics_log_holds(
    metrics: tuple[bytes, list[tuple[int, bytes]]], checkpoint_step: int
) -> None:
    data, records = metrics
    with tempfile.TemporaryDirectory(prefix="fuzz-trainer-") as temporary:
        run_dir = Path(temporary)
        path = run_dir / METRICS
        path.write_bytes(data)
        # The method itself, on a stand-in for the loop: it reads nothing of it but run_dir.
        loop: Any = SimpleNamespace(run_dir=run_dir)
        counted(lambda: TrainerLoop.forget_metrics_after(loop, checkpoint_step))
        after = path.read_bytes()
        good = {line for _, line in records}
        expected = [
            line
            for line in data.splitlines(True)
            if line.rstrip(b"\r\n") not in good or json.loads(line)["step"] <= checkpoint_step
        ]
        assert after.rstrip(b"\n") == b"".join(expected).rstrip(b"\n"), "lines changed or lost"
        assert not after or after.endswith(b"\n"), "the next step's line would join a torn one"
        with path.open("ab") as log:
            log.write(good_metrics(checkpoint_step + 1) + b"\n")
        read = quietly(lambda: step_records(path))
        if not read or read[-1]["step"] != checkpoint_step + 1:
            COUNTS["data lost"] += 1
            raise AssertionError("the record appended after the resume is not read back")
    COUNTS["accepted"] += 1


# ----------------------------------------------------------------------------- the report

REPORT_KEYS = ("reward", "kl_k3", "extreme_ratio", "tokens_per_s", "elapsed", "staleness_mean", "grad_norm")
odd_records = st.fixed_dictionaries(
    {"step": st.integers(0, 50)},
    optional={
        **{key: st.one_of(odd_values, json_garbage) for key in REPORT_KEYS},
        "pools": st.one_of(
            odd_values, st.dictionaries(st.text(max_size=4), st.one_of(odd_values, json_garbage))
        ),
        "pass_at_k": st.one_of(odd_values, st.dictionaries(st.text(max_size=3), odd_values)),
    },
)


# 150: logs of 0-8 lines, good and bad mixed, x 3 endings (newline, none, torn): ~6 cases per
# (length, ending) pair, each of the bad-line kinds many times; 1.5-3.5 s in process.
@settings(FUZZ, max_examples=150)
@given(metrics=st.lists(odd_records, max_size=8), evaluations=st.lists(odd_records, max_size=4))
def test_the_reports_figures_take_whatever_records_hold(
    metrics: list[dict[str, Any]], evaluations: list[dict[str, Any]]
) -> None:
    COUNTS["cases"] += 1
    figures = summary(metrics, evaluations)
    assert figures["steps"] == (metrics[-1]["step"] if metrics else 0)
    assert all(isinstance(v, int | float | type(None)) for v in figures.values())
    for key in REPORT_KEYS:
        steps, values = series(metrics, key)
        assert len(steps) == len(values) and all(isinstance(v, float) for v in values)
        for pool_steps, pool_values in pool_series(metrics, key).values():
            assert len(pool_steps) == len(pool_values)
    for evaluation in evaluations:
        assert all(k.isdigit() and isinstance(v, float) for k, v in pass_at_k(evaluation).items())


def test_a_report_is_written_from_damaged_records(tmp_path: Path) -> None:
    lines = [
        {"step": 1, "reward": "high", "pools": []},
        {"step": 2, "reward": 0.5, "kl_k3": [1], "pools": {"fp8": {"kl_k3": "big"}, "bf16": 3}},
        {"step": 3, "reward": 0.75, "pools": {"fp8": {"reward": 0.5}}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    evaluations = [
        {"step": 1, "pass_at_k": [1]},
        {"step": 2, "pass_at_k": {"1": 0.5, "x": 1, "2": "most", "²": 0.3}},
    ]
    (tmp_path / "evaluations.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evaluations))
    write_report(tmp_path)
    figures = json.loads((tmp_path / "summary.json").read_text())
    assert figures["steps"] == 3 and figures["pass@1_last"] == 0.5
    assert (tmp_path / "report.png").stat().st_size > 0
