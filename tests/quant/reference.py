"""Plain references for the quantizers: loops over blocks, rounding by enumerating every code point.

Scales follow the recipes' float32 arithmetic (they are part of the format); rounding to a code is
done in float64 by nearest distance with ties to the even code, independently of quant.py's
threshold counting. Slow by design; use on small tensors only.
"""

from __future__ import annotations

import math

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _positive_e4m3() -> torch.Tensor:
    values = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    return values[torch.isfinite(values)]  # codes 0..126 (0x7F is NaN); index == code


E4M3 = _positive_e4m3()


def round_to_grid(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Nearest grid value per element (grid sorted, index = code), ties to the even code, saturating."""
    x64 = x.to(torch.float64).flatten()
    out = torch.empty_like(x64)
    for i, value in enumerate(x64.tolist()):
        magnitude = min(abs(value), float(grid[-1]))
        distances = (grid - magnitude).abs()
        best = float(distances.min())
        candidates = [code for code in range(len(grid)) if float(distances[code]) == best]
        code = next((c for c in candidates if c % 2 == 0), candidates[0])
        out[i] = math.copysign(float(grid[code]), value)
    return out.view(x.shape)


def fp8_block(w: torch.Tensor, tile: int = 128) -> torch.Tensor:
    w = w.to(torch.float32)
    out = torch.empty_like(w)
    for r in range(0, w.shape[0], tile):
        for c in range(0, w.shape[1], tile):
            block = w[r : r + tile, c : c + tile]
            scale = torch.clamp(block.abs().max(), min=1e-12) / torch.tensor(448.0)
            codes = round_to_grid(block / scale, E4M3)
            out[r : r + tile, c : c + tile] = (codes.to(torch.float32) * scale).to(torch.float32)
    return out


def fp8_channel(w: torch.Tensor) -> torch.Tensor:
    w = w.to(torch.float32)
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        scale = torch.clamp(w[r].abs().max(), min=1e-12) / torch.tensor(448.0)
        out[r] = round_to_grid(w[r] / scale, E4M3).to(torch.float32) * scale
    return out


def mxfp4(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    w = w.to(torch.float32)
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for c in range(0, w.shape[1], block):
            values = w[r, c : c + block]
            amax = float(values.abs().max())
            shared = -127 if amax == 0 else max(-127, min(127, math.floor(math.log2(amax)) - 2))
            scale = math.ldexp(1.0, shared)
            codes = round_to_grid(values.to(torch.float64) / scale, E2M1)
            out[r, c : c + block] = (codes * scale).to(torch.float32)
    return out


def nvfp4(w: torch.Tensor, global_amax: float | None = None, block: int = 16) -> torch.Tensor:
    w = w.to(torch.float32)
    amax = torch.tensor(global_amax if global_amax is not None else float(w.abs().max()), dtype=torch.float32)
    global_scale = amax / torch.tensor(6.0 * 448.0) if amax > 0 else torch.tensor(1.0)
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for c in range(0, w.shape[1], block):
            values = w[r, c : c + block]
            block_amax = values.abs().max()
            if block_amax == 0:
                scale = torch.tensor(1.0)
            else:
                raw = torch.clamp(block_amax / (6.0 * global_scale), min=2.0**-9, max=448.0)
                scale = round_to_grid(raw.reshape(1), E4M3).to(torch.float32).reshape(())
            divisor = scale * global_scale
            codes = round_to_grid(values / divisor, E2M1)
            out[r, c : c + block] = codes.to(torch.float32) * divisor
    return out
