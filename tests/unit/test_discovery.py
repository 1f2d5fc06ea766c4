"""Replica address forms (docs/architecture.md, "Pools and discovery"): parsing, errors, and the
pure parts of discovery."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.discovery import (
    DnsSource,
    Endpoint,
    KubernetesService,
    StaticSource,
    join_host_port,
    make_source,
    parse_kubernetes,
    split_host_port,
)


def test_static_list():
    source = make_source("10.0.0.1:50051, host-b:50052,[fd00::1]:50051")
    assert isinstance(source, StaticSource)
    assert source.addresses == ("10.0.0.1:50051", "host-b:50052", "[fd00::1]:50051")
    assert asyncio.run(source.endpoints()) == [Endpoint("10.0.0.1:50051"), Endpoint("host-b:50052"),
                                               Endpoint("[fd00::1]:50051")]
    assert source.description == "10.0.0.1:50051,host-b:50052,[fd00::1]:50051"


@pytest.mark.parametrize("spec", ["", " , ", "host", "host:", ":50051", "host:0", "host:65536", "host:http",
                                  "fd00::1:50051", "a b:1", "host:1,other"])
def test_static_list_errors(spec):
    with pytest.raises(ValueError):
        make_source(spec)


def test_dns_form():
    source = make_source("dns:///specdec-target.llm.svc.cluster.local:50051")
    assert isinstance(source, DnsSource)
    assert (source.host, source.port) == ("specdec-target.llm.svc.cluster.local", 50051)
    assert source.description == "dns:///specdec-target.llm.svc.cluster.local:50051"


@pytest.mark.parametrize("spec, message", [
    ("dns:///name", "host:port"),
    ("dns:///name:0", "host:port"),
    ("dns:///:50051", "host:port"),
    ("dns://8.8.8.8/name:50051", "not supported"),
    ("dns:name:50051", "dns:///name:port"),
])
def test_dns_form_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        make_source(spec)


def test_dns_source_resolves_on_every_call_and_formats_ipv6():
    answers = [["10.0.0.2", "10.0.0.1", "10.0.0.2"], ["10.0.0.3", "fd00::7"]]
    asked = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return answers[len(asked) - 1]

    source = DnsSource("pool.example", 7000, resolver=resolver)
    first = asyncio.run(source.endpoints())
    second = asyncio.run(source.endpoints())
    assert first == [Endpoint("10.0.0.1:7000"), Endpoint("10.0.0.2:7000")]
    assert second == [Endpoint("10.0.0.3:7000"), Endpoint("[fd00::7]:7000")]
    assert asked == [("pool.example", 7000)] * 2


def test_dns_source_with_no_addresses_fails_rather_than_emptying_the_pool():
    async def nothing(host: str, port: int) -> list[str]:
        return []

    with pytest.raises(LookupError):
        asyncio.run(DnsSource("gone.example", 1, resolver=nothing).endpoints())


def test_kubernetes_form():
    assert parse_kubernetes("k8s://llm/specdec-target:50051") == KubernetesService("llm", "specdec-target", 50051)
    named = parse_kubernetes("k8s://llm/specdec-draft:grpc")
    assert named.port == "grpc"
    assert named.label_selector == "kubernetes.io/service-name=specdec-draft"
    assert named.description == "k8s://llm/specdec-draft:grpc"


def test_make_source_builds_a_kubernetes_source_without_contacting_the_api():
    source = make_source("k8s://llm/specdec-target:50051")
    assert type(source).__name__ == "KubernetesSource"
    assert source.description == "k8s://llm/specdec-target:50051"


@pytest.mark.parametrize("spec, message", [
    ("k8s://specdec-target:50051", "k8s://namespace/service:port"),
    ("k8s://llm/specdec-target", "k8s://namespace/service:port"),
    ("k8s:///specdec-target:50051", "namespace"),
    ("k8s://llm/specdec-target:50051/x", "k8s://namespace/service:port"),
    ("k8s://LLM/specdec-target:50051", "DNS-1123"),
    ("k8s://llm/specdec_target:50051", "DNS-1123"),
    ("k8s://llm/specdec-target:0", "outside"),
    ("k8s://llm/specdec-target:70000", "outside"),
    ("k8s://llm/specdec-target:Grpc", "port name"),
    ("k8s://llm/specdec-target:a-very-long-port-name", "port name"),
])
def test_kubernetes_form_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        make_source(spec)


@pytest.mark.parametrize("spec", ["http://host:80", "unix:/tmp/socket", "ipv4:10.0.0.1:50051", "xds:///svc"])
def test_unknown_forms_name_the_supported_ones(spec):
    with pytest.raises(ValueError, match="dns:///name:port or k8s://namespace/service:port"):
        make_source(spec)


def test_host_port_helpers():
    assert split_host_port("[::1]:50051") == ("::1", 50051)
    assert split_host_port("name:1") == ("name", 1)
    assert join_host_port("::1", 5) == "[::1]:5"
    assert join_host_port("10.0.0.1", 5) == "10.0.0.1:5"


# -- EndpointSlice conditions (kubernetes' own models, no server) --------------------------------

def _slice(endpoints: list[dict], ports=({"name": "grpc", "port": 50051},)):
    from kubernetes.aio.client import V1EndpointSlice

    return V1EndpointSlice.from_dict({"addressType": "IPv4", "metadata": {"name": "s"},
                                      "endpoints": endpoints, "ports": list(ports)})


@pytest.mark.parametrize("conditions, takes_new_sessions", [
    ({"ready": True, "serving": True, "terminating": False}, True),
    ({}, True),  # nil ready means ready, nil terminating means not terminating
    ({"ready": False, "serving": True, "terminating": True}, False),  # draining
    ({"ready": True, "serving": True, "terminating": True}, False),  # publishNotReadyAddresses
    ({"ready": False, "serving": False, "terminating": False}, False),  # failing its readiness probe
])
def test_endpoint_conditions(conditions, takes_new_sessions):
    from orchestrator.k8s_discovery import slice_endpoints

    found = slice_endpoints(_slice([{"addresses": ["10.1.0.5"], "conditions": conditions}]), 50051)
    assert found == [Endpoint("10.1.0.5:50051", ready=takes_new_sessions)]


def test_named_port_and_ipv6_and_merge():
    from orchestrator.k8s_discovery import merge, slice_endpoints

    ports = ({"name": "health", "port": 50061}, {"name": "grpc", "port": 8000})
    endpoints = [{"addresses": ["fd00::5"], "conditions": {"ready": True}}]
    assert slice_endpoints(_slice(endpoints, ports), "grpc") == [Endpoint("[fd00::5]:8000")]
    assert slice_endpoints(_slice(endpoints, ports), "metrics") == []
    assert slice_endpoints(_slice(endpoints, ports), 50051) == [Endpoint("[fd00::5]:50051")]
    # The same address in two slices (the controller moving it): ready if either says so.
    merged = merge([[Endpoint("a:1", False), Endpoint("b:1")], [Endpoint("a:1", True)]])
    assert merged == [Endpoint("a:1", True), Endpoint("b:1", True)]
