"""The orchestrator's metrics and request traces, recorded beside the loop, not inside it.

Metrics (Prometheus, served on --metrics-port): the speculative-decoding counters and latency
histograms under vLLM's names with the `specdec:` prefix and vLLM's `model_name` label (the
target's model id), so a vLLM dashboard or alert reads them with the prefix changed, plus what is
specdec's own: draft and accepted tokens by the method that proposed them (`method`: model, ngram
or suffix), the K chosen each round, the RTT of each hop, re-prefills, rounds without a draft,
and `specdec_active_sessions{role="orchestrator"}`, the streams in flight that the
orchestrator's HPA scales on. deploy/README.md has the PromQL; deploy/grafana/ a dashboard.

Traces (OpenTelemetry, specdec/tracing.py): a `generate` span per request, inside it a `prefill`
span and one `round` span per round, and inside those the CLIENT span of each call to a replica
(Prefill, Propose, Verify), whose context the replica continues.

A request is recorded in two ways, so generation.py holds no recording code: RequestTelemetry is
the request's GenerationStats observer (each call's timing, each round's K and accepted count as
the stats take them) and wraps the stream of chunks (time to first token, inter-token latency,
end-to-end latency, the finish reason, the spans).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from orchestrator.generation import Chunk
from orchestrator.stats import GenerationStats
from specdec.protocol import CallTiming
from specdec.tracing import tracer

# vLLM's buckets, with finer steps below 10 ms for inter-token latency (a small target on a GPU).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 32, 64, 128, 256)
RTT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
               2.5, 5.0)
# Finish reasons: the loop's, then "abort" (the client went away) and "error" (the request failed).
FINISH_REASONS = ("length", "eos", "stop", "context", "abort", "error")
HOPS = ("draft", "target")
# The methods that propose drafts (orchestrator/local_draft.py): a draft model, or a lookup.
PROPOSAL_METHODS = ("model", "ngram", "suffix")


class Telemetry:
    """The orchestrator's metrics, in a registry of its own (served by specdec.metrics'
    serve_registry). bind() names the model once the target is known; until then requests are
    recorded under model_name="" ."""

    def __init__(self, replica_id: str | None = None) -> None:
        self.registry = registry = CollectorRegistry()
        self.replica_id = replica_id or socket.gethostname()
        model = ["model_name"]

        def counter(name: str, help_text: str, labels: list[str] = model) -> Counter:
            return Counter(name, help_text, labels, registry=registry)

        def histogram(name: str, help_text: str, buckets: tuple, labels: list[str] = model) -> Histogram:
            return Histogram(name, help_text, labels, buckets=buckets, registry=registry)

        # vLLM's speculative-decoding counters. A draft is a round with K > 0.
        self.num_drafts = counter("specdec:spec_decode_num_drafts", "Rounds that drafted tokens (K > 0)")
        self.num_draft_tokens = counter("specdec:spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.num_accepted_tokens = counter("specdec:spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted by the target")
        self.accepted_per_pos = counter(
            "specdec:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of a round (0: the first draft token)",
            [*model, "position"])
        self.draft_tokens_per_pos = counter(
            "specdec:spec_decode_num_draft_tokens_per_pos",
            "Draft tokens proposed at each position of a round (K varies by round: the denominator "
            "of acceptance by position)", [*model, "position"])
        self.draft_tokens_by_method = counter(
            "specdec:spec_decode_num_draft_tokens_by_method",
            "Draft tokens proposed, by the method that proposed them (model, ngram, suffix)",
            [*model, "method"])
        self.accepted_by_method = counter(
            "specdec:spec_decode_num_accepted_tokens_by_method",
            "Draft tokens accepted by the target, by the method that proposed them (model, ngram, "
            "suffix)", [*model, "method"])
        # vLLM's request metrics.
        self.time_to_first_token = histogram("specdec:time_to_first_token_seconds",
                                             "Seconds from a request's arrival to its first token",
                                             TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "specdec:inter_token_latency_seconds",
            "Seconds between successive chunks of a stream (one per round: a round commits 1 to K+1 "
            "tokens)", ITL_BUCKETS)
        self.time_per_output_token = histogram(
            "specdec:request_time_per_output_token_seconds",
            "Per request: seconds after the first token over the tokens after it", ITL_BUCKETS)
        self.e2e_request_latency = histogram("specdec:e2e_request_latency_seconds",
                                             "Seconds from a request's arrival to its last token", E2E_BUCKETS)
        self.prompt_tokens = counter("specdec:prompt_tokens", "Prompt tokens of requests")
        self.generation_tokens = counter("specdec:generation_tokens", "Tokens generated (committed)")
        self.request_success = counter(
            "specdec:request_success",
            "Requests ended, by finish reason (length, eos, stop, context; abort: the client went "
            "away; error: the request failed)", [*model, "finished_reason"])
        self.num_requests_running = Gauge("specdec:num_requests_running", "Requests in flight", model,
                                          registry=registry)
        # specdec's own.
        self.num_speculative_tokens = histogram("specdec:num_speculative_tokens",
                                                "K chosen for each round (0: the target alone)", K_BUCKETS)
        self.hop_rtt = histogram(
            "specdec:hop_rtt_seconds",
            "Per call to a replica: wall time less the replica's compute and queue time (network "
            "and RPC overhead), by hop", RTT_BUCKETS, [*model, "hop"])
        self.re_prefills = counter("specdec:re_prefills", "Target sessions rebuilt from the committed "
                                   "tokens after a lost replica or session")
        self.draft_unavailable_rounds = counter("specdec:draft_unavailable_rounds",
                                                "Rounds run at K = 0 because no draft held the session")
        # Pipelining (drafting ahead while the target verifies).
        self.pipelined_rounds = counter("specdec:pipelined_rounds",
                                        "Rounds whose draft call also drafted the next round ahead")
        self.pipeline_hits = counter("specdec:pipeline_hits",
                                     "Rounds whose proposal had been drafted ahead (no draft call waited for)")
        self.pipeline_misses = counter("specdec:pipeline_misses",
                                       "Rounds after a pipelined round whose outcome had no branch")
        self.branches_drafted = counter("specdec:branches_drafted", "Branches drafted ahead")
        # Streamed speculation (drafts offered to the target's Decode).
        self.offered_passes = counter("specdec:offered_passes",
                                      "Target passes of streamed requests that verified offered drafts")
        self.offered_drafts = counter("specdec:offered_drafts", "Offered drafts verified by the target")
        self.offered_accepted = counter("specdec:offered_accepted", "Offered drafts the target accepted")
        self.offered_branch_passes = counter("specdec:offered_branch_passes",
                                             "Target passes that verified the drafts of an offer's branch")
        # Lookups in the target's own Decode passes.
        self.decode_lookup_passes = counter("specdec:decode_lookup_passes",
                                            "Target Decode passes that verified tokens looked up in the session's own")
        self.decode_lookup_drafts = counter("specdec:decode_lookup_drafts",
                                            "Looked-up tokens verified in the target's Decode passes")
        self.decode_lookup_accepted = counter("specdec:decode_lookup_accepted",
                                              "Looked-up tokens the target accepted in its Decode passes")
        # The target's draft head in its own Decode passes.
        self.decode_head_passes = counter("specdec:decode_head_passes",
                                          "Target Decode passes that verified drafts of its draft head")
        self.decode_head_drafts = counter("specdec:decode_head_drafts",
                                          "Draft-head drafts verified in the target's Decode passes")
        self.decode_head_accepted = counter("specdec:decode_head_accepted",
                                            "Draft-head drafts the target accepted in its Decode passes")
        # The orchestrator HPA's Pods metric, under the model services' name and labels.
        self.active_sessions = Gauge("specdec_active_sessions", "Generate streams in flight",
                                     ["role", "replica_id"], registry=registry).labels(
                                         "orchestrator", self.replica_id)
        self.model_name = ""
        self._positions: dict[int, tuple[Counter, Counter]] = {}

    def bind(self, model_name: str) -> None:
        """Names the model and creates every series the dashboard reads, so that each exists
        (at 0) before the first request that would have made it."""
        self.model_name = model_name
        self._positions = {}
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        for hop in HOPS:
            self.hop_rtt.labels(model_name, hop)
        for method in PROPOSAL_METHODS:
            self.draft_tokens_by_method.labels(model_name, method)
            self.accepted_by_method.labels(model_name, method)
        for family in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                       self.time_to_first_token, self.inter_token_latency, self.time_per_output_token,
                       self.e2e_request_latency, self.prompt_tokens, self.generation_tokens,
                       self.num_requests_running, self.num_speculative_tokens, self.re_prefills,
                       self.draft_unavailable_rounds, self.pipelined_rounds, self.pipeline_hits,
                       self.pipeline_misses, self.branches_drafted, self.offered_passes,
                       self.offered_drafts, self.offered_accepted, self.offered_branch_passes,
                       self.decode_lookup_passes, self.decode_lookup_drafts, self.decode_lookup_accepted,
                       self.decode_head_passes, self.decode_head_drafts, self.decode_head_accepted):
            family.labels(model_name)
        self._position(0)

    def _position(self, position: int) -> tuple[Counter, Counter]:
        children = self._positions.get(position)
        if children is None:
            children = self._positions[position] = (
                self.draft_tokens_per_pos.labels(self.model_name, str(position)),
                self.accepted_per_pos.labels(self.model_name, str(position)))
        return children

    def request(self, prompt_tokens: int, arrived: float | None = None) -> RequestTelemetry:
        """The recorder of one request that arrived at `arrived` (time.perf_counter(); default now)."""
        return RequestTelemetry(self, prompt_tokens, arrived)


class RequestTelemetry:
    """One request's recorder: GenerationStats' observer, and the wrapper of its stream."""

    def __init__(self, telemetry: Telemetry, prompt_tokens: int, arrived: float | None = None) -> None:
        self.telemetry = telemetry
        self.model_name = telemetry.model_name
        self.prompt_tokens = prompt_tokens
        self.arrived = time.perf_counter() if arrived is None else arrived

    # -- GenerationStats' observer --------------------------------------------------------------

    def call(self, hop: str, timing: CallTiming) -> None:
        self.telemetry.hop_rtt.labels(self.model_name, hop).observe(timing.network_seconds)

    def round(self, num_speculative_tokens: int, num_accepted: int) -> None:
        t = self.telemetry
        model = self.model_name
        t.num_speculative_tokens.labels(model).observe(num_speculative_tokens)
        if num_speculative_tokens == 0:
            return
        t.num_drafts.labels(model).inc()
        t.num_draft_tokens.labels(model).inc(num_speculative_tokens)
        t.num_accepted_tokens.labels(model).inc(num_accepted)
        for position in range(num_speculative_tokens):
            drafted, accepted = t._position(position)
            drafted.inc()
            if position < num_accepted:
                accepted.inc()

    def method_round(self, method: str, num_speculative_tokens: int, num_accepted: int) -> None:
        t = self.telemetry
        t.draft_tokens_by_method.labels(self.model_name, method).inc(num_speculative_tokens)
        t.accepted_by_method.labels(self.model_name, method).inc(num_accepted)

    # -- the stream -----------------------------------------------------------------------------

    async def stream(self, chunks: AsyncIterator[Chunk], stats: GenerationStats) -> AsyncIterator[Chunk]:
        """Yields the loop's chunks, timing them, with the request's spans around the loop's work:
        `generate`, then `prefill` for the first chunk and `round` for each one after (one chunk
        per round)."""
        t, model = self.telemetry, self.model_name
        request_span = tracer().start_span("generate", attributes={
            "specdec.model_name": model, "specdec.prompt_tokens": self.prompt_tokens})
        request_context = trace.set_span_in_context(request_span)
        t.num_requests_running.labels(model).inc()
        t.active_sessions.inc()
        finish = "abort"
        first_token = last = None
        rounds = 0
        try:
            while True:
                name = "prefill" if first_token is None else "round"
                with tracer().start_as_current_span(name, context=request_context) as span:
                    chunk = await anext(chunks, None)
                    if chunk is None:  # the loop ends on a chunk with a finish reason; not this time
                        raise RuntimeError("the generation ended without a finish reason")
                    if stats.rounds > rounds:
                        rounds = stats.rounds
                        span.set_attributes({
                            "specdec.round": rounds,
                            "specdec.num_speculative_tokens": stats.num_speculative_tokens_per_round[-1],
                            "specdec.num_accepted": stats.num_accepted_per_round[-1]})
                now = time.perf_counter()
                if first_token is None:
                    first_token = now
                    t.time_to_first_token.labels(model).observe(now - self.arrived)
                else:
                    t.inter_token_latency.labels(model).observe(now - last)
                last = now
                if chunk.finish_reason is not None:
                    finish = chunk.finish_reason
                    yield chunk
                    return
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            finish = "abort"
            raise
        except Exception as error:
            finish = "error"
            request_span.record_exception(error)
            request_span.set_status(Status(StatusCode.ERROR, str(error)))
            raise
        finally:
            # The loop's cleanup (Releases sent in the background) belongs to the request's trace.
            with trace.use_span(request_span, end_on_exit=False):
                await chunks.aclose()
            # The span ends before the counters move: whoever sees the request counted finds its trace.
            request_span.set_attributes(_span_summary(stats, finish))
            request_span.end()
            self._finished(stats, finish, first_token, last)

    def _finished(self, stats: GenerationStats, finish: str, first_token: float | None,
                  last: float | None) -> None:
        t, model = self.telemetry, self.model_name
        t.num_requests_running.labels(model).dec()
        t.active_sessions.dec()
        t.request_success.labels(model, finish).inc()
        t.prompt_tokens.labels(model).inc(self.prompt_tokens)
        t.generation_tokens.labels(model).inc(stats.generated_tokens)
        t.re_prefills.labels(model).inc(stats.re_prefills)
        t.draft_unavailable_rounds.labels(model).inc(stats.draft_unavailable_rounds)
        t.pipelined_rounds.labels(model).inc(stats.pipelined_rounds)
        t.pipeline_hits.labels(model).inc(stats.pipeline_hits)
        t.pipeline_misses.labels(model).inc(stats.pipeline_misses)
        t.branches_drafted.labels(model).inc(stats.branches_drafted)
        t.offered_passes.labels(model).inc(stats.offered_passes)
        t.offered_drafts.labels(model).inc(stats.offered_drafts)
        t.offered_accepted.labels(model).inc(stats.offered_accepted)
        t.offered_branch_passes.labels(model).inc(stats.offered_branch_passes)
        t.decode_lookup_passes.labels(model).inc(stats.decode_lookup_passes)
        t.decode_lookup_drafts.labels(model).inc(stats.decode_lookup_drafts)
        t.decode_lookup_accepted.labels(model).inc(stats.decode_lookup_accepted)
        t.decode_head_passes.labels(model).inc(stats.decode_head_passes)
        t.decode_head_drafts.labels(model).inc(stats.decode_head_drafts)
        t.decode_head_accepted.labels(model).inc(stats.decode_head_accepted)
        if last is not None and finish not in ("abort", "error"):
            t.e2e_request_latency.labels(model).observe(last - self.arrived)
            if first_token is not None and stats.generated_tokens > 1:
                t.time_per_output_token.labels(model).observe(
                    (last - first_token) / (stats.generated_tokens - 1))


def _span_summary(stats: GenerationStats, finish: str) -> dict[str, str | int | float]:
    return {
        "specdec.finish_reason": finish,
        "specdec.generated_tokens": stats.generated_tokens,
        "specdec.rounds": stats.rounds,
        "specdec.drafted_tokens": stats.drafted_tokens,
        "specdec.accepted_tokens": stats.accepted_tokens,
        "specdec.mean_accepted_length": stats.mean_accepted_length,
        "specdec.re_prefills": stats.re_prefills,
        "specdec.pipeline_hits": stats.pipeline_hits,
        "specdec.pipeline_misses": stats.pipeline_misses,
        "specdec.target_replica": stats.target_replica,
        "specdec.draft_replica": stats.draft_replica,
    }
