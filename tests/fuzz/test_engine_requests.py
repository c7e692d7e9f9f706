"""Fuzzing the torch engine over real HTTP: ``/generate`` requests and the control endpoints.

One ``mixrl engine`` child process (tests/engine's tiny dense model, ``--context-length 64`` so no
accepted request generates for long, the run's token required on control endpoints, a weight root
holding version 1 of its own weights and versions whose manifests are damaged).  Every case is
sent with a per-request timeout (a hang fails it) and must get:

- a 200 with a well-formed answer (``/generate``: output ids inside the vocabulary, a finish
  reason, as many log-probs as tokens when asked for them; control: ``success`` true), or
- a 4xx whose JSON error is one line of bounded length; for a request error (400, 413) the line
  starts with the field it names and ``param`` names it too; a control call without the run's
  token is 401 and changes neither the weight version nor the paused state;
- never a 5xx, and never a traceback or an ERROR line in the engine's log.

After every case the engine still generates a valid request (control cases first continue
generation with the token, since a pause that succeeds is a legitimate outcome).
"""

from __future__ import annotations

import http.client
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from mixrl.local.processes import EngineProcess
from mixrl.rl.auth import AuthToken
from mixrl.rl.weights import MAX_VERSION, WeightStore

from ..engine.conftest import VOCAB
from .conftest import FUZZ, any_json, tally

TOKEN = AuthToken("fuzz-run-token-" + "f" * 32)
CONTEXT = 64
REQUEST_TIMEOUT_S = 60.0  # a tiny model's answer takes milliseconds; only a hang gets near this
MAX_LINE = 1000
COUNTS = tally("engine requests")
COUNTS.update({"crashes": 0})


# ----------------------------------------------------------------------------- the engine


class Engine:
    """The running engine, its weight root and the offset of its log already checked."""

    def __init__(self, process: EngineProcess, root: Path) -> None:
        self.process = process
        self.root = root
        self.host = process.host
        self.port = process.port or 0
        self.log_checked = 0

    def call(
        self, method: str, path: str, body: bytes | None = None, authorization: str | None = None
    ) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S)
        headers = {"Content-Type": "application/json"}
        if authorization is not None:
            headers["Authorization"] = authorization
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def new_log(self) -> str:
        """What the engine logged since the last call."""
        with self.process.log_path.open("rb") as log:
            log.seek(self.log_checked)
            data = log.read()
        self.log_checked += len(data)
        return data.decode(errors="replace")

    def state(self) -> tuple[str, bool]:
        status, raw = self.call("GET", "/get_server_info")
        assert status == 200, raw[:300]
        info = json.loads(raw)
        return info["weight_version"], info["paused"]


@pytest.fixture(scope="module")
def engine(dense_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("weight-root")
    config = json.loads((Path(dense_path) / "config.json").read_text())
    version = Path(
        WeightStore(str(root / "store")).publish(
            1, load_file(Path(dense_path) / "model.safetensors"), config=config
        )
    )
    for name, manifest in DAMAGED_MANIFESTS.items():
        shutil.copytree(version, root / name)
        (root / name / "manifest.json").write_text(manifest)
    args = ["--context-length", str(CONTEXT), "--weight-root", str(root), "--log-level", "info"]
    with EngineProcess(dense_path, auth_token=TOKEN, extra_args=args) as process:
        yield Engine(process, root)


DAMAGED_MANIFESTS = {
    "not-json": "{",
    "a-list": "[]",
    "deep": "[" * 100_000,
    "escaping-file": json.dumps({"version": 2, "files": {"../../../etc/hostname": {"size": 1}}}),
    "huge-version": json.dumps({"version": 10**30, "files": {}}),
    "negative-version": json.dumps({"version": -7, "files": {}}),
    "no-files": json.dumps({"version": 2}),
}


# ----------------------------------------------------------------------------- the property


def one_line(text: Any) -> bool:
    return isinstance(text, str) and 0 < len(text) <= MAX_LINE and "\n" not in text and "\r" not in text


def check_error(status: int, raw: bytes) -> None:
    """A 4xx answer: JSON whose error is one clear line (naming the field for a request error)."""
    assert 400 <= status < 500, (status, raw[:500])
    answer = json.loads(raw)
    error = answer.get("error")
    if isinstance(error, dict):  # a request error: {"error": {"message": "<field>: <reason>", "param": ...}}
        message, param = error.get("message"), error.get("param")
        assert one_line(message), message
        assert isinstance(param, str) and param and message.startswith(f"{param}: "), answer
    elif error is not None:  # 401 from the token check, as SGLang shapes it
        assert status == 401 and one_line(error), answer
    else:  # a weight update the engine refused: {"success": false, "message": ...}
        assert answer.get("success") is False and one_line(answer.get("message")), answer
    COUNTS["clear errors"] += 1


def check_generated(answer: Any, batched: bool) -> None:
    items = answer if batched else [answer]
    assert isinstance(items, list) and items, answer
    for item in items:
        ids, meta = item["output_ids"], item["meta_info"]
        assert all(isinstance(i, int) and 0 <= i < VOCAB for i in ids), ids
        assert meta["finish_reason"]["type"] in ("stop", "length", "abort"), meta
        assert meta["completion_tokens"] == len(ids)
        assert meta["prompt_tokens"] + len(ids) <= CONTEXT
        if "output_token_logprobs" in meta:
            logprobs = meta["output_token_logprobs"]
            assert [entry[1] for entry in logprobs] == ids
            assert all(math.isfinite(entry[0]) and entry[0] <= 1e-6 for entry in logprobs)


def send(
    engine: Engine, method: str, path: str, body: bytes | None, authorization: str | None
) -> tuple[int, bytes]:
    COUNTS["cases"] += 1
    try:
        status, raw = engine.call(method, path, body, authorization)
    except TimeoutError:
        COUNTS["hangs"] += 1
        raise
    if status >= 500:
        COUNTS["crashes"] += 1
    assert status < 500, (status, raw[:500])
    return status, raw


def still_serves(engine: Engine) -> None:
    """The engine's log holds no traceback, and a valid request still gets a valid answer."""
    log = engine.new_log()
    if "Traceback" in log or " ERROR " in log:
        COUNTS["crashes"] += 1
        raise AssertionError(f"the engine logged an error:\n{log[-3000:]}")
    status, raw = engine.call("POST", "/generate", json.dumps(VALID_GENERATE).encode())
    assert status == 200, raw[:500]
    check_generated(json.loads(raw), batched=False)


VALID_GENERATE = {
    "input_ids": [1, 2, 3],
    "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
    "return_logprob": True,
}


# ----------------------------------------------------------------------------- strategies

huge_ints = st.sampled_from([-1, 0, 1, 2**31, 2**63, 2**64, 10**30, -(2**64), 10**400])
awkward = st.one_of(
    huge_ints,
    st.integers(-5, 600),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.sampled_from(["", "1", "abc", "x" * 100_000, "\x00", "é", "NaN", "default"]),
    st.lists(st.integers(-2, 600), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
prompts = st.one_of(
    token_ids,
    st.lists(token_ids, min_size=1, max_size=3),  # a batch
    st.lists(st.integers(0, VOCAB - 1), min_size=CONTEXT, max_size=CONTEXT + 2),  # over the context
    st.lists(st.one_of(st.integers(-3, VOCAB + 3), awkward), max_size=5),
    st.lists(st.lists(st.one_of(st.integers(0, VOCAB - 1), awkward), max_size=3), max_size=3),
    awkward,
)
sampling_values: dict[str, st.SearchStrategy[Any]] = {
    "max_new_tokens": st.one_of(st.integers(0, 6), awkward),
    "temperature": st.one_of(st.floats(0, 2), awkward),
    "top_p": st.one_of(st.floats(0, 1), awkward),
    "top_k": st.one_of(st.sampled_from([-1, 1, 5, VOCAB]), awkward),
    "min_p": st.one_of(st.floats(0, 1), awkward),
    "stop_token_ids": st.one_of(st.lists(st.integers(0, VOCAB), max_size=3), awkward),
    "ignore_eos": st.one_of(st.booleans(), awkward),
    "sampling_seed": st.one_of(st.integers(-(2**63), 2**64 - 1), awkward),
    "n": st.one_of(st.just(1), awkward),
    "frequency_penalty": st.one_of(st.just(0.0), awkward),
    "stop": awkward,
    "json_schema": awkward,
    "an_unknown_field": awkward,
}
sampling_params = st.one_of(
    st.fixed_dictionaries({}, optional=sampling_values),
    st.lists(st.fixed_dictionaries({}, optional=sampling_values), max_size=3),
    awkward,
)
generate_fields: dict[str, st.SearchStrategy[Any]] = {
    "sampling_params": sampling_params,
    "return_logprob": st.one_of(st.booleans(), awkward),
    "top_logprobs_num": st.one_of(st.integers(0, VOCAB), awkward),
    "logprob_start_len": st.one_of(st.just(-1), awkward),
    "return_sampling_mask": st.one_of(st.booleans(), awkward),
    "rid": st.one_of(st.text(max_size=8), awkward),
    "stream": st.one_of(st.just(False), awkward),
    "text": st.one_of(st.none(), awkward),
    "model": st.none(),  # the sglang-router adds it
    "an_unknown_field": awkward,
}
good_sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.integers(0, 6),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.sampled_from([-1, 1, 5, VOCAB]),
        "min_p": st.floats(0, 1),
        "stop_token_ids": st.lists(st.integers(0, VOCAB), max_size=3),
        "ignore_eos": st.booleans(),
        "sampling_seed": st.integers(-(2**63), 2**64 - 1),
        "an_unknown_field": awkward,
    },
)
good_generate = st.fixed_dictionaries(
    {"input_ids": st.one_of(token_ids, st.lists(token_ids, min_size=1, max_size=3))},
    optional={
        "sampling_params": good_sampling,
        "return_logprob": st.booleans(),
        "top_logprobs_num": st.integers(0, VOCAB),
        "return_sampling_mask": st.booleans(),
        "rid": st.text(max_size=8),
    },
)


@st.composite
def one_wrong_field(draw: st.DrawFn) -> dict[str, Any]:
    """A valid request with one field (or one sampling parameter) set to anything."""
    body = draw(good_generate)
    if draw(st.booleans()):
        body[draw(st.sampled_from(sorted(generate_fields)))] = draw(awkward)
    else:
        sampling = body.setdefault("sampling_params", {})
        sampling[draw(st.sampled_from(sorted(sampling_values)))] = draw(awkward)
    return body


generate_bodies = st.one_of(
    good_generate,
    one_wrong_field(),
    st.fixed_dictionaries({"input_ids": prompts}, optional=generate_fields),
    st.fixed_dictionaries({}, optional={**generate_fields, "input_ids": prompts}),
)
json_garbage = any_json(max_text=10, max_leaves=10)
raw_bodies = st.one_of(
    st.binary(max_size=200),
    json_garbage.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 200_000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.integers(1, 200_000).map(lambda depth: b'{"input_ids": ' + b"[" * depth),
    st.sampled_from([b"", b" ", b"null", b"{}", b'{"input_ids": [1] ', b"\xff\xfe", b"x" * (9 << 20)]),
)


def encoded(body: Any) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity go out as such, as a careless client sends them


# ----------------------------------------------------------------------------- /generate


def generate_case(engine: Engine, body: bytes, batched: bool) -> None:
    status, raw = send(engine, "POST", "/generate", body, None)
    if status == 200:
        check_generated(json.loads(raw), batched)
        COUNTS["accepted"] += 1
    else:
        check_error(status, raw)
    still_serves(engine)


def is_batch(body: dict[str, Any]) -> bool:
    ids = body.get("input_ids")
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


# 60: each case is a real HTTP request to the engine process (~0.1 s); mixed bodies are the
# cross-field cases; each field alone gets its own share below. ~7 s.
@settings(FUZZ, max_examples=60)
@given(generate_bodies)
def test_generate_requests_get_an_answer_or_one_line(engine: Engine, body: dict[str, Any]) -> None:
    generate_case(engine, encoded(body), is_batch(body))


FIELDS = [*(f"sampling_params.{name}" for name in sorted(sampling_values)), *sorted(generate_fields)]


@pytest.mark.parametrize("field", FIELDS)
# 6 per field, every field (a parametrized case each): each field's strategy mixes its valid range
# with the shared hostile values, so 6 draws reach both; ~0.5-1.5 s a field.
@settings(FUZZ, max_examples=6)
@given(data=st.data())
def test_each_field_of_a_valid_request_set_to_anything(
    engine: Engine, field: str, data: st.DataObject
) -> None:
    """Every field gets its share of hostile values (a mix of all fields would leave some untried)."""
    body = data.draw(good_generate)
    if field.startswith("sampling_params."):
        body.setdefault("sampling_params", {})[field.split(".", 1)[1]] = data.draw(awkward)
    else:
        body[field] = data.draw(awkward)
    generate_case(engine, encoded(body), is_batch(body))


# 50: raw bytes mostly fail JSON decoding in the first few bytes; 50 covers truncated, non-UTF-8,
# deeply nested and valid-JSON-wrong-type bodies; <1 s.
@settings(FUZZ, max_examples=50)
@given(raw_bodies)
def test_any_bytes_sent_to_generate_get_an_answer_or_one_line(engine: Engine, body: bytes) -> None:
    try:
        batched = is_batch(json.loads(body))
    except (ValueError, RecursionError, AttributeError):
        batched = False
    generate_case(engine, body, batched)


# ----------------------------------------------------------------------------- control


VALID_VERSION = "{root}/store/v00000001"
model_paths = st.one_of(
    st.just(VALID_VERSION),
    st.sampled_from(
        [
            VALID_VERSION,
            "{root}/store/v00000001/",
            "{root}/store",
            "{root}/missing",
            "{root}/../outside",
            "{root}/store/../store/v00000001",
            "relative/v00000001",
            "/etc",
            "/",
            "",
            "\x00",
            "/" + "a" * 5000,
            *(f"{{root}}/{name}" for name in DAMAGED_MANIFESTS),
        ]
    ),
    awkward,
)
versions = st.one_of(st.none(), st.sampled_from([0, 1, 5, "7", " 8 ", MAX_VERSION, MAX_VERSION + 1]), awkward)
control_bodies: dict[str, st.SearchStrategy[Any]] = {
    "/update_weights_from_disk": st.one_of(
        st.fixed_dictionaries(  # a well-formed update of the valid version (200, the version it names)
            {"model_path": st.just(VALID_VERSION)},
            optional={
                "weight_version": st.one_of(st.integers(0, MAX_VERSION), st.integers(0, 99).map(str)),
                "load_format": st.sampled_from(["auto", "safetensors"]),
                "abort_all_requests": st.booleans(),
                "flush_cache": st.booleans(),
            },
        ),
        st.fixed_dictionaries(
            {"model_path": model_paths},
            optional={
                "weight_version": versions,
                "load_format": st.one_of(st.sampled_from(["auto", "safetensors", "pt"]), awkward),
                "abort_all_requests": st.one_of(st.booleans(), awkward),
                "flush_cache": st.one_of(st.booleans(), awkward),
            },
        ),
    ),
    "/pause_generation": st.one_of(
        st.fixed_dictionaries({}, optional={"mode": st.sampled_from(["abort", "in_place", "retract"])}),
        st.fixed_dictionaries({}, optional={"mode": awkward}),
    ),
    "/continue_generation": st.fixed_dictionaries({}, optional={"an_unknown_field": awkward}),
    "/abort_request": st.fixed_dictionaries(
        {},
        optional={
            "rid": st.one_of(st.text(max_size=8), awkward),
            "abort_all": st.one_of(st.booleans(), awkward),
        },
    ),
    "/update_weight_version": st.fixed_dictionaries(
        {}, optional={"new_version": versions, "abort_all_requests": st.one_of(st.booleans(), awkward)}
    ),
}
authorizations = st.one_of(
    st.just(f"Bearer {TOKEN.reveal()}"),
    st.sampled_from(
        [
            f"Bearer {TOKEN.reveal()}",
            f"bearer {TOKEN.reveal()}",
            None,
            "Bearer not-the-run-token",
            "Basic dXNlcjpwdw==",
            "Bearer ",
            TOKEN.reveal(),
            f"Bearer {TOKEN.reveal()}x",
        ]
    ),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40),
)


def control_cases(path: str) -> st.SearchStrategy[tuple[bytes | None, str | None]]:
    """A body for ``path`` (its fields, hostile or not, or any bytes) and an Authorization header."""
    bodies = st.one_of(
        control_bodies[path].map(encoded),
        control_bodies[path].map(encoded),
        raw_bodies.filter(lambda b: len(b) < 1 << 20),
    )
    return st.tuples(bodies, authorizations)


def right_token(authorization: str | None) -> bool:
    return authorization is not None and authorization.lower() == f"bearer {TOKEN.reveal()}".lower()


def expected_version(body: bytes) -> str | None:
    """The version a successful update must report: the one asked for, else the manifest's (1)."""
    asked = json.loads(body).get("weight_version")
    return "1" if asked is None else str(int(str(asked).strip()))


@pytest.mark.parametrize("path", sorted(control_bodies))
# 60 per control endpoint (5): token missing / wrong / right x well-formed / hostile bodies, ~10
# cases per combination; ~1.4 s an endpoint.
@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_control_requests_need_the_token_and_get_an_answer_or_one_line(
    engine: Engine, path: str, data: st.DataObject
) -> None:
    body, authorization = data.draw(control_cases(path))
    if body is not None:
        body = body.replace(b"{root}", str(engine.root).encode())
    before = engine.state()
    status, raw = send(engine, "POST", path, body, authorization)
    if not right_token(authorization):
        assert status == 401, (status, raw[:300])
        assert engine.state() == before, "a refused call changed the engine's state"
        COUNTS["refused without the token"] += 1
        check_error(status, raw)
    elif status == 200:
        answer = json.loads(raw)
        assert answer.get("success") is True, answer
        if path == "/update_weights_from_disk":
            assert answer["weight_version"] == expected_version(body or b"{}"), answer
            COUNTS["weight updates applied"] += 1
        COUNTS["accepted"] += 1
    else:
        check_error(status, raw)
    status, raw = engine.call("POST", "/continue_generation", b"", f"Bearer {TOKEN.reveal()}")
    assert status == 200, raw[:300]
    still_serves(engine)
