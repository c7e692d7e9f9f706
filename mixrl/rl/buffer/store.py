"""``TrajectoryBuffer``: grouping state made durable by append-only JSON-lines logs (no HTTP).

Files under the buffer's directory::

    trajectories.jsonl   one Trajectory per line, as validated, re-serialised by its model;
                         line number = the trajectory's seq
    assignments.jsonl    {"kind": "batch", "step", "groups": [[seq, ...], ...], "staleness": ...}
                         {"kind": "drop", "step", "groups": [[seq, ...], ...]}
                         {"kind": "commit", "step"}
                         {"kind": "quarantine", "step", "groups": [[seq, ...], ...], "prompt_ids", "reason"}
    quarantine/step-<s>-<n>.json  the n-th batch of step s the trainer could not train, as served
    evaluations.jsonl    held-out results posted by the rollout worker
    trainer-metrics.jsonl  the trainer's per-step records (a copy of its metrics.jsonl, so a run's
                         telemetry stays readable from the buffer once the trainer is gone)

Every write is flushed and fsynced before it is acknowledged; a decision (batch, drop, commit) is
logged before it is applied.  On start the buffer replays the trajectory log through the same pure
grouping (grouping depends only on arrival order, so the same groups form) and then the
assignments: nothing acknowledged is lost and no group is ever handed to two different steps.

Damage on start: a last line without its newline that is nevertheless a complete, valid record is
kept (its newline is added); any other unterminated last line (a write torn by a crash, never
acknowledged) is moved to ``<log>.damaged`` and cut from the log, never silently dropped.  A bad
line anywhere else in the trajectory or assignment log stops the start with one line,
``log <file> is damaged at line N: <reason>``; a trajectory line must be a whole Trajectory, as
the trainer reads it.  The evaluation and trainer-metrics logs are telemetry: a bad line there
is skipped with a warning and never blocks a restart.

Idempotent intake: a trajectory is identified by its (``prompt_id``, ``sample_index``).  A post
that repeats one already stored with the same content (a client retrying a post whose answer it
lost) is acknowledged and stored once; the same key with other content is refused
(:class:`ConflictError`, HTTP 409), and so is a post holding one key twice with different content.

Quarantine: a batch the trainer reports it cannot train (:meth:`TrajectoryBuffer.quarantine`) is
taken back from its step for good and written to ``quarantine/`` for inspection; the step's next
request takes the next full groups.

Thread safety: every public method holds one lock, so the HTTP layer may call them from worker
threads (file I/O stays off the event loop).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeGuard

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mixrl.api.trajectory import Trajectory
from mixrl.rl.buffer.grouping import (
    NOT_THE_STEPS_BATCH,
    Group,
    GroupState,
    Plan,
    StalenessStats,
    StepError,
    TrajectoryMeta,
)
from mixrl.rl.durable import fsync_path, sync_file

log = logging.getLogger("mixrl.buffer")

TRAJECTORIES = "trajectories.jsonl"
ASSIGNMENTS = "assignments.jsonl"
EVALUATIONS = "evaluations.jsonl"
TRAINER_METRICS = "trainer-metrics.jsonl"
QUARANTINE = "quarantine"

PoolKey = tuple[str, str, str]


class ConflictError(ValueError):
    """A post that contradicts what the buffer stored (HTTP 409); the message names the trajectory."""


class BufferLogError(RuntimeError):
    """A log file is damaged somewhere other than a torn last line; the message names file and line."""


def damaged(path: Path, number: int, reason: str) -> BufferLogError:
    """The one-line error for line ``number`` (0-based) of a log."""
    return BufferLogError(f"log {path} is damaged at line {number + 1}: {reason}")


def _shown(value: Any, limit: int = 80) -> str:
    """repr() of a value from a damaged line, cut short: the line may be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


class Evaluation(BaseModel):
    """Held-out results at one step; extra fields (per-pool figures, task counts...) are kept as sent."""

    model_config = ConfigDict(extra="allow")

    step: int = Field(ge=0)
    weight_version: int = Field(ge=0)
    pass_at_k: dict[str, float] = Field(description="k (as a string) -> pass@k in [0, 1].")

    @field_validator("pass_at_k")
    @classmethod
    def _pass_at_k(cls, value: dict[str, float]) -> dict[str, float]:
        if not value:
            raise ValueError("needs at least one k")
        for k, rate in value.items():
            if not k.isdigit() or int(k) < 1:
                raise ValueError(f"key {k!r} is not a positive integer k")
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"pass@{k} = {rate} is outside [0, 1]")
        return value


@dataclass(frozen=True)
class BatchPayload:
    """A served batch: ``body`` is the JSON the trainer receives (trajectories spliced in as logged)."""

    step: int
    body: bytes
    groups: int
    trajectories: int


DAMAGED_SUFFIX = ".damaged"


def _json_line(line: bytes) -> Any:
    """The JSON value of a log line; ValueError with the reason when it is not JSON."""
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError("not JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"not JSON ({exc})") from None


def _quarantine(path: Path, offset: int, tail: bytes) -> None:
    """Move an unusable unterminated last line to ``<log>.damaged`` (durably), then cut it from the log."""
    side = path.with_name(path.name + DAMAGED_SUFFIX)
    with side.open("ab") as f:
        f.write(tail + b"\n")
        sync_file(f)
    fsync_path(path.parent)
    # Only now cut it: a crash in between leaves the line in both places, never in neither.
    with path.open("r+b") as f:
        f.truncate(offset)
        sync_file(f)
    log.warning(
        "%s: its last line (%d bytes, no newline) is not a complete record, as a crash mid-write "
        "leaves it; moved it to %s",
        path,
        len(tail),
        side,
    )


def _read_lines(path: Path, complete: Callable[[bytes], bool]) -> Iterator[tuple[int, int, bytes]]:
    """(offset, line number, line) of every line of a log, after repairing its end.

    A last line without its newline (a write cut short) is kept when ``complete(line)`` says it is
    a whole valid record (its newline is added, so later appends start on a line of their own), and
    otherwise quarantined by :func:`_quarantine`.
    """
    if not path.exists():
        return
    with path.open("rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        tail = data[end:]
        if complete(tail):
            log.warning("%s: its last line lacked its newline but is a complete record; kept it", path)
            with path.open("ab") as f:
                f.write(b"\n")
                sync_file(f)
            data += b"\n"
        else:
            _quarantine(path, end, tail)
            data = data[:end]
    offset = 0
    number = 0
    while offset < len(data):
        stop = data.index(b"\n", offset)
        yield offset, number, data[offset:stop]
        offset = stop + 1
        number += 1


def _record(path: Path, number: int, line: bytes) -> dict[str, Any]:
    try:
        value = _json_line(line)
    except ValueError as exc:
        raise damaged(path, number, str(exc)) from None
    if not isinstance(value, dict):
        raise damaged(path, number, f"expected a JSON object, got {type(value).__name__}")
    return value


def _meta_problem(record: dict[str, Any]) -> str | None:
    """Why a logged trajectory cannot be grouped (only the fields grouping reads), or None."""
    for name in ("prompt_id", "pool"):
        if not isinstance(record.get(name), str):
            return f"{name}: expected a string, got {_shown(record.get(name))}"
    for name in ("gpu_type", "precision"):
        if not isinstance(record.get(name, ""), str):
            return f"{name}: expected a string, got {_shown(record.get(name))}"
    columns: dict[str, list[int]] = {}
    for name in ("weight_version", "loss_mask"):
        column = record.get(name)
        if not isinstance(column, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in column
        ):
            return f"{name}: expected a list of integers"
        columns[name] = column
    if len(columns["weight_version"]) != len(columns["loss_mask"]):
        return "weight_version and loss_mask differ in length"
    return None


def _validation_problem(exc: ValidationError) -> str:
    """pydantic's first complaint as ``<field path>: <reason>`` (it never quotes the input)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    problem = f"{where}: {first['msg']}" if where else str(first["msg"])
    return problem if len(problem) <= 300 else problem[:300] + "…"


def _logged_trajectory(path: Path, number: int, line: bytes) -> Trajectory:
    """Line ``number`` of the trajectory log as the Trajectory the trainer will read it as.

    Checked whole, not only the fields grouping reads: a line the trainer cannot read would
    otherwise be handed out in a batch, and the same batch again after every restart of the
    trainer.  (Parsing the line straight into the model is also quicker than ``json.loads``.)
    """
    try:
        return Trajectory.model_validate_json(line)
    except ValidationError as exc:
        problem = _meta_problem(_record(path, number, line)) or _validation_problem(exc)
        raise damaged(path, number, problem) from None


def _complete_trajectory(line: bytes) -> bool:
    try:
        Trajectory.model_validate(_json_line(line))
    except ValueError:  # pydantic's ValidationError is a ValueError too
        return False
    return True


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seq_lists(value: Any) -> TypeGuard[list[list[Any]]]:
    return isinstance(value, list) and all(
        isinstance(group, list) and group and all(_is_step(seq) for seq in group) for group in value
    )


STALENESS_KEYS = frozenset({"tokens", "min", "max", "mean"})


def _assignment_problem(record: Any) -> str | None:
    """Why a line of the assignment log is not a batch, drop or commit record, or None."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    kind = record.get("kind")
    if kind not in ("batch", "drop", "commit", "quarantine"):
        return f"kind: expected batch, drop, commit or quarantine, got {_shown(kind)}"
    if not _is_step(record.get("step")):
        return f"step: expected a non-negative integer, got {_shown(record.get('step'))}"
    if kind == "commit":
        return None
    groups = record.get("groups")
    if not _seq_lists(groups):
        return "groups: expected lists of trajectory line numbers"
    if kind == "drop":
        return None
    if kind == "quarantine":
        prompt_ids = record.get("prompt_ids")
        if not isinstance(prompt_ids, list) or not all(isinstance(p, str) for p in prompt_ids):
            return "prompt_ids: expected strings"
        return None if isinstance(record.get("reason"), str) else "reason: expected a string"
    prompt_ids, staleness = record.get("prompt_ids"), record.get("staleness")
    if not isinstance(prompt_ids, list) or len(prompt_ids) != len(groups):
        return "prompt_ids: expected one prompt id per group"
    if not all(isinstance(p, str) for p in prompt_ids):
        return "prompt_ids: expected strings"
    if not isinstance(staleness, list) or len(staleness) != len(groups):
        return "staleness: expected one list per group"
    for group, entries in zip(groups, staleness, strict=True):
        if not isinstance(entries, list) or len(entries) != len(group):
            return "staleness: expected one entry per trajectory of its group"
        if not all(isinstance(e, dict) and set(e) == STALENESS_KEYS for e in entries):
            return f"staleness: expected objects with {', '.join(sorted(STALENESS_KEYS))}"
    return None


def _complete_assignment(line: bytes) -> bool:
    try:
        return _assignment_problem(_json_line(line)) is None
    except ValueError:
        return False


def _complete_object(line: bytes) -> bool:
    try:
        return isinstance(_json_line(line), dict)
    except ValueError:
        return False


def meta_of(seq: int, trajectory: Trajectory | dict[str, Any]) -> TrajectoryMeta:
    if isinstance(trajectory, Trajectory):
        t = trajectory
        return TrajectoryMeta.from_columns(
            seq, t.prompt_id, (t.pool, t.gpu_type, t.precision), t.weight_version, t.loss_mask
        )
    pool = (trajectory["pool"], trajectory.get("gpu_type", ""), trajectory.get("precision", ""))
    return TrajectoryMeta.from_columns(
        seq, trajectory["prompt_id"], pool, trajectory["weight_version"], trajectory["loss_mask"]
    )


@dataclass
class Telemetry:
    """Counters the metrics exporter reads (since this process started, except ``received``)."""

    received: Counter[PoolKey] = field(default_factory=Counter)
    dropped: Counter[PoolKey] = field(default_factory=Counter)
    staleness_tokens: dict[PoolKey, Counter[int]] = field(default_factory=dict)
    """pool -> staleness value -> generated tokens handed out with it."""
    batches: int = 0


class TrajectoryBuffer:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        prompts_per_update: int,
        samples_per_prompt: int,
        max_staleness: int | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state = GroupState(prompts_per_update, samples_per_prompt, max_staleness)
        self.telemetry = Telemetry()
        self.latest_requested_step: int | None = None
        self.evaluations: list[dict[str, Any]] = []
        self.trainer_records: dict[int, dict[str, Any]] = {}
        """The trainer's latest record per step (a redone step replaces the one before)."""
        self._offsets: list[tuple[int, int]] = []  # seq -> (offset, length) in the trajectory log
        self._batch_places: dict[int, tuple[int, int]] = {}  # step -> its batch record in the assignments log
        self._keys: dict[tuple[str, int], bytes] = {}
        """(prompt_id, sample_index) -> a digest of the stored line: what makes intake idempotent."""
        self.duplicates = 0
        """Posted trajectories acknowledged again without being stored (since this process started)."""
        self.quarantined: list[dict[str, Any]] = []
        """Each quarantined batch: step, prompt ids, reason, the file it was written to."""
        self._lock = threading.RLock()
        started = time.monotonic()
        self._replay()
        self._traj_log = self._open_append(TRAJECTORIES)
        self._assign_log = self._open_append(ASSIGNMENTS)
        self._eval_log = self._open_append(EVALUATIONS)
        self._trainer_log = self._open_append(TRAINER_METRICS)
        fsync_path(self.dir)
        self._reader = (self.dir / TRAJECTORIES).open("rb")
        self._assign_reader = (self.dir / ASSIGNMENTS).open("rb")
        log.info(
            "buffer at %s: %d trajectories, %d groups ready, %d partial, %d batches (%d committed); "
            "rebuilt in %.2fs",
            self.dir,
            self.state.received,
            len(self.state.ready),
            len(self.state.partial),
            len(self.state.assigned),
            len(self.state.committed),
            time.monotonic() - started,
        )

    def close(self) -> None:
        with self._lock:
            for f in (
                self._traj_log,
                self._assign_log,
                self._eval_log,
                self._trainer_log,
                self._reader,
                self._assign_reader,
            ):
                f.close()

    def __enter__(self) -> TrajectoryBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ replay

    def _open_append(self, name: str) -> BinaryIO:
        # Unbuffered: a write that failed (a full disk) must leave no bytes behind in a buffer
        # that a later write would flush after the cut (see _write).
        return (self.dir / name).open("ab", buffering=0)

    def _replay(self) -> None:
        path = self.dir / TRAJECTORIES
        for offset, number, line in _read_lines(path, _complete_trajectory):
            trajectory = _logged_trajectory(path, number, line)
            meta = meta_of(number, trajectory)
            # (A log from before idempotent intake may repeat a key: the first line keeps it.)
            self._keys.setdefault((trajectory.prompt_id, trajectory.sample_index), _digest(line))
            self._offsets.append((offset, len(line)))
            self.state.add(meta)
            self.telemetry.received[meta.pool] += 1
        by_seqs = {group.seqs: group for group in self.state.ready}
        path = self.dir / ASSIGNMENTS
        for offset, number, line in _read_lines(path, _complete_assignment):
            record = _record(path, number, line)
            problem = _assignment_problem(record)
            if problem is not None:
                raise damaged(path, number, problem)
            try:
                self._replay_assignment(record, offset, len(line), by_seqs)
            except KeyError as exc:
                reason = (
                    f"names group {exc} that the trajectory log does not form; "
                    "the logs do not belong together"
                )
                raise damaged(path, number, reason) from None
            except ValueError as exc:  # StepError: a second batch for a step, a commit without one...
                raise damaged(path, number, str(exc)) from None
        path = self.dir / EVALUATIONS
        self.evaluations = []
        for _, number, line in _read_lines(path, _complete_object):
            # Held-out results are telemetry: a bad line costs one point of a plot, never a restart.
            try:
                self.evaluations.append(Evaluation.model_validate(_json_line(line)).model_dump())
            except ValueError as exc:
                reason = str(exc).splitlines()[0]
                log.warning("%s: skipping line %d, not an evaluation record (%s)", path, number + 1, reason)
        path = self.dir / TRAINER_METRICS
        self.trainer_records = {}
        for _, number, line in _read_lines(path, _complete_object):
            try:  # telemetry too: a bad line is skipped with a warning
                record = _json_line(line)
                self.trainer_records[trainer_step(record)] = record
            except ValueError as exc:
                log.warning("%s: skipping line %d (%s)", path, number + 1, str(exc).splitlines()[0])
        if self.state.assigned:
            self.latest_requested_step = max(self.state.assigned)

    def _replay_assignment(
        self, record: dict[str, Any], offset: int, length: int, by_seqs: dict[tuple[int, ...], Group]
    ) -> None:
        kind, step = record["kind"], record["step"]
        if kind == "commit":
            self.state.commit(step)
            return
        if kind == "quarantine":
            if [list(seqs) for seqs in self.state.assigned.get(step, ())] != record["groups"]:
                raise ValueError(f"step {step}: the quarantined groups are not the step's batch")
            self._note_quarantine(step, self.state.quarantine(step), record["prompt_ids"], record["reason"])
            return
        groups = tuple(by_seqs[tuple(seqs)] for seqs in record["groups"])
        plan = Plan(step, groups, None) if kind == "drop" else Plan(step, (), groups)
        self.state.apply(plan)
        if kind == "batch":
            self._batch_places[step] = (offset, length)

    # ------------------------------------------------------------------ writes

    @staticmethod
    def _write(f: BinaryIO, lines: Sequence[bytes]) -> list[tuple[int, int]]:
        """Append lines durably; returns each line's (offset, length) in the file.

        A write that fails (a full disk, an I/O error) is cut from the log before the error is
        raised: it was never acknowledged, and a half line left there would be glued to the next
        record, a damaged line inside the log that every later restart refuses.
        """
        offset = f.seek(0, os.SEEK_END)
        data = memoryview(b"".join(line + b"\n" for line in lines))
        try:
            written = 0
            while written < len(data):  # a raw write may take only part of it
                taken = f.write(data[written:])
                if not taken:
                    raise OSError(f"{f.name}: the write took no bytes")
                written += taken
            sync_file(f)
        except BaseException:
            os.ftruncate(f.fileno(), offset)
            f.seek(offset)
            raise
        places = []
        for line in lines:
            places.append((offset, len(line)))
            offset += len(line) + 1
        return places

    def append(self, trajectories: Sequence[Trajectory]) -> int:
        """Log trajectories durably, then group them; returns how many groups became full.

        Trajectories already stored with the same content are skipped (a retried post; counted in
        :attr:`duplicates`); a key stored with other content raises :class:`ConflictError` and
        nothing of the post is stored.
        """
        with self._lock:
            fresh = self._new_trajectories(trajectories)
            lines = [line for _, line in fresh]
            places = self._write(self._traj_log, lines) if lines else []
            # Counted once the write held: a post whose write failed is retried, and counting it
            # before would count its duplicates twice.
            self.duplicates += len(trajectories) - len(fresh)
            completed = 0
            for (trajectory, line), place in zip(fresh, places, strict=True):
                self._keys[(trajectory.prompt_id, trajectory.sample_index)] = _digest(line)
                seq = len(self._offsets)
                self._offsets.append(place)
                meta = meta_of(seq, trajectory)
                self.telemetry.received[meta.pool] += 1
                completed += self.state.add(meta) is not None
            return completed

    def _new_trajectories(self, trajectories: Sequence[Trajectory]) -> list[tuple[Trajectory, bytes]]:
        """The trajectories of a post not stored yet, with their log lines; ConflictError on a clash."""
        fresh: list[tuple[Trajectory, bytes]] = []
        seen: dict[tuple[str, int], bytes] = {}
        for index, trajectory in enumerate(trajectories):
            line = log_line(trajectory)
            key, digest = (trajectory.prompt_id, trajectory.sample_index), _digest(line)
            known = self._keys.get(key, seen.get(key))
            if known is None:
                seen[key] = digest
                fresh.append((trajectory, line))
            elif known != digest:
                raise ConflictError(
                    f"trajectories[{index}]: prompt {trajectory.prompt_id!r} sample {trajectory.sample_index} "
                    "was already posted with other content"
                )
        return fresh

    def batch(self, step: int, reserve: bool = True) -> BatchPayload | None:
        """The batch of ``step``: the same one on every call once assigned; None until there is one.

        With ``reserve``, the trainer's next step (:attr:`GroupState.next_step`) takes the oldest
        full groups once enough are waiting; without it nothing changes (None until it has a batch).
        Raises :class:`~mixrl.rl.buffer.grouping.StepError` for a step that has no batch and is
        not the next step: such a request changes nothing.
        """
        with self._lock:
            if step not in self.state.assigned:
                self.state.check_next_step(step)
            if reserve and (self.latest_requested_step is None or step > self.latest_requested_step):
                self.latest_requested_step = step
            if step not in self.state.assigned:
                if not reserve:
                    return None
                plan = self.state.plan(step)
                if plan.empty:
                    return None
                self._log_plan(plan)
                self.state.apply(plan)
                if plan.batch is None:
                    return None
            return self._payload(step)

    def _log_plan(self, plan: Plan) -> None:
        records: list[dict[str, Any]] = []
        if plan.dropped:
            groups = [list(group.seqs) for group in plan.dropped]
            records.append({"kind": "drop", "step": plan.step, "groups": groups})
            for group in plan.dropped:
                log.info(
                    "step %d: dropped group %s as too stale (oldest version %s, max staleness %s)",
                    plan.step,
                    group.prompt_id,
                    group.oldest_version,
                    self.state.max_staleness,
                )
        if plan.batch is not None:
            staleness = [[m.staleness(plan.step).to_json() for m in group.members] for group in plan.batch]
            groups = [list(group.seqs) for group in plan.batch]
            records.append(
                {
                    "kind": "batch",
                    "step": plan.step,
                    "groups": groups,
                    "prompt_ids": [group.prompt_id for group in plan.batch],
                    "staleness": staleness,
                }
            )
        places = self._write(self._assign_log, [json.dumps(r).encode() for r in records])
        # Counted once the write held (a failed one is planned and counted again on the retry).
        for group in plan.dropped:
            self.telemetry.dropped.update(m.pool for m in group.members)
        if plan.batch is not None:
            self._observe_staleness(plan.batch, plan.step)
            self._batch_places[plan.step] = places[-1]

    def _observe_staleness(self, groups: Sequence[Group], step: int) -> None:
        self.telemetry.batches += 1
        for group in groups:
            for member in group.members:
                histogram = self.telemetry.staleness_tokens.setdefault(member.pool, Counter())
                for version, count in member.versions:
                    histogram[step - version] += count

    def commit(self, step: int) -> bool:
        """Mark a step's batch consumed (idempotent); StepError unless it is the step just served."""
        with self._lock:
            if step in self.state.committed:
                return False
            self.state.check_commit(step)
            self._write(self._assign_log, [json.dumps({"kind": "commit", "step": step}).encode()])
            return self.state.commit(step)

    def quarantine(self, step: int, prompt_ids: Sequence[str], reason: str) -> dict[str, Any]:
        """Take the served, uncommitted batch of ``step`` back for good (the trainer cannot train it).

        ``prompt_ids`` must be that batch's, so a late report about a batch already replaced
        cannot take the replacement; StepError otherwise.  The batch is written to
        ``quarantine/`` as it was served, then the decision is logged and applied."""
        with self._lock:
            self.state.check_quarantine(step)
            record = self._batch_record(step)
            if list(prompt_ids) != record["prompt_ids"]:
                raise StepError(f"step {step}: those prompts {NOT_THE_STEPS_BATCH} (it was replaced?)")
            folder = self.dir / QUARANTINE
            folder.mkdir(exist_ok=True)
            fsync_path(self.dir)  # the folder's name (new only the first time; quarantines are rare)
            # The file's bytes, then its name: the quarantine record logged next must never
            # point at a file a power loss emptied or lost.
            with (folder / self._quarantine_file(step)).open("wb") as f:
                f.write(self._payload(step).body)
                sync_file(f)
            fsync_path(folder)
            groups = [list(seqs) for seqs in self.state.assigned[step]]
            entry = {"kind": "quarantine", "step": step, "groups": groups, "prompt_ids": record["prompt_ids"], "reason": reason}  # fmt: skip
            self._write(self._assign_log, [json.dumps(entry).encode()])
            self._note_quarantine(step, self.state.quarantine(step), record["prompt_ids"], reason)
            log.warning(
                "step %d: batch quarantined (%s), kept in %s", step, reason, self.quarantined[-1]["file"]
            )
            return self.quarantined[-1]

    def _quarantine_file(self, step: int) -> str:
        """The file of the step's next quarantined batch: a step may lose more than one."""
        return f"step-{step}-{sum(1 for q in self.quarantined if q['step'] == step)}.json"

    def _note_quarantine(
        self, step: int, groups: tuple[tuple[int, ...], ...], prompt_ids: list[str], reason: str
    ) -> None:
        self.quarantined.append(
            {
                "step": step,
                "prompt_ids": prompt_ids,
                "trajectories": sum(len(seqs) for seqs in groups),
                "reason": reason,
                "file": f"{QUARANTINE}/{self._quarantine_file(step)}",
            }
        )
        del self._batch_places[step]

    def add_evaluation(self, evaluation: Evaluation) -> None:
        record = {**evaluation.model_dump(), "received_unix": time.time()}
        with self._lock:
            self._write(self._eval_log, [json.dumps(record).encode()])
            self.evaluations.append(record)

    def add_trainer_record(self, record: dict[str, Any]) -> int:
        """One step's record of the trainer's metrics.jsonl, logged before it is acknowledged."""
        step = trainer_step(record)
        with self._lock:
            self._write(self._trainer_log, [json.dumps(record).encode()])
            self.trainer_records[step] = record
        return step

    # ------------------------------------------------------------------ reads

    def _read(self, seq: int) -> bytes:
        offset, length = self._offsets[seq]
        self._reader.seek(offset)
        return self._reader.read(length)

    def _payload(self, step: int) -> BatchPayload:
        """Rebuild the batch of an assigned step from the log: the trajectories exactly as logged
        (as validated, re-serialised by their model), spliced in byte for byte."""
        record = self._batch_record(step)
        parts = []
        batch_tokens: list[StalenessStats] = []
        count = 0
        for prompt_id, seqs, staleness in zip(
            record["prompt_ids"], record["groups"], record["staleness"], strict=True
        ):
            lines = b",".join(self._read(seq) for seq in seqs)
            count += len(seqs)
            batch_tokens += [StalenessStats(**s) for s in staleness]
            group_head = json.dumps({"prompt_id": prompt_id, "staleness": staleness})[:-1].encode()
            parts.append(group_head + b', "trajectories": [' + lines + b"]}")
        summary = _combine(batch_tokens)
        head = {
            "step": step,
            "prompts_per_update": self.state.prompts_per_update,
            "samples_per_prompt": self.state.samples_per_prompt,
            "max_staleness": self.state.max_staleness,
            "staleness": summary.to_json(),
        }
        body = json.dumps(head)[:-1].encode() + b', "groups": [' + b",".join(parts) + b"]}"
        return BatchPayload(step, body, len(parts), count)

    def _batch_record(self, step: int) -> dict[str, Any]:
        offset, length = self._batch_places[step]
        self._assign_reader.seek(offset)
        return json.loads(self._assign_reader.read(length))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            state = self.state
            return {
                "step": self.latest_requested_step,
                "committed_step": state.last_committed,
                "groups_ready": len(state.ready),
                "groups_partial": len(state.partial),
                "trajectories": state.received,
                "trajectories_waiting": sum(state.waiting_by_pool().values()),
                "batches": len(state.assigned),
                "quarantined": list(self.quarantined),
                "duplicates": self.duplicates,
                "dropped_stale": state.dropped_groups,
                "dropped_stale_trajectories": state.dropped_trajectories,
                "evaluations": len(self.evaluations),
                "prompts_per_update": state.prompts_per_update,
                "samples_per_prompt": state.samples_per_prompt,
                "max_staleness": state.max_staleness,
            }


def log_line(trajectory: Trajectory) -> bytes:
    """A trajectory as one line of the trajectory log (and of the batches spliced from it).

    Not ``model_dump_json``: it writes a −inf candidate log q (valid: a token the sampler's logits
    ruled out) as ``null``, which no reader takes for a number, so the batch could not be trained
    and the log could not be replayed.  ``-Infinity`` is read back by both ``json.loads`` and
    pydantic; every finite value is written byte for byte as ``model_dump_json`` writes it, so the
    lines already logged keep their digests.
    """
    return pydantic_core.to_json(trajectory.model_dump(), inf_nan_mode="constants")


def _digest(line: bytes) -> bytes:
    return hashlib.blake2b(line, digest_size=16).digest()


def trainer_step(record: Any) -> int:
    """The step of a trainer record: a JSON object with an integer ``step`` ≥ 1 (else ValueError)."""
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError("a trainer record is a JSON object with an integer step >= 1")
    return step


def _combine(stats: Sequence[StalenessStats]) -> StalenessStats:
    measured = [s for s in stats if s.tokens]
    tokens = sum(s.tokens for s in measured)
    if not tokens:
        return StalenessStats(0, None, None, None)
    mean = sum(s.mean * s.tokens for s in measured if s.mean is not None) / tokens
    return StalenessStats(
        tokens,
        min(s.min for s in measured if s.min is not None),
        max(s.max for s in measured if s.max is not None),
        mean,
    )
