"""A loop that calls ``tick()`` every ``tick_s`` seconds until stopped, with one HTTP session: the
shape of the operator's background loops (the built-in autoscaler, the live status)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp


class Ticker:
    """Subclasses define ``tick``; an exception in one tick is logged and the next tick comes."""

    tick_name = "tick"
    """Names the task and the log line of a failed tick."""

    def __init__(self, tick_s: float, log: logging.Logger) -> None:
        self.tick_s = tick_s
        self.log = log
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def tick(self) -> object:
        raise NotImplementedError

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._forever(), name=self.tick_name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _forever(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # one bad object or a lost connection must not end the loop
                self.log.exception("%s failed", self.tick_name)
            await asyncio.sleep(self.tick_s)

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session
