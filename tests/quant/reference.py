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
    magnitude = x64.abs().clamp(max=float(grid[-1]))
    distance = (grid[None, :] - magnitude[:, None]).abs()
    nearest = distance == distance.min(dim=1, keepdim=True).values
    even = torch.arange(len(grid)) % 2 == 0
    preference = nearest.to(torch.int64) * (1 + even.to(torch.int64))  # an even nearest code beats an odd one
    code = preference.argmax(dim=1)
    return torch.copysign(grid[code], x64).view(x.shape)


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
    scale = torch.clamp(w.abs().amax(dim=1, keepdim=True), min=1e-12) / torch.tensor(448.0)
    return round_to_grid(w / scale, E4M3).to(torch.float32) * scale


def mxfp4(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    w = w.to(torch.float32)
    out = torch.empty_like(w)
    for c in range(0, w.shape[1], block):  # one block column at a time, every row at once
        values = w[:, c : c + block].to(torch.float64)
        exponents = []
        for amax in values.abs().amax(dim=1).tolist():
            exponents.append(-127 if amax == 0 else max(-127, min(127, math.floor(math.log2(amax)) - 2)))
        scale = torch.tensor([math.ldexp(1.0, e) for e in exponents], dtype=torch.float64)[:, None]
        out[:, c : c + block] = (round_to_grid(values / scale, E2M1) * scale).to(torch.float32)
    return out


def nvfp4(w: torch.Tensor, global_amax: float | None = None, block: int = 16) -> torch.Tensor:
    w = w.to(torch.float32)
    amax = torch.tensor(global_amax if global_amax is not None else float(w.abs().max()), dtype=torch.float32)
    global_scale = amax / torch.tensor(6.0 * 448.0) if amax > 0 else torch.tensor(1.0)
    out = torch.empty_like(w)
    for c in range(0, w.shape[1], block):
        values = w[:, c : c + block]
        block_amax = values.abs().amax(dim=1)
        raw = torch.clamp(block_amax / (6.0 * global_scale), min=2.0**-9, max=448.0)
        scale = round_to_grid(raw, E4M3).to(torch.float32)
        scale = torch.where(block_amax == 0, torch.tensor(1.0), scale)  # all-zero blocks use 1
        divisor = (scale * global_scale)[:, None]
        out[:, c : c + block] = round_to_grid(values / divisor, E2M1).to(torch.float32) * divisor
    return out


def fp8_token_groups(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """E4M3 with one scale amax / 448 per row and ``group`` columns (a row of one tile's height)."""
    x = x.to(torch.float32)
    out = torch.empty_like(x)
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], group):
            values = x[r, c : c + group]
            scale = torch.clamp(values.abs().max(), min=1e-12) / torch.tensor(448.0)
            out[r, c : c + group] = round_to_grid(values / scale, E4M3).to(torch.float32) * scale
    return out
