"""Megatron-core pieces of the trainer, with real megatron-core (a dev dependency: these tests fail,
never skip, when it is missing).

On the CPU, two torchrun ranks form real ``parallel_state`` tensor-parallel groups over gloo and build
megatron-core's ``GPTModel`` (local layer spec, ``use_cpu_initialization``): the Hugging Face Qwen3
weights (dense with tensor parallelism 2, untied and tied; MoE with expert parallelism 2 and with
tensor parallelism 2) go in through mixrl.rl.trainer.megatron_convert and come back out exactly;
Megatron's own QKV split and dense MLP compute the Hugging Face layer; and the corrected loss on the
vocabulary-parallel output layer's logit shards equals the unsharded loss, gradients included.
``GPTModel.forward`` itself needs CUDA in megatron-core 0.16 (the rotary table, the attention's matmul
buffer and the MoE router's weight go to ``torch.cuda.current_device()``): that check runs when CUDA
is present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from mixrl.rl.corrections import CorrectionConfig, LossTokens, token_policy_loss
from mixrl.rl.tiny_models import create_tiny_checkpoint, load_model, tiny_config
from mixrl.rl.trainer.megatron_convert import (
    check_supported,
    hf_to_megatron,
    megatron_to_hf,
    parallel_shard,
    parallel_unshard,
    pipeline_shard,
    pipeline_unshard,
)

WORKER = Path(__file__).with_name("megatron_worker.py")


def run_worker(
    model_dir: Path, out: Path, ranks: int, device: str, ep: int = 1, pp: int = 1
) -> list[dict[str, Any]]:
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(WORKER), str(model_dir), str(out), device, str(ep), str(pp)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in range(ranks)]


@pytest.fixture(scope="module")
def cpu_ranks(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_worker(tiny_model_dir, tmp_path_factory.mktemp("megatron") / "out", ranks=2, device="cpu")


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(
        create_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "model", "qwen3_moe", vocab_size=48, seed=3)
    )


def hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in load_model(model_dir).state_dict().items()}


def assert_round_trip_exact(ranks: list[dict[str, Any]], model_dir: Path) -> None:
    for r in ranks:  # every Megatron parameter was loaded, nothing was left over
        assert r["missing"] == [] and r["unexpected"] == []
    expected = hf_state(model_dir)
    back = ranks[0]["hf_back"]
    assert sorted(back) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


def test_hf_megatron_hf_round_trip_through_a_tensor_parallel_gpt_model_is_exact(
    cpu_ranks: list[dict[str, Any]], tiny_model_dir: Path
) -> None:
    assert [r["place"] for r in cpu_ranks] == [(0, 0), (0, 1)]  # (ep_rank, tp_rank)
    assert_round_trip_exact(cpu_ranks, tiny_model_dir)


def test_tied_embeddings_round_trip_through_a_tensor_parallel_gpt_model(tmp_path: Path) -> None:
    model_dir = Path(
        create_tiny_checkpoint(tmp_path / "tied", "qwen3", vocab_size=48, seed=4, tie_word_embeddings=True)
    )
    state = hf_state(model_dir)
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    ranks = run_worker(model_dir, tmp_path / "out", ranks=2, device="cpu")
    assert_round_trip_exact(ranks, model_dir)
    torch.testing.assert_close(
        ranks[0]["logits_from_shared"], ranks[0]["hidden"] @ state["lm_head.weight"][:24].T
    )


@pytest.mark.parametrize(("ep", "places"), [(2, [(0, 0), (1, 0)]), (1, [(0, 0), (0, 1)])])
def test_qwen3_moe_round_trip_through_an_expert_or_tensor_parallel_gpt_model_is_exact(
    tiny_moe_dir: Path, tmp_path: Path, ep: int, places: list[tuple[int, int]]
) -> None:
    ranks = run_worker(tiny_moe_dir, tmp_path / "out", ranks=2, device="cpu", ep=ep)
    assert [r["place"] for r in ranks] == places
    assert_round_trip_exact(ranks, tiny_moe_dir)
    assert_layer0_computes_what_hugging_face_computes(ranks, tiny_moe_dir)


def assert_layer0_computes_what_hugging_face_computes(ranks: list[dict[str, Any]], model_dir: Path) -> None:
    """Megatron's modules, holding the converted weights, compute Hugging Face's layer 0 pieces: the
    query/key/value heads (the fused QKV layout and the q/k norms) and, for a dense model, the MLP's
    output (the [gate; up] layout). An MoE block runs only on CUDA (its router's forward)."""
    layer = load_model(model_dir).model.layers[0]
    attn = layer.self_attn
    x = torch.randn(7, 2, attn.config.hidden_size, generator=torch.Generator().manual_seed(6))
    heads = (*x.shape[:2], -1, attn.head_dim)
    with torch.no_grad():
        expected = {
            "q": attn.q_norm(attn.q_proj(x).view(heads)),
            "k": attn.k_norm(attn.k_proj(x).view(heads)),
            "v": attn.v_proj(x).view(heads),
        }
        dense = attn.config.model_type == "qwen3"
        expected_mlp = layer.mlp(x.transpose(0, 1).contiguous()).transpose(0, 1) if dense else None
    for name, value in expected.items():  # tensor parallelism splits the heads: rank order on dim 2
        parts = [r["layer0"][name] for r in ranks if r["place"][0] == 0]
        torch.testing.assert_close(torch.cat(parts, dim=2), value, rtol=1e-5, atol=1e-6)
    for r in ranks:
        assert ("mlp" in r["layer0"]) == dense
        if dense:
            torch.testing.assert_close(r["layer0"]["mlp"], expected_mlp, rtol=1e-5, atol=1e-6)


def test_megatron_modules_compute_the_hugging_face_layer_on_cpu(
    cpu_ranks: list[dict[str, Any]], tiny_model_dir: Path
) -> None:
    assert_layer0_computes_what_hugging_face_computes(cpu_ranks, tiny_model_dir)


def test_corrected_loss_on_megatron_vocab_parallel_logits_equals_the_unsharded_loss(
    cpu_ranks: list[dict[str, Any]], tiny_model_dir: Path
) -> None:
    head = hf_state(tiny_model_dir)["lm_head.weight"].clone().requires_grad_(True)
    hidden = cpu_ranks[0]["hidden"].clone().requires_grad_(True)
    loss, metrics = token_policy_loss(
        hidden @ head.T, LossTokens(**cpu_ranks[0]["records"]), CorrectionConfig(), None
    )
    loss.backward()
    assert head.grad is not None and hidden.grad is not None
    for r in cpu_ranks:  # every rank gets the whole loss, metrics and hidden-state gradient
        torch.testing.assert_close(r["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
        for key, values in metrics.per_token.items():
            torch.testing.assert_close(r["metrics"][key], values.detach(), rtol=1e-5, atol=1e-6)
        # Megatron's copy_to_tensor_model_parallel_region sums the shards' contributions.
        torch.testing.assert_close(r["grad_hidden"], hidden.grad, rtol=1e-5, atol=1e-6)
    vocab = head.shape[0]
    assert [r["grad_head_shard"].shape[0] for r in cpu_ranks] == [vocab // 2, vocab // 2]
    torch.testing.assert_close(torch.cat([r["grad_head_shard"] for r in cpu_ranks]), head.grad)
    assert all(r["grad_head_shard"].abs().max() > 0 for r in cpu_ranks)


@pytest.mark.cuda  # GPTModel.forward needs CUDA in megatron-core 0.16
def test_gpt_model_forward_matches_hugging_face_and_backpropagates_on_cuda(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    for model_dir in (
        tiny_model_dir,
        create_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", vocab_size=48, seed=3),
        create_tiny_checkpoint(tmp_path / "tied", "qwen3", vocab_size=48, seed=4, tie_word_embeddings=True),
    ):
        ranks = run_worker(Path(model_dir), tmp_path / f"out-{Path(model_dir).name}", ranks=1, device="cuda")
        with torch.no_grad():
            ids = torch.randint(1, 48, (2, 7), generator=torch.Generator().manual_seed(5))
            expected = load_model(model_dir)(input_ids=ids).logits
        torch.testing.assert_close(ranks[0]["logits_shard"], expected, rtol=1e-3, atol=1e-3)
        # Every parameter gets a gradient, except MoE experts no token was routed to.
        without = ranks[0]["params_without_grad"]
        assert all(".local_experts." in name for name in without), without
        assert len(without) < 2 * 8 * 2  # not every expert of every layer (fc1 + fc2, 8 experts, 2 layers)


def test_conversion_functions_invert_each_other_for_any_tensor_parallel_size(tiny_model_dir: Path) -> None:
    config = load_model(tiny_model_dir).config
    state = hf_state(tiny_model_dir)
    whole = hf_to_megatron(state, config)
    for tp in (1, 2, 4):
        shards = {(0, rank): parallel_shard(whole, rank, tp) for rank in range(tp)}
        if tp == 2:  # rank 0's fc1 is [gate rows 0..63; up rows 0..63], not the first half of [gate; up]
            fc1 = shards[(0, 0)]["decoder.layers.0.mlp.linear_fc1.weight"]
            assert torch.equal(fc1[:64], state["model.layers.0.mlp.gate_proj.weight"][:64])
            assert torch.equal(fc1[64:], state["model.layers.0.mlp.up_proj.weight"][:64])
        back = megatron_to_hf(parallel_unshard(shards), config)
        assert all(torch.equal(back[k], v) for k, v in state.items()) and sorted(back) == sorted(state)


def test_moe_experts_go_to_their_expert_parallel_rank_renumbered(tiny_moe_dir: Path) -> None:
    config = load_model(tiny_moe_dir).config
    state = hf_state(tiny_moe_dir)
    whole = hf_to_megatron(state, config)
    shards = {(ep, tp): parallel_shard(whole, tp, 2, ep, 2) for ep in range(2) for tp in range(2)}
    # 8 experts over 2 expert-parallel ranks: rank 1's local expert 0 is global expert 4
    local = shards[(1, 0)]["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert torch.equal(local, state["model.layers.1.mlp.experts.down_proj"][4][:, :16])
    assert "decoder.layers.1.mlp.experts.local_experts.4.linear_fc2.weight" not in shards[(1, 0)]
    back = megatron_to_hf(parallel_unshard(shards), config)
    assert all(torch.equal(back[k], v) for k, v in state.items()) and sorted(back) == sorted(state)
    with pytest.raises(ValueError, match=r"ep_size: 8 experts do not split into 3 expert-parallel ranks"):
        parallel_shard(whole, 0, 1, 0, 3)
    with pytest.raises(ValueError, match=r"shards: no part for \(ep_rank, tp_rank\) \[\(1, 1\)\]"):
        parallel_unshard({k: v for k, v in shards.items() if k != (1, 1)})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (SimpleNamespace(model_type="llama"), "model_type: the megatron conversion maps Qwen3 dense and MoE"),
        (tiny_config("qwen3_moe", 48, decoder_sparse_step=2), "decoder_sparse_step: the megatron conversion"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(config: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_supported(config)


def test_a_shard_that_does_not_split_is_refused(tiny_model_dir: Path) -> None:
    whole = hf_to_megatron(hf_state(tiny_model_dir), load_model(tiny_model_dir).config)
    with pytest.raises(
        ValueError, match=r"embedding.word_embeddings.weight: dim 0 of size 48 does not split"
    ):
        parallel_shard(whole, 0, 5)
    with pytest.raises(ValueError, match=r"tp_rank: must be in \[0, 2\)"):
        parallel_shard(whole, 2, 2)


# megatron-core 0.16 moves a tied embedding to CUDA to share it across pipeline stages
TIED_PIPELINE_NEEDS_CUDA = pytest.mark.cuda


@pytest.mark.parametrize("tie", [False, pytest.param(True, marks=TIED_PIPELINE_NEEDS_CUDA)])
def test_pipeline_stages_hold_their_layers_and_round_trip_through_real_gpt_model_stages(
    tmp_path: Path, tie: bool
) -> None:
    """Two pipeline stages of megatron-core's ``GPTModel`` (parallel_state over gloo): each stage's
    part of the weights loads with nothing missing or left over, and the parts come back exactly;
    a tied model's last stage gets the embedding as its output layer."""
    model_dir = Path(
        create_tiny_checkpoint(tmp_path / "model", "qwen3", vocab_size=48, seed=5, tie_word_embeddings=tie)
    )
    config = load_model(model_dir).config
    ranks = run_worker(model_dir, tmp_path / "out", ranks=2, device="cuda" if tie else "cpu", pp=2)
    assert [r["place"] for r in ranks] == [(0,), (1,)]
    assert [r["layers"] for r in ranks] == [config.num_hidden_layers // 2] * 2
    assert_round_trip_exact(ranks, model_dir)


def test_pipeline_parts_renumber_layers_and_refuse_an_uneven_split(tiny_model_dir: Path) -> None:
    config = load_model(tiny_model_dir).config
    whole = hf_to_megatron(hf_state(tiny_model_dir), config)
    first, last = (pipeline_shard(whole, config, rank, 2) for rank in range(2))
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last
    per_stage = config.num_hidden_layers // 2
    name = "self_attention.linear_qkv.weight"
    assert torch.equal(last[f"decoder.layers.0.{name}"], whole[f"decoder.layers.{per_stage}.{name}"])
    assert pipeline_unshard({0: first, 1: last}, config).keys() == whole.keys()
    with pytest.raises(ValueError, match="do not split evenly"):
        pipeline_shard(whole, config, 0, config.num_hidden_layers + 1)


TRAINER_WORKER = Path(__file__).with_name("megatron_trainer_worker.py")


@pytest.mark.parametrize(  # MegatronPolicyTrainer needs CUDA (megatron-core 0.16), a GPU a rank
    ("tp", "pp"),
    [pytest.param(tp, pp, marks=pytest.mark.cuda(gpus=tp * pp)) for tp, pp in [(1, 1), (2, 1), (1, 2)]],
)
def test_megatron_trainer_makes_the_torch_backends_update_on_cuda(
    tmp_path: Path, tiny_model_dir: Path, groups_json: Path, tp: int, pp: int
) -> None:
    """Two steps of the megatron backend (BF16, distributed optimizer) against the torch backend's
    BF16 steps on the same batch: the same update to BF16's precision, the same loss and metrics;
    its checkpoint loads back to the same weights."""
    ranks = tp * pp
    from mixrl.api.trajectory import Trajectory
    from mixrl.rl.trainer.batch import collate

    from .conftest import reference_trainer

    reference = reference_trainer(tiny_model_dir, torch.bfloat16)
    groups = [[Trajectory.model_validate(t) for t in g] for g in json.loads(groups_json.read_text())]
    expected = [reference.step(collate(groups, trainer_version=0)) for _ in range(2)]
    want = reference.state_dict_for_publication(torch.float32)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(TRAINER_WORKER), str(tiny_model_dir), str(groups_json), str(tmp_path), "2", str(tp), str(pp)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    got = json.loads((tmp_path / "results.json").read_text())
    for step, reference_step in zip(got["steps"], expected, strict=True):
        assert step["loss"] == pytest.approx(reference_step.loss, rel=5e-2, abs=1e-3)
        assert step["metrics"]["kl_k3"] == pytest.approx(reference_step.metrics["kl_k3"], rel=0.2, abs=1e-4)
    weights = load_file(str(tmp_path / "weights.safetensors"))
    assert weights.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(weights[name], value, rtol=2e-2, atol=2e-3, msg=name)
    assert got["loaded_step"] == 2
    reloaded = load_file(str(tmp_path / "reloaded.safetensors"))
    assert all(torch.equal(reloaded[name], weights[name]) for name in weights)


@pytest.mark.no_cuda  # checks the refusal on a machine without CUDA
def test_the_megatron_trainer_refuses_a_machine_without_cuda_in_one_line(tmp_path: Path) -> None:
    import yaml

    from mixrl.api.loader import parse_document
    from mixrl.api.resolve import resolve

    doc = yaml.safe_load((Path(__file__).parents[2] / "examples" / "rlrun-mixed.yaml").read_text())
    doc["spec"]["trainer"]["backend"] = "megatron"
    config = tmp_path / "resolved.json"
    config.write_text(resolve(parse_document(doc)).model_dump_json())
    token = tmp_path / "token"
    token.write_text("t" * 40)
    token.chmod(0o600)
    command = [sys.executable, "-m", "mixrl.cli", "trainer", "--config", str(config), "--buffer",
               "http://127.0.0.1:9", "--run-dir", str(tmp_path / "run"), "--auth-token-file", str(token)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("mixrl trainer: spec.trainer.backend: megatron trains on")
    )
