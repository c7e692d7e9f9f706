"""Torch engine tests: mixrl/rl/engine/ and mixrl/rl/tiny_models.py.

Real: the engine as a child process (`python -m mixrl.cli engine`) serving HTTP on loopback, the
async client talking to it, `transformers` Qwen3 and Qwen3-MoE models built from tiny configs on
this machine (random weights; nothing downloaded), safetensors files, the weight store, the
quantizers of mixrl/rl/quant.py and prometheus-client's exposition.

Stand-ins, named as such: SGLang itself cannot run here (it needs a GPU), so the client's SGLang
compatibility is tested against responses shaped like SGLang's (only its standard fields) in
test_records.py, and the torch engine stands in for SGLang wherever a server is needed.

References: every model result is compared with a plain `transformers` forward pass over the whole
sequence (no KV cache, no batching, no server), at the same precision, prepared by hand in
:func:`reference_model`; sampling math is compared with float64 code written out in
:mod:`reference` beside this file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.cache_utils import Cache, DynamicLayer
from transformers.utils import logging as hf_logging

from mixrl.local.processes import EngineProcess
from mixrl.rl import activation_quant, quant
from mixrl.rl.auth import AuthToken
from mixrl.rl.engine.client import EngineClient
from mixrl.rl.engine.server import build_app
from mixrl.rl.engine.service import EngineConfig, EngineService
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model
from mixrl.rl.weights import WeightStore

from ..fakes import serve

hf_logging.disable_progress_bar()
# Tiny models on shared cores: one intra-op thread avoids multi-millisecond thread handoffs per op.
torch.set_num_threads(1)

VOCAB = 512


@pytest.fixture(scope="session")
def dense_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3", vocab_size=VOCAB, seed=0
    )


@pytest.fixture(scope="session")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return create_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "moe", "qwen3_moe", vocab_size=VOCAB, seed=1
    )


def publish(store: WeightStore, version: int, checkpoint: str | Path) -> str:
    """The weights and config of the checkpoint directory ``checkpoint`` published in ``store`` as
    ``version`` (metadata ``{"step": version}``), as the trainer publishes; returns its directory."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return store.publish(
        version, load_file(Path(checkpoint) / "model.safetensors"), {"step": version}, config
    )


@pytest.fixture
def other_version(tmp_path: Path) -> tuple[str, WeightStore]:
    """Version 1 for an engine on ``dense_path`` whose weight root is ``tmp_path``: the same tiny
    dense model with other weights (seed 7, in tmp_path/other), published in the store
    tmp_path/store.  (The checkpoint's directory, the store.)"""
    other = create_tiny_checkpoint(tmp_path / "other", "qwen3", vocab_size=VOCAB, seed=7)
    store = WeightStore(str(tmp_path / "store"))
    publish(store, 1, other)
    return other, store


@pytest.fixture(scope="module")
def engine(dense_path: str) -> Iterator[EngineProcess]:
    """A bf16 engine on the dense tiny model, shared by one test module."""
    with EngineProcess(dense_path) as process:
        yield process


@contextlib.asynccontextmanager
async def serve_in_process(
    auth_token: AuthToken | None = None, **config: object
) -> AsyncIterator[tuple[str, EngineService]]:
    """The engine's HTTP app on a loopback port inside this process (no start-up cost).

    Yields its URL and the service behind it.
    Same application as `mixrl engine`, minus the command line and the child process; with
    ``auth_token`` its control endpoints need the token, as with ``--auth-token-file``.
    """
    service = EngineService(EngineConfig(**config))  # type: ignore[arg-type]
    runner, url = await serve(build_app(service, auth_token), shutdown_timeout=1.0)
    try:
        yield url, service
    finally:
        service.sched.abort_all("test finished")
        await runner.cleanup()


async def until_running(client: EngineClient, at_least: int = 1) -> None:
    """Wait until the engine runs ``at_least`` requests (they are in its batch, past the queue)."""
    while (await client.metrics()).get("sglang:num_running_reqs", 0) < at_least:
        await asyncio.sleep(0.01)


def reference_model(path: str | Path, precision: str = "bf16", activations: bool = True) -> torch.nn.Module:
    """The served model prepared by hand: every parameter rounded to bf16, linear weights quantized,
    and (``activations``) their inputs quantized as the precision's kernels do, calibrated."""
    model = load_model(path, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    report = quant.quantize_model_(model, precision)
    inputs = activation_quant.install_(model, precision, report["quantized"]) if activations else None
    if inputs:
        inputs.calibrated(model)
    return model


class _Fp8KVLayer(DynamicLayer):
    """Reference FP8 KV cache: round keys/values through E4M3 (scale 1.0) as they are stored."""

    def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[no-untyped-def]
        return super().update(
            quant.fp8_kv_quant_dequant(key_states, 1.0),
            quant.fp8_kv_quant_dequant(value_states, 1.0),
            *args,
            **kwargs,
        )


@torch.no_grad()
def reference_logprobs(
    model: torch.nn.Module,
    prompt: list[int],
    output: list[int],
    temperature: float = 1.0,
    fp8_kv: bool = False,
) -> torch.Tensor:
    """log_softmax(z / T) at every generated position [len(output), V], float64, one full forward pass.

    Row t is the distribution the token output[t] was drawn from (teacher forcing on the engine's own
    tokens: the same as a plain generation loop as long as the tokens agree).
    """
    ids = torch.tensor([prompt + output[:-1]])
    kwargs = {}
    if fp8_kv:
        kwargs = {
            "cache": Cache(layers=[_Fp8KVLayer() for _ in range(model.config.num_hidden_layers)]),
            "use_cache": True,
        }
    logits = model(input_ids=ids, **kwargs).logits[0, len(prompt) - 1 :].double()
    return torch.log_softmax(logits / temperature, dim=-1)


def random_prompts(count: int, seed: int, low: int = 2, high: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


CHAT_TEMPLATE = (
    "{%- for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ROLE_WORDS = ["system", "user", "assistant"]


def word(i: int) -> str:
    """The tiny tokenizer's word for id ``i`` beyond its special and role tokens (fixed width, so no
    word is a substring of another)."""
    return f"w{i:03d}"


def save_tiny_tokenizer(directory: Path) -> Path:
    """A real Hugging Face fast tokenizer (word level, VOCAB ids, a ChatML-like chat template) saved
    in ``directory``: nothing downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    head = [*SPECIAL_TOKENS, *ROLE_WORDS]
    vocab = {w: i for i, w in enumerate(head)}
    vocab.update({word(i): i for i in range(len(head), VOCAB)})
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer")))


class ByteCodec:
    """A tokenizer whose ids are UTF-8 bytes: decoding a cut inside a character gives U+FFFD."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True, spaces: bool = True) -> str:
        return bytes(ids).decode("utf-8", "replace")

    def token_text(self, token_id: int) -> str:
        return bytes([token_id]).decode("utf-8", "replace")
