"""The trajectory contract (mixrl.api.trajectory_check): every kind of impossible trajectory the
buffer used to acknowledge is named by field and position; a real one passes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from mixrl.api.trajectory import TokenRecord, Trajectory
from mixrl.api.trajectory_check import TrajectoryLimits, group_problem, trajectory_problem

LIMITS = TrajectoryLimits(
    run="demo", samples_per_prompt=4, candidates=3, max_context_tokens=64, vocab_size=100, latest_version=5
)


def episode(sample_index: int = 0, prompt_id: str = "p") -> Trajectory:
    """Prompt, a generated token, two tool tokens, a generated token with a top-p support of 2."""
    t = Trajectory(
        run="demo", prompt_id=prompt_id, sample_index=sample_index, pool="fp8", prompt_ids=[1, 2], reward=1.0
    )
    t.append_generated(TokenRecord(token_id=5, logprob=-0.1, cand_ids=[5, 6, 7], cand_logprobs=[-0.1, -2.0, -3.0],
                                   support_size=0, weight_version=4))  # fmt: skip
    t.append_observation([8, 9])
    t.append_generated(TokenRecord(token_id=11, logprob=-0.7, cand_ids=[10, 11], cand_logprobs=[-0.5, -0.7],
                                   support_size=2, weight_version=5))  # fmt: skip
    return t


def test_a_real_episode_keeps_the_contract() -> None:
    assert trajectory_problem(episode(), LIMITS) is None
    group = [episode(i) for i in range(4)]
    assert group_problem("p", group, LIMITS) is None


def with_column(name: str, index: int, value: Any) -> Callable[[Trajectory], None]:
    def change(t: Trajectory) -> None:
        getattr(t, name)[index] = value

    return change


def setting(name: str, value: Any) -> Callable[[Trajectory], None]:
    def change(t: Trajectory) -> None:
        setattr(t, name, value)

    return change


def four_candidates(t: Trajectory) -> None:
    t.cand_ids[0], t.cand_logprobs[0] = [5, 6, 7, 8], [-0.1, -2.0, -3.0, -4.0]


# (what is wrong, how to make it so, the start of the one line that names it)
IMPOSSIBLE = [
    ("NaN log-probability", with_column("logprobs", 3, math.nan), "logprobs[3]: nan"),
    ("+inf log-probability", with_column("logprobs", 0, math.inf), "logprobs[0]: inf"),
    ("-inf log-probability of a sampled token", with_column("logprobs", 0, -math.inf), "logprobs[0]: -inf"),
    ("positive log-probability", with_column("logprobs", 3, 0.5), "logprobs[3]: 0.5"),
    ("NaN candidate log-probability", with_column("cand_logprobs", 0, [-0.1, math.nan, -3.0]), "cand_logprobs[0][1]"),
    ("positive candidate log-probability", with_column("cand_logprobs", 3, [0.2, -0.7]), "cand_logprobs[3][0]"),
    ("NaN reward", setting("reward", math.nan), "reward: nan"),
    ("infinite reward", setting("reward", -math.inf), "reward: -inf"),
    ("no reward", setting("reward", None), "reward: missing"),
    ("candidate row shorter than its partner", with_column("cand_logprobs", 0, [-0.1, -2.0]), "cand_logprobs[0]: 2 entries for 3"),
    ("candidate row longer than its partner", with_column("cand_ids", 3, [10, 11, 12]), "cand_logprobs[3]: 2 entries for 3"),
    ("more candidates than the run records", four_candidates, "cand_ids[0]: 4 candidates"),
    ("a candidate id twice", with_column("cand_ids", 0, [5, 5, 7]), "cand_ids[0]: a candidate id appears twice"),
    ("token id outside the vocabulary", with_column("tokens", 1, 100), "tokens[1]: token id 100 is outside"),
    ("negative token id", with_column("tokens", 2, -1), "tokens[2]: token id -1 is negative"),
    ("prompt id outside the vocabulary", with_column("prompt_ids", 1, 10**9), "prompt_ids[1]: token id 1000000000"),
    ("candidate id outside the vocabulary", with_column("cand_ids", 3, [10, 400]), "cand_ids[3][1]: token id 400"),
    ("support larger than the candidates", with_column("support_size", 3, 3), "support_size[3]: 3 is outside 0..2"),
    ("sampled token outside its support", with_column("support_size", 3, 1), "tokens[3]: sampled token 11"),
    ("loss mask of 2", with_column("loss_mask", 1, 2), "loss_mask[1]: 2 is neither"),
    ("loss mask on a tool token", with_column("loss_mask", 1, 1), "weight_version[1]: -1; a generated token"),
    ("a sampler record on a tool token", with_column("weight_version", 2, 3), "weight_version[2]: 3 on a tool token"),
    ("candidates on a tool token", with_column("cand_ids", 1, [3]), "cand_ids[1]: candidates on a tool token"),
    ("negative weight version", with_column("weight_version", 0, -1), "weight_version[0]: -1"),
    ("a version newer than any published", with_column("weight_version", 3, 6), "weight_version[3]: 6 is newer"),
    ("another run's name", setting("run", "other"), "run: 'other' is not this run ('demo')"),
    ("sample index beyond samplesPerPrompt", setting("sample_index", 4), "sample_index: 4 is not below"),
    ("sample index far beyond samplesPerPrompt", setting("sample_index", 10**6), "sample_index: 1000000"),
    ("no prompt", setting("prompt_ids", []), "prompt_ids: empty"),
    ("longer than the context", setting("prompt_ids", list(range(61))), "tokens: 65 tokens with the prompt exceed"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "expected"), [(c, e) for _, c, e in IMPOSSIBLE], ids=[w for w, _, _ in IMPOSSIBLE]
)
def test_each_impossible_trajectory_is_named_by_field_and_position(
    change: Callable[[Trajectory], None], expected: str
) -> None:
    trajectory = episode()
    change(trajectory)
    problem = trajectory_problem(trajectory, LIMITS)
    assert problem is not None and problem.startswith(expected), problem


def test_an_empty_trajectory_is_refused() -> None:
    empty = Trajectory(run="demo", prompt_id="p", pool="fp8", prompt_ids=[1], reward=0.0)
    assert trajectory_problem(empty, LIMITS) == "tokens: empty (nothing after the prompt to train on)"


@pytest.mark.parametrize("value", ["7", 7.0, True])
def test_ids_are_never_coerced(value: Any) -> None:
    body = episode().model_dump(mode="json")
    body["tokens"][0] = value
    with pytest.raises(ValidationError, match="valid integer"):
        Trajectory.model_validate(body)


@pytest.mark.parametrize("value", ["-0.5", True])
def test_log_probabilities_are_never_coerced(value: Any) -> None:
    body = episode().model_dump(mode="json")
    body["logprobs"][0] = value
    with pytest.raises(ValidationError, match="valid number"):
        Trajectory.model_validate(body)


def test_without_a_vocabulary_ids_are_only_checked_to_be_non_negative() -> None:
    trajectory = episode()
    trajectory.tokens[1] = 10**6
    unknown = TrajectoryLimits("demo", 4, 3, 64, vocab_size=None)
    assert trajectory_problem(trajectory, unknown) is None
    trajectory.tokens[1] = -3
    assert trajectory_problem(trajectory, unknown) == "tokens[1]: token id -3 is negative"


def test_a_group_names_its_stray_member_and_its_missing_samples() -> None:
    group = [episode(i) for i in range(4)]
    group[2].prompt_id = "q"
    assert group_problem("p", group, LIMITS) == "trajectories[2].prompt_id: 'q' in the group of 'p'"
    assert group_problem("p", [episode(0), episode(1), episode(1), episode(3)], LIMITS) == (
        "group 'p' needs sample indices 0..3 once each, got [0, 1, 1, 3]"
    )
    bad = [episode(i) for i in range(4)]
    bad[3].logprobs[0] = math.nan
    assert group_problem("p", bad, LIMITS) == "trajectories[3].logprobs[0]: nan is not the log-probability of a sampled token (finite, ≤ 0)"  # fmt: skip
