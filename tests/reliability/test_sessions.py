"""Sessions and memory, with real processes started through the CLI: cancelled requests
leave no cache and no memory behind, and admission control refuses new sessions past a budget
while existing ones go on and the orchestrator tries another replica.

Cluster: the plain cluster of conftest.py (target replicas A with a small budget and B, a draft,
an orchestrator; TTL an hour, so expiry cannot hide a leak)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter

import grpc
import pytest

from specdec.v1 import common_pb2, draft_pb2, target_pb2
from specdec.v1 import orchestrator_pb2 as pb

from tests.reliability.reliability_support import (
    A_MAX_CACHED_TOKENS, A_MAX_SESSIONS, CALL_SECONDS, Service, info, model_stub,
    orchestrator_stub, rss_bytes, sessions_and_tokens,
)
from tests.waiting import eventually

PROMPT_TOKENS = 1000  # every cancelled session holds at least this many tokens on both sides
CANCELLED_REQUESTS = 1000
WARMUP_REQUESTS = 60
CONCURRENT_STREAMS = 24
STREAM_SECONDS = 600  # a stream's deadline: only a hang comes near it, even with 24 at once
SPECULATION = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=2)
PIPELINED = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=2,
                                 pipeline=pb.PIPELINE_MODE_ON)
ADAPTIVE = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_ADAPTIVE)
RSS_TOLERANCE = 0.10


@pytest.fixture(scope="module")
def cluster(plain_cluster):
    return plain_cluster


def model_services(cluster) -> list[Service]:
    return [cluster["target_a"], cluster["target_b"], cluster["draft"]]


def wait_for_no_sessions(cluster) -> list[tuple[int, int]]:
    """Polls every model service until it reports zero live sessions and zero cached tokens."""
    services = model_services(cluster)
    eventually(lambda: all(counts == (0, 0) for counts in sessions_and_tokens(services)),
               "every service reports 0 live sessions and 0 cached tokens")
    return sessions_and_tokens(services)


# -- cancellation -------------------------------------------------------------------------------


async def _cancel_one(address: str, channel: grpc.aio.Channel, rng: random.Random,
                      speculation: pb.SpeculationConfig = SPECULATION) -> str:
    """One Generate with a 1,000-token prompt, cancelled at a random point: before any answer
    (in prefill or the first rounds), after a random number of streamed chunks, or by dropping the
    connection. Returns the call's final status as the client saw it."""
    prompt = [rng.randrange(3, 40) for _ in range(PROMPT_TOKENS)]
    request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=1500, speculation=speculation)
    how = rng.choice(("at once", "after chunks", "disconnect"))
    own = grpc.aio.insecure_channel(address) if how == "disconnect" else None
    call = orchestrator_stub(own or channel).Generate(request, timeout=STREAM_SECONDS)
    try:
        if how == "at once":
            await asyncio.sleep(rng.uniform(0, 0.03))
            call.cancel()
        else:
            chunks = rng.randrange(1, 24)  # up to past an adaptive stretch's probe, sent 4 tokens before its end
            async for _ in call:
                chunks -= 1
                if chunks == 0:
                    break
            if own is not None:
                await own.close()  # the client goes away: every call on it is cancelled
            else:
                call.cancel()
        return (await call.code()).name
    finally:
        if own is not None:
            await own.close()


async def _cancel_many(address: str, count: int, seed: int,
                       speculation: pb.SpeculationConfig = SPECULATION) -> Counter:
    """Runs requests, CONCURRENT_STREAMS at a time, until `count` of them ended CANCELLED."""
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    channels = [grpc.aio.insecure_channel(address) for _ in range(4)]

    async def worker(index: int) -> None:
        while outcomes["CANCELLED"] < count:
            outcomes[await _cancel_one(address, channels[index % len(channels)], rng, speculation)] += 1

    try:
        await asyncio.gather(*(worker(i) for i in range(CONCURRENT_STREAMS)))
    finally:
        for channel in channels:
            await channel.close()
    return outcomes


def _rss_of(services: list[Service]) -> dict[str, int]:
    """Median of a few samples per process, in bytes."""
    samples: dict[str, list[int]] = {s.address: [] for s in services}
    for _ in range(5):
        for service in services:
            samples[service.address].append(rss_bytes(service.pid))
        time.sleep(0.2)
    return {address: int(statistics.median(values)) for address, values in samples.items()}


@pytest.mark.parametrize("speculation", [SPECULATION, PIPELINED, ADAPTIVE], ids=["plain", "pipelined", "adaptive"])
def test_cancelled_requests_leave_no_session_and_no_cached_token(cluster, speculation):
    """The quick version: a hundred cancellations, counters only. Pipelined, a cancel also lands
    while the draft drafts ahead (its branch caches go with the session); adaptive (greedy), while
    a stretch of K = 0 rounds streams with a probe beside it on the draft."""
    outcomes = asyncio.run(_cancel_many(cluster["orchestrator"].address, 100, seed=1, speculation=speculation))
    assert set(outcomes) <= {"CANCELLED", "OK"} and outcomes["CANCELLED"] >= 100, outcomes
    wait_for_no_sessions(cluster)


@pytest.mark.slow
def test_a_thousand_cancelled_requests_leave_no_cache_and_no_memory(cluster):
    address = cluster["orchestrator"].address
    watched = [*model_services(cluster), cluster["orchestrator"]]

    warmup = asyncio.run(_cancel_many(address, WARMUP_REQUESTS, seed=2))
    assert warmup["CANCELLED"] >= WARMUP_REQUESTS, warmup
    wait_for_no_sessions(cluster)
    baseline = _rss_of(watched)

    started = time.monotonic()
    outcomes = asyncio.run(_cancel_many(address, CANCELLED_REQUESTS, seed=3))
    # Only cancellations, and the few streams that ended first (the target sampled EOS).
    assert set(outcomes) <= {"CANCELLED", "OK"}, outcomes
    assert outcomes["CANCELLED"] >= CANCELLED_REQUESTS

    left = wait_for_no_sessions(cluster)
    after = _rss_of(watched)
    growth = {f"{s.role} {s.replica_id or s.address}": after[s.address] / baseline[s.address] - 1
              for s in watched}
    print(f"\ncancellation: {dict(outcomes)} in {time.monotonic() - started:.0f} s; "
          f"(live sessions, cached tokens) left {left}; RSS vs baseline "
          + ", ".join(f"{name} {g:+.1%} (of {baseline[s.address] / 2**20:.0f} MiB)"
                      for (name, g), s in zip(growth.items(), watched)))
    for name, service in zip(growth, watched[:-1]):  # the model services
        assert growth[name] <= RSS_TOLERANCE, (name, growth)
    assert all(s.alive for s in watched)


# -- admission ----------------------------------------------------------------------------------


def _prefill(service: Service, session_id: str, tokens: int) -> object:
    prompt = [(i * 7) % 37 + 3 for i in range(tokens)]
    with grpc.insecure_channel(service.address) as channel:
        stub = model_stub(service, channel)
        kind = target_pb2.TargetPrefillRequest if service.role == "target" else draft_pb2.DraftPrefillRequest
        return stub.Prefill(kind(session_id=session_id, token_ids=prompt), timeout=CALL_SECONDS)


def _release(service: Service, session_ids) -> None:
    with grpc.insecure_channel(service.address) as channel:
        stub = model_stub(service, channel)
        for session_id in session_ids:
            stub.Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=CALL_SECONDS)


def _refusal(service: Service, session_id: str, tokens: int) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        _prefill(service, session_id, tokens)
    return raised.value


def _generate(cluster, **fields) -> pb.GenerateResponse:
    request = pb.GenerateRequest(prompt_token_ids=[5, 9, 13, 2, 8], max_new_tokens=12, **fields)
    with grpc.insecure_channel(cluster["orchestrator"].address) as channel:
        last = None
        for last in orchestrator_stub(channel).Generate(request, timeout=CALL_SECONDS):
            pass
    assert last is not None and last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    return last


def test_session_budget_refuses_new_sessions_keeps_old_ones_and_the_orchestrator_moves_on(cluster):
    a, b = cluster["target_a"], cluster["target_b"]
    wait_for_no_sessions(cluster)
    held_a = [f"held-a-{i}" for i in range(A_MAX_SESSIONS)]
    held_b = [f"held-b-{i}" for i in range(A_MAX_SESSIONS + 4)]  # B has more: A looks less loaded
    handles = {sid: _prefill(a, sid, 8).handle for sid in held_a}
    for sid in held_b:
        _prefill(b, sid, 8)
    try:
        # Past A's budget a new session is refused, with the reason.
        error = _refusal(a, "one-too-many", 8)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert "session budget" in error.details() and str(A_MAX_SESSIONS) in error.details()

        # The orchestrator's pool sees A with fewer sessions than B, tries A, is refused, and
        # places the session on B; the client sees no error.
        eventually(lambda: info(a).live_sessions == A_MAX_SESSIONS and info(b).live_sessions == len(held_b),
                   "the sessions are in place")
        time.sleep(1.5)  # three pool refreshes, so the orchestrator's view of the loads is current
        last = _generate(cluster, speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_OFF))
        assert last.stats.target_replica == "target-b", last.stats
        refusal = f"target replica {a.address} refused session"
        eventually(lambda: any(refusal in line and "RESOURCE_EXHAUSTED" in line
                               for line in cluster["orchestrator"].output().splitlines()),
                   "the orchestrator logs A's refusal before it moves to B")

        # Sessions admitted before are unaffected: each can still verify.
        with grpc.insecure_channel(a.address) as channel:
            stub = model_stub(a, channel)
            for sid in held_a[:4]:
                verify = stub.Verify(target_pb2.VerifyRequest(handle=handles[sid], draft_token_ids=[3, 4]),
                                     timeout=CALL_SECONDS)
                assert verify.handle.committed_length > handles[sid].committed_length

        # With every target replica full the orchestrator gives up with RESOURCE_EXHAUSTED and says why.
        b_budget = info(b).max_sessions
        extra_b = [f"fill-b-{i}" for i in range(b_budget - len(held_b))]
        for sid in extra_b:
            _prefill(b, sid, 4)
        with pytest.raises(grpc.RpcError) as raised:
            _generate(cluster)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, raised.value
        assert "budget" in raised.value.details(), raised.value.details()
        _release(b, extra_b)
    finally:
        _release(a, held_a)
        _release(b, held_b)
    wait_for_no_sessions(cluster)


def test_cached_token_budget_refuses_a_session_that_does_not_fit(cluster):
    a = cluster["target_a"]
    wait_for_no_sessions(cluster)
    held = [f"tokens-{i}" for i in range(A_MAX_CACHED_TOKENS // 4000 - 1)]
    for sid in held:
        _prefill(a, sid, 4000)
    try:
        held_tokens = info(a).cached_tokens
        assert held_tokens == len(held) * 4000
        error = _refusal(a, "does-not-fit", A_MAX_CACHED_TOKENS - held_tokens + 1)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert "cached-token budget" in error.details(), error.details()
        assert info(a).live_sessions == len(held)  # nothing admitted, nothing evicted
        _prefill(a, "fits", A_MAX_CACHED_TOKENS - held_tokens)  # what still fits is admitted
        held.append("fits")
    finally:
        _release(a, held)
    wait_for_no_sessions(cluster)


def test_a_full_draft_turns_rounds_to_k0_without_an_error(cluster):
    draft = cluster["draft"]
    wait_for_no_sessions(cluster)
    budget = info(draft).max_sessions
    held = [f"draft-full-{i}" for i in range(budget)]
    for sid in held:
        _prefill(draft, sid, 4)
    try:
        assert _refusal(draft, "one-too-many", 4).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        last = _generate(cluster, speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED,
                                                                   num_speculative_tokens=3))
        assert last.stats.drafted_tokens == 0 and last.stats.draft_unavailable_rounds == last.stats.rounds > 0
    finally:
        _release(draft, held)
    last = _generate(cluster, speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED,
                                                               num_speculative_tokens=3))
    assert last.stats.drafted_tokens > 0 and last.stats.draft_unavailable_rounds == 0
    wait_for_no_sessions(cluster)
