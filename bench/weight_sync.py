"""What a weight version costs from the trainer's publish to every engine serving it.

A Qwen3-shaped model built locally (by default Qwen3-0.6B's shape: hidden 1024, 28 layers, 16 query
and 8 key-value heads of 128, MLP 3072, vocabulary 151,936, tied embeddings: 596 M parameters, no
model hub here) is trained for ``--versions`` real policy-gradient steps (REINFORCE on sequences it
samples itself, AdamW at ``--lr`` 1e-6, a learning rate typical of RL on a model this size), and
every version is published as the trainer publishes it.  Then, in one run:

1. **Publish**: the trainer's publish time and the bytes each version writes, as a full copy (today)
   and into a store of deltas (``--snapshot-every`` 10: a snapshot, then deltas on the previous
   version).
2. **Convert**: CPU-seconds per version to convert to each quantized precision (what an SGLang
   pool's sidecar does), per GB of BF16 weights to extrapolate, and the CPU of ``--replicas``
   converters of one version started at once (one converter per version and precision: ≈1×).
3. **Sync under decode load**: ``--engines`` real torch engine processes (``mixrl engine``, every
   second one at FP8) decode ``--streams`` endless streamed requests each while the versions are
   published one by one into a fresh store; a sidecar loop per engine (the weight-sync sidecar's
   poll, every ``--poll`` seconds: its default) moves its engine to each new version.  Each engine
   first takes one update to the version it serves, unmeasured (it starts its preparer process at
   its first update).  Two passes over the same versions, each with freshly started engines:

   - ``paused`` (the baseline: today's path before issue #29, and still SGLang's): full copies;
     pause generation in place, ``/update_weights_from_disk``, continue.
   - ``staged``: deltas; ``/update_weights_from_disk`` alone: the engine's preparer process readies
     the version beside the served weights while it decodes, and the engine swaps between two
     decode steps.

   Reported per pass: publish → every engine serving (p50/p95 over versions, from the moment the
   version is visible; add the publish time for end to end), one engine's update (median over
   engines and versions), and the **pause**: the gap between two streamed tokens of one request
   that spans the swap (on the paused path, the pause), against the median decode step (the same
   gap outside updates); apart, the decode step while a version is prepared (the preparer takes
   CPU from decoding here, where the engines keep both cores busy; a GPU engine's CPUs are idle).

Targets (issue #29): bytes per version ≤ 0.3× a full copy; conversion once per precision; pause ≤
one decode step on the torch engine (the gap spanning the swap at most one median step longer
than a step); publish → every engine serving p95 ≤ 2× one engine's update.  The process's
memory peaks around 10 GB during training (parameters, gradients and AdamW's two moments in
float32); each engine holds its weights twice after its first update (served and staging).

    python bench/weight_sync.py                  # Qwen3-0.6B-shaped, 4 versions (about 10 minutes)
    python bench/weight_sync.py --quick          # a 30 M-parameter Qwen3, 3 versions (about 1 minute)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

from mixrl.local.processes import EngineProcess
from mixrl.rl.engine.client import EngineClient
from mixrl.rl.engine.weight_sync import POLL_S, update_paused
from mixrl.rl.weights import WeightStore, version_dir_name

FULL_SHAPE = {  # Qwen3-0.6B's published configuration
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
QUICK_SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
QUANTIZED = ("fp8", "nvfp4", "mxfp4")
ENGINE_PRECISIONS = ("bf16", "fp8")  # engine i serves ENGINE_PRECISIONS[i % 2]
GB = 1e9


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------------------- training


def build_model(shape: dict[str, int], seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        **shape,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        torch_dtype="bfloat16",
        eos_token_id=None,
        pad_token_id=0,
    )
    return Qwen3ForCausalLM(config).float()


def rl_step(
    model: Qwen3ForCausalLM,
    optimizer: torch.optim.Optimizer,
    rows: int,
    prompt: int,
    new: int,
    gen: torch.Generator,
) -> float:
    """One REINFORCE step on sequences the model samples itself (reward: the share of even token
    ids, centred per batch), AdamW, gradients clipped at 1.0.  Returns the mean reward."""
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (rows, prompt), generator=gen)
    model.eval()
    with torch.no_grad():
        sequences = model.generate(
            prompts,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            pad_token_id=0,
        )
    model.train()
    logits = model(sequences).logits[:, prompt - 1 : -1].float()
    sampled = sequences[:, prompt:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, sampled[..., None]).squeeze(-1)
    reward = (sampled % 2 == 0).float().mean(dim=1)
    advantage = reward - reward.mean()
    loss = -(advantage[:, None] * logp).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(reward.mean())


def dir_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


@dataclass
class Published:
    params: int
    bf16_bytes: int
    publish_s: list[float] = field(default_factory=list)
    bytes_per_version: list[int] = field(default_factory=list)
    delta_publish_s: list[float] = field(default_factory=list)
    delta_bytes_per_version: list[int] = field(default_factory=list)


def train_and_publish(args: argparse.Namespace, store: WeightStore, deltas: WeightStore) -> Published:
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    model = build_model(shape, args.seed)
    params = sum(p.numel() for p in model.parameters())
    log(f"model: Qwen3-shaped, {params / 1e6:.0f} M parameters ({params * 2 / GB:.2f} GB in BF16)")
    config = model.config.to_dict()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    result = Published(params=params, bf16_bytes=params * 2)

    def publish(version: int, trained: Qwen3ForCausalLM) -> None:
        state = {k: v.detach().to(torch.bfloat16) for k, v in trained.state_dict().items()}
        for target, seconds, sizes in (
            (store, result.publish_s, result.bytes_per_version),
            (deltas, result.delta_publish_s, result.delta_bytes_per_version),
        ):
            started = time.perf_counter()
            target.publish(version, state, {"step": version}, config)
            elapsed = time.perf_counter() - started
            written = dir_bytes(target.path(version))
            if version:  # version 0 is the starting weights, not an update
                seconds.append(elapsed)
                sizes.append(written)
            kind = "full copy" if target is store else "delta store"
            log(f"published v{version} ({kind}): {written / GB:.4f} GB in {elapsed:.1f} s")

    publish(0, model)
    started = time.perf_counter()
    for step in range(1, args.versions + 1):
        reward = rl_step(model, optimizer, args.rows, 16, args.new_tokens, gen)
        publish(step, model)
        rate = step / (time.perf_counter() - started)
        log(
            f"step {step}/{args.versions}: reward {reward:.3f}, {1 / rate:.0f} s/step, "
            f"ETA {(args.versions - step) / rate:.0f} s"
        )
    del model, optimizer
    gc.collect()
    return result


# ----------------------------------------------------------------------------------- conversion


def publish_and_convert(
    args: argparse.Namespace, root: Path
) -> tuple[Published, dict[str, dict[str, float]]]:
    hf_logging.set_verbosity_error()
    torch.set_num_threads(2)
    full = WeightStore(str(root / "full"))
    deltas = WeightStore(str(root / "deltas"), snapshot_every=args.snapshot_every)
    published = train_and_publish(args, full, deltas)
    torch.set_num_threads(1)
    return published, convert_costs(full, args.replicas)


def convert_costs(store: WeightStore, replicas: int) -> dict[str, dict[str, float]]:
    """Per precision: CPU-seconds (this process, every thread) and wall seconds of converting
    version 1 alone, then of ``replicas`` converters of version 2 started at once, as every replica's
    sidecar does: with one converter per (version, precision) their work is about 1× one
    conversion, not ``replicas``×."""
    costs = {}
    for precision in QUANTIZED:
        cpu, wall = time.process_time(), time.perf_counter()
        store.convert(1, precision)
        one_cpu, one_wall = time.process_time() - cpu, time.perf_counter() - wall
        cpu = time.process_time()
        with ThreadPoolExecutor(replicas) as pool:
            paths = set(pool.map(store.convert, [2] * replicas, [precision] * replicas))
        together_cpu = time.process_time() - cpu
        assert len(paths) == 1, paths
        costs[precision] = {
            "cpu_s": one_cpu,
            "wall_s": one_wall,
            "replicas": replicas,
            "replicas_cpu_s": together_cpu,
            "work_ratio": together_cpu / one_cpu,
        }
        log(
            f"convert to {precision}: {one_cpu:.1f} CPU-s alone; {replicas} converters at once "
            f"{together_cpu:.1f} CPU-s ({together_cpu / one_cpu:.2f}x one)"
        )
    return costs


# ---------------------------------------------------------------------------------- sync passes


@dataclass
class Update:
    engine: int
    version: int
    start: float
    end: float


@dataclass
class PassResult:
    mode: str
    reveal: dict[int, float] = field(default_factory=dict)
    updates: list[Update] = field(default_factory=list)
    gaps: list[tuple[int, float, float]] = field(default_factory=list)  # (engine, from, to)


def reveal(source: WeightStore, target_root: Path, version: int) -> None:
    """Make ``version`` visible in the serving store as a publish does: staged (hard links, so no
    bytes are copied) and renamed into place in one step."""
    name = version_dir_name(version)
    staged = target_root / ".staging" / name
    shutil.copytree(source.path(version), staged, copy_function=os.link)
    os.rename(staged, target_root / name)


async def stream_forever(
    url: str,
    engine: int,
    prompt_len: int,
    max_new: int,
    vocab: int,
    seed: int,
    out: PassResult,
    stop: asyncio.Event,
) -> None:
    """Streamed requests, one after another; every gap between two tokens of one request is kept."""
    gen = torch.Generator().manual_seed(seed)
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            ids = torch.randint(1, vocab, (prompt_len,), generator=gen).tolist()
            body = {
                "input_ids": ids,
                "stream": True,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True},
            }
            last: float | None = None
            async with session.post(f"{url}/generate", json=body) as response:
                async for line in response.content:
                    if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        out.gaps.append((engine, last, now))
                    last = now
                    if stop.is_set():
                        break


async def sidecar(
    client: EngineClient,
    engine: int,
    store: WeightStore,
    mode: str,
    poll_s: float,
    out: PassResult,
    stop: asyncio.Event,
) -> None:
    """The weight-sync sidecar's loop, reduced to what is measured: poll, update, record."""
    served = 0
    while not stop.is_set():
        latest = await asyncio.to_thread(store.latest)
        if latest is not None and latest != served:
            path = store.path(latest)
            start = time.perf_counter()
            if mode == "paused":
                answer = await update_paused(client, path, latest)
            else:
                answer = await client.update_weights_from_disk(
                    path, latest, abort_all_requests=False, flush_cache=False
                )
            end = time.perf_counter()
            if not answer.get("success"):
                raise RuntimeError(f"engine {engine} refused v{latest}: {answer}")
            out.updates.append(Update(engine, latest, start, end))
            served = latest
        await asyncio.sleep(poll_s)


async def sync_pass(
    args: argparse.Namespace, source: WeightStore, root: Path, mode: str, vocab: int
) -> PassResult:
    serving_root = root / f"serve-{mode}"
    serving_root.mkdir()
    (serving_root / ".staging").mkdir()
    reveal(source, serving_root, 0)
    store = WeightStore(str(serving_root))
    out = PassResult(mode)
    engines = [
        EngineProcess(
            store.path(0),
            weight_precision=ENGINE_PRECISIONS[i % len(ENGINE_PRECISIONS)],
            max_running_requests=args.streams,
            torch_threads=1,
            extra_args=["--weight-root", str(serving_root), "--skip-tokenizer-init"],
            startup_timeout_s=600,
        )
        for i in range(args.engines)
    ]
    stop = asyncio.Event()
    try:
        for engine in engines:
            await asyncio.to_thread(engine.start)
        clients = [EngineClient(e.url, timeout_s=1800.0) for e in engines]
        # One update to the version they serve before anything is measured: an engine starts its
        # preparer process at its first update (seconds of imports), in both passes alike.
        for client in clients:
            warm = await client.update_weights_from_disk(store.path(0), 0, flush_cache=False)
            if not warm.get("success"):
                raise RuntimeError(f"warm-up update refused: {warm}")
        log(f"{mode}: {len(engines)} engines up")
        tasks = [
            asyncio.create_task(
                stream_forever(e.url, i, 32, args.stream_tokens, vocab, 100 * i + s, out, stop)
            )
            for i, e in enumerate(engines)
            for s in range(args.streams)
        ]
        await asyncio.sleep(args.settle_s)  # decode steps before the first update: the baseline gaps
        sidecars = [
            asyncio.create_task(sidecar(c, i, store, mode, args.poll, out, stop))
            for i, c in enumerate(clients)
        ]
        started = time.perf_counter()
        for version in range(1, args.versions + 1):
            await asyncio.to_thread(reveal, source, serving_root, version)
            out.reveal[version] = time.perf_counter()
            while sum(u.version == version for u in out.updates) < len(engines):
                for task in (*sidecars, *tasks):
                    if task.done() and task.exception():
                        raise task.exception()  # type: ignore[misc]
                await asyncio.sleep(0.05)
            took = max(u.end for u in out.updates if u.version == version) - out.reveal[version]
            rate = version / (time.perf_counter() - started)
            log(
                f"{mode}: v{version} served by every engine {took:.1f} s after publish, "
                f"ETA {(args.versions - version) / rate:.0f} s"
            )
            await asyncio.sleep(args.settle_s)
        stop.set()
        await asyncio.gather(*tasks, *sidecars, return_exceptions=True)
        for c in clients:
            await c.close()
    finally:
        stop.set()
        for engine in engines:
            await asyncio.to_thread(engine.close)
    return out


# --------------------------------------------------------------------------------------- report


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


SWAP_WINDOW_S = 0.005
"""The new weights are swapped in just before the update's answer leaves the engine: a gap that
reaches into this last stretch of the update spans the swap (or, on the paused path, the pause)."""


def summarise(result: PassResult) -> dict[str, Any]:
    """The pause an update causes is the gap between two tokens that spans its swap (on the paused
    path: the pause itself): judged against the median decode step outside updates.  Gaps during
    the rest of a staged update (the preparation) are decode steps slowed by the preparer's CPU,
    and now and then by another request's prefill, which happens outside updates too: reported
    apart, as the median and the longest."""
    windows = {(u.engine, u.version): (u.start, u.end) for u in result.updates}

    def in_update(engine: int, start: float, end: float) -> tuple[int, int] | None:
        for (e, v), (a, b) in windows.items():
            if e == engine and start < b and end > a:
                return e, v
        return None

    quiet: list[float] = []
    during: list[float] = []
    longest: dict[tuple[int, int], float] = {}
    swap_gap: dict[tuple[int, int], float] = {}
    for engine, start, end in result.gaps:
        key = in_update(engine, start, end)
        if key is None:
            quiet.append(end - start)
            continue
        longest[key] = max(longest.get(key, 0.0), end - start)
        if end > windows[key][1] - SWAP_WINDOW_S:
            swap_gap[key] = max(swap_gap.get(key, 0.0), end - start)
        else:
            during.append(end - start)
    step = statistics.median(quiet)
    pauses = list(swap_gap.values())
    to_every = [max(u.end for u in result.updates if u.version == v) - t for v, t in result.reveal.items()]
    durations = [u.end - u.start for u in result.updates]
    return {
        "decode_step_s": step,
        "quiet_gap_max_s": max(quiet),
        "pause_max_s": max(pauses) if pauses else 0.0,
        "pause_p50_s": statistics.median(pauses) if pauses else 0.0,
        "extra_over_step": (max(pauses) - step) / step if pauses else 0.0,
        "step_during_update_s": statistics.median(during) if during else step,
        "longest_gap_during_update_s": max(longest.values()) if longest else 0.0,
        "update_s_p50": statistics.median(durations),
        "publish_to_every_engine_s_p50": percentile(to_every, 0.5),
        "publish_to_every_engine_s_p95": percentile(to_every, 0.95),
        "updates_measured": len(swap_gap),
        "pause_per_update_s": {f"engine {e} v{v}": round(g, 4) for (e, v), g in sorted(swap_gap.items())},
        "gaps": len(result.gaps),
    }


def plot(results: list[PassResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.8 * len(results)), sharey=True)
    for ax, result in zip(axes, results, strict=True):
        origin = min(start for _, start, _ in result.gaps)
        for engine in sorted({e for e, _, _ in result.gaps}):
            xs = [end - origin for e, _, end in result.gaps if e == engine]
            ys = [end - start for e, start, end in result.gaps if e == engine]
            ax.scatter(xs, ys, s=3, label=f"engine {engine} ({ENGINE_PRECISIONS[engine % 2]})")
        for u in result.updates:
            ax.axvspan(u.start - origin, u.end - origin, color="grey", alpha=0.15)
        ax.set_yscale("log")
        ax.set_title(f"{result.mode}: gap between two tokens of a request (grey: an update runs)")
        ax.set_ylabel("seconds")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1].set_xlabel("seconds into the pass")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 30 M-parameter model, 3 versions")
    parser.add_argument(
        "--versions", type=int, default=0, help="training steps = versions (default 4; 3 quick)"
    )
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--rows", type=int, default=4, help="sequences per training step")
    parser.add_argument("--new-tokens", type=int, default=24, help="sampled tokens per sequence")
    parser.add_argument("--snapshot-every", type=int, default=10, help="the delta store's snapshot interval")
    parser.add_argument("--replicas", type=int, default=4, help="converters of one version started at once")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4, help="concurrent streamed requests per engine")
    parser.add_argument("--stream-tokens", type=int, default=256, help="tokens per streamed request")
    parser.add_argument(
        "--poll", type=float, default=POLL_S, help="the sidecar's poll interval (its default)"
    )
    parser.add_argument(
        "--settle-s", type=float, default=0.0, help="decoding between versions (default 8; 3 quick)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--plot", type=Path, default=None, help="draw the gaps here (PNG)")
    args = parser.parse_args(argv)
    args.versions = args.versions or (3 if args.quick else 4)
    args.settle_s = args.settle_s or (3.0 if args.quick else 8.0)
    hf_logging.set_verbosity_error()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="mixrl-bench-weight-sync-") as tmp:
        root = Path(tmp)
        # Training and conversion in a process of their own: its ~10 GB (AdamW's state, the
        # stores' caches) is returned before the engines start, each holding its model twice.
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            published, conversions = pool.submit(publish_and_convert, args, root).result()
        full = WeightStore(str(root / "full"))
        deltas = WeightStore(str(root / "deltas"), snapshot_every=args.snapshot_every)
        vocab = (QUICK_SHAPE if args.quick else FULL_SHAPE)["vocab_size"]
        # Today's path: full copies, paused engines.  The new one: deltas, engines that prepare while serving.
        passes = [
            asyncio.run(sync_pass(args, source, root, mode, vocab))
            for mode, source in (("paused", full), ("staged", deltas))
        ]
    summaries = {p.mode: summarise(p) for p in passes}
    gb = published.bf16_bytes / GB
    report = {
        "parameters": published.params,
        "bf16_gb": gb,
        "publish_s": published.publish_s,
        "bytes_per_version": published.bytes_per_version,
        "delta_publish_s": published.delta_publish_s,
        "delta_bytes_per_version": published.delta_bytes_per_version,
        "delta_ratio": max(published.delta_bytes_per_version)
        / statistics.median(published.bytes_per_version),
        "conversion": {p: {**c, "cpu_s_per_gb": c["cpu_s"] / gb} for p, c in conversions.items()},
        "passes": summaries,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(passes, args.plot)
    return 0 if judged(report) else 1


def print_report(report: dict[str, Any]) -> None:
    gb = report["bf16_gb"]
    print(f"\nmodel: {report['parameters'] / 1e6:.0f} M parameters, {gb:.2f} GB in BF16")
    publish = statistics.median(report["publish_s"])
    written = statistics.median(report["bytes_per_version"]) / 1e9
    print(
        f"publish (full copy): {publish:.1f} s per version ({publish / gb:.1f} s/GB), {written:.3f} GB written"
    )
    delta_s = statistics.median(report["delta_publish_s"])
    delta_gb = max(report["delta_bytes_per_version"]) / 1e9
    print(
        f"publish (delta):     {delta_s:.1f} s per version, at most {delta_gb:.4f} GB written "
        f"({report['delta_ratio']:.3f}x a full copy)"
    )
    for precision, c in report["conversion"].items():
        print(
            f"convert to {precision:6s}: {c['cpu_s']:.1f} CPU-s per version ({c['cpu_s_per_gb']:.1f} CPU-s/GB); "
            f"{c['replicas']} replicas at once: {c['work_ratio']:.2f}x one conversion's CPU"
        )
    print(f"\n{'':34s}{'paused (baseline)':>20s}{'staged':>12s}")
    rows = [
        ("decode step, median (s)", "decode_step_s"),
        ("gap without updates, longest (s)", "quiet_gap_max_s"),
        ("pause: the gap spanning the swap (s)", "pause_max_s"),
        ("pause beyond one step (steps)", "extra_over_step"),
        ("step while preparing, median (s)", "step_during_update_s"),
        ("longest gap during an update (s)", "longest_gap_during_update_s"),
        ("one update's duration, p50 (s)", "update_s_p50"),
        ("publish -> every engine, p50 (s)", "publish_to_every_engine_s_p50"),
        ("publish -> every engine, p95 (s)", "publish_to_every_engine_s_p95"),
    ]
    paused, staged = report["passes"]["paused"], report["passes"]["staged"]
    for label, key in rows:
        print(f"{label:34s}{paused[key]:>20.3f}{staged[key]:>12.3f}")
    print(f"{'pause ratio staged / paused':34s}{staged['pause_max_s'] / paused['pause_max_s']:>32.3f}")


def judged(report: dict[str, Any]) -> bool:
    """The issue's targets.  "One engine's load time" is one engine's update in the same pass (the
    median over engines and versions): publish → every engine within 2× of it says the fleet is
    not serialised behind a shared step (a conversion per replica, a slow poll, the store)."""
    staged = report["passes"]["staged"]
    checks = {
        "bytes per version <= 0.3x a full copy (deltas)": report["delta_ratio"] <= 0.3,
        "conversion once per precision (replicas' CPU <= 1.5x one)": all(
            c["work_ratio"] <= 1.5 for c in report["conversion"].values()
        ),
        "pause <= one decode step (staged)": staged["extra_over_step"] <= 1.0,
        "publish -> every engine p95 <= 2x one engine's load (staged)": staged[
            "publish_to_every_engine_s_p95"
        ]
        <= 2 * staged["update_s_p50"],
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    return all(checks.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
