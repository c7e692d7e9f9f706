"""Fuzzing the buffer's door (issue #27): generated trajectories posted to a real ``mixrl buffer``
process, then everything it acknowledged trained by a real ``mixrl trainer`` process.

The seed corpus is valid groups of two sampled from the tiny model itself; each case takes one,
gives it a prompt id of its own and sets one field of one trajectory (or one entry of a per-token
column, or one candidate) to anything JSON can carry, NaN and infinities included, or deletes it,
or adds a field.  Every post must get 200, or 400/409 with one line naming the trajectory and its
field (``trajectories[i].field…`` or ``body: …``); never a 500 or a dropped connection.  Then the
trainer trains one step per full group the buffer acknowledged: it must finish with exit code 0,
quarantine nothing (the door let nothing untrainable in: the buffer reads the model's vocabulary
from ``--model-path``), and every acknowledged trajectory is either trained in exactly one step
or still waiting for its group's partner (refused): nothing acknowledged is lost.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.api.trajectory import Trajectory
from mixrl.rl.tiny_models import load_model

from ..api.conftest import ROOT
from ..trainer.conftest import VOCAB, synthetic_group
from ..trainer.conftest import tiny_model_dir as tiny_model_dir
from .conftest import FUZZ, tally

COUNTS = tally("trajectory door")
COUNTS.update({"crashes": 0, "data lost": 0, "quarantined": 0})
ONE_LINE = re.compile(r"^(trajectories\[\d+\](\.\w+)?[\[\]\d.\w]*: |body: )\S")
FIELDS = list(Trajectory.model_fields)
COLUMNS = ["prompt_ids", "tokens", "loss_mask", "logprobs", "cand_ids", "cand_logprobs", "support_size",
           "weight_version"]  # fmt: skip


def run_config(tmp_path: Path, total_steps: int) -> ResolvedRun:
    """The quickstart with one group of two per step, its weights under ``tmp_path``."""
    run = resolve(load_rlrun(ROOT / "examples" / "quickstart.yaml"))
    spec = run.trainer.spec.model_copy(update={"total_steps": total_steps, "checkpoint_every": 1000})
    trainer = run.trainer.model_copy(update={"spec": spec, "prompts_per_update": 1, "samples_per_prompt": 2})
    weights = run.weights.model_copy(update={"store": str(tmp_path / "weights")})
    return run.model_copy(update={"trainer": trainer, "weights": weights})


class Buffer:
    """``mixrl buffer`` as a child process on loopback."""

    def __init__(self, tmp_path: Path, model_dir: Path) -> None:
        config = tmp_path / "buffer-run.json"
        config.write_text(run_config(tmp_path, total_steps=1).model_dump_json())
        port_file = tmp_path / "buffer.port"
        self.log = (tmp_path / "buffer.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mixrl.cli", "buffer", "--config", str(config), "--dir", str(tmp_path / "logs"),
             "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
             "--insecure-no-auth"],
            stdout=subprocess.DEVNULL, stderr=self.log,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            assert self.process.poll() is None, (tmp_path / "buffer.log").read_text()
            assert time.monotonic() < deadline, "the buffer did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text().strip()}"

    def post(self, body: bytes) -> tuple[int, Any]:
        request = urllib.request.Request(
            f"{self.url}/trajectories", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as refused:
            return refused.code, json.loads(refused.read())

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=30) as answer:
            return dict(json.loads(answer.read()))


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[tuple[Buffer, Path]]:
    where = tmp_path_factory.mktemp("door")
    buffer = Buffer(where, tiny_model_dir)
    try:
        yield buffer, where
    finally:
        buffer.process.terminate()
        buffer.process.wait(timeout=30)
        buffer.log.close()


@pytest.fixture(scope="module")
def seeds(tiny_model_dir: Path) -> list[list[dict[str, Any]]]:
    model = load_model(tiny_model_dir)
    run = load_rlrun(ROOT / "examples" / "quickstart.yaml").metadata.name
    with torch.no_grad():
        groups = [
            synthetic_group(model, "seed", 2, pool="bf16", seed=i, top_k=4 * (i % 2), run=run)
            for i in range(4)
        ]
    return [[t.model_dump(mode="json") for t in group] for group in groups]


anything = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), 2**63), st.integers(-3, VOCAB + 3),
        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
    max_leaves=6,
)  # fmt: skip


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, int, str, Any, str]:
    """(seed group, trajectory, field, value, how): how is set, entry, candidate, delete, extra or none."""
    how = draw(st.sampled_from(["set", "entry", "entry", "candidate", "delete", "extra", "none"]))
    field = draw(st.sampled_from(COLUMNS if how in ("entry", "candidate") else FIELDS))
    return draw(st.integers(0, 3)), draw(st.integers(0, 1)), field, draw(anything), how


def mutated(seed: list[dict[str, Any]], case: int, trajectory: int, field: str, value: Any, how: str, at: int) -> list[dict[str, Any]]:  # fmt: skip
    group = copy.deepcopy(seed)
    for t in group:
        t["prompt_id"] = f"case-{case}"
    target = group[trajectory]
    if how == "set":
        target[field] = value
    elif how == "entry" and target[field]:
        target[field][at % len(target[field])] = value
    elif how == "candidate":
        rows = [row for row in target[field] if isinstance(row, list) and row]
        if rows:
            row = rows[at % len(rows)]
            row[at % len(row)] = value
    elif how == "delete":
        target.pop(field, None)
    elif how == "extra":
        target[f"x{at}"] = value
    return group


CASE_NUMBER = iter(range(10**9))


# 200: each case is one real HTTP post to the buffer process (a few ms); the 8 fields and 8 columns,
# each set whole, one entry or one candidate at a time, get about a dozen draws each (~10 s).
@settings(FUZZ, max_examples=200)
@given(case=cases(), at=st.integers(0, 40))
def test_any_trajectory_gets_an_answer_or_one_line(
    door: tuple[Buffer, Path],
    seeds: list[list[dict[str, Any]]],
    case: tuple[int, int, str, Any, str],
    at: int,
) -> None:
    buffer, _ = door
    number = next(CASE_NUMBER)
    body = json.dumps(mutated(seeds[case[0]], number, *case[1:], at=at)).encode()  # NaN goes out as NaN
    COUNTS["cases"] += 1
    try:
        status, answer = buffer.post(body)
    except (OSError, ValueError) as exc:  # a dropped connection or a body that is not JSON
        COUNTS["crashes"] += 1
        raise AssertionError(f"no answer to case {number}: {exc}") from exc
    if status == 200:
        COUNTS["accepted"] += 1
        return
    assert status in (400, 409), (status, answer)
    COUNTS["clear errors"] += 1
    message = answer["error"]
    assert "\n" not in message and ONE_LINE.match(message), message


def test_everything_acknowledged_trains_and_nothing_is_lost_or_quarantined(
    door: tuple[Buffer, Path], tiny_model_dir: Path
) -> None:
    buffer, where = door
    before = buffer.stats()
    steps = before["groups_ready"]
    assert steps >= 10, before  # enough of the fuzzed groups were valid to train on
    config = where / "trainer-run.json"
    config.write_text(run_config(where, total_steps=steps).model_dump_json())
    trainer = subprocess.run(
        [sys.executable, "-m", "mixrl.cli", "trainer", "--config", str(config), "--buffer", buffer.url,
         "--run-dir", str(where / "run"), "--model-path", str(tiny_model_dir), "--insecure-no-auth"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    after = buffer.stats()
    COUNTS["quarantined"] += len(after["quarantined"])
    assert after["quarantined"] == [] and after["committed_step"] == steps, after
    trained = 2 * steps
    waiting = after["trajectories_waiting"]
    lost = after["trajectories"] - trained - waiting
    COUNTS["data lost"] += lost
    assert lost == 0 and waiting == after["groups_partial"], after  # a partial group waits for its partner
    lines = (where / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, steps + 1))
