"""Runs model forward passes off the asyncio event loop, on one thread with a bounded queue, so
health checks, cancellation and other sessions never wait behind a forward pass."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from specdec.errors import Overloaded

Result = TypeVar("Result")


@dataclass(frozen=True)
class Timed:
    """A worker result with its timing (seconds)."""

    value: object
    compute_seconds: float
    queue_seconds: float


class ModelWorker:
    def __init__(self, max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.max_queue = max_queue
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-worker")
        self._pending = 0

    @property
    def load(self) -> float:
        """Calls queued or running over the queue's capacity, in [0, 1]."""
        return min(1.0, self._pending / self.max_queue)

    @property
    def idle(self) -> bool:
        return self._pending == 0

    async def run(self, fn: Callable[[], Result]) -> Timed:
        if self._pending >= self.max_queue:
            raise Overloaded(f"model worker queue is full ({self.max_queue} calls waiting)")
        self._pending += 1
        submitted = time.perf_counter()
        started: list[float] = []

        def timed_call() -> Result:
            started.append(time.perf_counter())
            return fn()

        future = asyncio.get_running_loop().run_in_executor(self._executor, timed_call)
        try:
            value = await asyncio.shield(future)
        except asyncio.CancelledError:
            # A forward pass cannot be interrupted: let it finish before the caller's session
            # lock is released, so no other call sees a half-updated cache.
            await asyncio.wait([future])
            raise
        finally:
            self._pending -= 1
        finished = time.perf_counter()
        return Timed(value=value, compute_seconds=finished - started[0],
                     queue_seconds=started[0] - submitted)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
