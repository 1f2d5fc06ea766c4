"""Faults, injected into real processes started through the CLI: kill -9, SIGSTOP (a stall),
SIGTERM (a drain) on each kind of service, and idle sessions reclaimed by TTL. What the
orchestrator must do about each is in docs/architecture.md, "Recovery".

Cluster: target replicas A and B, one draft, one orchestrator, float64 (so that a re-prefill in one
pass and incremental decoding agree to the last bit and greedy output can be compared exactly).
The orchestrator's step deadline is short, so a stalled replica is found out quickly; the TTL is
short, so orphaned sessions are reclaimed while the test watches."""

from __future__ import annotations

import signal
from collections import Counter

import grpc
import pytest
import torch

from specdec.v1 import common_pb2, draft_pb2, target_pb2
from specdec.v1 import orchestrator_pb2 as pb

from tests.reliability.reliability_support import (
    CALL_SECONDS, Service, health_status, info, model_stub, orchestrator_stub,
    sessions_and_tokens, two_target_cluster,
)
from tests.waiting import eventually

TTL_SECONDS = 8
STEP_TIMEOUT_SECONDS = 3  # a Verify or Propose stalled this long is a failed replica
IN_FLIGHT_CALLS = 16  # long prefills queued when SIGTERM lands
MAX_QUEUE = 64  # forward passes a service queues; Info's load is the queued share of it
STREAM_SECONDS = 900  # a stream's deadline: only a hang comes near it
PROMPT = [7, 3, 19, 22, 5, 14, 30, 11]
FIXED_K3 = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=3)
OFF = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_OFF)
FIXED_K3_PIPELINED = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=3,
                                          pipeline=pb.PIPELINE_MODE_ON)


def survived(fault: str) -> None:
    print(f"\nfault injected and survived: {fault}")


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    common = ["--dtype", "float64", "--session-ttl", str(TTL_SECONDS), "--grace-seconds", "60",
              "--health-port", "0", "--max-queue", str(MAX_QUEUE)]
    orchestrator = ["--health-port", "0", "--grace-seconds", "60", "--step-timeout", str(STEP_TIMEOUT_SECONDS),
                    "--control-timeout", "5", "--prefill-timeout", "60", "--pool-refresh-seconds", "0.5"]
    # Faults kill and pause processes on purpose: exit codes say nothing here.
    with two_target_cluster(tiny_pair, common, orchestrator, require_clean_exit=False) as services:
        yield services


def model_services(cluster) -> list[Service]:
    return [cluster["target_a"], cluster["target_b"], cluster["draft"]]


def pools(cluster) -> dict[str, bool]:
    """address -> healthy, as the orchestrator sees its replicas."""
    with grpc.insecure_channel(cluster["orchestrator"].address) as channel:
        response = orchestrator_stub(channel).Pools(pb.PoolsRequest(), timeout=CALL_SECONDS)
    return {r.address: r.healthy for p in response.pools for r in p.replicas}


def settled(cluster, all_up: bool = True) -> None:
    """Every process up (or those still up), no session left anywhere, every replica healthy in
    the orchestrator."""
    services = model_services(cluster)
    if all_up:
        assert all(s.alive for s in services)
    services = [s for s in services if s.alive]
    assert cluster["orchestrator"].alive
    eventually(lambda: all(c == (0, 0) for c in sessions_and_tokens(services)), "no sessions left")
    eventually(lambda: all(pools(cluster).get(s.address) for s in services), "all replicas healthy")


def reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return output[0, len(prompt):].tolist()


class Stream:
    """A Generate read chunk by chunk in the test's own thread, so faults land mid-stream."""

    def __init__(self, cluster, max_new_tokens: int, speculation=FIXED_K3) -> None:
        self._channel = grpc.insecure_channel(cluster["orchestrator"].address)
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=max_new_tokens,
                                     speculation=speculation)
        self._responses = orchestrator_stub(self._channel).Generate(request, timeout=STREAM_SECONDS)
        self.token_ids: list[int] = []
        self.chunks = 0
        self.last: pb.GenerateResponse | None = None

    def read(self, chunks: int | None = None) -> Stream:
        """Reads `chunks` more chunks (all that are left if None)."""
        for response in self._responses:
            self.token_ids.extend(response.token_ids)
            self.chunks += 1
            self.last = response
            if chunks is not None:
                chunks -= 1
                if chunks == 0:
                    break
        return self

    def finish(self) -> pb.GenerationStats:
        self.read()
        self._channel.close()
        assert self.last is not None and self.last.finish_reason == pb.FINISH_REASON_LENGTH, self.last
        return self.last.stats


def holder(cluster) -> tuple[Service, Service]:
    """(the target replica that holds the one running session, the other one)."""
    a, b = cluster["target_a"], cluster["target_b"]
    counts = eventually(lambda: (lambda c: c if sorted(c) == [0, 1] else None)(
        [info(a).live_sessions, info(b).live_sessions]), "one target holds the session")
    return (a, b) if counts[0] == 1 else (b, a)


# -- TTL ----------------------------------------------------------------------------------------


@pytest.mark.slow  # waits out the session TTL
def test_idle_sessions_expire_after_the_ttl(cluster):
    settled(cluster)
    target, draft = cluster["target_a"], cluster["draft"]
    with grpc.insecure_channel(target.address) as t_channel, grpc.insecure_channel(draft.address) as d_channel:
        target_stub, draft_stub = model_stub(target, t_channel), model_stub(draft, d_channel)
        handle = target_stub.Prefill(target_pb2.TargetPrefillRequest(session_id="idle-t", token_ids=PROMPT),
                                     timeout=CALL_SECONDS).handle
        draft_handle = draft_stub.Prefill(draft_pb2.DraftPrefillRequest(session_id="idle-d", token_ids=PROMPT),
                                          timeout=CALL_SECONDS).handle
        assert info(target).live_sessions == 1 and info(draft).live_sessions == 1
        eventually(lambda: info(target).live_sessions == 0 and info(draft).live_sessions == 0,
                   f"idle sessions dropped after the {TTL_SECONDS} s TTL")
        with pytest.raises(grpc.RpcError) as raised:
            target_stub.Verify(target_pb2.VerifyRequest(handle=handle), timeout=CALL_SECONDS)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as raised:
            draft_stub.Propose(draft_pb2.ProposeRequest(handle=draft_handle, num_speculative_tokens=2),
                               timeout=CALL_SECONDS)
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    eventually(lambda: "expired after" in target.output(), "the expiry is logged")


# -- a stalled target, a killed target ----------------------------------------------------------


# A killed replica is restarted before the next test (4-6 s), so only the stall is in the quick set.
@pytest.mark.parametrize("fault", ["stall", "stall-pipelined", "stall-off", pytest.param("kill", marks=pytest.mark.slow)])
def test_target_lost_mid_stream_the_stream_moves_and_output_is_unchanged(cluster, reference_target, fault):
    """Pipelined: the draft is drafting ahead while the stalled Verify waits for its deadline.
    Off: the target stalls inside a Decode stream, whose step deadline holds for each token."""
    settled(cluster)
    max_new_tokens = 120
    expected = reference(reference_target, PROMPT, max_new_tokens)
    speculation = {"stall-pipelined": FIXED_K3_PIPELINED, "stall-off": OFF}.get(fault, FIXED_K3)
    stream = Stream(cluster, max_new_tokens, speculation).read(8)
    lost, other = holder(cluster)
    stall = fault.startswith("stall")
    if stall:
        lost.pause()  # it keeps its connections open and answers nothing: only a deadline tells
    else:
        lost.kill()
    try:
        stats = stream.finish()
    finally:
        if stall:
            lost.resume()
    assert stream.token_ids == expected
    assert stats.re_prefills >= 1, stats
    if fault == "stall-pipelined":
        assert stats.pipelined_rounds > 0 and stats.pipeline_hits > 0, stats
    if fault == "stall-off":
        assert stats.decode_calls >= 2 and stats.drafted_tokens == 0, stats  # one before the stall, one after
    assert stats.target_replica == other.replica_id, stats
    survived(f"target {'stalled (SIGSTOP)' if stall else 'killed (kill -9)'} mid-stream")
    if fault == "kill":
        lost.start()  # back on the same port
    # The session left behind on the lost replica is released or reclaimed by its TTL.
    settled(cluster)


# -- a killed draft -----------------------------------------------------------------------------


@pytest.mark.slow  # ~10 s: kills and restarts the draft
@pytest.mark.parametrize("speculation", [FIXED_K3, FIXED_K3_PIPELINED], ids=["plain", "pipelined"])
def test_draft_killed_mid_stream_goes_on_at_k0_and_speculation_resumes_when_it_is_back(cluster, speculation):
    settled(cluster)
    draft, orchestrator = cluster["draft"], cluster["orchestrator"]
    stream = Stream(cluster, max_new_tokens=1500, speculation=speculation).read(10)
    draft.kill()
    stream.read(20)  # rounds at K = 0, without an error
    # The orchestrator is paused while the draft restarts, so that the stream is still running
    # when it is back however slow this machine is; the client only waits meanwhile.
    orchestrator.pause()
    try:
        draft.start()  # on the same port
    finally:
        orchestrator.resume()
    stats = stream.finish()
    k_per_round = list(stats.num_speculative_tokens_per_round)
    assert stats.draft_unavailable_rounds > 0, stats
    first_k0 = k_per_round.index(0)
    assert any(k > 0 for k in k_per_round[:first_k0]), "speculation before the kill"
    back = [i for i, k in enumerate(k_per_round) if i > first_k0 and k > 0]
    assert back, f"no drafted round after the draft came back: {k_per_round}"
    assert all(k == 0 for k in k_per_round[first_k0:back[0]])
    assert sum(k_per_round[back[0]:]) > 0 and stats.drafted_tokens > sum(k_per_round[:first_k0])
    survived("draft killed (kill -9) mid-stream, restarted")
    settled(cluster)


# -- a killed orchestrator ----------------------------------------------------------------------


@pytest.mark.slow  # ~12 s: restarts the orchestrator and waits out the session TTL
def test_killed_orchestrator_gives_clients_unavailable_and_ttl_reclaims_its_sessions(cluster):
    settled(cluster)
    orchestrator = cluster["orchestrator"]
    stream = Stream(cluster, max_new_tokens=3000).read(5)
    orchestrator.kill()
    with pytest.raises(grpc.RpcError) as raised:
        stream.read()
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value  # not a hang (DEADLINE)
    with grpc.insecure_channel(orchestrator.address) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            list(orchestrator_stub(channel).Generate(pb.GenerateRequest(prompt_token_ids=PROMPT),
                                                    timeout=CALL_SECONDS))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    # Its sessions are orphaned on the services, then reclaimed by their TTL.
    orphans = sum(sessions for sessions, _ in sessions_and_tokens(model_services(cluster)))
    assert orphans >= 2, "the killed orchestrator's target and draft sessions"
    eventually(lambda: all(c == (0, 0) for c in sessions_and_tokens(model_services(cluster))),
               "orphaned sessions reclaimed by the TTL")
    orchestrator.start()  # restarted on the same port, it serves again
    survived("orchestrator killed (kill -9) mid-stream, restarted")
    settled(cluster)
    assert len(Stream(cluster, max_new_tokens=10).read().token_ids) == 10


# -- SIGTERM: drain, then exit ------------------------------------------------------------------


def _prefill_async(service: Service, session_id: str, tokens: int):
    channel = grpc.insecure_channel(service.address)
    stub = model_stub(service, channel)
    prompt = [(i * 7) % 37 + 3 for i in range(tokens)]
    kind = target_pb2.TargetPrefillRequest if service.role == "target" else draft_pb2.DraftPrefillRequest
    return channel, stub.Prefill.future(kind(session_id=session_id, token_ids=prompt), timeout=CALL_SECONDS)


@pytest.mark.parametrize("role", ["target_a", "draft"])
def test_sigterm_drains_a_model_service_then_it_exits(cluster, role):
    """NOT_SERVING on health at once; the calls in flight and the sessions it holds are served to
    the end; new sessions (and Info, which routers read) are refused; the orchestrator places new
    sessions elsewhere; then the process exits 0."""
    settled(cluster, all_up=False)
    service = cluster[role]
    health_address = f"127.0.0.1:{service.health_port}"
    assert health_status(health_address) == "SERVING"
    with grpc.insecure_channel(service.address) as channel:
        stub = model_stub(service, channel)
        kind = target_pb2.TargetPrefillRequest if service.role == "target" else draft_pb2.DraftPrefillRequest
        handle = stub.Prefill(kind(session_id="kept", token_ids=PROMPT), timeout=CALL_SECONDS).handle
        # Long prefills queue up on the model worker: calls in flight when the signal lands.
        calls = [_prefill_async(service, f"in-flight-{i}", 4000) for i in range(IN_FLIGHT_CALLS)]
        in_flight = eventually(lambda: round(info(service).load * MAX_QUEUE) or None,
                               "prefills queued on the worker")
        service.signal(signal.SIGTERM)

        eventually(lambda: health_status(health_address) == "NOT_SERVING", "NOT_SERVING on the health port")
        assert service.alive
        assert health_status(service.address) == "NOT_SERVING"  # the service port still answers
        with pytest.raises(grpc.RpcError) as raised:
            stub.Prefill(kind(session_id="new", token_ids=PROMPT), timeout=CALL_SECONDS)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in raised.value.details()
        with pytest.raises(grpc.RpcError) as raised:
            stub.Info(common_pb2.InfoRequest(), timeout=CALL_SECONDS)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE

        # A session it holds is still served.
        if service.role == "target":
            step = stub.Verify(target_pb2.VerifyRequest(handle=handle, draft_token_ids=[3]), timeout=CALL_SECONDS)
            assert step.handle.committed_length > handle.committed_length
        else:
            step = stub.Propose(draft_pb2.ProposeRequest(handle=handle, num_speculative_tokens=2),
                                timeout=CALL_SECONDS)
            assert len(step.draft_token_ids) == 2

        # The orchestrator stops routing new sessions to it.
        with grpc.insecure_channel(cluster["orchestrator"].address) as o_channel:
            last = None
            for last in orchestrator_stub(o_channel).Generate(
                    pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=10, speculation=FIXED_K3),
                    timeout=CALL_SECONDS):
                pass
        if service.role == "target":
            assert last.stats.target_replica == "target-b", last.stats
        else:  # the only draft: the request goes on at K = 0
            assert last.stats.drafted_tokens == 0 and last.stats.draft_unavailable_rounds > 0, last.stats
        eventually(lambda: pools(cluster).get(service.address) is False, "the pool marks it unusable")

        # Every call that was in flight finished; then the sessions are released and it exits.
        outcomes, held = Counter(), ["kept"]
        for index, (call_channel, call) in enumerate(calls):
            try:
                call.result()
                outcomes["OK"] += 1
                held.append(f"in-flight-{index}")
            except grpc.RpcError as error:
                outcomes[error.code().name] += 1
            call_channel.close()
        assert set(outcomes) <= {"OK", "UNAVAILABLE"}, outcomes  # refused only if it came late
        assert outcomes["OK"] >= in_flight, (outcomes, in_flight)
        assert service.alive, "it waits for the sessions it holds"
        # Release only the sessions it holds: once the last one goes it stops, so a Release of a
        # session that a late refusal never made would race the shutdown (CANCELLED, seen once).
        for session_id in held:
            assert service.alive, f"it exited before {session_id} was released"
            stub.Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=CALL_SECONDS)
    assert service.wait() == 0, service.output()[-3000:]
    survived(f"SIGTERM on a {service.role}, drained")


def test_sigterm_on_the_orchestrator_finishes_the_stream_in_flight_then_exits(cluster):
    orchestrator = cluster["orchestrator"]
    health_address = f"127.0.0.1:{orchestrator.health_port}"
    stream = Stream(cluster, max_new_tokens=1000, speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_OFF))
    stream.read(3)
    orchestrator.signal(signal.SIGTERM)
    eventually(lambda: health_status(health_address) == "NOT_SERVING", "NOT_SERVING on the health port")
    with grpc.insecure_channel(orchestrator.address) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            list(orchestrator_stub(channel).Generate(pb.GenerateRequest(prompt_token_ids=PROMPT),
                                                    timeout=CALL_SECONDS))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    stats = stream.finish()
    assert stream.chunks >= 3 and stats.generated_tokens == 1000
    assert orchestrator.wait() == 0, orchestrator.output()[-3000:]
    survived("SIGTERM on the orchestrator, drained")
