"""Does speculation pay for the whole system right now? Measured, not modelled.

The adaptive controller (orchestrator/k_controller.py) prices each session's rounds from measured
timings and charges the rows its drafts add to a shared target pass. What no per-session model
sees is work that competes for the same hardware outside the pass: a draft service on the target's
machine (`specdec up` on one host, or co-located pods) slows every target pass while it drafts,
and once the target is busy all the time every draft pass is taken from the target's throughput.
A single session cannot measure this either: its own K = 0 rounds still run beside the other
sessions' drafts.

So while two or more sessions are generating, the orchestrator tests it directly. Every so often
it measures a window with its adaptive sessions doing what they decided so far (speculating as
their controllers choose, or all at K = 0) and, right after, a window doing the other, and keeps
whichever committed more tokens per second, by a margin; until its first test it holds the
sessions at K = 0, so speculation that does not pay costs only the test's window (and half of it
when the other mode is clearly losing: the window then ends early). A decision that
holds at least doubles the time to the next test (up to a ceiling), and more when the test showed
the other choice to lose a lot: the time in the losing mode is then kept to a small share of the
time between tests. One that flips resets it; a test whose windows saw different loads is
discarded. The time between tests is time under load: while fewer than two sessions run, the
schedule's clock stands still, so a load that comes and goes (bursts of requests with quiet in
between) resumes the schedule where it stopped instead of paying a test at every burst. With
fewer than two sessions (for longer than a window: not the gap between a client's requests) the
guard stays out of the way: a lone session's own K = 0 probes already measure the truth. Where
the replicas' Info says the draft computes on the target's hardware, speculating under load pays
only by exception (every draft pass is taken from a busy target), so the first test comes after
30 s of load rather than 1 s and tests keep to 1 % of the time rather than 2.5 %. Nothing
here is a setting a user tunes: the windows, the margin and the share only decide how quickly and
how surely a measured difference is acted on, and at what cost.

The guard sees one orchestrator's sessions; replicas of the orchestrator test on their own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardConfig:
    """Seconds, and the margin by which the other choice must win a test to be taken."""

    window_seconds: float = 2.0  # each of a test's two windows
    settle_seconds: float = 0.4  # before each window: rounds of the previous mode finish
    margin: float = 0.05
    first_test_seconds: float = 1.0  # after load appears, and after a decision flips
    max_interval_seconds: float = 96.0
    # A test costs the tokens its other window loses against the kept mode; the next test waits
    # until that cost is at most this share of the time in between.
    test_cost_share: float = 0.025
    min_sessions: int = 2
    max_load_change: float = 0.25  # mean sessions of the two windows may differ by this fraction
    # The other window ends early once, after this share of it, it has committed less than the
    # kept mode's rate would have by more than early_end_loss: a clear loss need not run in full.
    early_end_share: float = 0.5
    early_end_loss: float = 0.35
    # Where the draft computes on the target's hardware (SpeculationGuard.shares_compute), every
    # draft pass under load is taken from a busy target: speculating there pays only by exception,
    # so the first test waits longer and tests cost a smaller share of the time between them.
    shared_first_test_seconds: float = 30.0
    shared_test_cost_share: float = 0.01

    def __post_init__(self) -> None:
        if self.window_seconds <= 0 or self.settle_seconds < 0 or self.margin < 0:
            raise ValueError("window_seconds must be > 0, settle_seconds and margin >= 0")
        if not 0 < self.first_test_seconds <= self.max_interval_seconds:
            raise ValueError("need 0 < first_test_seconds <= max_interval_seconds")
        if self.min_sessions < 2:
            raise ValueError("min_sessions must be >= 2")
        if not 0 < self.test_cost_share < 1:
            raise ValueError("test_cost_share must be in (0, 1)")
        if not 0 < self.early_end_share <= 1 or not 0 < self.early_end_loss < 1:
            raise ValueError("early_end_share must be in (0, 1], early_end_loss in (0, 1)")
        if not 0 < self.shared_first_test_seconds <= self.max_interval_seconds:
            raise ValueError("need 0 < shared_first_test_seconds <= max_interval_seconds")
        if not 0 < self.shared_test_cost_share < 1:
            raise ValueError("shared_test_cost_share must be in (0, 1)")


@dataclass
class _Window:
    start: float
    end: float
    tokens: int = 0
    session_samples: int = 0
    session_sum: int = 0

    def add(self, now: float, tokens: int, sessions: int) -> None:
        if self.start <= now < self.end:
            self.tokens += tokens
            self.session_samples += 1
            self.session_sum += sessions

    @property
    def rate(self) -> float:
        return self.tokens / (self.end - self.start)

    @property
    def mean_sessions(self) -> float:
        return self.session_sum / self.session_samples if self.session_samples else 0.0


@dataclass(frozen=True)
class GuardDecision:
    """The outcome of one test: tokens/s speculating and at K = 0, and what was kept."""

    speculating_rate: float
    off_rate: float
    speculating: bool


class SpeculationGuard:
    """Shared by every adaptive generation of one orchestrator (see the module docstring)."""

    def __init__(self, config: GuardConfig = GuardConfig(), clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        # The decision kept between tests. Under load speculation must first show that it pays:
        # until the first test, sessions run at K = 0 (a lone session is not held back).
        self.speculating = False
        self.last_decision: GuardDecision | None = None
        # Whether the draft computes on the target's hardware (set_shares_compute).
        self.shares_compute = False
        # Wall time per token of the sessions' Decode calls, smoothed: how many tokens a session's
        # first call fits before the answer may change, before it has a pace of its own.
        self.decode_pace: float | None = None
        self._active = 0
        self._interval = config.first_test_seconds
        # The schedule runs on a clock of seconds under load (min_sessions or more), not wall time.
        self._loaded_seconds = 0.0  # under load until _loaded_since
        self._loaded_since: float | None = None  # wall time the current stretch of load began
        self._next_test: float | None = None  # on the loaded clock
        self._windows: tuple[_Window, _Window] | None = None  # (kept mode, the other mode)
        self._low_since: float | None = float("-inf")  # since when fewer than min_sessions have run

    @property
    def active_sessions(self) -> int:
        return self._active

    def enter(self) -> None:
        self._active += 1
        self._advance(self._clock())

    def leave(self) -> None:
        self._active = max(0, self._active - 1)
        self._advance(self._clock())

    def record(self, tokens: int) -> None:
        """Tokens a session committed just now."""
        now = self._clock()
        self._advance(now)
        if self._windows is not None:
            for window in self._windows:
                window.add(now, tokens, self._active)
            self._end_a_clear_loss_early(now)

    def _end_a_clear_loss_early(self, now: float) -> None:
        """Ends the other window now if, past early_end_share of it, it trails the kept mode's
        rate by more than early_end_loss (the test is then decided on the shorter window)."""
        config = self.config
        kept, other = self._windows
        elapsed = now - other.start
        if elapsed < config.early_end_share * config.window_seconds or now >= other.end:
            return
        if other.tokens < (1.0 - config.early_end_loss) * kept.rate * elapsed:
            other.end = now

    def allows_speculation(self) -> bool:
        """Whether an adaptive session may speculate in the round it is about to run."""
        now = self._clock()
        self._advance(now)
        if self._windows is not None:
            in_second_window = now >= self._windows[1].start - self.config.settle_seconds
            return self.speculating != in_second_window
        if self._load_gone(now):
            return True
        return self.speculating

    def seconds_until_change(self) -> float:
        """How long allows_speculation() keeps its answer if the load stays as it is: until the
        next test switches to its other window, that window ends, or (with fewer than
        min_sessions) the load counts as gone. inf when nothing is due. A clearly losing other
        window may end sooner (record): a session still decoding then finishes its call in that
        mode, as it would have had the window run whole."""
        now = self._clock()
        self._advance(now)
        config = self.config
        if self._windows is not None:
            switch = self._windows[1].start - config.settle_seconds
            return max(0.0, (switch if now < switch else self._windows[1].end) - now)
        if self._active < config.min_sessions:
            if self._load_gone(now) or self._low_since is None:
                return float("inf")
            return max(0.0, self._low_since + config.window_seconds - now)
        if self._next_test is None:
            return float("inf")
        # Under load the loaded clock runs with the wall clock. The test's first window runs the
        # kept mode; the other starts a window and a settling later.
        due_in = self._next_test - self._loaded_clock(now)
        return max(0.0, due_in + config.settle_seconds + config.window_seconds)

    def _loaded_clock(self, now: float) -> float:
        """Seconds spent with min_sessions or more sessions running, up to now."""
        if self._loaded_since is None:
            return self._loaded_seconds
        return self._loaded_seconds + (now - self._loaded_since)

    def observe_decode_pace(self, seconds_per_token: float, weight: float = 0.3) -> None:
        old = self.decode_pace
        self.decode_pace = seconds_per_token if old is None else old + weight * (seconds_per_token - old)

    def set_shares_compute(self, shared: bool) -> None:
        """Whether the draft computes on the target's hardware, as the replicas' Info says
        (OrchestratorService.draft_shares_compute). A first test already scheduled moves with it."""
        if shared == self.shares_compute:
            return
        before = self._first_test_seconds()
        self.shares_compute = shared
        if self._next_test is not None and self._windows is None and self.last_decision is None:
            self._next_test += self._first_test_seconds() - before

    def _first_test_seconds(self) -> float:
        return self.config.shared_first_test_seconds if self.shares_compute else self.config.first_test_seconds

    def _load_gone(self, now: float) -> bool:
        """Fewer than min_sessions for longer than a window (not a closed-loop client's gap
        between one request and its next)."""
        return self._low_since is not None and now - self._low_since > self.config.window_seconds

    def _advance(self, now: float) -> None:
        config = self.config
        if self._windows is not None and now >= self._windows[1].end:
            self._decide(now)
        if self._active < config.min_sessions:
            if self._loaded_since is not None:  # the loaded clock stops
                self._loaded_seconds += now - self._loaded_since
                self._loaded_since = None
            if self._low_since is None:
                self._low_since = now
            if self._load_gone(now) and self._windows is not None:
                self._windows, self._next_test = None, None  # the load went mid-test: test again once it is back
            return
        self._low_since = None
        if self._loaded_since is None:
            self._loaded_since = now
        loaded = self._loaded_clock(now)
        if self._next_test is None:  # the first load, or one back after a test it broke off: test soon
            self._next_test = loaded + self._first_test_seconds()
        if self._windows is None and loaded >= self._next_test:
            first = now + config.settle_seconds
            second = first + config.window_seconds + config.settle_seconds
            self._windows = (_Window(first, first + config.window_seconds),
                             _Window(second, second + config.window_seconds))

    def _decide(self, now: float) -> None:
        config = self.config
        kept, other = self._windows
        self._windows = None
        loads = (kept.mean_sessions, other.mean_sessions)
        loaded = self._loaded_clock(now)
        # Closed-loop clients leave a session out for a moment between requests, so a window's mean
        # falls a little short of the sessions running; more than max_load_change short, the load
        # was not there.
        low = min(loads) < config.min_sessions * (1.0 - config.max_load_change)
        if low or abs(loads[0] - loads[1]) > config.max_load_change * max(loads):
            self._next_test = loaded + config.window_seconds  # different loads: not comparable, soon again
            log.info("speculation guard: test discarded, %.1f and %.1f sessions in its windows", *loads)
            return
        # (other.rate is over the window as it ran: whole, or ended early on a clear loss.)
        speculating_rate, off_rate = (kept.rate, other.rate) if self.speculating else (other.rate, kept.rate)
        if other.rate > kept.rate * (1.0 + config.margin):
            self.speculating = not self.speculating
            self._interval = self._first_test_seconds()
        else:
            # The other window (and its settling) ran at other.rate instead of kept.rate. The wait
            # is set by what a whole test in the losing mode costs, so a test that ended early
            # costs less than its share, and does not come any sooner.
            loss = max(0.0, 1.0 - other.rate / kept.rate) if kept.rate > 0 else 0.0
            cost = loss * (config.window_seconds + config.settle_seconds)
            share = config.shared_test_cost_share if self.shares_compute else config.test_cost_share
            self._interval = min(max(2.0 * self._interval, cost / share), config.max_interval_seconds)
        self.last_decision = GuardDecision(speculating_rate, off_rate, self.speculating)
        self._next_test = loaded + self._interval
        log.info("speculation guard: %.1f tokens/s speculating, %.1f at K = 0 (%.1f sessions): %s; "
                 "next test in %.0f s", speculating_rate, off_rate, sum(loads) / 2,
                 "speculating" if self.speculating else "K = 0", self._interval)
