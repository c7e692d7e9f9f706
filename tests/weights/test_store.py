"""Publishing, listing, loading, verifying and pruning weight versions."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mixrl.rl.weights import MANIFEST, WeightStore, WeightStoreError, load_checkpoint_dir

from .conftest import assert_same_parameters, tiny_qwen3, tiny_qwen3_moe


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(7, generator=g),  # float32 stays float32: stored as given
        "c.count": torch.arange(5),
    }


def _assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == expected.keys()
    for key, tensor in expected.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key


# ---------------------------------------------------------------------------------------- publish


def test_publish_list_latest_load(store: WeightStore) -> None:
    assert store.versions() == [] and store.latest() is None
    for version in (3, 1, 12):
        path = store.publish(version, _tensors(version), metadata={"step": version * 10})
        assert path == store.path(version) and Path(path).name == f"v{version:08d}"
    assert store.versions() == [1, 3, 12] and store.latest() == 12
    _assert_same(store.load(3), _tensors(3))
    manifest = json.loads((Path(store.path(3)) / MANIFEST).read_text())
    assert manifest["version"] == 3 and manifest["metadata"] == {"step": 30}
    for name, entry in manifest["files"].items():
        data = (Path(store.path(3)) / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def test_file_url_and_unsupported_schemes(tmp_path: Path) -> None:
    root = tmp_path / "via-url"
    WeightStore(f"file://{root}").publish(0, _tensors())
    assert WeightStore(str(root)).versions() == [0]
    with pytest.raises(ValueError, match="url: scheme 's3' has no storage backend"):
        WeightStore("s3://bucket/weights")
    with pytest.raises(ValueError, match="url: file:// URLs name a local path"):
        WeightStore("file://otherhost/weights")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(version=-1, state_dict=_tensors()), "version: expected an integer"),
        (dict(version=True, state_dict=_tensors()), "version: expected an integer"),
        (dict(version="3", state_dict=_tensors()), "version: expected an integer"),
        (dict(version=1, state_dict={}), "state_dict: expected a non-empty mapping"),
        (dict(version=1, state_dict={"x": [1.0]}), "state_dict: entry 'x'"),
        (dict(version=1, state_dict=_tensors(), config="qwen3"), "config: expected a dict"),
    ],
)
def test_bad_publish_arguments(store: WeightStore, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        store.publish(**kwargs)
    assert store.versions() == []


def test_versions_are_immutable(store: WeightStore) -> None:
    store.publish(1, _tensors(1))
    with pytest.raises(WeightStoreError, match="version 1 already exists"):
        store.publish(1, _tensors(2))
    _assert_same(store.load(1), _tensors(1))


def test_sharded_version_loads_back_and_into_transformers(store: WeightStore) -> None:
    model = tiny_qwen3()
    path = store.publish(1, model.state_dict(), config=model.config.to_dict(), max_shard_bytes=40_000)
    files = sorted(os.listdir(path))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    _assert_same(store.load(1), dict(model.state_dict()))
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert_same_parameters(model, loaded)


@pytest.mark.parametrize("build", [lambda: tiny_qwen3(tie_word_embeddings=True), tiny_qwen3_moe])
def test_published_models_load_with_from_pretrained(store: WeightStore, build) -> None:
    model = build()  # tied embeddings share memory; MoE experts are fused 3-D tensors
    path = store.publish(5, model.state_dict(), config=model.config.to_dict())
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert loaded.dtype == torch.bfloat16
    assert_same_parameters(model, loaded)


# ------------------------------------------------------------------------------- verification


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_corrupt_file_is_named(store: WeightStore) -> None:
    shard = Path(store.publish(1, _tensors())) / "model.safetensors"
    _flip_byte(shard, shard.stat().st_size - 3)  # inside the tensor data: the file still parses
    with pytest.raises(WeightStoreError) as exc:
        store.load(1)
    assert _one_line(exc) == f"{shard}: corrupt: sha256 does not match manifest.json"
    store.load(1, verify=False)  # without hashing only sizes are checked


def test_truncated_missing_and_manifestless_versions(store: WeightStore) -> None:
    path = Path(store.publish(1, _tensors()))
    shard = path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(WeightStoreError, match=r"model.safetensors: corrupt: \d+ bytes, manifest.json says"):
        load_checkpoint_dir(str(path), verify=False)
    shard.unlink()
    with pytest.raises(WeightStoreError, match=r"model\.safetensors: missing"):
        load_checkpoint_dir(str(path))
    (path / MANIFEST).write_text("{not json")
    with pytest.raises(WeightStoreError, match=r"manifest\.json: corrupt manifest"):
        load_checkpoint_dir(str(path))
    (path / MANIFEST).unlink()
    assert store.versions() == []  # a directory without a manifest is not a version
    with pytest.raises(WeightStoreError) as exc:
        load_checkpoint_dir(str(path))
    assert _one_line(exc).endswith("manifest.json: incomplete checkpoint: manifest.json is missing")
    with pytest.raises(WeightStoreError, match="version 9 does not exist"):
        store.load(9)


def _edit_manifest(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def test_manifest_entries_are_plain_files_of_the_version_and_nothing_outside_is_described(
    store: WeightStore, tmp_path: Path
) -> None:
    """A manifest naming ``../x``, ``sub/x`` or a link out of the directory is refused by its entry,
    before anything about the file it points at (its size, whether it exists) is looked at."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 4321)
    path = Path(store.publish(1, _tensors()))
    good = (path / MANIFEST).read_text()
    escape = os.path.relpath(secret, path)
    for name in (escape, str(secret), "sub/model.safetensors", "..", ".", "", "a\\b", MANIFEST):
        _edit_manifest(path, lambda m, name=name: m["files"].update({name: {"sha256": "0" * 64, "bytes": 1}}))
        with pytest.raises(WeightStoreError) as exc:
            load_checkpoint_dir(str(path))
        message = _one_line(exc)
        assert f"corrupt manifest: files entry {name!r}:" in message, message
        assert "4321" not in message
        (path / MANIFEST).write_text(good)
    for entry, problem in [
        ("abc", "expected an object with sha256 and bytes, got 'abc'"),
        ({"sha256": "0" * 64, "bytes": True}, "bytes: expected a non-negative integer, got True"),
        ({"sha256": "xyz", "bytes": 1}, "sha256: expected 64 hex digits, got 'xyz'"),
    ]:
        _edit_manifest(path, lambda m, entry=entry: m["files"].update({"model.safetensors": entry}))
        with pytest.raises(WeightStoreError, match=re.escape(f"files entry 'model.safetensors': {problem}")):
            load_checkpoint_dir(str(path))
        (path / MANIFEST).write_text(good)
    shard = path / "model.safetensors"
    shard.unlink()
    shard.symlink_to(secret)  # a plain name, but a link out of the directory
    with pytest.raises(WeightStoreError) as exc:
        load_checkpoint_dir(str(path))
    assert _one_line(exc) == f"{shard}: is not a file inside {path} (listed in manifest.json)"
    (path / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(WeightStoreError, match="corrupt manifest: nested too deeply"):
        load_checkpoint_dir(str(path))


def test_partial_directory_from_another_writer_is_invisible(store: WeightStore) -> None:
    store.publish(1, _tensors())
    partial = Path(store.path(2))
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half a file")
    assert store.versions() == [1] and store.latest() == 1
    with pytest.raises(WeightStoreError, match="incomplete checkpoint"):
        store.load(2)


# ------------------------------------------------------------------------------- crash safety

CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from mixrl.rl import weights
    root, action, pause_at = sys.argv[1:4]

    def pause(*args, **kwargs):
        print("PAUSED", flush=True)
        time.sleep(120)

    if pause_at == "manifest":
        weights._write_manifest = pause
    else:
        weights.LocalStorage._promote = pause
    store = weights.WeightStore(root)
    if action == "publish":
        store.publish(7, {"w": torch.ones(256, 256, dtype=torch.bfloat16)})
    else:
        store.convert(1, "nvfp4")
    """
)


@pytest.mark.parametrize(
    ("action", "pause_at"), [("publish", "manifest"), ("publish", "promote"), ("convert", "promote")]
)
def test_killed_writer_leaves_no_visible_version(store: WeightStore, action: str, pause_at: str) -> None:
    store.publish(1, {"layers.0.mlp.up_proj.weight": torch.randn(64, 64).to(torch.bfloat16)})
    root = str(Path(store.path(1)).parent)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, root, action, pause_at], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == b"PAUSED", child.stderr.read().decode() if child.stderr else line
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()
    assert store.versions() == [1]
    assert not (Path(root) / "v00000001" / "nvfp4").exists()
    staging = Path(root) / ".staging"
    leftovers = list(staging.iterdir())
    assert len(leftovers) == 1  # the dead writer's private directory, never a version
    # a fresh writer succeeds, and prune clears the dead writer's leftovers once they are stale
    if action == "publish":
        store.publish(7, {"w": torch.zeros(2, 2)})
        assert store.versions() == [1, 7]
    else:
        started = time.monotonic()
        assert Path(store.convert(1, "nvfp4")).is_dir()
        # The dead converter's lease is taken at once (its process is gone on this host), not
        # after the heartbeat timeout (LEASE_TIMEOUT_S, 120 s).
        assert time.monotonic() - started < 30
    old = time.time() - 7200
    os.utime(leftovers[0], (old, old))
    store.prune(keep=5)
    assert list(staging.iterdir()) == []


def test_a_lease_held_on_another_node_is_taken_over_only_once_its_heartbeat_is_stale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = WeightStore(str(tmp_path / "store"), lease_timeout_s=1.0)
    store.publish(1, {"layers.0.mlp.up_proj.weight": torch.randn(64, 64).to(torch.bfloat16)})
    lease = tmp_path / "store" / ".flags" / "convert-v00000001-fp8.lease"
    lease.parent.mkdir(parents=True, exist_ok=True)
    lease.write_text("another-node:1:abcd\n")  # its pid says nothing here: only the heartbeat does
    old = time.time() - 5
    os.utime(lease, (old, old))
    with caplog.at_level("WARNING", logger="mixrl.rl.weights"):
        assert Path(store.convert(1, "fp8")).is_dir()
    assert "lease of another-node:1:abcd is 5 s without a heartbeat; taking over" in caplog.text


# ----------------------------------------------------------------------------------------- prune


def test_prune_keeps_the_newest(store: WeightStore) -> None:
    for version in range(1, 6):
        store.publish(version, _tensors(version))
    store.convert(2, "fp8")
    assert store.prune(keep=2) == [1, 2, 3]
    assert store.versions() == [4, 5]
    assert sorted(p.name for p in Path(store.path(4)).parent.iterdir() if not p.name.startswith(".")) == [
        "v00000004",
        "v00000005",
    ]
    assert store.prune(keep=2) == []
    with pytest.raises(ValueError, match="keep: expected an integer ≥ 1"):
        store.prune(keep=0)


def test_remove_one_version_then_publish_it_again(store: WeightStore) -> None:
    # A resumed trainer replaces the versions it published after its last checkpoint.
    for version in (1, 2, 3):
        store.publish(version, _tensors(version))
    store.convert(3, "nvfp4")
    store.remove(3)
    assert store.versions() == [1, 2] and store.latest() == 2
    store.publish(3, _tensors(30))
    torch.testing.assert_close(store.load(3), _tensors(30))


def test_files_beside_the_weights_are_plain_names_and_listed(tmp_path: Path) -> None:
    from mixrl.rl.weights import tokenizer_files

    source = tmp_path / "src"
    source.mkdir()
    (source / "tokenizer.json").write_text("{}")
    (source / "notes.txt").write_text("not a tokenizer file")
    assert tokenizer_files(source) == {"tokenizer.json": source / "tokenizer.json"}
    assert tokenizer_files("tiny:qwen3") == {} and tokenizer_files(None) == {}
    store = WeightStore(str(tmp_path / "store"))
    store.publish(0, {"w": torch.ones(2)}, files=tokenizer_files(source))
    manifest = json.loads((Path(store.path(0)) / "manifest.json").read_text())
    assert manifest["files"]["tokenizer.json"]["bytes"] == 2
    for bad in ("../escape.json", "manifest.json", "model.safetensors"):
        with pytest.raises(ValueError, match="not a plain file name"):
            store.publish(1, {"w": torch.ones(2)}, files={bad: source / "tokenizer.json"})
    assert store.versions() == [0]  # a refused publication leaves nothing behind
