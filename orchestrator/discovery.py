"""Where a pool's replicas are: the address forms of --draft / --target (DESIGN.md section 5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Endpoint:
    address: str  # host:port
    ready: bool = True  # False: serving but terminating; keeps its sessions, takes no new ones


class ReplicaSource(Protocol):
    description: str

    async def endpoints(self) -> list[Endpoint]:
        """The replicas as of now."""


@dataclass(frozen=True)
class StaticSource:
    """A fixed list: host:port,host:port."""

    addresses: tuple[str, ...]

    @property
    def description(self) -> str:
        return ",".join(self.addresses)

    async def endpoints(self) -> list[Endpoint]:
        return [Endpoint(address) for address in self.addresses]


def parse_static(spec: str) -> StaticSource:
    addresses = tuple(part.strip() for part in spec.split(",") if part.strip())
    if not addresses:
        raise ValueError(f"no addresses in {spec!r}")
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{address!r} is not host:port")
    return StaticSource(addresses)


def make_source(spec: str) -> ReplicaSource:
    """A source from an address form: host:port[,host:port...]."""
    if "://" in spec:
        raise ValueError(f"unsupported replica address form {spec!r}: use host:port[,host:port]")
    return parse_static(spec)
