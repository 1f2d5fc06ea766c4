"""The chart's container args must be accepted by the real `specdec` command line: every rendered
Deployment's args, and the generate command the chart's NOTES print, go through specdec_cli's own
argparse parser, so a renamed or missing flag fails here, not in a cluster."""

from __future__ import annotations

import contextlib
import io
import shlex

import pytest

from draft_service.lookup_service import LookupDraftConfig
from orchestrator.local_draft import draft_method_of
from specdec_cli.main import build_parser
from specdec_cli.serve_cmd import orchestrator_config

from tests.deploy.helm_support import CHART, NAMESPACE, RELEASE, VALUE_SETS, render, run_helm

COMPONENTS = ("draft", "target", "orchestrator")


@pytest.fixture(scope="module")
def cli_parser():
    return build_parser()


def _parse_or_fail(parser, args: list[str], what: str):
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            return parser.parse_args(args)
        except SystemExit as exc:
            pytest.fail(f"{what} rejected by `specdec` ({exc.code}): "
                        f"{errors.getvalue().strip()}\nargs: {args}")


def _container_args(rendered, component: str) -> list[str]:
    # The kubelet expands $(POD_NAME) from the env before the process sees it.
    return [arg.replace("$(POD_NAME)", "pod-0") for arg in rendered.container(component)["args"]]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="plain"),
        pytest.param(["--set", "discovery=dns"], id="dns"),
        pytest.param(["--set", "auth.existingSecret=token"], id="auth"),
        pytest.param(["--set", "orchestrator.draftMethod=suffix",
                      "--set", "orchestrator.suffixCache=shared"], id="local-suffix"),
        pytest.param(["--set", "orchestrator.draftMethod=hybrid", "--set", "draft.method=suffix",
                      "--set", "draft.suffixCache=shared"], id="hybrid-lookup-pool"),
    ],
)
def test_rendered_args_parse_with_the_real_cli(helm, cli_parser, value_set, extra):
    rendered = render(helm, *VALUE_SETS[value_set], *extra)
    # A lookup in the orchestrator has no draft pool to run.
    local = "orchestrator.draftMethod=suffix" in extra
    assert (rendered.get("Deployment", "draft") is None) == local
    for component in COMPONENTS:
        if component == "draft" and local:
            continue
        _parse_or_fail(cli_parser, _container_args(rendered, component), f"{component} args")


@pytest.mark.parametrize("cache", ["session", "shared"])
@pytest.mark.parametrize("method", ["model", "hybrid", "ngram", "suffix"])
def test_orchestrator_draft_methods_mean_the_same_to_the_cli(helm, cli_parser, method, cache):
    """Beyond parsing: the orchestrator's own config (OrchestratorConfig, which refuses a --draft
    and --draft-method that disagree) takes the rendered args, and its effective method and suffix
    cache are the chart's values (the cache where the method has a suffix lookup)."""
    rendered = render(helm, "--set", f"orchestrator.draftMethod={method}",
                      "--set", f"orchestrator.suffixCache={cache}")
    parsed = _parse_or_fail(cli_parser, _container_args(rendered, "orchestrator"), "orchestrator args")
    config = orchestrator_config(parsed)
    assert draft_method_of(config.draft, config.draft_method) == method
    assert config.draft.startswith("local:") == (method in ("ngram", "suffix"))
    expected_cache = cache if method in ("suffix", "hybrid") else "session"
    assert config.lookup.suffix_cache == expected_cache


@pytest.mark.parametrize("cache", ["session", "shared"])
@pytest.mark.parametrize("method", ["model", "ngram", "suffix"])
def test_draft_pool_methods_mean_the_same_to_the_cli(helm, cli_parser, method, cache):
    """The draft pool's args parse to the chart's method, and a lookup's to the LookupDraftConfig
    `specdec serve draft` builds from them."""
    rendered = render(helm, "--set", f"draft.method={method}", "--set", f"draft.suffixCache={cache}")
    parsed = _parse_or_fail(cli_parser, _container_args(rendered, "draft"), "draft args")
    assert parsed.method == method
    if method != "model":
        lookup = LookupDraftConfig(method=parsed.method, suffix_cache=parsed.suffix_cache)
        assert lookup.suffix_cache == (cache if method == "suffix" else "session")
    target = _parse_or_fail(cli_parser, _container_args(rendered, "target"), "target args")
    # A lookup speaks the target's vocabulary: it reads the target's model directory.
    assert (parsed.model == target.model) == (method != "model")


def test_the_generate_command_in_notes_parses(helm, cli_parser):
    result = run_helm(helm, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
                      "--dry-run=client")
    assert result.returncode == 0, result.stderr
    (command,) = [line.strip() for line in result.stdout.split("NOTES:", 1)[1].splitlines()
                  if line.strip().startswith("specdec generate")]
    args = shlex.split(command.replace('"$ADDR"', "localhost:50050"))[1:]
    _parse_or_fail(cli_parser, args, "NOTES' generate command")
