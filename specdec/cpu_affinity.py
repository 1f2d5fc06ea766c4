"""Pinning a service's process to CPUs: `specdec serve ROLE --cpus 0-3` (Linux).

A CPU list is what taskset and cpusets take: CPU numbers and inclusive ranges separated by commas
("0", "0,1", "0-3", "0-1,4,6-7"). pin_to_cpus() sets the affinity of every thread the process has
so far (os.sched_setaffinity on pid 0 changes only the calling thread on Linux; threads a library
started at import keep their own mask otherwise); threads started later inherit it from the thread
that starts them. It is called before the model is loaded and before the gRPC server and the model
thread start, so torch's OpenMP workers, created on the first forward pass, run on these CPUs.

Plain Python: no torch here (the caller sets torch's thread count).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def parse_cpu_list(text: str) -> frozenset[int]:
    """'0', '0,1', '0-3', '0-1,4' -> the set of CPU numbers. Raises ValueError saying what is wrong."""
    cpus: set[int] = set()
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or not all(items):
        raise ValueError(f"--cpus {text!r}: expected CPU numbers and ranges separated by commas, "
                         "e.g. 0 or 0,1 or 0-3")
    for item in items:
        low, dash, high = item.partition("-")
        try:
            first = _cpu_number(low)
            last = _cpu_number(high) if dash else first
        except ValueError:
            raise ValueError(f"--cpus {text!r}: {item!r} is not a CPU number or a range "
                             "(e.g. 0 or 0-3)") from None
        if last < first:
            raise ValueError(f"--cpus {text!r}: the range {item!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def _cpu_number(text: str) -> int:
    text = text.strip()
    if not text.isdigit():  # no sign, no blank: "-1" and "" are not CPUs
        raise ValueError(text)
    return int(text)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5' (the form parse_cpu_list reads)."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    start = previous = None
    for cpu in [*ordered, None]:
        if start is not None and (cpu is None or cpu != previous + 1):
            ranges.append(str(start) if start == previous else f"{start}-{previous}")
            start = None
        if cpu is not None and start is None:
            start = cpu
        previous = cpu
    return ",".join(ranges)


def supported() -> bool:
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def available_cpus() -> frozenset[int]:
    """The CPUs this process may run on now (its affinity mask: all of the machine's, unless a
    cpuset, taskset or a container limits it)."""
    return frozenset(os.sched_getaffinity(0))


def check_available(cpus: frozenset[int], available: frozenset[int]) -> None:
    """Raises ValueError naming the CPUs asked for that are not available, and those that are."""
    missing = cpus - available
    if missing:
        which = "CPU" if len(missing) == 1 else "CPUs"
        raise ValueError(f"--cpus: {which} {format_cpu_list(missing)} not available to this process; "
                         f"available: {format_cpu_list(available)}")


def pin_to_cpus(text: str) -> frozenset[int]:
    """Parses `text` and pins every thread of this process to those CPUs; returns them. Raises
    ValueError for a malformed list, CPUs not available here, or a platform without affinity."""
    cpus = parse_cpu_list(text)
    if not supported():
        raise ValueError("--cpus needs a platform with CPU affinity (Linux: os.sched_setaffinity)")
    check_available(cpus, available_cpus())
    try:
        for thread_id in _thread_ids():
            try:
                os.sched_setaffinity(thread_id, cpus)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        os.sched_setaffinity(0, cpus)  # the calling thread, whatever /proc said
    except OSError as error:  # e.g. EINVAL: outside this cgroup's cpuset
        raise ValueError(f"--cpus {text!r}: cannot pin to CPUs {format_cpu_list(cpus)}: "
                         f"{error.strerror or error}") from error
    pinned = frozenset(os.sched_getaffinity(0))
    if pinned != cpus:  # e.g. a cpuset that changed underneath
        raise ValueError(f"--cpus {text!r}: asked for CPUs {format_cpu_list(cpus)}, the process runs on "
                         f"{format_cpu_list(pinned)}")
    return cpus


def _thread_ids() -> list[int]:
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return []
    return [int(entry.name) for entry in tasks.iterdir() if entry.name.isdigit()]
