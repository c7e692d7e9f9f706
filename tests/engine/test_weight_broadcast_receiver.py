"""The engine's receiver of a broadcast, in this process over gloo, with rank 0 played by the test:
a group destroyed or initialized anew while a receive waits in it, and tensors of a dtype the model
cannot take, and the trainer's line for an engine that refused (the processes:
tests/engine/test_weight_broadcast.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer

from mixrl.rl.engine.service import EngineService
from mixrl.rl.engine.weight_broadcast import (
    BroadcastReceiver,
    GroupRequest,
    UpdateGroup,
    add_routes,
    parse_update_request,
)
from mixrl.rl.trainer.weight_broadcast import Receiver, WeightBroadcaster

GROUP = "g"


class FakeService:
    """What the receiver uses of an engine: the model's names and shapes, and ``apply_state``."""

    def __init__(self, bias: bool = False) -> None:
        self.runner = type("Runner", (), {"model": torch.nn.Linear(4, 4, bias=bias)})()
        self.applied: list[int] = []

    async def apply_state(
        self, state: dict[str, torch.Tensor], version: int, source: str, abort_all_requests: bool = False
    ) -> tuple[bool, str]:
        self.applied.append(version)
        return True, f"Succeeded to update model weights to version {version}."


async def rank0_and_join(receiver: BroadcastReceiver, name: str = GROUP) -> UpdateGroup:
    """Rank 0 here, the receiver as rank 1 of 2."""
    store = UpdateGroup.host_store("127.0.0.1", 2, timeout_s=20)
    ours = asyncio.ensure_future(
        asyncio.to_thread(
            UpdateGroup.form,
            store,
            name=name,
            kind="gloo",
            rank=0,
            world_size=2,
            local_address="127.0.0.1",
            timeout_s=20,
        )
    )
    ok, message = await receiver.init_group(GroupRequest("127.0.0.1", store.port, 1, 2, name, "gloo"))
    assert ok, message
    return await ours


def update_body(dtype: str = "float32", version: int | None = 1) -> dict[str, Any]:
    body: dict[str, Any] = {"names": ["weight"], "dtypes": [dtype], "shapes": [[4, 4]], "group_name": GROUP}
    if version is not None:
        body["weight_version"] = version
    return body


async def receiving(
    engine: BroadcastReceiver, dtype: str = "float32"
) -> tuple[UpdateGroup, asyncio.Future[Any]]:
    """Rank 0 joined, a session begun, and an update of ``dtype`` waiting for rank 0's broadcast."""
    rank0 = await rank0_and_join(engine)
    assert engine.begin()[0]
    return rank0, asyncio.ensure_future(engine.update(parse_update_request(update_body(dtype))))


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[BroadcastReceiver, FakeService]]:
    service = FakeService()
    receiver = BroadcastReceiver(cast(EngineService, service))
    yield receiver, service
    receiver.close()


async def test_destroying_a_group_while_it_receives_does_not_stop_the_engine(
    receiver: tuple[BroadcastReceiver, FakeService],
) -> None:
    engine, service = receiver
    rank0, update = await receiving(engine)
    await asyncio.sleep(0.3)  # the receive waits for rank 0's broadcast, which does not come
    # Were the event loop held by the destroy, only this would end it (the engine's timeout otherwise).
    wake = threading.Timer(5.0, rank0.close)
    wake.start()
    try:
        started = time.perf_counter()
        ok, message = engine.destroy_group(GROUP)
        assert ok, message
        assert time.perf_counter() - started < 1.0, "the destroy waited for the receive"
        # The name is free at once: a new sender's group replaces the old one.
        rank0_again = await rank0_and_join(engine)
        replacement = engine.groups[GROUP]
        rank0.close()  # the old receive fails now: connection closed by peer
        ok, message = await asyncio.wait_for(update, 10)
        assert not ok and message.startswith("Failed to receive weights:") and "\n" not in message
        assert engine.groups.get(GROUP) is replacement, "the failed receive destroyed the new group"
        assert service.applied == []
        rank0_again.close()
    finally:
        wake.cancel()


async def test_a_tensor_of_an_integer_dtype_is_refused_in_one_line(
    receiver: tuple[BroadcastReceiver, FakeService],
) -> None:
    engine, service = receiver
    rank0, update = await receiving(engine, "int32")
    try:
        await asyncio.to_thread(rank0.broadcast, torch.arange(16, dtype=torch.int32).reshape(4, 4))
        ok, message = await asyncio.wait_for(update, 10)
        assert not ok, message
        assert message == "Failed to update weights: weight: dtype int32 is not a floating-point type"
        assert service.applied == []
        # The group stayed in step: a float version goes through it and is applied.
        update = asyncio.ensure_future(engine.update(parse_update_request(update_body())))
        await asyncio.to_thread(rank0.broadcast, torch.ones(4, 4))
        ok, message = await asyncio.wait_for(update, 10)
        assert ok, message
        assert service.applied == [1]
    finally:
        rank0.close()


async def test_an_update_outside_a_session_is_refused_and_the_sender_fails_at_once(
    receiver: tuple[BroadcastReceiver, FakeService],
) -> None:
    engine, service = receiver
    rank0 = await rank0_and_join(engine)  # its sends wait 20 s for a receiver
    try:
        ok, message = await engine.update(parse_update_request(update_body()))  # no begin_weight_update
        assert not ok and message.startswith("update_weights_from_distributed must run between")
        started = time.perf_counter()
        with pytest.raises(RuntimeError):
            await asyncio.to_thread(rank0.broadcast, torch.ones(4, 4))
        assert time.perf_counter() - started < 5.0, "rank 0 waited for a receiver that had refused"
        assert GROUP not in engine.groups and service.applied == []
    finally:
        rank0.close()


async def test_a_begin_through_a_new_group_discards_the_session_a_dead_trainer_left_open() -> None:
    service = FakeService(bias=True)  # two tensors: a session can be left half received
    engine = BroadcastReceiver(cast(EngineService, service))
    dead = await rank0_and_join(engine, "old")
    try:
        assert engine.begin()[0]
        body = update_body(version=5) | {"group_name": "old"}
        update = asyncio.ensure_future(engine.update(parse_update_request(body)))
        await asyncio.to_thread(dead.broadcast, torch.ones(4, 4))
        ok, message = await asyncio.wait_for(update, 10)
        assert ok and "1 of 2" in message, message
    finally:
        dead.close()  # the trainer dies before /end_weight_update
    rank0 = await rank0_and_join(engine, "new")
    try:
        ok, message = engine.begin()
        assert ok, message
        assert sorted(engine.groups) == ["new"], "the dead trainer's group stayed"
        assert engine.pending == {} and engine.pending_version is None
        body = {
            "names": ["weight", "bias"],
            "dtypes": ["float32", "float32"],
            "shapes": [[4, 4], [4]],
            "group_name": "new",
            "weight_version": 6,
        }
        update = asyncio.ensure_future(engine.update(parse_update_request(body)))
        await asyncio.to_thread(rank0.broadcast, torch.full((4, 4), 2.0))
        await asyncio.to_thread(rank0.broadcast, torch.zeros(4))
        ok, message = await asyncio.wait_for(update, 10)
        assert ok, message
        assert service.applied == [6], "the discarded partial session's version moved the label"
        # Through the same group, an open session is still refused (the sender is alive).
        assert engine.end()[0]
        assert engine.begin()[0] and not engine.begin()[0]
    finally:
        rank0.close()
        engine.close()


async def test_the_trainer_reports_the_engines_refusal_not_only_the_send_that_it_broke(
    receiver: tuple[BroadcastReceiver, FakeService], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: an engine that refused the update left the group, and the trainer logged only its
    own send's error ("Connection closed by peer"), which names neither the engine nor why."""
    engine, service = receiver
    # A session another sender discarded, as the engine sees it: begun, then gone.
    monkeypatch.setattr(engine, "begin", lambda: (True, "Began a weight update."))

    async def json_body(request: web.Request, allow_empty: bool = False) -> dict[str, Any]:
        return cast(dict[str, Any], await request.json()) if request.can_read_body else {}

    app = web.Application()
    add_routes(app, engine, json_body)
    async with TestServer(app, host="127.0.0.1") as server:
        url = str(server.make_url("")).rstrip("/")
        broadcaster = WeightBroadcaster("127.0.0.1", timeout_s=20)
        started = time.perf_counter()
        result = await broadcaster.broadcast([Receiver("bf16", url)], {"weight": torch.ones(4, 4)}, 1)
    assert time.perf_counter() - started < 10, "the failure waited for a timeout"
    assert result.error is not None and result.updated == []
    assert result.error.startswith(
        f"bucket 1 of 1: {url}: update_weights_from_distributed: update_weights_from_distributed"
        " must run between begin_weight_update() and end_weight_update(); the send: "
    ), result.error
    assert service.applied == []
