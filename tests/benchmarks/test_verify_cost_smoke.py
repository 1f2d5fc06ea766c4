"""benchmarks/verify_cost.py end to end on the tiny target (grouped-query: 4 heads, 2 key/value
heads): it prints a row per pass size with positive times for both attention implementations,
writes the same table with --out, and the two gave identical logits. No timing assertions."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_prints_both_implementations_per_pass_size(tiny_pair, tmp_path):
    out = tmp_path / "verify_cost.md"
    command = [sys.executable, str(ROOT / "benchmarks" / "verify_cost.py"), "--model",
               str(tiny_pair.target_dir), "--threads", "1", "--context", "20", "--rows", "1,2,3",
               "--repeats", "3", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \(([\d.]+)×\) \| ([\d.]+) \(([\d.]+)×\) \|$",
                      result.stdout, flags=re.MULTILINE)
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    assert all(float(value) > 0 for row in rows for value in row[1:])
    assert [(r[2], r[4]) for r in rows][0] == ("1.00", "1.00")  # each relative to its own one-token pass
    assert "largest logit difference between the two: 0\n" in result.stdout
    assert out.read_text().strip() == result.stdout.strip()
