"""Hostile or careless input to the engine, over loopback HTTP to the engine's real app.

Weight updates load only from inside the weight root; manifest entries must be plain files of the
version directory; weight versions are integers in the store's range; seeds outside torch's range,
deeply nested JSON, huge strings and oversized bodies are each one clear 400 (or 413) naming the
field — never a 500, never a file outside the root read or described — and the engine keeps
serving its old weights.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from safetensors.torch import load_file

from mixrl.rl.engine import server
from mixrl.rl.engine.server import build_parser, config_from_args
from mixrl.rl.weights import WeightStore

from .conftest import serve_in_process

SECRET_BYTES = 12345  # the size of a file outside the root, which no answer may reveal


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory, dense_path: str) -> dict[str, Path]:
    """A weight root with a store holding version 1, and, outside it, a secret and a valid version."""
    root = tmp_path_factory.mktemp("root")
    store = WeightStore(str(root / "store"))
    config = json.loads((Path(dense_path) / "config.json").read_text())
    version = Path(store.publish(1, load_file(Path(dense_path) / "model.safetensors"), config=config))
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret").write_bytes(b"s" * SECRET_BYTES)
    shutil.copytree(version, outside / "v00000001")
    (root / "link-out").symlink_to(outside / "v00000001", target_is_directory=True)
    return {"root": root, "version": version, "outside": outside}


@pytest.fixture
async def engine(dense_path: str, places: dict[str, Path]) -> AsyncIterator[str]:
    async with serve_in_process(model_path=dense_path, weight_root=str(places["root"])) as (url, _):
        yield url


async def post(url: str, path: str, body: Any) -> tuple[int, Any]:
    # (a file-like body: aiohttp warns about sending megabytes of raw bytes in one piece)
    data = io.BytesIO(body if isinstance(body, bytes) else json.dumps(body).encode())
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + path, data=data, headers={"Content-Type": "application/json"}) as response,
    ):
        return response.status, await response.json(content_type=None)


async def version_of(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + "/get_weight_version") as response:
        return str((await response.json())["weight_version"])


def variant(places: dict[str, Path], name: str, edit: Any) -> Path:
    """A copy of version 1 inside the root whose manifest ``edit`` rewrote (a dict edit, or raw text)."""
    target = places["root"] / "variants" / name
    shutil.copytree(places["version"], target)
    manifest_path = target / "manifest.json"
    if isinstance(edit, str):
        manifest_path.write_text(edit)
    else:
        manifest = json.loads(manifest_path.read_text())
        edit(manifest)
        manifest_path.write_text(json.dumps(manifest))
    return target


async def test_model_path_must_lie_inside_the_weight_root(engine: str, places: dict[str, Path]) -> None:
    root, outside = places["root"], places["outside"]
    cases = {
        "store/v00000001": "must be an absolute path inside the weight root",
        f"{root}/store/../store/v00000001": "must not contain '..' components",
        str(outside / "v00000001"): "is outside the weight root",  # a complete, valid version
        str(outside / "no-such-version"): "is outside the weight root",
        str(root / "link-out"): "is outside the weight root",  # a link in the root pointing out of it
        "/etc": "is outside the weight root",
        "/" + "a" * 5000: "is longer than 4096 characters",
        f"{root}/store\x00/v00000001": "contains a NUL character",
    }
    for model_path, reason in cases.items():
        status, payload = await post(engine, "/update_weights_from_disk", {"model_path": model_path})
        assert status == 400, (model_path, payload)
        error = payload["error"]
        assert error["param"] == "model_path" and error["message"].startswith(f"model_path: {reason}"), error
        assert len(error["message"]) < 400
    # What lies outside is not told apart: an existing version and a missing one get the same answer.
    _, there = await post(engine, "/update_weights_from_disk", {"model_path": str(outside / "v00000001")})
    _, missing = await post(engine, "/update_weights_from_disk", {"model_path": str(outside / "v00000009")})
    assert there["error"]["message"].replace("v00000001", "X") == missing["error"]["message"].replace(
        "v00000009", "X"
    )
    assert await version_of(engine) == "0"
    status, payload = await post(
        engine, "/update_weights_from_disk", {"model_path": str(places["version"]), "weight_version": 1}
    )
    assert status == 200 and payload["success"], payload
    assert await version_of(engine) == "1"


async def test_manifest_entries_must_be_plain_files_of_the_version_directory(
    engine: str, places: dict[str, Path]
) -> None:
    secret = places["outside"] / "secret"
    escape = os.path.relpath(secret, places["root"] / "variants" / "escape")  # ../../../outside0/secret

    def entry(name: str) -> Any:
        def edit(manifest: dict[str, Any]) -> None:
            manifest["files"][name] = {"sha256": "0" * 64, "bytes": 1}

        return edit

    def linked_shard(manifest: dict[str, Any]) -> None:
        pass  # the manifest is intact; the shard itself becomes a link out of the directory

    cases: dict[str, tuple[Any, str]] = {
        "escape": (entry(escape), "is not a plain file name in the version directory"),
        "absolute": (entry(str(secret)), "is not a plain file name in the version directory"),
        "subdirectory": (entry("sub/model.safetensors"), "is not a plain file name"),
        "dotdot": (entry(".."), "is not a plain file name"),
        "not-an-object": (lambda m: m["files"].update({"model.safetensors": "abc"}), "expected an object"),
        "negative-size": (
            lambda m: m["files"]["model.safetensors"].update({"bytes": -1}),
            "bytes: expected a non-negative integer",
        ),
        "bad-version": (lambda m: m.update({"version": "abc"}), "names a bad version"),
        "huge-version": (lambda m: m.update({"version": 10**30}), "names a bad version"),
        "deep": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        "linked-shard": (linked_shard, "is not a file inside"),
    }
    for name, (edit, reason) in cases.items():
        path = variant(places, name, edit)
        if name == "linked-shard":
            (path / "model.safetensors").unlink()
            (path / "model.safetensors").symlink_to(secret)
        body: dict[str, Any] = {"model_path": str(path)}
        if "version" not in name:
            body["weight_version"] = 5
        status, payload = await post(engine, "/update_weights_from_disk", body)
        assert status == 400 and payload["success"] is False, (name, payload)
        message = payload["message"]
        assert reason in message, (name, message)
        assert str(SECRET_BYTES) not in message, (name, message)  # nothing about the file outside
        assert "\n" not in message and len(message) < 1500
    assert await version_of(engine) == "0"


@pytest.mark.parametrize("value", [-7, "-7", 10**8, 10**30, str(10**30), "9" * 5000, "1e3", 1.5, True, "٣"])
async def test_weight_versions_are_integers_in_the_store_range(
    engine: str, places: dict[str, Path], value: Any
) -> None:
    for path, field in (
        ("/update_weights_from_disk", "weight_version"),
        ("/update_weight_version", "new_version"),
    ):
        body = {"model_path": str(places["version"]), field: value}
        status, payload = await post(engine, path, body)
        assert status == 400, (path, value, payload)
        assert payload["error"]["param"] == field
        assert payload["error"]["message"].startswith(f"{field}: must be an integer in [0, 99999999]")
        assert len(payload["error"]["message"]) < 400
    assert await version_of(engine) == "0"
    status, _ = await post(engine, "/update_weight_version", {"new_version": "99999999"})
    assert status == 200 and await version_of(engine) == "99999999"


async def test_seeds_deep_json_huge_strings_and_bodies_are_clear_errors(engine: str) -> None:
    def generate(**sampling: Any) -> dict[str, Any]:
        return {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, **sampling}}

    status, payload = await post(engine, "/generate", generate(sampling_seed=2**64))
    assert status == 400 and payload["error"]["param"] == "sampling_params.sampling_seed", payload
    for seed in (2**64 - 1, -1, 0):
        status, payload = await post(engine, "/generate", generate(sampling_seed=seed))
        assert status == 200 and len(payload["output_ids"]) == 2, payload
    for field in ("min_p", "top_p", "temperature"):  # an int too large for a float: range, not a crash
        status, payload = await post(engine, "/generate", generate(**{field: 10**400}))
        assert status == 400 and payload["error"]["param"] == f"sampling_params.{field}", payload
        assert len(payload["error"]["message"]) < 400

    for path in ("/generate", "/update_weights_from_disk", "/pause_generation"):
        status, payload = await post(engine, path, b"[" * 100_000 + b"]" * 100_000)
        assert status == 400 and payload["error"]["param"] == "body", payload
        assert payload["error"]["message"] == "body: is not valid JSON (nested too deeply)"

    huge = "x" * 5_000_000
    for path, body, field in [
        ("/generate", generate(temperature=huge), "sampling_params.temperature"),
        ("/generate", {"input_ids": [1], "rid": [huge]}, "rid"),
        ("/pause_generation", {"mode": huge}, "mode"),
        ("/update_weights_from_disk", {"model_path": "/x", "abort_all_requests": huge}, "abort_all_requests"),
    ]:
        status, payload = await post(engine, path, body)
        assert status == 400 and payload["error"]["param"] == field, payload
        assert len(payload["error"]["message"]) < 400, len(payload["error"]["message"])

    status, payload = await post(engine, "/generate", b'{"input_ids": [' + b"1, " * (3 << 20) + b"1]}")
    assert status == 413, status
    assert payload["error"]["param"] == "body" and "--max-request-mib" in payload["error"]["message"]
    status, payload = await post(engine, "/generate", generate())
    assert status == 200 and len(payload["output_ids"]) == 2  # and the engine serves on


async def test_the_body_limit_is_a_flag(dense_path: str) -> None:
    args = build_parser().parse_args(["--model-path", dense_path, "--max-request-mib", "1"])
    config = config_from_args(args)
    assert config.max_request_mib == 1
    async with serve_in_process(model_path=dense_path, max_request_mib=1) as (url, _):
        status, _ = await post(url, "/generate", b'{"input_ids": [' + b"1, " * (1 << 19) + b"1]}")
        assert status == 413
        status, payload = await post(
            url, "/generate", {"input_ids": [1] * 1000, "sampling_params": {"max_new_tokens": 1}}
        )
        assert status == 200, payload
    with pytest.raises(ValueError, match=r"^--max-request-mib: must be >= 1, got 0$"):
        config_from_args(build_parser().parse_args(["--model-path", dense_path, "--max-request-mib", "0"]))


@pytest.mark.parametrize(
    ("flag", "value", "reason"),
    [
        ("--context-length", "-1", "must be >= 0 (0: the model's max_position_embeddings), got -1"),
        (
            "--max-total-tokens",
            "-1",
            "must be >= 0 (0: the running-request limit × the context length), got -1",
        ),
        ("--max-running-requests", "0", "must be >= 1, got 0"),
        ("--sampling-mask-max-tokens", "0", "must be >= 1, got 0"),
        ("--prefix-cache-max-tokens", "-5", "must be >= 0, got -5"),
        ("--weight-version", "-1", "must be in [0, 99999999], got -1"),
    ],
)
def test_a_bad_number_is_one_line_naming_its_flag_and_exit_2(
    capsys: pytest.CaptureFixture[str], dense_path: str, flag: str, value: str, reason: str
) -> None:
    """Checked before the model loads: a negative --context-length used to start an engine that
    refused every prompt, a negative --max-total-tokens one whose prefix cache was silently off."""
    assert server.main(["--model-path", dense_path, "--insecure-no-auth", flag, value]) == 2
    assert capsys.readouterr().err.splitlines() == [f"mixrl engine: {flag}: {reason}"]


def test_a_bad_log_level_is_refused_by_the_parser(
    capsys: pytest.CaptureFixture[str], dense_path: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        server.main(["--model-path", dense_path, "--log-level", "loud"])
    assert exited.value.code == 2 and "--log-level: invalid choice: 'loud'" in capsys.readouterr().err
    assert (
        build_parser().parse_args(["--model-path", dense_path, "--log-level", "DEBUG"]).log_level == "debug"
    )


async def test_the_default_weight_root_is_the_directory_holding_the_model(
    dense_path: str, places: dict[str, Path]
) -> None:
    """As `mixrl engine-sync` starts an engine: --model-path is a version of the store (through a
    link), so the store is the root; anything beside it is outside."""
    link = places["root"] / "store" / "current"
    link.symlink_to(places["version"], target_is_directory=True)
    async with serve_in_process(model_path=str(link)) as (url, _):
        async with aiohttp.ClientSession() as http, http.get(url + "/get_server_info") as response:
            assert (await response.json())["weight_root"] == str((places["root"] / "store").resolve())
        status, payload = await post(url, "/update_weights_from_disk", {"model_path": str(places["version"])})
        assert status == 200 and payload["success"], payload
        status, payload = await post(url, "/update_weights_from_disk", {"model_path": str(places["root"])})
        assert status == 400 and payload["error"]["param"] == "model_path", payload
