"""The speculation guard (orchestrator/speculation_guard.py): with two or more sessions it tests
speculating against K = 0 by aggregate tokens per second and keeps the winner; alone it stays out
of the way. Driven by a fake clock and simulated sessions whose rate depends on the mode."""

from __future__ import annotations

import itertools

import pytest

from orchestrator.speculation_guard import GuardConfig, SpeculationGuard


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _simulate(guard: SpeculationGuard, clock: Clock, sessions: int, seconds: float,
              rate_speculating: float, rate_off: float, step: float = 0.05) -> list[bool]:
    """Each step, every session asks whether it may speculate and commits tokens at the rate of
    the mode it got (tokens per second per session). Returns the modes the first session got."""
    modes = []
    carry = [0.0] * sessions
    end = clock.now + seconds
    while clock.now < end:
        for index in range(sessions):
            speculating = guard.allows_speculation()
            if index == 0:
                modes.append(speculating)
            carry[index] += (rate_speculating if speculating else rate_off) * step
            whole = int(carry[index])
            if whole:
                carry[index] -= whole
                guard.record(whole)
        clock.now += step
    return modes


def _guard(clock: Clock, sessions: int) -> SpeculationGuard:
    guard = SpeculationGuard(GuardConfig(), clock=clock)
    for _ in range(sessions):
        guard.enter()
    return guard


def test_turns_speculation_off_when_k0_commits_more_and_rechecks_less_often():
    clock = Clock()
    guard = _guard(clock, sessions=8)
    _simulate(guard, clock, 8, 30.0, rate_speculating=5.0, rate_off=12.0)
    assert not guard.speculating
    assert guard.last_decision.off_rate > guard.last_decision.speculating_rate
    modes = _simulate(guard, clock, 8, 60.0, rate_speculating=5.0, rate_off=12.0)
    # Mostly off from now on: only the test windows speculate, and they get rarer.
    assert sum(modes) / len(modes) < 0.2


def test_keeps_speculating_when_it_pays_and_comes_back_when_it_pays_again():
    clock = Clock()
    guard = _guard(clock, sessions=4)
    _simulate(guard, clock, 4, 30.0, rate_speculating=15.0, rate_off=10.0)
    assert guard.speculating
    # K = 0 lost by a third: tests come less often, so a change is seen within the ceiling.
    _simulate(guard, clock, 4, GuardConfig().max_interval_seconds, rate_speculating=5.0, rate_off=10.0)
    assert not guard.speculating
    _simulate(guard, clock, 4, 120.0, rate_speculating=15.0, rate_off=10.0)
    assert guard.speculating


def _test_times(rate_speculating: float, rate_off: float, seconds: float = 300.0) -> list[float]:
    """When the tests of a guard under 8 sessions decided, over `seconds`."""
    clock = Clock()
    guard = _guard(clock, sessions=8)
    decided, last = [], None
    while clock.now < seconds:
        _simulate(guard, clock, 8, 0.5, rate_speculating, rate_off)
        if guard.last_decision is not last:
            decided.append(clock.now)
            last = guard.last_decision
    assert not guard.speculating
    return decided


def test_the_more_the_other_mode_loses_the_rarer_the_tests():
    """Each test runs a window in the losing mode: after a decisive result the next one waits
    until that loss is a small share of the time in between (and at least doubles the wait)."""
    config = GuardConfig()
    decisive = _test_times(rate_speculating=4.0, rate_off=12.0)  # speculating loses two thirds
    marginal = _test_times(rate_speculating=10.5, rate_off=12.0)  # it loses an eighth
    assert len(decisive) < len(marginal)
    # K = 0 from the start, and every test confirms it.
    gaps = [later - earlier for earlier, later in itertools.pairwise(decisive)]
    loss = 1.0 - 4.0 / 12.0
    assert gaps and min(gaps) >= loss * (config.window_seconds + config.settle_seconds) / config.test_cost_share
    marginal_gaps = [later - earlier for earlier, later in itertools.pairwise(marginal)]
    assert marginal_gaps == sorted(marginal_gaps) and marginal_gaps[0] < marginal_gaps[-1]  # they double


def _seconds_in_other_mode_during_first_test(rate_speculating: float, rate_off: float) -> float:
    """Seconds the first session spent speculating (the other mode of a guard that starts at
    K = 0) until the first test decided."""
    clock = Clock()
    guard = _guard(clock, sessions=8)
    step = 0.05
    modes = _simulate(guard, clock, 8, 10.0, rate_speculating, rate_off, step=step)  # the next test is later
    assert guard.last_decision is not None and not guard.speculating
    return sum(modes) * step


def test_a_clearly_losing_window_ends_early_and_a_close_one_runs_in_full():
    config = GuardConfig()
    whole = config.settle_seconds + config.window_seconds
    # Speculating at half of K = 0's rate: the window ends once half of it has shown that.
    clear = _seconds_in_other_mode_during_first_test(rate_speculating=6.0, rate_off=12.0)
    assert clear < config.settle_seconds + 0.6 * config.window_seconds < whole
    # At 0.9 of it (within early_end_loss) the window runs whole, and the test decides on it.
    close = _seconds_in_other_mode_during_first_test(rate_speculating=10.8, rate_off=12.0)
    assert close == pytest.approx(whole, abs=0.1)


def test_an_early_end_does_not_bring_the_next_test_sooner():
    """The wait after a test is what a whole test in the losing mode would cost over the share."""
    config = GuardConfig()
    decided = _test_times(rate_speculating=4.0, rate_off=12.0, seconds=200.0)
    loss = 1.0 - 4.0 / 12.0
    wait = loss * (config.window_seconds + config.settle_seconds) / config.test_cost_share
    gaps = [later - earlier for earlier, later in itertools.pairwise(decided)]
    assert gaps and min(gaps) >= wait


def test_when_the_load_comes_back_the_last_decision_stands_until_its_next_test():
    clock = Clock()
    guard = _guard(clock, sessions=8)
    _simulate(guard, clock, 8, 20.0, rate_speculating=4.0, rate_off=12.0)
    assert not guard.speculating
    decision = guard.last_decision
    for _ in range(8):
        guard.leave()
    _simulate(guard, clock, 0, 5.0, rate_speculating=4.0, rate_off=12.0)  # the load goes
    for _ in range(8):
        guard.enter()
    modes = _simulate(guard, clock, 8, 5.0, rate_speculating=4.0, rate_off=12.0)
    assert not any(modes)  # no test right away: K = 0 as decided
    assert guard.last_decision is decision


def test_a_difference_within_the_margin_changes_nothing():
    clock = Clock()
    guard = _guard(clock, sessions=4)
    _simulate(guard, clock, 4, 60.0, rate_speculating=10.3, rate_off=10.0)
    assert not guard.speculating  # as it started: speculation did not win by the margin
    assert guard.last_decision is not None
    clock = Clock()
    guard = _guard(clock, sessions=4)
    _simulate(guard, clock, 4, 30.0, rate_speculating=15.0, rate_off=10.0)
    assert guard.speculating
    _simulate(guard, clock, 4, 120.0, rate_speculating=10.0, rate_off=10.3)
    assert guard.speculating  # K = 0 did not win by the margin either


def test_under_load_speculation_waits_for_its_first_test():
    """Until the first test, sessions under load run at K = 0: speculation that does not pay
    costs only a test's window."""
    clock = Clock()
    guard = _guard(clock, sessions=8)
    modes = _simulate(guard, clock, 8, GuardConfig().first_test_seconds * 0.9, rate_speculating=5.0, rate_off=12.0)
    assert modes and not any(modes)


def test_one_session_is_left_to_its_own_controller():
    clock = Clock()
    guard = _guard(clock, sessions=1)
    modes = _simulate(guard, clock, 1, 60.0, rate_speculating=1.0, rate_off=50.0)
    assert all(modes)
    assert guard.last_decision is None


def test_a_test_whose_load_changed_is_discarded():
    clock = Clock()
    guard = _guard(clock, sessions=8)
    _simulate(guard, clock, 8, 3.5, rate_speculating=5.0, rate_off=12.0)  # the first window runs
    for _ in range(6):
        guard.leave()  # most sessions end before the second window
    _simulate(guard, clock, 2, 3.0, rate_speculating=5.0, rate_off=12.0)
    assert guard.last_decision is None and not guard.speculating  # still as it started


@pytest.mark.parametrize("bad", [dict(window_seconds=0), dict(min_sessions=1),
                                 dict(first_test_seconds=200.0, max_interval_seconds=100.0)])
def test_config_is_checked(bad):
    with pytest.raises(ValueError):
        GuardConfig(**bad)


def test_a_gap_between_requests_does_not_abort_a_test():
    """Two closed-loop clients: each ends a request and sends the next a moment later, so for a
    moment one session runs. The test still completes and turns speculation off."""
    clock = Clock()
    guard = _guard(clock, sessions=2)
    for second in range(20):
        _simulate(guard, clock, 2, 0.9, rate_speculating=5.0, rate_off=12.0)
        guard.leave()
        clock.now += 0.05
        guard.enter()
    assert not guard.speculating


def test_two_closed_loop_clients_get_a_decision():
    """Two clients, each out for a moment between its requests while the other commits: the
    windows' mean load is a little under two sessions. The tests must still decide (they were
    discarded as a lost load, every time, so the sessions sat at K = 0 and paid the tests)."""
    clock = Clock()
    guard = _guard(clock, sessions=2)
    step, request_seconds, gap_seconds = 0.05, 1.5, 0.15
    present = [True, True]
    rates = {True: 20.0, False: 12.0}  # speculating pays
    carry = [0.0, 0.0]
    while clock.now < 40.0:
        for index in range(2):
            phase = (clock.now + index * request_seconds / 2) % (request_seconds + gap_seconds)
            here = phase < request_seconds
            if here != present[index]:
                guard.enter() if here else guard.leave()
                present[index] = here
            if here:
                carry[index] += rates[guard.allows_speculation()] * step
                whole = int(carry[index])
                if whole:
                    carry[index] -= whole
                    guard.record(whole)
        clock.now += step
    assert guard.last_decision is not None
    assert guard.speculating


def test_seconds_until_change_bounds_how_long_the_answer_holds():
    """While the load stays, allows_speculation() keeps its answer for at least what
    seconds_until_change() said (a guarded session decodes that long without missing a switch),
    and every change comes when a bound ran out, not unannounced."""
    clock = Clock()
    # A clearly losing window ends early, unannounced (test_a_clearly_losing_window_ends_early...):
    # here every window runs whole.
    guard = SpeculationGuard(GuardConfig(early_end_share=1.0), clock=clock)
    guard.enter()
    guard.enter()
    step = 0.01
    samples = []  # (time, answer, seconds until change)
    while clock.now < 60:
        samples.append((clock.now, guard.allows_speculation(), guard.seconds_until_change()))
        guard.record(3 if samples[-1][1] else 1)  # speculating commits more: it wins its tests
        clock.now += step
    changes = [i for i in range(1, len(samples)) if samples[i][1] != samples[i - 1][1]]
    assert len(changes) >= 2  # the first test switched to speculating, and the decision kept it
    for time_, answer, until in samples:
        assert until >= 0
        assert all(a == answer for t, a, _ in samples if time_ <= t < time_ + until - step / 2)
    for index in changes:
        assert samples[index - 1][2] <= 1.5 * step  # announced: the bound had run out
    assert any(until == float("inf") for _, _, until in samples) is False  # under load a test is always due


def test_bursts_of_load_do_not_each_pay_a_test():
    """The time between tests counts only time under load: bursts of 15 s with a minute of quiet
    in between resume the schedule where it stopped. On the wall clock every burst would come
    after the next test was due, and each would pay a test's losing window."""
    config = GuardConfig()
    clock = Clock()
    guard = SpeculationGuard(config, clock=clock)
    decisions, last = 0, None
    for _ in range(10):
        for _ in range(8):
            guard.enter()
        for _ in range(30):
            _simulate(guard, clock, 8, 0.5, rate_speculating=4.0, rate_off=12.0)
            if guard.last_decision is not last:
                decisions, last = decisions + 1, guard.last_decision
        for _ in range(8):
            guard.leave()
        _simulate(guard, clock, 0, 60.0, rate_speculating=4.0, rate_off=12.0)  # quiet
    assert not guard.speculating
    # 150 s under load: the first test at once, then one after the loss's share of the time
    # (2 / 3 of a window and a settling at 2.5 %: 64 s), then the ceiling (96 s) is past the end.
    loss = 1.0 - 4.0 / 12.0
    first_gap = loss * (config.window_seconds + config.settle_seconds) / config.test_cost_share
    expected = 1 + int((150.0 - config.first_test_seconds) // first_gap)
    assert 1 <= decisions <= expected, decisions


def test_a_decode_under_the_guard_runs_up_to_its_next_change():
    """How many tokens a guarded Decode asks for (orchestrator/generation.py): nothing due (a lone
    session: inf) takes a whole call even before the session's pace is known; with a change due,
    as many as fit before it, and a few while the pace is unknown."""
    from orchestrator.generation import GUARDED_DECODE_STEPS, guarded_decode_steps
    from specdec.protocol import MAX_DECODE_STEPS

    clock = Clock()
    alone = _guard(clock, sessions=1)
    assert alone.seconds_until_change() == float("inf")
    assert guarded_decode_steps(alone.seconds_until_change(), None) == MAX_DECODE_STEPS
    loaded = _guard(clock, sessions=4)
    due = loaded.seconds_until_change()
    assert due < float("inf")
    assert guarded_decode_steps(due, None) == GUARDED_DECODE_STEPS
    assert guarded_decode_steps(due, due / 5.5) == 5
    assert guarded_decode_steps(due, due * 10) == 1
    assert guarded_decode_steps(due, due / 1000) == MAX_DECODE_STEPS


def test_where_the_draft_shares_the_target_hardware_tests_come_later_and_seldom():
    """The draft on the target's CPUs: under load every draft pass is taken from the target, so
    the guard waits longer for its first test and keeps tests to a smaller share of the time;
    where speculating does pay there it still finds out, a test later."""
    config = GuardConfig()
    decided = {}
    for shared in (False, True):
        clock = Clock()
        guard = _guard(clock, sessions=8)
        guard.set_shares_compute(shared)  # after the load came: the first test moves with it
        times, last = [], None
        while clock.now < 300.0:
            _simulate(guard, clock, 8, 0.5, rate_speculating=4.0, rate_off=12.0)
            if guard.last_decision is not last:
                times.append(clock.now)
                last = guard.last_decision
        decided[shared] = times
    assert decided[False][0] < config.first_test_seconds + 6.0 < config.shared_first_test_seconds < decided[True][0]
    assert len(decided[True]) < len(decided[False])
    loss = 1.0 - 4.0 / 12.0
    gaps = [later - earlier for earlier, later in itertools.pairwise(decided[True])]
    assert all(gap >= min(config.max_interval_seconds,
                          loss * (config.window_seconds + config.settle_seconds) / config.shared_test_cost_share)
               for gap in gaps)
    clock = Clock()
    guard = _guard(clock, sessions=4)
    guard.set_shares_compute(True)
    _simulate(guard, clock, 4, config.shared_first_test_seconds + 10.0, rate_speculating=15.0, rate_off=10.0)
    assert guard.speculating
