"""specdec pools against a small server that answers the Pools RPC (the real orchestrator's answer
is checked in test_replicas.py)."""

from __future__ import annotations

import json

import pytest

from specdec.rpc.auth import TOKEN_ENV, BearerTokenInterceptor
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from specdec_cli.main import main

RESPONSE = pb.PoolsResponse(pools=[
    pb.PoolStatus(role="draft", source="dns:///draft.llm.svc.cluster.local:50052", replicas=[
        pb.ReplicaStatus(address="10.0.1.4:50052", replica_id="draft-7f9c", healthy=True, accepting=True,
                         active_sessions=3, load=0.25, model_id="/models/draft"),
    ]),
    pb.PoolStatus(role="target", source="k8s://llm/specdec-target:50051", replicas=[
        pb.ReplicaStatus(address="10.0.2.8:50051", replica_id="target-a1", healthy=True, accepting=True,
                         active_sessions=5, load=0.5, model_id="/models/target"),
        pb.ReplicaStatus(address="10.0.2.9:50051", replica_id="target-b2", healthy=True, accepting=False,
                         active_sessions=1, load=0.0, model_id="/models/target"),
    ]),
])


class CannedPools(orchestrator_pb2_grpc.OrchestratorServicer):
    async def Pools(self, request, context):
        return RESPONSE


@pytest.fixture
def orchestrator(loop_thread):
    async def start():
        import grpc

        server = grpc.aio.server(interceptors=[BearerTokenInterceptor("s3cret")])
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(CannedPools(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"

    server, address = loop_thread.run(start())
    yield address
    loop_thread.run(server.stop(0))


def test_table_and_json(orchestrator, tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert main(["pools", "--orchestrator", orchestrator, "--auth-token-file", str(token)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "draft pool (dns:///draft.llm.svc.cluster.local:50052): 1 of 1 replicas take new sessions"
    assert lines[1] == "target pool (k8s://llm/specdec-target:50051): 1 of 2 replicas take new sessions"
    assert lines[3].split() == ["ROLE", "ADDRESS", "REPLICA", "HEALTHY", "ACCEPTING", "SESSIONS", "LOAD", "MODEL"]
    assert lines[6].split() == ["target", "10.0.2.9:50051", "target-b2", "yes", "no", "1", "0.00", "/models/target"]

    assert main(["pools", "--orchestrator", orchestrator, "--auth-token-file", str(token), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["pools"][1]["replicas"][1] == {
        "address": "10.0.2.9:50051", "replica_id": "target-b2", "healthy": True, "accepting": False,
        "active_sessions": 1, "load": 0.0, "model_id": "/models/target",
    }


def test_token_from_the_environment_and_a_refusal_without_it(orchestrator, monkeypatch, capsys):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert main(["pools", "--orchestrator", orchestrator]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    assert main(["pools", "--orchestrator", orchestrator, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["pools"]) == 2


def test_an_unreachable_orchestrator(capsys):
    import socket

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"
    assert main(["pools", "--orchestrator", address, "--timeout", "2"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_a_draft_on_the_target_hardware_is_said_in_the_table():
    from specdec_cli.pools_cmd import pools_table

    shared = pb.PoolsResponse()
    shared.CopyFrom(RESPONSE)
    shared.draft_shares_compute = True
    lines = pools_table(shared).splitlines()
    assert lines[2] == ("the draft replicas compute on the target replicas' hardware: pipelining auto holds off, "
                        "and under load speculation is tested seldom")
    assert "hardware" not in pools_table(RESPONSE)


def test_a_draft_sharing_the_target_hardware_without_turns_is_warned_about_in_the_table():
    from specdec_cli.pools_cmd import pools_table

    untimed = pb.PoolsResponse()
    untimed.CopyFrom(RESPONSE)
    untimed.draft_shares_compute = True
    untimed.shared_compute_without_turns = True
    lines = pools_table(untimed).splitlines()
    assert lines[3] == ("a draft replica computes on a target replica's hardware and their passes do not take "
                        "turns: start both with the same --pass-lock FILE, or give the draft hardware of its own")
    untimed.shared_compute_without_turns = False
    assert "--pass-lock" not in pools_table(untimed)
