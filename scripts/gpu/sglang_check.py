"""The pinned SGLang on one GPU behind mixrl's clients (issue #13's GPU check; run by
scripts/gpu/sglang-check.sh).

1. The operator's own command line for an FP8 pool (FP8 weights, FP8 KV cache) of
   ``examples/rlrun-mixed.yaml`` (:func:`mixrl.api.launch.component_command`, what the pool's
   engine container runs), pointed at this machine's loopback, port and files.
2. ``--dry-run``: print that command line and have SGLang's own argument parser judge it (the
   test-only environment scripts/setup.sh makes, ``$MIXRL_SGLANG_ENV`` or
   ``~/.cache/mixrl/sglang-<pinned>``); runs anywhere, no GPU.
3. Otherwise: a tiny Qwen3 published as the trainer publishes version 0 (BF16 state and config in
   mixrl's weight store), converted to the pool's precision and linked as ``current`` by the
   weight-sync init container's code; SGLang serves it; the rollout's client
   (:class:`~mixrl.rl.rollout.router_client.RouterClient`, straight at the engine: no router, no
   environment) plays multi-turn episodes with the run's sampling; version 1 is published and
   applied with the weight-sync sidecar's sequence (:func:`~mixrl.rl.engine.weight_sync.sync_engine`)
   while turns are being generated; more episodes follow.  Every token record is checked: the
   support (mask) is present and holds the token, candidates cover it, the version is one that was
   served and never goes back within an episode, tokens drawn after the update carry version 1.

Prints one line per step and exits 1 on the first check that fails.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from mixrl.api.launch import AUTH_TOKEN_ENV, Where, component_command  # noqa: E402
from mixrl.api.loader import parse_document, read_documents  # noqa: E402
from mixrl.api.models import RLRun  # noqa: E402
from mixrl.api.resolve import ENGINE_PORT, SGLANG_VERSION, ResolvedPool, ResolvedRun, resolve  # noqa: E402

EXAMPLE = ROOT / "examples" / "rlrun-mixed.yaml"
PARSE_SCRIPT = ROOT / "tests" / "sglang" / "sglang_parse.py"
TINY = {  # FlashInfer/Triton kernels want a real head size; SGLang refuses --context-length above the config's
    "vocab_size": 2048,
    "hidden_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 1024,
    "max_position_embeddings": 65536,
}


def say(message: str) -> None:
    print(f"sglang-check: {message}", flush=True)


class CheckFailed(Exception):
    pass


def fp8_pool(resolved: ResolvedRun, name: str | None) -> ResolvedPool:
    """The named pool, or the first SGLang pool with FP8 weights and an FP8 KV cache."""
    for pool in resolved.pools:
        if (
            name is None
            and pool.engine == "sglang"
            and pool.weight_precision == "fp8"
            and pool.kv_cache_dtype == "fp8"
        ):
            return pool
        if pool.name == name:
            if pool.engine != "sglang":
                raise CheckFailed(f"--pool: {name} is not an SGLang pool (engine {pool.engine})")
            return pool
    wanted = name or "an SGLang pool with FP8 weights and FP8 KV cache"
    raise CheckFailed(f"--pool: {wanted} not found in {EXAMPLE.name}")


def example_run(path: Path) -> ResolvedRun:
    for doc in read_documents(path):
        run = parse_document(doc.data)
        if isinstance(run, RLRun):
            return resolve(run)
    raise CheckFailed(f"--example: {path} holds no RLRun")


def engine_command(
    resolved: ResolvedRun, pool: ResolvedPool, model_path: str, port: int, token: str
) -> list[str]:
    """The operator's engine command for ``pool``, on loopback at ``port`` with this run's token."""
    where = Where(
        program=("mixrl",),
        host="127.0.0.1",
        config="/unused/run.json",
        auth_token_file="/unused/token",
        buffer_dir="/unused/buffer",
        trainer_run_dir="/unused/trainer",
        engine_model_path=model_path,
    )
    command = component_command(resolved, "engine", where, pool)
    assert command[:3] == ["python3", "-m", "sglang.launch_server"], command
    command[command.index("--port") + 1] = str(port)
    # In the pod the container's $(MIXRL_AUTH_TOKEN) expands to the run's Secret; here, this run's token.
    command[command.index(f"$({AUTH_TOKEN_ENV})")] = token
    return [sys.executable, *command[1:]]


def default_parser_env() -> Path:
    default = Path.home() / ".cache" / "mixrl" / f"sglang-{SGLANG_VERSION}"
    return Path(os.environ.get("MIXRL_SGLANG_ENV") or default)


def parser_verdict(args: list[str], env_dir: Path) -> tuple[str, str | None]:
    """SGLang's version and its parser's refusal of ``args`` (None: accepted), in ``env_dir``."""
    if not (env_dir / ".mixrl-installed").is_file():
        raise CheckFailed(
            f"SGLang {SGLANG_VERSION}'s parser environment is absent at {env_dir}: run scripts/setup.sh"
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        done = subprocess.run(
            [sys.executable, str(PARSE_SCRIPT), str(out)],
            input=json.dumps({"lines": [args]}),
            env={**os.environ, "PYTHONPATH": str(env_dir)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise CheckFailed(f"SGLang's parser did not run: {done.stderr.strip().splitlines()[-1:]}")
        answer = json.loads(out.read_text())
    return answer["version"], answer["results"][0]


def shown(command: list[str], token: str) -> str:
    return shlex.join(command).replace(token, "<token>")


# ----------------------------------------------------------------------------- the GPU run


def gpu_ready() -> None:
    """One clear line (CheckFailed) unless a CUDA device and the pinned SGLang are here."""
    import torch

    if not torch.cuda.is_available():
        raise CheckFailed("no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine")
    if importlib.util.find_spec("sglang") is None:
        raise CheckFailed(
            f"SGLang is not installed for {sys.executable}: run it in the pinned image "
            f"(lmsysorg/sglang:v{SGLANG_VERSION}) or set SGLANG_PIP_INSTALL=1"
        )
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        raise CheckFailed(f"SGLang {sglang.__version__} is installed; mixrl pins {SGLANG_VERSION}")


def publish_version_0(store_url: str, workdir: Path) -> Any:
    """A tiny Qwen3 published as version 0 the way ``mixrl run`` publishes a run's first weights."""
    import torch

    from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model
    from mixrl.rl.weights import WeightStore

    model_dir = create_tiny_checkpoint(workdir / "tiny", "qwen3", seed=13, **TINY)
    model = load_model(model_dir)
    state = {n: t.detach().to(torch.bfloat16).contiguous().clone() for n, t in model.state_dict().items()}
    store = WeightStore(store_url)
    store.publish(0, state, {"source": model_dir}, model.config.to_dict())
    return store, state, model.config.to_dict()


async def wait_up(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                raise CheckFailed(f"SGLang exited {process.returncode}:\n" + "\n".join(tail))
            try:
                async with http.get(f"{url}/health") as answer:
                    if answer.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(1.0)
    raise CheckFailed(f"SGLang did not answer /health within {timeout_s:.0f} s (log: {log})")


def check_records(episodes: list[list[Any]], allowed: set[int], after_update: bool) -> int:
    """Every record of every turn: support present and holding the token, candidates, versions."""
    tokens = 0
    for e, turns in enumerate(episodes):
        last = -1
        for t, result in enumerate(turns):
            if not result.records:
                raise CheckFailed(f"episode {e} turn {t}: no tokens ({result.finish_reason})")
            for i, r in enumerate(result.records):
                where = f"episode {e} turn {t} token {i}"
                if r.support_size < 1:
                    raise CheckFailed(f"{where}: no sampling support (mask) although top-p/top-k truncate")
                if r.token_id not in r.cand_ids[: r.support_size]:
                    raise CheckFailed(f"{where}: token {r.token_id} outside its support")
                if r.weight_version not in allowed:
                    raise CheckFailed(
                        f"{where}: weight version {r.weight_version}, expected one of {sorted(allowed)}"
                    )
                if r.weight_version < last:
                    raise CheckFailed(f"{where}: version went back from {last} to {r.weight_version}")
                if after_update and r.weight_version != max(allowed):
                    raise CheckFailed(f"{where}: drawn after the update but labelled {r.weight_version}")
                last = r.weight_version
                tokens += 1
    return tokens


LOAD_TOKENS = 2048
"""Tokens per turn while the update happens: long enough that turns are running when it lands."""


async def until_running(engine: Any, episodes: asyncio.Task[Any]) -> None:
    """Until SGLang reports running requests (``sglang:num_running_reqs``), so the update is under load."""
    while True:
        if episodes.done():
            raise CheckFailed("the loaded episodes finished before any request was seen running")
        metrics = await engine.metrics()
        if metrics.get("sglang:num_running_reqs", 0.0) >= 1:
            return
        await asyncio.sleep(0.05)


async def play(client: Any, count: int, turns: int, max_new_tokens: int, tag: str) -> list[list[Any]]:
    """``count`` episodes of ``turns`` turns each, concurrently; each turn extends the history."""
    import random

    async def episode(k: int) -> list[Any]:
        rng = random.Random(f"{tag}-{k}")
        history = [rng.randrange(3, TINY["vocab_size"]) for _ in range(16)]
        results = []
        for _ in range(turns):
            result = await client.generate(f"{tag}-{k}", history, max_new_tokens)
            results.append(result)
            history += [r.token_id for r in result.records] + [
                rng.randrange(3, TINY["vocab_size"]) for _ in range(8)
            ]
        return results

    return list(await asyncio.gather(*(episode(k) for k in range(count))))


async def gpu_run(args: argparse.Namespace, resolved: ResolvedRun, pool: ResolvedPool) -> None:
    from mixrl.rl.auth import AuthToken
    from mixrl.rl.engine import weight_sync
    from mixrl.rl.engine.client import EngineClient
    from mixrl.rl.rollout.router_client import RouterClient

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mixrl-sglang-check-"))
    output = workdir / "engine"
    store, state, config = publish_version_0(f"file://{workdir / 'store'}", workdir)
    await weight_sync.prepare(store, pool, output, poll_s=0.1, timeout_s=10)
    say(
        f"version 0 published and converted to {pool.weight_precision}: {os.path.realpath(output / 'current')}"
    )

    token = secrets.token_urlsafe(24)
    command = engine_command(resolved, pool, str(output / "current"), args.port, token)
    say(f"starting: {shown(command, token)}")
    log = workdir / "sglang.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    auth = AuthToken(token)
    try:
        started = time.monotonic()
        await wait_up(url, process, log, args.startup_timeout)
        say(f"SGLang up in {time.monotonic() - started:.0f} s (log: {log})")
        async with (
            EngineClient(url, auth_token=auth) as engine,
            RouterClient(url, resolved.sampling, [], auth_token=auth) as rollout,
        ):
            first = await play(rollout, args.episodes, 2, 32, "v0")
            served = await engine.get_weight_version()
            tokens = check_records(first, {0}, after_update=False)
            say(
                f"{args.episodes} episodes before the update: {tokens} token records checked (mask, candidates, version 0)"
            )

            trained = {n: (t.float() + 0.01 * t.float().std()).to(t.dtype) for n, t in state.items()}
            store.publish(1, trained, {"step": 1}, config)
            under_load = asyncio.create_task(play(rollout, args.episodes, 2, LOAD_TOKENS, "load"))
            await until_running(engine, under_load)
            paused_at = time.perf_counter()
            await weight_sync.sync_engine(store, pool, output, engine, 1, served)
            # The sidecar's SGLang sequence holds the in-place pause for the whole disk load:
            # this is the pause issue #29 asks to measure (docs/engine.md "Weight updates under load").
            pause_s = time.perf_counter() - paused_at
            bf16_gb = sum(t.numel() * 2 for t in state.values()) / 1e9
            say(f"SGLang weight update under load: paused {pause_s:.3f} s for {bf16_gb:.3f} GB of BF16 weights")
            if await engine.get_weight_version() != 1:
                raise CheckFailed("after the weight-sync sequence the engine does not report version 1")
            loaded = await under_load
            tokens = check_records(loaded, {0, 1}, after_update=False)
            mixed = sum(
                1 for turns in loaded for r in turns if len({x.weight_version for x in r.records}) > 1
            )
            if mixed == 0:
                raise CheckFailed("no turn spans both versions: the update did not happen under load")
            say(
                f"weight update under load: engine on version 1; {tokens} token records checked, {mixed} turns span both versions"
            )

            after = await play(rollout, args.episodes, 2, 32, "v1")
            tokens = check_records(after, {0, 1}, after_update=True)
            say(f"{args.episodes} episodes after the update: {tokens} token records checked (all version 1)")
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print and parse the command line; no GPU")
    parser.add_argument("--example", type=Path, default=EXAMPLE)
    parser.add_argument(
        "--pool", default=None, help="default: the first SGLang pool with FP8 weights and KV cache"
    )
    parser.add_argument("--port", type=int, default=ENGINE_PORT)
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--sglang-env", type=Path, default=None, help="the parser environment (--dry-run)")
    args = parser.parse_args(argv)
    try:
        resolved = example_run(args.example)
        pool = fp8_pool(resolved, args.pool)
        if args.dry_run:
            token = "<token>"
            command = engine_command(resolved, pool, "/weights/engine/current", args.port, token)
            print(shlex.join(command))
            version, refusal = parser_verdict(command[3:], args.sglang_env or default_parser_env())
            if refusal is not None:
                raise CheckFailed(
                    f"SGLang {version}'s parser refuses the {pool.name} command line: {refusal}"
                )
            say(f"dry run: SGLang {version}'s parser accepts the {pool.name} command line")
            return 0
        gpu_ready()
        asyncio.run(gpu_run(args, resolved, pool))
    except CheckFailed as exc:
        say(f"FAILED: {exc}")
        return 1
    say("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
