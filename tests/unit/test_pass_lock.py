"""The pass lock: services that name the same file never run passes at once, take turns fairly,
and a worker given one runs its passes under it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest
import torch

from specdec import attention
from specdec.kv_cache import SequenceCache
from specdec.pass_lock import PassLock, take_turns
from specdec.ragged import Feed
from specdec.worker import ModelWorker

from tests import tiny_models

@pytest.fixture(scope="module")
def model():
    model = tiny_models.make_model(seed=5).to(torch.float64)
    attention.use_ragged(model)
    return model


_HOLDER = """
import os, sys, time
from specdec.pass_lock import PassLock, take_turns
lock = PassLock(sys.argv[1])
log = os.open(sys.argv[2], os.O_WRONLY | os.O_APPEND)
for _ in range(40):
    with lock:
        os.write(log, f"in {os.getpid()}\\n".encode())
        time.sleep(0.002)
        os.write(log, f"out {os.getpid()}\\n".encode())
"""


def test_processes_sharing_the_file_never_hold_it_at_once(tmp_path):
    """Three processes, 40 turns each, log entering and leaving (appends are atomic): every
    entry is followed by the same process leaving before anyone enters again."""
    path, log = tmp_path / "passes.lock", tmp_path / "log"
    log.touch()
    holders = [subprocess.Popen([sys.executable, "-c", _HOLDER, str(path), str(log)]) for _ in range(3)]
    for holder in holders:
        assert holder.wait(timeout=120) == 0
    lines = log.read_text().split()
    events = list(zip(lines[0::2], lines[1::2]))
    assert len(events) == 3 * 40 * 2
    for entering, leaving in zip(events[0::2], events[1::2]):
        assert entering[0] == "in" and leaving == ("out", entering[1]), (entering, leaving)
    assert len({pid for _, pid in events}) == 3


def test_a_waiting_holder_goes_before_the_one_that_just_left(tmp_path):
    """A holds the lock; B waits for it; A leaves and asks again at once: B's turn comes first
    (without the turnstile, A usually takes it straight back)."""
    path = tmp_path / "passes.lock"
    a, b = PassLock(path), PassLock(path)
    order: list[str] = []
    b_waiting = threading.Event()

    def take_b() -> None:
        b_waiting.set()
        with b:
            order.append("b")

    try:
        for _ in range(5):
            order.clear()
            b_waiting.clear()
            with a:
                order.append("a")
                thread = threading.Thread(target=take_b)
                thread.start()
                b_waiting.wait()
                time.sleep(0.1)  # B is blocked in the lock by now
            with a:
                order.append("a again")
            thread.join()
            assert order == ["a", "b", "a again"]
    finally:
        a.close()
        b.close()


def test_a_worker_runs_its_passes_under_the_lock(model, tmp_path, monkeypatch):
    """While another holder has the lock, the worker's pass does not run; once it is free, the
    pass runs, and its compute time leaves out the wait (the worker's clock jumps 100 s while the
    lock is taken, so a wait counted in it would show)."""
    import types

    import specdec.worker as worker_module

    offset = [0.0]
    real_clock = time.perf_counter
    monkeypatch.setattr(worker_module, "time", types.SimpleNamespace(perf_counter=lambda: real_clock() + offset[0]))

    class SlowToTake(PassLock):
        def __enter__(self):
            taken = super().__enter__()
            offset[0] += 100.0
            return taken

    path = tmp_path / "passes.lock"
    holder = PassLock(path)
    lock = SlowToTake(path)
    cache = SequenceCache(model)
    cache.feed([1, 2, 3])

    def step():
        return (yield Feed(cache, [4]))

    async def scenario():
        worker = ModelWorker(model=model, pass_lock=lock)
        with holder:
            job = asyncio.ensure_future(worker.run_job(step))
            await asyncio.sleep(0.5)
            ran_while_held = job.done() or len(cache) != 3
        timed = await job
        worker.shutdown()
        return ran_while_held, timed

    try:
        ran_while_held, timed = asyncio.run(scenario())
    finally:
        holder.close()
        lock.close()
    assert not ran_while_held
    assert len(cache) == 4
    assert offset[0] == 100.0  # the pass took the lock once
    assert timed.compute_seconds < 100.0


def test_a_lock_is_named_by_its_file_whatever_the_path(tmp_path):
    """Info names a replica's pass lock by its file (device and inode), so two services that reach
    one file by different paths are seen to take turns, and two files are not one lock."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    first, again, other = (PassLock(tmp_path / "dir" / "passes.lock"), PassLock(tmp_path / "link" / "passes.lock"),
                           PassLock(tmp_path / "other.lock"))
    try:
        assert first.lock_id == again.lock_id and first.lock_id != other.lock_id
        assert take_turns(first.lock_id, again.lock_id)
        assert not take_turns(first.lock_id, other.lock_id)
        assert not take_turns("", "")  # neither takes a lock
    finally:
        for lock in (first, again, other):
            lock.close()
