"""The load benchmark (benchmarks/bench_load.py) end to end with its --quick preset on tiny float64
models: the three services as separate processes, closed-loop concurrent streams for every
(schedule, stream count) cell, and Hugging Face batched generate in-process. Checks that every
cell was measured and the table printed. No timing assertions: speed is the benchmark's output,
not a test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.process_groups import run_in_group

ROOT = Path(__file__).resolve().parents[2]

# A benchmark run of ~30 s on 2 cores: in the full suite (CI), not in `-m "not slow"`.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("load-results")
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_load.py"), "--quick",
               "--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir),
               "--dtype", "float64", "--out", str(out), "--name", "smoke"]
    result = run_in_group(command, cwd=ROOT, timeout=900)  # its services die with it
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-6000:]}"
    data = json.loads((out / "load-smoke.json").read_text())
    return data, (out / "load-smoke.md").read_text(), result.stdout


def test_every_cell_is_measured(quick_run):
    data, _, _ = quick_run
    config = data["config"]
    assert config["quick"] and set(config["schedules"]) == {"off", "adaptive", "k=2"}
    cells = {(c["schedule"], c["streams"]): c for c in data["cells"]}
    assert set(cells) == {(s, n) for s in config["schedules"] for n in config["streams"]}
    for key, cell in cells.items():
        assert cell["tokens_per_second"] > 0, key
        assert cell["requests_completed"] >= 1 and not cell["errors"], key
        assert len(cell["stream_tokens_per_second"]) == cell["streams"], key
        assert cell["ttft_p50"] is not None and cell["itl_p50"] is not None, key
        assert cell["ttft_p50"] <= cell["ttft_p99"] and cell["itl_p50"] <= cell["itl_p99"], key
    assert cells[("off", 1)]["mean_k"] == 0
    assert 0 < cells[("k=2", 1)]["mean_k"] <= 2


def test_the_hf_anchor_is_measured_at_every_batch_size(quick_run):
    data, _, _ = quick_run
    config = data["config"]
    assert set(data["hf_generate"]) == set(config["hf_dtypes"])
    for figures in data["hf_generate"].values():
        assert set(figures) == {str(n) for n in config["streams"]}
        assert all(f["tokens_per_second"] > 0 for f in figures.values())
    assert set(data["comparisons"]["off_over_hf_best"]) == {str(n) for n in config["streams"]}


def test_the_tables_and_goals_are_printed(quick_run):
    data, markdown, stdout = quick_run
    for schedule in data["config"]["schedules"]:
        assert any(line.startswith(f"| {schedule} |") for line in markdown.splitlines()), schedule
        assert any(line.startswith(schedule) for line in stdout.splitlines()), schedule
    assert "TTFT p50" in stdout and "slowest/median" in stdout and "Goals:" in stdout
    assert "HF float32 tok/s" in stdout
    assert data["config"]["draft_method"] == "hybrid" and "(hybrid draft method)" in stdout
    assert data["goals"] and all("met" in goal for goal in data["goals"])


def test_schedules_name_a_pipeline_mode():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_load
    from specdec.v1 import orchestrator_pb2 as pb

    auto = bench_load.speculation("adaptive/auto")
    assert auto.mode == pb.SPECULATION_MODE_ADAPTIVE and auto.pipeline == pb.PIPELINE_MODE_AUTO
    on = bench_load.speculation("k=2/on")
    assert (on.mode, on.num_speculative_tokens, on.pipeline) == (pb.SPECULATION_MODE_FIXED, 2, pb.PIPELINE_MODE_ON)
    assert bench_load.speculation("adaptive").pipeline == pb.PIPELINE_MODE_UNSPECIFIED
    for bad in ("off/on", "adaptive/sometimes", "k=0/on"):
        with pytest.raises(ValueError):
            bench_load.speculation(bad)
