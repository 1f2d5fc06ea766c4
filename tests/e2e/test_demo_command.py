"""`specdec demo` end to end on the tiny pair: three real processes, both run orders (the target-only
run goes first on even prompts, the speculative one on odd prompts), the table printed. No timing
assertions: the speedup is the demo's output, not a test's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.process_groups import run_in_group

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~10 s: three processes started and stopped, every prompt run twice
def test_demo_runs_both_orders_and_prints_the_table(tiny_pair):
    command = [sys.executable, "-m", "specdec_cli.main", "demo", "--target", str(tiny_pair.target_dir),
               "--draft", str(tiny_pair.draft_dir), "--dtype", "float64", "--port", "0", "--threads", "1",
               "--prompts", "2", "--max-new-tokens", "8", "--quiet"]
    result = run_in_group(command, cwd=ROOT, timeout=600)  # its services die with it
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "differs" not in result.stdout  # speculative output == target-only output
    # It says what it is doing from the start: starting services, then each prompt and each run.
    assert result.stdout.startswith("specdec demo: 2 prompts"), result.stdout[:500]
    assert "with speculation adaptive (hybrid draft) and without" in result.stdout.splitlines()[0]
    assert result.stdout.count("[target-only decoding...]") == 2
    assert result.stdout.count("[speculative decoding (adaptive)...]") == 2
    rows = [line for line in result.stdout.splitlines() if re.match(r"(demo-\S+|overall)\s+\d+\s", line)]
    assert [row.split()[0] for row in rows][-1] == "overall" and len(rows) == 3, result.stdout
    for row in rows:
        assert re.search(r"\d+\.\d\dx$", row), row
    assert re.search(r"speedup over target-only: \d+\.\d\dx", result.stdout)
