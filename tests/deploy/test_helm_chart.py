"""The Helm chart, checked with the real tools and no cluster: `helm lint --strict`, `helm template`,
the rendered objects through `kubernetes-validate --strict` (offline OpenAPI schemas of the
Kubernetes version below), then the rendered YAML parsed and checked for what this workload needs.

Runs for the chart's defaults and for every value set in deploy/values/.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.deploy.helm_support import CHART, NAMESPACE, VALUE_SETS, chart_values, render, run_helm

# The newest Kubernetes whose schemas kubernetes-validate 1.37.0 ships offline.
KUBERNETES_VERSION = "1.37.0"
POOLS = ("draft", "target")
COMPONENTS = POOLS + ("orchestrator",)
PORTS = {"orchestrator": (50050, 50060), "draft": (50051, 50061), "target": (50051, 50061)}
# Startup budget that must cover model loading: the brief's ten minutes.
MIN_POOL_STARTUP_SECONDS = 600

value_sets = pytest.mark.parametrize("value_set", sorted(VALUE_SETS))


def _arg(args: list[str], flag: str) -> str:
    """The value after `flag` in a container's args (flags appear once)."""
    assert args.count(flag) == 1, f"{flag} appears {args.count(flag)} times in {args}"
    return args[args.index(flag) + 1]


@value_sets
def test_helm_lint_strict_passes(helm, value_set):
    result = run_helm(helm, "lint", "--strict", str(CHART), *VALUE_SETS[value_set])
    assert result.returncode == 0, result.stdout + result.stderr


@value_sets
def test_rendered_objects_match_kubernetes_schemas(rendered_sets, kubernetes_validate, value_set):
    rendered = rendered_sets[value_set]
    result = subprocess.run(
        [*kubernetes_validate, "--strict", "--kubernetes-version", KUBERNETES_VERSION, "-"],
        input=rendered.text, capture_output=True, text=True, timeout=60,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # A kind without an offline schema is only a WARN with exit 0: insist that every object was
    # actually checked.
    assert "WARN" not in output and "ERROR" not in output, output
    passed = [line for line in output.splitlines() if line.startswith("INFO") and "passed" in line]
    assert len(passed) == len(rendered.docs), output


@value_sets
def test_each_component_has_its_own_deployment_service_hpa_and_pdb(rendered_sets, value_set):
    rendered = rendered_sets[value_set]
    values = chart_values(value_set)
    for component in COMPONENTS:
        deployment = rendered.get("Deployment", component)
        assert deployment is not None, component
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector["app.kubernetes.io/component"] == component

        service = rendered.get("Service", component)
        assert service is not None, component
        assert service["spec"]["selector"] == selector

        pdb = rendered.get("PodDisruptionBudget", component)
        assert pdb is not None, component
        assert pdb["apiVersion"] == "policy/v1"
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"] == selector

        hpa = rendered.get("HorizontalPodAutoscaler", component)
        autoscaling = values[component]["autoscaling"]
        if not autoscaling["enabled"]:
            assert hpa is None, component
            assert deployment["spec"]["replicas"] == values[component]["replicas"]
            continue
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"],
        }
        # The HPA owns the replica count; a fixed one would fight it on every upgrade.
        assert "replicas" not in deployment["spec"]
        assert hpa["spec"]["minReplicas"] == autoscaling["minReplicas"]
        assert hpa["spec"]["maxReplicas"] == autoscaling["maxReplicas"]
        *session_metrics, cpu_metric = hpa["spec"]["metrics"]
        assert len(session_metrics) == (1 if autoscaling["activeSessionsPerReplica"] else 0)
        assert cpu_metric["type"] == "Resource"
        assert cpu_metric["resource"]["name"] == "cpu"
        assert cpu_metric["resource"]["target"]["type"] == "Utilization"
        if not session_metrics:
            continue
        (pods_metric,) = session_metrics
        assert pods_metric["type"] == "Pods"
        assert pods_metric["pods"]["metric"]["name"] == "specdec_active_sessions"
        assert pods_metric["pods"]["target"] == {
            "type": "AverageValue", "averageValue": str(autoscaling["activeSessionsPerReplica"]),
        }


@value_sets
def test_pool_services_are_headless_and_orchestrator_service_is_not(rendered_sets, value_set):
    rendered = rendered_sets[value_set]
    values = chart_values(value_set)
    for pool in POOLS:
        service = rendered.get("Service", pool)
        assert service["spec"]["clusterIP"] == "None"
        (port,) = service["spec"]["ports"]
        assert port["port"] == PORTS[pool][0] and port["targetPort"] == "grpc"
    orchestrator = rendered.get("Service", "orchestrator")
    assert "clusterIP" not in orchestrator["spec"]
    assert orchestrator["spec"]["type"] == values["orchestrator"]["service"]["type"]
    # gRPC and the OpenAI-compatible HTTP API, each to its named container port
    ports = {port["name"]: (port["port"], port["targetPort"]) for port in orchestrator["spec"]["ports"]}
    assert ports == {"grpc": (values["orchestrator"]["service"]["port"], "grpc"),
                     "http": (values["orchestrator"]["httpPort"], "http")}


METRICS_PORT = 9090
HTTP_PORT = 8000


@value_sets
def test_all_probes_are_grpc_on_the_plaintext_health_port(rendered_sets, value_set):
    rendered = rendered_sets[value_set]
    for component in COMPONENTS:
        container = rendered.container(component)
        service_port, health_port = PORTS[component]
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        # Every component serves /metrics: the pools' specdec_active_sessions for their HPAs, the
        # orchestrator's streams in flight for its own, and the dashboard's metrics.
        expected = {"grpc": service_port, "health": health_port, "metrics": METRICS_PORT}
        args = container["args"]
        assert _arg(args, "--metrics-port") == str(METRICS_PORT)
        if component == "orchestrator":  # the OpenAI-compatible HTTP API, on by default
            expected["http"] = HTTP_PORT
            assert _arg(args, "--http-port") == str(HTTP_PORT)
        assert ports == expected
        assert _arg(args, "--port") == str(service_port)
        assert _arg(args, "--health-port") == str(health_port)

        probes = {kind: container[f"{kind}Probe"] for kind in ("startup", "readiness", "liveness")}
        for kind, probe in probes.items():
            handlers = {"grpc", "httpGet", "tcpSocket", "exec"} & probe.keys()
            assert handlers == {"grpc"}, f"{component} {kind} probe uses {handlers}"
            assert probe["grpc"]["port"] == health_port, f"{component} {kind}"
        # Deep checks (service "") gate startup and traffic; liveness is the shallow one.
        assert probes["startup"]["grpc"].get("service", "") == ""
        assert probes["readiness"]["grpc"].get("service", "") == ""
        assert probes["liveness"]["grpc"]["service"] == "liveness"
        if component in POOLS:
            budget = probes["startup"]["periodSeconds"] * probes["startup"]["failureThreshold"]
            assert budget >= MIN_POOL_STARTUP_SECONDS, f"{component} startup budget {budget}s"

        deployment = rendered.get("Deployment", component)
        pod = deployment["spec"]["template"]["spec"]
        sleep_command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep_command[0] == "sleep"
        # SIGKILL comes terminationGracePeriodSeconds after the sleep starts: the sleep and the
        # server's own drain after SIGTERM must both fit before it.
        drain = float(_arg(args, "--grace-seconds"))
        assert int(sleep_command[1]) + drain < pod["terminationGracePeriodSeconds"]


@value_sets
def test_role_grants_only_endpointslice_reads_to_the_orchestrator(rendered_sets, value_set):
    rendered = rendered_sets[value_set]
    (role,) = rendered.all("Role")
    assert role["rules"] == [{
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }]
    assert rendered.all("ClusterRole") == [] and rendered.all("ClusterRoleBinding") == []
    (binding,) = rendered.all("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"],
    }
    (account,) = rendered.all("ServiceAccount")
    assert binding["subjects"] == [{
        "kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE,
    }]
    orchestrator_pod = rendered.get("Deployment", "orchestrator")["spec"]["template"]["spec"]
    assert orchestrator_pod["serviceAccountName"] == account["metadata"]["name"]
    assert orchestrator_pod["automountServiceAccountToken"] is True
    for pool in POOLS:
        pool_pod = rendered.get("Deployment", pool)["spec"]["template"]["spec"]
        assert pool_pod["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in pool_pod


@value_sets
def test_orchestrator_args_point_at_both_pool_services(rendered_sets, value_set):
    rendered = rendered_sets[value_set]
    args = rendered.container("orchestrator")["args"]
    assert args[:2] == ["serve", "orchestrator"]
    for pool in POOLS:
        service = rendered.get("Service", pool)
        expected = f"k8s://{NAMESPACE}/{service['metadata']['name']}:{PORTS[pool][0]}"
        assert _arg(args, f"--{pool}") == expected
    assert _arg(args, "--speculation") == "adaptive"
    # the fixed mode's K, and the adaptive controller's maximum (two flags, two values)
    assert _arg(args, "--num-speculative-tokens") == "4"
    assert _arg(args, "--max-num-speculative-tokens") == "16"


@value_sets
def test_pools_run_serve_with_the_pool_flags(rendered_sets, value_set):
    rendered = rendered_sets[value_set]
    values = chart_values(value_set)
    for pool in POOLS:
        container = rendered.container(pool)
        args = container["args"]
        assert args[:2] == ["serve", pool]
        assert _arg(args, "--host") == "0.0.0.0"
        assert _arg(args, "--replica-id") == "$(POD_NAME)"
        env = {item["name"]: item for item in container["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert _arg(args, "--dtype") == values[pool]["dtype"]
        assert _arg(args, "--max-sessions") == str(values[pool]["maxSessions"])
        assert _arg(args, "--max-cached-tokens") == str(values[pool]["maxCachedTokens"])
        assert _arg(args, "--session-ttl") == str(values[pool]["sessionTtlSeconds"])
        assert _arg(args, "--max-num-speculative-tokens") == "16"
        assert re.fullmatch(r"/\S+", _arg(args, "--model"))


@value_sets
def test_gpus_and_node_selectors_land_on_the_right_pool(rendered_sets, value_set):
    rendered = rendered_sets[value_set]
    values = chart_values(value_set)
    for component in COMPONENTS:
        container = rendered.container(component)
        pod = rendered.get("Deployment", component)["spec"]["template"]["spec"]
        gpus = values[component].get("gpu", 0)
        limits = container["resources"].get("limits", {})
        assert limits.get("nvidia.com/gpu", 0) == gpus, component
        assert "nvidia.com/gpu" not in container["resources"].get("requests", {})
        assert pod.get("nodeSelector", {}) == values[component]["nodeSelector"]
        assert pod.get("tolerations", []) == values[component]["tolerations"]
        if component in POOLS:
            assert _arg(container["args"], "--device") == ("cuda" if gpus else "cpu")


def test_gpu_value_set_puts_small_gpus_on_draft_and_big_ones_on_target(rendered_sets):
    rendered = rendered_sets["gpu-autoscaling"]
    expected_products = {"draft": "NVIDIA-L4", "target": "NVIDIA-H100-80GB-HBM3"}
    for pool, product in expected_products.items():
        pod = rendered.get("Deployment", pool)["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": product}
        assert rendered.container(pool)["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        assert rendered.get("HorizontalPodAutoscaler", pool) is not None
        volume = next(v for v in pod["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": "specdec-models", "readOnly": True}
        assert _arg(rendered.container(pool)["args"], "--model") == f"/models/{pool}/{pool}"
    orchestrator = rendered.container("orchestrator")
    assert "nvidia.com/gpu" not in orchestrator["resources"].get("limits", {})


@value_sets
def test_tls_mounts_the_secret_and_passes_the_flags_to_all_three(rendered_sets, value_set):
    rendered = rendered_sets[value_set]
    tls = chart_values(value_set)["tls"]
    for component in COMPONENTS:
        container = rendered.container(component)
        pod = rendered.get("Deployment", component)["spec"]["template"]["spec"]
        flags = {"--tls-cert", "--tls-key", "--tls-ca"} & set(container["args"])
        volumes = [v for v in pod["volumes"] if v["name"] == "tls"]
        if not tls["enabled"]:
            assert flags == set() and volumes == [], component
            continue
        (volume,) = volumes
        assert volume["secret"]["secretName"] == tls["secretName"]
        secret_files = {item["path"] for item in volume["secret"]["items"]}
        assert secret_files == {"ca.crt", "tls.crt", "tls.key"}
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
        assert mount == {"name": "tls", "mountPath": "/etc/specdec/tls", "readOnly": True}
        args = container["args"]
        assert _arg(args, "--tls-cert") == "/etc/specdec/tls/tls.crt"
        assert _arg(args, "--tls-key") == "/etc/specdec/tls/tls.key"
        assert _arg(args, "--tls-ca") == "/etc/specdec/tls/ca.crt"


def test_every_value_set_is_exercised():
    # The GPU set is the one that turns TLS, autoscaling, PVCs and GPUs on: keep it and the
    # minimal CPU set among the value sets above.
    assert {"default", "gpu-autoscaling", "cpu-small"} <= set(VALUE_SETS)
    gpu = chart_values("gpu-autoscaling")
    assert gpu["tls"]["enabled"] is True
    for component in COMPONENTS:
        assert gpu[component]["autoscaling"]["enabled"] is True
        assert gpu[component]["autoscaling"]["activeSessionsPerReplica"] > 0
    cpu_small = chart_values("cpu-small")
    for component in COMPONENTS:
        assert cpu_small[component]["replicas"] == 1
        assert cpu_small[component]["autoscaling"]["enabled"] is False
    for pool in POOLS:
        assert cpu_small[pool]["gpu"] == 0
        assert cpu_small[pool]["model"]["source"] == "image"


def test_http_port_0_turns_the_http_api_off(helm):
    rendered = render(helm, "--set", "orchestrator.httpPort=0")
    container = rendered.container("orchestrator")
    assert "--http-port" not in container["args"]
    assert "http" not in {port["name"] for port in container["ports"]}
    service = rendered.get("Service", "orchestrator")
    assert [port["name"] for port in service["spec"]["ports"]] == ["grpc"]


def test_orchestrator_beside_target_value_set_selects_the_target_pods(rendered_sets):
    """The orchestrator-beside-target value set asks the scheduler to put each orchestrator pod on a
    node that runs a target pod: its rule must select the target pool's pods (by the labels the
    chart gives them) and not the draft's, or it would place nothing anywhere."""
    rendered = rendered_sets["orchestrator-beside-target"]
    pod = rendered.get("Deployment", "orchestrator")["spec"]["template"]["spec"]
    (term,) = pod["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    labels = {pool: rendered.get("Deployment", pool)["spec"]["template"]["metadata"]["labels"] for pool in POOLS}
    assert selector.items() <= labels["target"].items()
    assert not selector.items() <= labels["draft"].items()
    assert _arg(rendered.container("orchestrator")["args"], "--pipeline") == "auto"
