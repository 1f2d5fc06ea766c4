"""benchmarks/cold_start.py end to end, short: a cold and a warm stack of the emulated pair, each
measured by `specdec bench` (off, adaptive, K = 4), greedy outputs identical, the table and the
result files written. No figure is asserted (no timing in tests); the benchmark prints them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two stacks of three processes each
def test_cold_and_warm_stacks_are_measured(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "cold_start.py"), "--prompts", "1",
               "--max-new-tokens", "8", "--out", str(tmp_path), "--name", "smoke"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| cold", "| warm"))]
    assert len(rows) == 2 and all(row.endswith("| identical |") for row in rows), result.stdout
    data = json.loads((tmp_path / "cold-start-smoke.json").read_text())
    assert [c["cold_seconds"] for c in data["conditions"]] == [0.3, 0.0]
    for condition in data["conditions"]:
        assert set(condition["schedules"]) == {"off", "adaptive", "k=4"}
        assert len(condition["adaptive_verify_fit_one_row"]) == 1
    assert (tmp_path / "cold-start-smoke.md").is_file()
    assert not (tmp_path / "cold-start-smoke.work").exists()  # the pair and the stretcher are removed
