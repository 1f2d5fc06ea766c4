"""The draft-method benchmark (benchmarks/bench_drafts.py) end to end with its --quick preset on
tiny float64 models: target and draft services and four orchestrators (model, ngram, suffix,
hybrid) as separate processes. Checks that every (temperature, prompt set, method) cell was
measured, that each method's tokens are named after it, that the target's own count of verify rows
agrees with the orchestrator's rounds, that /metrics' counters by method add up to the per-request
stats, and that every greedy output equals target-only decoding. No timing assertions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.process_groups import run_in_group

ROOT = Path(__file__).resolve().parents[2]
METHODS = {"target-only", "model", "ngram", "suffix", "hybrid"}

# Several services and ~100 requests: in the full suite (CI), not in `-m "not slow"`.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafts-results") / "drafts.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_drafts.py"), "--quick", "--threads", "1",
               "--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir),
               "--dtype", "float64", "--out", str(out)]
    result = run_in_group(command, cwd=ROOT, timeout=900)  # its services die with it
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_every_method_prompt_set_and_temperature_is_measured(quick_run):
    data, markdown = quick_run
    assert set(data["summary"]) == {"0.0", "0.7"}
    for temperature, sets in data["summary"].items():
        assert set(sets) == {"grounded", "open-ended"}
        for prompt_set, cells in sets.items():
            assert set(cells) == METHODS
            for method, figures in cells.items():
                assert figures["runs"] == 2 and figures["tokens_per_second"] > 0, (temperature, prompt_set, method)
                assert figures["ratio_vs_target_only"] > 0 and figures["tau"] >= 1.0
            assert cells["target-only"]["drafted"] == 0
            assert cells["target-only"]["ratio_vs_target_only"] == pytest.approx(1.0)
            assert cells["target-only"]["verify_rows_per_pass"] == pytest.approx(1.0)
    assert "| 0.7 | grounded | suffix |" in markdown
    assert len(data["prompts"]["grounded"]) == len(data["prompts"]["open-ended"]) == 2


def test_each_method_names_its_own_drafts(quick_run):
    data, _ = quick_run
    allowed = {"target-only": set(), "model": {"model"}, "ngram": {"ngram"}, "suffix": {"suffix"},
               "hybrid": {"model", "suffix"}}
    for run in data["runs"]:
        assert set(run["drafted_by_method"]) <= allowed[run["method"]], run["method"]
        assert sum(run["drafted_by_method"].values()) == run["drafted"]
        assert sum(run["accepted_by_method"].values()) == run["accepted"]
    # The lookups find matches in the prompts that they are given (the tiny pair's prompts are
    # characters, so even the open-ended ones repeat pairs of them).
    for method in ("ngram", "suffix"):
        assert sum(r["drafted"] for r in data["runs"] if r["method"] == method) > 0, method


def test_the_target_counts_the_verify_rows_the_orchestrator_sent(quick_run):
    data, _ = quick_run
    for run in data["runs"]:
        # One Verify pass of K + 1 rows per round, a Decode step's row and the tokens it looked up
        # (each accepted one a round with no pass of its own); the prompt's prefill is the rest.
        rows = run["target_rows"] - run["prompt_tokens"]
        looked_up = run["decode_lookup_drafts"] - run["decode_lookup_accepted"]
        assert rows == run["rounds"] + run["drafted"] + looked_up, (run["prompt"], run["method"])
        assert run["target_passes"] > run["rounds"] - run["decode_lookup_accepted"]  # and the prefill


def test_metrics_by_method_add_up_to_the_request_stats(quick_run):
    data, _ = quick_run
    for orchestrator, scraped in data["metrics_by_method"].items():
        served = ["target-only", "model"] if orchestrator == "model" else [orchestrator]
        runs = [r for r in data["runs"] if r["method"] in served]
        for key in ("drafted", "accepted"):
            expected: dict[str, int] = {}
            for run in runs:
                for name, count in run[f"{key}_by_method"].items():
                    expected[name] = expected.get(name, 0) + count
            # a counter at 0 may be absent from /metrics and present (as 0) in the stats
            assert ({name: value for name, value in scraped[key].items() if value}
                    == {name: value for name, value in expected.items() if value}), (orchestrator, key)


def test_greedy_outputs_equal_target_only(quick_run):
    assert quick_run[0]["greedy_mismatches"] == []
