"""The `specdec` command line itself: a parser built without torch (the client commands start in
a fraction of a second), every command's module imported when it runs and never skipped, help
that shows defaults, and flag defaults read from the config dataclasses."""

from __future__ import annotations

import subprocess
import sys

import pytest

import specdec_cli.main as cli
from specdec_cli.processes import specdec_command

HEAVY = ("torch", "transformers")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_parser_and_the_client_commands_import_neither_torch_nor_transformers():
    result = _python(
        "import specdec_cli.main as m; m.build_parser(); "
        "import specdec_cli.generate_cmd, specdec_cli.pools_cmd, specdec_cli.bench_cmd, specdec_cli.client; "
        "import sys; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, "
        "sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'transformers'))[:5]")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command", [["generate", "--help"], ["pools", "--help"], ["bench", "--help"],
                                     ["--help"]])
def test_help_of_a_client_command_runs_without_torch(command):
    # -X importtime lists every module the process imported, on stderr.
    result = subprocess.run([sys.executable, "-X", "importtime", *specdec_command(*command)[1:]],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    heavy = sorted(name for name in imported if name.split(".")[0] in HEAVY)
    assert not heavy, heavy[:5]
    assert "usage: specdec" in result.stdout


def test_generate_help_shows_defaults_and_explains_every_flag():
    result = subprocess.run(specdec_command("generate", "--help"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "(default: 127.0.0.1:50050)" in text
    assert "256" in text  # the server's default of --max-new-tokens
    for flag in ("--top-p", "--top-k", "--seed", "--temperature", "--tls-server-name"):
        described = text.split(f"{flag} {flag[2:].upper().replace('-', '_')}")[-1].split(" --")[0]
        assert len(described.split()) >= 2, (flag, described)  # some words of help after the flag


def test_every_command_builds_its_parser():
    parser = cli.build_parser()
    for name in cli.COMMANDS:
        with pytest.raises(SystemExit) as exited:
            parser.parse_args([name, "--help"])
        assert exited.value.code == 0, name


def test_a_command_whose_module_does_not_import_fails_loudly(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "broken", ("no_such_command_module", "a command that is gone"))
    assert "broken" in cli.build_parser().format_help()  # listed, not silently dropped
    with pytest.raises(ModuleNotFoundError, match="no_such_command_module"):
        cli.main(["broken"])


def test_a_real_bug_keeps_its_traceback(monkeypatch):
    import specdec_cli.pools_cmd as pools_cmd

    def broken(args):
        raise RuntimeError("a bug, not a user error")

    monkeypatch.setattr(pools_cmd, "run", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["pools"])


@pytest.mark.parametrize("argv, dest, config, field", [
    (["serve", "orchestrator", "--target", "t:1", "--draft", "d:1"], "startup_timeout",
     "orchestrator.service.OrchestratorConfig", "startup_timeout_seconds"),
    (["serve", "orchestrator", "--target", "t:1", "--draft", "d:1"], "default_max_new_tokens",
     "orchestrator.service.OrchestratorConfig", "default_max_new_tokens"),
    (["serve", "orchestrator", "--target", "t:1", "--draft", "d:1"], "pool_refresh_seconds",
     "orchestrator.pool.PoolConfig", "refresh_seconds"),
    (["serve", "target", "--model", "m"], "max_sessions", "specdec.sessions.SessionBudget", "max_sessions"),
    (["serve", "target", "--model", "m"], "session_ttl", "specdec.sessions.SessionBudget", "ttl_seconds"),
    (["serve", "target", "--model", "m"], "max_queue", "specdec.serving.ServiceConfig", "max_queue"),
    (["serve", "draft", "--model", "m"], "grace_seconds", "specdec.rpc.server.ServerConfig", "grace_seconds"),
    (["up"], "port", "specdec_cli.stack.StackConfig", "port"),
    (["proxy", "--upstream", "h:1"], "delay_ms", "specdec.delay_proxy.DelayProxyConfig", "one_way_delay_ms"),
])
def test_a_flag_takes_its_default_from_the_config_dataclass(monkeypatch, argv, dest, config, field):
    import importlib

    module, name = config.rsplit(".", 1)
    fields = getattr(importlib.import_module(module), name).__dataclass_fields__
    monkeypatch.setattr(fields[field], "default", 4321)
    assert getattr(cli.build_parser().parse_args(argv), dest) == 4321
