"""What a replica's Info says about where it computes, and when a draft shares its target's
hardware (specdec/compute_units.py)."""

from __future__ import annotations

import os

import pytest

from specdec import compute_units
from specdec.compute_units import shares_compute
from specdec.protocol import PROTOCOL_VERSION, ReplicaInfo
from specdec.rpc import convert


def test_one_machine_and_units_in_common_share_compute():
    assert shares_compute("boot:a", ["cpu:0", "cpu:1"], "boot:a", ["cpu:1", "cpu:2"])
    assert not shares_compute("boot:a", ["cpu:0"], "boot:a", ["cpu:1"])  # pinned apart
    assert not shares_compute("boot:a", ["cpu:0"], "boot:b", ["cpu:0"])  # two machines
    assert not shares_compute("boot:a", ["cuda:GPU-1"], "boot:a", ["cuda:GPU-2"])  # two GPUs of one machine
    assert shares_compute("boot:a", ["cuda:GPU-1"], "boot:a", ["cuda:GPU-1"])
    assert not shares_compute("", [], "", [])  # replicas that do not say: not shared


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity (Linux)")
def test_a_cpu_service_computes_on_the_cpus_it_may_run_on():
    assert compute_units.compute_units("cpu") == tuple(f"cpu:{cpu}" for cpu in sorted(os.sched_getaffinity(0)))
    assert compute_units.compute_units("mps") == ("mps",)


def test_the_machine_is_named_the_same_every_time():
    name = compute_units.host_id()
    assert name == compute_units.host_id() and name.split(":", 1)[0] in ("boot", "host") and name.split(":", 1)[1]


def test_info_carries_where_a_replica_computes():
    info = ReplicaInfo(PROTOCOL_VERSION, "draft", "m", 10, "", 64, 8, "float32", "cpu", 0, 0, 0.0, "r",
                       host_id="boot:x", compute_units=("cpu:0", "cpu:3"))
    assert convert.info_from_proto(convert.info_to_proto(info)) == info
