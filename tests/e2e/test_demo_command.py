"""`specdec demo` end to end on the tiny pair: three real processes, both run orders (the target-only
run goes first on even prompts, the speculative one on odd prompts), the table printed. No timing
assertions: the speedup is the demo's output, not a test's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_both_orders_and_prints_the_table(tiny_pair):
    command = [sys.executable, "-m", "specdec_cli.main", "demo", "--target", str(tiny_pair.target_dir),
               "--draft", str(tiny_pair.draft_dir), "--dtype", "float64", "--port", "0", "--threads", "1",
               "--prompts", "2", "--max-new-tokens", "8", "--quiet"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "differs" not in result.stdout  # speculative output == target-only output
    rows = [line for line in result.stdout.splitlines() if re.match(r"(demo-\S+|overall)\s+\d+\s", line)]
    assert [row.split()[0] for row in rows][-1] == "overall" and len(rows) == 3, result.stdout
    for row in rows:
        assert re.search(r"\d+\.\d\dx$", row), row
    assert re.search(r"speedup over target-only: \d+\.\d\dx", result.stdout)
