"""Metrics and traces of the three services after a real request.

One in-process stack (tiny float64 models) with tracing on (the OpenTelemetry SDK's in-memory
exporter) and the three real /metrics endpoints: one Generate must leave one trace that spans the
orchestrator, the draft and the target, the trace context crossing each hop in gRPC metadata;
and every metric the Grafana dashboard (deploy/grafana/) queries must be among what the three
endpoints serve.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from specdec.metrics import serve_registry, start_metrics_server
from specdec.tracing import _wanted_exporters
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

from tests import stack as stack_module

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "specdec-dashboard.json"
PROMPT = [4, 5, 6, 7, 8]
MAX_NEW_TOKENS = 16
NUM_SPECULATIVE_TOKENS = 3


@pytest.fixture(scope="module")
def spans():
    """Spans of this process from now on, in memory. The SDK's provider can be set once per
    process: reuse one a previous test set."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    yield exporter
    processor.shutdown()  # stops recording into this exporter; later tests pay nothing for it


@pytest.fixture(scope="module")
def traced_stack(spans, loop_thread, tiny_pair):
    """A stack started with tracing on (the interceptors are installed at start), and the three
    /metrics endpoints: {"target": port, "draft": port, "orchestrator": port}."""
    running = loop_thread.run(stack_module.start_stack(tiny_pair.target_dir, tiny_pair.draft_dir))
    ports = {
        "target": start_metrics_server(0, "127.0.0.1", running.target.info, running.target.worker),
        "draft": start_metrics_server(0, "127.0.0.1", running.draft.info, running.draft.worker),
        "orchestrator": serve_registry(0, "127.0.0.1", running.orchestrator.telemetry.registry),
    }
    yield running, ports
    loop_thread.run(running.stop())


@pytest.fixture(scope="module")
def one_request(traced_stack, spans):
    """One Generate under a client span whose context goes out in the call's metadata; returns
    (the client span's trace id, the stream's last response)."""
    running, _ = traced_stack
    spans.clear()
    request = pb.GenerateRequest(
        prompt_token_ids=PROMPT, max_new_tokens=MAX_NEW_TOKENS,
        speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED,
                                         num_speculative_tokens=NUM_SPECULATIVE_TOKENS))
    with trace.get_tracer("test").start_as_current_span("client") as client_span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        with grpc.insecure_channel(running.address) as channel:
            responses = list(orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(
                request, metadata=tuple(carrier.items()), timeout=120))
    last = responses[-1]
    assert last.stats.rounds >= 2 and last.stats.drafted_tokens > 0, last.stats
    return client_span.get_span_context().trace_id, last


def _finished_spans(spans, at_least: int) -> list:
    """The exporter's spans once the Releases sent after the stream (in the background) ended on
    both sides: a replica's SERVER span ends before the orchestrator's CLIENT span sees the reply."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        finished = list(spans.get_finished_spans())
        if all(sum(s.name.endswith("/Release") and s.kind == kind for s in finished) >= at_least
               for kind in (SpanKind.SERVER, SpanKind.CLIENT)):
            return finished
        time.sleep(0.05)
    return list(spans.get_finished_spans())


def test_one_request_is_one_trace_across_the_three_services(one_request, spans):
    trace_id, last = one_request
    finished = _finished_spans(spans, at_least=2)
    by_id = {s.context.span_id: s for s in finished}
    ours = [s for s in finished if s.context.trace_id == trace_id]

    def named(name: str, kind: SpanKind | None = None) -> list:
        return [s for s in ours if s.name == name and (kind is None or s.kind == kind)]

    def parent(span):
        return by_id.get(span.parent.span_id) if span.parent is not None else None

    # The orchestrator continues the caller's trace: its server span's parent came in metadata.
    (server,) = named("specdec.v1.Orchestrator/Generate", SpanKind.SERVER)
    assert server.parent.is_remote and parent(server).name == "client"
    (request,) = named("generate")
    assert parent(request) is server
    assert request.attributes["specdec.finish_reason"] in ("length", "eos")
    assert request.attributes["specdec.generated_tokens"] == last.stats.generated_tokens
    (prefill,) = named("prefill")
    rounds = named("round")
    assert parent(prefill) is request and len(rounds) == last.stats.rounds
    assert all(parent(r) is request for r in rounds)
    assert [r.attributes["specdec.num_speculative_tokens"] for r in sorted(
        rounds, key=lambda r: r.attributes["specdec.round"])] == list(last.stats.num_speculative_tokens_per_round)

    # Each hop: a CLIENT span in the orchestrator, under the prefill or a round, and the
    # replica's SERVER span under it, its parent a remote context (it crossed in metadata).
    for service, method, under in (
        ("TargetService", "Prefill", "prefill"), ("DraftService", "Prefill", "prefill"),
        ("DraftService", "Propose", "round"), ("TargetService", "Verify", "round"),
    ):
        name = f"specdec.v1.{service}/{method}"
        clients = named(name, SpanKind.CLIENT)
        servers = named(name, SpanKind.SERVER)
        assert clients and len(servers) == len(clients), name
        assert {parent(c).name for c in clients} == {under}, name
        for span in servers:
            assert span.parent.is_remote, name
            assert parent(span).kind == SpanKind.CLIENT and parent(span).name == name
        for span in clients:
            assert span.attributes["specdec.network_seconds"] >= 0.0
            assert span.attributes["specdec.compute_seconds"] > 0.0
    assert len(named("specdec.v1.TargetService/Verify", SpanKind.SERVER)) == last.stats.rounds
    # The Releases sent when the stream ended belong to the request too.
    assert {parent(s).name for s in named("specdec.v1.TargetService/Release", SpanKind.CLIENT)} == {"generate"}
    # Pool probes (Info every 0.5 s here) make no spans at all.
    assert not [s for s in finished if s.name.endswith("/Info")]


# -- the dashboard's metrics -------------------------------------------------------------------

PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right", "and",
    "or", "unless", "bool", "offset", "inf", "nan",
}


def _metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (what is left once strings, label matchers,
    ranges, grouping labels, functions, keywords and numbers are taken out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # dashboard variables
    expr = re.sub(r"(?<![\w:])\d[\w.]*", "", expr)  # numbers and durations (0.99, 5m, 1e3)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = match.group(0)
        rest = expr[match.end():].lstrip()
        if word.lower() in PROMQL_WORDS or rest.startswith("("):  # an aggregation or a function
            continue
        names.add(word)
    return names


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []

    def walk(panels):
        for panel in panels:
            queries.extend(target["expr"] for target in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        match = re.fullmatch(r"label_values\(\s*([^,\s]+)\s*,.*\)", query or "")
        if match:
            queries.append(match.group(1))
    return queries


def _scrape(port: int) -> dict[str, list[tuple[str, float]]]:
    """Sample name -> [(labels, value)] of one /metrics endpoint."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples: dict[str, list[tuple[str, float]]] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            samples.setdefault(name, []).append((labels.rstrip("}"), float(value)))
    return samples


def test_metric_names_are_read_from_promql():
    assert _metric_names(
        'histogram_quantile(0.99, sum by (le, hop) (rate(specdec:hop_rtt_seconds_bucket'
        '{model_name=~"$model_name",le="0.0"}[$__rate_interval]))) / ignoring(x) group_left '
        'sum without (a) (specdec_load offset 5m)') == {"specdec:hop_rtt_seconds_bucket", "specdec_load"}


def test_every_metric_the_dashboard_queries_is_served_after_a_request(traced_stack, one_request):
    _, ports = traced_stack
    _, last = one_request
    served = {role: _scrape(port) for role, port in ports.items()}
    every = {name for samples in served.values() for name in samples}
    queries = _dashboard_queries()
    assert len(queries) >= 20
    used = set().union(*map(_metric_names, queries))
    assert all(name.startswith("specdec") for name in used), used  # the parser found metric names
    assert used - every == set(), f"the dashboard queries metrics no service exports: {sorted(used - every)}"

    # ... and they count this request.
    def total(role: str, name: str, where: str = "") -> float:
        return sum(value for labels, value in served[role].get(name, []) if where in labels)

    orchestrator = "orchestrator"
    assert total(orchestrator, "specdec:generation_tokens_total") == last.stats.generated_tokens
    assert total(orchestrator, "specdec:prompt_tokens_total") == len(PROMPT)
    drafted_rounds = sum(k > 0 for k in last.stats.num_speculative_tokens_per_round)
    assert total(orchestrator, "specdec:spec_decode_num_drafts_total") == drafted_rounds
    assert total(orchestrator, "specdec:spec_decode_num_draft_tokens_total") == last.stats.drafted_tokens
    assert total(orchestrator, "specdec:spec_decode_num_accepted_tokens_total") == last.stats.accepted_tokens
    assert total(orchestrator, "specdec:spec_decode_num_draft_tokens_per_pos_total",
                 'position="0"') == drafted_rounds
    assert total(orchestrator, "specdec:spec_decode_num_accepted_tokens_per_pos_total") == \
        last.stats.accepted_tokens
    assert total(orchestrator, "specdec:num_speculative_tokens_count") == last.stats.rounds
    assert total(orchestrator, "specdec:time_to_first_token_seconds_count") == 1
    assert total(orchestrator, "specdec:inter_token_latency_seconds_count") == last.stats.rounds
    assert total(orchestrator, "specdec:e2e_request_latency_seconds_count") == 1
    finish = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    assert total(orchestrator, "specdec:request_success_total", f'finished_reason="{finish}"') == 1
    assert total(orchestrator, "specdec:request_success_total") == 1
    for hop in ("draft", "target"):  # a Prefill on each hop, a Propose or a Verify per round
        assert total(orchestrator, "specdec:hop_rtt_seconds_count", f'hop="{hop}"') >= drafted_rounds + 1
    assert total(orchestrator, "specdec_active_sessions", 'role="orchestrator"') == 0
    assert total(orchestrator, "specdec:num_requests_running") == 0
    for role in ("target", "draft"):
        passes = total(role, "specdec_forward_passes_total")
        assert passes >= 1
        assert total(role, "specdec_forward_pass_rows_count") == passes
        assert total(role, "specdec_forward_pass_sessions_count") == passes
        assert total(role, "specdec_queue_seconds_count") >= 1
    assert total("target", "specdec_queue_seconds_count") >= last.stats.rounds + 1  # Prefill + Verifys


def test_tracing_is_off_unless_the_environment_asks():
    assert _wanted_exporters({}) == []
    assert _wanted_exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}) == ["otlp"]
    assert _wanted_exporters({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}) == ["otlp"]
    assert _wanted_exporters({"OTEL_TRACES_EXPORTER": "console,otlp"}) == ["console", "otlp"]
    assert _wanted_exporters({"OTEL_TRACES_EXPORTER": "none",
                              "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}) == []
    assert _wanted_exporters({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}) == []


def test_configured_from_the_environment_a_process_exports_its_spans():
    """A fresh process: OTEL_TRACES_EXPORTER=console prints the spans, under the service name
    given unless OTEL_SERVICE_NAME names another."""
    code = ("from specdec.tracing import configure_tracing, shutdown_tracing, tracer, tracing_enabled\n"
            "assert not tracing_enabled()\n"
            "assert configure_tracing('specdec-target') and tracing_enabled()\n"
            "with tracer().start_as_current_span('hello'): pass\n"
            "shutdown_tracing()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    for extra, service_name in (({}, "specdec-target"), ({"OTEL_SERVICE_NAME": "mine"}, "mine")):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                                env={**env, "OTEL_TRACES_EXPORTER": "console", **extra})
        assert result.returncode == 0, result.stderr
        assert '"name": "hello"' in result.stdout and f'"service.name": "{service_name}"' in result.stdout
    result = subprocess.run([sys.executable, "-c", "from specdec.tracing import configure_tracing\n"
                             "assert not configure_tracing('x')"], capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode == 0, result.stderr


def test_a_stream_its_client_abandons_ends_its_trace_and_counts_as_abort(traced_stack, one_request, spans):
    running, ports = traced_stack
    before = _scrape(ports["orchestrator"])
    request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=200,
                                 speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED,
                                                                  num_speculative_tokens=1))
    with grpc.insecure_channel(running.address) as channel:
        call = orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(request, timeout=120)
        next(call), next(call)
        call.cancel()

    def aborted() -> float:
        samples = _scrape(ports["orchestrator"])["specdec:request_success_total"]
        return sum(value for labels, value in samples if 'finished_reason="abort"' in labels)

    deadline = time.monotonic() + 10
    while aborted() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = _scrape(ports["orchestrator"])
    assert aborted() == 1 + sum(v for labels, v in before["specdec:request_success_total"]
                                if 'finished_reason="abort"' in labels)
    assert sum(v for _, v in after["specdec:num_requests_running"]) == 0
    ended = [s for s in spans.get_finished_spans()
             if s.name == "generate" and s.attributes.get("specdec.finish_reason") == "abort"]
    assert len(ended) == 1
    # The stack still serves (nothing was left locked or half-recorded).
    _, _, last = stack_module.generate(running.address, pb.GenerateRequest(prompt_token_ids=PROMPT,
                                                                             max_new_tokens=4))
    assert last.stats.generated_tokens >= 1
