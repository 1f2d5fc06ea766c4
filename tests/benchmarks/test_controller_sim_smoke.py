"""benchmarks/controller_sim.py runs and prints one ratio per schedule (a simulation of the K
controller; deterministic for a seed, but its figures are the script's output, not a test's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_simulation_prints_every_schedule() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "controller_sim.py"), "--seeds", "2", "--passes", "1"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = dict(line.rsplit(None, 1) for line in result.stdout.splitlines()[2:])
    names = {name.strip() for name in rows}
    assert names == {"K=1", "K=2", "K=3", "adaptive (defaults)", "adaptive, no optimism",
                     "adaptive, line-only fit"}
    assert all(float(ratio) > 0 for ratio in rows.values())
