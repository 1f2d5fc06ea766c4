"""Where a pool's replicas are: the address forms of --draft / --target (docs/architecture.md, "Pools and discovery").

- ``host:port[,host:port...]``: a fixed list.
- ``dns:///name:port``: every A / AAAA record of name (a headless Service), resolved again on every
  refresh of the pool.
- ``k8s://namespace/service:port``: the EndpointSlices of a Service, listed and then watched through
  the Kubernetes API (orchestrator/k8s_discovery.py); ready endpoints take new sessions, serving but
  terminating ones keep theirs and take none.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

FORMS = "host:port[,host:port...], dns:///name:port or k8s://namespace/service:port"
# A DNS-1123 label: Kubernetes namespaces and Service names.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# An IANA service name: a named Service port.
_PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?$")


@dataclass(frozen=True)
class Endpoint:
    address: str  # host:port ([v6]:port for an IPv6 literal)
    ready: bool = True  # False: serving but terminating; keeps its sessions, takes no new ones


class ReplicaSource(Protocol):
    @property
    def description(self) -> str:
        """The address form it came from, for logs and the Pools RPC."""

    async def endpoints(self) -> list[Endpoint]:
        """The replicas as of now; raises when discovery fails (the pool keeps what it knows)."""

    async def close(self) -> None:
        """Stops any background watch."""


@dataclass(frozen=True)
class StaticSource:
    """A fixed list: host:port,host:port."""

    addresses: tuple[str, ...]

    @property
    def description(self) -> str:
        return ",".join(self.addresses)

    async def endpoints(self) -> list[Endpoint]:
        return [Endpoint(address) for address in self.addresses]

    async def close(self) -> None:
        pass


# (host, port) -> the host's IP addresses, in any order.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """getaddrinfo in the loop's executor, so a slow DNS server never blocks the event loop."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True)
class DnsSource:
    """Every address of a name, e.g. a headless Service: one A / AAAA record per ready pod."""

    host: str
    port: int
    resolver: Resolver = field(default=system_resolver, compare=False, repr=False)

    @property
    def description(self) -> str:
        return f"dns:///{join_host_port(self.host, self.port)}"

    async def endpoints(self) -> list[Endpoint]:
        addresses = sorted(set(await self.resolver(self.host, self.port)))
        if not addresses:
            raise LookupError(f"{self.host} resolved to no addresses")
        return [Endpoint(join_host_port(address, self.port)) for address in addresses]

    async def close(self) -> None:
        pass


def join_host_port(host: str, port: int | str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """host:port or [v6]:port -> (host, port); ValueError when it is neither."""
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # a bare IPv6 literal: ambiguous without brackets
    if not host or any(c in host for c in "/,[] \t") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port (IPv6 as [address]:port)")
    return host, int(port)


def parse_static(spec: str) -> StaticSource:
    addresses = tuple(part.strip() for part in spec.split(",") if part.strip())
    if not addresses:
        raise ValueError(f"no addresses in {spec!r}")
    for address in addresses:
        split_host_port(address)
    return StaticSource(addresses)


def parse_dns(spec: str) -> DnsSource:
    """dns:///name:port (the gRPC name syntax, without a chosen DNS server)."""
    if not spec.startswith("dns:///"):
        raise ValueError(f"{spec!r}: a DNS address is dns:///name:port (choosing a DNS server as "
                         "dns://server/name:port is not supported)")
    host, port = split_host_port(spec[len("dns:///"):])
    return DnsSource(host, port)


@dataclass(frozen=True)
class KubernetesService:
    """k8s://namespace/service:port. port: the number each endpoint listens on (the container port),
    or the name of a Service port, resolved per EndpointSlice (when it differs from targetPort)."""

    namespace: str
    service: str
    port: int | str

    @property
    def description(self) -> str:
        return f"k8s://{self.namespace}/{self.service}:{self.port}"

    @property
    def label_selector(self) -> str:
        return f"kubernetes.io/service-name={self.service}"


def parse_kubernetes(spec: str) -> KubernetesService:
    rest = spec[len("k8s://"):]
    namespace, slash, service_port = rest.partition("/")
    service, colon, port = service_port.partition(":")
    if not slash or not colon or "/" in service_port:
        raise ValueError(f"{spec!r}: a Kubernetes address is k8s://namespace/service:port")
    for what, value in (("namespace", namespace), ("service", service)):
        if not _DNS_LABEL.match(value):
            raise ValueError(f"{spec!r}: {what} {value!r} is not a DNS-1123 label (lower case a-z, 0-9, '-')")
    if port.isdigit():
        if not 0 < int(port) < 65536:
            raise ValueError(f"{spec!r}: port {port} is outside 1..65535")
        return KubernetesService(namespace, service, int(port))
    if not _PORT_NAME.match(port):
        raise ValueError(f"{spec!r}: port {port!r} is neither a number nor a port name")
    return KubernetesService(namespace, service, port)


def make_source(spec: str) -> ReplicaSource:
    """A source from an address form (see the module docstring)."""
    spec = spec.strip()
    if spec.startswith("dns:"):
        return parse_dns(spec)
    if spec.startswith("k8s://"):
        from orchestrator.k8s_discovery import KubernetesSource  # the kubernetes client is heavy

        return KubernetesSource(parse_kubernetes(spec))
    if "://" in spec:
        raise ValueError(f"unsupported replica address form {spec!r}: use {FORMS}")
    try:
        return parse_static(spec)
    except ValueError as error:
        raise ValueError(f"{error}; replica addresses are {FORMS}") from None
