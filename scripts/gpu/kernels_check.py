"""The emulated precisions against real GPU kernels (issue #32's GPU check; scripts/gpu/kernels-check.sh).

1. **W8A8, real FP8 GEMM**: ``torch._scaled_mm`` with row-wise scales (one per token of the input,
   one per output channel of the weight: the fp8_channel recipe) against the emulation
   (``quant.quantize_activation`` and ``quant.quantize_dequantize``, then a float32 product).  The
   emulation holds when the real kernel's distance to it is small next to the quantization error
   itself (the real product is rounded to BF16 on output, the emulated one is not).
2. **A BF16 pool's kernels**: the tiny Qwen3's next-token distributions from the trainer's numbers
   (float32, SDPA, on the CPU) against the GPU's (BF16, PyTorch's flash/efficient attention) and
   against the emulation of serving kernels (``--dtype bfloat16 --attention-backend split_kv`` on
   the CPU).  The emulation is a fair stand-in when both KLs are of one order of magnitude.

``--dry-run`` runs the CPU half only (no CUDA needed).  One line per check; exit 1 when one fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

from mixrl.rl import quant
from mixrl.rl.engine.attention import use_engine_attention
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model

ROWS, IN, OUT = 64, 1024, 768
HOLDS = 0.25
"""The real kernel's distance to the emulation, as a share of the quantization error, at most."""


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def w8a8(cuda: bool) -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, IN, generator=g) * torch.rand(ROWS, 1, generator=g) * 4
    w = torch.randn(OUT, IN, generator=g) * 0.05
    exact = x @ w.T
    emulated = quant.quantize_activation(x, "fp8_channel") @ quant.quantize_dequantize(w, "fp8_channel").T
    error = relative(emulated, exact)
    if not cuda:
        print(f"kernels-check: dry run: fp8 W8A8 emulated, quantization error {error:.2e} (no GPU product)")
        return True
    a, b = quant.pack(x, "fp8_channel"), quant.pack(w, "fp8_channel")
    real = (
        torch._scaled_mm(
            a["weight"].cuda(),
            b["weight"].cuda().T,
            scale_a=a["weight_scale"].cuda(),
            scale_b=b["weight_scale"].cuda().T.contiguous(),
            out_dtype=torch.bfloat16,
        )
        .float()
        .cpu()
    )
    distance = relative(real, emulated)
    ok = distance <= HOLDS * error
    print(
        f"kernels-check: fp8 W8A8 (torch._scaled_mm, row-wise scales): real vs emulated {distance:.2e}, "
        f"quantization error {error:.2e} ({distance / error:.2f}× of it, at most {HOLDS}): {'ok' if ok else 'FAIL'}"
    )
    return ok


def next_token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits[:, -1].float().log_softmax(-1).cpu()


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum(-1).mean())


def bf16_kernels(cuda: bool) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        path = create_tiny_checkpoint(tmp, "qwen3", vocab_size=512, seed=0)
        ids = torch.randint(1, 512, (16, 48), generator=torch.Generator().manual_seed(1))
        trainer = next_token_logprobs(load_model(path).eval(), ids)
        emulated_model = load_model(path, dtype=torch.bfloat16).eval()
        use_engine_attention(emulated_model, "split_kv")
        emulated = kl(trainer, next_token_logprobs(emulated_model, ids))
        if not cuda:
            print(
                f"kernels-check: dry run: BF16 serving kernels emulated, KL(trainer ‖ emulated) {emulated:.2e}"
            )
            return True
        gpu = kl(
            trainer, next_token_logprobs(load_model(path, dtype=torch.bfloat16).eval().cuda(), ids.cuda())
        )
    ratio = emulated / gpu if gpu > 0 else float("inf")
    ok = 0.1 <= ratio <= 10
    print(
        f"kernels-check: BF16 kernels: KL(trainer ‖ GPU BF16) {gpu:.2e}, KL(trainer ‖ emulated) {emulated:.2e} "
        f"({ratio:.2f}×, one order of magnitude allowed): {'ok' if ok else 'FAIL'}"
    )
    return ok


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the CPU half only")
    args = parser.parse_args(argv)
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        print("kernels-check: no CUDA device (use --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    ok = w8a8(cuda) and bf16_kernels(cuda)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
