"""The TCP delay proxy with real sockets on loopback.

Timing assertions are lower bounds only (a proxy that holds bytes for 50 ms each way cannot answer
in under 100 ms, however loaded the machine is); nothing asserts an upper bound.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.delay_proxy import DelayProxy, DelayProxyConfig, start_in_thread
from specdec_cli.proxy_cmd import parse_host_port

REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def run(coroutine: Awaitable[T], timeout_s: float = 60.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, timeout_s)

    return asyncio.run(bounded())


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@asynccontextmanager
async def echo_server() -> AsyncIterator[int]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def proxy_config(
    upstream_port: int, delay_ms: float = 0.0, jitter_ms: float = 0.0
) -> DelayProxyConfig:
    return DelayProxyConfig(
        upstream_host="127.0.0.1",
        upstream_port=upstream_port,
        one_way_delay_ms=delay_ms,
        jitter_ms=jitter_ms,
        seed=1,
    )


async def send_in_pieces(writer: asyncio.StreamWriter, payload: bytes, rng: random.Random) -> None:
    """Many small writes with pauses, so the proxy sees many chunks with their own jitter."""
    offset = 0
    while offset < len(payload):
        size = rng.randint(1, 2048)
        writer.write(payload[offset : offset + size])
        offset += size
        await writer.drain()
        if rng.random() < 0.2:
            await asyncio.sleep(0.0005)


def test_bytes_arrive_intact_and_in_order_despite_jitter() -> None:
    async def scenario() -> None:
        rng = random.Random(0)
        payload = rng.randbytes(1 << 20)
        async with echo_server() as port, DelayProxy(proxy_config(port, 2.0, 2.0)) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            sending = asyncio.create_task(send_in_pieces(writer, payload, rng))
            received = await reader.readexactly(len(payload))
            await sending
            writer.close()
            await writer.wait_closed()
        assert received == payload

    run(scenario())


def test_a_large_payload_through_the_threaded_proxy() -> None:
    payload = random.Random(1).randbytes(8 << 20)

    async def upstream_and_client() -> bytes:
        async with echo_server() as port:
            with start_in_thread(proxy_config(port, delay_ms=1.0)) as proxy:
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
                writer.write(payload)
                writer.write_eof()  # half-close: the echo must still come back in full
                received = await reader.read()  # until the proxy forwards the upstream's EOF
                writer.close()
                return received

    assert run(upstream_and_client()) == payload


def test_delay_is_added_to_every_round_trip() -> None:
    one_way_ms = 50.0

    async def scenario() -> list[float]:
        async with echo_server() as port, DelayProxy(proxy_config(port, one_way_ms)) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            round_trips = []
            for i in range(3):
                started = time.perf_counter()
                writer.write(bytes([i]))
                assert await reader.readexactly(1) == bytes([i])
                round_trips.append(time.perf_counter() - started)
            writer.close()
            return round_trips

    for seconds in run(scenario()):
        assert seconds >= 2 * one_way_ms / 1000  # a lower bound: it cannot flake under load


def test_the_delay_can_change_while_running() -> None:
    async def scenario() -> float:
        async with echo_server() as port:
            with start_in_thread(proxy_config(port)) as proxy:
                proxy.set_delay(40.0)
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
                started = time.perf_counter()
                writer.write(b"x")
                await reader.readexactly(1)
                writer.close()
                return time.perf_counter() - started

    assert run(scenario()) >= 0.080


def test_closing_either_side_closes_the_other() -> None:
    async def scenario() -> None:
        upstream_saw_eof = asyncio.Event()
        upstream_writers: list[asyncio.StreamWriter] = []

        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            upstream_writers.append(writer)
            if not await reader.read():
                upstream_saw_eof.set()
            writer.close()

        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with DelayProxy(proxy_config(port, 5.0)) as proxy:
            # the client closes: the upstream reads EOF
            _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.close()
            await asyncio.wait_for(upstream_saw_eof.wait(), 10)
            # the upstream closes: the client reads EOF
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            while not upstream_writers[1:]:
                await asyncio.sleep(0.01)
            upstream_writers[1].close()
            assert await reader.read() == b""
            writer.close()
        server.close()
        await server.wait_closed()

    run(scenario())


def test_an_unreachable_upstream_closes_the_client_and_the_proxy_stays_up() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead_port = unused.getsockname()[1]  # nothing listens here once the socket closes

    async def scenario() -> None:
        async with DelayProxy(proxy_config(dead_port)) as proxy:
            for _ in range(2):
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
                assert await reader.read() == b""
                writer.close()

    run(scenario())


def test_close_ends_open_connections_and_stops_listening() -> None:
    async def scenario() -> None:
        async with echo_server() as port:
            proxy = DelayProxy(proxy_config(port))
            await proxy.start()
            listen_port = proxy.port
            reader, writer = await asyncio.open_connection("127.0.0.1", listen_port)
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            await proxy.close()
            assert await reader.read() == b""
            writer.close()
            with pytest.raises(RuntimeError):
                _ = proxy.port
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", listen_port)

    run(scenario())


def test_a_grpc_health_check_through_the_proxy() -> None:
    one_way_ms = 20.0

    async def scenario() -> None:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await servicer.set("specdec.v1.Test", health_pb2.HealthCheckResponse.SERVING)
        try:
            async with DelayProxy(proxy_config(port, one_way_ms, jitter_ms=5.0)) as proxy:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    request = health_pb2.HealthCheckRequest(service="specdec.v1.Test")
                    first = await stub.Check(request, timeout=30)
                    started = time.perf_counter()
                    second = await stub.Check(request, timeout=30)
                    elapsed = time.perf_counter() - started
        finally:
            await server.stop(None)
        assert first.status == second.status == health_pb2.HealthCheckResponse.SERVING
        # request and response each cross the proxy once; jitter is at most 5 ms per direction
        assert elapsed >= 2 * (one_way_ms - 5.0) / 1000

    run(scenario())


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        DelayProxyConfig(upstream_host="127.0.0.1", upstream_port=0)
    with pytest.raises(ValueError):
        DelayProxyConfig(upstream_host="h", upstream_port=1, one_way_delay_ms=-1.0)
    assert parse_host_port("example.org:50051") == ("example.org", 50051)
    assert parse_host_port("[::1]:7") == ("::1", 7)


def test_the_cli_prints_its_port_and_forwards_until_interrupted() -> None:
    async def scenario() -> None:
        async with echo_server() as port:
            command = [sys.executable, "-m", "specdec_cli.main", "proxy", "--upstream"]
            process = await asyncio.create_subprocess_exec(
                *command,
                f"127.0.0.1:{port}",
                "--delay-ms",
                "5",
                cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                stdout=subprocess.PIPE,
            )
            try:
                assert process.stdout is not None
                line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
                match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
                assert match, line
                reader, writer = await asyncio.open_connection("127.0.0.1", int(match.group(1)))
                writer.write(b"through the cli")
                assert await reader.readexactly(15) == b"through the cli"
                writer.close()
                process.send_signal(signal.SIGINT)
                assert await asyncio.wait_for(process.wait(), 30) == 130
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()

    run(scenario(), timeout_s=120)
