"""Pipelined speculation's cost model and controller (orchestrator/pipeline_policy.py;
docs/architecture.md, "Pipelining: the cost model"): pure math and seeded simulations, no
servers, no clocks."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from itertools import pairwise

import pytest

from orchestrator.k_controller import (
    LinearVerifyTime,
    RoundCosts,
    others_lost_tokens,
    round_time,
    seconds_per_token,
)
from orchestrator.pipeline_policy import (
    DEFAULT_C_BONUS,
    DEFAULT_C_CORR,
    BranchCost,
    CandidateRanks,
    FixedCoverage,
    LinearBranchTime,
    PipelineConfig,
    PipelineController,
    PipelinePriorEstimates,
    PipelinePriors,
    RankTally,
    VerifySlowdown,
    best_pipeline,
    branch_passes,
    branch_rows,
    choose_from_table,
    extend_coverage,
    hit_rate,
    pipeline_seconds_per_token,
    pipeline_times,
    pipelined_others_lost_tokens,
    pipelined_round_time,
)

MAX_K = 8
MAX_F = 8


@dataclass(frozen=True)
class World:
    """The true state of things, seconds. Defaults: a GPU-like target, a draft 30 ms away whose
    batched branch passes cost little per extra row."""

    alpha: float = 0.7
    t_draft: float = 0.004
    verify_a: float = 0.020
    verify_b: float = 0.001
    rtt_draft: float = 0.030
    rtt_target: float = 0.010
    branch_t1: float = 0.0005  # seconds per extra row of a branch pass (t0 = t_draft)
    slowdown: float = 1.0  # verify pass while the draft drafts ahead, over one without
    coverage: FixedCoverage = field(default_factory=FixedCoverage)

    def verify(self, rows: int) -> float:
        return self.verify_a + self.verify_b * rows

    def costs(self) -> RoundCosts:
        return RoundCosts(self.t_draft, LinearVerifyTime(self.verify_a, self.verify_b), self.rtt_draft,
                          self.rtt_target)

    def branch(self) -> LinearBranchTime:
        return LinearBranchTime(t1=self.branch_t1)

    def branch_seconds(self, num: int, fanout: int) -> float:
        return self.branch().seconds(branch_rows(num, fanout), branch_passes(num), self.t_draft)

    def choice(self, **kwargs: object) -> tuple[int, int]:
        return best_pipeline(self.alpha, self.costs(), MAX_K, MAX_F, self.coverage, self.branch(),
                             self.slowdown, **kwargs)  # type: ignore[arg-type]

    def seconds(self, num: int, fanout: int) -> float:
        return pipeline_seconds_per_token(self.alpha, num, fanout, self.costs(), self.coverage, self.branch(),
                                          self.slowdown)

    def best_plain(self) -> float:
        return min(self.seconds(num, 0) for num in range(MAX_K + 1))


def rank_probabilities(curve: tuple[float, ...]) -> list[float]:
    """P(rank = r), r = 1.., from a coverage curve c(f) = P(rank <= f)."""
    return [c1 - c0 for c0, c1 in zip((0.0, *curve[:-1]), curve)]


def draw_rank(rng: random.Random, probabilities: list[float]) -> int | None:
    u, total = rng.random(), 0.0
    for rank, probability in enumerate(probabilities, start=1):
        total += probability
        if u < total:
            return rank
    return None


# -- priors and coverage curves ---------------------------------------------------------------------


def test_default_priors_are_the_measured_figures_extended_gently() -> None:
    assert DEFAULT_C_CORR[:3] == pytest.approx((0.19, 0.27, 0.33))
    assert DEFAULT_C_BONUS[:3] == pytest.approx((0.41, 0.52, 0.58))
    for curve, cap in ((DEFAULT_C_BONUS, 0.75), (DEFAULT_C_CORR, 0.5)):
        assert len(curve) == MAX_F
        steps = [b - a for a, b in pairwise(curve)]
        assert all(step > 0.0 for step in steps)
        assert all(later < earlier for earlier, later in pairwise(steps[2:]))  # diminishing
        assert curve[-1] <= cap
    fresh = CandidateRanks()  # no data: exactly the prior
    for fanout in range(1, MAX_F + 1):
        assert fresh.c_bonus(fanout) == pytest.approx(DEFAULT_C_BONUS[fanout - 1])
        assert fresh.c_corr(fanout) == pytest.approx(DEFAULT_C_CORR[fanout - 1])
    assert fresh.c_bonus(0) == 0.0 and fresh.c_corr(0) == 0.0
    assert fresh.c_corr(MAX_F + 3) == fresh.c_corr(MAX_F)


def test_extend_coverage_repairs_and_caps() -> None:
    assert extend_coverage((0.3, 0.2, 0.5), 3) == (0.3, 0.3, 0.5)  # made non-decreasing
    assert extend_coverage((0.2, 0.4), 4, ratio=0.5) == pytest.approx((0.2, 0.4, 0.5, 0.55))
    assert extend_coverage((0.5, 0.9), 4, cap=0.8) == (0.5, 0.8, 0.8, 0.8)
    with pytest.raises(ValueError):
        extend_coverage((), 3)


def test_hit_rate_weighs_bonus_and_correction_coverage() -> None:
    coverage = FixedCoverage(bonus=(0.5, 0.6), corr=(0.2, 0.3))
    every = 0.6**3
    assert hit_rate(0.6, 3, 2, coverage) == pytest.approx(every * 0.6 + (1 - every) * 0.3)
    assert hit_rate([0.6], 3, 2, coverage) == pytest.approx(hit_rate(0.6, 3, 2, coverage))
    every = 0.9 * 0.5 * 0.5  # per-position alphas, the last repeating
    assert hit_rate([0.9, 0.5], 3, 1, coverage) == pytest.approx(every * 0.5 + (1 - every) * 0.2)
    assert hit_rate(1.0, 4, 2, coverage) == pytest.approx(0.6)  # always the bonus
    assert hit_rate(0.0, 4, 2, coverage) == pytest.approx(0.3)  # always a correction
    assert hit_rate(0.6, 3, 0, coverage) == 0.0  # not pipelined
    assert hit_rate(0.6, 0, 2, coverage) == 0.0  # K = 0 is never pipelined


# -- the round time ------------------------------------------------------------------------------


COSTS = RoundCosts(0.004, LinearVerifyTime(0.020, 0.001), rtt_draft=0.006, rtt_target=0.010,
                   catchup_seconds=0.003, others_rows=5)


def test_fanout_zero_is_the_plain_round() -> None:
    for num in range(4):
        assert pipelined_round_time(num, 0, num, COSTS, 0.5, 1.0, 2.0) == round_time(num, COSTS)


def test_no_hits_and_a_branch_path_inside_the_verify_path_cost_nothing() -> None:
    verify_path = COSTS.rtt_target + COSTS.verify_fn(COSTS.others_rows + 4)
    for branch_seconds in (0.0, 0.01, verify_path - COSTS.rtt_draft):  # the hit path fits too
        elapsed = pipelined_round_time(3, 2, 3, COSTS, 0.0, branch_seconds, 1.0)
        assert elapsed == pytest.approx(round_time(3, COSTS), rel=1e-12)


def test_hits_save_the_draft_side() -> None:
    draft_side = 3 * COSTS.t_draft + COSTS.rtt_draft
    verify_path = COSTS.rtt_target + COSTS.verify_fn(COSTS.others_rows + 4)
    for hit in (0.25, 0.5, 1.0):
        elapsed = pipelined_round_time(3, 2, 3, COSTS, hit, 0.01, 1.0)
        assert elapsed == pytest.approx(round_time(3, COSTS) - hit * draft_side)
    # every proposal drafted ahead: only the verify path (and the catch-up owed)
    assert pipelined_round_time(3, 2, 3, COSTS, 1.0, 0.01) == pytest.approx(verify_path + COSTS.catchup_seconds)


def test_a_branch_path_longer_than_the_verify_path_is_waited_for() -> None:
    verify_path = COSTS.rtt_target + COSTS.verify_fn(COSTS.others_rows + 4)
    draft_side = 3 * COSTS.t_draft + COSTS.rtt_draft
    branch = verify_path + 0.05
    for hit in (0.0, 0.3, 1.0):
        # streamed behind the proposal on a miss, a call of its own (one hop) on a hit
        expected = (COSTS.catchup_seconds + (1 - hit) * (draft_side + branch)
                    + hit * (COSTS.rtt_draft + branch))
        assert pipelined_round_time(3, 2, 3, COSTS, hit, branch) == pytest.approx(expected)
        # branches as a call of their own after a miss too: (1 - h) D + max(V, RTT_draft + T_branch)
        separate = pipelined_round_time(3, 2, 3, COSTS, hit, branch, miss_branch_hop=COSTS.rtt_draft)
        simple = (COSTS.catchup_seconds + (1 - hit) * draft_side
                  + max(verify_path, COSTS.rtt_draft + branch))
        assert separate == pytest.approx(simple)


def test_slowdown_lengthens_the_verify_path_and_the_others_pay_for_it() -> None:
    plain = pipelined_round_time(3, 2, 3, COSTS, 0.4, 0.0, 1.0)
    slowed = pipelined_round_time(3, 2, 3, COSTS, 0.4, 0.0, 1.5)
    assert slowed - plain == pytest.approx(0.5 * COSTS.verify_fn(COSTS.others_rows + 4))
    shared = replace(COSTS, others_sessions=2.0, others_tokens_per_second=30.0)
    assert pipelined_others_lost_tokens(3, shared, 1.0) == pytest.approx(others_lost_tokens(3, shared))
    extra = pipelined_others_lost_tokens(3, shared, 1.5) - others_lost_tokens(3, shared)
    assert extra == pytest.approx(2.0 * 30.0 * 0.5 * shared.verify_fn(shared.others_rows + 4))


def test_seconds_per_token_reduces_to_the_plain_one() -> None:
    shared = replace(COSTS, others_sessions=2.0, others_tokens_per_second=30.0)
    never = FixedCoverage(bonus=(0.0,), corr=(0.0,))
    free = LinearBranchTime(t1=0.0, t0=0.0, hop=0.0)
    for num in range(1, 5):
        plain = seconds_per_token(0.7, num, shared)
        assert pipeline_seconds_per_token(0.7, num, 0, shared, never, free) == plain
        # no hits, a branch path that fits, no slowdown: pipelining changes nothing
        assert pipeline_seconds_per_token(0.7, num, 3, shared, never, free) == pytest.approx(plain, rel=1e-12)
    assert pipeline_seconds_per_token(0.7, 0, 2, shared, FixedCoverage(), free) == math.inf


# -- choosing K and the fan-out -------------------------------------------------------------------


def test_pipelining_turns_on_for_a_remote_draft() -> None:
    world = World()
    num, fanout = world.choice()
    assert num >= 1 and fanout >= 1
    assert world.seconds(num, fanout) < 0.97 * world.best_plain()


def test_pipelining_pays_for_a_slow_draft_side_and_not_for_a_free_one() -> None:
    gains = []
    for rtt_draft, t_draft in ((0.0, 0.0002), (0.005, 0.002), (0.02, 0.004), (0.03, 0.004), (0.06, 0.008)):
        world = World(rtt_draft=rtt_draft, t_draft=t_draft)
        num, fanout = world.choice()
        gains.append(world.best_plain() / world.seconds(num, fanout))
        assert (fanout > 0) == (0.0 < rtt_draft < 0.06), (rtt_draft, num, fanout)
    assert gains[0] == 1.0  # off: nothing to hide
    assert min(gains[1:4]) > 1.03
    # A hit still waits for the next branches, one draft hop away: a draft so far that the target
    # alone (31 ms a token) beats any drafting is not pipelined either.
    assert gains[4] == 1.0 and World(rtt_draft=0.06, t_draft=0.008).choice() == (0, 0)


def test_off_when_the_branch_path_is_longer_than_the_verify_path() -> None:
    world = World(branch_t1=0.02)  # a CPU draft: every branch row costs most of a pass
    assert world.choice()[1] == 0
    num = world.choice()[0]
    verify_path = world.rtt_target + world.verify(num + 1)
    assert world.branch_seconds(num, 1) > verify_path


def test_off_when_colocation_slowdown_eats_the_gain() -> None:
    assert World().choice()[1] > 0
    assert World(slowdown=1.5).choice()[1] == 0


def test_off_when_the_hit_rate_is_low() -> None:
    rare = FixedCoverage(bonus=(0.02,) * MAX_F, corr=(0.01,) * MAX_F)
    assert World(coverage=rare).choice()[1] == 0
    assert World(alpha=0.7, coverage=rare).seconds(4, 1) < World(coverage=rare).best_plain()  # a gain,
    # but within the margin: noise, not worth drafting ahead for


def test_fanout_grows_with_the_hit_rate_only_while_the_branch_path_fits() -> None:
    # A slow target on a fast network: the verify path hides the branches up to some width.
    base = World(alpha=0.7, t_draft=0.004, verify_a=0.08, verify_b=0.002, rtt_draft=0.002, rtt_target=0.002)
    free = replace(base, branch_t1=0.0)
    costly = replace(base, branch_t1=0.001)
    free_f = free.choice()[1]
    num, fanout = costly.choice()
    assert 1 <= fanout < free_f
    verify_path = costly.rtt_target + costly.verify(num + 1)
    assert costly.rtt_draft + costly.branch_seconds(num, fanout) <= verify_path  # fits
    assert costly.rtt_draft + costly.branch_seconds(num, fanout + 1) > verify_path  # the next does not
    # the wider fan-outs would hit more often: the branch path is what stops them
    assert hit_rate(costly.alpha, num, fanout + 1, costly.coverage) > hit_rate(costly.alpha, num, fanout,
                                                                                costly.coverage)
    # once the coverage stops growing, so does the fan-out
    flat = replace(free, coverage=FixedCoverage(bonus=(0.4, 0.5) + (0.5,) * 6, corr=(0.2, 0.3) + (0.3,) * 6))
    assert flat.choice()[1] == 2


def test_k_zero_is_never_pipelined() -> None:
    world = World()
    assert best_pipeline(world.alpha, world.costs(), 0, MAX_F, world.coverage, world.branch()) == (0, 0)
    times = pipeline_times(world.alpha, world.costs(), MAX_K, MAX_F, world.coverage, world.branch())
    assert all(math.isinf(seconds) for seconds in times[0][1:])
    hopeless = World(alpha=0.1, t_draft=0.05)  # drafting cannot pay: K = 0, so no pipelining
    assert hopeless.choice() == (0, 0)


def test_the_margin_turns_pipelining_off_when_its_gain_is_noise() -> None:
    in_margin = 0
    for step in range(60):
        world = World(rtt_draft=0.0005 * step, t_draft=0.0005 + 0.0001 * step)
        num, fanout = world.choice()
        best = min(world.seconds(k, f) for k in range(1, MAX_K + 1) for f in range(1, MAX_F + 1))
        if fanout > 0:
            assert world.seconds(num, fanout) < 0.97 * world.best_plain()
        elif best < world.best_plain():
            assert best >= 0.97 * world.best_plain()
            in_margin += 1
            assert world.choice(margin=0.0)[1] > 0  # without the margin it would draft ahead
    assert in_margin > 0


def test_choose_from_table_prefers_plain_small_k_and_narrow_fanout() -> None:
    inf = math.inf
    assert choose_from_table([[1.0, inf], [0.9, 0.9], [0.9, 0.9]]) == (1, 0)  # ties: plain, smaller K
    assert choose_from_table([[1.0, inf], [0.9, 0.88], [0.95, 0.8]]) == (2, 1)
    assert choose_from_table([[1.0, inf, inf], [0.9, 0.80, 0.797]]) == (1, 1)  # within 1 %: narrower
    assert choose_from_table([[1.0, inf, inf], [0.9, 0.80, 0.70]]) == (1, 2)
    assert choose_from_table([[inf, inf], [inf, inf]]) == (0, 0)


def test_per_position_alpha_is_accepted() -> None:
    world = World()
    args = (world.costs(), MAX_K, MAX_F, world.coverage, world.branch())
    assert best_pipeline([world.alpha], *args) == best_pipeline(world.alpha, *args)


# -- estimators ----------------------------------------------------------------------------------------


TRUE_BONUS = (0.6, 0.7, 0.75, 0.78, 0.8, 0.81, 0.82, 0.83)
TRUE_CORR = (0.1, 0.3, 0.4, 0.45, 0.48, 0.5, 0.52)  # 7 candidates: the rejected draft excluded


def feed(ranks: CandidateRanks, rng: random.Random, count: int, bonus: tuple[float, ...] = TRUE_BONUS,
         corr: tuple[float, ...] = TRUE_CORR, candidates: int | None = None) -> None:
    """`count` bonus and `count` correction outcomes; with `candidates`, ranks beyond them are
    reported as None (the draft returned only that many)."""

    def seen(rank: int | None) -> int | None:
        return None if rank is None or (candidates is not None and rank > candidates) else rank

    for _ in range(count):
        ranks.update(True, seen(draw_rank(rng, rank_probabilities(bonus))), candidates)
        ranks.update(False, seen(draw_rank(rng, rank_probabilities(corr))), candidates)


def test_candidate_ranks_converge_to_the_true_coverage() -> None:
    ranks = CandidateRanks(decay=1.0)
    feed(ranks, random.Random(1), 5000)
    for fanout in range(1, 8):
        assert ranks.c_bonus(fanout) == pytest.approx(TRUE_BONUS[fanout - 1], abs=0.02)
        assert ranks.c_corr(fanout) == pytest.approx(TRUE_CORR[fanout - 1], abs=0.02)


def test_candidate_ranks_follow_a_change() -> None:
    ranks = CandidateRanks()  # recency-weighted
    rng = random.Random(2)
    feed(ranks, rng, 1000)
    later = (0.3, 0.35, 0.38, 0.4, 0.41, 0.42, 0.43)
    feed(ranks, rng, 1000, corr=later)
    for fanout in range(1, 8):
        assert ranks.c_corr(fanout) == pytest.approx(later[fanout - 1], abs=0.08)


def test_candidate_ranks_take_censoring_into_account() -> None:
    """The draft returned 2 candidates: a miss says nothing about rank 3, so c(3) keeps the prior's
    step beyond c(2) instead of collapsing onto it."""
    ranks = CandidateRanks(decay=1.0)
    feed(ranks, random.Random(3), 4000, candidates=2)
    assert ranks.c_corr(1) == pytest.approx(TRUE_CORR[0], abs=0.02)
    assert ranks.c_corr(2) == pytest.approx(TRUE_CORR[1], abs=0.02)
    prior_hazard = (DEFAULT_C_CORR[2] - DEFAULT_C_CORR[1]) / (1 - DEFAULT_C_CORR[1])
    assert ranks.c_corr(3) - ranks.c_corr(2) == pytest.approx((1 - ranks.c_corr(2)) * prior_hazard, rel=1e-9)
    # a known rank beyond the candidates counted is still a rank
    ranks.update(False, 3, candidates=2)
    assert ranks.c_corr(3) - ranks.c_corr(2) > (1 - ranks.c_corr(2)) * prior_hazard
    with pytest.raises(ValueError):
        ranks.update(False, 0)


def test_branch_cost_starts_from_the_draft_time() -> None:
    cost = BranchCost(slope_ratio=0.25)
    assert cost.seconds(9, 4, t_draft=0.004) == pytest.approx(4 * (0.004 + 0.001 * 8))
    assert BranchCost(prior_t1=0.002).seconds(9, 4, t_draft=0.004) == pytest.approx(4 * (0.004 + 0.002 * 8))
    assert cost.hop_seconds(0.03) == 0.03  # unmeasured: the draft's RTT


def test_branch_cost_fits_the_line() -> None:
    rng = random.Random(4)
    cost = BranchCost(slope_ratio=0.0)
    t0, t1 = 0.006, 0.0015
    for index in range(300):
        rows, passes = (4, 4) if index % 2 else (15, 5)
        seconds = passes * (t0 + t1 * (rows - 1)) * rng.uniform(0.95, 1.05)
        cost.observe(seconds, passes, rows, hop_seconds=0.02 * rng.uniform(0.9, 1.1))
    fitted_t0, fitted_t1 = cost.coefficients(t_draft=0.004)  # the prior is outweighed
    assert fitted_t0 == pytest.approx(t0, rel=0.1)
    assert fitted_t1 == pytest.approx(t1, rel=0.1)
    assert cost.hop_seconds(0.5) == pytest.approx(0.02, rel=0.1)


def test_branch_cost_charges_the_wait_for_the_branches_to_them_not_to_the_hop() -> None:
    # The draft runs one job per branch: beyond its compute, scheduling them and sending them back
    # takes time that grows with the branches. A wide call (15 rows) waits 3x its compute, a narrow
    # one (3 rows) about its compute. Were the excess a fixed hop, as it once was, the wide calls
    # would make every narrow one look as slow (a 0.2 s hop on a 0.07 s verify: never worth it).
    cost = BranchCost(slope_ratio=0.0)
    t0, t1, overhead_per_row = 0.006, 0.0015, 0.004
    for index in range(300):
        rows, passes = (3, 2) if index % 2 else (15, 5)
        compute = passes * (t0 + t1 * (rows - 1))
        waited = compute + passes * overhead_per_row * (rows - 1)
        hop = 0.01 if index % 3 == 0 else None  # measured only on calls of their own
        cost.observe(compute, passes, rows, after_proposal_seconds=waited, hop_seconds=hop)
    assert cost.hop_seconds(0.5) == pytest.approx(0.01)
    assert cost.seconds(15, 5, t_draft=0.006) == pytest.approx(5 * (t0 + (t1 + overhead_per_row) * 14), rel=0.05)
    assert cost.seconds(3, 2, t_draft=0.006) == pytest.approx(2 * (t0 + (t1 + overhead_per_row) * 2), rel=0.05)
    # a wait shorter than the reported compute (clocks apart) never makes the branches cheaper
    quick = BranchCost(slope_ratio=0.0)
    for _ in range(100):
        quick.observe(0.02, 2, 3, after_proposal_seconds=0.001)
    assert quick.seconds(3, 2, t_draft=0.006) == pytest.approx(0.02, rel=0.05)


def test_branch_cost_from_one_row_count_keeps_t0_at_the_draft_time() -> None:
    cost = BranchCost()
    for _ in range(50):
        cost.observe(4 * (0.004 + 0.002 * 11), 4, 12)
    t0, _ = cost.coefficients(t_draft=0.004)
    assert t0 == pytest.approx(0.004, rel=0.05)
    assert cost.seconds(12, 4, t_draft=0.004) == pytest.approx(4 * (0.004 + 0.002 * 11), rel=0.01)
    assert cost.seconds(24, 4, t_draft=0.004) > cost.seconds(12, 4, t_draft=0.004)


def test_branch_cost_never_predicts_rows_cheaper() -> None:
    cost = BranchCost()
    for _ in range(50):
        cost.observe(0.010, 1, 2)
        cost.observe(0.004, 1, 20)
    assert cost.coefficients(t_draft=0.004)[1] == 0.0
    with pytest.raises(ValueError):
        cost.observe(0.01, 0, 3)


def test_verify_slowdown() -> None:
    slowdown = VerifySlowdown(max_slowdown=3.0)
    assert slowdown.value == 1.0
    for _ in range(100):
        slowdown.observe(True, 0.030, 0.020)
    assert slowdown.value == pytest.approx(1.5, rel=1e-3)
    assert slowdown.plain_seconds(0.030, pipelined=True) == pytest.approx(0.020, rel=1e-3)
    assert slowdown.plain_seconds(0.030, pipelined=False) == 0.030
    # relative to the plain rounds: right even when the fit was fed the slowed passes
    for _ in range(100):
        slowdown.observe(False, 0.020, 0.025)
        slowdown.observe(True, 0.030, 0.025)
    assert slowdown.value == pytest.approx(1.5, rel=1e-3)
    faster = VerifySlowdown()
    for _ in range(50):
        faster.observe(True, 0.018, 0.020)
    assert faster.value == 1.0  # never below 1
    capped = VerifySlowdown(max_slowdown=2.0)
    for _ in range(50):
        capped.observe(True, 0.1, 0.02)
    assert capped.value == 2.0
    capped.observe(True, 0.1, 0.0)  # no prediction: ignored
    assert capped.value == 2.0


def test_pool_priors_seed_new_sessions() -> None:
    pool = PipelinePriors(weight=0.5)
    first = PipelineController(priors=pool)
    for _ in range(200):
        first.observe_outcome(False, 1, candidates=7, fanout=1)  # the correction always the first
        first.observe_branches(0.05, 5, 10, hop_seconds=0.02)
    snapshot = pool.snapshot()
    assert snapshot.c_corr is not None and snapshot.c_corr[0] > 0.9
    assert snapshot.c_bonus is None  # no bonus outcome measured
    assert snapshot.branch_hop == pytest.approx(0.02)
    second = PipelineController(priors=pool)
    assert second.ranks.c_corr(1) > 0.9
    assert second.ranks.c_bonus(1) == pytest.approx(DEFAULT_C_BONUS[0])
    pool.update(PipelinePriorEstimates(verify_slowdown=2.0))
    pool.update(PipelinePriorEstimates())  # nothing known: nothing changes
    assert pool.snapshot().verify_slowdown == 2.0
    assert PipelineController(priors=pool).slowdown.value == 2.0


# -- the controller in a simulated world ---------------------------------------------------------------


@dataclass
class Played:
    choices: list[tuple[int, int]]
    hits: int = 0
    pipelined: int = 0


def play(controller: PipelineController, world: World, rounds: int, seed: int = 0) -> Played:
    """Rounds of the loop: choose, verify, draft ahead, learn the outcome. The controller is given the
    true costs (the K controller's estimates); ranks, branch times and the slowdown it learns."""
    rng = random.Random(seed)
    bonus_probabilities = rank_probabilities(world.coverage.bonus)
    corr_probabilities = rank_probabilities(world.coverage.corr)
    played = Played([])
    for _ in range(rounds):
        num, fanout = controller.choose(world.alpha, world.costs(), MAX_K, MAX_F)
        played.choices.append((num, fanout))
        if num == 0:
            continue
        accepted = 0
        while accepted < num and rng.random() < world.alpha:
            accepted += 1
        ahead = fanout > 0
        plain = world.verify(num + 1)
        controller.observe_verify(ahead, plain * (world.slowdown if ahead else 1.0), plain)
        if not ahead:
            continue
        rows, passes = branch_rows(num, fanout), branch_passes(num)
        seconds = passes * (world.t_draft + world.branch_t1 * (rows - 1))
        controller.observe_branches(seconds, passes, rows, after_proposal_seconds=seconds, hop_seconds=world.rtt_draft)
        bonus = accepted == num
        rank = draw_rank(rng, bonus_probabilities if bonus else corr_probabilities)
        controller.observe_outcome(bonus, rank, candidates=MAX_F if bonus else MAX_F - 1, fanout=fanout)
        played.pipelined += 1
        played.hits += rank is not None and rank <= fanout
    return played


def test_controller_drafts_ahead_and_hits_as_often_as_it_predicts() -> None:
    world = World()
    controller = PipelineController()
    played = play(controller, world, 600)
    tail = played.choices[300:]
    assert sum(fanout > 0 for _, fanout in tail) >= 0.95 * len(tail)  # refresh rounds apart
    estimates = controller.estimates()
    assert played.hits / played.pipelined == pytest.approx(estimates["pipeline_hit_rate"], abs=0.06)
    assert estimates["pipeline_observed_hit_rate"] == pytest.approx(estimates["pipeline_hit_rate"], abs=0.15)
    assert estimates["verify_slowdown"] == 1.0
    assert estimates["branch_t1"] == pytest.approx(world.branch_t1, rel=0.2)
    assert estimates["branch_hop_seconds"] == pytest.approx(world.rtt_draft)
    assert estimates["pipeline_predicted_gain"] > 1.03
    for name in ("pipeline_fanout", "branch_seconds", "branch_t0", "pipeline_c_bonus", "pipeline_c_corr"):
        assert name in estimates


def test_controller_learns_that_branches_cost_too_much() -> None:
    world = World(branch_t1=0.02)  # the prior (t1 = t_draft / 4) is too hopeful
    controller = PipelineController()
    played = play(controller, world, 300)
    assert played.choices[0][1] > 0
    assert all(fanout == 0 for _, fanout in played.choices[-20:])
    assert controller.estimates()["branch_t1"] == pytest.approx(0.02, rel=0.2)


def test_controller_learns_the_colocation_slowdown() -> None:
    world = World(slowdown=1.6)
    controller = PipelineController()
    played = play(controller, world, 300)
    assert played.choices[0][1] > 0
    assert all(fanout == 0 for _, fanout in played.choices[-20:])
    # a few pipelined rounds (and the 1-sample prior of no slowdown) are enough to turn it off
    assert 1.4 <= controller.estimates()["verify_slowdown"] <= 1.6


def test_controller_refreshes_while_on_and_probes_while_off() -> None:
    config = PipelineConfig(refresh_interval_rounds=10, probe_interval_rounds=5, probe_interval_max_rounds=20)
    on = play(PipelineController(config), World(), 60).choices
    plain_rounds = [index for index, (_, fanout) in enumerate(on) if fanout == 0]
    assert plain_rounds == [10, 21, 32, 43, 54]  # one plain round after every 10 drafted ahead
    off = play(PipelineController(config), World(branch_t1=0.05), 120).choices
    probes = [index for index, (_, fanout) in enumerate(off) if fanout > 0]
    assert probes[0] == 0  # the prior is hopeful: the first round drafts ahead
    gaps = [later - earlier for earlier, later in pairwise(probes)]
    assert gaps[:4] == [6, 11, 21, 21]  # 5, 10, 20 plain rounds between probes, capped at 20
    assert all(fanout == 1 for index, (_, fanout) in enumerate(off) if index in probes[1:])


def test_short_sessions_of_a_pool_still_probe() -> None:
    """Sessions of 4 rounds, each shorter than the probe interval, one after another on the pool's
    priors: once the pool has learnt that drafting ahead does not pay, a new session starts with
    it off, and only probes counted over the pool's plain rounds ever measure it again."""
    config = PipelineConfig(probe_interval_rounds=5, probe_interval_max_rounds=20)
    priors = PipelinePriors()
    choices: list[tuple[int, int]] = []
    for session in range(60):
        controller = PipelineController(config, priors)
        choices += play(controller, World(branch_t1=0.05), 4, seed=session).choices
    ahead = [index for index, (_, fanout) in enumerate(choices) if fanout > 0]
    late = [index for index in ahead if index >= 80]
    assert len(late) >= 4, ahead
    assert all(later - earlier <= 21 for earlier, later in pairwise(late))  # capped at 20 plain rounds
    assert all(choices[index][1] == 1 for index in late)  # probes, not a decision to pipeline
    assert len(ahead) < len(choices) / 5


def test_controller_never_pipelines_k_zero() -> None:
    controller = PipelineController(PipelineConfig(probe_interval_rounds=1))
    for _ in range(5):
        assert controller.choose(0.7, World().costs(), 0, MAX_F) == (0, 0)
    hopeless = World(alpha=0.1, t_draft=0.05)
    assert all(choice == (0, 0) for choice in play(PipelineController(), hopeless, 50).choices)


def test_controller_hysteresis_keeps_a_choice_that_stays_close() -> None:
    def sweep(hysteresis: float) -> list[tuple[int, int]]:
        # no margin to turn pipelining on, which is a hysteresis of its own; the world's ranks
        # taken as measured (no hopeful ranks before outcomes)
        config = PipelineConfig(margin=0.0, hysteresis=hysteresis, refresh_interval_rounds=0,
                                probe_interval_rounds=0, measured_outcomes=0)
        controller = PipelineController(config)
        choices = []
        for step in range(40):  # the draft's RTT jitters either side of where K = 0 starts to win
            world = World(rtt_draft=0.037 if step % 2 else 0.038, branch_t1=0.001)  # t1: the prior's
            choice = controller.choose(world.alpha, world.costs(), MAX_K, MAX_F)
            best = world.choice(margin=0.0)
            if choice != best:  # kept: the best is not 3 % better
                assert world.seconds(*best) >= 0.97 * world.seconds(*choice)
            choices.append(choice)
        return choices

    def switches(choices: list[tuple[int, int]]) -> int:
        return sum(before != after for before, after in pairwise(choices))

    steady, eager = sweep(0.03), sweep(0.0)
    assert switches(eager) == 39  # (0, 0), (3, 1), (0, 0), ...
    assert switches(steady) == 0


def test_rank_tally_hopes_for_every_round_a_hit_until_the_outcomes_say_otherwise() -> None:
    tally = RankTally(3)
    assert tally.hopeful(4.0).c_bonus(1) == 1.0 and tally.hopeful(4.0).c_corr(3) == 1.0
    for rank in (None, None, 2, None):  # corrections: one within 2 candidates
        tally.add(False, rank)
    tally.add(True, 1)
    hopeful = tally.hopeful(4.0)
    assert tally.outcomes == 5
    assert hopeful.c_corr(1) == pytest.approx(4 / 8)
    assert hopeful.c_corr(2) == hopeful.c_corr(3) == pytest.approx(5 / 8)
    assert hopeful.c_bonus(1) == pytest.approx(1.0)
    assert hopeful.c_corr(0) == 0.0


def test_could_pay_turns_on_the_pools_outcomes() -> None:
    """Every round a hit would make drafting ahead pay here; outcomes whose candidates all missed
    say it will not (long before the ranks count as measured), outcomes that hit keep it open,
    and a pool's sessions judge by the outcomes of all of them."""
    from tests.unit.test_k_plain_stretches import draft_hop_world

    costs, alpha = draft_hop_world().costs(), 0.6
    misses = 6
    assert misses < PipelineConfig().measured_outcomes
    assert PipelineController().could_pay(alpha, costs, MAX_K, 3)
    for rank, expected in ((None, False), (1, True)):
        priors = PipelinePriors()
        tested = PipelineController(priors=priors)
        for _ in range(misses):
            tested.observe_outcome(False, rank, 8, 3)
        assert tested.could_pay(alpha, costs, MAX_K, 3) is expected
        assert PipelineController(priors=priors).could_pay(alpha, costs, MAX_K, 3) is expected


def test_rank_tally_shrunk_towards_a_prior() -> None:
    tally = RankTally(3)
    prior = FixedCoverage((0.4, 0.5, 0.6), (0.2, 0.3, 0.4))
    assert tally.shrunk(prior, 2.0).c_bonus(2) == pytest.approx(0.5)  # no outcomes: the prior
    for rank in (1, 1, 2, None):
        tally.add(False, rank)
    shrunk = tally.shrunk(prior, 2.0)
    assert shrunk.c_corr(1) == pytest.approx((2 + 2 * 0.2) / 6)
    assert shrunk.c_corr(3) == pytest.approx((3 + 2 * 0.4) / 6)
    assert shrunk.c_bonus(1) == pytest.approx(0.4)


def test_measured_ranks_are_the_pools_counted_outcomes() -> None:
    """Once the pool has its outcomes, decisions read them as counted (a little pulled towards the
    pool's prior curves), not a session's CandidateRanks, whose 8 pseudo-outcomes of the default
    pair's curves would keep a draft whose candidates always hold the target's token looking
    like the default one for dozens of outcomes more (which, measured one per probe beside a
    stretch, would keep drafting ahead off for good)."""
    from tests.unit.test_k_plain_stretches import draft_hop_world

    costs, alpha = draft_hop_world().costs(), 0.7
    needed = PipelineConfig().measured_outcomes

    def controller_after(rank: int | None) -> PipelineController:
        priors = PipelinePriors()
        for _ in range(needed):
            priors.add_outcome(False, rank)
        controller = PipelineController(priors=priors)
        assert controller.ranks_measured
        return controller

    hits, misses = controller_after(1), controller_after(None)
    assert hits.ranks.c_corr(1) == misses.ranks.c_corr(1) < 0.3  # the session's own curves: the prior's
    assert hits.drafts_ahead(alpha, costs, MAX_K, 3) and not misses.drafts_ahead(alpha, costs, MAX_K, 3)
    assert hits.estimates()["pipeline_c_corr"] > 0.8 > 0.1 > misses.estimates()["pipeline_c_corr"]
