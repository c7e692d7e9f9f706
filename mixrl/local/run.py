"""``mixrl run FILE``: an RLRun on this machine, with the same components as in the cluster.

Starts the buffer, one torch engine per pool replica (each at its emulated precision), the router,
the rollout workers (``rollout.workers``, each on its own shard of the training split) and the
trainer as local processes on loopback; shows progress; stops them in
order on Ctrl-C or SIGTERM or when the trainer finishes; writes ``runs/<name>/`` (resolved config,
logs, metrics.jsonl, evaluations.jsonl, weights, checkpoint, report.png, report.md).  One run at a
time uses a run directory: another ``mixrl run`` on it is refused with one line (``.lock``).

Each start draws a fresh token (``secrets.token_urlsafe``), writes it to ``runs/<name>/auth-token``
(mode 0600) and passes ``--auth-token-file`` to every component, servers and clients alike: other
users and processes on the machine cannot reload the engines or write to the buffer (docs/auth.md).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from mixrl.api.errors import InvalidSpec
from mixrl.api.evaluation import evaluation_steps
from mixrl.api.launch import (
    ONE_MACHINE,
    SERVER_PORTS,
    Component,
    Where,
    component_command,
    port_file,
    process_name,
)
from mixrl.api.loader import ManifestUnreadable, load_rlrun
from mixrl.api.models import CollapseSpec, RLRun
from mixrl.api.plain_text import plain_text
from mixrl.api.resolve import ResolvedPool, ResolvedRun, initial_replicas, resolve
from mixrl.local.processes import MIXRL, Process, ProcessStartError, StopSignals, wait_healthy
from mixrl.local.report import (
    EVALUATIONS,
    buffer_directory,
    buffer_evaluations,
    process_elapsed,
    step_records,
    trainer_processes,
    write_report,
)
from mixrl.rl.auth import AuthToken, write_token_file
from mixrl.rl.health.collapse import assess

MAX_TRAINER_RESTARTS = 3
# One intra-op thread per process: the local run has more processes than cores, and OpenMP threads
# spinning on oversubscribed cores cost far more than the parallelism gains on a tiny model.
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
AUTH_TOKEN_FILE = "auth-token"
LOOPBACK = "127.0.0.1"
TOKEN_BYTES = 32
LOCK_FILE = ".lock"
STOP_ORDER = ("rollout", "evaluator", "trainer", "router", "engine", "buffer")
"""Producers first, then the trainer, the router, the engines and the buffer last, so that no
trajectory in flight is lost (by name prefix; a component of no other kind is stopped last)."""


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the supervisor (:class:`StopSignals`)."""


class RunDirectoryInUse(Exception):
    """Another ``mixrl run`` holds the run directory; the message says which, in one line."""


class RunLock:
    """An exclusive lock (``flock``) on ``<run_dir>/.lock`` for as long as one ``mixrl run`` uses
    the directory; the file holds the process id of the run that holds it.

    A second run on the same directory would write a new auth-token (locking the first run's
    components out of each other), its own pid and port files, start a second buffer on the same
    logs, and its trainer's resume would delete the first's newer weight versions.  The kernel
    drops the lock when the process ends, however it ends, so no stale lock survives a crash.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock, or RunDirectoryInUse at once (never wait for another run to end)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            # (no pid yet: the other run has locked the file and not yet written its pid)
            who = f"pid {holder}" if holder.isdigit() else "its pid not written yet"
            raise RunDirectoryInUse(
                f"{self.run_dir} is in use by another mixrl run ({who}); stop it first or "
                "give another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        # The file stays: deleting it would let a run that opened it just before lock a file that is
        # no longer the one the next run locks.
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def clear_run_directory(run_dir: Path) -> None:
    """``--fresh``: delete everything in the run directory but its lock, which this run holds (a
    lock file deleted and made anew would be another file, which another run could lock too)."""
    for entry in run_dir.iterdir():
        if entry.name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def default_cache_dir() -> Path:
    return Path(os.environ.get("MIXRL_CACHE", Path.home() / ".cache" / "mixrl"))


def local_run(resolved: ResolvedRun, run_dir: Path) -> ResolvedRun:
    """The same run with the weight store under the run directory (this machine's disk)."""
    weights = resolved.weights.model_copy(update={"store": str((run_dir / "weights").resolve())})
    return resolved.model_copy(update={"weights": weights})


class Supervisor:
    def __init__(self, run: ResolvedRun, run_dir: Path, model_path: str, tokenizer_path: str) -> None:
        self.run = run
        self.run_dir = run_dir
        self.components: list[Process] = []
        self.rollouts: list[Process] = []
        """The ``rollout.workers`` rollout workers, by index; worker 0 evaluates on the pools."""
        self.evaluator: Process | None = None
        """``evaluation.sampler: bf16``: mixrl evaluate (started with the rest)."""
        self.evaluator_restarts = 0
        # A new token per start: components of an earlier start (or anyone who read its file)
        # cannot act on this one.  Every component reads it from the file, never from its argv.
        token_path = run_dir / AUTH_TOKEN_FILE
        write_token_file(token_path, AuthToken(secrets.token_urlsafe(TOKEN_BYTES)))
        self.logs = run_dir / "logs"
        self.replicas_path = run_dir / "replicas.json"
        ports = run_dir / "ports"
        ports.mkdir(parents=True, exist_ok=True)
        # The servers' URLs and the engines' first checkpoint are added as start() learns them.
        self.where = Where(
            program=MIXRL,
            host=LOOPBACK,
            config=str(run_dir / "resolved.json"),
            auth_token_file=str(token_path),
            buffer_dir=str(buffer_directory(run_dir)),
            trainer_run_dir=str(run_dir),
            port_dir=str(ports),
            replicas_file=str(self.replicas_path),
            # Every engine here reads the store as it is, so the trainer reloads them directly.
            reload_through_router=True,
            trainer_model_path=model_path,
            buffer_model_path=model_path,
            tokenizer=tokenizer_path,
            # nodes × gpusPerNode trainer processes (processes per node on gpuType cpu), all here.
            rendezvous=ONE_MACHINE,
            torchrun=(sys.executable, "-m", "torch.distributed.run"),
        )

    def _component(self, component: Component, pool: ResolvedPool | None = None, replica: int = 0) -> Process:
        """The process of ``component`` as the launch table starts it, with its log and port files;
        ``replica``: an engine's among its pool's, a rollout worker's index."""
        where = self.where
        workers = self.run.rollout.workers
        if component == "rollout":
            where = replace(where, worker_index=str(replica))
        name = process_name(component, pool, replica, workers)
        port = Path(port_file(where, component, pool, replica)) if component in SERVER_PORTS else None
        command = component_command(self.run, component, where, pool, replica)
        process = Process(name, command, self.logs / f"{name}.log", port_file=port)
        self.components.append(process)
        return process

    def start(
        self, initial_version_path: str, initial_version: int, check_signals: Callable[[], None]
    ) -> None:
        """Start every component, waiting for the servers to be healthy; ``check_signals`` between
        waits (:meth:`StopSignals.check`)."""
        run = self.run
        self.where = replace(
            self.where, engine_model_path=initial_version_path, engine_weight_version=initial_version
        )
        buffer = self._component("buffer")
        buffer.start()
        engines = self.pool_engines()
        for engine in (e for pool in engines.values() for e in pool):
            engine.start(env=SINGLE_THREAD)
        # evaluation.sampler bf16: the evaluator's own engine, which the router never sees.
        evaluator_engine = None
        if run.evaluation_pool is not None:
            evaluator_engine = self._component("engine", run.evaluation_pool)
            evaluator_engine.start(env=SINGLE_THREAD)
        own = [evaluator_engine] if evaluator_engine is not None else []
        wait_healthy(
            [buffer, *(e for pool in engines.values() for e in pool), *own],
            timeout=300,
            between_polls=check_signals,
        )
        replicas = {name: [engine.url for engine in pool] for name, pool in engines.items()}
        self.replicas_path.write_text(json.dumps(replicas, indent=2))
        self.where = replace(self.where, buffer_url=buffer.url)
        if evaluator_engine is not None:
            self.where = replace(self.where, evaluator_engine_url=evaluator_engine.url)
            self.evaluator = self._component("evaluator")
            self.evaluator.start(env=SINGLE_THREAD)

        router = self._component("router")
        router.start()
        wait_healthy([router], timeout=60, between_polls=check_signals)
        self.where = replace(self.where, router_url=router.url)

        self.trainer = self._component("trainer")
        self.trainer.start(env=SINGLE_THREAD)
        for worker in self.rollout_workers():
            worker.start(env=SINGLE_THREAD)

    def pool_engines(self) -> dict[str, list[Process]]:
        """Each pool's engines (not started): its ``initial_replicas``, the number the operator seeds
        a new SamplerPool with; nothing scales them here."""
        return {
            pool.name: [self._component("engine", pool, i) for i in range(pool.initial_replicas)]
            for pool in self.run.pools
        }

    def rollout_workers(self) -> list[Process]:
        """The ``rollout.workers`` rollout processes (not started), each with its own index, log and
        name: the worker plays only its index's shard of the training split, so all of them together
        cover it, as the cluster's StatefulSet of that many pods does."""
        self.rollouts = [self._component("rollout", replica=i) for i in range(self.run.rollout.workers)]
        return self.rollouts

    def stop(self) -> None:
        """Stop every component, in :data:`STOP_ORDER`.  One that cannot be stopped is reported and
        the others are still stopped: each runs in its own session, so a component left behind here
        runs on as an orphan."""

        def rank(component: Process) -> int:
            return next(
                (i for i, kind in enumerate(STOP_ORDER) if component.name.startswith(kind)), len(STOP_ORDER)
            )

        for component in sorted(self.components, key=rank):
            try:
                if component.name.startswith("trainer"):  # it ends its step and saves a checkpoint
                    component.stop(self.run.trainer.spec.stop_grace_seconds)
                else:
                    component.stop()
            except Exception as exc:
                print(f"mixrl run: stopping {component.name} failed: {exc!r}", file=sys.stderr, flush=True)

    def revive_evaluator(self) -> None:
        """Restart a failed evaluator (a few times): it goes on from the evaluations in the buffer,
        and the trainer keeps the versions it has still to evaluate."""
        evaluator = self.evaluator
        if evaluator is None or evaluator.alive or evaluator.returncode == 0:
            return
        if self.evaluator_restarts < MAX_TRAINER_RESTARTS:
            self.evaluator_restarts += 1
            print(
                f"mixrl run: evaluator exited with code {evaluator.returncode}; restarting it "
                f"({self.evaluator_restarts}/{MAX_TRAINER_RESTARTS})",
                flush=True,
            )
            evaluator.start(env=SINGLE_THREAD)

    def failed_component(self) -> Process | None:
        for component in self.components:
            if component is self.trainer or component.alive:
                continue
            # Servers must stay up; the rollout workers and the evaluator may end on their own after
            # the last step.
            may_end = component is self.evaluator or any(component is w for w in self.rollouts)
            if not may_end or component.returncode != 0:
                return component
        if not self.trainer.alive and self.trainer.returncode != 0:
            return self.trainer
        return None


def _number(value: Any, default: float = 0.0) -> float:
    """A figure of a telemetry record, or ``default`` when the record holds something else there."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if is_number else default


class Progress:
    """Periodic progress lines: step, reward, held-out pass@k, KL, throughput, ETA, and a warning
    while a sign of collapse is raised (mixrl.rl.health.collapse, thresholds of spec.health)."""

    def __init__(self, run_dir: Path, total_steps: int | None, collapse: CollapseSpec | None = None) -> None:
        self.run_dir = run_dir
        self.total = total_steps
        self.collapse = collapse or CollapseSpec()
        self.warned: set[tuple[str, str]] = set()
        self.started = time.monotonic()
        self.shown_step = 0
        self.last_line = 0.0
        self.first_seen: tuple[int, float] | None = None
        """The first step this progress saw and when: the pace when no record has a clock."""

    def update(self, force: bool = False) -> None:
        records = step_records(self.run_dir / "metrics.jsonl")
        # The buffer's own file, as the evaluations arrive (runs/<name>/evaluations.jsonl is its
        # copy, made once the components have stopped).
        evaluations = step_records(buffer_evaluations(self.run_dir))
        step = records[-1]["step"] if records else 0
        now = time.monotonic()
        if records and self.first_seen is None:
            self.first_seen = (step, now)
        if not force and step == self.shown_step and now - self.last_line < 15:
            return
        self.shown_step, self.last_line = step, now
        elapsed = now - self.started
        parts = [f"[{elapsed:6.0f}s]", f"step {step}" + (f"/{self.total}" if self.total else "")]
        if records:
            last = records[-1]
            parts += [
                f"reward {_number(last.get('reward')):.3f}",
                f"kl {_number(last.get('kl_k3')):.4f}",
                f"extreme {_number(last.get('extreme_ratio')):.3%}",
                f"{_number(last.get('tokens_per_s')):.0f} tok/s",
            ]
            rate = self.rate(records, step, now)
            if self.total and rate is not None and rate > 0:
                parts.append(f"ETA {max(self.total - step, 0) / rate:.0f}s")
        else:
            parts.append("collecting the first batch…")
        if evaluations:
            e = evaluations[-1]
            rates = e.get("pass_at_k")
            parts.append(
                "held-out "
                + " ".join(
                    f"pass@{k} {_number(v):.3f}"
                    for k, v in (rates if isinstance(rates, dict) else {}).items()
                )
                + f" (step {e['step']})"
            )
        raised = assess(records, self.collapse).raised
        if raised:
            parts.append("WARNING collapse risk: " + ", ".join(sign.short() for sign in raised))
        print("  ".join(parts), flush=True)
        for sign in raised:  # the figures once per sign and scope; the progress line repeats the gist
            if (sign.name, sign.scope) not in self.warned:
                self.warned.add((sign.name, sign.scope))
                print(f"mixrl run: warning: {sign.describe()}", flush=True)

    def rate(self, records: list[dict[str, Any]], step: int, now: float) -> float | None:
        """Steps per second of the trainer process now running: its own steps over its own clock.

        A resumed or restarted trainer starts ``elapsed`` at zero while its steps go on from its
        checkpoint, so the run's step over that clock would overstate the pace (and understate the
        ETA) by the steps of every earlier process."""
        processes = trainer_processes(records)
        clock = process_elapsed(processes[-1]) if processes else None
        if clock is not None and clock > 0:
            before = processes[-2][-1]["step"] if len(processes) > 1 else 0
            return (step - before) / clock
        # Records without a clock: the steps seen since this progress began, over its own time.
        if self.first_seen is None or now <= self.first_seen[1]:
            return None
        return (step - self.first_seen[0]) / (now - self.first_seen[1])


def evaluations_to_run_dir(run_dir: Path) -> None:
    source = buffer_evaluations(run_dir)
    if source.exists():
        shutil.copyfile(source, run_dir / EVALUATIONS)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mixrl run",
        description=plain_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", help="RLRun YAML")
    parser.add_argument("--run-dir", default=None, help="output directory (default: runs/<name>)")
    parser.add_argument("--steps", type=int, default=None, help="override trainer.totalSteps")
    parser.add_argument("--fresh", action="store_true", help="delete an existing run directory first")
    parser.add_argument("--cache-dir", default=None, help="cache for tiny models and warm starts")
    args = parser.parse_args(argv)
    try:
        rlrun = load_rlrun(args.file)
    except ManifestUnreadable as exc:
        print(f"mixrl run: {exc}", file=sys.stderr)
        return 2
    except InvalidSpec as exc:
        for problem in exc.problems:
            print(f"{args.file}: {problem}", file=sys.stderr)
        return 1
    if args.steps is not None:
        if args.steps <= 0:
            print("mixrl run: --steps: must be positive", file=sys.stderr)
            return 2
        rlrun.spec.trainer.total_steps = args.steps
    bad = [p.name for p in rlrun.spec.sampler_pools if p.engine != "torch"]
    if bad:
        print(
            f"mixrl run: spec.samplerPools: pools {bad} use SGLang, which needs GPUs; local runs use "
            "engine: torch (set gpuType: cpu)",
            file=sys.stderr,
        )
        return 1
    if not any(initial_replicas(p.min_replicas, p.max_replicas) for p in rlrun.spec.sampler_pools):
        print(
            "mixrl run: spec.samplerPools: every pool has maxReplicas 0, so no engine would start "
            "(mixrl run scales no pool)",
            file=sys.stderr,
        )
        return 1
    if rlrun.spec.rollout.sandbox is not None:
        print(
            "mixrl run: spec.rollout.sandbox: sandbox pods exist only in a cluster (the operator "
            "creates them); remove it to run the environment's sandboxed commands in the local "
            "bubblewrap sandbox (docs/sandbox.md)",
            file=sys.stderr,
        )
        return 1
    from mixrl.rl.environments.registry import check_rollout  # imports the user's environment

    environment_problems = check_rollout(rlrun.spec.rollout)
    for environment_problem in environment_problems:
        print(f"{args.file}: {environment_problem}", file=sys.stderr)
    if environment_problems:
        return 1

    run_dir = Path(args.run_dir or Path("runs") / rlrun.metadata.name)
    # Before anything is written in the run directory (and before --fresh deletes it).
    try:
        lock = RunLock(run_dir).acquire()
    except RunDirectoryInUse as exc:
        print(f"mixrl run: {exc}", file=sys.stderr)
        return 1
    with lock:
        return run_in(run_dir, rlrun, args.file, fresh=args.fresh, cache_dir=args.cache_dir)


def run_in(run_dir: Path, rlrun: RLRun, file: str, *, fresh: bool, cache_dir: str | None) -> int:
    """The run of ``rlrun`` in ``run_dir``, whose lock the caller holds; the exit status."""
    from mixrl.local.prepare import prepare_model  # torch and transformers load from here on

    if fresh:
        clear_run_directory(run_dir)
    resolved = local_run(resolve(rlrun), run_dir)
    (run_dir / "resolved.json").write_text(resolved.model_dump_json(indent=2))
    (run_dir / "rlrun.yaml").write_text(Path(file).read_text())

    print(
        f"mixrl run: {rlrun.metadata.name}: {len(resolved.pools)} pools "
        f"({', '.join(f'{p.name}={p.weight_precision}/kv-{p.kv_cache_dtype}' for p in resolved.pools)}), "
        f"output in {run_dir}",
        flush=True,
    )
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    prepared = prepare_model(resolved, cache, run_dir)
    supervisor = Supervisor(resolved, run_dir, prepared.model_path, prepared.tokenizer_path)
    progress = Progress(run_dir, resolved.trainer.spec.total_steps, rlrun.spec.health.collapse)
    status = supervise(supervisor, progress, prepared.initial_version_path, prepared.initial_version)
    if status == START_FAILED:
        return 1
    progress.update(force=True)
    if (run_dir / "metrics.jsonl").exists():
        print(f"mixrl run: report at {write_report(run_dir)}")
    return status


START_FAILED = -1
"""supervise(): a component could not start (said in one line); no report is written."""


def supervise(
    supervisor: Supervisor, progress: Progress, initial_version_path: str, initial_version: int
) -> int:
    """Start the components, watch them until the trainer is done, and stop them all, whatever
    happens meanwhile: 0, 1 (a component failed), 130 (SIGINT or SIGTERM) or START_FAILED.

    The first SIGINT or SIGTERM stops the run; any later one is ignored while the components stop
    (:class:`StopSignals`): each runs in its own session, so one not stopped here would be orphaned.
    """
    run_dir, resolved = supervisor.run_dir, supervisor.run
    status = 0
    with StopSignals(Interrupted) as signals:
        try:
            supervisor.start(initial_version_path, initial_version, signals.check)
            print("mixrl run: all components up; training", flush=True)
            restarts = 0
            while supervisor.trainer.alive or supervisor.trainer.returncode != 0:
                if not supervisor.trainer.alive and restarts < MAX_TRAINER_RESTARTS:
                    # As Kubernetes restarts a failed trainer pod: it resumes from its checkpoint,
                    # and the buffer hands it the same batches again, so no trajectory is lost.
                    restarts += 1
                    print(
                        f"mixrl run: trainer exited with code {supervisor.trainer.returncode}; restarting "
                        f"it ({restarts}/{MAX_TRAINER_RESTARTS}) from its last checkpoint",
                        flush=True,
                    )
                    supervisor.trainer.start(env=SINGLE_THREAD)
                    continue
                supervisor.revive_evaluator()
                failed = supervisor.failed_component()
                if failed is not None:
                    print(
                        f"mixrl run: {failed.name} exited with code {failed.returncode}; last log lines "
                        f"({failed.log_path}):\n{failed.log_tail()}",
                        file=sys.stderr,
                    )
                    status = 1
                    break
                progress.update()
                time.sleep(1.0)
                signals.check()
            if status == 0 and supervisor.trainer.returncode not in (0, None):
                failed = supervisor.trainer
                print(f"mixrl run: trainer failed; last log lines:\n{failed.log_tail()}", file=sys.stderr)
                status = 1
            if status == 0:
                wait_for_final_evaluation(run_dir, resolved, supervisor, signals.check)
        except ProcessStartError as exc:
            # One line naming the component and its own last word; the others are stopped below.
            print(f"mixrl run: {exc}", file=sys.stderr, flush=True)
            status = START_FAILED
        except Interrupted:
            print("\nmixrl run: interrupted; stopping components (collected data is kept)", flush=True)
            status = 130
        finally:
            signals.stopping = True  # first: a signal from here on is ignored while they stop
            supervisor.stop()
        if status != START_FAILED:
            evaluations_to_run_dir(run_dir)
    return status


def wait_for_final_evaluation(
    run_dir: Path,
    run: ResolvedRun,
    supervisor: Supervisor,
    check_signals: Callable[[], None],
    timeout: float = 180,
) -> None:
    """Rollout worker 0 (or the BF16 evaluator, which may be several evaluations behind)
    evaluates after the last step; keep the engines up until it has.  ``check_signals`` between
    waits: :meth:`StopSignals.check`."""
    total = run.trainer.spec.total_steps
    if total is None:
        return
    evaluator = supervisor.evaluator or supervisor.rollouts[0]  # worker 0 evaluates on the pools
    if supervisor.evaluator is not None:
        timeout *= 1 + len(list(evaluation_steps(run.evaluation.every_steps, total)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        supervisor.revive_evaluator()
        if not evaluator.alive:
            break
        evaluations = step_records(buffer_evaluations(run_dir))
        if evaluations and evaluations[-1]["step"] >= total:
            return
        time.sleep(1.0)
        check_signals()
    print("mixrl run: no held-out evaluation of the final step arrived in time", file=sys.stderr)
