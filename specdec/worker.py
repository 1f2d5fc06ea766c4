"""Runs model forward passes off the asyncio event loop, on one thread with a bounded queue, so
health checks, cancellation and other sessions never wait behind a forward pass.

One thread per process runs all of its torch work, the model's loading included (model_thread).
torch's CPU ops run on an OpenMP team per calling thread, and libgomp lets a team's idle threads
spin between parallel regions only while the process has no more OpenMP threads than CPUs. A
second team (a model loaded on one thread and run on another, or two services' workers in one
process) doubles that count: every small op then pays a futex wake-up and a decode step takes
2-3x longer. Measured on 2 CPUs: the default draft's Propose 3.3 ms with one thread, 8.6 ms when
loaded on one thread and run on another."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
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


_model_thread: ThreadPoolExecutor | None = None
_model_thread_lock = threading.Lock()


def model_thread() -> ThreadPoolExecutor:
    """The one thread that runs this process's torch work (see the module's docstring)."""
    global _model_thread
    with _model_thread_lock:
        if _model_thread is None:
            _model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        return _model_thread


async def run_on_model_thread(fn: Callable[[], Result]) -> Result:
    """fn() on the model thread, awaited (loading a model, say)."""
    return await asyncio.wrap_future(model_thread().submit(fn))


class ModelWorker:
    """One service's queue of forward passes. Every worker in a process shares the model thread,
    so two services in one process take turns; each keeps its own queue bound and shutdown."""

    def __init__(self, max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.max_queue = max_queue
        self._pending = 0
        self._futures: set[concurrent.futures.Future] = set()
        self._closed = False

    @property
    def load(self) -> float:
        """Calls queued or running over the queue's capacity, in [0, 1]."""
        return min(1.0, self._pending / self.max_queue)

    @property
    def idle(self) -> bool:
        return self._pending == 0

    async def run(self, fn: Callable[[], Result]) -> Timed:
        if self._closed:
            raise RuntimeError("the model worker is shut down")
        if self._pending >= self.max_queue:
            raise Overloaded(f"model worker queue is full ({self.max_queue} calls waiting)")
        self._pending += 1
        submitted = time.perf_counter()
        started: list[float] = []

        def timed_call() -> Result:
            started.append(time.perf_counter())
            return fn()

        submitted_future = model_thread().submit(timed_call)
        self._futures.add(submitted_future)
        submitted_future.add_done_callback(self._futures.discard)
        future = asyncio.wrap_future(submitted_future)
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
        """Cancels this worker's queued calls and waits for its running one; the model thread
        itself goes on (other services in the process may use it)."""
        self._closed = True
        pending = list(self._futures)
        for future in pending:
            future.cancel()
        concurrent.futures.wait(pending)
