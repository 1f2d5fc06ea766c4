"""The model thread (specdec.worker): a process runs all of its torch work, loading included, on
one thread, so torch has one OpenMP team (the module docstring says why that matters); workers
share that thread yet keep their own queue bound and shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specdec.errors import Overloaded
from specdec.worker import ModelWorker, model_thread, run_on_model_thread


def test_loading_and_every_worker_run_on_one_thread():
    async def scenario() -> set[int]:
        first, second = ModelWorker(), ModelWorker()
        try:
            loaded_on = await run_on_model_thread(threading.get_ident)
            ran_on = [(await worker.run(threading.get_ident)).value for worker in (first, second)]
            return {loaded_on, *ran_on}
        finally:
            first.shutdown()
            second.shutdown()

    threads = asyncio.run(scenario())
    assert len(threads) == 1
    assert threads != {threading.get_ident()}  # never the caller's (event loop) thread


def test_shutdown_cancels_only_its_own_queued_calls():
    async def scenario() -> tuple[list[str], str]:
        stopping, other = ModelWorker(), ModelWorker()
        release = threading.Event()
        started = threading.Event()
        order: list[str] = []

        def blocking() -> None:
            started.set()
            release.wait(timeout=30)
            order.append("running call finished")

        running = asyncio.ensure_future(stopping.run(blocking))
        queued = asyncio.ensure_future(stopping.run(lambda: order.append("queued call ran")))
        await asyncio.to_thread(started.wait, 30)
        threading.Timer(0.05, release.set).start()
        await asyncio.to_thread(stopping.shutdown)  # waits for the running call, cancels the queued
        await running
        with pytest.raises(asyncio.CancelledError):
            await queued
        with pytest.raises(RuntimeError, match="shut down"):
            await stopping.run(lambda: None)
        survivor = (await other.run(lambda: "other worker still runs")).value
        other.shutdown()
        return order, survivor

    order, survivor = asyncio.run(scenario())
    assert order == ["running call finished"]
    assert survivor == "other worker still runs"
    assert not model_thread()._shutdown  # the shared thread outlives a worker


def test_queue_bound_is_per_worker():
    async def scenario() -> None:
        small, other = ModelWorker(max_queue=1), ModelWorker(max_queue=1)
        release = threading.Event()
        busy = asyncio.ensure_future(small.run(lambda: release.wait(timeout=30)))
        await asyncio.sleep(0)  # the call is now pending on `small`
        with pytest.raises(Overloaded):
            await small.run(lambda: None)
        waiting_on_other = asyncio.ensure_future(other.run(lambda: "accepted"))  # queued, not refused
        release.set()
        await busy
        assert (await waiting_on_other).value == "accepted"
        small.shutdown()
        other.shutdown()

    asyncio.run(scenario())
