"""Versions stored as deltas on their predecessor: the codec, the chains, the cache, snapshots on
demand, damaged links, conversions of delta versions, prune, and the size of a real RL delta."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mixrl.rl import weights
from mixrl.rl.weight_deltas import DeltaError, apply_delta, encode_delta, tensors_sha256
from mixrl.rl.weights import (
    DELTA_FILE,
    MANIFEST,
    WeightStore,
    WeightStoreError,
    forget_rebuilt,
    load_checkpoint_dir,
    load_dequantized,
)

from .conftest import tiny_qwen3


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    """Each test starts as a fresh process would: nothing rebuilt yet."""
    forget_rebuilt()


def _versions(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` consecutive versions: each changes a few words of the one before."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "norm.weight": torch.ones(32, dtype=torch.bfloat16),
        "steps": torch.tensor(0),
    }
    out = [state]
    for i in range(1, count):
        state = {name: tensor.clone() for name, tensor in state.items()}
        state["a.weight"][i % 64, : i + 1] += 0.5
        state["steps"] = torch.tensor(i)
        out.append(state)
    return out


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------ codec


def test_codec_round_trip_of_changed_unchanged_new_removed_and_reshaped_tensors() -> None:
    base = {
        "changed": torch.randn(40, 8).to(torch.bfloat16),
        "same": torch.randn(5).to(torch.bfloat16),
        "scalar": torch.tensor(2.0),
        "reshaped": torch.arange(6),
        "retyped": torch.ones(3),
        "gone": torch.zeros(2),
    }
    new = dict(base)
    new["changed"] = base["changed"].clone()
    new["changed"][7, 3] = 1.0
    new["scalar"] = torch.tensor(3.0)
    new["reshaped"] = torch.arange(6).reshape(2, 3)
    new["retyped"] = torch.ones(3, dtype=torch.bfloat16)
    new["added"] = torch.tensor([True, False])
    del new["gone"]
    blob, stats = encode_delta(base, new)
    assert (stats.changed, stats.unchanged, stats.whole, stats.removed) == (2, 1, 3, 1)
    rebuilt = apply_delta(base, blob)
    _assert_same(rebuilt, new)
    assert tensors_sha256(rebuilt) == tensors_sha256(new) != tensors_sha256(base)
    assert rebuilt["same"] is base["same"]  # unchanged tensors are the base's, not copies


def test_codec_refuses_a_damaged_file_or_the_wrong_base_with_one_line() -> None:
    base = {"w": torch.randn(32, 32).to(torch.bfloat16)}
    new = {"w": base["w"] + 1}
    blob, _ = encode_delta(base, new)
    for damaged, reason in [
        (b"PK" + blob[2:], "not a delta file"),
        (blob[:20], "truncated before the header length"),
        (blob[:40], "runs past the end of the file"),
        (blob[:-5], "payload runs past the end"),
        (blob[:-40] + bytes(40), "does not decompress"),
    ]:
        with pytest.raises(DeltaError, match=reason):
            apply_delta(base, damaged)
    with pytest.raises(
        DeltaError, match=r"tensor 'w': the base has no torch.bfloat16 tensor of shape \[32, 32\]"
    ):
        apply_delta({"w": torch.zeros(4)}, blob)


# ------------------------------------------------------------------------------------------ store


def test_snapshot_every_n_and_deltas_between_load_back_exactly(tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path / "w"), snapshot_every=3)
    states = _versions(7)
    for version, state in enumerate(states):
        store.publish(version, state, {"step": version})
    kinds = [store.manifest(v)["kind"] for v in range(7)]
    assert kinds == ["snapshot", "delta", "delta", "snapshot", "delta", "delta", "snapshot"]
    manifest = store.manifest(5)
    assert manifest["base"] == 4 and manifest["depth"] == 2 and manifest["metadata"] == {"step": 5}
    assert manifest["tensors_sha256"] == tensors_sha256(states[5])
    assert manifest["base_tensors_sha256"] == store.manifest(4)["tensors_sha256"]
    assert set(manifest["files"]) == {DELTA_FILE}
    assert store.chain(5) == [3, 4, 5] and store.chain(3) == [3]
    for version in (5, 2, 6, 1):  # out of order, from a cold cache each time
        forget_rebuilt()
        _assert_same(store.load(version), states[version])
        _assert_same(load_checkpoint_dir(store.path(version))[0], states[version])


def test_every_version_whole_with_snapshot_every_1_as_before(store: WeightStore) -> None:
    for version, state in enumerate(_versions(3)):
        store.publish(version, state)
    manifests = [store.manifest(v) for v in range(3)]
    assert [m["kind"] for m in manifests] == ["snapshot"] * 3
    assert all("model.safetensors" in m["files"] and "tensors_sha256" not in m for m in manifests)


def test_following_the_versions_one_by_one_reads_one_delta_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = WeightStore(str(tmp_path / "w"), snapshot_every=10)
    states = _versions(5)
    for version, state in enumerate(states):
        store.publish(version, state)
    reads: list[str] = []
    real_load_file, real_apply = weights.load_file, weights._apply_delta_file
    monkeypatch.setattr(
        weights, "load_file", lambda path: reads.append(Path(path).parent.name) or real_load_file(path)
    )
    monkeypatch.setattr(
        weights, "_apply_delta_file", lambda d, m, b: reads.append(d.name) or real_apply(d, m, b)
    )
    forget_rebuilt()  # a loader in another process: it starts from the snapshot
    _assert_same(store.load(2), states[2])
    assert reads == ["v00000000", "v00000001", "v00000002"]
    for version in (3, 4):
        reads.clear()
        _assert_same(store.load(version), states[version])
        assert reads == [f"v{version:08d}"]


def test_the_publisher_writes_deltas_without_reading_its_last_version_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = WeightStore(str(tmp_path / "w"), snapshot_every=10)
    states = _versions(4)
    store.publish(0, states[0])
    monkeypatch.setattr(weights, "load_checkpoint_dir", lambda *a, **k: pytest.fail("read back"))
    # The publisher's own tensors are copied into the cache: changing them in place after a
    # publish (a trainer's next step) does not change the next delta's base.
    live = {name: tensor.clone() for name, tensor in states[1].items()}
    store.publish(1, live)
    live["a.weight"].fill_(0.0)
    store.publish(2, states[2])
    store.publish(3, states[3])
    monkeypatch.undo()
    forget_rebuilt()
    _assert_same(WeightStore(store.url).load(3), states[3])
    # A restarted publisher (empty cache) rebuilds the base from the store once.
    forget_rebuilt()
    store.publish(4, states[3] | {"steps": torch.tensor(40)})
    assert store.manifest(4)["kind"] == "delta"


def test_a_snapshot_on_demand_and_by_request(tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path / "w"), snapshot_every=10)
    states = _versions(5)
    store.publish(0, states[0])
    store.publish(1, states[1], snapshot=True)
    store.publish(2, states[2])
    store.request_snapshot("v2 is broken\non two lines")
    assert store.snapshot_requested() == "v2 is broken on two lines\n"
    store.publish(3, states[3])
    store.publish(4, states[4])
    assert [store.manifest(v)["kind"] for v in range(5)] == [
        "snapshot",
        "snapshot",
        "delta",
        "snapshot",
        "delta",
    ]
    assert store.snapshot_requested() is None  # honoured, then cleared


def test_a_damaged_or_missing_link_is_refused_with_one_line(tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path / "w"), snapshot_every=10)
    states = _versions(4)
    for version, state in enumerate(states):
        store.publish(version, state)
    delta = Path(store.path(2)) / DELTA_FILE
    good = delta.read_bytes()
    _flip_byte(delta, delta.stat().st_size - 3)
    for version in (2, 3):  # the damaged delta and every version whose chain goes through it
        forget_rebuilt()
        with pytest.raises(WeightStoreError) as exc:
            store.load(version)
        assert _one_line(exc) == f"{delta}: corrupt: sha256 does not match manifest.json"
        assert store.chain_problem(version) == str(exc.value)
    forget_rebuilt()
    with pytest.raises(
        WeightStoreError, match=rf"^{delta}: corrupt delta: tensor 'steps': payload does not decompress"
    ):
        store.load(2, verify=False)  # without hashing, the decoder still refuses it
    assert store.chain_problem(1) is None and store.newest_loadable() == 1
    # a missing base names the base and the delta that needs it
    delta.write_bytes(good)
    store.remove(1)
    forget_rebuilt()
    with pytest.raises(WeightStoreError) as exc:
        store.load(3)
    assert _one_line(exc) == f"{store.path(1)}: missing: the base of delta version 2 (v00000002)"
    assert store.newest_loadable() == 0


def test_a_rebuilt_result_that_differs_from_the_manifests_digest_is_refused(tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path / "w"), snapshot_every=10)
    for version, state in enumerate(_versions(2)):
        store.publish(version, state)
    path = Path(store.path(1)) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["tensors_sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    forget_rebuilt()
    with pytest.raises(WeightStoreError) as exc:
        store.load(1)
    assert (
        _one_line(exc)
        == f"{path}: corrupt: the tensors rebuilt from 1 delta(s) do not match its tensors_sha256"
    )


def test_a_cached_base_changed_in_place_by_a_caller_is_caught_and_rebuilt_from_disk(tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path / "w"), snapshot_every=10)
    states = _versions(3)
    for version, state in enumerate(states):
        store.publish(version, state)
    forget_rebuilt()
    store.load(1)["a.weight"].zero_()  # a careless caller
    _assert_same(store.load(2), states[2])


def test_delta_versions_convert_to_every_precision_and_bf16_is_materialised(tmp_path: Path) -> None:
    model = tiny_qwen3()
    state = model.state_dict()
    later = {name: tensor.clone() for name, tensor in state.items()}
    later["model.norm.weight"] += 0.25
    config = model.config.to_dict()
    store = WeightStore(str(tmp_path / "w"), snapshot_every=10)
    store.publish(0, state, config=config)
    store.publish(1, later, config=config)
    whole = WeightStore(str(tmp_path / "whole"))
    whole.publish(1, later, config=config)
    assert store.convert(0, "bf16") == store.path(0)  # a serving-BF16 snapshot is its own checkpoint
    bf16 = store.convert(1, "bf16")
    assert bf16 == str(Path(store.path(1)) / "bf16")
    _assert_same(load_checkpoint_dir(bf16)[0], later)
    loaded = AutoModelForCausalLM.from_pretrained(bf16)  # what SGLang would load: a directory
    assert torch.equal(loaded.state_dict()["model.norm.weight"], later["model.norm.weight"])
    forget_rebuilt()
    _assert_same(load_dequantized(store.convert(1, "fp8")), load_dequantized(whole.convert(1, "fp8")))


def test_prune_keeps_every_link_a_kept_version_needs(tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path / "w"), snapshot_every=4)
    states = _versions(7)  # 0 snapshot, 1-3 deltas, 4 snapshot, 5-6 deltas
    for version, state in enumerate(states):
        store.publish(version, state)
    store.convert(1, "fp8")
    assert store.prune(keep=4) == []  # 3 is kept, and it needs 0, 1 and 2
    assert store.versions() == list(range(7))
    assert not (Path(store.path(1)) / "fp8").exists()  # kept only as a link: its conversion goes
    assert store.prune(keep=2, protect={2}) == [3]
    assert store.versions() == [0, 1, 2, 4, 5, 6]
    assert store.prune(keep=2) == [0, 1, 2]
    assert store.versions() == [4, 5, 6]
    forget_rebuilt()
    _assert_same(store.load(6), states[6])


def test_bad_store_arguments_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="snapshot_every: expected an integer ≥ 1, got 0"):
        WeightStore(str(tmp_path), snapshot_every=0)
    with pytest.raises(ValueError, match="lease_timeout_s: expected a positive number"):
        WeightStore(str(tmp_path), lease_timeout_s=0)


# ----------------------------------------------------------------------------- a real RL update


def test_a_delta_of_real_training_at_an_rl_learning_rate_is_a_fraction_of_a_full_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny Qwen3 trained in FP32 by AdamW at lr 1e-6 on a next-token loss, each step published
    in BF16 as the trainer publishes it: the delta versions' bytes against the snapshot's."""
    model = tiny_qwen3().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    store = WeightStore(str(tmp_path / "w"), snapshot_every=10)
    config = model.config.to_dict()
    generator = torch.Generator().manual_seed(1)
    published = []
    for step in range(4):
        if step:
            tokens = torch.randint(0, model.config.vocab_size, (4, 32), generator=generator)
            loss = model(input_ids=tokens, labels=tokens).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        state = {name: t.detach().to(torch.bfloat16).clone() for name, t in model.state_dict().items()}
        published.append(state)
        store.publish(step, state, {"step": step}, config)

    def weight_bytes(version: int) -> int:
        return sum(entry["bytes"] for entry in store.manifest(version)["files"].values())

    full = weight_bytes(0)
    ratios = [weight_bytes(v) / full for v in (1, 2, 3)]
    with capsys.disabled():
        print(
            f"\ndelta/full bytes of versions 1-3: {', '.join(f'{r:.3f}' for r in ratios)} (full {full} bytes)"
        )
    assert [store.manifest(v)["kind"] for v in (1, 2, 3)] == ["delta"] * 3
    assert max(ratios) <= 0.3
    forget_rebuilt()
    _assert_same(store.load(3), published[3])
