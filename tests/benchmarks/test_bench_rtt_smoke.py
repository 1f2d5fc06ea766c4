"""The RTT benchmark (benchmarks/bench_rtt.py) end to end with its --quick preset on tiny float64
models: services as separate processes, delay proxies, one orchestrator per RTT. Checks that every
(RTT, schedule, temperature) cell was measured, that the delay really was on the wire, and that
every greedy output equals target-only decoding. No timing assertions: speed is the benchmark's
output, not a test."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.process_groups import run_in_group

ROOT = Path(__file__).resolve().parents[2]

# A benchmark run of ~20 s on 2 cores: in the full suite (CI), not in `-m "not slow"`.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("rtt-results")
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_rtt.py"), "--quick",
               "--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir),
               "--dtype", "float64", "--out", str(out)]
    result = run_in_group(command, cwd=ROOT, timeout=600)  # its services die with it
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"
    (json_path,) = out.glob("rtt_*.json")
    (markdown_path,) = out.glob("rtt_*.md")
    return json.loads(json_path.read_text()), markdown_path.read_text(), result.stdout


def test_every_cell_is_measured(quick_run):
    data, _, _ = quick_run
    config = data["config"]
    assert config["quick"] and {"adaptive", "heuristic"} <= set(config["schedules"])
    assert 0.0 in config["rtts_ms"] and max(config["rtts_ms"]) > 0
    expected = {(rtt, schedule, temperature) for rtt in config["rtts_ms"]
                for schedule in config["schedules"] for temperature in config["temperatures"]}
    cells = {(c["rtt_ms"], c["schedule"], c["temperature"]): c for c in data["cells"]}
    assert set(cells) == expected
    for key, cell in cells.items():
        figures = cell["tokens_per_second"]
        assert figures["min"] > 0 and figures["median"] > 0, key
        assert len(figures["per_repetition"]) == config["repetitions"], key
    runs_per_cell = Counter((r["rtt_ms"], r["schedule"], r["temperature"]) for r in data["runs"])
    assert runs_per_cell == {key: config["repetitions"] * config["prompts"] for key in expected}
    assert all(r["generated_tokens"] > 0 for r in data["runs"])


def test_greedy_outputs_of_all_schedules_equal_target_only(quick_run):
    data, _, _ = quick_run
    greedy = [r for r in data["runs"] if r["temperature"] == 0]
    assert greedy
    assert all(r["matches_target_only"] for r in greedy), [r for r in greedy if not r["matches_target_only"]]
    for index, prompt in enumerate(data["prompts"]):
        digests = {r["output_digest"] for r in greedy if r["prompt"] == prompt}
        assert digests == {data["target_only_reference_digests"][index]}, prompt
    exactness = data["exactness"]
    assert exactness["all_greedy_outputs_match_target_only"] and not exactness["greedy_mismatches"]
    assert exactness["sampled_fixed_k_not_reproduced"] == []  # a seed reproduces a fixed-K schedule


def test_delay_is_on_the_wire(quick_run):
    data, _, _ = quick_run
    for run in data["runs"]:
        # Every round makes at least one target call through the proxy, which holds each
        # direction for half the RTT, except the K = 0 rounds a Decode call streamed: one call
        # for all of them.
        target_calls = run["rounds"] - run["decoded_tokens"] + run["decode_calls"]
        assert run["decoded_tokens"] >= run["decode_calls"] >= 0
        assert run["network_seconds"] >= 0.99 * run["rtt_ms"] / 1000 * target_calls, run


def test_comparisons_goals_and_table(quick_run):
    data, markdown, stdout = quick_run
    config = data["config"]
    fixed = {s for s in config["schedules"] if s.startswith("K=")}
    comparisons = {(c["rtt_ms"], c["temperature"]): c for c in data["comparisons"]}
    assert set(comparisons) == {(r, t) for r in config["rtts_ms"] for t in config["temperatures"]}
    for comparison in comparisons.values():
        assert comparison["best_fixed"] in fixed
        assert comparison["compared_on_repetitions"] == [1]  # one repetition: compared on it
        assert comparison["adaptive_over_best_fixed"]["median"] > 0
        assert comparison["adaptive_over_heuristic"]["median"] > 0
        assert isinstance(comparison["meets_best_fixed_goal"], bool)
    assert isinstance(data["goals"]["adaptive_at_least_0.95_of_best_fixed_everywhere"], bool)
    for text in (stdout, markdown):
        assert "adaptive / best fixed" in text and "adaptive / heuristic" in text
        assert "picked and compared on the same repetition" in text
    assert markdown.count("\n|") >= len(config["schedules"]) * len(config["temperatures"])
