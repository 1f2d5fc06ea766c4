"""What one more row costs a model service's forward pass, measured on its own passes (plain
Python): the price a target puts on the rows of the tokens it looks up in its Decode passes.

A line T(rows) = a + b rows through the service's step passes (every feed a decoding step or a
verify: no prompt chunk, whose hundreds of rows cost far less each and would flatten the line),
by exponentially weighted least squares over recent passes. The rows of step passes vary with the
sessions in them and the drafts they verify, so the slope is measured where it is paid; it also
carries what a session's own rows add beyond the product (its attention over its cache), which
makes it the dearer, safer side. One more row in a pass of n sessions that commit about one token
each costs them n b / T(rows) tokens: what a looked-up token's chance of acceptance must beat.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class RowPrice:
    """The last step pass's sessions and rows, and the line's slope and value there (seconds)."""

    sessions: int
    rows: int
    seconds_per_row: float
    pass_seconds: float

    @property
    def chance(self) -> float:
        """n b / T(rows): the tokens one more row costs the pass's sessions, at most 1."""
        if self.pass_seconds <= 0.0:
            return 1.0
        return min(1.0, self.sessions * self.seconds_per_row / self.pass_seconds)


class StepPassCosts:
    """T(rows) over a service's step passes: decayed sums for a least-squares line. Thread-safe
    (passes are recorded on the model thread; read there too)."""

    def __init__(self, decay: float = 0.98, min_spread: float = 1.0) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.min_spread = min_spread  # rows: below this standard deviation the slope is unknown
        self._sums = [0.0] * 5  # weight, rows, seconds, rows^2, rows x seconds
        self._last: tuple[int, int] | None = None  # (sessions, rows) of the last step pass
        self._lock = threading.Lock()

    def record(self, rows: int, sessions: int, seconds: float) -> None:
        """A step pass of `rows` rows over `sessions` sessions that took `seconds`."""
        with self._lock:
            self._sums = [s * self.decay for s in self._sums]
            for i, value in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
                self._sums[i] += value
            self._last = (sessions, rows)

    def line(self) -> tuple[float, float] | None:
        """(a, b) of T(rows) = a + b rows, b >= 0; None before the rows have varied enough."""
        with self._lock:
            sums = tuple(self._sums)
        return self._fit(sums)

    def price(self) -> RowPrice | None:
        """One more row's price at the last step pass's sessions and rows; None until known."""
        with self._lock:
            sums, last = tuple(self._sums), self._last
        line = self._fit(sums)
        if line is None or last is None:
            return None
        a, b = line
        sessions, rows = last
        return RowPrice(sessions, rows, b, a + b * rows)

    def _fit(self, sums: tuple[float, ...]) -> tuple[float, float] | None:
        weight, rows, seconds, rows2, cross = sums
        if weight <= 0.0:
            return None
        mean_rows, mean_seconds = rows / weight, seconds / weight
        variance = rows2 / weight - mean_rows * mean_rows
        if variance < self.min_spread ** 2:
            return None
        slope = max(0.0, (cross / weight - mean_rows * mean_seconds) / variance)
        return mean_seconds - slope * mean_rows, slope
