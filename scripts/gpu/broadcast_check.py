"""The trainer's weight broadcast on a GPU machine (issue #29 item 5; run by scripts/gpu/broadcast-check.sh).

This process is the trainer's rank 0: it holds a version's BF16 weights on the GPU and broadcasts
them (mixrl.rl.trainer.weight_broadcast, SGLang's ``update_weights_from_distributed`` contract) to
a real ``mixrl engine`` process, then checks what tests/engine/test_weight_broadcast.py checks on
the CPU: the engine reports the version and its greedy tokens equal those of an engine that loaded
the same weights from the store.  It prints the measured broadcast time and GB/s.

NCCL refuses two ranks on one CUDA device ("Duplicate GPU detected"), so ``--backend nccl`` needs
two GPUs: the trainer on the first, the engine receiving on the second.  On a one-GPU machine the
check says so in one line and measures gloo instead (the weights leave the GPU through host
memory), unless ``--backend nccl`` was asked for explicitly, which then fails.
Prints one line per check and exits 1 on the first that fails.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

from mixrl.local.processes import EngineProcess, wait_healthy
from mixrl.rl.auth import AuthToken
from mixrl.rl.engine.client import EngineClient
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model
from mixrl.rl.trainer.weight_broadcast import Receiver, WeightBroadcaster
from mixrl.rl.weights import WeightStore

TOKEN = AuthToken("broadcast-check-token")
PROMPT = [5, 9, 17, 33, 2]
NCCL_NEEDS_TWO = "nccl needs two GPUs: NCCL refuses two ranks on one CUDA device (Duplicate GPU detected)"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="broadcast_check.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "--backend", choices=("auto", "nccl", "gloo"), default="auto", help="auto: nccl with 2+ GPUs"
    )
    p.add_argument(
        "--hidden-size", type=int, default=1024, help="the model's width (1024: about 0.2 GB in BF16)"
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--bucket-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="broadcasts timed (versions 1, 2, ...)")
    return p.parse_args(argv)


def choose_backend(asked: str, gpus: int) -> tuple[str, str | None]:
    """(backend, a line saying why it is not the one asked for, or None)."""
    if asked == "gloo":
        return "gloo", None
    if gpus >= 2:
        return "nccl", None
    if asked == "nccl":
        raise SystemExit(f"broadcast-check: {NCCL_NEEDS_TWO}; this machine has {gpus}")
    return "gloo", f"{NCCL_NEEDS_TWO}; measuring gloo from GPU-held weights instead"


async def greedy(url: str) -> list[int]:
    async with EngineClient(url, auth_token=TOKEN) as client:
        return (await client.generate(PROMPT, max_new_tokens=16, temperature=0.0, ignore_eos=True)).output_ids


async def check(args: argparse.Namespace, work: Path) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend, note = choose_backend(args.backend, gpus)
    if note:
        print(f"broadcast-check: {note}")
    trainer_device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    model_dir = create_tiny_checkpoint(
        work / "model", "qwen3", vocab_size=512, seed=3,
        hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size, num_hidden_layers=args.layers,
    )  # fmt: skip
    model = load_model(model_dir)
    store = WeightStore(str(work / "store"))
    base = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in model.state_dict().items()}
    store.publish(0, base, {"step": 0}, model.config.to_dict())
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    print(f"broadcast-check: {backend}, {nbytes / 1e9:.3f} GB per version, trainer on {trainer_device}")
    # The engine receives on the second GPU under NCCL; it computes on the CPU either way.
    engine_env = {"CUDA_VISIBLE_DEVICES": "1" if backend == "nccl" else ""}
    engine = EngineProcess(
        store.path(0), pool="bf16", auth_token=TOKEN, torch_threads=4, startup_timeout_s=600
    )
    engine.server.start(engine_env)
    await asyncio.to_thread(wait_healthy, [engine.server], 600)
    try:
        device = trainer_device if backend == "nccl" else torch.device("cpu")
        broadcaster = WeightBroadcaster(
            "127.0.0.1", backend=backend, device=device, bucket_bytes=args.bucket_mib << 20, auth_token=TOKEN
        )
        state: dict[str, torch.Tensor] = {}
        for version in range(1, args.repeats + 1):
            state = {
                n: (t.float() * (1 + 0.01 * version)).to(torch.bfloat16).to(trainer_device)
                for n, t in base.items()
            }
            if trainer_device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            result = await broadcaster.broadcast([Receiver("bf16", engine.url)], state, version)
            total = time.perf_counter() - started
            if result.error is not None:
                print(f"broadcast-check: version {version}: FAILED: {result.error}")
                print(engine.log_tail(30))
                return 1
            print(
                f"broadcast-check: version {version}: {result.bytes / 1e9:.3f} GB broadcast in {result.broadcast_s:.3f} s"
                f" ({result.gb_per_s:.2f} GB/s); served {result.transfer_s:.3f} s after the first bucket (the"
                f" engine's answers, preparation and swap included); group set-up {result.setup_s:.3f} s;"
                f" {total:.3f} s in all"
            )
        async with EngineClient(engine.url, auth_token=TOKEN) as client:
            served = await client.get_weight_version()
        if served != args.repeats:
            print(f"broadcast-check: the engine serves version {served}, not {args.repeats}")
            return 1
        store.publish(
            args.repeats,
            {n: t.cpu() for n, t in state.items()},
            {"step": args.repeats},
            model.config.to_dict(),
        )
        with EngineProcess(store.path(args.repeats), weight_version=args.repeats, pool="ref", torch_threads=4,
                           startup_timeout_s=600, auth_token=TOKEN) as reference:  # fmt: skip
            same = await greedy(engine.url) == await greedy(reference.url)
        print(f"broadcast-check: greedy tokens equal those of an engine loaded from the store: {same}")
        return 0 if same else 1
    finally:
        await asyncio.to_thread(engine.close)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="broadcast-check-") as work:
        code = asyncio.run(check(args, Path(work)))
    print("broadcast-check: passed" if code == 0 else "broadcast-check: failed")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
