"""Where services compute, through real processes: a service started with `--cpus` reports this
machine and exactly those CPUs in its Info, and an orchestrator whose draft and target are pinned
to different CPUs of one machine (the closest one machine gets to a draft on its own) runs
pipelining auto, where with both on the same CPUs it holds it off (tests/service/
test_pipelined_generate.py, on one process's CPUs)."""

from __future__ import annotations

import os

import grpc
import pytest

from specdec import compute_units
from specdec.v1 import common_pb2, draft_pb2_grpc
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec_cli.processes import start_service
from specdec_cli.stack import stop_services
from tests.stack import generate

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs CPU affinity (Linux) and two CPUs")


@pytest.fixture(scope="module")
def pinned_services(tiny_pair):
    """Target on one CPU, draft on another, each with one torch thread; an orchestrator that
    pipelines adaptive requests under auto."""
    target_cpu, draft_cpu = sorted(os.sched_getaffinity(0))[:2]
    started = []
    try:
        for role, model, cpu in (("target", tiny_pair.target_dir, target_cpu), ("draft", tiny_pair.draft_dir, draft_cpu)):
            started.append(start_service(role, ["--model", str(model), "--dtype", "float64", "--port", "0",
                                                "--threads", "1", "--cpus", str(cpu)], timeout=300))
        target, draft = started
        started.append(start_service("orchestrator", [
            "--target", target.address, "--draft", draft.address, "--port", "0", "--speculation", "adaptive",
            "--pipeline", "auto"], timeout=300))
        yield {s.role: s for s in started}, (target_cpu, draft_cpu)
    finally:
        stop_services(started)
    for service in started:
        assert service.process.returncode == 0, service.output()


def test_a_pinned_service_reports_this_machine_and_its_cpus(pinned_services):
    services, (_, draft_cpu) = pinned_services
    with grpc.insecure_channel(services["draft"].address) as channel:
        info = draft_pb2_grpc.DraftServiceStub(channel).Info(common_pb2.InfoRequest(), timeout=30)
    assert info.host_id == compute_units.host_id() and info.host_id
    assert list(info.compute_units) == [f"cpu:{draft_cpu}"]


def test_auto_pipelines_where_draft_and_target_have_cpus_of_their_own(pinned_services):
    services, _ = pinned_services
    request = pb.GenerateRequest(prompt_token_ids=[5, 9, 14, 3, 22], max_new_tokens=24)
    _, _, last = generate(services["orchestrator"].address, request)
    estimates = dict(last.stats.controller_estimates)
    assert "draft_shares_compute" not in estimates, estimates
    assert "auto_streamed" in estimates, estimates  # auto chose rounds or streaming for it
    log = services["orchestrator"].output()
    assert "computes on hardware of its own" in log, log[-2000:]
    with grpc.insecure_channel(services["orchestrator"].address) as channel:
        response = orchestrator_pb2_grpc.OrchestratorStub(channel).Pools(pb.PoolsRequest(), timeout=30)
    assert not response.draft_shares_compute and {pool.role for pool in response.pools} == {"draft", "target"}
