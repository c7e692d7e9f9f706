"""The trainer's rank 0 broadcasts each new version to the BF16 engines (``weights.broadcast``).

The disk store stays the source of truth: the version is published there first (new replicas,
a resumed trainer, pools of other precisions and every failure read it), and the broadcast only
saves the BF16 engines the read.  Per version:

1. ask the router who serves (``GET /pools``: each pool's precision and replicas); the ready
   replicas of the pools at the trainer's own precision, BF16, are the receivers;
2. open a fresh group (``UpdateGroup``: a TCPStore on a free port and a backend, apart from any
   default group FSDP holds) and post SGLang's ``/init_weights_update_group`` to every receiver at
   once, ranks 1..N.  A fresh group per version is what makes it elastic: replicas that came up
   since the last version join, and ones that went away are simply not asked;
3. ``/begin_weight_update``; per bucket of tensors (at most ``bucket_bytes``, their bytes end to
   end: SGLang's ``flattened_bucket``) post ``/update_weights_from_distributed`` to every receiver
   and broadcast the bucket (the last bucket carries ``weight_version``); ``/end_weight_update``;
   ``/destroy_weights_update_group``.

Anything that fails (an engine that cannot join, dies mid-way or refuses) ends the broadcast for
this version: the group is closed, which wakes every receiver still waiting, and the failure is
one log line.  It is never fatal: the caller reloads every replica not updated from the disk
store, as it would without a broadcast.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import torch

from mixrl.rl.auth import AuthToken
from mixrl.rl.engine.client import EngineClient, EngineError
from mixrl.rl.engine.weight_broadcast import (
    FLATTENED_BUCKET,
    GROUP_TIMEOUT_S,
    UpdateGroup,
    flatten,
    local_address_towards,
)

log = logging.getLogger(__name__)

BROADCAST_PRECISION = "bf16"
"""The pools that receive: those serving the trainer's own precision (others need the version
converted, which the disk path does)."""
DEFAULT_BUCKET_BYTES = 256 << 20
CAUSE_GRACE_S = 1.0
"""How long a failed send waits for the engines' answers before closing the group: an engine that
refused or failed answers at once, and its answer names the cause."""


class BroadcastFailed(RuntimeError):
    """One line: why this version's broadcast stopped (the disk path takes over)."""


@dataclass(frozen=True)
class Receiver:
    pool: str
    url: str


@dataclass
class BroadcastResult:
    version: int
    updated: list[str] = field(default_factory=list)
    """Replica URLs now serving the version (empty on failure)."""
    error: str | None = None
    bytes: int = 0
    setup_s: float = 0.0
    """Forming the group and opening the session."""
    transfer_s: float = 0.0
    """The buckets: the broadcasts, and the receivers' answers (the last one once applied)."""
    broadcast_s: float = 0.0
    """The broadcasts alone (rank 0's sends), the wire time behind :attr:`gb_per_s`."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.broadcast_s / 1e9 if self.broadcast_s > 0 else 0.0


async def receivers_from_router(
    router_url: str, session: aiohttp.ClientSession, precision: str = BROADCAST_PRECISION
) -> list[Receiver]:
    """The ready replicas of the router's pools at ``precision`` (``GET /pools``; open, no token)."""
    async with session.get(f"{router_url}/pools", timeout=aiohttp.ClientTimeout(total=10)) as response:
        if response.status != 200:
            raise BroadcastFailed(f"GET /pools: HTTP {response.status}")
        snapshot = await response.json(content_type=None)
    pools = snapshot.get("pools") if isinstance(snapshot, dict) else None
    if not isinstance(pools, list):
        raise BroadcastFailed("GET /pools: no 'pools' list in the answer")
    return [
        Receiver(str(pool["name"]), str(replica["url"]))
        for pool in pools
        if pool.get("precision") == precision and not pool.get("draining")
        for replica in pool.get("replicas", [])
        if replica.get("ready")
    ]


def buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tensors in order, cut into buckets of at most ``bucket_bytes`` (a larger tensor alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _gloo_reason(exc: BaseException | str) -> str:
    """The first sentence of a backend's error (or of an engine's message quoting one), without
    gloo's source location."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"\[[^\]]*\.cc:\d+\] ", "", text)
    return text.split(". This is typically caused")[0]


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class WeightBroadcaster:
    """Rank 0's side: one :meth:`broadcast` per version, to the receivers given."""

    def __init__(
        self,
        master_address: str,
        *,
        backend: str = "gloo",
        device: torch.device | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        auth_token: AuthToken | None = None,
        timeout_s: float = GROUP_TIMEOUT_S,
    ) -> None:
        self.master_address = master_address
        self.backend = backend
        self.device = device or torch.device("cpu" if backend == "gloo" else "cuda")
        self.bucket_bytes = bucket_bytes
        self.auth_token = auth_token
        self.timeout_s = timeout_s

    @classmethod
    def towards(cls, router_url: str, **kwargs: Any) -> WeightBroadcaster:
        """A broadcaster whose store listens on this machine's address on the route to the router
        (the engines the router lists reach the trainer the same way)."""
        host = urlsplit(router_url).hostname or "127.0.0.1"
        return cls(local_address_towards(host), **kwargs)

    async def broadcast(
        self, receivers: list[Receiver], state: Mapping[str, torch.Tensor], version: int
    ) -> BroadcastResult:
        """Send ``state`` as ``version`` to every receiver; never raises for a failed broadcast."""
        result = BroadcastResult(version)
        if not receivers:
            return result
        name = f"mixrl-weights-v{version}-{secrets.token_hex(4)}"
        timeout = aiohttp.ClientTimeout(total=self.timeout_s * 2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            clients = [EngineClient(r.url, session, auth_token=self.auth_token, retries=0) for r in receivers]
            group: UpdateGroup | None = None
            try:
                started = time.perf_counter()
                group = await self._open(clients, name)
                await _all_succeed(clients, "begin_weight_update", lambda c: c.begin_weight_update())
                result.setup_s = time.perf_counter() - started
                started = time.perf_counter()
                result.bytes = await self._send(group, clients, state, version, result)
                await _all_succeed(clients, "end_weight_update", lambda c: c.end_weight_update())
                result.transfer_s = time.perf_counter() - started
                result.updated = [r.url for r in receivers]
            except (BroadcastFailed, EngineError, RuntimeError, OSError) as exc:
                result.error = str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__
            finally:
                if group is not None:
                    group.close()  # wakes any receiver still waiting in it
                if result.error is not None:  # the survivors' sessions, so the next version can open one
                    await asyncio.gather(*(c.end_weight_update() for c in clients), return_exceptions=True)
                await asyncio.gather(
                    *(c.destroy_weights_update_group(name) for c in clients), return_exceptions=True
                )
        return result

    async def _open(self, clients: list[EngineClient], name: str) -> UpdateGroup:
        """Rank 0's store on a free port, then every engine's join and ours at the same time."""
        world = len(clients) + 1
        store = await asyncio.to_thread(UpdateGroup.host_store, self.master_address, world, self.timeout_s)
        ours = asyncio.ensure_future(
            asyncio.to_thread(
                UpdateGroup.form,
                store,
                name=name,
                kind=self.backend,
                rank=0,
                world_size=world,
                local_address=self.master_address,
                timeout_s=self.timeout_s,
            )
        )

        async def join(rank: int, client: EngineClient) -> tuple[EngineClient, Any]:
            try:
                return client, await client.init_weights_update_group(
                    master_address=self.master_address,
                    master_port=store.port,
                    rank_offset=rank,
                    world_size=world,
                    group_name=name,
                    backend=self.backend,
                )
            except (EngineError, aiohttp.ClientError, TimeoutError) as exc:
                return client, exc

        joins = [asyncio.ensure_future(join(rank, c)) for rank, c in enumerate(clients, start=1)]
        try:
            # The first refusal ends it: the others would wait for the missing rank until the timeout.
            for done in asyncio.as_completed(joins):
                client, answer = await done
                await _check_answers([client], "init_weights_update_group", [answer])
        except BroadcastFailed:
            for task in joins:
                task.cancel()
            # Our side waits for the missing rank until its timeout, on its own thread: leave it.
            ours.add_done_callback(lambda done: done.exception())
            raise
        return await ours

    async def _send(
        self,
        group: UpdateGroup,
        clients: list[EngineClient],
        state: Mapping[str, torch.Tensor],
        version: int,
        result: BroadcastResult,
    ) -> int:
        """Every bucket: the engines' calls posted, then the broadcast; their answers checked."""
        sent = 0
        cuts = list(buckets(state, self.bucket_bytes))
        for index, bucket in enumerate(cuts):
            last = index == len(cuts) - 1
            flat = await asyncio.to_thread(flatten, bucket, self.device)
            calls = [
                asyncio.ensure_future(
                    c.update_weights_from_distributed(
                        [n for n, _ in bucket],
                        [_dtype_name(t) for _, t in bucket],
                        [list(t.shape) for _, t in bucket],
                        group_name=group.name,
                        weight_version=version if last else None,
                        load_format=FLATTENED_BUCKET,
                    )
                )
                for c in clients
            ]
            try:
                started = time.perf_counter()
                await asyncio.to_thread(group.broadcast, flat)
                result.broadcast_s += time.perf_counter() - started
            except RuntimeError as exc:
                # An engine that refused the call or failed left the group, which is what failed
                # the send: the engines that answered by now are the cause, named first with their
                # own message; the send's error says only that a peer went away.
                await asyncio.wait(calls, timeout=CAUSE_GRACE_S)
                answered = [call.done() for call in calls]
                group.close()  # the receivers still waiting fail now, not at their timeout
                answers = await asyncio.gather(*calls, return_exceptions=True)
                what = "update_weights_from_distributed"
                causes = _failures(*_where(answered, clients, answers), what)
                ended = len(_failures(*_where([not a for a in answered], clients, answers), what))
                parts = [*causes, f"the send: {_gloo_reason(exc)}"]
                if ended:
                    parts.append(f"the receives of {ended} other engine(s) ended with it")
                raise BroadcastFailed(f"bucket {index + 1} of {len(cuts)}: {'; '.join(parts)}") from None
            await _check_answers(
                clients,
                "update_weights_from_distributed",
                await asyncio.gather(*calls, return_exceptions=True),
            )
            sent += flat.numel()
        return sent


async def _all_succeed(clients: list[EngineClient], what: str, call: Any) -> None:
    await _check_answers(
        clients, what, await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
    )


async def _check_answers(clients: list[EngineClient], what: str, answers: list[Any]) -> None:
    """BroadcastFailed naming the first engine that failed or refused ``what``."""
    failures = _failures(clients, answers, what)
    if failures:
        raise BroadcastFailed(failures[0])


def _where(
    chosen: list[bool], clients: list[EngineClient], answers: list[Any]
) -> tuple[list[EngineClient], list[Any]]:
    """The clients and answers where ``chosen`` holds."""
    pairs = [(c, a) for c, a, keep in zip(clients, answers, chosen, strict=True) if keep]
    return [c for c, _ in pairs], [a for _, a in pairs]


def _failures(clients: list[EngineClient], answers: list[Any], what: str) -> list[str]:
    """One line per engine that failed or refused ``what``, in the engines' order (an exception
    that is not the engine's or its connection's is raised)."""
    failures = []
    for client, answer in zip(clients, answers, strict=True):
        if isinstance(answer, BaseException):
            if not isinstance(answer, EngineError | aiohttp.ClientError | TimeoutError):
                raise answer
            reason = str(answer).splitlines()[0] if str(answer) else type(answer).__name__
            failures.append(f"{client.base_url}: {what}: {reason}")
        elif not answer.get("success"):
            failures.append(f"{client.base_url}: {what}: {_gloo_reason(str(answer.get('message')))}")
    return failures
