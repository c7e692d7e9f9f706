"""``mixrl rollout``: agent loops that turn sampler output into trajectories for the buffer.

The worker runs up to ``rollout.concurrency`` episodes at once as asyncio tasks, each with its own
router session.  Training tasks come in groups: every prompt gets ``samplesPerPrompt`` episodes,
and a group is posted to the buffer (``POST /trajectories``) when all of them have ended, so a
partial group never reaches it.  The trainer's progress is read from the buffer's ``GET /stats``
(``committed_step``: updates done, which is also the weight version the engines were told to load);
the held-out split is evaluated before training starts (step 0, the warm-start model), every
``evaluation.everySteps`` steps and at ``trainer.totalSteps``, and each result is posted to
``POST /evaluations``.  After the last step no new training episodes start.

Every request carries the run's token (``--auth-token-file`` or ``$MIXRL_AUTH_TOKEN``;
docs/auth.md); a buffer that refuses it (401) stops the worker with one line instead of dropping
every group it plays.

SIGTERM / SIGINT stop it cleanly: running episodes are cancelled, their sessions ended, the HTTP
sessions closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixrl.api.launch import SANDBOX_TEMPLATE_FILE
from mixrl.api.loader import component_parser, load_resolved
from mixrl.api.models import tiny_kind
from mixrl.api.resolve import ResolvedRun, SamplingParams
from mixrl.api.trajectory import Trajectory
from mixrl.api.trajectory_check import TrajectoryLimits, trajectory_problem
from mixrl.rl.auth import AuthToken, add_auth_arguments, token_from_args
from mixrl.rl.buffer.client import BufferClient, BufferError
from mixrl.rl.engine.protocol import EngineResponseError, GenerateResult, SamplingMaskMissing
from mixrl.rl.environments.base import SPLITS, Environment, Split, TaskLike
from mixrl.rl.environments.datasets import load_tasks
from mixrl.rl.environments.registry import check_rollout, load_environment, offered_tools
from mixrl.rl.environments.tools import Tool
from mixrl.rl.rollout.agent import EnvironmentFailed, EpisodeAborted, evaluate, run_episode
from mixrl.rl.rollout.chat_tokenizer import ChatTokenizer, load_chat_tokenizer
from mixrl.rl.rollout.router_client import RouterClient, RouterError
from mixrl.rl.rollout.stats import RolloutStats
from mixrl.rl.sandbox.backend import use_sandbox
from mixrl.rl.sandbox.kubernetes import KubePodClient, KubernetesSandbox, SandboxPods
from mixrl.rl.sandbox.runner import SandboxUnavailable

log = logging.getLogger("mixrl.rollout")

EPISODE_FAILURES = (RouterError, EpisodeAborted, EnvironmentFailed, EngineResponseError)
"""An episode that ends in one of these is dropped (with its group); anything else is a bug.
Except :class:`SamplingMaskMissing`: it would recur on every turn (a proxy dropping the field), so it
stops the worker with one line instead of dropping every group."""


@dataclass(frozen=True)
class WorkerSettings:
    """The rollout worker's part of a resolved run."""

    run: str
    sampling: SamplingParams
    max_turns: int
    max_context_tokens: int
    format_error_limit: int
    tools: tuple[str, ...] | None
    """Offered tools by name; None = every tool the environment offers."""
    concurrency: int
    samples_per_prompt: int
    dataset_seed: int
    train_size: int
    heldout_size: int
    total_steps: int | None
    eval_every: int
    eval_tasks: int
    eval_samples: int
    pass_k: tuple[int, ...]
    prompts_per_update: int = 1
    max_steps_ahead: int = 2
    """Pause new groups while the buffer holds this many steps of complete groups (plus the ones in
    flight); 0 = never pause.  Bounds staleness and leaves CPU to the trainer when sampling is fast."""
    worker_index: int = 0
    workers: int = 1
    environment: str = "filetree"
    environment_args: dict[str, Any] | None = None
    max_observation_tokens: int | None = None
    train_path: str | None = None
    """Training tasks from this dataset file; None = the environment's generator."""
    heldout_path: str | None = None
    evaluates: bool = True
    """The worker evaluates the held-out split on the pools (``evaluation.sampler: pools``); with
    ``bf16`` the evaluator does (mixrl.rl.rollout.evaluator)."""

    @property
    def limits(self) -> TrajectoryLimits:
        """What the buffer checks every trajectory against, checked here before posting (ids only
        ≥ 0: the tokenizer's vocabulary may be smaller than the model's, which the buffer and the
        trainer check)."""
        return TrajectoryLimits(
            run=self.run,
            samples_per_prompt=self.samples_per_prompt,
            candidates=self.sampling.top_logprobs_num,
            max_context_tokens=self.max_context_tokens,
            vocab_size=None,
        )

    def tasks(self, environment: Environment[Any], split: Split) -> Sequence[TaskLike]:
        """The tasks of ``split``: from the dataset file the spec names, else generated."""
        if split == "train":
            return load_tasks(environment, split, self.train_size, self.dataset_seed, self.train_path)
        return load_tasks(environment, split, self.heldout_size, self.dataset_seed, self.heldout_path)

    @staticmethod
    def from_run(
        run: ResolvedRun, worker_index: int = 0, max_steps_ahead: int | None = None
    ) -> WorkerSettings:
        rollout, evaluation = run.rollout, run.evaluation
        if max_steps_ahead is None:
            max_steps_ahead = rollout.max_steps_ahead
        # rollout.environment's form and the built-ins' tools were checked by mixrl.api when the run
        # was resolved; an environment of the user's own is checked when the worker loads it.
        if max_steps_ahead < 0:
            raise ValueError(f"max-steps-ahead: must be 0 (no limit) or positive, got {max_steps_ahead}")
        if not 0 <= worker_index < rollout.workers:
            raise ValueError(f"worker-index: {worker_index} outside 0..{rollout.workers - 1}")
        heldout = rollout.dataset.heldout_size
        return WorkerSettings(
            run=run.name,
            sampling=run.sampling,
            max_turns=rollout.max_turns,
            max_context_tokens=run.model.max_context_tokens,
            format_error_limit=rollout.format_error_limit,
            tools=None if rollout.tools is None else tuple(rollout.tools),
            concurrency=rollout.concurrency,
            samples_per_prompt=run.trainer.samples_per_prompt,
            dataset_seed=rollout.dataset.seed,
            train_size=rollout.dataset.train_size,
            heldout_size=heldout,
            total_steps=run.trainer.spec.total_steps,
            eval_every=evaluation.every_steps,
            eval_tasks=min(evaluation.tasks or heldout, heldout),
            eval_samples=evaluation.samples_per_task,
            pass_k=tuple(evaluation.pass_k),
            prompts_per_update=run.trainer.prompts_per_update,
            max_steps_ahead=max_steps_ahead,
            worker_index=worker_index,
            workers=rollout.workers,
            environment=rollout.environment,
            environment_args=dict(rollout.environment_args),
            max_observation_tokens=rollout.max_observation_tokens,
            train_path=rollout.dataset.train,
            heldout_path=rollout.dataset.heldout,
            evaluates=evaluation.sampler == "pools",
        )


def next_evaluation_step(step: int, every: int, total: int | None) -> int | None:
    """The first step after ``step`` to evaluate at: the next multiple of ``every``, capped at ``total``."""
    if total is not None and step >= total:
        return None
    following = (step // every + 1) * every
    return following if total is None else min(following, total)


def training_stream(
    settings: WorkerSettings, environment: Environment[Any], nonce: str
) -> Iterator[tuple[str, TaskLike]]:
    """(prompt_id, task) forever: this worker's shard of the training split, reshuffled every epoch.

    ``nonce`` makes prompt ids unique per worker process, so a restarted worker's groups never
    merge with the groups its predecessor left unfinished.
    """
    tasks = settings.tasks(environment, "train")
    shard = list(tasks[settings.worker_index :: settings.workers])
    if not shard:
        raise ValueError(
            f"rollout.dataset.trainSize: {settings.train_size} tasks leave worker "
            f"{settings.worker_index} of {settings.workers} none"
        )
    epoch = 0
    while True:
        order = list(shard)
        random.Random(f"{settings.dataset_seed}|{settings.worker_index}|{epoch}").shuffle(order)
        for task in order:
            yield f"{task.id}/{nonce}.{epoch}", task
        epoch += 1


class _Group:
    """The episodes of one prompt; complete when every sample has ended (or one failed)."""

    def __init__(self, prompt_id: str, size: int) -> None:
        self.prompt_id = prompt_id
        self.trajectories: list[Trajectory | None] = [None] * size
        self.pending = size
        self.failed = False


class RolloutWorker:
    def __init__(
        self,
        settings: WorkerSettings,
        environment: Environment[Any],
        tokenizer: ChatTokenizer,
        router: RouterClient,
        buffer: BufferClient,
        *,
        stats: RolloutStats | None = None,
        poll_s: float = 1.0,
        progress_s: float = 10.0,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.environment = environment
        self.tools: list[Tool] = offered_tools(environment, settings.tools)
        self.tokenizer = tokenizer
        self.router = router
        self.buffer = buffer
        self.stats = stats or RolloutStats(settings.run)
        self.poll_s = poll_s
        self.progress_s = progress_s
        self.say = say or (lambda line: print(line, flush=True))
        self.nonce = uuid.uuid4().hex[:8]
        self.heldout = list(settings.tasks(environment, "heldout"))[: settings.eval_tasks]
        self.trainer_step = 0
        self.groups_ready = 0
        """Complete groups waiting in the buffer at the last poll."""
        self.groups_in_flight = 0
        self.posted_since_poll = 0
        self.training_done = asyncio.Event()
        self.final_evaluation_posted = asyncio.Event()
        self._gate = asyncio.Semaphore(settings.concurrency)
        self._changed = asyncio.Condition()
        """Notified when the trainer step, the buffer's backlog or the groups in flight change."""

    # ------------------------------------------------------------------ episodes
    async def play(self, task: TaskLike, sample_index: int, prompt_id: str) -> Trajectory:
        """One episode in its own router session; the session is ended however the episode ends."""
        session_id = f"{self.settings.run or 'mixrl'}-{self.nonce}-{uuid.uuid4().hex[:12]}"
        generate = self.router.generator(session_id)

        async def counted(input_ids: list[int], max_new_tokens: int) -> GenerateResult:
            result = await generate(input_ids, max_new_tokens)
            self.stats.turn_received(result)
            return result

        try:
            trajectory = await run_episode(
                counted,
                self.environment,
                task,
                self.tokenizer,
                self.settings.sampling,
                self.settings.max_turns,
                self.settings.max_context_tokens,
                self.settings.format_error_limit,
                run=self.settings.run,
                prompt_id=prompt_id,
                sample_index=sample_index,
                tools=self.tools,
                max_observation_tokens=self.settings.max_observation_tokens,
            )
        finally:
            await self.router.end_session(session_id)
        self.stats.episode_ended(trajectory)
        return trajectory

    async def _group_member(self, group: _Group, task: TaskLike, index: int) -> None:
        try:
            group.trajectories[index] = await self.play(task, index, group.prompt_id)
        except SamplingMaskMissing:
            raise
        except EPISODE_FAILURES as exc:
            if not group.failed:
                log.warning("group %s dropped: an episode failed: %s", group.prompt_id, exc)
            group.failed = True
        finally:
            self._gate.release()
            group.pending -= 1
        if group.pending == 0:
            if group.failed:
                self.stats.groups_dropped += 1
            else:
                await self.post_group([t for t in group.trajectories if t is not None], group.prompt_id)
            self.groups_in_flight -= 1
            await self._notify()

    async def post_group(self, trajectories: list[Trajectory], prompt_id: str, attempts: int = 6) -> None:
        """Post a whole group; retried while the buffer cannot be reached (it stores a repeat once)."""
        limits = self.settings.limits
        for index, trajectory in enumerate(trajectories):
            problem = trajectory_problem(trajectory, limits)
            if problem is not None:  # made here: the buffer would refuse it, and nobody could train it
                log.error("group %s not posted: trajectories[%d].%s", prompt_id, index, problem)
                self.stats.groups_dropped += 1
                return
        for attempt in range(attempts):
            try:
                await self.buffer.post_trajectories(trajectories, group=prompt_id)
                self.stats.group_acknowledged(len(trajectories))
                self.posted_since_poll += 1
                return
            except BufferError as exc:
                if exc.status == 401:  # not this run's token: every later group would fail alike
                    raise
                if exc.status is not None or attempt == attempts - 1:
                    # refused (a bug on one side, or a clash: 409) or unreachable for a minute: say so loudly
                    log.error("group %s not accepted by the buffer: %s", prompt_id, exc)
                    self.stats.groups_dropped += 1
                    return
                await asyncio.sleep(2.0 * (attempt + 1))

    def _room_for_a_group(self) -> bool:
        limit = self.settings.max_steps_ahead * self.settings.prompts_per_update
        backlog = self.groups_ready + self.posted_since_poll + self.groups_in_flight
        return self.training_done.is_set() or limit == 0 or backlog < limit

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def produce(self) -> None:
        """Start groups while the trainer still needs data; each episode holds one concurrency slot."""
        async with asyncio.TaskGroup() as running:
            for prompt_id, task in training_stream(self.settings, self.environment, self.nonce):
                async with self._changed:
                    await self._changed.wait_for(self._room_for_a_group)
                if self.training_done.is_set():
                    break
                self.groups_in_flight += 1
                group = _Group(prompt_id, self.settings.samples_per_prompt)
                for index in range(self.settings.samples_per_prompt):
                    await self._gate.acquire()
                    running.create_task(self._group_member(group, task, index))

    # ------------------------------------------------------------------ evaluation
    async def read_buffer(self) -> bool:
        """Refresh the trainer step (``committed_step``: updates done) and the buffer's backlog."""
        try:
            stats = await self.buffer.stats()
        except BufferError as exc:
            log.warning("cannot read the trainer step from the buffer: %s", exc)
            return False
        committed = stats.get("committed_step")
        self.trainer_step = int(committed) if committed is not None else 0
        self.groups_ready = int(stats.get("groups_ready") or 0)
        self.posted_since_poll = 0
        total = self.settings.total_steps
        if total is not None and self.trainer_step >= total:
            self.training_done.set()
        await self._notify()
        return True

    async def poll_buffer(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.read_buffer()

    async def evaluate_heldout(self, step: int) -> dict[str, Any]:
        started = time.monotonic()
        result = await evaluate(
            self._heldout_episode,
            self.heldout,
            self.settings.eval_samples,
            self.settings.pass_k,
            concurrency=self.settings.concurrency,
        )
        result["step"] = step
        result["seconds"] = time.monotonic() - started
        scores = ", ".join(f"pass@{k} {v:.3f}" for k, v in result["pass_at_k"].items())
        self.say(
            f"rollout: held-out evaluation at step {step} (weights v{result['weight_version']}): {scores} "
            f"over {result['tasks']} tasks x {self.settings.eval_samples} in {result['seconds']:.0f}s"
        )
        self.stats.evaluation_done(result)
        try:
            await self.buffer.post_evaluation(
                step,
                max(result["weight_version"], 0),
                result["pass_at_k"],
                tasks=result["tasks"],
                episodes=result["episodes"],
                mean_reward=result["mean_reward"],
                finish_reasons=result["finish_reasons"],
                seconds=result["seconds"],
            )
        except BufferError as exc:
            if exc.status == 401:
                raise
            log.error("evaluation of step %d not accepted by the buffer: %s", step, exc)
        return result

    async def _heldout_episode(self, task: TaskLike, index: int, attempts: int = 3) -> Trajectory:
        """A held-out episode; one whose engine failed is played again (a lost one would bias pass@k)."""
        for _ in range(attempts - 1):
            try:
                return await self.play(task, index, f"{task.id}/eval")
            except SamplingMaskMissing:
                raise
            except EPISODE_FAILURES as exc:
                log.warning("held-out episode of %s failed (%s); playing it again", task.id, exc)
        return await self.play(task, index, f"{task.id}/eval")

    async def watch_trainer(self) -> None:
        """Evaluate at every evaluation step the trainer reaches; stop training after the last step."""
        total = self.settings.total_steps
        target = next_evaluation_step(self.trainer_step, self.settings.eval_every, total)
        while target is not None:
            await self._wait_for_step(target)
            step = self.trainer_step
            await self.evaluate_heldout(step)
            target = next_evaluation_step(step, self.settings.eval_every, total)
        self.final_evaluation_posted.set()

    async def _wait_for_step(self, step: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.trainer_step >= step)

    # ------------------------------------------------------------------ the whole worker
    async def run(self, stopping: asyncio.Event) -> None:
        """Evaluate the starting weights, then produce and evaluate until ``stopping`` is set."""
        progress = asyncio.create_task(self.report_progress())
        try:
            evaluates = self.settings.evaluates
            if await self.read_buffer() and self.trainer_step == 0 and evaluates:
                # The warm-start baseline, measured before any training episode competes for the engines.
                await _until(stopping, self.evaluate_heldout(0))
            if stopping.is_set():
                return
            async with asyncio.TaskGroup() as tasks:
                jobs = [
                    tasks.create_task(job)
                    for job in (
                        self.produce(),
                        self.poll_buffer(),
                        *([self.watch_trainer()] if evaluates else []),
                    )
                ]
                await stopping.wait()
                for job in jobs:
                    job.cancel()
        finally:
            progress.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await progress
            self.say(self.stats.progress_line(self.trainer_step, self.settings.total_steps, final=True))

    async def report_progress(self) -> None:
        while True:
            await asyncio.sleep(self.progress_s)
            self.say(self.stats.progress_line(self.trainer_step, self.settings.total_steps))


async def _until(stopping: asyncio.Event, work: Any) -> None:
    """Run ``work`` unless ``stopping`` is set first (then cancel it)."""
    job = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({job, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in (job, waiter):
            if not future.done():
                future.cancel()
        await asyncio.gather(job, waiter, return_exceptions=True)
    if job.done() and not job.cancelled() and (failure := job.exception()) is not None:
        raise failure


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = component_parser("mixrl rollout", __doc__)
    parser.add_argument("--router", required=True, help="router URL (or one engine's URL: same API)")
    parser.add_argument("--buffer", required=True, help="buffer URL")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="mixrl word-tokenizer JSON or a Hugging Face tokenizer directory (default: model.tokenizer, "
        "else model.path; for tiny: models the word tokenizer over the environment's vocabulary)",
    )
    parser.add_argument(
        "--worker-index", type=int, default=0, help="this worker's index among rollout.workers"
    )
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0 = none)")
    parser.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    parser.add_argument("--poll-every", type=float, default=1.0, help="seconds between trainer-step reads")
    parser.add_argument(
        "--max-steps-ahead",
        type=int,
        default=None,
        help="pause new groups while the buffer holds this many steps of data (0 = never; "
        "default: the run's rollout.maxStepsAhead)",
    )
    add_auth_arguments(parser)
    return parser


def tokenizer_location(run: ResolvedRun, flag: str | None) -> str | None:
    """``--tokenizer``, else the model's own (``model.tokenizer``, else ``model.path``: what the
    operator's pods read), else None for a ``tiny:`` model: the word tokenizer over the environment's
    vocabulary."""
    if flag:
        return flag
    if tiny_kind(run.model.path) is not None:
        return None
    return run.model.tokenizer or run.model.path


@dataclass(frozen=True)
class Loaded:
    run: ResolvedRun
    settings: WorkerSettings
    environment: Environment[Any]
    tokenizer: ChatTokenizer
    auth_token: AuthToken | None
    sandbox_pods: KubernetesSandbox | None = None
    """``spec.rollout.sandbox``: started and closed by :func:`serve`."""


def load_worker(args: argparse.Namespace) -> Loaded:
    """The run, settings, environment, tokenizer and token of a worker's (or evaluator's) arguments."""
    run = load_resolved(args.config)  # a RunConfigError is a ValueError: one line
    settings = WorkerSettings.from_run(run, args.worker_index, args.max_steps_ahead)
    pods = sandbox_pods(run, Path(args.config).parent) if run.rollout.sandbox is not None else None
    if pods is not None:  # every environment of this process (the check's too) runs its commands in pods
        use_sandbox(lambda _config: pods)
    problems = check_rollout(run.rollout)
    if problems:
        raise ValueError(problems[0])
    environment = load_environment(settings.environment, settings.environment_args)
    for split in SPLITS:  # a dataset row the environment cannot read: one line now, not a traceback later
        settings.tasks(environment, split)
    tokenizer = load_chat_tokenizer(
        tokenizer_location(run, args.tokenizer),
        run.model.chat_template,
        environment.vocabulary(),
        settings.environment,
    )
    auth_token = token_from_args(args)  # an AuthConfigError is a ValueError
    return Loaded(run, settings, environment, tokenizer, auth_token, pods)


def sandbox_pods(run: ResolvedRun, config_dir: Path) -> KubernetesSandbox:
    """``spec.rollout.sandbox``: this worker's warm pool of sandbox pods, from the pod manifest the
    operator put beside the resolved run, named after this pod (``POD_NAME``); SandboxUnavailable
    (a ValueError's one line) outside a pod with the rollout's service account."""
    spec = run.rollout.sandbox
    assert spec is not None
    path = config_dir / SANDBOX_TEMPLATE_FILE
    try:
        template = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"spec.rollout.sandbox: cannot read the sandbox pod manifest {path}: {exc}"
        ) from None
    worker = os.environ.get("POD_NAME")
    if not worker:
        raise ValueError(
            "spec.rollout.sandbox: POD_NAME is not set (the worker names its sandbox pods after its pod)"
        )
    try:
        client = KubePodClient.in_cluster()
    except SandboxUnavailable as exc:
        raise ValueError(str(exc)) from None
    pool = SandboxPods(
        client, template, worker=worker, size=spec.pool_size, ready_timeout_s=spec.ready_timeout_seconds
    )
    return KubernetesSandbox(pool)


async def serve(
    args: argparse.Namespace,
    settings: WorkerSettings,
    environment: Environment[Any],
    tokenizer: ChatTokenizer,
    auth_token: AuthToken | None = None,
    sandbox_pods: KubernetesSandbox | None = None,
) -> None:
    stopping = asyncio.Event()
    if sandbox_pods is not None:  # deletes an earlier incarnation's pods, starts filling the pool
        await sandbox_pods.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    stats = RolloutStats(settings.run)
    metrics = await stats.serve_metrics(args.metrics_port) if args.metrics_port else None
    router = RouterClient(args.router, settings.sampling, tokenizer.stop_token_ids, auth_token=auth_token)
    buffer = BufferClient(args.buffer, auth_token=auth_token)
    worker = RolloutWorker(
        settings,
        environment,
        tokenizer,
        router,
        buffer,
        stats=stats,
        poll_s=args.poll_every,
        progress_s=args.progress_every,
    )
    print(
        f"rollout: worker {settings.worker_index}/{settings.workers} of run {settings.run!r}: "
        f"environment {settings.environment}, {settings.concurrency} concurrent episodes, groups of {settings.samples_per_prompt}, "
        f"{len(worker.heldout)} held-out tasks; router {args.router}, buffer {args.buffer}",
        flush=True,
    )
    try:
        await worker.run(stopping)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await router.close()
        await buffer.close()
        if metrics is not None:
            await metrics.cleanup()
        if sandbox_pods is not None:  # every pod of this worker is deleted
            await sandbox_pods.close()


def start(
    argv: list[str], parser: argparse.ArgumentParser, command: str
) -> tuple[argparse.Namespace, Loaded] | None:
    """The arguments and the loaded worker of ``mixrl <command>`` (rollout or evaluate), its logs
    set up; None after printing one line when :func:`load_worker` refuses them."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {command} %(levelname)s %(message)s")
    try:
        return args, load_worker(args)
    except ValueError as exc:
        print(f"mixrl {command}: {exc}", file=sys.stderr)
        return None


def main(argv: list[str]) -> int:
    started = start(argv, build_parser(), "rollout")
    if started is None:
        return 2
    args, loaded = started
    status = 0
    try:
        asyncio.run(
            serve(
                args,
                loaded.settings,
                loaded.environment,
                loaded.tokenizer,
                loaded.auth_token,
                loaded.sandbox_pods,
            )
        )
    except* BufferError as refused:  # raised only for a 401, through the worker's task groups
        print(f"mixrl rollout: buffer: {_first_leaf(refused)}", file=sys.stderr)
        status = 1
    except* SamplingMaskMissing as missing:  # every turn would fail alike: one line, not a drop per group
        print(f"mixrl rollout: engine: {_first_leaf(missing)}", file=sys.stderr)
        status = 1
    return status


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception inside nested exception groups (the task groups nest them)."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
