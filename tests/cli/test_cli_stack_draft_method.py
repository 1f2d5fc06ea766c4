"""Which draft method a local stack (`specdec up`, `specdec demo`) gives its orchestrator: hybrid
unless told otherwise, the model draft when pipelining is asked for (it drafts ahead with the
model), and a one-line refusal of hybrid with pipelining."""

from __future__ import annotations

import pytest

from specdec_cli.main import build_parser, main
from specdec_cli.stack import StackConfig, orchestrator_flags
from specdec_cli.up_cmd import stack_config


@pytest.mark.parametrize("argv, method", [
    (["up"], "hybrid"),
    (["demo"], "hybrid"),
    (["up", "--draft-method", "model"], "model"),
    (["demo", "--draft-method", "hybrid", "--pipeline", "off"], "hybrid"),
    (["up", "--pipeline", "auto"], "model"),
    (["demo", "--pipeline", "on"], "model"),
])
def test_the_stack_draft_method(argv, method):
    config = stack_config(build_parser().parse_args(argv))
    assert config.draft_method == method
    flags = orchestrator_flags(config)
    assert flags[flags.index("--draft-method") + 1] == method


@pytest.mark.parametrize("command", ["up", "demo"])
def test_hybrid_with_pipelining_is_refused_in_one_line(command, capsys):
    # Refused from the flags alone, before any service starts or any signal handler is installed.
    assert main([command, "--draft-method", "hybrid", "--pipeline", "auto", "--port", "0"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "specdec: --pipeline auto drafts ahead with the draft model: it needs --draft-method model, "
        "not hybrid")


def test_every_orchestrator_setting_of_the_stack_reaches_its_command_line():
    config = StackConfig(speculation="fixed", num_speculative_tokens=3, max_num_speculative_tokens=5,
                         pipeline="on", pipeline_fanout=2, draft_method="model", http_port=8123)
    flags = orchestrator_flags(config)
    for flag, value in (("--speculation", "fixed"), ("--num-speculative-tokens", "3"),
                        ("--max-num-speculative-tokens", "5"), ("--pipeline", "on"),
                        ("--pipeline-fanout", "2"), ("--draft-method", "model"), ("--http-port", "8123")):
        assert flags[flags.index(flag) + 1] == value, flag
