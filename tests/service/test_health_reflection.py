"""Every server speaks grpc.health.v1 and server reflection; health is also served on a separate
plaintext port for the kubelet's probes (which cannot present the services' TLS certificates or
token), and a stopping server reports NOT_SERVING before it drains."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import target_service.server
from specdec.models import ModelConfig, load_model
from specdec.rpc.server import RunningServer, ServerConfig
from specdec.serving import ServiceConfig
from specdec.v1 import common_pb2, target_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT = 30
SERVICE_NAMES = {
    "target": "specdec.v1.TargetService",
    "draft": "specdec.v1.DraftService",
    "orchestrator": "specdec.v1.Orchestrator",
}


def _address(stack, role: str) -> str:
    return {"target": stack.target_address, "draft": stack.draft_address, "orchestrator": stack.address}[role]


def _check(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status


def _reflected_services(channel: grpc.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT))
    return {service.name for service in response.list_services_response.service}


@pytest.mark.parametrize("role", list(SERVICE_NAMES))
def test_health_is_serving(stack, role):
    with grpc.insecure_channel(_address(stack, role)) as channel:
        assert _check(channel, "") == SERVING
        assert _check(channel, SERVICE_NAMES[role]) == SERVING
        assert _check(channel, "liveness") == SERVING
        with pytest.raises(grpc.RpcError) as raised:
            _check(channel, "specdec.v1.NoSuchService")
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("role", list(SERVICE_NAMES))
def test_reflection_lists_the_service(stack, role):
    with grpc.insecure_channel(_address(stack, role)) as channel:
        services = _reflected_services(channel)
        assert SERVICE_NAMES[role] in services
        assert "grpc.health.v1.Health" in services
        # grpcurl needs more than the name: the file that defines the service.
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAMES[role])
        (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT))
        assert response.WhichOneof("message_response") == "file_descriptor_response"
        assert response.file_descriptor_response.file_descriptor_proto


def test_service_names_match_the_servers():
    import draft_service.server
    import orchestrator.server

    assert target_service.server.SERVICE_NAME == SERVICE_NAMES["target"]
    assert draft_service.server.SERVICE_NAME == SERVICE_NAMES["draft"]
    assert orchestrator.server.SERVICE_NAME == SERVICE_NAMES["orchestrator"]


@pytest.fixture(scope="module")
def loaded_target(tiny_pair):
    return load_model(ModelConfig(str(tiny_pair.target_dir), "target", dtype="float64"))


def test_separate_health_port_follows_the_server_life(loop_thread, loaded_target):
    """Health first (NOT_SERVING while the model loads), SERVING once the service port is up,
    NOT_SERVING as soon as stop() begins; liveness is SERVING throughout. The health port is
    plaintext and serves nothing but health."""
    name = SERVICE_NAMES["target"]
    config = ServerConfig(port=0, health_port=0, grace_seconds=5)
    running = RunningServer(config, [name])
    loop_thread.run(running.start_health())
    assert running.health_port
    health_channel = grpc.insecure_channel(f"127.0.0.1:{running.health_port}")
    watches = []
    service = None
    try:
        assert _check(health_channel, "") == NOT_SERVING
        assert _check(health_channel, name) == NOT_SERVING
        assert _check(health_channel, "liveness") == SERVING

        _, service = loop_thread.run(target_service.server.start(
            loaded_target, ServiceConfig(replica_id="health-target"), config, running=running))
        service_channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
        for channel in (health_channel, service_channel):
            assert _check(channel, "") == SERVING
            assert _check(channel, name) == SERVING
            assert _check(channel, "liveness") == SERVING
        with pytest.raises(grpc.RpcError) as raised:  # the model's API is not on the health port
            target_pb2_grpc.TargetServiceStub(health_channel).Info(common_pb2.InfoRequest(), timeout=TIMEOUT)
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED

        # Watch streams opened before the stop see the change while the server drains.
        for channel in (health_channel, service_channel):
            for service_name in ("", name):
                watch = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service=service_name), timeout=TIMEOUT)
                assert next(watch).status == SERVING
                watches.append(watch)
        stopping = asyncio.run_coroutine_threadsafe(running.stop(), loop_thread.loop)
        for watch in watches:
            assert next(watch).status == NOT_SERVING
        for watch in watches:
            watch.cancel()  # lets the drain end before its grace period
        stopping.result(TIMEOUT)
        service_channel.close()
    finally:
        for watch in watches:
            watch.cancel()
        health_channel.close()
        loop_thread.run(running.stop())
        if service is not None:
            service.worker.shutdown()


@pytest.mark.parametrize("role", list(SERVICE_NAMES))
def test_health_watch_on_the_service_port(stack, role):
    with grpc.insecure_channel(_address(stack, role)) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAMES[role]), timeout=TIMEOUT)
        try:
            assert next(watch).status == SERVING
        finally:
            watch.cancel()
