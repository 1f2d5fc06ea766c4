"""The chart's container args must be accepted by the real `specdec` command line: every rendered
Deployment's args, and the generate command the chart's NOTES print, go through specdec_cli's own
argparse parser, so a renamed or missing flag fails here, not in a cluster."""

from __future__ import annotations

import contextlib
import io
import shlex

import pytest

from specdec_cli.main import build_parser

from tests.deploy.helm_support import CHART, NAMESPACE, RELEASE, VALUE_SETS, render, run_helm

COMPONENTS = ("draft", "target", "orchestrator")


@pytest.fixture(scope="module")
def cli_parser():
    return build_parser()


def _parse_or_fail(parser, args: list[str], what: str) -> None:
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            parser.parse_args(args)
        except SystemExit as exc:
            pytest.fail(f"{what} rejected by `specdec` ({exc.code}): "
                        f"{errors.getvalue().strip()}\nargs: {args}")


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="plain"),
        pytest.param(["--set", "discovery=dns"], id="dns"),
        pytest.param(["--set", "auth.existingSecret=token"], id="auth"),
    ],
)
def test_rendered_args_parse_with_the_real_cli(helm, cli_parser, value_set, extra):
    rendered = render(helm, *VALUE_SETS[value_set], *extra)
    for component in COMPONENTS:
        # The kubelet expands $(POD_NAME) from the env before the process sees it.
        args = [arg.replace("$(POD_NAME)", "pod-0") for arg in rendered.container(component)["args"]]
        _parse_or_fail(cli_parser, args, f"{component} args")


def test_the_generate_command_in_notes_parses(helm, cli_parser):
    result = run_helm(helm, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
                      "--dry-run=client")
    assert result.returncode == 0, result.stderr
    (command,) = [line.strip() for line in result.stdout.split("NOTES:", 1)[1].splitlines()
                  if line.strip().startswith("specdec generate")]
    args = shlex.split(command.replace('"$ADDR"', "localhost:50050"))[1:]
    _parse_or_fail(cli_parser, args, "NOTES' generate command")
