"""`specdec serve ... --cpus`: a real draft service process started with `--cpus CPU` runs every one
of its threads (gRPC, the model thread, torch's) on that CPU only, and serves; a CPU this machine
does not give the process is refused in one line that names the CPUs available, before any model
is loaded; so is a --pass-lock file the process cannot open."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.cpu_affinity import format_cpu_list
from specdec_cli.processes import start_service
from tests.process_groups import run_specdec

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity (Linux)")


def _thread_masks(pid: int) -> dict[int, set[int]]:
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_a_draft_service_started_with_cpus_runs_on_that_cpu_only(tiny_pair):
    cpu = min(os.sched_getaffinity(0))
    service = start_service("draft", ["--model", str(tiny_pair.draft_dir), "--dtype", "float64",
                                      "--port", "0", "--cpus", str(cpu)], timeout=300)
    try:
        pid = service.process.pid
        assert os.sched_getaffinity(pid) == {cpu}
        with grpc.insecure_channel(service.address) as channel:  # it serves, pinned
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        masks = _thread_masks(pid)
        assert len(masks) > 1 and all(mask == {cpu} for mask in masks.values()), masks
    finally:
        service.stop()


def test_cpus_this_process_may_not_use_are_refused_before_the_model_loads(tmp_path: Path):
    available = os.sched_getaffinity(0)
    missing = max(available) + 1000
    # No model at this path: the CPU list is checked first, so the error is about the CPUs.
    with run_specdec("serve", "draft", "--model", str(tmp_path / "no-model"), "--port", "0",
                     "--cpus", f"{missing}") as service:
        assert service.wait(120) == 2, service.output()
    last = service.output().strip().splitlines()[-1]
    assert last == (f"specdec: --cpus: CPU {missing} not available to this process; "
                    f"available: {format_cpu_list(available)}"), service.output()
    assert "Traceback" not in service.output()


def test_a_malformed_cpu_list_is_a_usage_error(tmp_path: Path):
    with run_specdec("serve", "orchestrator", "--target", "127.0.0.1:1", "--draft", "127.0.0.1:1",
                     "--port", "0", "--cpus", "1-0") as service:
        assert service.wait(120) == 2, service.output()
    assert service.output().strip().splitlines()[-1] == "specdec: --cpus '1-0': the range '1-0' runs backwards"


def test_a_pass_lock_that_cannot_be_opened_is_refused_before_the_model_loads(tmp_path: Path):
    lock = tmp_path / "no-such-directory" / "passes.lock"
    # No model at this path either: the lock is checked first, so the error is about the lock.
    with run_specdec("serve", "target", "--model", str(tmp_path / "no-model"), "--port", "0",
                     "--pass-lock", str(lock)) as service:
        assert service.wait(120) == 2, service.output()
    assert service.output().strip().splitlines()[-1] == f"specdec: --pass-lock {lock}: No such file or directory"
    assert "Traceback" not in service.output()
