"""TrajectoryBuffer on a real directory: durable logs, idempotent batches, rebuild after a restart."""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path

import pytest

from mixrl.api.trajectory import Trajectory
from mixrl.rl.buffer.grouping import StepError
from mixrl.rl.buffer.store import (
    ASSIGNMENTS,
    EVALUATIONS,
    TRAJECTORIES,
    BufferLogError,
    Evaluation,
    TrajectoryBuffer,
)

from .conftest import FullDisk, group_of, make_trajectory


def served(body: bytes) -> dict:  # type: ignore[type-arg]
    return json.loads(body)


def served_keys(batch: dict) -> list[tuple[str, int]]:  # type: ignore[type-arg]
    return [(t["prompt_id"], t["sample_index"]) for g in batch["groups"] for t in g["trajectories"]]


def test_batch_returns_trajectories_exactly_as_posted_with_staleness(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, prompts_per_update=2, samples_per_prompt=2) as buffer:
        posted = [*group_of("a", 2, versions=(0, 1)), *group_of("b", 2, versions=(1, 1))]
        assert buffer.append(posted) == 2
        batch = served(buffer.batch(1).body)
    assert batch["step"] == 1
    assert [g["prompt_id"] for g in batch["groups"]] == ["a", "b"]
    trajectories = [Trajectory.model_validate(t) for g in batch["groups"] for t in g["trajectories"]]
    assert trajectories == posted
    # a: staleness 1 and 0 per trajectory; b: 0 and 0.  Batch: 8 tokens, mean (1 + 0) * 2 / 8 = 0.25.
    assert batch["groups"][0]["staleness"] == [{"tokens": 2, "min": 0, "max": 1, "mean": 0.5}] * 2
    assert batch["staleness"] == {"tokens": 8, "min": 0, "max": 1, "mean": 0.25}


def test_asking_again_for_a_step_returns_the_same_batch_even_after_restart(tmp_path: Path) -> None:
    buffer = TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2)
    buffer.append([*group_of("a", 2), *group_of("b", 2)])
    first = buffer.batch(1).body
    assert buffer.batch(1).body == first
    buffer.commit(1)
    buffer.append(group_of("c", 2))
    second = buffer.batch(2).body
    buffer.close()
    rebuilt = TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2)
    assert rebuilt.batch(1).body == first
    assert rebuilt.batch(2).body == second
    rebuilt.commit(2)
    assert served_keys(served(rebuilt.batch(3).body)) == [("c", 0), ("c", 1)]
    rebuilt.commit(3)
    assert rebuilt.batch(4) is None
    rebuilt.close()


def test_only_the_next_step_takes_a_batch_and_a_refusal_changes_nothing(tmp_path: Path) -> None:
    """A client asking for any other step (a typo, a second trainer, an attacker) derails nothing."""
    with TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=1) as buffer:
        buffer.append([make_trajectory("a"), make_trajectory("b"), make_trajectory("c")])
        logs = {name: (tmp_path / name).read_bytes() for name in (TRAJECTORIES, ASSIGNMENTS)}
        for step, message in [
            (10**18, "step 1000000000000000000 is not the trainer's next step 1 (nothing committed yet)"),
            (2, "step 2 is not the trainer's next step 1"),
            (0, "step 0: trainer steps start at 1"),
        ]:
            with pytest.raises(StepError, match=re.escape(message)):
                buffer.batch(step)
        for step in (0, 1, 10**18):
            with pytest.raises(StepError, match=f"step {step} has no batch to commit"):
                buffer.commit(step)
        assert buffer.batch(1, reserve=False) is None  # reading never takes groups
        assert {name: (tmp_path / name).read_bytes() for name in logs} == logs
        assert buffer.stats()["groups_ready"] == 3 and buffer.stats()["step"] is None
        assert served_keys(served(buffer.batch(1).body)) == [("a", 0)]  # the trainer's step 1 got the oldest
        with pytest.raises(
            StepError, match=re.escape("step 2 is not the trainer's next step 1 (nothing committed yet)")
        ):
            buffer.batch(2)  # one step at a time: step 1 is not committed yet
        buffer.commit(1)
        with pytest.raises(
            StepError, match=re.escape("step 1000 is not the trainer's next step 2 (last committed: 1)")
        ):
            buffer.batch(1000)
        with pytest.raises(StepError, match="step 0 is not after the last committed step 1 and has no batch"):
            buffer.batch(0)
        assert served_keys(served(buffer.batch(2).body)) == [("b", 0)]
        with pytest.raises(StepError, match="step 3 has no batch to commit"):
            buffer.commit(3)
        assert served(buffer.batch(2, reserve=False).body)["step"] == 2  # a read of an assigned step
    with TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=1) as buffer:
        assert buffer.state.next_step == 2  # step 2 is served but not committed
        assert served_keys(served(buffer.batch(2).body)) == [("b", 0)]
        buffer.commit(2)
        assert served_keys(served(buffer.batch(3).body)) == [("c", 0)]


def test_restart_loses_nothing_and_serves_nothing_twice(tmp_path: Path) -> None:
    """Random posts, batch requests, commits and restarts; then check every trajectory's fate."""
    rng = random.Random(7)
    prompts, samples = 3, 4
    buffer = TrajectoryBuffer(tmp_path, prompts, samples)
    posted: list[tuple[str, int]] = []
    served_by_step: dict[int, list[tuple[str, int]]] = {}
    step = 1
    for _ in range(160):
        action = rng.random()
        if action < 0.1:  # a request for some other step is refused and changes nothing
            rogue = rng.choice([step + rng.randrange(1, 10**6), rng.randrange(0, step)])
            if rogue not in served_by_step:
                with pytest.raises(StepError):
                    buffer.batch(rogue)
            if rogue > step:
                with pytest.raises(StepError):
                    buffer.commit(rogue)
        elif action < 0.6:
            prompt = f"p{rng.randrange(12)}"
            trajectory = make_trajectory(prompt, sample_index=len(posted), versions=(step,))
            buffer.append([trajectory])
            posted.append((prompt, len(posted)))
        elif action < 0.85:
            payload = buffer.batch(step)
            if payload is not None:
                keys = served_keys(served(payload.body))
                assert served_by_step.setdefault(step, keys) == keys
                if rng.random() < 0.7:
                    buffer.commit(step)
                    step += 1
        else:
            buffer.close()  # as if the process died: only the logs survive
            buffer = TrajectoryBuffer(tmp_path, prompts, samples)
            for old_step, keys in served_by_step.items():
                assert served_keys(served(buffer.batch(old_step).body)) == keys
    buffer.close()
    buffer = TrajectoryBuffer(tmp_path, prompts, samples)
    all_served = [key for keys in served_by_step.values() for key in keys]
    assert len(all_served) == len(set(all_served)), "a trajectory was served to two steps"
    waiting = [(m.prompt_id, m.seq) for members in buffer.state.partial.values() for m in members] + [
        (m.prompt_id, m.seq) for g in buffer.state.ready for m in g.members
    ]
    # Every posted trajectory is served or still waiting (sample_index == seq by construction).
    assert sorted(all_served + waiting, key=lambda k: k[1]) == posted
    assert len(served_by_step) >= 5
    assert buffer.stats()["trajectories"] == len(posted)
    buffer.close()


def test_a_torn_last_line_is_quarantined_and_earlier_lines_are_kept(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, 1, 2) as buffer:
        buffer.append(group_of("a", 2))
    log = tmp_path / TRAJECTORIES
    intact = log.read_bytes()
    torn = b'{"run": "test", "prompt_id": "b", "sam'
    with log.open("ab") as f:
        f.write(torn)  # crash in the middle of a write
    with TrajectoryBuffer(tmp_path, 1, 2) as buffer:
        assert log.read_bytes() == intact
        assert (tmp_path / (TRAJECTORIES + ".damaged")).read_bytes() == torn + b"\n"  # kept aside
        assert buffer.stats()["trajectories"] == 2
        buffer.append(group_of("b", 2))
        assert served_keys(served(buffer.batch(1).body)) == [("a", 0), ("a", 1)]
        buffer.commit(1)
        assert served_keys(served(buffer.batch(2).body)) == [("b", 0), ("b", 1)]


@pytest.mark.parametrize("name", [TRAJECTORIES, ASSIGNMENTS, EVALUATIONS])
def test_a_complete_last_record_missing_only_its_newline_is_kept(tmp_path: Path, name: str) -> None:
    with TrajectoryBuffer(tmp_path, 1, 2) as buffer:
        buffer.append(group_of("a", 2))
        batch = buffer.batch(1).body
        buffer.add_evaluation(Evaluation(step=1, weight_version=1, pass_at_k={"1": 0.5}))
    log = tmp_path / name
    log.write_bytes(log.read_bytes().removesuffix(b"\n"))
    with TrajectoryBuffer(tmp_path, 1, 2) as buffer:
        assert log.read_bytes().endswith(b"}\n")  # the newline is back: the next record starts a line
        assert buffer.batch(1).body == batch  # the trajectories and the batch are all still there
        assert buffer.stats()["trajectories"] == 2 and len(buffer.evaluations) == 1
        buffer.append(group_of("b", 2))
        buffer.add_evaluation(Evaluation(step=2, weight_version=1, pass_at_k={"1": 0.5}))
        buffer.commit(1)
    assert not (tmp_path / (name + ".damaged")).exists()
    with TrajectoryBuffer(tmp_path, 1, 2) as buffer:
        assert buffer.stats()["trajectories"] == 4 and len(buffer.evaluations) == 2
        assert buffer.stats()["committed_step"] == 1


def test_a_damaged_line_inside_a_log_is_reported_with_its_place(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, 1, 2) as buffer:
        buffer.append(group_of("a", 2))
    log = tmp_path / TRAJECTORIES
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(lines[0] + b"garbage\n")
    with pytest.raises(BufferLogError, match=r"^log .*trajectories.jsonl is damaged at line 2: not JSON"):
        TrajectoryBuffer(tmp_path, 1, 2)


TRAJECTORY = make_trajectory("a").model_dump()
BATCH = {
    "kind": "batch",
    "step": 1,
    "groups": [[0]],
    "prompt_ids": ["a"],
    "staleness": [[{"tokens": 2, "min": 1, "max": 1, "mean": 1.0}]],
}


@pytest.mark.parametrize(
    ("name", "line", "reason"),
    [
        (TRAJECTORIES, [1, 2], "expected a JSON object, got list"),
        (TRAJECTORIES, {**TRAJECTORY, "prompt_id": 7}, "prompt_id: expected a string, got 7"),
        (TRAJECTORIES, {**TRAJECTORY, "loss_mask": [1, "x"]}, "loss_mask: expected a list of integers"),
        (
            TRAJECTORIES,
            {**TRAJECTORY, "weight_version": [0]},
            "weight_version and loss_mask differ in length",
        ),
        (TRAJECTORIES, "[" * 100_000 + "]" * 100_000, "not JSON (nested too deeply)"),
        (
            ASSIGNMENTS,
            {"kind": "teleport", "step": 1},
            "kind: expected batch, drop, commit or quarantine, got 'teleport'",
        ),
        (ASSIGNMENTS, {"kind": "commit", "step": -1}, "step: expected a non-negative integer, got -1"),
        (ASSIGNMENTS, {"kind": "commit", "step": 3}, "step 3 has no batch to commit"),
        (ASSIGNMENTS, {**BATCH, "groups": "all"}, "groups: expected lists of trajectory line numbers"),
        (ASSIGNMENTS, {**BATCH, "prompt_ids": []}, "prompt_ids: expected one prompt id per group"),
        (
            ASSIGNMENTS,
            {**BATCH, "staleness": [[{}]]},
            "staleness: expected objects with max, mean, min, tokens",
        ),
        (
            ASSIGNMENTS,
            {"kind": "drop", "step": 1, "groups": [[0, 5]]},
            "names group (0, 5) that the trajectory log does not form",
        ),
        (ASSIGNMENTS, "x" * 1_000_000, "not JSON (Expecting value"),
    ],
)
def test_a_wrong_shaped_line_is_one_line_naming_the_log_and_the_line(
    tmp_path: Path, name: str, line: object, reason: str
) -> None:
    with TrajectoryBuffer(tmp_path, 1, 1) as buffer:
        buffer.append([make_trajectory("a"), make_trajectory("b")])
        buffer.batch(1)
    text = line if isinstance(line, str) else json.dumps(line)
    log = tmp_path / name
    log.write_bytes(log.read_bytes() + text.encode() + b"\n" + log.read_bytes().splitlines(keepends=True)[-1])
    number = len(log.read_bytes().splitlines()) - 1
    with pytest.raises(BufferLogError) as caught:
        TrajectoryBuffer(tmp_path, 1, 1)
    message = str(caught.value)
    assert message.startswith(f"log {log} is damaged at line {number}: {reason}"), message
    assert "\n" not in message and len(message) < 400


def test_bad_evaluation_lines_never_block_a_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with TrajectoryBuffer(tmp_path, 1, 1) as buffer:
        buffer.append([make_trajectory("a")])
        buffer.add_evaluation(Evaluation(step=0, weight_version=0, pass_at_k={"1": 0.25}))
    log = tmp_path / EVALUATIONS
    good = log.read_bytes()
    bad = [
        b"garbage",
        b"[1, 2]",
        json.dumps({"step": 1, "weight_version": 0, "pass_at_k": {"1": 7}}).encode(),
    ]
    log.write_bytes(good + b"\n".join(bad) + b"\n" + good + b'{"step": 2, "weight')  # and a torn tail
    with caplog.at_level(logging.WARNING, logger="mixrl.buffer"), TrajectoryBuffer(tmp_path, 1, 1) as buffer:
        assert [e["pass_at_k"] for e in buffer.evaluations] == [{"1": 0.25}] * 2
        assert buffer.stats()["trajectories"] == 1
        buffer.add_evaluation(Evaluation(step=3, weight_version=0, pass_at_k={"1": 0.5}))
    skipped = [r.getMessage() for r in caplog.records if "skipping line" in r.getMessage()]
    assert [m.split("skipping line ")[1].split(",")[0] for m in skipped] == ["2", "3", "4"]
    assert (tmp_path / (EVALUATIONS + ".damaged")).read_bytes() == b'{"step": 2, "weight\n'
    with TrajectoryBuffer(tmp_path, 1, 1) as buffer:
        assert [e["step"] for e in buffer.evaluations] == [0, 0, 3]


def test_logs_that_do_not_belong_together_are_refused(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, 1, 2) as buffer:
        buffer.append(group_of("a", 2))
        buffer.batch(1)
    (tmp_path / ASSIGNMENTS).write_text(json.dumps({"kind": "drop", "step": 1, "groups": [[0, 5]]}) + "\n")
    with pytest.raises(BufferLogError, match="names group"):
        TrajectoryBuffer(tmp_path, 1, 2)


def test_stale_groups_are_dropped_durably_and_counted(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2, max_staleness=0) as buffer:
        buffer.append(group_of("old", 2, versions=(0, 1)))
        buffer.append(group_of("fresh", 2, versions=(1, 1)))
        batch = served(buffer.batch(1).body)
        assert [g["prompt_id"] for g in batch["groups"]] == ["fresh"]
        stats = buffer.stats()
        assert (stats["dropped_stale"], stats["dropped_stale_trajectories"]) == (1, 2)
    with TrajectoryBuffer(tmp_path, 1, 2, max_staleness=0) as buffer:
        assert buffer.stats()["dropped_stale"] == 1  # the drop was logged
        assert buffer.stats()["groups_ready"] == 0


def test_commit_rules(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, 1, 1) as buffer:
        buffer.append(group_of("a", 1))
        with pytest.raises(StepError, match="step 1 has no batch to commit"):
            buffer.commit(1)
        buffer.batch(1)
        assert buffer.commit(1) is True
        assert buffer.commit(1) is False
        assert buffer.stats()["committed_step"] == 1
    with TrajectoryBuffer(tmp_path, 1, 1) as buffer:
        assert buffer.stats()["committed_step"] == 1
        assert buffer.commit(1) is False


def test_a_step_assigned_before_this_rule_can_only_be_read(tmp_path: Path) -> None:
    """Logs written by an older buffer may hold a far-ahead step; it is never committed by mistake."""
    with TrajectoryBuffer(tmp_path, 1, 1) as buffer:
        buffer.append([make_trajectory("a"), make_trajectory("b")])
    stray = {**BATCH, "step": 10**6}
    (tmp_path / ASSIGNMENTS).write_text(json.dumps(stray) + "\n")
    with TrajectoryBuffer(tmp_path, 1, 1) as buffer:
        assert served(buffer.batch(10**6).body)["step"] == 10**6
        with pytest.raises(
            StepError,
            match=re.escape("step 1000000 is not the step just served (1); steps are committed in order"),
        ):
            buffer.commit(10**6)
        assert served_keys(served(buffer.batch(1).body)) == [("b", 0)]
        assert buffer.commit(1) is True


def test_a_ruled_out_candidate_keeps_its_minus_infinity_through_the_log(tmp_path: Path) -> None:
    """−inf is a candidate's valid log q (the contract allows it): stored as null it poisoned the
    batch (the trainer cannot read it) and the log (the buffer refused to restart on it)."""
    posted = group_of("a", 2)
    for trajectory in posted:
        trajectory.cand_logprobs[0][1] = float("-inf")
    with TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2) as buffer:
        assert buffer.append(posted) == 1
        assert buffer.append(posted) == 0  # a retry is still recognised as the same content
        assert buffer.duplicates == 2
        first = buffer.batch(1).body
    trajectories = [Trajectory.model_validate(t) for g in served(first)["groups"] for t in g["trajectories"]]
    assert trajectories == posted
    with TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2) as rebuilt:
        assert rebuilt.batch(1).body == first


@pytest.mark.parametrize("log_name", ["_traj_log", "_assign_log"])
def test_a_write_the_disk_cut_short_leaves_no_torn_line_inside_the_log(tmp_path: Path, log_name: str) -> None:
    """A write that failed (a full disk) was never acknowledged; its half line must not stay in the
    log, where the next record would be glued to it and every later restart refused the log."""
    with TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2) as buffer:
        buffer.append(group_of("a", 2))
        real = getattr(buffer, log_name)
        setattr(buffer, log_name, FullDisk(real))
        with pytest.raises(OSError, match="No space left"):
            if log_name == "_traj_log":
                buffer.append(group_of("b", 2))
            else:
                buffer.batch(1)
        setattr(buffer, log_name, real)  # space again
        first = buffer.batch(1).body  # read while the cut bytes were there: none may linger
        assert buffer.append(group_of("b", 2)) == 1
        buffer.commit(1)
        second = buffer.batch(2).body
        assert served_keys(served(second)) == [("b", 0), ("b", 1)]
        assert [Trajectory.model_validate(t) for t in served(second)["groups"][0]["trajectories"]] == (
            group_of("b", 2)
        )
    with TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2) as rebuilt:
        assert rebuilt.batch(1).body == first
        assert rebuilt.batch(2).body == second
        assert rebuilt.stats()["trajectories"] == 4


def test_a_write_the_disk_refused_counts_nothing_until_its_retry_holds(tmp_path: Path) -> None:
    """The batches, staleness and duplicates counted for a write that failed were counted again on
    its retry: the figures of one batch twice."""
    with TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2) as buffer:
        buffer.append(group_of("a", 2))
        real_assign, real_traj = buffer._assign_log, buffer._traj_log
        buffer._assign_log = FullDisk(real_assign)
        with pytest.raises(OSError, match="No space left"):
            buffer.batch(1)
        buffer._traj_log = FullDisk(real_traj)
        with pytest.raises(OSError, match="No space left"):
            buffer.append([*group_of("a", 2), *group_of("b", 2)])  # two already stored, two new
        assert (buffer.telemetry.batches, buffer.duplicates) == (0, 0)
        assert not buffer.telemetry.staleness_tokens
        buffer._assign_log, buffer._traj_log = real_assign, real_traj  # space again
        buffer.batch(1)
        buffer.append([*group_of("a", 2), *group_of("b", 2)])
        assert (buffer.telemetry.batches, buffer.duplicates) == (1, 2)
        with TrajectoryBuffer(tmp_path / "clean", prompts_per_update=1, samples_per_prompt=2) as clean:
            clean.append(group_of("a", 2))
            clean.batch(1)
            assert buffer.telemetry.staleness_tokens == clean.telemetry.staleness_tokens
