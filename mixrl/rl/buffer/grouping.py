"""Groups, batches and staleness (pure: no files, no HTTP).

Trajectories with the same ``prompt_id`` form a group; a group is full at ``samples_per_prompt``
trajectories, and a further trajectory of that prompt starts a new group.  Full groups wait in
arrival order until a trainer step asks for ``prompts_per_update`` of them.

Staleness of a generated token, for trainer step N: ``N − weight_version``.  With
``max_staleness`` S, a group whose oldest generated token has staleness > S at batch time is
dropped (counted, never served).  Tool tokens (loss_mask 0) have no version and no staleness.

Every decision is a :class:`Plan` that the caller makes durable before applying it, so replaying the
same trajectories and plans rebuilds exactly the same state.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StalenessStats:
    """Staleness of one trajectory's (or a batch's) generated tokens at one trainer step."""

    tokens: int
    min: int | None
    max: int | None
    mean: float | None

    @staticmethod
    def of(version_counts: Mapping[int, int], step: int) -> StalenessStats:
        tokens = sum(version_counts.values())
        if tokens == 0:
            return StalenessStats(0, None, None, None)
        staleness = {step - version: count for version, count in version_counts.items()}
        mean = sum(s * count for s, count in staleness.items()) / tokens
        return StalenessStats(tokens, min(staleness), max(staleness), mean)

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "min": self.min, "max": self.max, "mean": self.mean}


@dataclass(frozen=True)
class TrajectoryMeta:
    """What grouping needs to know about a logged trajectory (the tokens stay in the log)."""

    seq: int
    """Line number in the trajectory log: the trajectory's identity."""
    prompt_id: str
    pool: tuple[str, str, str]
    """(pool, gpu_type, precision) of the sampler pool that generated it."""
    versions: tuple[tuple[int, int], ...]
    """(weight_version, generated tokens with that version), ascending by version."""

    @staticmethod
    def from_columns(
        seq: int,
        prompt_id: str,
        pool: tuple[str, str, str],
        weight_version: Iterable[int],
        loss_mask: Iterable[int],
    ) -> TrajectoryMeta:
        counts = Counter(v for v, m in zip(weight_version, loss_mask, strict=True) if m)
        return TrajectoryMeta(seq, prompt_id, pool, tuple(sorted(counts.items())))

    @property
    def oldest_version(self) -> int | None:
        return self.versions[0][0] if self.versions else None

    def staleness(self, step: int) -> StalenessStats:
        return StalenessStats.of(dict(self.versions), step)


@dataclass(frozen=True)
class Group:
    prompt_id: str
    members: tuple[TrajectoryMeta, ...]

    @property
    def seqs(self) -> tuple[int, ...]:
        return tuple(member.seq for member in self.members)

    @property
    def oldest_version(self) -> int | None:
        versions = [m.oldest_version for m in self.members if m.oldest_version is not None]
        return min(versions) if versions else None

    def is_stale(self, step: int, max_staleness: int | None) -> bool:
        oldest = self.oldest_version
        return max_staleness is not None and oldest is not None and step - oldest > max_staleness


@dataclass(frozen=True)
class Plan:
    """What a batch request for ``step`` decided: groups dropped as stale, and the batch if complete."""

    step: int
    dropped: tuple[Group, ...]
    batch: tuple[Group, ...] | None

    @property
    def empty(self) -> bool:
        return not self.dropped and self.batch is None


NO_BATCH_TO_QUARANTINE = "has no batch to quarantine"
STEP_COMMITTED = "is committed: its batch was trained"
NOT_THE_STEPS_BATCH = "are not the step's batch"
"""The words of the buffer's refusals of ``POST /quarantine`` (409), which a trainer tells apart:
the first and the last say the batch was taken back already (another rank reported it), the second
that the step was trained and its batch cannot be quarantined."""


class StepError(ValueError):
    """A batch or commit request for a step the buffer cannot serve (HTTP 409)."""


FIRST_STEP = 1
"""The trainer counts its updates from 1 (step 0 is the initial weights), so the first batch is step 1's."""


@dataclass
class GroupState:
    prompts_per_update: int
    samples_per_prompt: int
    max_staleness: int | None = None
    partial: dict[str, list[TrajectoryMeta]] = field(default_factory=dict)
    ready: deque[Group] = field(default_factory=deque)
    assigned: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """step -> the seqs of each group handed to that step (the batch, forever)."""
    committed: set[int] = field(default_factory=set)
    quarantined: list[tuple[int, tuple[tuple[int, ...], ...]]] = field(default_factory=list)
    """(step, the seqs of each group) of every batch the trainer could not train, in order: taken
    back from their step, never served again (the step takes the next full groups instead)."""
    received: int = 0
    dropped_groups: int = 0
    dropped_trajectories: int = 0

    def __post_init__(self) -> None:
        if self.prompts_per_update < 1:
            raise ValueError(f"prompts_per_update: must be ≥ 1, got {self.prompts_per_update}")
        if self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt: must be ≥ 1, got {self.samples_per_prompt}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be ≥ 0, got {self.max_staleness}")

    # ------------------------------------------------------------------ intake

    def add(self, meta: TrajectoryMeta) -> Group | None:
        """File one trajectory under its prompt; returns the group it completed, if any."""
        self.received += 1
        members = self.partial.setdefault(meta.prompt_id, [])
        members.append(meta)
        if len(members) < self.samples_per_prompt:
            return None
        del self.partial[meta.prompt_id]
        group = Group(meta.prompt_id, tuple(members))
        self.ready.append(group)
        return group

    # ------------------------------------------------------------------ batches

    @property
    def last_committed(self) -> int | None:
        return max(self.committed, default=None)

    @property
    def next_step(self) -> int:
        """The only step that may take a new batch: the one after the last committed step.

        A trainer works on one step at a time and commits it before asking for the next, so any
        other step is not a trainer's: letting it take groups would hand them to a step that is
        never trained (and a far-ahead step would make every later commit impossible).
        """
        last = self.last_committed
        return FIRST_STEP if last is None else last + 1

    def check_next_step(self, step: int) -> None:
        """Raise StepError unless ``step`` (not yet assigned) is the next step, the only one that may get a batch."""
        expected = self.next_step
        if step == expected:
            return
        last = self.last_committed
        if last is None:
            if step < expected:
                raise StepError(
                    f"step {step}: trainer steps start at {FIRST_STEP}; step 0 is the initial weights"
                )
            raise StepError(
                f"step {step} is not the trainer's next step {expected} (nothing committed yet); "
                "only the next step can take a batch"
            )
        if step <= last:
            raise StepError(f"step {step} is not after the last committed step {last} and has no batch")
        raise StepError(
            f"step {step} is not the trainer's next step {expected} (last committed: {last}); "
            "only the next step can take a batch"
        )

    def check_commit(self, step: int) -> None:
        """Raise StepError unless ``step`` may be committed now: it has a batch and is the next step.

        (Committing a step already committed is answered as a repeat before this check.)
        """
        if step not in self.assigned:
            raise StepError(f"step {step} has no batch to commit")
        if step != self.next_step:
            raise StepError(
                f"step {step} is not the step just served ({self.next_step}); steps are committed in order"
            )

    def plan(self, step: int) -> Plan:
        """Decide the batch of a step not yet assigned (oldest full groups first), without changing state."""
        if step < 0:
            raise StepError(f"step: must be ≥ 0, got {step}")
        if step in self.assigned:
            raise StepError(f"step {step} already has a batch")
        last = self.last_committed
        if last is not None and step <= last:
            raise StepError(f"step {step} is not after the last committed step {last} and has no batch")
        dropped: list[Group] = []
        batch: list[Group] = []
        for group in self.ready:
            if group.is_stale(step, self.max_staleness):
                dropped.append(group)
            elif len(batch) < self.prompts_per_update:
                batch.append(group)
        complete = len(batch) == self.prompts_per_update
        return Plan(step, tuple(dropped), tuple(batch) if complete else None)

    def apply(self, plan: Plan) -> None:
        """Carry out a plan (after it was logged): drop its stale groups, assign its batch."""
        taken = {group.seqs for group in plan.dropped}
        if plan.batch is not None:
            if plan.step in self.assigned:
                raise StepError(f"step {plan.step} already has a batch")
            taken |= {group.seqs for group in plan.batch}
            self.assigned[plan.step] = tuple(group.seqs for group in plan.batch)
        remaining = [group for group in self.ready if group.seqs not in taken]
        if len(self.ready) - len(remaining) != len(taken):
            raise ValueError(f"plan for step {plan.step} names groups that are not waiting")
        self.ready = deque(remaining)
        self.dropped_groups += len(plan.dropped)
        self.dropped_trajectories += sum(len(group.members) for group in plan.dropped)

    def check_quarantine(self, step: int) -> None:
        """Raise StepError unless ``step`` holds a batch that is served and not yet committed."""
        if step not in self.assigned:
            raise StepError(f"step {step} {NO_BATCH_TO_QUARANTINE}")
        if step in self.committed:
            raise StepError(f"step {step} {STEP_COMMITTED}")

    def quarantine(self, step: int) -> tuple[tuple[int, ...], ...]:
        """Take a served, uncommitted batch back from its step for good; returns its groups' seqs.

        The step then has no batch, and the next request for it plans afresh from the full groups
        waiting (the quarantined ones are in none of them), so a batch that crashes the trainer
        is trained by nobody and the step goes on with other data."""
        self.check_quarantine(step)
        seqs = self.assigned.pop(step)
        self.quarantined.append((step, seqs))
        return seqs

    def commit(self, step: int) -> bool:
        """Mark a step's batch consumed; returns False when it already was."""
        if step not in self.assigned:
            raise StepError(f"step {step} has no batch to commit")
        if step in self.committed:
            return False
        self.committed.add(step)
        return True

    # ------------------------------------------------------------------ views

    def waiting_by_pool(self) -> Counter[tuple[str, str, str]]:
        """Trajectories not yet handed to a step, per sampler pool."""
        counts: Counter[tuple[str, str, str]] = Counter()
        for members in self.partial.values():
            counts.update(m.pool for m in members)
        for group in self.ready:
            counts.update(m.pool for m in group.members)
        return counts
