"""The orchestrator's client boundary: a replica's status codes become domain errors (checked
against a real gRPC server on loopback that answers with each code), the shared plain types hold
their one vocabulary and compatibility check, and the routing side of the orchestrator imports no
torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from orchestrator.clients import RpcTimeouts, TargetClient, open_channel
from specdec.errors import (
    IncompatibleModels,
    InvalidInput,
    OutOfRange,
    Refused,
    ReplicaError,
    ReplicaLost,
    SessionLost,
)
from specdec.protocol import PROTOCOL_VERSION, Handle, Proposal, ReplicaInfo, check_compatible, check_token_ids
from specdec.v1 import target_pb2_grpc

STATUS_AND_KIND = [
    (grpc.StatusCode.NOT_FOUND, SessionLost),
    (grpc.StatusCode.ABORTED, SessionLost),
    (grpc.StatusCode.UNAVAILABLE, ReplicaLost),
    (grpc.StatusCode.DEADLINE_EXCEEDED, ReplicaLost),
    (grpc.StatusCode.INTERNAL, ReplicaLost),
    (grpc.StatusCode.UNKNOWN, ReplicaLost),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, Refused),
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidInput),
    (grpc.StatusCode.OUT_OF_RANGE, OutOfRange),
    (grpc.StatusCode.FAILED_PRECONDITION, ReplicaError),
    (grpc.StatusCode.PERMISSION_DENIED, ReplicaError),
]


class _AnswersWithStatus(target_pb2_grpc.TargetServiceServicer):
    """A target that fails every Verify with the status code named by the handle's session id."""

    async def Verify(self, request, context):
        await context.abort(grpc.StatusCode[request.handle.session_id], "as asked")


async def _kinds_of_failure() -> dict[grpc.StatusCode, Exception]:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    target_pb2_grpc.add_TargetServiceServicer_to_server(_AnswersWithStatus(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    client = TargetClient(address, open_channel(address, None, 1 << 20), RpcTimeouts())
    raised: dict[grpc.StatusCode, Exception] = {}
    try:
        for code, _ in STATUS_AND_KIND:
            try:
                await client.verify(Handle(code.name, "r", 3, 1), Proposal(token_ids=()))
            except Exception as error:  # noqa: BLE001 - what was raised is the point
                raised[code] = error
    finally:
        await client.channel.close()
        await server.stop(None)
    return raised


def test_a_replicas_status_codes_become_domain_errors_naming_the_replica():
    raised = asyncio.run(_kinds_of_failure())
    for code, kind in STATUS_AND_KIND:
        error = raised[code]
        assert type(error) is kind, (code, error)
        assert not isinstance(error, grpc.RpcError)
        assert "127.0.0.1:" in str(error) and "as asked" in str(error)


def _info(**changes) -> ReplicaInfo:
    fields = dict(protocol_version=PROTOCOL_VERSION, role="target", model_id="m", vocab_size=100,
                  tokenizer_hash="abc", max_context=64, max_num_speculative_tokens=8, dtype="float32",
                  device="cpu", live_sessions=0, cached_tokens=0, load=0.0, replica_id="r")
    return ReplicaInfo(**{**fields, **changes})


def test_check_compatible_refuses_another_protocol_vocabulary_or_tokenizer():
    target = _info()
    check_compatible(target, _info(role="draft", model_id="d"))
    check_compatible(target, _info(role="draft", tokenizer_hash=""))  # no hash: nothing to compare
    with pytest.raises(IncompatibleModels, match="vocabulary of 99 tokens"):
        check_compatible(target, _info(role="draft", vocab_size=99))
    with pytest.raises(IncompatibleModels, match="different tokenizer"):
        check_compatible(target, _info(role="draft", tokenizer_hash="abd"))
    with pytest.raises(IncompatibleModels, match="specdec.v2"):
        check_compatible(target, _info(protocol_version="specdec.v2"))


def test_check_token_ids_names_the_first_id_outside_the_vocabulary():
    check_token_ids([0, 5, 99], 100, "prompt")
    with pytest.raises(OutOfRange, match=r"prompt: token id 100 is outside the vocabulary \[0, 100\)"):
        check_token_ids([3, 100, -1], 100, "prompt")
    with pytest.raises(OutOfRange, match="token id -1"):
        check_token_ids([-1], 100, "prompt")


ROUTING_MODULES = (
    "specdec.protocol", "specdec.rpc.convert", "specdec.rpc.errors", "orchestrator.clients",
    "orchestrator.pool", "orchestrator.recovery", "orchestrator.generation", "orchestrator.k_policy",
    "orchestrator.k_controller", "orchestrator.stats", "specdec.lookup", "orchestrator.local_draft",
)


def test_the_routing_side_of_the_orchestrator_imports_no_torch():
    code = (f"import sys\nfor name in {ROUTING_MODULES!r}:\n    __import__(name)\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
