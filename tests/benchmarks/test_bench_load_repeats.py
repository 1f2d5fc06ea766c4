"""bench_load --repeats: a cell's rounds are merged into one (means of figures, sums of counts) and
the spread of speculation off over its rounds is the run's noise, the margin of the "adaptive never
below off" goal (never less than the fixed 5 %); the stack runs the draft method `specdec up` runs.
Pure functions on cell records and the arguments: no services."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_load

from specdec_cli.stack import StackConfig


def _cell(schedule: str, streams: int, tps: float, requests: int = 10) -> dict:
    cell = {name: 1.0 for name in bench_load.MEAN_FIELDS}
    cell.update({name: 1 for name in bench_load.SUM_FIELDS})
    cell.update(schedule=schedule, streams=streams, tokens_per_second=tps, requests_completed=requests,
                errors={}, finish_reasons={"length": requests}, stream_tokens_per_second=[tps / streams] * streams)
    return cell


def test_rounds_of_a_cell_are_merged_and_off_spread_is_the_noise():
    cells = [_cell("off", 4, 40.0), _cell("adaptive", 4, 38.0), _cell("adaptive", 4, 42.0, requests=12),
             _cell("off", 4, 44.0), _cell("off", 8, 60.0), _cell("off", 8, 60.0)]
    merged = {(c["schedule"], c["streams"]): c for c in bench_load.merge_repeats(cells)}
    assert set(merged) == {("off", 4), ("adaptive", 4), ("off", 8)}
    adaptive = merged[("adaptive", 4)]
    assert adaptive["tokens_per_second"] == pytest.approx(40.0)
    assert adaptive["tokens_per_second_rounds"] == [38.0, 42.0]
    assert adaptive["requests_completed"] == 22 and adaptive["finish_reasons"] == {"length": 22}
    # off moved 40 -> 44 at 4 streams (4 / 42 of the mean) and not at all at 8: the run's noise.
    assert bench_load.run_noise(list(merged.values())) == pytest.approx({4: 4.0 / 42.0, 8: 0.0})


def test_one_round_has_no_measured_noise_and_the_goal_keeps_its_floor():
    cells = bench_load.merge_repeats([_cell("off", 1, 20.0), _cell("adaptive", 1, 19.2)])
    assert bench_load.run_noise(cells) == {}
    config = bench_load.parse_args(["--streams", "1", "--schedules", "off,adaptive", "--skip-hf"])
    (never_below,) = [g for g in bench_load.goals(cells, {}, config) if g["goal"].startswith("adaptive over off at every")]
    assert never_below["threshold"] == pytest.approx(1.0 - bench_load.NOISE) and never_below["met"] is True
    # A noisy run widens the margin to what off itself moved at that stream count, never narrows it.
    noisy = bench_load.merge_repeats([_cell("off", 1, 20.0), _cell("off", 1, 24.0), _cell("adaptive", 1, 20.0)])
    (never_below,) = [g for g in bench_load.goals(noisy, {}, config) if g["goal"].startswith("adaptive over off at every")]
    assert never_below["threshold"] == pytest.approx(1.0 - 4.0 / 22.0, abs=1e-3) and never_below["met"] is True
    # Each stream count against its own margin: a quiet count where adaptive lost is not excused
    # by a noisy one.
    config = bench_load.parse_args(["--streams", "1,4", "--schedules", "off,adaptive", "--skip-hf"])
    mixed = bench_load.merge_repeats([_cell("off", 1, 20.0), _cell("off", 1, 24.0), _cell("adaptive", 1, 22.0),
                                      _cell("off", 4, 40.0), _cell("off", 4, 40.4), _cell("adaptive", 4, 37.6)])
    (never_below,) = [g for g in bench_load.goals(mixed, {}, config) if g["goal"].startswith("adaptive over off at every")]
    assert never_below["value"] == pytest.approx(37.6 / 40.2) and never_below["met"] is False
    assert never_below["threshold"] == pytest.approx(1.0 - bench_load.NOISE)


def test_the_stack_runs_the_draft_method_specdec_up_runs_unless_told():
    default = bench_load.parse_args(["--streams", "1", "--skip-hf"])
    assert default.draft_method == StackConfig.draft_method == "hybrid"
    assert "(hybrid draft method)" in bench_load.describe(default, {"cpu_count": 2})[0]
    assert bench_load.parse_args(["--draft-method", "model", "--skip-hf"]).draft_method == "model"
    with pytest.raises(SystemExit):
        bench_load.parse_args(["--draft-method", "ngram"])  # a local stack always runs a model draft
