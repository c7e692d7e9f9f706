"""Weight-store tests: mixrl/rl/weights.py and mixrl/rl/checkpoint_formats.py.

Everything here is real: files in a temporary directory, safetensors, sha256 manifests, renames,
`transformers` Qwen3 / Qwen3-MoE models built from tiny configs (nothing downloaded) and loaded back
with `AutoModelForCausalLM.from_pretrained`, and a child Python process killed with SIGKILL in the
middle of a publish. The only stand-in is the pause point: the child replaces one internal step
(`_write_manifest` or `LocalStorage._promote`) with a wait, so the kill lands at a known moment.
No object-store backend exists yet (only the `Storage` interface), and no SGLang runs here: the
converted checkpoints are checked against quant.py's emulation and the published config formats.
"""

from __future__ import annotations

import pytest
import torch

from mixrl.rl.weights import WeightStore

from .. import tiny_models


def tiny_qwen3(tie_word_embeddings: bool = False) -> torch.nn.Module:
    """The shared tiny Qwen3 in BF16, the precision the trainer publishes."""
    return tiny_models.tiny_qwen3(tie_word_embeddings=tie_word_embeddings).to(torch.bfloat16)


def tiny_qwen3_moe() -> torch.nn.Module:
    """The shared tiny Qwen3-MoE in BF16, the precision the trainer publishes."""
    return tiny_models.tiny_qwen3_moe().to(torch.bfloat16)


def assert_same_parameters(expected: torch.nn.Module, got: torch.nn.Module) -> None:
    expected_state, got_state = expected.state_dict(), got.state_dict()
    assert expected_state.keys() == got_state.keys()
    for name, tensor in expected_state.items():
        assert got_state[name].dtype == tensor.dtype and torch.equal(got_state[name], tensor), name


@pytest.fixture
def store(tmp_path) -> WeightStore:
    return WeightStore(str(tmp_path / "weights"))
