"""Running the real `helm` on the chart and reading what it renders; shared by the tests in
tests/deploy/ (fixtures live in conftest.py)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "deploy" / "helm" / "specdec"
VALUES_DIR = REPO_ROOT / "deploy" / "values"
HELM = REPO_ROOT / ".tools" / "bin" / "helm"
INSTALL_HINT = "run scripts/install_helm.sh"

RELEASE = "sd"
NAMESPACE = "llm"

# Value sets every structural test runs against: the chart's defaults and each file in
# deploy/values/ (a new file there is picked up without touching the tests).
VALUE_SETS = {"default": []} | {
    path.stem: ["-f", str(path)] for path in sorted(VALUES_DIR.glob("*.yaml"))
}


@dataclass(frozen=True)
class Rendered:
    """One `helm template` output: the text and its parsed documents."""

    text: str
    docs: list[dict]

    def all(self, kind: str) -> list[dict]:
        return [doc for doc in self.docs if doc["kind"] == kind]

    def get(self, kind: str, component: str) -> dict | None:
        """The one object of `kind` labelled app.kubernetes.io/component=<component>, or None."""
        found = [
            doc for doc in self.all(kind)
            if doc["metadata"]["labels"]["app.kubernetes.io/component"] == component
        ]
        assert len(found) <= 1, f"{len(found)} {kind} objects for component {component}"
        return found[0] if found else None

    def container(self, component: str) -> dict:
        deployment = self.get("Deployment", component)
        assert deployment is not None, f"no Deployment for {component}"
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        return container


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)


def template(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)


def render(helm: Path, *args: str) -> Rendered:
    result = template(helm, *args)
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return Rendered(text=result.stdout, docs=docs)


def chart_values(value_set: str) -> dict:
    """The values one of VALUE_SETS renders with: values.yaml deep-merged with its -f files, as
    helm merges them. What the tests compare rendered objects against."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for arg in VALUE_SETS[value_set]:
        if arg != "-f":
            _deep_merge(values, yaml.safe_load(Path(arg).read_text()) or {})
    return values


def _deep_merge(base: dict, override: dict) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value
