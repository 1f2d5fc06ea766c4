"""`specdec bench` against a real orchestrator on the tiny float64 pair (run as a subprocess, as a
user runs it), its one-line refusals, and the plan and figures it computes."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from specdec.v1 import orchestrator_pb2 as pb
from specdec_cli.bench_cmd import Run, builtin_prompts, greedy_mismatches, plan, summarize
from specdec_cli.main import main
from specdec_cli.processes import specdec_command

LINES = [
    {"prompt": "the quick brown fox", "name": "fox"},
    {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6},
    {"prompt_token_ids": [5, 9, 13, 17]},
]


def _closed_port_address() -> str:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{unused.getsockname()[1]}"


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in LINES[:2]) + "\n\n"
                    + json.dumps(LINES[2]) + "\n")
    return path


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(specdec_command("bench", *args), capture_output=True, text=True, timeout=300)


def test_bench_json_on_a_real_pair(stack, prompts_file):
    result = _bench("--orchestrator", stack.address, "--prompts", str(prompts_file),
                    "--schedules", "off,k=2", "--max-new-tokens", "12", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    schedules = report["schedules"]
    assert list(schedules) == ["off", "k=2"]
    for summary in schedules.values():
        assert summary["requests"] == 3
        assert summary["tokens_per_second"] > 0
        assert summary["ttft_seconds"]["p50"] > 0 and summary["itl_seconds"]["p99"] > 0
    assert schedules["off"]["speedup"] == 1.0
    assert schedules["off"]["tau"] == pytest.approx(1.0)
    assert schedules["off"]["acceptance_per_position"] == [] and schedules["off"]["mean_k"] == 0
    speculative = schedules["k=2"]
    assert speculative["speedup"] > 0 and speculative["mean_k"] == pytest.approx(2.0, abs=1.0)
    assert len(speculative["acceptance_per_position"]) == 2
    assert all(0.0 <= rate <= 1.0 for rate in speculative["acceptance_per_position"])
    assert speculative["drafted_per_position"][0] >= speculative["drafted_per_position"][1] > 0
    assert report["greedy"] == {"compared": True, "reference": "off", "identical": True, "mismatches": []}
    runs = report["runs"]
    assert len(runs) == 6
    assert {r["prompt"] for r in runs} == {"fox", f"{prompts_file}:2", f"{prompts_file}:4"}
    assert all(r["generated_tokens"] <= 6 for r in runs if r["prompt"].endswith(":2"))
    # Interleaved: each prompt under both schedules before the next prompt, the order rotated.
    assert [r["schedule"] for r in runs] == ["off", "k=2", "k=2", "off", "off", "k=2"]
    assert "[6/6]" in result.stderr  # progress, on stderr
    # Per request, how it ran: speculation off decodes in Decode calls, K = 2 in Verify rounds
    assert all(r["decode_calls"] >= 1 and r["shadow_probes"] == 0 for r in runs if r["schedule"] == "off")
    assert all(r["decode_calls"] == 0 for r in runs if r["schedule"] == "k=2")
    assert all(r["controller_estimates"] == {} for r in runs)  # no controller at fixed K


def test_bench_json_says_why_adaptive_chose_its_k(stack, prompts_file):
    result = _bench("--orchestrator", stack.address, "--prompts", str(prompts_file),
                    "--schedules", "adaptive", "--max-new-tokens", "12", "--json", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(result.stdout)["runs"]
    assert len(runs) == 3
    for run in runs:
        estimates = run["controller_estimates"]
        assert 0.0 < estimates["alpha"] < 1.0
        assert estimates["num_speculative_tokens"] >= 0 and estimates["rtt_target"] >= 0


def test_bench_table_with_repeats_and_concurrency(stack, prompts_file):
    result = _bench("--orchestrator", stack.address, "--prompts", str(prompts_file),
                    "--schedules", "adaptive,off", "--max-new-tokens", "8", "--repeats", "2",
                    "--concurrency", "2", "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.startswith("specdec bench: 3 prompts x 2 schedules (adaptive, off) x 2 repeats")
    rows: dict[str, list[str]] = {}
    for line in out.splitlines():  # the first table's rows (the per-position table follows)
        if line.split()[:1] in (["adaptive"], ["off"]):
            rows.setdefault(line.split()[0], line.split())
    assert rows["off"][1] == "6" and rows["off"][4] == "1.00x"  # 3 prompts x 2 repeats
    assert rows["adaptive"][1] == "6" and float(rows["adaptive"][3]) > 0
    assert "speedup by repeat: adaptive " in out
    assert "greedy outputs: identical across the schedules for all 3 prompts" in out
    assert "[1/12]" not in result.stderr  # --quiet: no progress


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "ok"', "not valid JSON"),
    ('["a list"]', "a line must be a JSON object"),
    ('{"text": "x"}', "needs exactly one of prompt, messages, prompt_token_ids"),
    ('{"prompt": "x", "prompt_token_ids": [1]}', "needs exactly one of"),
    ('{"prompt": ""}', "prompt must be a non-empty string"),
    ('{"prompt_token_ids": [1, -2]}', "prompt_token_ids must be a non-empty list of non-negative"),
    ('{"messages": [{"role": "user"}]}', "messages must be a non-empty list"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be an integer >= 1"),
])
def test_a_malformed_line_is_refused_naming_it(tmp_path, line, message, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(LINES[0]) + "\n" + line + "\n")
    # Nothing listens at the address: the line is refused before any call.
    assert main(["bench", "--orchestrator", _closed_port_address(), "--prompts", str(path)]) == 2
    captured = capsys.readouterr()
    [error] = captured.err.splitlines()
    assert error.startswith(f"specdec: {path}:2: {message}"), error
    assert captured.out == ""


def test_no_orchestrator_is_one_line_and_exit_2(prompts_file):
    address = _closed_port_address()
    result = _bench("--orchestrator", address, "--prompts", str(prompts_file), "--timeout", "5")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    [error] = result.stderr.splitlines()
    assert error.startswith(f"specdec: no orchestrator answered at {address} (UNAVAILABLE")


@pytest.mark.parametrize("flags, message", [
    (["--schedules", "off,k=0"],
     "--schedules: each one of off, adaptive, heuristic or k=N (N >= 1), got 'k=0'"),
    (["--schedules", "off,OFF"], "--schedules: off is given twice"),
    (["--schedules", " , "], "--schedules: give at least one schedule"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--prompts", "/nonexistent/prompts.jsonl"], "cannot read --prompts /nonexistent/prompts.jsonl"),
])
def test_bad_flags_are_refused_before_any_call(flags, message, capsys):
    assert main(["bench", "--orchestrator", _closed_port_address(), *flags]) == 2
    assert capsys.readouterr().err.startswith(f"specdec: {message}")


def test_plan_interleaves_and_rotates_the_schedules():
    one_at_a_time = plan(2, ["off", "adaptive", "k=2"], repeats=2, concurrency=1)
    assert [batch for batch in one_at_a_time if len(batch) != 1] == []
    order = [item for batch in one_at_a_time for item in batch]
    assert order[:6] == [(0, 0, "off"), (0, 0, "adaptive"), (0, 0, "k=2"),
                         (0, 1, "adaptive"), (0, 1, "k=2"), (0, 1, "off")]
    assert order[6:9] == [(1, 0, "adaptive"), (1, 0, "k=2"), (1, 0, "off")]
    concurrent = plan(3, ["off", "adaptive"], repeats=2, concurrency=4)
    assert [(batch[0][0], batch[0][2], len(batch)) for batch in concurrent] == [
        (0, "off", 3), (0, "adaptive", 3), (1, "adaptive", 3), (1, "off", 3)]


def _run(schedule: str, ks: list[int], ns: list[int], tokens: tuple[int, ...] = (1, 2, 3), prompt: int = 0,
         repeat: int = 0) -> Run:
    rounds = len(ks)
    stats = pb.GenerationStats(rounds=rounds, drafted_tokens=sum(ks), accepted_tokens=sum(ns),
                               mean_accepted_length=(sum(ns) + rounds) / rounds if rounds else 0.0,
                               num_speculative_tokens_per_round=ks, num_accepted_per_round=ns)
    return Run(f"p{prompt}", prompt, repeat, schedule, tokens, 1.0, 0.1, (0.05, 0.05),
               "FINISH_REASON_LENGTH", stats)


def test_summarize_acceptance_per_position_tau_and_speedup():
    runs = [_run("off", [0, 0], [0, 0]), _run("k=3", [3, 3, 1], [3, 0, 1]), _run("k=3", [2], [1], prompt=1)]
    summary = summarize(runs, {("off", 0): 2.0, ("k=3", 0): 1.0}, ["off", "k=3"])
    assert summary["off"]["speedup"] == 1.0 and summary["off"]["tau"] == 1.0
    spec = summary["k=3"]
    assert spec["drafted_per_position"] == [4, 3, 2] and spec["accepted_per_position"] == [3, 1, 1]
    assert spec["acceptance_per_position"] == [0.75, pytest.approx(1 / 3), 0.5]
    assert spec["tau"] == pytest.approx((5 + 4) / 4) and spec["acceptance_rate"] == pytest.approx(5 / 9)
    assert spec["mean_k"] == pytest.approx(9 / 4)
    assert spec["tokens_per_second"] == 6.0 and spec["speedup"] == pytest.approx(4.0)


def test_greedy_mismatches_name_the_schedule_and_the_first_differing_token():
    runs = [_run("adaptive", [1], [1], (1, 2, 3)), _run("off", [0], [0], (1, 2, 3)),
            _run("k=2", [2], [0], (1, 5, 3)), _run("off", [0], [0], (4,), prompt=1),
            _run("adaptive", [1], [1], (4,), prompt=1), _run("k=2", [2], [0], (4,), prompt=1)]
    reference, mismatches = greedy_mismatches(runs, ["adaptive", "off", "k=2"])
    assert reference == "off"
    assert mismatches == [{"prompt": "p0", "reference": "off",
                           "differ": [{"schedule": "k=2", "repeat": 0, "first_difference": 1}]}]


def test_a_small_limit_of_the_built_in_set_covers_every_task_kind():
    from specdec.prompt_sets import BENCHMARK_PROMPTS

    kinds = {p.name: p.kind for p in BENCHMARK_PROMPTS}
    assert {kinds[p.name] for p in builtin_prompts(4)} == {"code", "explanation", "chat", "translation"}
    assert len(builtin_prompts()) == len(BENCHMARK_PROMPTS)
