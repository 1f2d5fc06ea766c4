"""Prometheus metrics of a model service, for the HPA's per-replica session target (through a
metrics adapter) and for dashboards. Served over HTTP on --metrics-port; read at scrape time."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec.protocol import ReplicaInfo


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


def start_metrics_server(port: int, host: str, info: Callable[[], ReplicaInfo]) -> int:
    """Starts the /metrics HTTP endpoint in a daemon thread; returns the bound port."""
    registry = CollectorRegistry()
    registry.register(ServiceCollector(info))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port
