"""benchmarks/verify_cost.py end to end on the tiny target (grouped-query: 4 heads, 2 key/value
heads, float32): it prints a row per pass size with positive times for both attention
implementations and for specdec's with packed linears, oneDNN's and MKL's (passes of 4 and 5 rows
padded to the packing for 8), writes the same table with --out, the two attention implementations
gave identical logits and each packing the plain ones' up to float rounding. No timing
assertions."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_prints_both_implementations_per_pass_size(tiny_pair, tmp_path):
    out = tmp_path / "verify_cost.md"
    command = [sys.executable, str(ROOT / "benchmarks" / "verify_cost.py"), "--model",
               str(tiny_pair.target_dir), "--threads", "1", "--dtype", "float32", "--context", "20", "--rows", "1,2,3,4,5",
               "--repeats", "3", "--packed-rows", "8", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    cell = r" ([\d.]+) \(([\d.]+)×\) \|"
    rows = re.findall(r"^\| (\d+) \|" + cell * 4 + "$", result.stdout, flags=re.MULTILINE)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5]
    assert all(float(value) > 0 for row in rows for value in row[1:])
    assert rows[0][2] == rows[0][4] == "1.00"  # each relative to its own one-token pass
    assert "| specdec, packed for oneDNN: ms (× one token) | specdec, packed for MKL: ms" in result.stdout
    assert "largest logit difference between hf sdpa and specdec: 0\n" in result.stdout
    packings = re.findall(r"between specdec, packed for (oneDNN|MKL) and plain linears \(float rounding\): "
                          r"([\d.e+-]+);", result.stdout)
    assert [name for name, _ in packings] == ["oneDNN", "MKL"]
    assert all(float(difference) < 1e-4 for _, difference in packings)
    assert out.read_text().strip() == result.stdout.strip()
