"""Values that must be refused (values.schema.json strictness, `required`, cross-value checks) and
the chart's switches (discovery, auth, model sources, service type), through the real `helm`."""

from __future__ import annotations

import re

import pytest

from tests.deploy.helm_support import CHART, NAMESPACE, RELEASE, render, run_helm, template

# Maps whose entries are data (Kubernetes quantities, labels), documented by their parent's comment.
DATA_MAPS = {"resources", "requests", "limits"}


def test_every_key_in_values_yaml_has_a_comment():
    lines = (CHART / "values.yaml").read_text().splitlines()
    parents: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    undocumented = []
    for number, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z][\w.]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        parents = [(i, k) for i, k in parents if i < indent]
        if not (parents and parents[-1][1] in DATA_MAPS):
            if not lines[number - 1].strip().startswith("#"):
                undocumented.append(f"line {number + 1}: {line.strip()}")
        parents.append((indent, key))
    assert undocumented == []


@pytest.mark.parametrize(
    "setting, misspelt_key",
    [
        ("draft.replicaz=2", "replicaz"),
        ("target.autoscaling.enable=true", "enable"),
        ("orchestrator.service.tipe=LoadBalancer", "tipe"),
        ("tlss.enabled=true", "tlss"),
        ("draft.tolerations[0].operater=Exists", "operater"),
    ],
)
def test_misspelt_key_fails_template_and_lint(helm, setting, misspelt_key):
    result = template(helm, "--set", setting)
    assert result.returncode != 0, f"--set {setting} rendered:\n{result.stdout[:500]}"
    assert "additional properties" in result.stderr and misspelt_key in result.stderr
    lint = run_helm(helm, "lint", "--strict", str(CHART), "--set", setting)
    assert lint.returncode != 0, lint.stdout


@pytest.mark.parametrize(
    "setting",
    [
        "draft.dtype=fp8",
        "target.device=tpu",
        "discovery=consul",
        "orchestrator.service.type=NodePort",
        "orchestrator.speculation=sometimes",
        "draft.model.source=s3",
        "target.gpu=-1",
        "draft.replicas=two",
        "draft.resources.limits.nvidia\\.com/gpu=1",  # GPUs go in `gpu`, which also sets the device
        "target.packedRows=8;17",
        "draft.packedRows=always",
    ],
)
def test_out_of_schema_value_fails(helm, setting):
    result = template(helm, "--set", setting)
    assert result.returncode != 0, f"--set {setting} rendered"
    assert "schema" in result.stderr


@pytest.mark.parametrize(
    "settings, message",
    [
        (["tls.enabled=true"], "tls.secretName is required"),
        (["target.model.source=persistentVolumeClaim"],
         "target.model.persistentVolumeClaim.claimName is required"),
        (["draft.model.source=hostPath"], "draft.model.hostPath.path is required"),
        (["orchestrator.serviceAccount.create=false"], "orchestrator.serviceAccount.name is required"),
    ],
)
def test_missing_required_value_fails_with_its_name(helm, settings, message):
    args = [arg for setting in settings for arg in ("--set", setting)]
    result = template(helm, *args)
    assert result.returncode != 0
    assert message in result.stderr


def test_packed_rows_reach_each_pools_model_service(helm):
    """`--packed-rows` follows each pool's packedRows (default auto: the service decides, packing on
    a CPU in float32); the value is checked by the schema and passed as `specdec serve` reads it."""
    cases = (((), "auto", "auto"),
             (("--set", "target.packedRows=off", "--set-string", "draft.packedRows=8\\,17"), "off", "8,17"))
    for settings, target_rows, draft_rows in cases:
        rendered = render(helm, *settings)
        for component, rows in (("target", target_rows), ("draft", draft_rows)):
            args = rendered.container(component)["args"]
            assert args[args.index("--packed-rows") + 1] == rows


def test_speculation_beyond_a_pools_limit_fails(helm):
    result = template(helm, "--set", "target.maxNumSpeculativeTokens=8")
    assert result.returncode != 0
    assert "orchestrator.maxNumSpeculativeTokens (16) exceeds target.maxNumSpeculativeTokens" in result.stderr
    result = template(helm, "--set", "draft.maxNumSpeculativeTokens=3")
    assert result.returncode != 0
    assert "orchestrator.numSpeculativeTokens (4) exceeds draft.maxNumSpeculativeTokens" in result.stderr
    assert template(helm, "--set", "target.maxNumSpeculativeTokens=8",
                    "--set", "orchestrator.maxNumSpeculativeTokens=8").returncode == 0


def test_min_replicas_above_max_fails(helm):
    result = template(
        helm, "--set", "draft.autoscaling.enabled=true", "--set", "draft.autoscaling.minReplicas=9",
    )
    assert result.returncode != 0
    assert "minReplicas" in result.stderr


def test_zero_sessions_per_replica_leaves_the_hpa_on_cpu_alone(helm):
    rendered = render(
        helm,
        "--set", "target.autoscaling.enabled=true",
        "--set", "target.autoscaling.activeSessionsPerReplica=0",
    )
    (metric,) = rendered.get("HorizontalPodAutoscaler", "target")["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"


def test_dns_discovery_uses_headless_service_names_and_no_rbac(helm):
    rendered = render(helm, "--set", "discovery=dns")
    args = rendered.container("orchestrator")["args"]
    for pool in ("draft", "target"):
        service = rendered.get("Service", pool)["metadata"]["name"]
        expected = f"dns:///{service}.{NAMESPACE}.svc.cluster.local:50051"
        assert args[args.index(f"--{pool}") + 1] == expected
    assert rendered.all("Role") == [] and rendered.all("RoleBinding") == []
    pod = rendered.get("Deployment", "orchestrator")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False


def test_auth_token_is_mounted_and_passed_to_the_orchestrator_only(helm):
    rendered = render(helm, "--set", "auth.existingSecret=api-token")
    container = rendered.container("orchestrator")
    args = container["args"]
    assert args[args.index("--auth-token-file") + 1] == "/etc/specdec/auth/token"
    pod = rendered.get("Deployment", "orchestrator")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "auth"]
    assert volume["secret"]["secretName"] == "api-token"
    assert volume["secret"]["items"] == [{"key": "token", "path": "token"}]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "auth"]
    assert mount["mountPath"] == "/etc/specdec/auth" and mount["readOnly"] is True
    for pool in ("draft", "target"):
        assert "--auth-token-file" not in rendered.container(pool)["args"]


def test_model_sources_mount_read_only_and_point_model_at_them(helm):
    rendered = render(
        helm,
        "--set", "draft.model.source=hostPath",
        "--set", "draft.model.hostPath.path=/var/models/draft",
        "--set", "target.model.source=persistentVolumeClaim",
        "--set", "target.model.persistentVolumeClaim.claimName=weights",
        "--set", "target.model.persistentVolumeClaim.path=llama/8b/",
    )
    expectations = {
        "draft": ({"hostPath": {"path": "/var/models/draft", "type": "Directory"}}, "/models/draft"),
        "target": (
            {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
            "/models/target/llama/8b",
        ),
    }
    for pool, (source, model_path) in expectations.items():
        container = rendered.container(pool)
        pod = rendered.get("Deployment", pool)["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert {key: value for key, value in volume.items() if key != "name"} == source
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": f"/models/{pool}", "readOnly": True}
        assert container["args"][container["args"].index("--model") + 1] == model_path


def test_notes_tell_how_to_reach_the_api(helm):
    for service_type, how in (("ClusterIP", "port-forward"), ("LoadBalancer", "loadBalancer")):
        result = run_helm(
            helm, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
            "--set", f"orchestrator.service.type={service_type}",
        )
        assert result.returncode == 0, result.stderr
        notes = result.stdout.split("NOTES:", 1)[1]
        assert how in notes
        assert 'specdec generate --orchestrator "$ADDR" --prompt' in notes
