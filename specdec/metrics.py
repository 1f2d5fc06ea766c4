"""Prometheus metrics of a model service, for the HPA's per-replica session target (through a
metrics adapter) and for dashboards (deploy/grafana/). Served over HTTP on --metrics-port.

Gauges and counters are read from Info at scrape time; the histograms (queue time, rows, sessions
and seconds per forward pass) are fed by the model worker as passes run (specdec.worker's
PassObserver). The orchestrator's own metrics are in orchestrator/telemetry.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec.protocol import ReplicaInfo

if TYPE_CHECKING:
    from specdec.worker import ModelWorker

# Rows of one pass: a decode step of one session is 1-17 rows, prompts are chunked to
# --max-pass-tokens (512 by default).
ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SESSIONS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PASS_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0,
                        2.5, 5.0, 10.0)
QUEUE_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                         0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServiceCollector:
    """Reads Info at scrape time, so the figures are never stale."""

    def __init__(self, info: Callable[[], ReplicaInfo]) -> None:
        self._info = info

    def collect(self):
        try:
            info = self._info()
        except Exception:  # draining or shutting down: report nothing rather than fail the scrape
            return
        labels = ["role", "replica_id"]
        values = [info.role, info.replica_id]
        for name, help_text, value in (
            ("specdec_active_sessions", "Live sessions (KV caches) on this replica", info.live_sessions),
            ("specdec_cached_tokens", "Tokens held in KV caches", info.cached_tokens),
            ("specdec_load", "Forward passes queued or running over the queue capacity", info.load),
            ("specdec_max_sessions", "Session budget of this replica", info.max_sessions),
            ("specdec_batch_size", "Sessions in the last forward pass", info.pass_sessions),
            ("specdec_tokens_per_pass", "Rows (tokens, all sessions) of the last forward pass",
             info.pass_rows),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=labels)
            gauge.add_metric(values, float(value))
            yield gauge
        for name, help_text, value in (
            ("specdec_forward_passes", "Forward passes run", info.passes_total),
            ("specdec_pass_rows", "Rows fed in forward passes, all sessions together",
             info.pass_rows_total),
            ("specdec_pass_sessions", "Sessions fed in forward passes, summed over passes "
             "(rate over specdec_forward_passes' rate: the mean batch size)", info.pass_sessions_total),
        ):
            counter = CounterMetricFamily(name, help_text, labels=labels)
            counter.add_metric(values, float(value))
            yield counter
        packing = GaugeMetricFamily("specdec_linear_packing_info", "How the linear layers' weights "
                                    "are packed for the CPU's matrix product (any: oneDNN's layout; "
                                    "row counts: MKL's; none)", labels=[*labels, "packing"])
        packing.add_metric([*values, info.linear_packing or "none"], 1.0)
        yield packing


class PassHistograms:
    """The worker's PassObserver: one observation per forward pass and per call."""

    def __init__(self, registry: CollectorRegistry, role: str, replica_id: str) -> None:
        labels = ["role", "replica_id"]

        def histogram(name: str, help_text: str, buckets: tuple) -> Histogram:
            return Histogram(name, help_text, labels, buckets=buckets, registry=registry).labels(
                role, replica_id)

        self.rows = histogram("specdec_forward_pass_rows",
                              "Rows (tokens, all sessions) of each forward pass", ROWS_BUCKETS)
        self.sessions = histogram("specdec_forward_pass_sessions",
                                  "Sessions batched into each forward pass", SESSIONS_BUCKETS)
        self.seconds = histogram("specdec_forward_pass_seconds", "Seconds of each forward pass",
                                 PASS_SECONDS_BUCKETS)
        self.queue = histogram("specdec_queue_seconds", "Seconds a call waited for its first "
                               "forward pass (the model thread's queue)", QUEUE_SECONDS_BUCKETS)

    def pass_ran(self, rows: int, sessions: int, seconds: float) -> None:
        self.rows.observe(rows)
        self.sessions.observe(sessions)
        self.seconds.observe(seconds)

    def call_started(self, queue_seconds: float) -> None:
        self.queue.observe(queue_seconds)


def serve_registry(port: int, host: str, registry: CollectorRegistry) -> int:
    """Serves registry on http://host:port/metrics from a daemon thread; returns the bound port
    (port 0 picks a free one)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port


def start_metrics_server(port: int, host: str, info: Callable[[], ReplicaInfo],
                         worker: ModelWorker | None = None) -> int:
    """Starts the /metrics HTTP endpoint of a model service; returns the bound port. With worker,
    its passes and queue waits also feed histograms from now on."""
    registry = CollectorRegistry()
    registry.register(ServiceCollector(info))
    if worker is not None:
        identity = info()
        worker.observer = PassHistograms(registry, identity.role, identity.replica_id)
    return serve_registry(port, host, registry)
