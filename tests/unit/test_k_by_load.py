"""The K controller under load (docs/architecture.md, "Choosing K"): the target batches the Verify
calls of n sessions into one forward pass, and a session's drafted rows cost every other session
in that pass. No servers, no clocks: a seeded simulator plays n sessions in lockstep, one shared
verify pass per round of T_pass(R) = a + b R over the pass's rows R, with the pass's rows and
sessions reported to every session as the target does.

The pass line is the default target's, float32, on a 2-core CPU: 32 ms for one row and 256 ms for
32 sessions x 5 rows (160 rows), the line through those two. The draft pass keeps its
single-session cost (7 ms): only the target's batching is modelled, so a K that falls here falls
because of the rows' marginal cost alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from itertools import pairwise

import pytest

from orchestrator.generation import _observation
from orchestrator.k_controller import (
    AdaptiveKController,
    KControllerConfig,
    LinearVerifyTime,
    RoundCosts,
    best_k,
    expected_committed_tokens,
    goodput,
    others_commit_rate,
    others_lost_tokens,
    round_time,
    seconds_per_token,
    session_rate,
)
from orchestrator.k_estimates import ControllerPriors
from orchestrator.k_policy import RoundObservation
from specdec.protocol import CallTiming, Handle, Proposal, Reply, VerifyOutcome
from tests.unit.test_k_controller import Conditions, SimulatedServices, cpu_steps, play

K_MAX = 8


@dataclass(frozen=True)
class SharedWorld:
    """The true state of a loaded world, seconds."""

    alpha: float = 0.5
    pass_a: float = 0.0306  # T_pass(1) = 32 ms
    pass_b: float = 0.00141  # T_pass(160) = 256 ms
    t_draft: float = 0.007
    rtt: float = 0.001
    noise: float = 0.1  # each time is scaled by a uniform factor in [1 - noise, 1 + noise]

    def t_pass(self, rows: int) -> float:
        return self.pass_a + self.pass_b * rows

    def uniform_rate(self, sessions: int, k: int) -> float:
        """The system's tokens per second when every session runs K = k (the truth to beat)."""
        draft = k * self.t_draft + self.rtt if k else 0.0
        round_seconds = draft + self.t_pass(sessions * (k + 1)) + self.rtt
        return sessions * expected_committed_tokens(self.alpha, k) / round_seconds

    def best_uniform_k(self, sessions: int) -> int:
        return max(range(K_MAX + 1), key=lambda k: self.uniform_rate(sessions, k))


class SharedPass:
    """Sessions in lockstep: each round every session picks K, drafts, and all verify in one pass."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._draft_lacks: dict[int, int] = {}  # committed tokens a session's draft has not fed
        self.tokens: dict[int, int] = {}
        self.seconds: dict[int, float] = {}

    def _noisy(self, seconds: float, world: SharedWorld) -> float:
        return seconds * (1.0 + world.noise * self._rng.uniform(-1.0, 1.0))

    def round(self, controllers: list[AdaptiveKController], world: SharedWorld) -> list[int]:
        ks = [controller.choose(K_MAX) for controller in controllers]
        rows = sum(k + 1 for k in ks)
        verify = self._noisy(world.t_pass(rows), world)  # one pass, the same for all in it
        for controller, k in zip(controllers, ks):
            key = id(controller)
            lacks = self._draft_lacks.get(key, 1)
            verify_wall = verify + self._noisy(world.rtt, world)
            accepted, draft, draft_wall, fed = 0, 0.0, 0.0, 0
            if k == 0:
                self._draft_lacks[key] = lacks + 1
            else:
                while accepted < k and self._rng.random() < world.alpha:
                    accepted += 1
                draft = self._noisy(k * world.t_draft, world)
                draft_wall = draft + self._noisy(world.rtt, world)
                fed = lacks + k - 1
                self._draft_lacks[key] = 2 if accepted == k else 1
            controller.observe(RoundObservation(k, accepted, (), draft, draft_wall, fed, verify,
                                                verify_wall, float(rows), float(len(controllers))))
            self.tokens[key] = self.tokens.get(key, 0) + accepted + 1
            self.seconds[key] = self.seconds.get(key, 0.0) + draft_wall + verify_wall
        return ks


def new_controller(priors: ControllerPriors) -> AdaptiveKController:
    return AdaptiveKController(KControllerConfig(max_num_speculative_tokens=K_MAX), priors)


@dataclass
class Level:
    sessions: int
    mean_k: float  # over the level's last 100 rounds, all sessions
    at_zero: float  # share of those rounds' sessions whose chosen K (probes aside) was 0
    rate: float  # the system's tokens per second over the level's last 100 rounds


def ramp(world: SharedWorld, levels: tuple[int, ...], seed: int, rounds: int = 250
         ) -> tuple[list[Level], list[AdaptiveKController], SharedPass]:
    """Load rising level by level: sessions join (from the pool's priors) and stay."""
    services, priors = SharedPass(seed), ControllerPriors(weight=0.2)
    controllers: list[AdaptiveKController] = []
    result = []
    for sessions in levels:
        while len(controllers) < sessions:
            controllers.append(new_controller(priors))
        for _ in range(rounds - 100):
            services.round(controllers, world)
        services.tokens.clear()
        services.seconds.clear()
        chosen: list[int] = []
        zero = 0
        for _ in range(100):
            chosen += services.round(controllers, world)
            zero += sum(c.estimates()["num_speculative_tokens"] == 0 for c in controllers)
        at_zero = zero / len(chosen)
        rate = sum(services.tokens[key] / services.seconds[key] for key in services.tokens)
        result.append(Level(sessions, sum(chosen) / len(chosen), at_zero, rate))
    return result, controllers, services


# -- the pure cost model under load ---------------------------------------------------------------


def loaded_costs(world: SharedWorld, sessions: int, others_k: int, k_now: int) -> RoundCosts:
    """The figures a session sees with `sessions - 1` others at K = others_k in its pass."""
    costs = RoundCosts(world.t_draft, LinearVerifyTime(world.pass_a, world.pass_b), world.rtt,
                       world.rtt, others_rows=(sessions - 1) * (others_k + 1),
                       others_sessions=float(sessions - 1))
    rate = others_commit_rate(world.alpha, k_now, costs)
    return replace(costs, others_tokens_per_second=rate)


def test_alone_the_goodput_rule_is_seconds_per_committed_token() -> None:
    costs = Conditions(rtt_target=0.01).costs()
    for k in range(K_MAX + 1):
        plain = round_time(k, costs) / expected_committed_tokens(0.7, k)
        assert seconds_per_token(0.7, k, costs) == plain  # exactly: no penalty term at all
        assert goodput(0.7, k, costs) == pytest.approx(session_rate(0.7, k, costs), rel=1e-12)
    # Others in the pass but no rate charged (say the first round): only the longer pass counts.
    shifted = replace(costs, others_rows=12)
    assert round_time(2, shifted) == pytest.approx(round_time(2, costs) + 12 * Conditions().verify_b)


def test_the_penalty_is_the_others_lost_tokens_by_hand() -> None:
    world = SharedWorld(alpha=0.6)
    costs = loaded_costs(world, sessions=4, others_k=2, k_now=2)  # 3 others x 3 rows
    assert costs.others_rows == 9
    # Others like this session at K = 2: r = E(2) / T_round(2) in a pass of 12 rows.
    t_round = 2 * 0.007 + 0.001 + world.t_pass(12) + 0.001
    r = (1 + 0.6 + 0.36) / t_round
    assert costs.others_tokens_per_second == pytest.approx(r)
    assert round_time(2, costs) == pytest.approx(t_round)
    assert others_lost_tokens(0, costs) == 0.0
    lost = 3 * r * 3 * world.pass_b  # (n - 1) r dT(3), dT(3) = 3 rows of b
    assert others_lost_tokens(3, costs) == pytest.approx(lost)
    t_round_3 = 3 * 0.007 + 0.001 + world.t_pass(13) + 0.001
    e3 = 1 + 0.6 + 0.36 + 0.216
    assert goodput(0.6, 3, costs) == pytest.approx((e3 - lost) / t_round_3)
    assert seconds_per_token(0.6, 3, costs) == pytest.approx(t_round_3 / (e3 - lost))


def test_the_truth_falls_with_load_and_the_rule_follows_it() -> None:
    """At every load the system's best common K is a fixed point of the rule (with the others at
    that K, the rule picks it too), and that K falls to 0 as the pass fills."""
    for alpha in (0.45, 0.5, 0.6):
        world = SharedWorld(alpha=alpha)
        truth = [world.best_uniform_k(n) for n in (1, 4, 16, 32, 64)]
        assert truth == sorted(truth, reverse=True) and truth[0] >= 1 and truth[-1] == 0, truth
        for n, best in zip((1, 4, 16, 32, 64), truth):
            fixed_points = [k for k in range(K_MAX + 1)
                            if best_k(alpha, loaded_costs(world, n, k, k), K_MAX) == k]
            assert best in fixed_points, (alpha, n, best, fixed_points)


def test_a_session_charges_nothing_when_the_others_rows_cost_nothing() -> None:
    world = replace(SharedWorld(alpha=0.6), pass_b=0.0)  # a pass costs the same at any size
    alone = best_k(0.6, loaded_costs(world, 1, 0, 0), K_MAX)
    assert best_k(0.6, loaded_costs(world, 32, 0, 0), K_MAX) == alone > 0


# -- the controller -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_k_falls_as_the_batch_fills_and_reaches_zero_at_saturation(seed: int) -> None:
    world = SharedWorld(alpha=0.5)
    assert [world.best_uniform_k(n) for n in (1, 4, 16, 32)] == [1, 1, 0, 0]
    # At 32 sessions drafting one token costs the system over 10 % (saturation); at 16, 4 %.
    assert world.uniform_rate(32, 1) < 0.9 * world.uniform_rate(32, 0)
    levels, _, _ = ramp(world, (1, 4, 16, 32), seed)
    ks = [level.mean_k for level in levels]
    # Non-increasing, up to the noise of 100 rounds near a break-even point (16 sessions: K = 0
    # wins by 4 % there, so sessions leave K = 1 only as their alpha estimates come down).
    assert all(after <= before + 0.15 for before, after in pairwise(ks)), ks
    assert ks[0] >= 1.0 and ks[1] >= 0.75 and ks[2] < ks[0], ks
    assert ks[-1] <= 0.1, ks  # probes now and then, nothing more
    assert levels[-1].at_zero >= 0.9, levels[-1]
    for level in levels:  # and the system is as fast as the best common K, give or take
        best = max(world.uniform_rate(level.sessions, k) for k in range(K_MAX + 1))
        assert level.rate >= 0.93 * best, (level, best)


def test_k_steps_down_from_two_as_load_rises() -> None:
    world = SharedWorld(alpha=0.6, t_draft=0.004)  # a faster draft: K = 2 or 3 alone
    assert [world.best_uniform_k(n) for n in (1, 16, 64)] == [2, 1, 0]
    levels, _, _ = ramp(world, (1, 16, 64), seed=2, rounds=220)
    ks = [level.mean_k for level in levels]
    assert ks[0] >= 1.4 and 0.8 <= ks[1] <= 1.3 and ks[2] <= 0.1, ks
    assert levels[-1].at_zero >= 0.9, levels[-1]


def test_k_comes_back_when_the_load_drops() -> None:
    world = SharedWorld(alpha=0.5)
    levels, controllers, services = ramp(world, (1, 32), seed=3)
    first = controllers[0]
    assert levels[-1].at_zero >= 0.9 and first.estimates()["num_speculative_tokens"] == 0
    assert first.estimates()["verify_pass_sessions"] == pytest.approx(32)
    # While at K = 0 it went on probing (alpha is not observed otherwise), less and less often.
    assert first.estimates()["probe_interval_rounds"] > KControllerConfig().probe_interval_rounds
    ks = [services.round([first], world)[0] for _ in range(200)]  # the others have finished
    assert all(k > 0 for k in ks[-100:]), ks
    assert first.estimates()["verify_pass_sessions"] == pytest.approx(1.0, abs=0.01)


def test_probes_under_saturation_are_still_made() -> None:
    world = SharedWorld(alpha=0.5)
    services, priors = SharedPass(4), ControllerPriors(weight=0.2)
    controllers = [new_controller(priors) for _ in range(32)]
    for _ in range(150):
        services.round(controllers, world)
    assert all(c.estimates()["num_speculative_tokens"] == 0 for c in controllers)
    rounds = [services.round(controllers, world) for _ in range(200)]
    probes = sum(k > 0 for ks in rounds for k in ks)
    assert 0 < probes < 0.05 * 200 * 32, probes


def test_the_verify_fit_is_over_the_whole_pass() -> None:
    """The line is learned from the pass's rows (every session's), so its slope is the cost of a
    row wherever it comes from, and the load figures are reported."""
    world = SharedWorld(alpha=0.6, noise=0.05)
    _, controllers, _ = ramp(world, (4, 12), seed=5, rounds=150)
    figures = controllers[0].estimates()
    assert figures["verify_b"] == pytest.approx(world.pass_b, rel=0.2)
    assert figures["verify_a"] + 40 * figures["verify_b"] == pytest.approx(world.t_pass(40), rel=0.05)
    assert figures["verify_pass_sessions"] == pytest.approx(12)
    k_others = figures["verify_pass_others_rows"] / 11 - 1
    assert 0.0 <= k_others <= K_MAX
    assert figures["verify_pass_rows"] == pytest.approx(
        figures["verify_pass_others_rows"] + figures["num_speculative_tokens"] + 1, abs=1.5)
    assert figures["predicted_goodput_tokens_per_second"] < figures["predicted_tokens_per_second"]


# -- alone: nothing changes -----------------------------------------------------------------------


def alone(observation: RoundObservation) -> RoundObservation:
    """The same round as reported by a batching server that had nobody else in the pass."""
    return replace(observation, verify_pass_rows=float(observation.num_speculative_tokens + 1),
                   verify_pass_sessions=1.0)


class ReportingAlone(SimulatedServices):
    def round(self, k: int, world: Conditions) -> RoundObservation:
        return alone(super().round(k, world))


@pytest.mark.parametrize("world", [Conditions(rtt_target=0.01, noise=0.2), cpu_steps(0.6)])
def test_a_session_alone_chooses_as_before(world: Conditions) -> None:
    """Pass figures of 0 (a server that predates batching) and of a pass of its own (K + 1 rows, 1
    session) give the same choices, round for round, as the cost model without load."""
    config = KControllerConfig(max_num_speculative_tokens=K_MAX)
    legacy, reporting = AdaptiveKController(config), AdaptiveKController(config)
    ks_legacy = play(legacy, SimulatedServices(7), world, 300)
    ks_reporting = play(reporting, ReportingAlone(7), world, 300)
    assert ks_legacy == ks_reporting
    assert legacy.estimates() == reporting.estimates()
    figures = legacy.estimates()
    assert figures["verify_pass_sessions"] == 1.0 and figures["verify_pass_others_rows"] == 0.0
    assert figures["predicted_goodput_tokens_per_second"] == figures["predicted_tokens_per_second"]


def test_zero_pass_fields_are_taken_as_alone() -> None:
    observation = RoundObservation(3, 1, (1.0, 0.0, 0.0), 0.02, 0.03, 3, 0.05, 0.06)
    assert observation.pass_rows == 4 and observation.pass_sessions == 1.0
    reported = replace(observation, verify_pass_rows=17.0, verify_pass_sessions=5.0)
    assert reported.pass_rows == 17 and reported.pass_sessions == 5.0
    assert replace(observation, verify_pass_rows=2.0).pass_rows == 4  # never fewer than its own

    handle = Handle("session", "replica", 0, 1)
    proposal = Reply(handle, Proposal((5, 6, 7), fed_tokens=3), CallTiming(0.03, 0.02))
    outcome = VerifyOutcome(1, 9, (1.0, 0.0, 0.0))
    old_server = _observation(proposal, Reply(handle, outcome, CallTiming(0.06, 0.05)))
    assert (old_server.verify_pass_rows, old_server.verify_pass_sessions) == (4.0, 1.0)
    batched = _observation(proposal, Reply(handle, outcome, CallTiming(0.06, 0.05, 0.0, 40.0, 9.0)))
    assert (batched.verify_pass_rows, batched.verify_pass_sessions) == (40.0, 9.0)
    plain = _observation(None, Reply(handle, outcome, CallTiming(0.06, 0.05)))
    assert (plain.verify_pass_rows, plain.verify_pass_sessions) == (1.0, 1.0)


def test_the_controller_simulation_shows_k_falling_with_load(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import controller_sim

    argv = ["--sessions", "1,32", "--alpha", "0.5", "--seeds", "1", "--load-rounds", "100"]
    assert controller_sim.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    table = {int(line.split()[0]): line.split() for line in lines[2:4]}
    assert set(table) == {1, 32}
    assert float(table[1][1]) >= 1.0 and float(table[32][1]) <= 0.2  # mean K alone and at 32
    assert table[32][2] == "100%"  # every session's chosen K is 0 at the end


def test_a_looked_up_tokens_price_rises_with_load() -> None:
    """decode_lookup_min_chance: the chance of acceptance a token the target looks up in a Decode
    pass needs to pay for its row, n dT(1) / T_pass(R + 1) with n sessions in the pass. Before any
    pass is measured, the unpriced default; then it rises with the sessions in the pass."""
    from orchestrator.k_controller import UNPRICED_LOOKUP_CHANCE

    world = SharedWorld(alpha=0.5)
    assert new_controller(ControllerPriors()).decode_lookup_min_chance() == UNPRICED_LOOKUP_CHANCE
    chances, rows = {}, {}
    for sessions in (1, 8, 32):
        levels, controllers, _ = ramp(world, (sessions,), seed=3, rounds=120)
        chances[sessions] = sum(c.decode_lookup_min_chance() for c in controllers) / len(controllers)
        rows[sessions] = sessions * (levels[-1].mean_k + 1)  # the pass's rows, all sessions
    assert chances[1] == pytest.approx(world.pass_b / world.t_pass(1), rel=0.25), chances
    assert chances[1] < chances[8] < chances[32] <= 1.0, chances
    for sessions in (8, 32):
        truth = sessions * world.pass_b / world.t_pass(round(rows[sessions]))
        assert chances[sessions] == pytest.approx(truth, rel=0.25), (sessions, chances, truth)


def test_passes_of_a_decode_the_guard_ran_price_the_lookups_rows() -> None:
    """Under the speculation guard a session runs no rounds: the passes of its Decode calls
    (their time per pass, once the passes' accepted lookups are counted out, and their load) are
    all its controller learns the price of a row from."""
    from orchestrator.generation import _decoded_passes
    from orchestrator.k_policy import DecodedPasses
    from specdec.protocol import DraftTally

    world = SharedWorld(noise=0.0)
    # 12 tokens from 8 passes: 4 looked-up tokens accepted (of 10 verified), the rest one a pass
    rows = 8 * 1 + 10
    timing = CallTiming(8 * world.t_pass(rows), 8 * world.t_pass(rows), pass_rows=rows, pass_sessions=8.0)
    passes = _decoded_passes(12, timing, (None, DraftTally(passes=3, drafts=10, accepted=4)))
    assert passes == DecodedPasses(world.t_pass(rows), rows, 8.0, own_rows=1.0 + 10 / 8, count=8)
    controller = new_controller(ControllerPriors())
    for rows_now in (8, 12, 18, 24, 30):  # a load of 8 sessions, their lookups' rows varying
        controller.observe_decoded_passes(DecodedPasses(world.t_pass(rows_now), rows_now, 8.0, count=4))
    others_rows = controller.estimates()["verify_pass_others_rows"]
    truth = 8 * world.pass_b / world.t_pass(round(others_rows) + 1)
    assert controller.decode_lookup_min_chance() == pytest.approx(truth, rel=0.3)
    assert controller.decode_lookup_min_chance() > 4 * world.pass_b / world.t_pass(1)
