"""The pipelining benchmark (benchmarks/bench_pipeline.py) end to end with its --quick preset: a
tiny random-weight float64 pair built by the benchmark itself, the target and the draft started as
`specdec serve ... --cpus` processes pinned to a CPU each, one orchestrator per RTT behind delay
proxies. Checks that every (RTT, schedule, temperature) cell was measured and tabled, that the
services really ran pinned, that greedy outputs equal target-only with and without pipelining,
that the pipelined fixed-K rows drafted ahead and their measured hit rate is what the draft's
teacher-forced candidates predict, and that rows without pipelining never drafted ahead. No timing
assertions: speed is the benchmark's output, not a test."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.process_groups import run_in_group

ROOT = Path(__file__).resolve().parents[2]
HIT_RATE_TOLERANCE = 0.1  # predicted vs measured: the last round of each request may count apart

# A benchmark run of ~1 minute on 2 cores: in the full suite (CI), not in `-m "not slow"`.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline-results")
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_pipeline.py"), "--quick", "--out", str(out),
               "--name", "smoke"]
    result = run_in_group(command, cwd=ROOT, timeout=900)  # its services die with it
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"
    data = json.loads((out / "pipeline-smoke.json").read_text())
    return data, (out / "pipeline-smoke.md").read_text(), result.stdout


def _cells(data: dict) -> dict:
    return {(c["rtt_ms"], c["schedule"], c["temperature"]): c for c in data["cells"]}


def test_every_cell_is_measured_and_tabled(quick_run):
    data, markdown, stdout = quick_run
    config = data["config"]
    assert config["quick"] and config["rtts_ms"] == [0.0, 10.0] and config["repetitions"] == 1
    assert config["schedules"] == ["off", "adaptive/off", "adaptive/auto", "k=1/on", "k=2/on", "k=3/on", "k=4/on",
                                   "k=2/stream"]
    expected = {(r, s, t) for r in config["rtts_ms"] for s in config["schedules"] for t in config["temperatures"]}
    cells = _cells(data)
    assert set(cells) == expected
    for key, cell in cells.items():
        assert cell["tokens_per_second"]["median"] > 0 and cell["tokens"] > 0, key
        assert cell["over_target_only"]["median"] > 0, key
    runs_per_cell = Counter((r["rtt_ms"], r["schedule"], r["temperature"]) for r in data["runs"])
    assert runs_per_cell == {key: config["repetitions"] * len(data["prompts"]) for key in expected}
    labels = config["schedule_labels"]
    for text in (markdown, stdout):
        for schedule in config["schedules"]:
            assert labels[schedule] in text, schedule
        assert "adaptive + pipelining (auto) / adaptive" in text  # the pipelining gain, adaptive
        assert "K=2 + pipelining / target-only" in text
        assert "K=2 + streamed / adaptive" in text
    table_rows = [line for line in markdown.splitlines() if line.startswith("| ") and " ms |" in line]
    assert len(table_rows) >= len(expected)  # a row per cell (and the ratio table's header)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity (Linux)")
def test_the_services_ran_pinned_one_cpu_each(quick_run):
    data, _, _ = quick_run
    config, placements = data["config"], data["placements"]
    available = sorted(os.sched_getaffinity(0))
    assert config["target_cpus"] == str(available[0])
    assert config["draft_cpus"] == str(available[1] if len(available) > 1 else available[0])
    for role in ("target", "draft"):
        cpus = config[f"{role}_cpus"]
        assert placements[role]["cpus"] == cpus, placements[role]
        assert placements[role]["thread_cpus"] == [cpus], placements[role]  # every thread, not just the main one


def test_greedy_outputs_equal_target_only_with_and_without_pipelining(quick_run):
    data, _, _ = quick_run
    greedy = [r for r in data["runs"] if r["temperature"] == 0]
    assert {r["schedule"] for r in greedy} == set(data["config"]["schedules"])
    assert all(r["matches_target_only"] for r in greedy), [r for r in greedy if not r["matches_target_only"]]
    exactness = data["exactness"]
    assert exactness["all_greedy_outputs_match_target_only"] and exactness["greedy_runs"] == len(greedy)
    assert exactness["sampled_fixed_k_not_reproduced"] == []  # a seed reproduces fixed K, pipelined too
    for cell in data["cells"]:
        if cell["temperature"] == 0:
            assert cell["greedy_matches"] == cell["greedy_runs"] > 0, cell["schedule"]


def test_pipelined_rows_draft_ahead_and_the_others_do_not(quick_run):
    data, _, _ = quick_run
    for (rtt, schedule, temperature), cell in _cells(data).items():
        if schedule in ("off", "adaptive/off"):
            assert cell["pipelined_rounds"] == 0 and cell["hit_rate"] is None, (rtt, schedule, temperature)
        if schedule == "off":
            assert cell["mean_k"] == 0 and cell["tau"] == 1.0
        if schedule.endswith("/stream"):  # no rounds: the target's Decode verifies offered drafts
            assert cell["pipelined_rounds"] == 0 and cell["mean_k"] == 0, (rtt, schedule, temperature)
            assert cell["offered_accepted"] <= cell["offered_drafts"], (rtt, schedule, temperature)
        elif schedule.startswith("k="):
            k = int(schedule[2:].split("/")[0])
            assert 0 < cell["mean_k"] <= k, (rtt, schedule, temperature)
            assert cell["pipelined_rounds"] > 0, (rtt, schedule, temperature)
            assert cell["pipeline_hits"] + cell["pipeline_misses"] > 0
            assert 0 <= cell["hit_rate"] <= 1 and cell["mean_fanout"] >= 1
            assert cell["branches_drafted"] >= cell["pipelined_rounds"]
            assert 1 <= cell["tau"] <= k + 1


def test_predicted_hit_rates_match_the_measured_ones(quick_run):
    data, markdown, stdout = quick_run
    prediction = data["prediction"]
    assert prediction["ks"] == [1, 2, 3, 4]
    assert prediction["local_target_agreement_with_reference"] == 1.0  # float64: the same greedy tokens
    for k in prediction["ks"]:
        figures = prediction["by_k"][str(k)]
        rates = [figures["predicted_hit_rate"][str(f)] for f in prediction["fanouts"]]
        assert figures["outcomes"] > 0 and all(0 <= r <= 1 for r in rates), (k, figures)
        assert rates == sorted(rates), (k, rates)  # a wider fan-out never hits less
        assert figures["measured_outcomes"] > 0 and figures["measured_fanouts"], (k, figures)
        gap = abs(figures["measured_hit_rate"] - figures["predicted_hit_rate_at_measured_fanout"])
        assert gap <= HIT_RATE_TOLERANCE, (k, figures)
    for text in (markdown, stdout):
        assert "predicted f=1" in text and "predicted at it" in text
