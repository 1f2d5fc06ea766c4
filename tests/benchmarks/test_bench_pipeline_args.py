"""bench_pipeline's arguments: the RTT on each hop, or (--target-rtt-ms) the target hop's fixed and
--rtts the draft hop's alone. Pure: no services."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_pipeline


def test_rtts_set_each_hop_unless_the_target_hop_is_given():
    each = bench_pipeline.parse_args(["--rtts", "10,30", "--skip-prediction"])
    assert each.target_rtt_ms is None
    assert [each.target_hop_ms(rtt) for rtt in each.rtts_ms] == [10.0, 30.0]
    beside = bench_pipeline.parse_args(["--rtts", "10,30", "--target-rtt-ms", "0", "--skip-prediction"])
    assert [beside.target_hop_ms(rtt) for rtt in beside.rtts_ms] == [0.0, 0.0]
    assert beside.rtts_ms == (10.0, 30.0)  # the draft hop's


def test_a_negative_target_rtt_is_refused():
    with pytest.raises(SystemExit):
        bench_pipeline.parse_args(["--target-rtt-ms", "-1"])
