"""The pair benchmark (benchmarks/bench_pair.py) end to end with its --quick preset on tiny float64
models: the three services as separate processes, a fixed-K sweep, adaptive K, concurrent streams
and Hugging Face assisted generation in-process. Checks that every cell was measured, that the
per-round records add up to the totals, that the measured cost model and its bound are there, and
that every greedy output equals target-only decoding. No timing assertions: speed is the
benchmark's output, not a test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.process_groups import run_in_group

ROOT = Path(__file__).resolve().parents[2]

# A benchmark run of ~15 s on 2 cores: in the full suite (CI), not in `-m "not slow"`.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("pair-results") / "pair.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_pair.py"), "--quick", "--threads", "1",
               "--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir),
               "--dtype", "float64", "--out", str(out)]
    result = run_in_group(command, cwd=ROOT, timeout=900)  # its services die with it
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_every_schedule_and_temperature_is_measured(quick_run):
    data, markdown = quick_run
    for temperature in ("0.0", "0.7"):
        assert set(data["speedup"][temperature]) == {"k=1", "k=4", "adaptive"}
        assert all(ratio > 0 for ratio in data["speedup"][temperature].values())
        assert data["target_only_tps"][temperature] > 0
        assert data["hf_assisted"][temperature]["assisted_tps"] > 0
    assert set(data["concurrency"]) == {"1", "4"}
    assert "| 0.0 | adaptive |" in markdown
    for temperature in ("0.0", "0.7"):  # tau and mean K for every schedule, adaptive included
        assert set(data["tau"][temperature]) == set(data["mean_k"][temperature]) == {"k=1", "k=4", "adaptive"}
        assert data["tau"][temperature]["adaptive"] >= 1.0
        assert data["mean_k"][temperature]["k=4"] <= 4.0
    assert "nan" not in markdown.split("\n\n")[0]  # the speedup table has every cell


def test_per_round_records_add_up(quick_run):
    data, _ = quick_run
    for run in data["runs"]:
        assert len(run["ks"]) == len(run["accepted_per_round"]) == run["rounds"], run["schedule"]
        assert sum(run["ks"]) == run["drafted"] and sum(run["accepted_per_round"]) == run["accepted"]
        assert all(0 <= n <= k for k, n in zip(run["ks"], run["accepted_per_round"]))
        if run["schedule"].startswith("k="):
            limit = int(run["schedule"][2:])
            assert max(run["ks"]) <= limit and run["ks"][0] == limit
        if run["schedule"] == "off":
            assert run["drafted"] == 0


def test_the_cost_model_and_its_bound_are_measured(quick_run):
    model = quick_run[0]["model"]
    assert 0.0 <= model["alpha"] <= 1.0 and model["t_step"] > 0 and model["t_draft"] > 0
    # T_verify by row count: 1 row (target-only) and K + 1 for each fixed K of the sweep
    assert set(model["verify_by_rows"]) == {"1", "2", "5"}
    assert all(seconds > 0 for seconds in model["verify_by_rows"].values())
    assert model["bound"] > 0
    # The target's step accounts for the plain runs' time (speculation off decodes in Decode calls,
    # whose server timing is not per pass: taken from it, the step came out at a twentieth).
    plain = [run for run in quick_run[0]["runs"] if run["schedule"] == "off" and run["temperature"] == 0]
    busy = sum(run["seconds"] - run["network_seconds"] for run in plain)
    assert model["t_step"] * sum(run["generated"] for run in plain) >= 0.5 * busy


def test_greedy_outputs_equal_target_only(quick_run):
    assert quick_run[0]["greedy_mismatches"] == []
