"""The trainer loop against the real buffer over loopback HTTP: resuming from a checkpoint whose step
the buffer never saw committed (a crash between the two) goes on with the next step; a fresh run
publishes version 0 itself."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from mixrl.api.loader import load_rlrun
from mixrl.api.resolve import ResolvedRun, resolve
from mixrl.rl.buffer.client import BufferClient
from mixrl.rl.buffer.store import ASSIGNMENTS
from mixrl.rl.tiny_models import load_model
from mixrl.rl.trainer.batch import PolicyBatch
from mixrl.rl.trainer.distributed import Ranks
from mixrl.rl.trainer.main import FINISHED, OutOfMemory, PoisonBatch, TrainerLoop, batch_of_step
from mixrl.rl.trainer.torch_backend import StepResult, TorchPolicyTrainer
from mixrl.rl.weights import WeightStore

from ..api.conftest import ROOT
from ..servers import buffer_at
from .conftest import VOCAB, synthetic_group

QUICKSTART = ROOT / "examples" / "quickstart.yaml"
RUN = load_rlrun(QUICKSTART).metadata.name


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def small_run(tmp_path: Path, total_steps: int, checkpoint_every: int = 1) -> ResolvedRun:
    run = resolve(load_rlrun(QUICKSTART))
    update = {"total_steps": total_steps, "checkpoint_every": checkpoint_every}
    spec = run.trainer.spec.model_copy(update=update)
    weights = run.weights.model_copy(update={"store": str(tmp_path / "weights")})
    # buffer_at's grouping: one group of two per step
    trainer = run.trainer.model_copy(update={"spec": spec, "prompts_per_update": 1, "samples_per_prompt": 2})
    return run.model_copy(update={"trainer": trainer, "weights": weights})


async def test_a_resume_commits_the_checkpointed_step_and_goes_on(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module
) -> None:
    directory, run_dir = tmp_path / "buffer", tmp_path / "run"
    run_dir.mkdir()

    def loop(url: str, total_steps: int) -> TrainerLoop:
        trainer = TrainerLoop(
            small_run(tmp_path, total_steps),
            buffer_url=url,
            router_url=None,
            run_dir=run_dir,
            model_path=str(tiny_model_dir),
        )
        trainer.resume()
        return trainer

    async with buffer_at(directory, run=RUN) as url:
        async with BufferClient(url) as client:
            for seed, prompt in enumerate("ab"):
                await client.post_trajectories(
                    synthetic_group(model, prompt, 2, pool="bf16", seed=seed, run=RUN)
                )
        await loop(url, total_steps=1).train()
    # A crash after the checkpoint of step 1 was saved and before step 1 was committed.
    log = directory / ASSIGNMENTS
    log.write_text("".join(line for line in log.read_text().splitlines(True) if '"commit"' not in line))
    async with buffer_at(directory, run=RUN) as url:
        resumed = loop(url, total_steps=2)
        assert resumed.step == 1
        await resumed.train()
        async with BufferClient(url) as client:
            stats: dict[str, object] = await client.stats()
    assert stats["committed_step"] == 2 and stats["batches"] == 2
    records = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in records] == [1, 2]
    assert json.loads((run_dir / FINISHED).read_text())["weight_version"] == 2


async def test_a_finished_trainer_holds_until_sigterm_with_hold_when_done(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module
) -> None:
    """In a pod the StatefulSet restarts a container that exits, even with 0: the finished trainer
    keeps serving /metrics (``mixrl_trainer_finished`` 1) until the operator scales it down."""
    run_dir, config = tmp_path / "run", tmp_path / "resolved.json"
    config.write_text(small_run(tmp_path, total_steps=1).model_dump_json())
    metrics_port = free_port()
    async with buffer_at(tmp_path / "buffer", run=RUN) as url:
        async with BufferClient(url) as client:
            await client.post_trajectories(synthetic_group(model, "a", 2, pool="bf16", seed=0, run=RUN))
        trainer = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mixrl.cli", "trainer", "--config", str(config), "--buffer", url,
            "--run-dir", str(run_dir), "--model-path", str(tiny_model_dir), "--insecure-no-auth",
            "--metrics-port", str(metrics_port), "--hold-when-done",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            for _ in range(600):
                if (run_dir / FINISHED).exists() or trainer.returncode is not None:
                    break
                await asyncio.sleep(0.1)
            assert (run_dir / FINISHED).exists(), "the trainer did not finish its one step"
            await asyncio.sleep(2.0)
            assert trainer.returncode is None, "a finished trainer with --hold-when-done exited"
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{metrics_port}/metrics") as response,
            ):
                text = await response.text()
            assert 'mixrl_trainer_finished{gpu_type="",pool="all",precision="",run="quickstart"} 1.0' in text
        finally:
            if trainer.returncode is None:
                trainer.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(trainer.communicate(), timeout=60)
    assert trainer.returncode == 0, stderr.decode()[-2000:]


async def test_two_ranks_get_one_batch_and_the_buffer_counts_the_trainers_wait_once(
    tmp_path: Path, model: torch.nn.Module
) -> None:
    """Every rank of a torchrun trainer asks for each step's batch: the main rank takes it and the
    other reads it, so the buffer serves one batch and its trainer clock (the autoscaler's idle share)
    counts one rank's wait, not one per rank."""
    group = synthetic_group(model, "a", 2, pool="bf16", seed=0, run=RUN)
    async with buffer_at(tmp_path / "buffer", run=RUN) as url, BufferClient(url) as client:
        started = asyncio.get_running_loop().time()
        asking = [
            asyncio.create_task(batch_of_step(client, Ranks(rank=rank, world_size=2), 1, timeout=20))
            for rank in (1, 0)  # rank 1 first: reading never assigns, it waits for rank 0's batch
        ]
        await asyncio.sleep(0.5)
        await client.post_trajectories(group)
        read, taken = await asyncio.wait_for(asyncio.gather(*asking), 20)
        elapsed = asyncio.get_running_loop().time() - started
        assert taken is not None and read is not None
        assert [t.model_dump() for t in read.trajectories] == [t.model_dump() for t in taken.trajectories]
        stats = await client.stats()
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
            text = await response.text()
    assert stats["batches"] == 1
    (line,) = [x for x in text.splitlines() if x.startswith("mixrl_buffer_trainer_wait_seconds_total{")]
    assert 0.4 <= float(line.rsplit(" ", 1)[1]) <= elapsed  # two ranks' waits: about twice the elapsed


def offline_loop(run: ResolvedRun, run_dir: Path, model_dir: Path) -> TrainerLoop:
    """A trainer loop whose buffer is never reached (port 9, discard): for what it does before its
    first step (resume, publishing, the store)."""
    return TrainerLoop(
        run, buffer_url="http://127.0.0.1:9", router_url=None, run_dir=run_dir, model_path=str(model_dir)
    )


def trainer_loop(tmp_path: Path, url: str, model_dir: Path, total_steps: int) -> TrainerLoop:
    (tmp_path / "run").mkdir(exist_ok=True)
    loop = TrainerLoop(
        small_run(tmp_path, total_steps),
        buffer_url=url,
        router_url=None,
        run_dir=tmp_path / "run",
        model_path=str(model_dir),
    )
    loop.resume()
    return loop


async def test_a_batch_outside_the_models_vocabulary_is_quarantined_and_the_step_trains_the_next(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module
) -> None:
    """The buffer cannot read a tiny model's vocabulary (nothing at ``model.path``), so it lets
    an out-of-vocabulary id in; the trainer, which has the model, refuses to train on it."""
    bad = synthetic_group(model, "bad", 2, pool="bf16", seed=0, run=RUN)
    bad[1].tokens[0] = VOCAB + 5
    async with buffer_at(tmp_path / "buffer", run=RUN) as url:
        async with BufferClient(url) as client:
            await client.post_trajectories(bad)
            await client.post_trajectories(synthetic_group(model, "good", 2, pool="bf16", seed=1, run=RUN))
        await trainer_loop(tmp_path, url, tiny_model_dir, total_steps=1).train()
        async with BufferClient(url) as client:
            stats = await client.stats()
            assert (await client.read_batch(1)).groups[0].prompt_id == "good"  # type: ignore[union-attr]
    assert stats["committed_step"] == 1
    (quarantined,) = stats["quarantined"]
    assert quarantined["prompt_ids"] == ["bad"] and quarantined["step"] == 1
    assert f"trajectories[1].tokens[0]: token id {VOCAB + 5} is outside the vocabulary (0..{VOCAB - 1})" in quarantined["reason"]  # fmt: skip


def failing_steps(monkeypatch: pytest.MonkeyPatch, error: Exception, times: int) -> list[bool]:
    """The trainer's step raises ``error`` on its first ``times`` calls (across processes: the
    loops a test runs one after another), then trains; the list grows by one per failure."""
    real_step = TorchPolicyTrainer.step
    failures: list[bool] = []

    def step(self: TorchPolicyTrainer, batch: PolicyBatch) -> StepResult:
        if len(failures) < times:
            failures.append(True)
            raise error
        return real_step(self, batch)

    monkeypatch.setattr(TorchPolicyTrainer, "step", step)
    return failures


async def quarantined_then_next_trained(
    tmp_path: Path, url: str, model_dir: Path, reason: str
) -> dict[str, Any]:
    """A trainer that ends quarantining step 1's batch for ``reason`` (a regex), then its restart,
    which trains step 1 on the next batch ("next"); the buffer's stats after."""
    with pytest.raises(PoisonBatch, match=rf"step 1: the batch could not be trained \({reason}"):
        await trainer_loop(tmp_path, url, model_dir, total_steps=1).train()
    await trainer_loop(tmp_path, url, model_dir, total_steps=1).train()
    async with BufferClient(url) as client:
        assert (await client.read_batch(1)).groups[0].prompt_id == "next"  # type: ignore[union-attr]
        return await client.stats()


async def test_a_batch_that_crashes_the_step_is_quarantined_once_and_the_restart_goes_on(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the same durable batch crashed every restart identically.  Now the crash reports the
    batch, the process ends with one line (PoisonBatch), and the restart trains the next batch."""
    async with buffer_at(tmp_path / "buffer", run=RUN) as url:
        async with BufferClient(url) as client:
            for seed, prompt in enumerate(["poison", "next"]):
                await client.post_trajectories(
                    synthetic_group(model, prompt, 2, pool="bf16", seed=seed, run=RUN)
                )
        failing_steps(monkeypatch, IndexError("index 7 is out of bounds for dimension 0 with size 3"), 1)
        stats = await quarantined_then_next_trained(tmp_path, url, tiny_model_dir, r"IndexError: index 7")
    assert stats["committed_step"] == 1 and [q["prompt_ids"] for q in stats["quarantined"]] == [["poison"]]


async def test_a_batch_that_runs_out_of_memory_in_two_processes_is_quarantined_and_the_next_trains(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: out of memory was never the batch's fault, so a trajectory too long for the device
    ended every restart on the same batch.  Now the first time the restart redoes the batch (memory
    can run out by chance), the second the batch is quarantined, and the next one trains."""
    long = synthetic_group(model, "long", 2, pool="bf16", seed=0, run=RUN)
    longest = max(len(t.prompt_ids) + len(t.tokens) for t in long)
    async with buffer_at(tmp_path / "buffer", run=RUN) as url:
        async with BufferClient(url) as client:
            await client.post_trajectories(long)
            await client.post_trajectories(synthetic_group(model, "next", 2, pool="bf16", seed=1, run=RUN))
        # Step 1's first batch ("long"), in two processes.
        attempts = failing_steps(
            monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), 2
        )
        with pytest.raises(OutOfMemory, match=r"step 1: out of memory \(CUDA out of memory. Tried"):
            await trainer_loop(tmp_path, url, tiny_model_dir, total_steps=1).train()
        async with BufferClient(url) as client:
            assert (await client.stats())["quarantined"] == []  # the first time: not the batch's fault
        stats = await quarantined_then_next_trained(
            tmp_path, url, tiny_model_dir, r"it ran out of memory twice"
        )
    assert len(attempts) == 2 and stats["committed_step"] == 1
    (quarantined,) = stats["quarantined"]
    assert quarantined["prompt_ids"] == ["long"]
    assert (
        f"its longest trajectory has {longest} tokens (trainer.microBatchTokens 16384)"
        in quarantined["reason"]
    )
    assert list((tmp_path / "run").glob("out-of-memory*")) == []


async def test_a_batch_that_runs_out_of_memory_once_trains_on_the_restart(
    tmp_path: Path, tiny_model_dir: Path, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory that ran out by chance: the restart trains the same batch, and forgets the failure,
    so a later step's first out-of-memory is a first time again."""
    async with buffer_at(tmp_path / "buffer", run=RUN) as url:
        async with BufferClient(url) as client:
            await client.post_trajectories(synthetic_group(model, "only", 2, pool="bf16", seed=0, run=RUN))
        failing_steps(monkeypatch, torch.OutOfMemoryError("CUDA out of memory"), 1)
        with pytest.raises(OutOfMemory):
            await trainer_loop(tmp_path, url, tiny_model_dir, total_steps=1).train()
        assert json.loads((tmp_path / "run" / "out-of-memory.rank-0.json").read_text()) == {
            "step": 1,
            "prompt_ids": ["only"],
        }
        await trainer_loop(tmp_path, url, tiny_model_dir, total_steps=1).train()
        async with BufferClient(url) as client:
            stats = await client.stats()
    assert stats["committed_step"] == 1 and stats["quarantined"] == []
    assert not (tmp_path / "run" / "out-of-memory.rank-0.json").exists()


def test_a_fresh_run_publishes_the_base_weights_as_version_0_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run = small_run(tmp_path, total_steps=1)
    store = WeightStore(run.weights.store)
    assert store.versions() == []  # nobody staged a version: engines would wait for one forever

    def resumed() -> TrainerLoop:
        loop = offline_loop(run, tmp_path, tiny_model_dir)
        loop.resume()
        return loop

    resumed()
    assert store.versions() == [0]
    published = store.load(0)
    base = load_model(str(tiny_model_dir)).state_dict()
    assert published.keys() == base.keys()
    assert all(torch.equal(published[name], base[name].to(torch.bfloat16)) for name in base)
    manifest = (Path(store.path(0)) / "manifest.json").read_bytes()
    resumed()  # already there: not published again
    assert store.versions() == [0] and (Path(store.path(0)) / "manifest.json").read_bytes() == manifest


def save_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A real Hugging Face fast tokenizer over ``vocab_size`` words (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", eos_token="w1").save_pretrained(
        str(directory)
    )


def test_every_published_version_carries_the_models_tokenizer(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Versions load as an engine loads a checkpoint directory: transformers' model and tokenizer
    from the version alone, the tokenizer files listed in the manifest like the weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for item in Path(tiny_model_dir).iterdir():
        (model_dir / item.name).write_bytes(item.read_bytes())
    vocab = load_model(model_dir).config.vocab_size
    save_word_tokenizer(model_dir, vocab)
    run = small_run(tmp_path, total_steps=1)
    loop = offline_loop(run, tmp_path, model_dir)
    loop.resume()  # publishes version 0
    version = Path(WeightStore(run.weights.store).path(0))
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(loop.tokenizer_files)
    manifest = json.loads((version / "manifest.json").read_text())
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest["files"])
    tokenizer = AutoTokenizer.from_pretrained(str(version), local_files_only=True)
    assert tokenizer("w3 w5")["input_ids"] == [3, 5]
    model = AutoModelForCausalLM.from_pretrained(str(version), local_files_only=True)
    assert model.config.vocab_size == vocab
