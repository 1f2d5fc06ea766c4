"""benchmarks/shared_cores.py end to end on the tiny pair: a row per mode (alone, overlapping,
pass lock) with positive rates and times, the draft's only where it runs, the target alone at
1.00x, and the same table in its results file. No timing assertions."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_prints_a_row_per_mode(tiny_pair, tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "shared_cores.py"), "--target", str(tiny_pair.target_dir),
               "--draft", str(tiny_pair.draft_dir), "--dtype", "float32", "--sessions", "2", "--context", "8",
               "--seconds", "0.5", "--rounds", "1", "--out", str(tmp_path), "--name", "smoke"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^\| (alone|overlapping|pass lock) \| ([\d.]+) \| ([\d.]+) \| ([\d.-]+) \| ([\d.-]+) \| ([\d.]+)x \|$",
                      result.stdout, flags=re.MULTILINE)
    assert [row[0] for row in rows] == ["alone", "overlapping", "pass lock"]
    for mode, rate, target_ms, draft_ms, draft_rate, ratio in rows:
        assert float(rate) > 0 and float(target_ms) > 0 and float(ratio) > 0
        assert (draft_ms == "-") == (draft_rate == "-") == (mode == "alone")
        if mode != "alone":
            assert float(draft_ms) > 0 and float(draft_rate) > 0
    assert rows[0][5] == "1.00"
    assert (tmp_path / "shared-cores-smoke.md").read_text().strip() in result.stdout
    assert (tmp_path / "shared-cores-smoke.json").is_file()
