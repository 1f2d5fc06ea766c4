"""The demo's check that the machine was quiet enough for its speedup figure to mean something."""

from __future__ import annotations

from specdec_cli.demo_cmd import BUSY_SPREAD, busy_machine_warning


def test_a_steady_target_speed_gives_no_warning():
    assert busy_machine_warning([10.0, 12.5, 14.0]) is None
    assert busy_machine_warning([10.0, 10.0 * BUSY_SPREAD]) is None  # at the limit
    assert busy_machine_warning([7.0]) is None  # one prompt: nothing to compare
    assert busy_machine_warning([]) is None


def test_a_large_spread_warns_that_the_figure_is_unreliable():
    warning = busy_machine_warning([1.5, 29.5, 12.0])  # measured under load on a shared machine
    assert warning is not None
    assert "1.5 to 29.5 tokens/s" in warning and "19.7x" in warning
    assert "busy" in warning and "unreliable" in warning


def test_the_limit_is_a_parameter():
    assert busy_machine_warning([10.0, 25.0], limit=3.0) is None
    assert busy_machine_warning([10.0, 25.0], limit=2.0) is not None
