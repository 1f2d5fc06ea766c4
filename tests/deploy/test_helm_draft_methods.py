"""The draft methods through the real `helm`: orchestrator.draftMethod / suffixCache (the
orchestrator's --draft, --draft-method, --suffix-cache; no draft pool for a lookup in the
orchestrator) and draft.method / suffixCache (a draft pool without a model that reads the target's
model directory), with the schema refusing what does not apply."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.deploy.helm_support import CHART, NAMESPACE, RELEASE, render, run_helm, template
from tests.deploy.test_helm_chart import KUBERNETES_VERSION

DRAFT_POOL_KINDS = ("Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget")
DRAFT_ADDRESS = f"k8s://{NAMESPACE}/{RELEASE}-specdec-draft:50051"
TARGET_ADDRESS = f"k8s://{NAMESPACE}/{RELEASE}-specdec-target:50051"
# Everything a draft pool can have, switched on: none of it may render without a draft pool.
ALL_DRAFT_RESOURCES = ["--set", "draft.autoscaling.enabled=true",
                       "--set", "draft.podDisruptionBudget.enabled=true"]


def _sets(**values: str) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def _flag(args: list[str], flag: str) -> str | None:
    """The value after `flag`, None if absent (and never twice)."""
    assert args.count(flag) <= 1, f"{flag} appears {args.count(flag)} times in {args}"
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize(
    "method, cache, draft, suffix_cache",
    [
        ("model", "shared", DRAFT_ADDRESS, None),  # the pool alone: no lookup, no cache flag
        ("hybrid", "session", DRAFT_ADDRESS, "session"),
        ("hybrid", "shared", DRAFT_ADDRESS, "shared"),
        ("ngram", "shared", "local:ngram", None),  # ngram keeps no suffix cache
        ("suffix", "session", "local:suffix", "session"),
        ("suffix", "shared", "local:suffix", "shared"),
    ],
)
def test_orchestrator_args_for_each_draft_method(helm, method, cache, draft, suffix_cache):
    rendered = render(helm, *_sets(**{"orchestrator.draftMethod": method,
                                      "orchestrator.suffixCache": cache}))
    args = rendered.container("orchestrator")["args"]
    assert _flag(args, "--draft") == draft
    assert _flag(args, "--draft-method") == method
    assert _flag(args, "--suffix-cache") == suffix_cache
    assert _flag(args, "--target") == TARGET_ADDRESS


def test_default_is_the_model_draft_pool(helm):
    rendered = render(helm)
    args = rendered.container("orchestrator")["args"]
    assert (_flag(args, "--draft"), _flag(args, "--draft-method")) == (DRAFT_ADDRESS, "model")
    assert "--suffix-cache" not in args
    draft_args = rendered.container("draft")["args"]
    assert _flag(draft_args, "--method") == "model" and "--suffix-cache" not in draft_args
    assert _flag(draft_args, "--model") == "/opt/specdec/models/draft"


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("discovery", ["kubernetes", "dns"])
def test_a_lookup_in_the_orchestrator_renders_no_draft_pool(helm, method, discovery):
    rendered = render(helm, *ALL_DRAFT_RESOURCES,
                      *_sets(**{"orchestrator.draftMethod": method, "discovery": discovery}))
    for kind in DRAFT_POOL_KINDS:
        assert rendered.get(kind, "draft") is None, kind
    assert "specdec-draft" not in rendered.text
    # The target pool and the orchestrator are whole; discovery still finds the target.
    for component in ("target", "orchestrator"):
        for kind in ("Deployment", "Service", "PodDisruptionBudget"):
            assert rendered.get(kind, component) is not None, (kind, component)
    args = rendered.container("orchestrator")["args"]
    assert _flag(args, "--draft") == f"local:{method}"
    target = _flag(args, "--target")
    assert target.startswith("k8s://" if discovery == "kubernetes" else "dns:///"), target
    assert len(rendered.all("Role")) == (1 if discovery == "kubernetes" else 0)


@pytest.mark.parametrize("method", ["model", "hybrid"])
def test_the_draft_pool_stays_for_model_and_hybrid(helm, method):
    rendered = render(helm, *ALL_DRAFT_RESOURCES, *_sets(**{"orchestrator.draftMethod": method}))
    for kind in DRAFT_POOL_KINDS:
        assert rendered.get(kind, "draft") is not None, kind


def test_without_a_draft_pool_its_limits_bind_nothing(helm):
    # The orchestrator's K is checked against each pool it calls; a lookup calls no draft pool.
    low_draft = _sets(**{"draft.maxNumSpeculativeTokens": "3"})
    assert template(helm, *low_draft).returncode != 0
    result = template(helm, *low_draft, *_sets(**{"orchestrator.draftMethod": "suffix"}))
    assert result.returncode == 0, result.stderr
    # ... but the target's still does.
    result = template(helm, *_sets(**{"orchestrator.draftMethod": "suffix",
                                      "target.maxNumSpeculativeTokens": "8"}))
    assert result.returncode != 0
    assert "exceeds target.maxNumSpeculativeTokens" in result.stderr


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({"orchestrator.draftMethod": "suffix", "orchestrator.suffixCache": "shared"},
                     id="local-suffix"),
        pytest.param({"orchestrator.draftMethod": "hybrid", "draft.method": "ngram"},
                     id="hybrid-over-lookup-pool"),
    ],
)
def test_draft_methods_pass_lint_and_kubernetes_schemas(helm, kubernetes_validate, settings):
    args = [*ALL_DRAFT_RESOURCES, *_sets(**settings)]
    lint = run_helm(helm, "lint", "--strict", str(CHART), *args)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    rendered = render(helm, *args)
    result = subprocess.run(
        [*kubernetes_validate, "--strict", "--kubernetes-version", KUBERNETES_VERSION, "-"],
        input=rendered.text, capture_output=True, text=True, timeout=60,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "WARN" not in output and "ERROR" not in output, output


@pytest.mark.parametrize(
    "method, cache, suffix_cache",
    [("ngram", "shared", None), ("suffix", "session", "session"), ("suffix", "shared", "shared")],
)
def test_a_lookup_draft_pool_serves_the_target_vocabulary(helm, method, cache, suffix_cache):
    rendered = render(helm, *_sets(**{"draft.method": method, "draft.suffixCache": cache}))
    args = rendered.container("draft")["args"]
    assert args[:2] == ["serve", "draft"]
    assert _flag(args, "--method") == method
    assert _flag(args, "--suffix-cache") == suffix_cache
    assert _flag(args, "--model") == _flag(rendered.container("target")["args"], "--model")
    assert _flag(args, "--model") == "/opt/specdec/models/target"
    # The orchestrator calls it as any draft pool.
    orchestrator = rendered.container("orchestrator")["args"]
    assert (_flag(orchestrator, "--draft"), _flag(orchestrator, "--draft-method")) == (
        DRAFT_ADDRESS, "model")
    # The target pool never gets the draft's flags.
    target = rendered.container("target")["args"]
    assert "--method" not in target and "--suffix-cache" not in target


def test_a_lookup_draft_pool_mounts_the_targets_volume_not_its_own(helm):
    rendered = render(helm, *_sets(**{
        "draft.method": "suffix",
        # the draft's own model source is unused: its missing path must not fail the render
        "draft.model.source": "hostPath",
        "target.model.source": "persistentVolumeClaim",
        "target.model.persistentVolumeClaim.claimName": "weights",
        "target.model.persistentVolumeClaim.path": "llama/8b",
    }))
    container = rendered.container("draft")
    pod = rendered.get("Deployment", "draft")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "model"]
    assert mount == {"name": "model", "mountPath": "/models/target", "readOnly": True}
    assert _flag(container["args"], "--model") == "/models/target/llama/8b"
    # With the model method the draft's own source is back in force.
    result = template(helm, *_sets(**{"draft.model.source": "hostPath"}))
    assert result.returncode != 0 and "draft.model.hostPath.path is required" in result.stderr


def test_notes_name_the_draft_method(helm):
    def notes(*settings: str) -> str:
        result = run_helm(helm, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
                          "--dry-run=client", *settings)
        assert result.returncode == 0, result.stderr
        return result.stdout.split("NOTES:", 1)[1]

    local = notes(*_sets(**{"orchestrator.draftMethod": "ngram"}))
    assert "local:ngram" in local and "no draft pool" in local
    assert f"{RELEASE}-specdec-draft" not in local and "s draft" not in local  # no startup budget
    assert "suffix lookup, no model" in notes(*_sets(**{"draft.method": "suffix"}))
    assert f"draft pool    {RELEASE}-specdec-draft" in notes()


@pytest.mark.parametrize("key", ["method", "suffixCache"])
def test_the_target_pool_refuses_the_draft_only_keys(helm, key):
    value = "ngram" if key == "method" else "shared"
    result = template(helm, "--set", f"target.{key}={value}")
    assert result.returncode != 0, f"target.{key} rendered"
    assert "additional properties" in result.stderr and key in result.stderr
    lint = run_helm(helm, "lint", "--strict", str(CHART), "--set", f"target.{key}={value}")
    assert lint.returncode != 0, lint.stdout
    # ... which the draft pool accepts.
    assert template(helm, "--set", f"draft.{key}={value}").returncode == 0


@pytest.mark.parametrize(
    "setting",
    [
        "orchestrator.draftMethod=eagle",
        "orchestrator.draftMethod=local:ngram",  # the method, not the CLI's address form
        "orchestrator.suffixCache=global",
        "draft.method=hybrid",  # hybrid is the orchestrator's; a pool proposes one way
        "draft.suffixCache=none",
    ],
)
def test_out_of_enum_draft_methods_fail(helm, setting):
    result = template(helm, "--set", setting)
    assert result.returncode != 0, f"--set {setting} rendered"
    assert "value must be one of" in result.stderr, result.stderr


def test_unquoted_yaml_boolean_is_refused_not_rendered(helm, tmp_path):
    # `suffixCache: off` in a values file is YAML's false: refuse it rather than render `false`.
    values = tmp_path / "values.yaml"
    values.write_text("orchestrator:\n  draftMethod: suffix\n  suffixCache: off\n")
    result = template(helm, "-f", str(values))
    assert result.returncode != 0 and "suffixCache" in result.stderr, result.stdout[:300]


def test_both_pools_close_over_the_shared_pool_keys():
    # draftPool and targetPool name every key of `pool` (whose schemas they take through allOf)
    # and close the object; only the draft adds its own. A key added to one list and not the other
    # would silently make the pools differ.
    definitions = json.loads((CHART / "values.schema.json").read_text())["definitions"]
    shared = set(definitions["pool"]["properties"])
    assert "additionalProperties" not in definitions["pool"]
    for name, own in (("draftPool", {"method", "suffixCache"}), ("targetPool", set())):
        pool = definitions[name]
        assert pool["allOf"] == [{"$ref": "#/definitions/pool"}]
        assert pool["additionalProperties"] is False
        assert set(pool["properties"]) == shared | own, name
        assert all(pool["properties"][key] is True for key in shared), name
