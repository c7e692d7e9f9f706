"""Preparing the next weight version while the engine decodes, in a process of its own.

A weight update costs reading the version (a delta chain rebuilt, every file hashed), checking it,
rounding it to BF16, quantizing it to the pool's precision and casting it to the compute dtype:
seconds for a large model.  On a thread of the engine's process that work would share the GIL with
the decode thread, which hands the GIL back and takes it again around every kernel, so a decode
step would also wait for Python work of the preparation.  A **preparer process** does it instead,
into a second copy of the parameters in shared memory, and the engine then takes that copy's
tensors in one pointer exchange per parameter between two decode steps
(:meth:`StagedWeights.swap_into`).  Decoding shares only the CPU with the preparation.

The copies: the staging tensors are allocated in shared memory at the first update (none before:
an engine that is never updated holds its weights once); after a swap they serve, and the tensors
that served become the staging copy (moved to shared memory at the next update, once).  The
preparer builds the model's structure on the ``meta`` device from its config (no weights) and
points its parameters at the staging tensors it is handed with each request, so the same
:func:`~mixrl.rl.engine.weights_io.apply_precision_` runs there as at start-up.

The preparer starts at the first update (a process importing torch: seconds, off the decode path)
and is restarted if it dies; an update it cannot prepare is refused with its one line and the
served weights stay.  Shared memory is ``/dev/shm``: engine pods mount a memory-backed volume there
(the container default, 64 MiB, holds no model).

A small model is prepared on a thread of the engine instead (``--weight-preparer``: ``auto``, the
default, picks the thread below :data:`PROCESS_PREPARER_MIN_BYTES` of parameters): its whole
preparation takes milliseconds (12 ms against 3.6 s for a process importing torch:
bench/weight_preparer.py).  Both ways write the same staging copy and swap it the same way.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing.queues
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from mixrl.rl import activation_quant
from mixrl.rl.engine import weights_io
from mixrl.rl.weights import WeightStoreError, load_checkpoint_dir

log = logging.getLogger(__name__)

ANSWER_POLL_S = 1.0
"""How often the engine checks that the preparer is alive while it waits for an answer."""

PREPARERS = ("auto", "process", "thread")
"""Where the next version is prepared: ``process`` (a preparer process), ``thread`` (the calling
thread of the engine), ``auto`` (the process from :data:`PROCESS_PREPARER_MIN_BYTES` on)."""

PROCESS_PREPARER_MIN_BYTES = 256 * 2**20
"""From this many bytes of parameters ``auto`` prepares in a process.  Below it (the test models,
a few MiB) a preparation takes milliseconds (bench/weight_preparer.py: 12 ms); a 596 M-parameter model's takes seconds
(bench/weight_sync.py), which on a thread would stretch the decode steps it overlaps."""


class PreparationRefused(ValueError):
    """The version cannot be served (missing, corrupt, not this model's); one line."""


@dataclass(frozen=True)
class Preparation:
    """How every version of one engine is prepared, fixed at start-up: handed to the preparer
    process once, and to each preparation on the thread."""

    weight_precision: str
    """The pool's weight format (apply_precision_'s)."""
    compute_dtype: torch.dtype
    calibrate_inputs: bool = False
    """Whether each version's GEMM inputs are calibrated (activation_quant) once it is prepared."""


@dataclass(frozen=True)
class Prepared:
    report: dict
    """The quantization report (apply_precision_'s)."""
    manifest_version: object
    """The version the checkpoint's manifest names (None for a state handed over directly)."""
    kv_scale_tensors: dict[str, Tensor]
    """The checkpoint's FP8 KV-cache scales, if it has any."""
    input_amax: dict[str, Tensor]
    """The version's calibrated GEMM-input maxima (NVFP4 activations), else empty."""


class StagedWeights:
    """The engine's side: the staging tensors, the preparer process, the swap.

    Each shared tensor gets a number and is handed to the preparer once (handing over a tensor
    passes a file descriptor through a Python thread of this process: a few hundred per model, so
    not on every update); each request then names by number the tensors to write into.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        weight_precision: str,
        compute_dtype: torch.dtype,
        preparer: str = "auto",
        calibrate_inputs: bool = False,
    ) -> None:
        if preparer not in PREPARERS:
            raise ValueError(f"preparer: must be one of {', '.join(PREPARERS)}, got {preparer!r}")
        self.config = config
        self.how = Preparation(weight_precision, compute_dtype, calibrate_inputs)
        self.preparer = preparer
        """As asked; ``auto`` is resolved at the first update, from the model's size."""
        self._skeleton: nn.Module | None = None
        """The thread preparer's model structure (built at its first update)."""
        self._staging: dict[str, tuple[int | None, Tensor]] = {}
        """Per parameter: the staging tensor and its number (None: not shared, not the preparer's)."""
        self._live_ids: dict[str, int | None] = {}
        self._next_id = 0
        self._handed: set[int] = set()
        """Numbers of the tensors the running preparer holds."""
        self._ready = False
        self._process: Any = None
        self._requests: multiprocessing.queues.Queue[Any] | None = None
        self._answers: multiprocessing.queues.Queue[Any] | None = None

    # -------------------------------------------------------------------- preparing (any thread)
    def prepare_dir(self, live: nn.Module, directory: str) -> Prepared:
        """Load, check and prepare the checkpoint at ``directory`` into the staging tensors."""
        return self._prepare(live, ("dir", directory))

    def prepare_state(self, live: nn.Module, state: dict[str, Tensor]) -> Prepared:
        """Check and prepare ``state`` (tensors received by other means, e.g. a broadcast)."""
        if self._mode(live) == "process":  # handed to another process: in shared memory
            state = {name: t.detach().contiguous().share_memory_() for name, t in state.items()}
        return self._prepare(live, ("state", state))

    def _prepare(self, live: nn.Module, source: tuple[str, Any]) -> Prepared:
        self._ready = False
        if self._mode(live) == "thread":
            return self._prepare_here(live, source)
        fresh = self._allocate(live, shared=True)
        self._ensure_process()
        assert self._requests is not None and self._answers is not None
        targets = {name: number for name, (number, _) in self._staging.items()}
        handles = {
            number: tensor
            for number, tensor in self._staging.values()
            if number is not None and number not in self._handed
        }
        self._requests.put((source, targets, handles))
        self._handed.update(handles)
        prepared = self._accept(self._wait_answer())
        for tensor in fresh:  # map the preparer's pages here now, not in the first decode step after the swap
            tensor.sum()
        self._ready = True
        return prepared

    def _mode(self, live: nn.Module) -> str:
        """``process`` or ``thread``; ``auto`` is resolved once, from the model's size."""
        if self.preparer == "auto":
            size = sum(p.numel() * p.element_size() for p in live.parameters())
            self.preparer = "process" if size >= PROCESS_PREPARER_MIN_BYTES else "thread"
            log.info("weights prepared on a %s (%.0f MiB of parameters)", self.preparer, size / 2**20)
        return self.preparer

    def _prepare_here(self, live: nn.Module, source: tuple[str, Any]) -> Prepared:
        """The thread preparer: the same preparation, on the calling thread."""
        self._allocate(live, shared=False)
        if self._skeleton is None:
            self._skeleton = skeleton(self.config)
        targets = {name: tensor for name, (_, tensor) in self._staging.items()}
        prepared = self._accept(prepare_request(self._skeleton, source, targets, self.how))
        self._ready = True
        return prepared

    @staticmethod
    def _accept(answer: tuple[Any, ...]) -> Prepared:
        """:func:`prepare_request`'s answer, from either preparer: the preparation, or its refusal raised."""
        if answer[0] != "ok":
            raise PreparationRefused(answer[1])
        _, report, manifest_version, scales, input_amax = answer
        return Prepared(report, manifest_version, scales, input_amax)

    def _allocate(self, live: nn.Module, shared: bool) -> list[Tensor]:
        """A new tensor (without copying anything) for each parameter whose staging tensor is
        missing, or for the process preparer not shared (the tensors that served before its first
        swap); returns them."""
        fresh = []
        for name, param in live.named_parameters():
            number, held = self._staging.get(name, (None, None))
            if (
                held is None
                or (shared and number is None)
                or held.shape != param.shape
                or held.dtype != param.dtype
            ):
                if not shared:
                    self._staging[name] = (None, torch.empty_like(param.data))
                    continue
                storage = torch.UntypedStorage._new_shared(param.numel() * param.element_size())
                tensor = torch.empty(0, dtype=param.dtype).set_(storage, 0, param.shape, param.stride())
                self._staging[name] = (self._next_id, tensor)
                self._next_id += 1
                fresh.append(tensor)
        return fresh

    def _ensure_process(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        context = mp.get_context("spawn")
        self._requests, self._answers = context.Queue(), context.Queue()
        self._handed = set()
        self._process = context.Process(
            target=serve_preparations,
            args=(
                self.config,
                self.how,
                torch.get_num_threads(),
                self._requests,
                self._answers,
            ),
            name="mixrl-weights-preparer",
            daemon=True,
        )
        self._process.start()
        log.info("weight preparer started (pid %d)", self._process.pid)

    def _wait_answer(self) -> tuple[Any, ...]:
        assert self._answers is not None
        while True:
            try:
                answer: tuple[Any, ...] = self._answers.get(timeout=ANSWER_POLL_S)
                return answer
            except queue.Empty:
                if not self._process.is_alive():
                    code = self._process.exitcode
                    self._process = None  # the next update starts a new one
                    raise PreparationRefused(f"the weight preparer died (exit code {code})") from None

    # -------------------------------------------------------------------- the swap (model thread)
    @torch.no_grad()
    def swap_into(self, live: nn.Module) -> None:
        """Give ``live`` the prepared tensors; the staging copy keeps the ones that served."""
        if not self._ready:
            raise RuntimeError("swap_into: nothing prepared")
        for name, param in live.named_parameters():
            number, tensor = self._staging[name]
            self._staging[name] = (self._live_ids.get(name), param.data)
            self._live_ids[name] = number
            param.data = tensor
        self._ready = False

    def close(self) -> None:
        if self._process is not None and self._process.is_alive():
            assert self._requests is not None
            self._requests.put(None)
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()
        self._process = None


# ------------------------------------------------------------------------------- the preparer


def skeleton(config: PretrainedConfig) -> nn.Module:
    """The model's structure without weights (parameters on ``meta``).  It runs only to calibrate a
    version's activation scales, with transformers' eager attention (the engine's own is registered
    in the engine's process only), so its buffers (the rotary embedding's frequencies, computed
    from the config) are real.  Built from a copy of ``config``: ``from_config`` writes the
    attention it chose into the config it is given, which for the thread preparer is the serving
    model's own."""
    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation="eager"
        )
    for name, module in list(model.named_modules()):
        if any(buffer.is_meta for buffer in module.buffers(recurse=False)):
            rebuilt: Any = module
            model.set_submodule(name, type(module)(config=rebuilt.config))  # rotary: buffers from the config
    return model


def prepare_into(
    model: nn.Module,
    targets: dict[str, Tensor],
    state: dict[str, Tensor],
    how: Preparation,
) -> tuple[dict, dict[str, Tensor], dict[str, Tensor]]:
    """Check ``state`` against ``model``'s structure, then load it into ``targets`` at the pool's
    precision (in place); returns the quantization report, the KV-cache scale tensors and, with
    ``how.calibrate_inputs``, the version's calibrated GEMM-input maxima (a forward pass of the
    calibration batch through the prepared weights)."""
    scales = {k: v.clone() for k, v in state.items() if weights_io.is_kv_scale_key(k)}
    weights = {k: v for k, v in state.items() if k not in scales}
    weights_io.check_state_dict(model, weights)
    bound = bind_parameters(model, targets)
    try:
        with torch.no_grad():
            model.load_state_dict(weights, strict=True)  # copies into the targets, converting
            report = weights_io.apply_precision_(model, how.weight_precision, how.compute_dtype)
            input_amax: dict[str, Tensor] = {}
            if how.calibrate_inputs and (
                inputs := activation_quant.install_(model, how.weight_precision, report["quantized"])
            ):
                input_amax = inputs.calibrate(model)
    finally:
        for module, key, original in bound:  # no reference to the engine's memory between requests
            module._parameters[key] = original
    return report, scales, input_amax


def bind_parameters(
    model: nn.Module, targets: dict[str, Tensor]
) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Make each parameter of ``model`` (on ``meta``) a parameter over its target tensor, tied
    parameters (one object in two modules) staying tied; returns what to put back."""
    missing = sorted({name for name, _ in model.named_parameters()} - set(targets))
    if missing:
        raise ValueError(f"no staging tensor for {missing[0]!r}")
    over = {id(p): nn.Parameter(targets[name], requires_grad=False) for name, p in model.named_parameters()}
    bound: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and id(param) in over:
                bound.append((module, key, param))
                module._parameters[key] = over[id(param)]
    return bound


PARENT_CHECK_S = 1.0


def exit_with_parent(parent: int) -> None:
    """End this process once its parent has: an engine killed outright (SIGKILL, OOM) runs no exit
    handler that would stop its daemon children, and a preparer left behind holds a model's worth of
    memory."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


def serve_preparations(
    config: PretrainedConfig,
    how: Preparation,
    threads: int,
    requests: multiprocessing.queues.Queue[Any],
    answers: multiprocessing.queues.Queue[Any],
) -> None:
    """The preparer process: one request at a time until ``None``, or until its engine is gone."""
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(max(threads, 1))
    model = skeleton(config)
    held: dict[int, Tensor] = {}  # the engine's two shared copies, by number, handed over once each
    while (request := requests.get()) is not None:
        source, numbers, handles = request
        held.update(handles)
        targets = {name: held[number] for name, number in numbers.items()}
        answers.put(prepare_request(model, source, targets, how))
        del targets


def prepare_request(
    model: nn.Module,
    source: tuple[str, Any],
    targets: dict[str, Tensor],
    how: Preparation,
) -> tuple[Any, ...]:
    """One preparation: ``("ok", report, the manifest's version, KV scales, input maxima)`` or
    ``("refused", why)``."""
    kind, payload = source
    try:
        if kind == "dir":
            state, manifest = load_checkpoint_dir(payload, verify=True)
            named = manifest.get("version")
        else:
            state, named = payload, None
        report, scales, input_amax = prepare_into(model, targets, state, how)
    except (WeightStoreError, OSError, ValueError, RuntimeError) as exc:
        return ("refused", str(exc))
    return ("ok", report, named, scales, input_amax)
