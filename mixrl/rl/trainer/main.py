"""``mixrl trainer``: take batches from the buffer, update the policy, publish each new version.

Before the first step the trainer publishes the weights it holds if the store lacks them (version 0
from ``model.path`` on a fresh run), so engines always have a version to start from.  A ``tiny:``
model is built first, by ``mixrl prepare-model`` (mixrl.rl.prepare_model: a trainer pod's ``model-init``
container) or by ``mixrl run``, and the trainer is given that directory as ``--model-path``.

The loop, per step s (the trainer holds weight version s − 1 while computing step s):
  1. ask the buffer for step s's batch (the same batch again after a crash: nothing is lost) and
     check it against the run (mixrl.api.trajectory_check, with the model's vocabulary); a batch
     that fails, that has no generated token to train on, that crashes the step, or that runs out
     of memory in two processes in a row (the first time may be chance: the restart redoes it) is
     quarantined in the buffer (kept, never trained) and the step takes the next full groups, so
     one bad trajectory cannot stop the run;
  2. recompute π on exactly the sampled ids, apply the corrected objective, step AdamW (not on a
     gradient that is NaN or infinite: the step fails as a crash does, the weights untouched);
  3. publish version s to the weight store.  Given ``--router`` (``mixrl run``), tell every engine
     through the router to reload it, between decode steps, while sessions continue; in a cluster
     the trainer has no ``--router`` and each engine pod's weight-sync sidecar converts the version
     to its pool's precision and reloads its own engine (the launch table, mixrl.api.launch);
  4. write step s's metrics line (JSONL, and Prometheus), then the checkpoint when one is due (every
     rank writes its own shards into ``checkpoint.tmp-<s>/``, committed by renaming it to
     ``checkpoint-<s>/``: mixrl.rl.trainer.checkpoint), then commit step s to the buffer: a crash
     between any two redoes the step on the same batch, and resume() drops the metrics lines of
     steps after the checkpoint, so every step is logged once.

Under torchrun (``trainer.nodes`` × ``gpusPerNode`` processes) rank 0 takes each step's batch and,
once the ranks have met and know it has one, the other ranks read the same one
(:func:`batch_of_step`); every rank computes its share of it
(FSDP2, mixrl.rl.trainer.distributed); rank 0 alone publishes, commits, reloads the engines and
writes and serves metrics, and the ranks meet after each commit.

Every request carries the run's token (``--auth-token-file`` or ``$MIXRL_AUTH_TOKEN``; docs/auth.md):
the buffer's batches and commits and (with ``--router``) the router's weight fan-out need it.  A refused token is fatal
(one line): training on while the engines never reload would only hide it.

SIGTERM or SIGINT stops the loop between steps: the step under way ends, a checkpoint of the last
step is saved (whatever ``checkpointEvery`` says) and the process exits 0.  The ranks meet once a
turn (:func:`distributed.any_rank`), so a signal to one rank alone stops every rank after the same
step.

The buffer hands out a batch only for the step after its last committed one, so a trainer that
resumes from a checkpoint first commits the checkpoint's step (a no-op unless it crashed between
saving the checkpoint and committing) and sends that step's metrics record and mismatch report
again (lost if it stopped before posting them; the buffer replaces a step's record), then asks for
the steps after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import aiohttp
import torch

from mixrl.api.evaluation import BF16_PROTOCOL, evaluated_steps, protected_versions
from mixrl.api.launch import ranks_stop_seconds
from mixrl.api.loader import RunConfigError, component_parser, load_resolved
from mixrl.api.models import tiny_kind
from mixrl.api.resolve import ResolvedRun
from mixrl.api.trajectory import Trajectory
from mixrl.api.trajectory_check import TrajectoryLimits, group_problem, limits_of_run
from mixrl.rl.auth import AuthConfigError, AuthToken, add_auth_arguments, bearer_headers, token_from_args
from mixrl.rl.buffer import BufferClient, BufferError
from mixrl.rl.buffer.client import Batch
from mixrl.rl.buffer.grouping import NO_BATCH_TO_QUARANTINE, NOT_THE_STEPS_BATCH, STEP_COMMITTED
from mixrl.rl.durable import sync_file
from mixrl.rl.health.routing import mismatch_report
from mixrl.rl.serving import stop_on_signals
from mixrl.rl.tiny_models import load_model
from mixrl.rl.trainer import checkpoint, distributed
from mixrl.rl.trainer.batch import collate
from mixrl.rl.trainer.megatron_backend import BackendUnavailable, MegatronPolicyTrainer
from mixrl.rl.trainer.telemetry import TrainerTelemetry, trainer_telemetry
from mixrl.rl.trainer.torch_backend import OptimizerSettings, StepResult, TorchPolicyTrainer
from mixrl.rl.trainer.weight_broadcast import WeightBroadcaster, receivers_from_router
from mixrl.rl.weights import WeightStore, WeightStoreError, tokenizer_files

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("mixrl.trainer")


METRICS = "metrics.jsonl"
FINISHED = "finished.json"
"""Written once the last step is taken (mixrl report and the operator read the run's end from it)."""
OUT_OF_MEMORY = "out-of-memory.rank-{rank}.json"
"""The batch this rank last ran out of memory on (step and prompt ids), until a step trains: one
rank per file, as the ranks of several nodes may share the run directory."""


class ReloadRefused(RuntimeError):
    """The router refused the weight fan-out for want of the run's token (one line, fatal)."""


class ModelUnavailable(RuntimeError):
    """``--model-path`` (or ``model.path``) holds no model transformers can load (one line, exit 2)."""


class PoisonBatch(RuntimeError):
    """A batch that passed every check crashed the step; it is quarantined, the process ends."""


class OutOfMemory(RuntimeError):
    """A step ran out of accelerator memory (one line, fatal): the restarted trainer redoes it on
    the same batch, and quarantines the batch if it runs out of memory there again."""


class CommittedBatch(RuntimeError):
    """A batch fails its checks or crashes the step, but its step is committed in the buffer (it was
    trained after the checkpoint this trainer resumed from): the buffer will not quarantine it, and
    a restart would redo the step on it the same way (one line, fatal)."""


LONG_POLL_SECONDS = 30.0
"""How long one request for a step's batch waits for it."""
RANKS_MEET_SECONDS = 5.0
"""The main rank's wait for a batch with several ranks: a stop that reached another rank alone is
heard within two of these while the trainer is idle (the rank's flag is read as a turn begins)."""


ALREADY_QUARANTINED = (NO_BATCH_TO_QUARANTINE, NOT_THE_STEPS_BATCH)
"""What the buffer's 409 to ``POST /quarantine`` says when the batch was quarantined already (by
another rank crashing alike: the step then has no batch, or the next one); its other 409,
:data:`STEP_COMMITTED`, is a batch that cannot be quarantined."""


NOT_THE_BATCH = (BufferError, OSError, torch.OutOfMemoryError, torch.distributed.DistError)
"""Failures inside a step that are not the batch's fault (the buffer, the disk, memory, the other
ranks): they end the process as before, and the restarted trainer redoes the step on the same batch."""
PEER_GONE = ("gloo/transport", "Connection reset by peer", "Connection closed by peer", "NCCL error")
"""What a collective raises as a plain RuntimeError when another rank died mid-step (gloo's
``pair.cc`` read error): the peer's failure, not the batch's (a rank SIGKILLed during step 3 had
its batch quarantined, tests/local/test_run.py)."""


def not_the_batch(exc: BaseException) -> bool:
    """Whether a failure inside a step is someone else's: :data:`NOT_THE_BATCH`, or a collective
    whose peer went away."""
    if isinstance(exc, NOT_THE_BATCH):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in PEER_GONE)


def first_line(exc: BaseException) -> str:
    """An error's first line (its type's name when it says nothing)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_initial_model(model_path: str) -> PreTrainedModel:
    """The model to train, from its local directory; :class:`ModelUnavailable` (one line) when there
    is none.  transformers raises an OSError (for a missing directory one that calls the path a
    malformed Hugging Face repository id) or, for a config.json without a model type, a ValueError."""
    try:
        return load_model(model_path)
    except (OSError, ValueError) as exc:
        if not Path(model_path).exists():
            raise ModelUnavailable(f"{model_path}: no such directory") from None
        reason = first_line(exc)
        raise ModelUnavailable(
            f"{model_path}: not a model directory transformers can load: {reason}"
        ) from None


def batch_problem(batch: Batch, limits: TrajectoryLimits) -> str | None:
    """Why a served batch must not be trained (one line naming the group, trajectory and field), or None."""
    for index, group in enumerate(batch.groups):
        problem = group_problem(group.prompt_id, group.trajectories, limits)
        if problem is not None:
            return f"groups[{index}] ({group.prompt_id}): {problem}"
    # Each trajectory may be all tool tokens, but a batch of nothing else has no loss token: the step
    # would update nothing and still count, publish an unchanged version and log a loss of 0.
    if not any(any(t.loss_mask) for group in batch.groups for t in group.trajectories):
        return "no generated token (loss_mask 1) in any trajectory: nothing to train on"
    return None


def format_error_share(groups: list[list[Trajectory]]) -> float:
    trajectories = [t for g in groups for t in g]
    return sum(t.finish_reason == "format_errors" for t in trajectories) / max(len(trajectories), 1)


def step_record(
    step: int, result: StepResult, groups: list[list[Trajectory]], started: float
) -> dict[str, Any]:
    per_pool = dict(result.per_pool)
    for pool in per_pool:
        pool_trajectories = [t for g in groups for t in g if t.pool == pool]
        per_pool[pool]["format_error_endings"] = sum(
            t.finish_reason == "format_errors" for t in pool_trajectories
        ) / max(len(pool_trajectories), 1)
    return {
        "step": step,
        "weight_version": step,
        "time": time.time(),
        "elapsed": time.time() - started,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "tokens": result.tokens,
        "tokens_per_s": result.tokens / max(result.seconds, 1e-9),
        "step_seconds": result.seconds,
        "format_error_endings": format_error_share(groups),
        **result.metrics,
        "pools": per_pool,
    }


class TrainerLoop:
    def __init__(
        self,
        run: ResolvedRun,
        *,
        buffer_url: str,
        router_url: str | None,
        run_dir: Path,
        model_path: str,
        telemetry: TrainerTelemetry | None = None,
        auth_token: AuthToken | None = None,
    ) -> None:
        self.run = run
        self.buffer = BufferClient(buffer_url, auth_token=auth_token)
        self.auth_headers = bearer_headers(auth_token)
        self.router_url = router_url.rstrip("/") if router_url else None
        self.run_dir = run_dir
        # Every weights.snapshotEvery versions a snapshot, deltas on the previous version between.
        self.store = WeightStore(run.weights.store, snapshot_every=run.weights.snapshot_every)
        self.telemetry = telemetry
        spec = run.trainer.spec
        # One process, or one rank of a torchrun group (nodes × gpusPerNode processes): every rank
        # computes its share of each step; rank 0 alone publishes, commits and writes metrics.
        self.ranks = distributed.Ranks.from_env()
        device = distributed.device_for(self.ranks)
        distributed.init_process_group(self.ranks, device)
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.ranks.distributed:
            backend = "NCCL" if device.type == "cuda" else "gloo"
            log.info("rank %d of %d (FSDP2 over %s)", self.ranks.rank, self.ranks.world_size, backend)
        log.info("computing on %s in %s (FP32 master weights and reductions)", device, compute_dtype)
        torch.manual_seed(0)
        optimizer = OptimizerSettings(
            lr=spec.optimizer.lr,
            betas=spec.optimizer.betas,
            weight_decay=spec.optimizer.weight_decay,
            grad_clip=spec.optimizer.grad_clip,
            temperature=run.trainer.temperature,
            micro_batch_tokens=spec.micro_batch_tokens,
        )
        self.trainer: TorchPolicyTrainer | MegatronPolicyTrainer
        if spec.backend == "megatron":  # imports megatron-core (the megatron trainer image has it)
            self.trainer = MegatronPolicyTrainer(
                model_path, run.trainer.corrections, spec.parallelism, optimizer
            )
            self.model_config = self.trainer.model_config
        else:
            self.trainer = TorchPolicyTrainer(
                load_initial_model(model_path),
                run.trainer.corrections,
                optimizer,
                compute_dtype=compute_dtype,
                device=device,
                ranks=self.ranks,
            )
            self.model_config = self.trainer.model.config.to_dict()
        # Every version carries the model's tokenizer, so any engine (and transformers) loads it.
        self.tokenizer_files = tokenizer_files(run.model.tokenizer or model_path)
        self.broadcaster = self._broadcaster(auth_token)
        self.step = 0
        self.checkpointed_step = 0
        """The step of the newest checkpoint: a stop saves one of ``step`` when it is behind."""
        self.warned_of_grace = False
        self.stopping = asyncio.Event()

    def resume(self) -> None:
        """Go on from the newest checkpoint in the run directory (``checkpoint-<step>/``, sharded;
        written on any number of ranks, mixrl.rl.trainer.checkpoint), if there is one."""
        path = checkpoint.latest_on_every_rank(self.run_dir)
        if path is not None:
            self.step = self.checkpointed_step = self.trainer.load_checkpoint(path)
            log.info("resumed from %s at step %d", path, self.step)
        # Versions published after the checkpoint came from updates that are now redone (on the same
        # batches: the buffer hands step N the same groups again), so they are replaced.
        if self.ranks.is_main:
            # Newest first: each is a delta on the one before, and engines load the newest, which
            # must never be one whose base is already gone.
            for version in reversed(self.store.versions()):
                if version > self.step:
                    log.info("removing weight version %d (newer than the checkpoint)", version)
                    self.store.remove(version)
            self.forget_metrics_after(self.step)
            self.forget_finished()
        self.publish_held_version()

    def forget_finished(self) -> None:
        """Remove ``finished.json`` when the resumed run has steps left: a finished run resumed with a
        larger ``totalSteps`` (or none) is not finished, and a file left from its first end would
        tell mixrl report and whoever reads the run directory that it ended at the old last step
        (it is written again when the new last step is taken).  A run still at its end keeps it."""
        path = self.run_dir / FINISHED
        if self.done or not path.exists():
            return
        total = self.run.trainer.spec.total_steps
        log.info("removing %s: the run goes on from step %d (totalSteps %s)", FINISHED, self.step, total)
        path.unlink(missing_ok=True)

    def forget_metrics_after(self, step: int) -> None:
        """Drop metrics lines of steps after the checkpoint: they are trained again, and logged again.

        Each step's line is written before its checkpoint and its commit, so a crash never leaves a
        trained step without its line; a step redone after a crash is logged once.
        """
        path = self.run_dir / METRICS
        if not path.exists():
            return
        # Bytes: a line of binary garbage is kept as it is, and never stops the resume.
        kept = [line for line in path.read_bytes().splitlines(True) if _step_of(line) <= step]
        if kept and not kept[-1].endswith(b"\n"):  # a torn last line: the next step's starts anew
            kept[-1] += b"\n"
        # Written beside and renamed over: rewritten in place, a write that fails (the full volume
        # the trainer crashed on) would leave the run's metrics history truncated.
        partial = path.with_name(f"{METRICS}.tmp")
        with partial.open("wb") as out:
            out.write(b"".join(kept))
            sync_file(out)
        partial.replace(path)

    def publish_held_version(self) -> None:
        """Publish the weights the trainer holds (version = its step) if the store lacks them.

        Engines start from the store's latest version (a cluster's ``weights-init`` waits for one),
        and the trainer waits for their samples, so the first version must not depend on anyone but
        the trainer: at step 0 this publishes the base weights (``model.path``) as version 0.
        ``mixrl run`` publishes its warm start as version 0 before the engines start, and then this
        finds it there and does nothing.
        """
        missing = self.step not in self.store.versions()
        if not distributed.agree_on_count(int(missing)):
            return
        state = self.trainer.state_dict_for_publication()  # every rank: the shards are gathered
        if self.ranks.is_main:
            log.info("publishing weight version %d (the weights the trainer holds)", self.step)
            self.store.publish(
                self.step, state, {"step": self.step}, self.model_config, files=self.tokenizer_files
            )
        distributed.barrier()

    async def prune(self) -> None:
        """Old versions out of the store, except those the BF16 evaluator has still to evaluate."""
        protect: set[int] = set()
        if self.run.evaluation.sampler == BF16_PROTOCOL:
            evaluated = evaluated_steps(await self.buffer.evaluations())
            protect = protected_versions(self.run, await asyncio.to_thread(self.store.versions), evaluated)
        await asyncio.to_thread(self.store.prune, self.run.weights.keep_versions, protect)

    def _broadcaster(self, auth_token: AuthToken | None) -> WeightBroadcaster | None:
        """Rank 0's broadcaster when the spec asks for one (``weights.broadcast``); it finds the
        engines through the router, so it needs ``--router`` (mixrl run)."""
        if not self.run.weights.broadcast or not self.ranks.is_main:
            return None
        if self.router_url is None:
            log.warning(
                "weights.broadcast: no --router to find the engines by; every version goes through the store"
            )
            return None
        return WeightBroadcaster.towards(self.router_url, auth_token=auth_token)

    async def broadcast_to_engines(self, version: int, state: dict[str, torch.Tensor]) -> list[str]:
        """Send ``version`` to the ready replicas of the BF16 pools; the URLs now serving it.  A
        failure is one log line and an empty list: those replicas then reload it from the store."""
        if self.broadcaster is None or self.router_url is None:
            return []
        try:
            async with aiohttp.ClientSession() as session:
                receivers = await receivers_from_router(self.router_url, session)
        except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
            log.warning("weight broadcast of version %d: cannot list the engines: %s", version, exc)
            return []
        if not receivers:
            return []
        result = await self.broadcaster.broadcast(receivers, state, version)
        if result.error is not None:
            log.warning(
                "weight broadcast of version %d failed (the store serves it): %s", version, result.error
            )
            return []
        log.info(
            "broadcast version %d to %d engines: %.1f MB sent in %.3f s (%.2f GB/s), applied %.3f s after"
            " the first bucket, group set-up %.3f s",
            version,
            len(result.updated),
            result.bytes / 1e6,
            result.broadcast_s,
            result.gb_per_s,
            result.transfer_s,
            result.setup_s,
        )
        return result.updated

    async def reload_engines(self, version: int, skip: list[str] | None = None) -> None:
        """Every ready replica but ``skip`` (those the broadcast updated) reloads ``version`` from
        the store, through the router's fan-out."""
        if self.router_url is None:
            return
        body: dict[str, Any] = {"model_path": self.store.path(version), "weight_version": str(version)}
        if skip:
            body["skip_replicas"] = skip
        # The version is published: a router that cannot be reached or answers garbage costs the
        # engines this reload (they catch up with the next), never the step (one warning line).
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"{self.router_url}/update_weights_from_disk",
                    json=body,
                    timeout=aiohttp.ClientTimeout(total=300),
                    headers=self.auth_headers,
                ) as response,
            ):
                status, text = response.status, await response.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            log.warning("engine reload to version %d: router %s: %s", version, self.router_url, reason)
            return
        try:
            result: Any = json.loads(text)
        except (ValueError, RecursionError):  # an HTML error page from a proxy, a cut-off body
            result = text[:200]
        if status == 401:
            message = result.get("error") if isinstance(result, dict) else result
            raise ReloadRefused(f"POST /update_weights_from_disk: 401: {message}")
        if status != 200:
            log.warning("engine reload to version %d: HTTP %d %s", version, status, result)

    async def train(self) -> None:
        try:
            await self._train()
        finally:  # also when the loop ends in an error: the process may go on (a test, a caller)
            await self.buffer.close()

    async def _train(self) -> None:
        total = self.run.trainer.spec.total_steps
        started = time.time()
        main = self.ranks.is_main
        if self.step > 0 and main:
            # The checkpoint holds step s's update, so step s is consumed; a crash between saving
            # the checkpoint and committing would otherwise leave it open and the buffer would
            # refuse step s + 1.
            await self.buffer.commit(self.step)
            await self.resend_checkpoint_record()
        distributed.barrier()
        while total is None or self.step < total:
            step = self.step + 1
            batch = await self.take_batch(step) if main else None
            # The ranks meet once a turn: they stop after the same step (SIGTERM may reach one rank
            # alone: a pod evicted), and the others read the batch only once the main rank has it.
            taken, stop = await asyncio.to_thread(
                distributed.any_rank, batch is not None, self.stopping.is_set()
            )
            if stop:
                break
            if not taken:  # long-poll timed out: no full batch yet
                continue
            if batch is None:
                batch = await self.read_taken_batch(step)
            turn_started = time.monotonic()
            groups = [group.trajectories for group in batch.groups]
            # Every rank reads the same batch, so every rank reaches the same verdict.
            problem = batch_problem(batch, self.limits(step))
            if problem is not None:
                if main:
                    await self.quarantine(batch, problem)
                distributed.barrier()  # every rank asks for the step's next batch only once it is out
                continue
            try:
                policy_batch = collate(
                    groups, trainer_version=self.step, normalize_std=self.run.trainer.normalize_std
                )
                result = await asyncio.to_thread(self.trainer.step, policy_batch)
            except Exception as exc:
                if isinstance(exc, torch.OutOfMemoryError):
                    await self.out_of_memory(batch, exc)
                if not_the_batch(exc):
                    raise
                # The model may be half-updated and the other ranks inside a collective: this
                # process ends (one line), and the restarted trainer takes the step's next batch.
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
                await self.quarantine(batch, f"the trainer crashed on it ({reason})")
                raise PoisonBatch(
                    f"step {step}: the batch could not be trained ({reason}); it is quarantined"
                ) from exc
            self.out_of_memory_marker.unlink(missing_ok=True)
            state = await asyncio.to_thread(self.trainer.state_dict_for_publication)
            if main:
                await asyncio.to_thread(
                    functools.partial(self.store.publish, files=self.tokenizer_files),
                    step,
                    state,
                    {"step": step},
                    self.model_config,
                )
                await self.reload_engines(step, skip=await self.broadcast_to_engines(step, state))
                await self.prune()
                # The line first: a crash after it redoes the step, and resume() drops the line.
                record = step_record(step, result, groups, started)
                with (self.run_dir / METRICS).open("a", encoding="utf-8") as out:
                    out.write(json.dumps(record) + "\n")
            self.step = step
            if step % self.run.trainer.spec.checkpoint_every == 0 or step == total:
                await self.save_checkpoint(step_seconds=time.monotonic() - turn_started)
            if main:
                await self.buffer.commit(step)
                # The router's mismatch-aware shares read it back from the buffer (docs/health.md),
                # and the buffer keeps the run's telemetry once a finished trainer is scaled away.
                await self.buffer.post_mismatch(mismatch_report(step, record["pools"]))
                await self.buffer.post_trainer_record(record)
                if self.telemetry is not None:
                    self.telemetry.observe(record)
                log.info(
                    "step %d reward %.3f kl %.4f grad %.3f tok/s %.0f",
                    step,
                    record.get("reward", 0.0),
                    record.get("kl_k3", 0.0),
                    result.grad_norm,
                    record["tokens_per_s"],
                )
            distributed.barrier()  # the other ranks ask for step + 1 only once it is open
        if total is not None and self.step >= total:
            self.finished()
        elif self.checkpointed_step < self.step:
            # Stopped (SIGTERM) between steps: the steps since the last checkpoint are kept, not
            # redone by the next start.  A stop cut short (SIGKILL) leaves the last one whole.
            log.info("stopping: saving a checkpoint of step %d", self.step)
            await self.save_checkpoint()

    async def save_checkpoint(self, step_seconds: float = 0.0) -> None:
        """This step's checkpoint (collective: every rank writes its shards).  Warns once when the
        step (``step_seconds``) and the save together would not fit in a stop's time."""
        started = time.monotonic()
        await asyncio.to_thread(self.trainer.save_checkpoint, self.run_dir, self.step)
        self.checkpointed_step = self.step
        seconds = step_seconds + time.monotonic() - started
        grace = self.run.trainer.spec.stop_grace_seconds
        if seconds > ranks_stop_seconds(grace) and self.ranks.is_main and not self.warned_of_grace:
            self.warned_of_grace = True
            log.warning(
                "step %d and its checkpoint took %.0f s, more than a stop has (trainer.stopGraceSeconds"
                " %d s, %d s of it for the ranks): a stop would be cut short and lose the steps since"
                " the last checkpoint; raise trainer.stopGraceSeconds",
                self.step,
                seconds,
                grace,
                ranks_stop_seconds(grace),
            )

    async def take_batch(self, step: int) -> Batch | None:
        """The main rank's take of ``step``'s batch; None when none came within the long-poll or the
        trainer is told to stop first (a batch taken and not trained is handed to the step again)."""
        if self.stopping.is_set():
            return None
        # With several ranks the wait is short, so that the ranks meet (and hear of a stop that
        # reached another rank alone) at least this often while no batch comes.
        wait = RANKS_MEET_SECONDS if self.ranks.distributed else LONG_POLL_SECONDS
        taking = asyncio.ensure_future(batch_of_step(self.buffer, self.ranks, step, wait))
        stopped = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({taking, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            taking.cancel()  # (nothing when it is done)
        (batch,) = await asyncio.gather(taking, return_exceptions=True)
        if isinstance(batch, asyncio.CancelledError):
            return None
        if isinstance(batch, BaseException):
            raise batch
        return batch

    async def read_taken_batch(self, step: int) -> Batch:
        """The batch the main rank took for ``step`` (the ranks other than the main one)."""
        batch = await batch_of_step(self.buffer, self.ranks, step)
        if batch is None:
            raise BufferError(f"step {step}: the main rank took its batch, and the buffer does not show it")
        return batch

    async def resend_checkpoint_record(self) -> None:
        """Send the checkpoint step's metrics record and mismatch report to the buffer again.

        A trainer stopped after saving step s's checkpoint and before posting them (SIGTERM, a
        buffer unreachable) resumes after step s and never posts them otherwise: the buffer's copy
        of the run's metrics would lack step s for good.  The buffer replaces a step's record (and
        keeps the newest step's report), so sending them again is harmless."""
        record = self.metrics_record(self.step)
        if record is None:
            log.warning("step %d: no line in %s to send to the buffer again", self.step, METRICS)
            return
        pools = record.get("pools")
        if isinstance(pools, dict):
            try:
                report = mismatch_report(self.step, pools)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("step %d: its metrics line has no usable pools (%s)", self.step, exc)
            else:
                await self.buffer.post_mismatch(report)
        await self.buffer.post_trainer_record(record)

    def metrics_record(self, step: int) -> dict[str, Any] | None:
        """Step ``step``'s line of metrics.jsonl (its last, if a damaged file holds two), or None."""
        path = self.run_dir / METRICS
        if not path.exists():
            return None
        for line in reversed(path.read_bytes().splitlines()):
            if _step_of(line) == step:
                record = json.loads(line)  # _step_of parsed it
                return record if isinstance(record, dict) else None
        return None

    def limits(self, step: int) -> TrajectoryLimits:
        """The contract of step ``step``'s trajectories: the buffer's, with the model's vocabulary
        and versions no newer than the step (version s exists only once step s is trained)."""
        vocab = self.model_config.get("vocab_size") or (self.model_config.get("text_config") or {}).get(
            "vocab_size"
        )
        limits = limits_of_run(self.run, vocab if isinstance(vocab, int) else None)
        return dataclasses.replace(limits, latest_version=step)

    @property
    def out_of_memory_marker(self) -> Path:
        return self.run_dir / OUT_OF_MEMORY.format(rank=self.ranks.rank)

    async def out_of_memory(self, batch: Batch, exc: torch.OutOfMemoryError) -> NoReturn:
        """End the process after step ``batch.step`` ran out of memory.  Memory can run out by
        chance (fragmentation, another process on the device), so the first time the restarted
        trainer redoes the step on the same batch; a batch that runs out of memory again, in a fresh
        process, would do so at every restart (a trajectory too long for the device: one row is
        the smallest micro-batch), so it is quarantined and the step takes the next full groups."""
        seen = {"step": batch.step, "prompt_ids": [group.prompt_id for group in batch.groups]}
        cause = first_line(exc)
        marker = self.out_of_memory_marker
        try:
            again = json.loads(marker.read_text(encoding="utf-8")) == seen
        except (OSError, ValueError):  # none yet, or a torn write: a first time
            again = False
        if again:
            longest = max(
                len(t.prompt_ids) + len(t.tokens) for group in batch.groups for t in group.trajectories
            )
            reason = (
                f"it ran out of memory twice, the second time in a fresh process ({cause}); its"
                f" longest trajectory has {longest} tokens (trainer.microBatchTokens"
                f" {self.run.trainer.spec.micro_batch_tokens})"
            )
            await self.quarantine(batch, reason)
            marker.unlink(missing_ok=True)
            raise PoisonBatch(
                f"step {batch.step}: the batch could not be trained ({reason}); it is quarantined"
            ) from exc
        staging = marker.with_name(marker.name + ".tmp")
        with staging.open("w", encoding="utf-8") as out:
            json.dump(seen, out)
            sync_file(out)
        staging.replace(marker)
        raise OutOfMemory(
            f"step {batch.step}: out of memory ({cause}); the restarted trainer redoes the step on the"
            " same batch, and quarantines the batch if it runs out of memory again"
        ) from exc

    async def quarantine(self, batch: Batch, reason: str) -> None:
        """Have the buffer take ``batch`` back for good; done already (another rank) is fine, a
        committed step is :class:`CommittedBatch`."""
        log.error("step %d: quarantining the batch: %s", batch.step, reason)
        try:
            await self.buffer.quarantine(batch.step, [group.prompt_id for group in batch.groups], reason)
        except BufferError as refused:
            if refused.status != 409:
                raise
            if any(marker in str(refused) for marker in ALREADY_QUARANTINED):
                log.info("step %d: the batch was quarantined already (another rank reported it)", batch.step)
                return
            if STEP_COMMITTED in str(refused):
                raise CommittedBatch(
                    f"step {batch.step}: its batch cannot be trained ({reason}) nor quarantined: the"
                    " buffer has the step committed (trained after the checkpoint this trainer resumed"
                    " from), so a restart redoes it the same way"
                ) from None
            raise

    @property
    def done(self) -> bool:
        total = self.run.trainer.spec.total_steps
        return total is not None and self.step >= total

    def finished(self) -> None:
        """Record that the run's last step is taken: ``finished.json`` in the run directory (the
        step and the final weight version) and the ``mixrl_trainer_finished`` series."""
        if not self.ranks.is_main:
            return
        log.info("finished: %d steps taken, the final weights are version %d", self.step, self.step)
        record = {"step": self.step, "weight_version": self.step, "time": time.time()}
        (self.run_dir / FINISHED).write_text(json.dumps(record) + "\n", encoding="utf-8")
        if self.telemetry is not None:
            self.telemetry.mark_finished(self.step, self.step)


async def batch_of_step(
    buffer: BufferClient, ranks: distributed.Ranks, step: int, timeout: float = LONG_POLL_SECONDS
) -> Batch | None:
    """Step ``step``'s batch for this rank, or None if it has none within ``timeout`` s.

    The main rank takes it (``POST /batch``), and the buffer reads that request's wait as the
    trainer's idle time and the time to its next one as the trainer's compute time; the other ranks
    read the same batch (``GET /batch``, which assigns and counts nothing and long-polls until the
    main rank has taken it), so those series are the trainer's for any number of ranks."""
    if ranks.is_main:
        return await buffer.get_batch(step, timeout)
    return await buffer.read_batch(step, timeout)


def _step_of(line: bytes) -> int:
    """The line's integer step, as the readers take it (``mixrl.local.report.has_step``); -1 for a
    damaged line (kept, as a line a reader can see)."""
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError, RecursionError):  # (RecursionError: "[" * 10**5)
        return -1
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


FATAL_ERRORS = (
    BackendUnavailable,
    ModelUnavailable,
    BufferError,
    ReloadRefused,
    PoisonBatch,
    OutOfMemory,
    CommittedBatch,
    checkpoint.CheckpointError,
    WeightStoreError,
    OSError,
    torch.OutOfMemoryError,  # outside a step (loading, publishing, a checkpoint): inside, OutOfMemory
)
"""What ends the trainer with one line (:func:`fatal_line`) rather than a traceback."""


def fatal_line(exc: BaseException) -> tuple[str, int]:
    """The line ``mixrl trainer`` prints for one of :data:`FATAL_ERRORS`, and its exit code: 2 for
    what the command line or the image got wrong, 1 for what went wrong while it ran."""
    if isinstance(exc, BackendUnavailable):
        return str(exc), 2
    if isinstance(exc, ModelUnavailable):
        return f"--model-path: {exc}", 2
    if isinstance(exc, PoisonBatch):
        return f"{exc}; restart to go on with the next batch", 1
    if isinstance(exc, torch.OutOfMemoryError):
        return f"out of memory: {first_line(exc)}", 1
    for kind, what in (
        (BufferError, "buffer"),  # a refused step or an unreachable buffer
        (ReloadRefused, "router"),
        (checkpoint.CheckpointError, "checkpoint"),  # unreadable at resume, or a save not committed
        (WeightStoreError, "weight store"),  # a version not published (or pruned)
    ):
        if isinstance(exc, kind):
            return f"{what}: {exc}", 1
    # CommittedBatch; an OSError: a run directory or store that refuses a write, a metrics port taken
    return str(exc), 1


def main(argv: list[str]) -> int:
    parser = component_parser("mixrl trainer", __doc__)
    parser.add_argument("--buffer", required=True, help="buffer URL")
    parser.add_argument(
        "--router",
        default=None,
        help="router URL: reload every engine through it (mixrl run; not in a cluster)",
    )
    parser.add_argument("--run-dir", required=True, help="directory for metrics.jsonl and checkpoints")
    parser.add_argument(
        "--model-path",
        default=None,
        help="initial checkpoint (default: the spec's model.path; a tiny: model's is the directory"
        " mixrl prepare-model built)",
    )
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0 = none)")
    parser.add_argument(
        "--hold-when-done",
        action="store_true",
        help="after the last step keep serving /metrics until SIGTERM instead of exiting (in a pod: a"
        " StatefulSet restarts a container that exits; the operator scales the finished trainer down)",
    )
    add_auth_arguments(parser)
    args = parser.parse_args(argv)
    try:
        auth_token = token_from_args(args)
    except AuthConfigError as exc:
        print(f"mixrl trainer: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(message)s")
    try:
        run = load_resolved(args.config)
    except RunConfigError as exc:
        print(f"mixrl trainer: {exc}", file=sys.stderr)
        return 2
    model_path = args.model_path or run.model.path
    if tiny_kind(model_path) is not None:
        # transformers would take it for a Hugging Face repository id and try to download it
        print(
            f"mixrl trainer: --model-path: {model_path} is built, not loaded: give the directory"
            " `mixrl prepare-model` built it into (a trainer pod's model-init container does; mixrl run"
            " builds it itself)",
            file=sys.stderr,
        )
        return 2
    run_dir = Path(args.run_dir)

    async def _main(loop: TrainerLoop) -> None:
        stop_on_signals(loop.stopping)
        train = asyncio.create_task(loop.train())
        stop = asyncio.create_task(loop.stopping.wait())
        await asyncio.wait({train, stop}, return_when=asyncio.FIRST_COMPLETED)
        if train.done() and train.exception() is None and loop.done and args.hold_when_done:
            log.info("holding until SIGTERM (--hold-when-done)")
            await stop
        if not train.done():
            log.info("stopping: the step under way (if any) ends, then a checkpoint of the last step")
        (outcome,) = await asyncio.gather(train, return_exceptions=True)
        stop.cancel()
        await asyncio.gather(stop, return_exceptions=True)
        if isinstance(outcome, Exception):  # a failed loop must fail the process, not exit 0
            raise outcome

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # Every rank of a torchrun group is given the same --metrics-port: the main rank alone serves it.
        telemetry = trainer_telemetry(run, args.metrics_port, distributed.Ranks.from_env())
        loop = TrainerLoop(
            run,
            buffer_url=args.buffer,
            router_url=args.router,
            run_dir=run_dir,
            model_path=model_path,
            telemetry=telemetry,
            auth_token=auth_token,
        )
        loop.resume()
        asyncio.run(_main(loop))
        distributed.destroy_process_group()
    except FATAL_ERRORS as exc:
        line, code = fatal_line(exc)
        print(f"mixrl trainer: {line}", file=sys.stderr)
        return code
    return 0
