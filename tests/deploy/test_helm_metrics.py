"""The chart's Prometheus wiring: every pod serves /metrics on its `metrics` port, the optional
scrape annotations, and the optional prometheus-operator ServiceMonitor with the headless Service
it selects, through the real `helm` (and kubernetes-validate for the built-in kinds)."""

from __future__ import annotations

import subprocess

import pytest

from tests.deploy.helm_support import NAMESPACE, VALUE_SETS, render, template
from tests.deploy.test_helm_chart import KUBERNETES_VERSION

COMPONENTS = ("draft", "target", "orchestrator")
METRICS_PORT = 9090
MONITORED = ["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podAnnotations=true",
             "--set", "metrics.serviceMonitor.labels.release=kube-prometheus-stack"]


def _pod_template(rendered, component: str) -> dict:
    return rendered.get("Deployment", component)["spec"]["template"]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_off_by_default_no_servicemonitor_and_no_scrape_annotations(rendered_sets, value_set):
    rendered = rendered_sets[value_set]
    assert rendered.all("ServiceMonitor") == []
    assert rendered.get("Service", "metrics") is None
    for component in COMPONENTS:
        annotations = _pod_template(rendered, component)["metadata"].get("annotations", {})
        assert not any(key.startswith("prometheus.io/") for key in annotations), component


def test_servicemonitor_scrapes_the_metrics_port_of_every_component(helm, kubernetes_validate):
    rendered = render(helm, *MONITORED)
    (monitor,) = rendered.all("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    service = rendered.get("Service", "metrics")
    assert service["spec"]["clusterIP"] == "None"
    (port,) = service["spec"]["ports"]
    assert port == {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}
    # The monitor selects that Service, in the release's namespace, on its named port.
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    # ... and the Service selects the pods of all three components, each with that port.
    for component in COMPONENTS:
        pod = _pod_template(rendered, component)
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items(), component
        (container,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == METRICS_PORT, component
        assert pod["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
            "prometheus.io/path": "/metrics"}, component
    # The pool Services still carry only their gRPC port (the orchestrator's discovery reads it).
    for pool in ("draft", "target"):
        assert [p["name"] for p in rendered.get("Service", pool)["spec"]["ports"]] == ["grpc"]
    # The built-in kinds pass the strict schema check (the CRD's kind has no offline schema).
    builtin = template(helm, *MONITORED).stdout.split("\n---")
    builtin = "\n---".join(doc for doc in builtin if "kind: ServiceMonitor" not in doc)
    result = subprocess.run([*kubernetes_validate, "--strict", "--kubernetes-version", KUBERNETES_VERSION, "-"],
                            input=builtin, capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "WARN" not in output and "ERROR" not in output, output


def test_pod_annotations_of_a_component_win_over_the_scrape_defaults(helm):
    rendered = render(helm, *MONITORED, "--set", "orchestrator.podAnnotations.team=llm",
                      "--set-string", "orchestrator.podAnnotations.prometheus\\.io/port=9999")
    annotations = _pod_template(rendered, "orchestrator")["metadata"]["annotations"]
    assert annotations["team"] == "llm" and annotations["prometheus.io/port"] == "9999"
    assert annotations["prometheus.io/scrape"] == "true"


@pytest.mark.parametrize("setting", ["metrics.serviceMonitor.interval=often", "metrics.scrape=true"])
def test_bad_metrics_values_are_refused(helm, setting):
    result = template(helm, "--set", setting)
    assert result.returncode != 0 and "schema" in result.stderr, result.stderr


def test_traces_go_to_the_collector_named_and_nowhere_by_default(helm, rendered_sets):
    for component in COMPONENTS:
        env = rendered_sets["default"].container(component)["env"]
        assert not [item for item in env if item["name"].startswith("OTEL_")], component
    rendered = render(helm, "--set", "tracing.otlpEndpoint=http://collector.obs:4317",
                      "--set-json", "tracing.sampleRatio=0.25")
    for component in COMPONENTS:
        env = {item["name"]: item.get("value") for item in rendered.container(component)["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector.obs:4317", component
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
        assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
