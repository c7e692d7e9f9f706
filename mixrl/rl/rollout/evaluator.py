"""``mixrl evaluate``: held-out pass@k by the stability study's protocol (``evaluation.sampler:
bf16``; docs/rollout.md#the-bf16-evaluator).

The rollout worker's evaluation (``sampler: pools``) plays the held-out episodes on the training
pools while training goes on, so an evaluation mixes precisions and versions.  This evaluator owns
one engine that nothing else reloads (the torch engine with BF16 weights, outside the router), and
for the evaluation of step N it

1. waits until the trainer has published version N (the weight store),
2. loads exactly that version into its engine (``/update_weights_from_disk`` with version N),
3. plays ``samplesPerTask`` episodes of every held-out task at the run's temperature over the full
   vocabulary (no top-p, no top-k), checking that every sampled token carries version N,
4. posts the result to the buffer (``POST /evaluations``, ``protocol: bf16``).

Evaluated steps: 0 (the warm start), every ``evaluation.everySteps``, and ``trainer.totalSteps``.
A restarted evaluator reads the buffer's evaluations and goes on with the first step it has not
posted, so no evaluation is lost or counted twice; the trainer keeps every evaluation step's
version in the store until its evaluation is in the buffer
(:func:`mixrl.api.evaluation.protected_versions`).  After
the last step it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import sys
import time
import uuid
from typing import Any

from mixrl.api.evaluation import BF16_PROTOCOL, evaluated_steps, evaluation_steps
from mixrl.api.loader import component_parser
from mixrl.api.trajectory import NO_VERSION, Trajectory
from mixrl.rl.auth import add_auth_arguments
from mixrl.rl.buffer.client import BufferClient, BufferError
from mixrl.rl.engine.client import EngineClient, EngineError
from mixrl.rl.environments.base import TaskLike
from mixrl.rl.environments.registry import offered_tools
from mixrl.rl.rollout.agent import evaluate, run_episode
from mixrl.rl.rollout.router_client import RouterClient
from mixrl.rl.rollout.worker import EPISODE_FAILURES, Loaded, first_leaf, play_heldout, start
from mixrl.rl.serving import stop_on_signals
from mixrl.rl.weights import WeightStore

log = logging.getLogger("mixrl.evaluate")


class VersionGone(RuntimeError):
    """The version to evaluate was removed from the store before it could be evaluated."""


class VersionNotLoaded(RuntimeError):
    """The evaluator's engine refused the version to evaluate, or reports another after loading it."""


class ForeignVersions(RuntimeError):
    """An evaluation episode has tokens of versions other than the one evaluated: something else
    reloaded the evaluator's engine, so its result would mix versions."""


class Evaluator:
    def __init__(
        self, loaded: Loaded, engine: EngineClient, sampler: RouterClient, buffer: BufferClient
    ) -> None:
        self.run = loaded.run
        self.settings = loaded.settings
        self.environment = loaded.environment
        self.tokenizer = loaded.tokenizer
        self.tools = offered_tools(loaded.environment, loaded.settings.tools)
        self.engine = engine
        self.sampler = sampler
        self.buffer = buffer
        self.store = WeightStore(self.run.weights.store)
        self.heldout = list(self.settings.tasks(self.environment, "heldout"))[: self.settings.eval_tasks]
        self.poll_s = 1.0

    async def wait_for_version(self, version: int) -> str:
        """The store path of ``version`` once published; VersionGone if a newer one came without it."""
        while True:
            published = await asyncio.to_thread(self.store.versions)
            if version in published:
                return self.store.path(version)
            if published and published[-1] > version:
                raise VersionGone(
                    f"version {version} is not in the weight store {self.store.url} (have {published})"
                )
            await asyncio.sleep(self.poll_s)

    async def load(self, version: int) -> None:
        path = await self.wait_for_version(version)
        answer = await self.engine.update_weights_from_disk(path, version, flush_cache=True)
        if not answer.get("success"):
            raise VersionNotLoaded(
                f"the evaluator's engine refused version {version}: {answer.get('message')}"
            )
        loaded = await self.engine.get_weight_version()
        if loaded != version:
            raise VersionNotLoaded(f"the evaluator's engine reports version {loaded} after loading {version}")

    async def episode(self, step: int, task: TaskLike, index: int) -> Trajectory:
        """One held-out episode in its own session, every token of it from version ``step``; a
        failed one is played again (:func:`play_heldout`)."""

        async def play() -> Trajectory:
            trajectory = await run_episode(
                self.sampler.generator(f"{self.settings.run or 'mixrl'}-eval-{uuid.uuid4().hex[:12]}"),
                self.environment,
                task,
                self.tokenizer,
                self.sampler.sampling,
                self.settings.max_turns,
                self.settings.max_context_tokens,
                self.settings.format_error_limit,
                run=self.settings.run,
                prompt_id=f"{task.id}/eval",
                sample_index=index,
                tools=self.tools,
                max_observation_tokens=self.settings.max_observation_tokens,
            )
            foreign = versions_of(trajectory) - {step}
            if foreign:  # nothing else reloads this engine: a bug, not noise to average over
                raise ForeignVersions(f"step {step}: tokens of versions {sorted(foreign)} in its evaluation")
            return trajectory

        return await play_heldout(play, task, index, self.settings.run)

    async def evaluate_step(self, step: int) -> dict[str, Any]:
        started = time.monotonic()
        await self.load(step)
        result = await evaluate(
            functools.partial(self.episode, step),
            self.heldout,
            self.settings.eval_samples,
            self.settings.pass_k,
            concurrency=self.settings.concurrency,
        )
        result["seconds"] = time.monotonic() - started
        sampling = self.sampler.sampling
        await self.buffer.post_evaluation(
            step,
            step,
            result["pass_at_k"],
            protocol=BF16_PROTOCOL,
            sampling={"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k},
            tasks=result["tasks"],
            episodes=result["episodes"],
            mean_reward=result["mean_reward"],
            finish_reasons=result["finish_reasons"],
            seconds=result["seconds"],
        )
        scores = ", ".join(f"pass@{k} {v:.3f}" for k, v in result["pass_at_k"].items())
        print(
            f"evaluate: step {step} (weights v{step}, BF16, full vocabulary): {scores} over "
            f"{result['tasks']} tasks x {self.settings.eval_samples} in {result['seconds']:.0f}s",
            flush=True,
        )
        return result

    async def run_all(self) -> int:
        """Evaluate every evaluation step not yet in the buffer; returns how many were skipped
        because their version was gone."""
        done = evaluated_steps(await self.buffer.evaluations())
        gone = 0
        for step in evaluation_steps(self.settings.eval_every, self.settings.total_steps):
            if step in done:
                continue
            try:
                await self.evaluate_step(step)
            except VersionGone as exc:
                gone += 1
                log.error("step %d not evaluated: %s", step, exc)
        return gone


def versions_of(trajectory: Trajectory) -> set[int]:
    """The versions that produced the sampled tokens of ``trajectory``."""
    return {
        v
        for v, m in zip(trajectory.weight_version, trajectory.loss_mask, strict=True)
        if m and v != NO_VERSION
    }


async def serve(args: argparse.Namespace, loaded: Loaded) -> int:
    sampling = loaded.run.evaluation_sampling
    assert sampling is not None, "checked by main()"
    engine = EngineClient(args.engine, auth_token=loaded.auth_token)
    sampler = RouterClient(
        args.engine, sampling, loaded.tokenizer.stop_token_ids, auth_token=loaded.auth_token
    )
    buffer = BufferClient(args.buffer, auth_token=loaded.auth_token)
    evaluator = Evaluator(loaded, engine, sampler, buffer)
    print(
        f"evaluate: run {loaded.run.name!r}: {len(evaluator.heldout)} held-out tasks x "
        f"{loaded.settings.eval_samples} every {loaded.settings.eval_every} steps on the BF16 engine "
        f"{args.engine} (temperature {sampling.temperature}, full vocabulary)",
        flush=True,
    )
    stopping = asyncio.Event()
    remove_signal_handlers = stop_on_signals(stopping)

    async def evaluate_all() -> int:
        # The wait for the engine is part of the job: awaited before it, a SIGTERM was ignored for
        # up to its five minutes.
        await engine.wait_healthy(timeout_s=300)
        return await evaluator.run_all()

    try:
        job = asyncio.create_task(evaluate_all())
        stop = asyncio.create_task(stopping.wait())
        await asyncio.wait({job, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not job.done():
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)  # done with the clients before they close
            return 0
        return 1 if job.result() else 0
    finally:
        remove_signal_handlers()
        for client in (engine, sampler, buffer):
            await client.close()


def build_parser() -> argparse.ArgumentParser:
    parser = component_parser(
        "mixrl evaluate", __doc__, config_help="resolved run JSON (written by mixrl run)"
    )
    parser.add_argument("--engine", required=True, help="URL of the evaluator's own engine")
    parser.add_argument("--buffer", required=True, help="buffer URL")
    parser.add_argument("--tokenizer", default=None, help="as mixrl rollout's --tokenizer")
    parser.set_defaults(worker_index=0, max_steps_ahead=None)
    add_auth_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    started = start(argv, build_parser(), "evaluate")
    if started is None:
        return 2
    args, loaded = started
    if loaded.run.evaluation_sampling is None:
        print(
            "mixrl evaluate: spec.evaluation.sampler: the run evaluates on its pools (set bf16)",
            file=sys.stderr,
        )
        return 2
    status = 1
    # One line and exit code 1, as mixrl rollout says its own: except* since an episode's error
    # comes through evaluate()'s task group.
    try:
        status = asyncio.run(serve(args, loaded))
    except* BufferError as refused:  # a refused post, or a buffer still failing after the budget
        print(f"mixrl evaluate: buffer: {first_leaf(refused)}", file=sys.stderr)
    except* (EngineError, VersionNotLoaded) as engine:  # not healthy in time, or not on the version
        print(f"mixrl evaluate: engine: {first_leaf(engine)}", file=sys.stderr)
    except* ForeignVersions as mixed:
        print(f"mixrl evaluate: evaluation: {first_leaf(mixed)}", file=sys.stderr)
    except* EPISODE_FAILURES as failed:  # a held-out episode's last try (play_heldout)
        print(f"mixrl evaluate: held-out evaluation: {first_leaf(failed)}", file=sys.stderr)
    return status
