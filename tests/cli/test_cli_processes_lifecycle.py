"""Service processes and what stops them: a port already in use is refused (grpcio would share
it), an orchestrator waiting for replicas says so and stops on SIGTERM or SIGINT, and `specdec
up` and `specdec proxy` stop on Ctrl-C even when started with SIGINT ignored (a background job
of a non-interactive shell), leaving no process behind."""

from __future__ import annotations

import signal
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import Unavailable
from specdec.rpc.server import RunningServer, ServerConfig
from specdec_cli.processes import start_service

from tests.process_groups import run_specdec

LIVENESS_DEADLINE = 60  # seconds; a bound on a hang, far above what a stop takes


def _closed_port() -> int:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        return unused.getsockname()[1]


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def test_a_grpc_server_does_not_share_a_port_in_use(loop_thread):
    """Without the early check: the grpc server itself must refuse the port (no SO_REUSEPORT)."""
    first = RunningServer(ServerConfig(port=0), [])
    loop_thread.run(first.start(lambda server: None))
    try:
        second = RunningServer(ServerConfig(port=first.port), [])
        with pytest.raises(Unavailable, match=f"^port {first.port} is already in use$"):
            loop_thread.run(second.start(lambda server: None))
        assert _serving(first.port)
    finally:
        loop_thread.run(first.stop())


@pytest.fixture(scope="module")
def target(tiny_pair):
    service = start_service("target", ["--model", str(tiny_pair.target_dir), "--dtype", "float64",
                                       "--port", "0", "--threads", "1"], timeout=300)
    try:
        yield service
    finally:
        service.stop()


@pytest.mark.parametrize("role", ["target", "orchestrator"])
def test_a_second_service_on_a_port_in_use_is_refused(target, tiny_pair, role):
    port = int(target.address.rsplit(":", 1)[1])
    flags = (["--model", str(tiny_pair.target_dir), "--threads", "1"] if role == "target" else
             ["--target", target.address, "--draft", target.address, "--startup-timeout", "5"])
    with run_specdec("serve", role, *flags, "--port", str(port)) as second:
        code = second.wait(LIVENESS_DEADLINE)
        assert code == 2, second.output()
        assert "Traceback" not in second.output()
        assert f"port {port} is already in use" in second.output().splitlines()[-1]
    assert target.process.poll() is None and _serving(port)


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_orchestrator_waiting_for_its_pools_says_so_and_stops_on_a_signal(number):
    target, draft = f"127.0.0.1:{_closed_port()}", f"127.0.0.1:{_closed_port()}"
    with run_specdec("serve", "orchestrator", "--target", target, "--draft", draft, "--port", "0") as orchestrator:
        line = orchestrator.wait_for_line(r"waiting for the target pool")
        assert target in line.string and draft in line.string and "--startup-timeout" in line.string
        orchestrator.process.send_signal(number)
        assert orchestrator.wait(LIVENESS_DEADLINE) == 0, orchestrator.output()
        assert "stopped by a signal before it was ready" in orchestrator.output()
        assert "Traceback" not in orchestrator.output()


def test_the_orchestrator_gives_up_after_the_startup_timeout():
    with run_specdec("serve", "orchestrator", "--target", f"127.0.0.1:{_closed_port()}",
                     "--draft", f"127.0.0.1:{_closed_port()}", "--port", "0",
                     "--startup-timeout", "1") as orchestrator:
        assert orchestrator.wait(LIVENESS_DEADLINE) == 2, orchestrator.output()
        assert "no target replica answered" in orchestrator.output()


def _up(tiny_pair) -> tuple[str, ...]:
    return ("up", "--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir),
            "--dtype", "float64", "--http-port", "0", "--port", "0", "--threads", "1")


def test_up_stops_on_ctrl_c_even_when_started_with_sigint_ignored(tiny_pair):
    with run_specdec(*_up(tiny_pair), ignore_sigint=True) as up:
        up.wait_for_line(r"orchestrator at (\S+)", timeout=300)
        up.process.send_signal(signal.SIGINT)
        assert up.wait(LIVENESS_DEADLINE) == 0, up.output()
        assert "stopping" in up.output()
        assert not up.group_alive(), "a service outlived `specdec up`"


def test_up_interrupted_while_starting_leaves_no_process(tiny_pair):
    with run_specdec(*_up(tiny_pair), ignore_sigint=True) as up:
        up.wait_for_line(r"^\[(target|draft)\] ", timeout=300)  # a model service is starting
        up.process.send_signal(signal.SIGINT)
        assert up.wait(LIVENESS_DEADLINE) in (0, 130), up.output()
        assert "Traceback" not in up.output()
        assert not up.group_alive(), "a service outlived `specdec up`"


def test_proxy_stops_on_ctrl_c_even_when_started_with_sigint_ignored():
    with run_specdec("proxy", "--upstream", f"127.0.0.1:{_closed_port()}", ignore_sigint=True) as proxy:
        proxy.wait_for_line(r"listening on 127\.0\.0\.1:\d+")
        proxy.process.send_signal(signal.SIGINT)
        assert proxy.wait(LIVENESS_DEADLINE) == 130, proxy.output()


def test_up_refuses_an_orchestrator_port_in_use_before_loading_models(target, tiny_pair):
    port = target.address.rsplit(":", 1)[1]
    with run_specdec(*_up(tiny_pair)[:-4], "--port", port) as up:
        assert up.wait(LIVENESS_DEADLINE) == 2, up.output()
        assert up.output().splitlines()[-1] == f"specdec: port {port} is already in use"
        assert "[target]" not in up.output()


def test_up_with_a_model_that_does_not_load_says_why_and_leaves_no_process(tiny_pair):
    with run_specdec("up", "--target", "/nonexistent/model", "--draft", str(tiny_pair.draft_dir),
                     "--dtype", "float64", "--port", "0", "--no-http", "--threads", "1") as up:
        assert up.wait(300) == 2, up.output()
        assert up.output().splitlines()[-1].startswith(
            "specdec: the target service did not start (exited with 2): specdec: '/nonexistent/model' "
            "is not a model directory")
        assert "Traceback" not in up.output()
        assert not up.group_alive(), "a service outlived `specdec up`"
