"""The orchestrator's request recorder on a scripted stream (no services): how a request ends
(finished, failed, abandoned by its client) lands in the metrics, rounds feed the
speculative-decoding counters, and the in-flight gauges always come back to zero."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from orchestrator.generation import Chunk
from orchestrator.stats import GenerationStats
from orchestrator.telemetry import Telemetry
from specdec.protocol import CallTiming

MODEL = "tiny"


def _value(telemetry: Telemetry, name: str, **labels: str) -> float:
    value = telemetry.registry.get_sample_value(name, {"model_name": MODEL, **labels})
    return 0.0 if value is None else value


def _stream(telemetry: Telemetry, rounds: list[tuple[int, int]], fail_after: int | None = None):
    """A request whose loop commits the first token, then runs `rounds` (K, accepted) and ends
    with "length" (or raises after `fail_after` chunks)."""
    recorder = telemetry.request(prompt_tokens=5)
    stats = GenerationStats(prompt_tokens=5, observer=recorder)

    async def loop():
        stats.add_target_call(CallTiming(0.010, compute_seconds=0.006, queue_seconds=0.001))
        stats.add_draft_call(CallTiming(0.004, compute_seconds=0.003))
        stats.generated_tokens = 1
        yield Chunk((7,), "a")
        for index, (k, accepted) in enumerate(rounds):
            if fail_after is not None and index + 1 >= fail_after:
                raise RuntimeError("the target is gone")
            if k:
                stats.add_draft_call(CallTiming(0.004, compute_seconds=0.003))
            stats.add_target_call(CallTiming(0.010, compute_seconds=0.006))
            stats.add_round(k, accepted, accepted + 1)
            stats.generated_tokens += accepted + 1
            last = index == len(rounds) - 1
            yield Chunk((7,) * (accepted + 1), "a", "length" if last else None, stats if last else None)

    return recorder.stream(loop(), stats), stats


async def _consume(stream, limit: int | None = None) -> list[Chunk]:
    chunks = []
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            chunks.append(chunk)
            if limit is not None and len(chunks) >= limit:
                break  # the client goes away
    return chunks


def test_a_finished_request_counts_its_rounds_tokens_and_latencies():
    telemetry = Telemetry(replica_id="orch-0")
    telemetry.bind(MODEL)
    stream, stats = _stream(telemetry, [(3, 2), (0, 0), (4, 4)])
    chunks = asyncio.run(_consume(stream))
    assert chunks[-1].finish_reason == "length"
    assert _value(telemetry, "specdec:request_success_total", finished_reason="length") == 1
    assert _value(telemetry, "specdec:generation_tokens_total") == stats.generated_tokens == 1 + 3 + 1 + 5
    assert _value(telemetry, "specdec:prompt_tokens_total") == 5
    assert _value(telemetry, "specdec:spec_decode_num_drafts_total") == 2  # the K = 0 round is no draft
    assert _value(telemetry, "specdec:spec_decode_num_draft_tokens_total") == 7
    assert _value(telemetry, "specdec:spec_decode_num_accepted_tokens_total") == 6
    per_position = [(_value(telemetry, "specdec:spec_decode_num_draft_tokens_per_pos_total", position=str(i)),
                     _value(telemetry, "specdec:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)))
                    for i in range(5)]
    assert per_position == [(2, 2), (2, 2), (2, 1), (1, 1), (0, 0)]
    assert _value(telemetry, "specdec:num_speculative_tokens_count") == 3
    assert _value(telemetry, "specdec:num_speculative_tokens_sum") == 7
    assert _value(telemetry, "specdec:time_to_first_token_seconds_count") == 1
    assert _value(telemetry, "specdec:inter_token_latency_seconds_count") == 3
    assert _value(telemetry, "specdec:e2e_request_latency_seconds_count") == 1
    assert _value(telemetry, "specdec:request_time_per_output_token_seconds_count") == 1
    # RTT per hop: wall less compute and queue, one observation per call.
    assert _value(telemetry, "specdec:hop_rtt_seconds_count", hop="target") == 4
    assert _value(telemetry, "specdec:hop_rtt_seconds_count", hop="draft") == 3
    assert _value(telemetry, "specdec:hop_rtt_seconds_sum", hop="target") == pytest.approx(0.003 + 3 * 0.004)
    assert _value(telemetry, "specdec:num_requests_running") == 0
    assert telemetry.registry.get_sample_value(
        "specdec_active_sessions", {"role": "orchestrator", "replica_id": "orch-0"}) == 0


def test_a_failed_request_counts_as_error_and_an_abandoned_one_as_abort():
    telemetry = Telemetry()
    telemetry.bind(MODEL)
    stream, _ = _stream(telemetry, [(3, 1), (3, 3)], fail_after=2)
    with pytest.raises(RuntimeError, match="the target is gone"):
        asyncio.run(_consume(stream))
    stream, _ = _stream(telemetry, [(3, 1), (3, 3), (3, 0)])
    assert len(asyncio.run(_consume(stream, limit=2))) == 2
    assert _value(telemetry, "specdec:request_success_total", finished_reason="error") == 1
    assert _value(telemetry, "specdec:request_success_total", finished_reason="abort") == 1
    assert _value(telemetry, "specdec:request_success_total", finished_reason="length") == 0
    # Neither has an end-to-end latency; both left the in-flight gauges.
    assert _value(telemetry, "specdec:e2e_request_latency_seconds_count") == 0
    assert _value(telemetry, "specdec:num_requests_running") == 0


def test_bind_creates_every_series_at_zero_before_any_request():
    telemetry = Telemetry()
    telemetry.bind(MODEL)
    for reason in ("length", "eos", "stop", "context", "abort", "error"):
        assert telemetry.registry.get_sample_value(
            "specdec:request_success_total", {"model_name": MODEL, "finished_reason": reason}) == 0
    for name in ("specdec:re_prefills_total", "specdec:spec_decode_num_drafts_total",
                 "specdec:time_to_first_token_seconds_count"):
        assert telemetry.registry.get_sample_value(name, {"model_name": MODEL}) == 0, name


def test_draft_and_accepted_tokens_are_counted_by_the_method_that_proposed_them():
    telemetry = Telemetry()
    telemetry.bind(MODEL)
    for method in ("model", "ngram", "suffix"):  # every method's series exists before a request
        assert _value(telemetry, "specdec:spec_decode_num_draft_tokens_by_method_total", method=method) == 0
        assert _value(telemetry, "specdec:spec_decode_num_accepted_tokens_by_method_total", method=method) == 0
    stats = GenerationStats(prompt_tokens=5, observer=telemetry.request(prompt_tokens=5))
    # A hybrid request: the suffix lookup's rounds where it matched well, the model's elsewhere.
    for method, k, accepted in (("suffix", 4, 4), ("model", 3, 1), ("suffix", 4, 2), ("model", 2, 0)):
        stats.add_round(k, accepted, accepted + 1)
        stats.add_method_round(method, k, accepted)
    drafted = {m: _value(telemetry, "specdec:spec_decode_num_draft_tokens_by_method_total", method=m)
               for m in ("model", "ngram", "suffix")}
    accepted = {m: _value(telemetry, "specdec:spec_decode_num_accepted_tokens_by_method_total", method=m)
                for m in ("model", "ngram", "suffix")}
    assert drafted == {"model": 5, "ngram": 0, "suffix": 8}
    assert accepted == {"model": 1, "ngram": 0, "suffix": 6}
    assert {m: n for m, n in drafted.items() if n} == stats.drafted_by_method
    assert {m: n for m, n in accepted.items() if n} == stats.accepted_by_method
    # The totals over methods are vLLM's counters.
    assert sum(drafted.values()) == _value(telemetry, "specdec:spec_decode_num_draft_tokens_total")
    assert sum(accepted.values()) == _value(telemetry, "specdec:spec_decode_num_accepted_tokens_total")
