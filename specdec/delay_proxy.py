"""A TCP proxy that adds network delay, for benchmarks and tests: delay between real processes,
never a sleep inside a service, so the services and the K controller see what a real network does.

These machines have no netem, so delay is injected on the byte stream: the proxy listens on a
port, opens one upstream connection per accepted connection and forwards bytes both ways, holding
each chunk for `one_way_delay_ms` plus a jitter sample before passing it on. A round trip through
the proxy therefore gains 2 x one_way_delay_ms.

- Jitter is uniform in [-jitter_ms, +jitter_ms] (the total never below zero), and never reorders
  bytes: a chunk is released at max(arrival + delay + jitter, release of the previous chunk in the
  same direction), so with jitter the mean added delay is somewhat above one_way_delay_ms.
- End of stream travels like data: when one side half-closes, the other side gets the EOF after
  the same delay, once everything before it was delivered; a connection is closed on both sides
  when both directions have ended, or at once when either side fails (reset, broken pipe).
- TCP_NODELAY on both sockets, so the proxy adds no Nagle delay of its own.

Use it inside a running loop (``async with DelayProxy(config) as proxy: proxy.port``) or, for
servers and benchmarks that are not asyncio, in its own thread (:func:`start_in_thread`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

_CHUNK_BYTES = 64 * 1024
_QUEUED_CHUNKS = 1024  # per direction: bounds memory at ~64 MiB while a slow reader catches up


@dataclass(frozen=True, kw_only=True)
class DelayProxyConfig:
    """Where to listen, where to forward, and how much delay to add to each direction."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # 0: an ephemeral port, read it from DelayProxy.port
    upstream_host: str
    upstream_port: int
    one_way_delay_ms: float = 0.0  # added to each direction: RTT grows by twice this
    jitter_ms: float = 0.0  # half-width of the uniform jitter added to each chunk
    seed: int | None = None  # jitter RNG seed (None: nondeterministic)

    def __post_init__(self) -> None:
        if not 0 <= self.listen_port <= 65535:
            raise ValueError(f"listen_port must be in [0, 65535], got {self.listen_port}")
        if not 1 <= self.upstream_port <= 65535:
            raise ValueError(f"upstream_port must be in [1, 65535], got {self.upstream_port}")
        if self.one_way_delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError("one_way_delay_ms and jitter_ms must be >= 0")


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class DelayProxy:
    """The proxy on the running event loop. Start with `async with` (or start() / close())."""

    def __init__(self, config: DelayProxyConfig) -> None:
        self._config = config
        self._rng = random.Random(config.seed)
        self._one_way_delay_ms = config.one_way_delay_ms
        self._jitter_ms = config.jitter_ms
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return self._server.sockets[0].getsockname()[1]

    def set_delay(self, one_way_delay_ms: float, jitter_ms: float = 0.0) -> None:
        """Change the delay for chunks arriving from now on (call on the proxy's loop)."""
        if one_way_delay_ms < 0 or jitter_ms < 0:
            raise ValueError("one_way_delay_ms and jitter_ms must be >= 0")
        self._one_way_delay_ms, self._jitter_ms = one_way_delay_ms, jitter_ms

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("the proxy is already started")
        self._server = await asyncio.start_server(
            self._accept, self._config.listen_host, self._config.listen_port
        )

    async def close(self) -> None:
        """Stop listening and close every proxied connection."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> DelayProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _delay_seconds(self) -> float:
        jitter = self._rng.uniform(-self._jitter_ms, self._jitter_ms) if self._jitter_ms else 0.0
        return max(0.0, self._one_way_delay_ms + jitter) / 1000.0

    def _accept(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        # Our own task rather than the server's callback task, so that close() can cancel it
        # without asyncio logging the cancellation as an error.
        task = asyncio.create_task(self._proxy_connection(client_reader, client_writer))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _proxy_connection(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        writers = [client_writer]
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                self._config.upstream_host, self._config.upstream_port
            )
            writers.append(upstream_writer)
            for writer in writers:
                _set_nodelay(writer)
            # Both directions end normally on EOF; the first failure cancels the other one.
            async with asyncio.TaskGroup() as group:
                group.create_task(self._pipe(client_reader, upstream_writer))
                group.create_task(self._pipe(upstream_reader, client_writer))
        except (OSError, ExceptionGroup):
            pass  # unreachable upstream or a reset side: closing both is all there is to do
        finally:
            for writer in writers:
                writer.close()
            for writer in writers:
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward one direction: each chunk, and the final EOF (b""), leaves at its release."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUED_CHUNKS)
        loop = asyncio.get_running_loop()

        async def receive() -> None:
            last_release = 0.0
            while True:
                chunk = await reader.read(_CHUNK_BYTES)
                last_release = max(loop.time() + self._delay_seconds(), last_release)
                await queue.put((last_release, chunk))
                if not chunk:
                    return

        async def send() -> None:
            while True:
                release, chunk = await queue.get()
                await asyncio.sleep(max(0.0, release - loop.time()))
                if not chunk:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()

        async with asyncio.TaskGroup() as group:
            group.create_task(receive())
            group.create_task(send())


class DelayProxyThread:
    """A DelayProxy running on its own event loop in a daemon thread (see start_in_thread)."""

    def __init__(self, config: DelayProxyConfig, start_timeout_s: float = 10.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="specdec-delay-proxy", daemon=True
        )
        self._thread.start()
        self._proxy = DelayProxy(config)
        try:
            self._call(self._proxy.start(), start_timeout_s)
        except BaseException:
            self._stop_loop()
            raise
        self.port = self._proxy.port

    def _call(self, coroutine: Coroutine[Any, Any, None], timeout_s: float | None) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def set_delay(self, one_way_delay_ms: float, jitter_ms: float = 0.0) -> None:
        """Change the delay for chunks arriving from now on; returns once it applies."""

        async def apply() -> None:
            self._proxy.set_delay(one_way_delay_ms, jitter_ms)

        self._call(apply(), timeout_s=10.0)

    def close(self, timeout_s: float = 10.0) -> None:
        """Close every connection, stop listening and end the thread. Idempotent."""
        if self._loop.is_closed():
            return
        try:
            self._call(self._proxy.close(), timeout_s)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> DelayProxyThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def start_in_thread(config: DelayProxyConfig) -> DelayProxyThread:
    """Start a proxy in a background thread; returns a handle with `.port` and `.close()`."""
    return DelayProxyThread(config)
