"""Waiting for a condition in tests: poll until it holds, fail the test if it never does.

The bound catches a hang, it is not a timing assertion: it is far above what a healthy run needs
on a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

WAIT_SECONDS = 120.0


def eventually(condition: Callable[[], object], what: str, timeout: float = WAIT_SECONDS,
               interval: float = 0.05) -> object:
    """Polls condition() until it returns something truthy, and returns that; fails with `what`
    after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(interval)


async def eventually_async(condition: Callable[[], object], what: str, timeout: float = WAIT_SECONDS,
                           interval: float = 0.05) -> object:
    """eventually, on an event loop; condition may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(interval)
