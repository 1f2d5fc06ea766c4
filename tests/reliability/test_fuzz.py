"""Bad input at scale: hypothesis sends every RPC of the three services random and
malformed messages (random field values, huge repeated fields, negative numbers, NaN and infinite
floats, out-of-vocabulary ids, unknown and mangled handles, unknown enum values, another method's
message, raw random bytes). Every call gets a defined status, never INTERNAL or UNKNOWN; the
processes keep their PIDs; a good request works afterwards; an oversize request is refused with
RESOURCE_EXHAUSTED.

Cluster: the plain cluster of conftest.py, started through the CLI."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.v1 import common_pb2, draft_pb2, target_pb2
from specdec.v1 import orchestrator_pb2 as pb

from tests.reliability.reliability_support import CALL_SECONDS, MAX_MESSAGE_BYTES, info
from tests.waiting import eventually

ALLOWED = {"OK", "INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND", "ABORTED", "FAILED_PRECONDITION",
           "RESOURCE_EXHAUSTED"}
EXAMPLES = 120  # per RPC, and as many raw-bytes calls
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                HealthCheck.function_scoped_fixture])
SENT: Counter = Counter()  # status name -> calls, for FIGURES.md
PREFILLED: set[tuple[str, str]] = set()  # (service role, session id) of every Prefill sent


@pytest.fixture(scope="module")
def cluster(plain_cluster):
    """Direct calls go to target replica B (the default budget), the draft and the orchestrator."""
    services = {"target": plain_cluster["target_b"], "draft": plain_cluster["draft"],
                "orchestrator": plain_cluster["orchestrator"]}
    return {**services, "pids": {role: s.pid for role, s in services.items()}}


@pytest.fixture(scope="module")
def channels(cluster):
    opened = {role: grpc.insecure_channel(cluster[role].address,
                                          options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
              for role in ("target", "draft", "orchestrator")}
    yield opened
    for channel in opened.values():
        channel.close()


@pytest.fixture(scope="module")
def live(cluster, channels):
    """A few real sessions, so that fuzzed handles sometimes name one."""
    handles = {"target": [], "draft": []}
    for i in range(3):
        for role, kind in (("target", target_pb2.TargetPrefillRequest), ("draft", draft_pb2.DraftPrefillRequest)):
            response = _call(channels[role], f"/specdec.v1.{ROLE_SERVICE[role]}/Prefill",
                             kind(session_id=f"live-{i}", token_ids=[5, 6, 7, 8, 9]))
            handles[role].append(response.handle)
    return handles


ROLE_SERVICE = {"target": "TargetService", "draft": "DraftService", "orchestrator": "Orchestrator"}
RESPONSES = {
    "/specdec.v1.TargetService/Prefill": target_pb2.TargetPrefillResponse,
    "/specdec.v1.TargetService/Verify": target_pb2.VerifyResponse,
    "/specdec.v1.TargetService/Release": common_pb2.ReleaseResponse,
    "/specdec.v1.TargetService/Info": common_pb2.InfoResponse,
    "/specdec.v1.TargetService/GetTokenizer": target_pb2.GetTokenizerResponse,
    "/specdec.v1.DraftService/Prefill": draft_pb2.DraftPrefillResponse,
    "/specdec.v1.DraftService/Propose": draft_pb2.ProposeResponse,
    "/specdec.v1.DraftService/Release": common_pb2.ReleaseResponse,
    "/specdec.v1.DraftService/Info": common_pb2.InfoResponse,
    "/specdec.v1.Orchestrator/Pools": pb.PoolsResponse,
}
REQUESTS = {
    "/specdec.v1.TargetService/Prefill": target_pb2.TargetPrefillRequest,
    "/specdec.v1.DraftService/Prefill": draft_pb2.DraftPrefillRequest,
}


def _call(channel: grpc.Channel, method: str, request) -> object:
    """A unary call with the real message types; raises grpc.RpcError."""
    response_type = RESPONSES[method]
    return channel.unary_unary(method, request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=response_type.FromString)(request, timeout=CALL_SECONDS)


def _record_prefill(method: str, payload: bytes) -> None:
    """Remembers the session a Prefill may have made (even from random bytes that happen to
    parse), so the test can release it."""
    if method in REQUESTS:
        try:
            session_id = REQUESTS[method].FromString(payload).session_id
        except Exception:  # not a message at all: it made nothing
            return
        PREFILLED.add(("target" if "Target" in method else "draft", session_id))


def _status_of_unary(channel: grpc.Channel, method: str, payload: bytes) -> str:
    _record_prefill(method, payload)
    try:
        channel.unary_unary(method)(payload, timeout=CALL_SECONDS)  # identity (de)serializers: bytes
        code = "OK"
        if method in REQUESTS:  # keep the session budget free for the next examples
            session_id = REQUESTS[method].FromString(payload).session_id
            if not session_id.startswith("live-"):
                channel.unary_unary(method.replace("/Prefill", "/Release"))(
                    common_pb2.ReleaseRequest(session_id=session_id).SerializeToString(), timeout=CALL_SECONDS)
    except grpc.RpcError as error:
        code = error.code().name
        assert code in ALLOWED, f"{method}: {code}: {error.details()}"
        assert error.details(), f"{method}: {code} without a message"
    SENT[code] += 1
    return code


def _status_of_generate(channel: grpc.Channel, payload: bytes) -> str:
    """Reads a few chunks of a Generate, then cancels it (an accepted request could otherwise run
    to the end of the context): what counts is the status the server gives, if it gives one."""
    call = channel.unary_stream("/specdec.v1.Orchestrator/Generate")(payload, timeout=CALL_SECONDS)
    try:
        for chunks, _ in enumerate(call, start=1):
            if chunks == 3:
                call.cancel()
                break
        code = "OK"
    except grpc.RpcError as error:
        code = error.code().name
        if code != "CANCELLED":  # ours
            assert code in ALLOWED, f"Generate: {code}: {error.details()}"
            assert error.details(), f"Generate: {code} without a message"
        else:
            code = "OK"
    SENT[code] += 1
    return code


# -- strategies ---------------------------------------------------------------------------------

int32 = st.integers(-(2**31), 2**31 - 1)
uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, 2**64 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
token_id = st.one_of(st.integers(-3, 60), int32)  # mostly near the vocabulary, sometimes anywhere
token_ids = st.one_of(
    st.lists(token_id, max_size=40),
    st.lists(st.integers(0, 48), min_size=1, max_size=300),  # valid ids, some long prompts
    st.builds(lambda n, t: [t] * n, st.integers(4000, 200_000), st.integers(0, 48)),  # huge
)
session_ids = st.one_of(st.text(max_size=20), st.text(min_size=120, max_size=300),
                        st.sampled_from(["live-0", "live-1", "live-2", ""]))
sampling = st.builds(
    lambda temperature, top_p, top_k, seed: common_pb2.SamplingParams(
        temperature=temperature, top_k=top_k,
        **({} if top_p is None else {"top_p": top_p}), **({} if seed is None else {"seed": seed})),
    st.one_of(floats, st.sampled_from([0.0, 0.7, 1.0, float("nan"), -1.0])),
    st.one_of(st.none(), floats), st.one_of(int32, st.integers(0, 60)), st.one_of(st.none(), uint64),
)
distribution = st.builds(
    lambda ids, probs: common_pb2.SparseDistribution(token_ids=ids, probs=probs),
    st.lists(token_id, max_size=80), st.lists(floats, max_size=80))


speculation = st.builds(
    pb.SpeculationConfig, mode=st.one_of(st.integers(0, 4), int32),
    num_speculative_tokens=st.one_of(st.integers(-2, 20), int32),
)


def handles(live: list[common_pb2.SessionHandle]):
    """A live handle, one of them mangled, or noise."""
    noise = st.builds(lambda sid, rid, length, epoch: common_pb2.SessionHandle(
        session_id=sid, replica_id=rid, committed_length=length, epoch=epoch),
        session_ids, st.sampled_from(["target-b", "target-a", "draft-0", "", "elsewhere"]), uint32, uint64)
    mangled = st.builds(lambda h, length, epoch: common_pb2.SessionHandle(
        session_id=h.session_id, replica_id=h.replica_id,
        committed_length=length if length is not None else h.committed_length,
        epoch=epoch if epoch is not None else h.epoch),
        st.sampled_from(live), st.one_of(st.none(), uint32), st.one_of(st.none(), st.integers(0, 10)))
    return st.one_of(st.sampled_from(live), mangled, noise)


def message_strategies(live) -> dict[str, st.SearchStrategy]:
    return {
        "/specdec.v1.TargetService/Prefill": st.builds(
            target_pb2.TargetPrefillRequest, session_id=session_ids, token_ids=token_ids,
            sampling=sampling, resume=st.booleans()),
        "/specdec.v1.TargetService/Verify": st.builds(
            target_pb2.VerifyRequest, handle=handles(live["target"]),
            draft_token_ids=st.one_of(st.lists(token_id, max_size=20), token_ids),
            draft_distributions=st.lists(distribution, max_size=20)),
        "/specdec.v1.TargetService/Release": st.builds(common_pb2.ReleaseRequest, session_id=session_ids),
        "/specdec.v1.DraftService/Prefill": st.builds(
            draft_pb2.DraftPrefillRequest, session_id=session_ids, token_ids=token_ids, sampling=sampling),
        "/specdec.v1.DraftService/Propose": st.builds(
            draft_pb2.ProposeRequest, handle=handles(live["draft"]),
            new_committed_token_ids=st.one_of(st.lists(token_id, max_size=20), token_ids),
            num_speculative_tokens=st.one_of(st.integers(-2, 20), int32)),
        "/specdec.v1.DraftService/Release": st.builds(common_pb2.ReleaseRequest, session_id=session_ids),
        "/specdec.v1.Orchestrator/Generate": st.builds(
            pb.GenerateRequest,
            prompt=st.one_of(st.just(""), st.text(max_size=200)),
            prompt_token_ids=st.one_of(st.just([]), token_ids),
            messages=st.lists(st.builds(pb.ChatMessage, role=st.text(max_size=10), content=st.text(max_size=50)),
                              max_size=3),
            max_new_tokens=st.one_of(int32, st.integers(-2, 8)),
            sampling=sampling,
            stop=st.lists(st.text(max_size=5), max_size=3),
            speculation=speculation),
    }


UNARY_WITHOUT_FIELDS = ["/specdec.v1.TargetService/Info", "/specdec.v1.TargetService/GetTokenizer",
                        "/specdec.v1.DraftService/Info", "/specdec.v1.Orchestrator/Pools"]
ALL_METHODS = [*REQUESTS, "/specdec.v1.TargetService/Verify", "/specdec.v1.TargetService/Release",
               "/specdec.v1.DraftService/Propose", "/specdec.v1.DraftService/Release",
               "/specdec.v1.Orchestrator/Generate", *UNARY_WITHOUT_FIELDS]


def _send(channels, method: str, payload: bytes) -> str:
    channel = channels[next(r for r, name in ROLE_SERVICE.items() if f"/specdec.v1.{name}/" in method)]
    if method.endswith("/Generate"):
        return _status_of_generate(channel, payload)
    return _status_of_unary(channel, method, payload)


# -- the properties -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", [m for m in ALL_METHODS if m not in UNARY_WITHOUT_FIELDS])
def test_random_messages_get_a_defined_status(cluster, channels, live, method):
    @FUZZ_SETTINGS
    @given(message=message_strategies(live)[method])
    def property_(message) -> None:
        _send(channels, method, message.SerializeToString())

    property_()


@pytest.mark.parametrize("method", ALL_METHODS)
def test_random_bytes_and_other_methods_messages_get_a_defined_status(cluster, channels, live, method):
    other_messages = st.one_of(*message_strategies(live).values()).map(lambda m: m.SerializeToString())

    @FUZZ_SETTINGS
    @given(payload=st.one_of(st.binary(max_size=2048), other_messages))
    def property_(payload: bytes) -> None:
        _send(channels, method, payload)

    property_()


def test_an_oversize_request_is_refused_with_resource_exhausted(cluster, channels):
    # Each id of 2**30 is a 5-byte varint: a message of about 1.25 x the limit.
    huge = target_pb2.TargetPrefillRequest(session_id="huge", token_ids=[2**30] * (MAX_MESSAGE_BYTES // 4))
    for role, method in (("target", "/specdec.v1.TargetService/Prefill"),
                         ("draft", "/specdec.v1.DraftService/Prefill"),
                         ("orchestrator", "/specdec.v1.Orchestrator/Generate")):
        payload = huge.SerializeToString()
        assert len(payload) > MAX_MESSAGE_BYTES
        with pytest.raises(grpc.RpcError) as raised:
            call = channels[role].unary_stream(method) if role == "orchestrator" else channels[role].unary_unary(method)
            response = call(payload, timeout=CALL_SECONDS)
            if role == "orchestrator":
                list(response)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, raised.value
        assert "larger than max" in raised.value.details(), raised.value.details()


@pytest.mark.parametrize("cap", [0, 2])
def test_adaptive_mode_with_a_small_k_cap(cluster, channels, cap):
    """Found by the fuzzing: this was UNKNOWN (a ValueError in OrchestratorService.policy)."""
    request = pb.GenerateRequest(prompt_token_ids=[5, 9, 13], max_new_tokens=4, speculation=pb.SpeculationConfig(
        mode=pb.SPECULATION_MODE_ADAPTIVE, num_speculative_tokens=cap))
    assert _send(channels, "/specdec.v1.Orchestrator/Generate", request.SerializeToString()) == "OK"


def test_the_processes_survive_and_answer_a_good_request(cluster, channels):
    for role, pid in cluster["pids"].items():
        assert cluster[role].alive and cluster[role].pid == pid, f"{role} restarted or died"
    # Release what the fuzzing made, then a good request works end to end.
    for role, session_id in sorted(PREFILLED):
        if session_id:
            _call(channels[role], f"/specdec.v1.{ROLE_SERVICE[role]}/Release",
                  common_pb2.ReleaseRequest(session_id=session_id))
    for i in range(3):
        for role in ("target", "draft"):
            _call(channels[role], f"/specdec.v1.{ROLE_SERVICE[role]}/Release",
                  common_pb2.ReleaseRequest(session_id=f"live-{i}"))
    request = pb.GenerateRequest(prompt_token_ids=[5, 9, 13, 2, 8], max_new_tokens=12,
                                 speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED,
                                                                  num_speculative_tokens=3))
    responses = list(channels["orchestrator"].unary_stream(
        "/specdec.v1.Orchestrator/Generate", request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=pb.GenerateResponse.FromString)(request, timeout=CALL_SECONDS))
    assert sum(len(r.token_ids) for r in responses) == 12 and responses[-1].stats.drafted_tokens > 0
    eventually(lambda: all(info(cluster[role]).live_sessions == 0 for role in ("target", "draft")),
               "no session left once the fuzzing's are released")
    print(f"\nfuzz: {sum(SENT.values())} calls, statuses {dict(SENT)}")
