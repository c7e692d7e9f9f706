"""Pure grouping, batch planning and staleness (no files, no HTTP)."""

from __future__ import annotations

import pytest

from mixrl.rl.buffer.grouping import GroupState, StalenessStats, StepError, TrajectoryMeta

POOL = ("p", "gpu", "bf16")


def meta(seq: int, prompt: str, versions: list[int], mask: list[int] | None = None) -> TrajectoryMeta:
    return TrajectoryMeta.from_columns(seq, prompt, POOL, versions, mask or [1] * len(versions))


def test_groups_fill_at_samples_per_prompt_and_a_full_prompt_starts_a_new_group() -> None:
    state = GroupState(prompts_per_update=1, samples_per_prompt=3)
    completed = [state.add(meta(i, "a" if i % 2 == 0 else "b", [0])) for i in range(8)]
    # a: seqs 0, 2, 4 | 6 ...; b: 1, 3, 5 | 7 ...
    assert [g.seqs if g else None for g in completed] == [None] * 4 + [(0, 2, 4), (1, 3, 5), None, None]
    assert {k: [m.seq for m in v] for k, v in state.partial.items()} == {"a": [6], "b": [7]}
    assert [g.prompt_id for g in state.ready] == ["a", "b"]


def test_batches_take_the_oldest_full_groups_and_are_assigned_once() -> None:
    state = GroupState(prompts_per_update=2, samples_per_prompt=2)
    for i, prompt in enumerate(["x", "y", "x", "z", "y", "z"]):
        state.add(meta(i, prompt, [0]))
    assert state.plan(0).batch is not None
    plan = state.plan(0)
    assert [g.seqs for g in plan.batch] == [(0, 2), (1, 4)]
    state.apply(plan)
    assert state.assigned[0] == ((0, 2), (1, 4))
    with pytest.raises(StepError, match="step 0 already has a batch"):
        state.plan(0)
    assert state.plan(1).batch is None  # only z is left
    assert not state.plan(1).dropped


def test_staleness_drops_groups_older_than_max_staleness() -> None:
    state = GroupState(prompts_per_update=1, samples_per_prompt=2, max_staleness=2)
    state.add(meta(0, "old", [5, 9]))
    state.add(meta(1, "old", [7]))  # oldest token of the group: version 5
    state.add(meta(2, "new", [6, 7]))
    state.add(meta(3, "new", [6], mask=[1]))
    # step 7: "old" has staleness 2 (kept: not more than 2); step 8: 3 > 2, dropped.
    assert state.plan(7).dropped == ()
    plan = state.plan(8)
    assert [g.prompt_id for g in plan.dropped] == ["old"]
    assert [g.prompt_id for g in plan.batch] == ["new"]
    state.apply(plan)
    assert (state.dropped_groups, state.dropped_trajectories) == (1, 2)
    assert list(state.ready) == []


def test_tool_tokens_have_no_staleness_and_never_cause_a_drop() -> None:
    state = GroupState(prompts_per_update=1, samples_per_prompt=1, max_staleness=0)
    only_tool = meta(0, "t", [-1, -1], mask=[0, 0])
    assert only_tool.versions == () and only_tool.staleness(50) == StalenessStats(0, None, None, None)
    state.add(only_tool)
    assert state.plan(50).batch is not None


def test_staleness_stats_match_a_float64_reference() -> None:
    versions = [3, 3, 4, 7, 7, 7, 2]
    mask = [1, 1, 0, 1, 1, 1, 1]
    m = meta(0, "p", versions, mask)
    step = 9
    kept = [step - v for v, k in zip(versions, mask, strict=True) if k]
    reference = StalenessStats(len(kept), min(kept), max(kept), sum(float(s) for s in kept) / len(kept))
    assert m.staleness(step) == reference


def test_commit_and_step_rules() -> None:
    state = GroupState(prompts_per_update=1, samples_per_prompt=1)
    for i in range(3):
        state.add(meta(i, f"p{i}", [0]))
    with pytest.raises(StepError, match="step 4 has no batch to commit"):
        state.commit(4)
    for step in (3, 4):
        state.apply(state.plan(step))
    assert state.commit(4) is True
    assert state.commit(4) is False
    with pytest.raises(StepError, match="not after the last committed step 4"):
        state.plan(2)
    with pytest.raises(StepError, match="step: must be ≥ 0"):
        state.plan(-1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompts_per_update": 0, "samples_per_prompt": 1}, "prompts_per_update: must be ≥ 1"),
        ({"prompts_per_update": 1, "samples_per_prompt": 0}, "samples_per_prompt: must be ≥ 1"),
        (
            {"prompts_per_update": 1, "samples_per_prompt": 1, "max_staleness": -1},
            "max_staleness: must be ≥ 0",
        ),
    ],
)
def test_bad_sizes_are_refused(kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        GroupState(**kwargs)
