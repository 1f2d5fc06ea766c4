"""benchmarks/batch_exactness.py end to end on the tiny target in float64: decoding the prompts
together in shared passes gives exactly the outputs each gets alone, and the table and result
files say so. (On the float32 default pair the script reports near-tie flips; here there are
none to report.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_float64_batched_greedy_equals_alone(tiny_pair, tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "batch_exactness.py"), "--target",
               str(tiny_pair.target_dir), "--dtypes", "float64", "--streams", "6",
               "--max-new-tokens", "10", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| float64 | 6 | 0 | none |" in result.stdout
    (written,) = tmp_path.glob("batch-exactness-*.json")
    data = json.loads(written.read_text())
    assert data["dtypes"]["float64"] == {"streams": 6, "differences": []}
