"""Real service processes for the reliability tests: started through the CLI, restartable on the
same port, killable, pausable; and the probes the tests use on them (Info, health, memory)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import common_pb2, draft_pb2_grpc, orchestrator_pb2_grpc, target_pb2_grpc
from specdec_cli.processes import ServiceProcess, start_service
from specdec_cli.stack import run_concurrently

START_SECONDS = 300  # a process's start (torch import, model load) on a loaded 2-core machine
WAIT_SECONDS = 120  # any "eventually" in these tests; only a bug comes near it
CALL_SECONDS = 60  # one RPC; only a hang comes near it

# The plain cluster (conftest.py): target replica A has a small budget, B the defaults.
PLAIN_TTL_SECONDS = 3600  # an hour: expiry cannot hide a leak
A_MAX_SESSIONS = 16
A_MAX_CACHED_TOKENS = 20_000
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class Service:
    """One `specdec serve ROLE` process. The first start takes a free port; restarts reuse it, as a
    restarted pod behind a stable address would."""

    role: str
    args: list[str]
    # One torch thread per process: several processes share two cores here, and OpenMP threads
    # spinning against each other cost them ~8x in CPU time.
    env: dict[str, str] = field(default_factory=lambda: {"OMP_NUM_THREADS": "1"})
    port: int = 0
    process: ServiceProcess | None = None
    starts: int = 0

    def start(self) -> Service:
        assert not self.alive, f"{self.role} on port {self.port} is already running"
        self.process = start_service(self.role, [*self.args, "--port", str(self.port)],
                                     timeout=START_SECONDS, env=self.env)
        self.port = int(self.process.address.rsplit(":", 1)[1])
        self.starts += 1
        return self

    @property
    def replica_id(self) -> str:
        return self.args[self.args.index("--replica-id") + 1] if "--replica-id" in self.args else ""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.process.pid

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.process.poll() is None

    @property
    def health_port(self) -> int | None:
        """The plaintext health port from the READY line (with --health-port)."""
        for line in self.output().splitlines():
            if line.startswith("READY ") and "health=" in line:
                value = line.split("health=", 1)[1].split()[0]
                return None if value == "None" else int(value)
        return None

    def signal(self, number: int) -> None:
        assert self.process is not None
        os.kill(self.pid, number)

    def kill(self) -> None:
        """kill -9: a crash."""
        assert self.process is not None
        self.process.kill()

    def pause(self) -> None:
        """SIGSTOP: a stall (the process holds its connections and answers nothing)."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM and wait; None if it was not running."""
        if self.process is None:
            return None
        if self.alive:
            self.resume()  # a paused process would never see the SIGTERM
        return self.process.stop(timeout)

    def wait(self, timeout: float = WAIT_SECONDS) -> int:
        assert self.process is not None
        return self.process.process.wait(timeout)

    def output(self) -> str:
        return self.process.output() if self.process else ""


def start_all(services: Iterable[Service]) -> None:
    """Starts services concurrently (model loads overlap); raises if any failed."""
    run_concurrently([service.start for service in services])


def stop_all(services: Iterable[Service]) -> dict[str, int | None]:
    """SIGTERM to all at once (each drains, then exits); their exit codes."""
    services = list(services)
    codes: dict[str, int | None] = {}

    def stop(service: Service) -> None:
        codes[f"{service.role}:{service.port}"] = service.stop()

    run_concurrently([partial(stop, service) for service in services])
    return codes


@contextmanager
def two_target_cluster(tiny_pair, model_flags: Sequence[str], orchestrator_flags: Sequence[str],
                       target_a_flags: Sequence[str] = (), require_clean_exit: bool = True,
                       ) -> Iterator[dict[str, Service]]:
    """Target replicas A and B, a draft and an orchestrator that lists A first, started through the
    CLI; stopped together on exit (each must exit 0 if require_clean_exit)."""
    services = {
        "target_a": Service("target", ["--model", str(tiny_pair.target_dir), "--replica-id", "target-a",
                                       *target_a_flags, *model_flags]),
        "target_b": Service("target", ["--model", str(tiny_pair.target_dir), "--replica-id", "target-b",
                                       *model_flags]),
        "draft": Service("draft", ["--model", str(tiny_pair.draft_dir), "--replica-id", "draft-0", *model_flags]),
    }
    try:
        start_all(services.values())
        services["orchestrator"] = Service("orchestrator", [
            # A first: with equal loads the orchestrator tries it first.
            "--target", f"{services['target_a'].address},{services['target_b'].address}",
            "--draft", services["draft"].address, *orchestrator_flags,
        ]).start()
        yield services
    finally:
        codes = stop_all(reversed(list(services.values())))
        if require_clean_exit:
            assert all(code == 0 for code in codes.values()), codes


# -- clients ----------------------------------------------------------------------------------


def model_stub(service: Service, channel: grpc.Channel):
    kind = target_pb2_grpc.TargetServiceStub if service.role == "target" else draft_pb2_grpc.DraftServiceStub
    return kind(channel)


def info(service: Service) -> common_pb2.InfoResponse:
    with grpc.insecure_channel(service.address) as channel:
        return model_stub(service, channel).Info(common_pb2.InfoRequest(), timeout=CALL_SECONDS)


def sessions_and_tokens(services: Iterable[Service]) -> list[tuple[int, int]]:
    return [(i.live_sessions, i.cached_tokens) for i in map(info, services)]


def health_status(address: str, service_name: str = "", timeout: float = 10) -> str:
    """SERVING / NOT_SERVING / UNKNOWN, or the status code name when the check fails."""
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service_name), timeout=timeout)
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def orchestrator_stub(channel: grpc.Channel) -> orchestrator_pb2_grpc.OrchestratorStub:
    return orchestrator_pb2_grpc.OrchestratorStub(channel)
