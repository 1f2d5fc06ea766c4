"""Where a service computes, as its Info reports it: the machine and the compute units its model
runs on. An orchestrator compares a draft replica's with its target replica's: a draft that
shares the target's hardware takes every pass it computes from the target, so drafting ahead
while the target verifies, or beside its Decode, cannot pay there (pipelining auto holds off).

The machine is named by its kernel's boot id, which every process and container on one booted
machine share and no two machines do (a container's /etc/machine-id is often the image's); where
there is none, by the host name. A CPU service's units are the CPUs its process may run on (its
affinity: `--cpus`, a cpuset or a container's pinned CPUs narrow it), a GPU service's the GPU's
UUID (its index where the UUID is not known). Two replicas share compute when they are on one
machine and their units meet.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

from specdec import cpu_affinity

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_id() -> str:
    try:
        boot_id = BOOT_ID.read_text().strip()
    except OSError:
        boot_id = ""
    return f"boot:{boot_id}" if boot_id else f"host:{socket.gethostname()}"


def compute_units(device: str) -> tuple[str, ...]:
    """The units a model on `device` ("cpu", "cuda", "cuda:1", ...) computes on."""
    kind, _, index = device.partition(":")
    if kind == "cpu":
        if not cpu_affinity.supported():
            return ("cpu",)  # no affinity to read: all of the machine's
        return tuple(f"cpu:{cpu}" for cpu in sorted(cpu_affinity.available_cpus()))
    if kind == "cuda":
        return (f"cuda:{_gpu_uuid(int(index or 0))}",)
    return (device,)


def _gpu_uuid(index: int) -> str:
    import torch

    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else str(index)


def shares_compute(host_a: str, units_a: Sequence[str], host_b: str, units_b: Sequence[str]) -> bool:
    """Whether two replicas compute on the same hardware: one machine, units that meet. Unknown
    (an older replica reports neither) is not shared."""
    return bool(host_a) and host_a == host_b and not set(units_a).isdisjoint(units_b)
