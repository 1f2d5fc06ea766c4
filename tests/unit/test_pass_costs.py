"""What one more row costs a pass (specdec/pass_costs.py), from step passes: no servers, no clocks."""

from __future__ import annotations

import random

import pytest

from specdec.pass_costs import RowPrice, StepPassCosts


def test_the_line_through_step_passes_prices_a_row_for_the_sessions_in_the_pass() -> None:
    costs = StepPassCosts()
    assert costs.price() is None
    rng = random.Random(4)
    for _ in range(300):  # 4 sessions, 0-12 looked-up rows among them: T = 60 ms + 2 ms a row
        rows = 4 + rng.randint(0, 12)
        costs.record(rows, 4, (0.060 + 0.002 * rows) * rng.uniform(0.95, 1.05))
    a, b = costs.line()
    assert b == pytest.approx(0.002, rel=0.2) and a == pytest.approx(0.060, rel=0.1)
    costs.record(6, 4, 0.072)
    a, b = costs.line()
    price = costs.price()
    assert price.sessions == 4 and price.rows == 6
    assert price.chance == pytest.approx(4 * b / (a + 6 * b))
    assert price.chance == pytest.approx(4 * 0.002 / 0.072, rel=0.25)


def test_no_price_while_the_rows_have_not_varied() -> None:
    costs = StepPassCosts()
    for _ in range(50):
        costs.record(4, 4, 0.06)
    assert costs.line() is None and costs.price() is None


def test_a_price_is_at_most_one_and_old_passes_fade() -> None:
    assert RowPrice(64, 64, 1.0, 0.5).chance == 1.0
    costs = StepPassCosts(decay=0.9)
    for rows in range(1, 40):
        costs.record(rows % 8 + 1, 1, 0.01 * (rows % 8 + 1))  # 10 ms a row
    for rows in range(1, 200):
        costs.record(rows % 8 + 1, 1, 0.05 + 0.001 * (rows % 8 + 1))  # now 1 ms a row
    assert costs.line()[1] == pytest.approx(0.001, rel=0.05)
