"""Turns at the cores for model services that share them: a lock that every service started with
the same --pass-lock file takes for the length of each forward pass.

A target and a draft service on one machine (as `specdec up` starts them) each run their passes on
an OpenMP team as wide as the machine. Where two passes overlap, the two teams share the same cores
inside every parallel region, each region waits for its slowest thread, and both passes run far
slower than either alone: on 2 CPUs, a target running passes over 4 sessions back to back (29 ms
each alone) took 81 ms a pass while a draft ran a pass every 10 ms beside it, and the draft's
passes took 16 ms instead of 4 (benchmarks/shared_cores.py). Taking turns, the target's passes
took 30 ms and the draft's 4. A turnstile keeps the turns fair: a service that has just run a pass
and wants another waits behind one already waiting, so a busy target cannot keep the draft out.

Two files: PATH, held for the length of a pass, and PATH.queue, held while waiting for PATH. They
are flock(2) locks, which belong to an open file: two PassLocks take turns even in one process, and
the kernel releases a lock whose process dies.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class PassLock:
    """`with lock:` around a forward pass. Open until close()."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._pass = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self._queue = os.open(f"{self.path}.queue", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            os.close(self._pass)
            raise

    def __enter__(self) -> PassLock:
        fcntl.flock(self._queue, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._pass, fcntl.LOCK_EX)
        finally:
            fcntl.flock(self._queue, fcntl.LOCK_UN)
        return self

    def __exit__(self, *exc_info: object) -> None:
        fcntl.flock(self._pass, fcntl.LOCK_UN)

    @property
    def lock_id(self) -> str:
        """The lock's name for other processes: its file's device and inode ("dev:inode"), the same
        for every service that opened this file, whatever path it was given."""
        stat = os.fstat(self._pass)
        return f"{stat.st_dev}:{stat.st_ino}"

    def close(self) -> None:
        os.close(self._pass)
        os.close(self._queue)


def take_turns(lock_a: str, lock_b: str) -> bool:
    """Whether two replicas' passes take turns: both take the same pass lock (lock_id, as their
    Info reports it). Meaningful for replicas on one machine (specdec.compute_units)."""
    return bool(lock_a) and lock_a == lock_b
