"""The broadcast's rules without processes: the engine's one-line refusals of bad bodies, the
trainer's buckets, the flattened bucket's layout, the router's ``skip_replicas`` and the
operator's refusal of ``weights.broadcast`` (the processes: tests/engine/test_weight_broadcast.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from mixrl.api.errors import InvalidSpec
from mixrl.operator.controller.reconcile import resolve_run
from mixrl.rl.engine.protocol import RequestError
from mixrl.rl.engine.weight_broadcast import (
    FLATTENED_BUCKET,
    flatten,
    parse_group_request,
    parse_update_request,
    specs_of,
    unflatten,
)
from mixrl.rl.router.server import without_skipped_replicas
from mixrl.rl.trainer.weight_broadcast import buckets

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
GROUP = {
    "master_address": "127.0.0.1",
    "master_port": 29500,
    "rank_offset": 1,
    "world_size": 3,
    "backend": "gloo",
}
UPDATE = {
    "names": ["a", "b"],
    "dtypes": ["bfloat16", "float32"],
    "shapes": [[2, 3], [4]],
    "weight_version": "7",
}


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"master_port": 0}, "master_port", "must be in [1, 65535]"),
        ({"world_size": 1}, "world_size", "must be >= 2"),
        ({"rank_offset": 0}, "rank_offset", "rank 0 is the sender"),
        ({"rank_offset": 3}, "rank_offset", "rank 0 is the sender"),
        ({"backend": "mpi"}, "backend", "must be one of gloo, nccl"),
        ({"master_address": None}, "master_address", "is required"),
        ({"group_name": ""}, "group_name", "non-empty"),
    ],
)
def test_a_bad_group_body_is_one_line_naming_the_field(
    change: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(RequestError) as refused:
        parse_group_request({**GROUP, **change})
    assert refused.value.field == field and reason in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"dtypes": ["bfloat16", "complex_thing"]}, "dtypes[1]", "must name a torch dtype"),
        ({"shapes": [[2, -3], [4]]}, "shapes[0]", "sizes >= 0"),
        ({"names": ["a"]}, "names", "differ in length"),
        ({"names": ["a", "a"]}, "names", "twice"),
        ({"load_format": "direct"}, "load_format", "flattened_bucket"),
        ({"weight_version": "-1"}, "weight_version", "must be an integer"),
        (
            {"dtypes": ["int8", "float32"], "load_format": FLATTENED_BUCKET, "shapes": [[3], [4]]},
            "dtypes",
            "byte offset 3",
        ),
    ],
)
def test_a_bad_update_body_is_one_line_naming_the_field(
    change: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(RequestError) as refused:
        parse_update_request({**UPDATE, **change})
    assert refused.value.field == field and reason in str(refused.value), str(refused.value)


def test_an_update_body_reads_as_sglang_sends_it() -> None:
    request = parse_update_request({**UPDATE, "load_format": FLATTENED_BUCKET})
    assert [(s.name, s.dtype, s.shape) for s in request.specs] == [
        ("a", torch.bfloat16, (2, 3)),
        ("b", torch.float32, (4,)),
    ]
    assert (request.weight_version, request.group_name, request.flush_cache) == (
        7,
        "weight_update_group",
        True,
    )


def test_a_flattened_bucket_is_the_tensors_bytes_end_to_end() -> None:
    named = [("a", torch.randn(2, 3).to(torch.bfloat16)), ("b", torch.arange(4, dtype=torch.float32))]
    flat = flatten(named, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == 2 * 3 * 2 + 4 * 4
    back = unflatten(flat, specs_of(named))
    assert all(torch.equal(back[name], tensor) for name, tensor in named)


def test_buckets_keep_the_order_and_the_limit_and_a_large_tensor_goes_alone() -> None:
    state = {"a": torch.zeros(10), "big": torch.zeros(100), "b": torch.zeros(5), "c": torch.zeros(5)}
    cuts = [[name for name, _ in bucket] for bucket in buckets(state, 64)]
    assert cuts == [["a"], ["big"], ["b", "c"]]


def test_the_router_takes_skip_replicas_out_of_the_body_it_forwards() -> None:
    raw = b'{"model_path": "/w/v1", "weight_version": "1"}'
    assert without_skipped_replicas(raw) == (raw, frozenset())  # forwarded byte for byte
    body, skipped = without_skipped_replicas(b'{"model_path": "/w/v1", "skip_replicas": ["http://a:1"]}')
    assert body == b'{"model_path": "/w/v1"}' and skipped == frozenset({"http://a:1"})
    with pytest.raises(ValueError, match=r"^skip_replicas: expected a list of replica URLs$"):
        without_skipped_replicas(b'{"skip_replicas": "http://a:1"}')


def test_the_operator_refuses_weights_broadcast_in_one_line() -> None:
    doc = yaml.safe_load(QUICKSTART.read_text())
    spec = {**doc["spec"], "weights": {**doc["spec"].get("weights", {}), "broadcast": True}}
    body = {"apiVersion": doc["apiVersion"], "kind": "RLRun", "metadata": doc["metadata"], "spec": spec}
    with pytest.raises(InvalidSpec) as refused:
        resolve_run(body)
    assert refused.value.first_line.startswith("spec.weights.broadcast: true runs with mixrl run only")
