"""benchmarks/draft_cold_cost.py end to end on the tiny pair: it runs, and prints the three
one-process cases, the target's step and the two-process turns with positive times. No timing
assertions: speed is the benchmark's output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~8 s on 2 cores: two processes time many model steps
def test_prints_every_case(tiny_pair):
    command = [sys.executable, str(ROOT / "benchmarks" / "draft_cold_cost.py"), "--target",
               str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir), "--threads", "1",
               "--context", "12", "--repeats", "6", "--pauses-ms", "2"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for case in ("back to back", "after a 64 MB memory sweep", "after a target forward pass"):
        (line,) = [line for line in lines if line.startswith(case)]
        milliseconds, cost_ratio = re.search(r"([\d.]+) ms per Propose of K=1\s+\(c = ([\d.]+)\)", line).groups()
        assert float(milliseconds) > 0 and float(cost_ratio) > 0, line
    assert any(line.startswith("target decode step") for line in lines)
    # the two-process case, as the services run
    (line,) = [line for line in lines if line.startswith("two processes, 2 ms pause")]
    draft_ms, cost_ratio, target_ms = re.search(
        r"([\d.]+) ms per Propose of K=1\s+\(c = ([\d.]+)\); target step ([\d.]+) ms", line).groups()
    assert min(float(draft_ms), float(cost_ratio), float(target_ms)) > 0, line
