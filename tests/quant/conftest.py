"""Precision-emulation tests: mixrl/rl/quant.py.

Everything here is real: the quantizers, torch's float8 casts, and `transformers` Qwen3 / Qwen3-MoE
models built from tiny configs on this machine (random weights, nothing downloaded). The expected
numbers come from hand-worked cases and from plain float64 references in reference.py that
enumerate the format's code points; no GPU or serving kernel runs here, so "what the kernel sees"
is checked against the published recipes (docs/precisions.md), not against SGLang itself.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gaussian_weight() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(512, 1024, generator=generator) * 0.02
