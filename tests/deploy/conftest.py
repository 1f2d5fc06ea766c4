"""Fixtures for the Helm chart tests: the real `helm` binary (installed by scripts/install_helm.sh
into .tools/bin), the kubernetes-validate checker, and the chart rendered once per value set.

Outside CI a missing tool skips these tests with the command that installs it; in CI (CI set) it
fails them, so a broken install step can never pass as a green run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.helm_support import HELM, INSTALL_HINT, REPO_ROOT, VALUE_SETS, Rendered, render


def _missing_tool(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI is set, so this fails instead of skipping): {INSTALL_HINT}")
    pytest.skip(f"{message}: {INSTALL_HINT}")


@pytest.fixture(scope="session")
def helm() -> Path:
    if not HELM.is_file():
        _missing_tool(f"helm is not installed at {HELM.relative_to(REPO_ROOT)}")
    return HELM


@pytest.fixture(scope="session")
def kubernetes_validate() -> list[str]:
    """Command prefix for the kubernetes-validate checker in this interpreter."""
    probe = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--version"],
        capture_output=True, text=True,
    )
    if probe.returncode != 0:
        _missing_tool("kubernetes-validate is not installed")
    return [sys.executable, "-m", "kubernetes_validate"]


@pytest.fixture(scope="session")
def rendered_sets(helm: Path) -> dict[str, Rendered]:
    """Every value set rendered once for the whole session (helm runs take ~0.1 s each)."""
    return {name: render(helm, *args) for name, args in VALUE_SETS.items()}
