"""TrajectoryBuffer on a real directory: durable logs, idempotent batches, rebuild after a restart."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mixrl.api.trajectory import Trajectory
from mixrl.rl.buffer.grouping import StepError
from mixrl.rl.buffer.store import ASSIGNMENTS, TRAJECTORIES, BufferLogError, TrajectoryBuffer

from .conftest import group_of, make_trajectory


def served(body: bytes) -> dict:  # type: ignore[type-arg]
    return json.loads(body)


def served_keys(batch: dict) -> list[tuple[str, int]]:  # type: ignore[type-arg]
    return [(t["prompt_id"], t["sample_index"]) for g in batch["groups"] for t in g["trajectories"]]


def test_batch_returns_trajectories_exactly_as_posted_with_staleness(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, prompts_per_update=2, samples_per_prompt=2) as buffer:
        posted = [*group_of("a", 2, versions=(3, 5)), *group_of("b", 2, versions=(4, 4))]
        assert buffer.append(posted) == 2
        batch = served(buffer.batch(6).body)
    assert batch["step"] == 6
    assert [g["prompt_id"] for g in batch["groups"]] == ["a", "b"]
    trajectories = [Trajectory.model_validate(t) for g in batch["groups"] for t in g["trajectories"]]
    assert trajectories == posted
    # a: staleness 3 and 1 per trajectory; b: 2 and 2.  Batch: 8 tokens, mean (3+1)*2/8 + 2*4/8 = 2.0.
    assert batch["groups"][0]["staleness"] == [{"tokens": 2, "min": 1, "max": 3, "mean": 2.0}] * 2
    assert batch["staleness"] == {"tokens": 8, "min": 1, "max": 3, "mean": 2.0}


def test_asking_again_for_a_step_returns_the_same_batch_even_after_restart(tmp_path: Path) -> None:
    buffer = TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2)
    buffer.append([*group_of("a", 2), *group_of("b", 2)])
    first = buffer.batch(0).body
    assert buffer.batch(0).body == first
    buffer.append(group_of("c", 2))
    second = buffer.batch(1).body
    buffer.close()
    rebuilt = TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2)
    assert rebuilt.batch(0).body == first
    assert rebuilt.batch(1).body == second
    assert served_keys(served(rebuilt.batch(2).body)) == [("c", 0), ("c", 1)]
    assert rebuilt.batch(3) is None
    rebuilt.close()


def test_restart_loses_nothing_and_serves_nothing_twice(tmp_path: Path) -> None:
    """Random posts, batch requests, commits and restarts; then check every trajectory's fate."""
    rng = random.Random(7)
    prompts, samples = 3, 4
    buffer = TrajectoryBuffer(tmp_path, prompts, samples)
    posted: list[tuple[str, int]] = []
    served_by_step: dict[int, list[tuple[str, int]]] = {}
    step = 0
    for _ in range(120):
        action = rng.random()
        if action < 0.6:
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


def test_a_torn_last_line_is_cut_and_earlier_lines_are_kept(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, 1, 2) as buffer:
        buffer.append(group_of("a", 2))
    log = tmp_path / TRAJECTORIES
    intact = log.read_bytes()
    with log.open("ab") as f:
        f.write(b'{"run": "test", "prompt_id": "b", "sam')  # crash in the middle of a write
    with TrajectoryBuffer(tmp_path, 1, 2) as buffer:
        assert log.read_bytes() == intact
        assert buffer.stats()["trajectories"] == 2
        buffer.append(group_of("b", 2))
        assert served_keys(served(buffer.batch(0).body)) == [("a", 0), ("a", 1)]
        assert served_keys(served(buffer.batch(1).body)) == [("b", 0), ("b", 1)]


def test_a_damaged_line_inside_a_log_is_reported_with_its_place(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, 1, 2) as buffer:
        buffer.append(group_of("a", 2))
    log = tmp_path / TRAJECTORIES
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(lines[0] + b"garbage\n")
    with pytest.raises(BufferLogError, match=r"trajectories.jsonl: line 2 is not JSON"):
        TrajectoryBuffer(tmp_path, 1, 2)


def test_logs_that_do_not_belong_together_are_refused(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, 1, 2) as buffer:
        buffer.append(group_of("a", 2))
        buffer.batch(0)
    (tmp_path / ASSIGNMENTS).write_text(json.dumps({"kind": "batch", "step": 0, "groups": [[0, 5]]}) + "\n")
    with pytest.raises(BufferLogError, match="names group"):
        TrajectoryBuffer(tmp_path, 1, 2)


def test_stale_groups_are_dropped_durably_and_counted(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, prompts_per_update=1, samples_per_prompt=2, max_staleness=1) as buffer:
        buffer.append(group_of("old", 2, versions=(0, 3)))
        buffer.append(group_of("fresh", 2, versions=(3, 3)))
        batch = served(buffer.batch(3).body)
        assert [g["prompt_id"] for g in batch["groups"]] == ["fresh"]
        stats = buffer.stats()
        assert (stats["dropped_stale"], stats["dropped_stale_trajectories"]) == (1, 2)
    with TrajectoryBuffer(tmp_path, 1, 2, max_staleness=1) as buffer:
        assert buffer.stats()["dropped_stale"] == 1  # the drop was logged
        assert buffer.stats()["groups_ready"] == 0


def test_commit_rules(tmp_path: Path) -> None:
    with TrajectoryBuffer(tmp_path, 1, 1) as buffer:
        buffer.append(group_of("a", 1))
        with pytest.raises(StepError, match="step 0 has no batch to commit"):
            buffer.commit(0)
        buffer.batch(0)
        assert buffer.commit(0) is True
        assert buffer.commit(0) is False
        assert buffer.stats()["committed_step"] == 0
    with TrajectoryBuffer(tmp_path, 1, 1) as buffer:
        assert buffer.stats()["committed_step"] == 0
        assert buffer.commit(0) is False
