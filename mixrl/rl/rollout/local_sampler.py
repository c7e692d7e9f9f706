"""An in-process batched sampler over a ``transformers`` model, for measuring success rates.

This is a plain sampling loop, not the engine: no KV cache (contexts here are under ~100 tokens,
so recomputing the whole batch each step is cheap), no HTTP, no precision emulation.  It serves the
warm start's success probes, the tests and the learnability benchmark, where the real agent loop
(:func:`mixrl.rl.rollout.agent.run_episode`) runs against a model without starting any server.

Concurrent ``generate`` calls from many episodes are batched: each step runs one forward pass over
every active request (right-padded; causal attention keeps padding out of real positions) and
samples one token for each with the engine's sampler (:func:`mixrl.rl.engine.sampling.sample_rows`),
so its token records are the engine's: log q after temperature and before truncation, candidates
most likely first, and with top-p / top-k (or greedy decoding) the support recorded as the leading
candidates.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import torch

from mixrl.api.trajectory import TokenRecord
from mixrl.rl.engine.protocol import GenerateResult, PoolInfo
from mixrl.rl.engine.sampling import RowSampling, sample_rows


@dataclass
class _Request:
    ids: list[int]
    remaining: int
    done: asyncio.Future[GenerateResult]
    records: list[TokenRecord] = field(default_factory=list)


class LocalSampler:
    """Batches concurrent ``generate(input_ids, max_new_tokens)`` calls onto one in-process model.

    Use as ``async with LocalSampler(model, ...) as sampler`` so its driver task is always awaited.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        stop_token_ids: list[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        num_candidates: int = 0,
        seed: int = 0,
        weight_version: int = 0,
        pool: PoolInfo | None = None,
        pad_id: int = 0,
        max_batch: int = 256,
    ) -> None:
        self.model = model
        self.stop_token_ids = set(stop_token_ids)
        self.sampling = RowSampling(
            temperature=temperature, top_p=top_p, top_k=top_k, num_candidates=num_candidates
        )
        self.weight_version = weight_version
        self.pool = pool or PoolInfo("local", "cpu", "fp32")
        self.pad_id = pad_id
        self.max_batch = max_batch
        self.generator = torch.Generator().manual_seed(seed)
        self._active: list[_Request] = []
        self._driver: asyncio.Task[None] | None = None
        self.forward_passes = 0

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._driver is not None:
            if self._active:
                self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None

    async def generate(self, input_ids: list[int], max_new_tokens: int) -> GenerateResult:
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: must be positive, got {max_new_tokens}")
        request = _Request(list(input_ids), max_new_tokens, asyncio.get_running_loop().create_future())
        self._active.append(request)
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        return await request.done

    async def _drive(self) -> None:
        try:
            while True:
                # Finished requests leave, and so do cancelled ones (their episode was cancelled
                # mid-turn): finishing a cancelled future would raise and fail the whole batch.
                self._active = [r for r in self._active if not r.done.done()]
                if not self._active:
                    break
                self._step(self._active[: self.max_batch])
                # let the episodes whose turn ended parse it and submit their next turn
                await asyncio.sleep(0)
        except BaseException as exc:
            for request in self._active:
                if not request.done.done():
                    request.done.set_exception(
                        exc if isinstance(exc, Exception) else RuntimeError("sampler stopped")
                    )
            self._active = []
            raise

    @torch.no_grad()
    def _step(self, batch: list[_Request]) -> None:
        lengths = [len(r.ids) for r in batch]
        width = max(lengths)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        for row, request in enumerate(batch):
            input_ids[row, : len(request.ids)] = torch.tensor(request.ids)
        logits = self.model(input_ids=input_ids).logits
        last = logits[torch.arange(len(batch)), torch.tensor(lengths) - 1]
        self.forward_passes += 1
        uniforms = torch.rand(len(batch), generator=self.generator)
        records = sample_rows(last, [self.sampling] * len(batch), uniforms, self.weight_version)
        for request, record in zip(batch, records, strict=True):
            request.records.append(record)
            request.ids.append(record.token_id)
            request.remaining -= 1
            if record.token_id in self.stop_token_ids:
                request.done.set_result(GenerateResult(request.records, "stop", self.pool))
            elif request.remaining == 0:
                request.done.set_result(GenerateResult(request.records, "length", self.pool))
