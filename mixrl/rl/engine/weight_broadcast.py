"""Weights broadcast by the trainer, received by the engine: SGLang's distributed weight update.

The contract is SGLang 0.5.23's (same JSON bodies, same answers):

- ``POST /init_weights_update_group`` ``{master_address, master_port, rank_offset, world_size,
  group_name?, backend?}``: join a process group whose rank 0 (the trainer) hosts the TCPStore at
  ``master_address:master_port``; this engine is rank ``rank_offset``.
- ``POST /begin_weight_update`` ``{}`` … ``POST /end_weight_update`` ``{}``: the session 0.5.23
  requires around the updates.
- ``POST /update_weights_from_distributed`` ``{names, dtypes, shapes, group_name?, flush_cache?,
  abort_all_requests?, weight_version?, load_format?}``: receive those tensors from rank 0, one
  broadcast per tensor, or with ``load_format: "flattened_bucket"`` one broadcast of their bytes
  laid end to end (SGLang's ``FlattenedTensorBucket``).
- ``POST /destroy_weights_update_group`` ``{group_name?}``.

A call the engine takes up answers ``{"success", "message"}``, 200 or 400 (``success: false``);
a malformed field is a :class:`RequestError`, the server's 400 with the ``{"error": {...}}`` body
naming it, before anything is received.  The group is built as SGLang builds its
own (a TCPStore, then prefix stores named after the group and the device, then the backend) but
without touching torch's default group: the trainer under FSDP already has one, and the engine
needs none.  That is why the backend objects are constructed directly here.

The torch engine differs from SGLang in one way, on purpose: SGLang loads each call's tensors into
the live model as they arrive, so between two buckets it serves a mix of versions; the torch
engine holds the tensors of a session until every tensor of the model has arrived and then hands
the whole version to :meth:`EngineService.apply_state`, which prepares it beside the served weights
while decoding goes on and swaps between two decode steps.  Receiving runs on a worker thread, so
decoding does not stop either.  ``weight_version`` is required on some call of the session (the
last one that gives it wins; a session whose set completes without one is refused): every token the
torch engine generates is tagged with the version that produced it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import socket
import threading
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from aiohttp import web

from mixrl.rl.engine.protocol import RequestError
from mixrl.rl.engine.service import EngineService
from mixrl.rl.engine.version_gate import parse_version

log = logging.getLogger(__name__)

DEFAULT_GROUP = "weight_update_group"
"""SGLang's default ``group_name``."""
BACKENDS = ("gloo", "nccl")
FLATTENED_BUCKET = "flattened_bucket"
"""SGLang's ``load_format`` for one broadcast carrying a bucket's bytes end to end."""
GROUP_TIMEOUT_S = 120.0
"""How long a rank waits for the others, to form the group and in each broadcast.  SGLang waits
torch's default 30 minutes; an engine whose trainer died mid-way would hold its receive that long."""


class JsonBody(Protocol):
    """The server's body reader: a JSON object, or a RequestError naming ``body``."""

    def __call__(self, request: web.Request, allow_empty: bool = False) -> Awaitable[dict[str, Any]]: ...


# ------------------------------------------------------------------------------ the group


def device_for(backend: str) -> torch.device:
    """Where a backend's tensors live: gloo on the CPU, NCCL on this process's current GPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent): what the other ranks
    of a group must reach this one at."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


class UpdateGroup:
    """One process group for weight updates, independent of torch's default group.

    Rank 0 hosts the TCPStore (``host`` binds a free port when given 0); the others connect to it
    (``join``).  The keys are laid out as SGLang's ``init_custom_process_group`` lays them out, so
    either side may be SGLang.
    """

    def __init__(
        self, store: dist.TCPStore, backend: Any, name: str, kind: str, rank: int, size: int
    ) -> None:
        self.store = store
        self.backend = backend
        self.name = name
        self.kind = kind
        self.rank = rank
        self.size = size
        self.device = device_for(kind)

    @classmethod
    def host_store(cls, address: str, world_size: int, timeout_s: float = GROUP_TIMEOUT_S) -> dist.TCPStore:
        """Rank 0's store on a free port (``store.port``), listening before anyone is told the port."""
        timeout = datetime.timedelta(seconds=timeout_s)
        return dist.TCPStore(address, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)

    @classmethod
    def form(
        cls,
        store: dist.TCPStore,
        *,
        name: str,
        kind: str,
        rank: int,
        world_size: int,
        local_address: str,
        timeout_s: float = GROUP_TIMEOUT_S,
    ) -> UpdateGroup:
        """Build the backend over ``store``; blocks until every rank has joined (or the timeout)."""
        if kind not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {kind!r}")
        timeout = datetime.timedelta(seconds=timeout_s)
        device_prefix = "cpu" if kind == "gloo" else "cuda"  # the first device torch maps the backend to
        prefixed = dist.PrefixStore(
            f"{device_prefix}/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store))
        )
        backend: Any
        if kind == "gloo":
            # _Options: the public Options constructor wants a backend name; not in torch's stubs
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
            backend = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            options.is_high_priority_stream = False
            backend = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        backend._set_sequence_number_for_group()  # SGLang's side reads rank 0's number from the store
        return cls(store, backend, name, kind, rank, world_size)

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        *,
        name: str,
        kind: str,
        rank: int,
        world_size: int,
        timeout_s: float = GROUP_TIMEOUT_S,
    ) -> UpdateGroup:
        """A non-zero rank: connect to rank 0's store, then form the group."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
        local = local_address_towards(master_address)
        return cls.form(
            store,
            name=name,
            kind=kind,
            rank=rank,
            world_size=world_size,
            local_address=local,
            timeout_s=timeout_s,
        )

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from rank 0 into every rank's ``tensor`` (in place), and wait."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        if self.backend is None:
            raise RuntimeError(f"group {self.name} is closed")
        self.backend.broadcast([tensor], options).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def close(self) -> None:
        """Drop the connections.  Closing rank 0's side fails every receive still waiting in the
        group at once ("connection closed by peer"); gloo's ``abort`` alone does not wake them,
        the backend's destructor (when the last reference goes) does."""
        backend, self.backend = self.backend, None
        abort = getattr(backend, "abort", None)
        try:
            if abort is not None:
                abort()
        except RuntimeError as exc:  # a backend without abort support says so
            log.debug("group %s: abort: %s", self.name, exc)
        del backend


# ------------------------------------------------------------------------------ tensors on the wire


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def specs_of(named: Sequence[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in named]


def flatten(named: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The bytes of ``named`` end to end, as one uint8 tensor on ``device`` (SGLang's flattened bucket)."""
    parts = [tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for _, tensor in named]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def unflatten(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """The tensors of a flattened bucket, as views of ``buffer``."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for spec in specs:
        out[spec.name] = buffer[offset : offset + spec.nbytes].view(spec.dtype).reshape(spec.shape)
        offset += spec.nbytes
    return out


def check_aligned(specs: Sequence[TensorSpec]) -> None:
    """A flattened bucket's tensors must start at a multiple of their element size (SGLang's rule)."""
    offset = 0
    for spec in specs:
        if offset % spec.dtype.itemsize:
            raise RequestError(
                "dtypes", f"{spec.name}: byte offset {offset} is not a multiple of {spec.dtype}'s size"
            )
        offset += spec.nbytes


# ------------------------------------------------------------------------------ request bodies


@dataclass(frozen=True)
class GroupRequest:
    """``/init_weights_update_group``'s body."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"


@dataclass(frozen=True)
class UpdateRequest:
    """``/update_weights_from_distributed``'s body."""

    specs: tuple[TensorSpec, ...]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: int | None = None
    load_format: str | None = None


def _typed(body: dict[str, Any], name: str, kind: type, default: Any = None, required: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise RequestError(name, "is required")
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise RequestError(name, f"must be a {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _group_name(body: dict[str, Any]) -> str:
    name = _typed(body, "group_name", str, DEFAULT_GROUP)
    if not name or len(name) > 200:
        raise RequestError("group_name", f"must be a non-empty name of at most 200 characters, got {name!r}")
    return name


def parse_group_request(body: dict[str, Any]) -> GroupRequest:
    address = _typed(body, "master_address", str, required=True)
    port = _typed(body, "master_port", int, required=True)
    if not 0 < port < 65536:
        raise RequestError("master_port", f"must be in [1, 65535], got {port}")
    world_size = _typed(body, "world_size", int, required=True)
    if world_size < 2:
        raise RequestError("world_size", f"must be >= 2 (rank 0 sends, the others receive), got {world_size}")
    rank_offset = _typed(body, "rank_offset", int, required=True)
    if not 0 < rank_offset < world_size:
        raise RequestError(
            "rank_offset", f"must be in [1, world_size - 1] (rank 0 is the sender), got {rank_offset}"
        )
    backend = _typed(body, "backend", str, "nccl")
    if backend not in BACKENDS:
        raise RequestError("backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RequestError("backend", "nccl needs a CUDA device and this engine has none; use 'gloo'")
    return GroupRequest(address, port, rank_offset, world_size, _group_name(body), backend)


def _dtype(index: int, raw: Any) -> torch.dtype:
    dtype = getattr(torch, raw.removeprefix("torch."), None) if isinstance(raw, str) else None
    if not isinstance(dtype, torch.dtype):
        raise RequestError(f"dtypes[{index}]", f"must name a torch dtype such as 'bfloat16', got {raw!r}")
    return dtype


def _shape(index: int, raw: Any) -> tuple[int, ...]:
    valid = isinstance(raw, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw
    )
    if not valid or len(raw) > 8:
        raise RequestError(
            f"shapes[{index}]", f"must be a list of at most 8 sizes >= 0, got {str(raw)[:100]}"
        )
    return tuple(raw)


def parse_update_request(body: dict[str, Any]) -> UpdateRequest:
    names = _typed(body, "names", list, required=True)
    dtypes = _typed(body, "dtypes", list, required=True)
    shapes = _typed(body, "shapes", list, required=True)
    if not names:
        raise RequestError("names", "must list at least one tensor")
    if not len(names) == len(dtypes) == len(shapes):
        raise RequestError(
            "names", f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    for index, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise RequestError(f"names[{index}]", f"must be a tensor name, got {name!r}")
    if len(set(names)) != len(names):
        raise RequestError("names", "lists a tensor twice")
    specs = tuple(
        TensorSpec(name, _dtype(i, raw_dtype), _shape(i, raw_shape))
        for i, (name, raw_dtype, raw_shape) in enumerate(zip(names, dtypes, shapes, strict=True))
    )
    load_format = _typed(body, "load_format", str)
    if load_format not in (None, "auto", FLATTENED_BUCKET):
        raise RequestError("load_format", f"must be '{FLATTENED_BUCKET}' or absent, got {load_format!r}")
    if load_format == FLATTENED_BUCKET:
        check_aligned(specs)
    raw_version = body.get("weight_version")
    return UpdateRequest(
        specs=specs,
        group_name=_group_name(body),
        flush_cache=_typed(body, "flush_cache", bool, True),
        abort_all_requests=_typed(body, "abort_all_requests", bool, False),
        weight_version=None if raw_version is None else parse_version("weight_version", raw_version),
        load_format=None if load_format == "auto" else load_format,
    )


# ------------------------------------------------------------------------------ the engine's side


def receive(group: UpdateGroup, request: UpdateRequest) -> dict[str, torch.Tensor]:
    """Take part in rank 0's broadcasts of ``request``'s tensors (blocking; a worker thread runs
    it); the tensors, on the CPU."""
    if request.load_format == FLATTENED_BUCKET:
        buffer = torch.empty(
            sum(spec.nbytes for spec in request.specs), dtype=torch.uint8, device=group.device
        )
        group.broadcast(buffer)
        return {name: tensor.cpu() for name, tensor in unflatten(buffer, request.specs).items()}
    received: dict[str, torch.Tensor] = {}
    for spec in request.specs:
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device=group.device)
        group.broadcast(tensor)
        received[spec.name] = tensor.cpu()
    return received


class BroadcastReceiver:
    """The engine's weight-update groups and the tensors of the open session.

    One update runs at a time.  The tensors of a session accumulate until they cover the model
    (every name of its state dict), and then the whole version is applied at once.
    """

    def __init__(self, service: EngineService) -> None:
        self.service = service
        self.groups: dict[str, UpdateGroup] = {}
        self.session_open = False
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_version: int | None = None
        self._joined = 0
        """Groups joined so far; ``_session_joined`` is the count when the open session began."""
        self._session_joined = 0
        self._newest: UpdateGroup | None = None
        self._session = 0
        """Sessions begun so far: a receive that outlives its session adds nothing to the next."""
        self._lock = asyncio.Lock()
        self._expected = {name: tuple(t.shape) for name, t in service.runner.model.state_dict().items()}

    # ---------------------------------------------------------------- groups
    async def init_group(self, request: GroupRequest) -> tuple[bool, str]:
        """Join the group (forming it blocks until every rank arrives: on a worker thread)."""
        old = self.groups.pop(request.group_name, None)
        if old is not None:
            close_aside(old)
        try:
            group = await asyncio.to_thread(
                UpdateGroup.join,
                request.master_address,
                request.master_port,
                name=request.group_name,
                kind=request.backend,
                rank=request.rank_offset,
                world_size=request.world_size,
            )
        except (RuntimeError, OSError, ValueError) as exc:
            return False, f"Failed to initialize custom process group: {_one_line(exc)}."
        self.groups[request.group_name] = group
        self._joined += 1
        self._newest = group
        log.info(
            "joined weight-update group %s as rank %d of %d (%s, master %s:%d)",
            request.group_name,
            request.rank_offset,
            request.world_size,
            request.backend,
            request.master_address,
            request.master_port,
        )
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, name: str) -> tuple[bool, str]:
        group = self.groups.pop(name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        close_aside(group)
        return True, "Succeeded to destroy custom process group."

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy_group(name)

    # ---------------------------------------------------------------- session
    def begin(self) -> tuple[bool, str]:
        if self.session_open:
            # The rule for a trainer that died between begin and end: one update runs at a time and
            # the trainer forms a fresh group per version, so a group joined since this session began
            # means its sender is gone.  Its partial tensors are dropped (never applied, so the
            # version label does not move) and the groups before the newest are closed aside.  No
            # timer is needed, and a live sender's session (no group joined since) is still refused.
            if self._joined == self._session_joined:
                return False, "a weight-update session is already open; call end_weight_update() first"
            log.warning(
                "discarding the weight-update session left open before the latest group joined "
                "(%d tensors received, never applied)",
                len(self.pending),
            )
            for name, group in list(self.groups.items()):
                if group is not self._newest:
                    self.destroy_group(name)
        self.session_open = True
        self._session += 1
        self._session_joined = self._joined
        self._discard()
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        if self.pending:
            held = len(self.pending)
            self._discard()
            return (
                False,
                f"discarded an incomplete update: {held} of {len(self._expected)} tensors had arrived",
            )
        return True, "Success"

    def _discard(self) -> None:
        self.pending = {}
        self.pending_version = None

    # ---------------------------------------------------------------- updates
    async def update(self, request: UpdateRequest) -> tuple[bool, str]:
        """Receive one call's tensors while decoding goes on; apply the version once complete.

        Shielded from the caller going away: a half-received call would leave the group out of
        step, and a half-applied one would leave the served weights and their version apart."""
        return await asyncio.shield(self._update(request))

    async def _update(self, request: UpdateRequest) -> tuple[bool, str]:
        async with self._lock:
            if not self.session_open:
                # Rank 0 broadcasts this call's tensors regardless, and its send waits for this rank
                # until the timeout: the group, out of step now, goes, which fails that send at once.
                if request.group_name in self.groups:
                    self.destroy_group(request.group_name)
                return (
                    False,
                    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
                )
            group = self.groups.get(request.group_name)
            if group is None:
                return (
                    False,
                    f"Group {request.group_name} not in {sorted(self.groups)}. Please call `init_weights_update_group` first.",
                )
            session = self._session
            try:
                received = await asyncio.to_thread(receive, group, request)
            except (RuntimeError, OSError) as exc:
                if self._session == session:  # a session begun meanwhile holds none of this one's
                    self._discard()
                if self.groups.get(request.group_name) is group:  # not one initialized under its name since
                    self.destroy_group(request.group_name)  # out of step with rank 0: unusable
                return False, f"Failed to receive weights: {_one_line(exc)}"
            if self._session != session or not self.session_open:
                return False, "Failed to update weights: the session was discarded during the receive"
            problem = self._problem(received)
            if problem is not None:
                self._discard()
                return False, f"Failed to update weights: {problem}"
            self.pending.update(received)
            if request.weight_version is not None:
                self.pending_version = request.weight_version
            if len(self.pending) < len(self._expected):
                return True, (
                    f"Received {len(received)} tensors ({len(self.pending)} of {len(self._expected)}); "
                    "the version is applied once every tensor has arrived."
                )
            return await self._apply(request, group)

    def _problem(self, received: dict[str, torch.Tensor]) -> str | None:
        for name, tensor in received.items():
            shape = self._expected.get(name)
            if shape is None:
                return f"the model has no tensor {name!r}"
            if tuple(tensor.shape) != shape:
                return f"{name}: shape {tuple(tensor.shape)} does not match the model's {shape}"
            if not tensor.is_floating_point():  # loading would convert integers or booleans silently
                return (
                    f"{name}: dtype {str(tensor.dtype).removeprefix('torch.')} is not a floating-point type"
                )
        return None

    async def _apply(self, request: UpdateRequest, group: UpdateGroup) -> tuple[bool, str]:
        state, version = self.pending, self.pending_version
        self._discard()
        if version is None:
            return (
                False,
                "weight_version: required by the torch engine (it tags every token with its version)",
            )
        source = f"broadcast {group.name} ({group.kind})"
        ok, message = await self.service.apply_state(state, version, source, request.abort_all_requests)
        if ok:
            log.info("weights updated to version %d from %s", version, source)
            message += f" Weight version updated to {version}."
        return ok, message


def close_aside(group: UpdateGroup) -> None:
    """Close ``group`` on a thread of its own.  The backend's destructor waits for a receive still
    running in the group (until rank 0 closes its side, or the timeout): on the event loop that
    wait would stop the scheduler's decode steps and every route with them."""
    threading.Thread(target=group.close, name=f"close {group.name}", daemon=True).start()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:500]


# ------------------------------------------------------------------------------ routes


def add_routes(app: web.Application, receiver: BroadcastReceiver, json_body: JsonBody) -> None:
    """SGLang's distributed weight-update routes, answered by ``receiver``.  ``json_body`` is the
    server's body reader (its errors are the server's 400s).  At shutdown the groups are aborted,
    so a receive waiting on a trainer that went away does not hold the process open."""

    def answer(ok: bool, message: str) -> web.Response:
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def init_group(request: web.Request) -> web.Response:
        return answer(*await receiver.init_group(parse_group_request(await json_body(request))))

    async def destroy_group(request: web.Request) -> web.Response:
        body = await json_body(request, allow_empty=True)
        return answer(*receiver.destroy_group(_group_name(body)))

    async def begin(request: web.Request) -> web.Response:
        await json_body(request, allow_empty=True)
        return answer(*receiver.begin())

    async def end(request: web.Request) -> web.Response:
        await json_body(request, allow_empty=True)
        return answer(*receiver.end())

    async def update(request: web.Request) -> web.Response:
        return answer(*await receiver.update(parse_update_request(await json_body(request))))

    async def close_groups(app: web.Application) -> None:
        receiver.close()

    app.on_shutdown.append(close_groups)
    router = app.router
    router.add_post("/init_weights_update_group", init_group)
    router.add_post("/destroy_weights_update_group", destroy_group)
    router.add_post("/begin_weight_update", begin)
    router.add_post("/end_weight_update", end)
    router.add_post("/update_weights_from_distributed", update)
