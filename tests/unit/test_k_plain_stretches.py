"""K = 0 rounds decoded in one call (PlainStretches): the controller says how many K = 0 rounds it
commits to (until its next probe), is told of them afterwards, and prices K = 0 at their measured
pace. Synthetic rounds from tests/unit/test_k_controller.py's simulator: no servers, no clocks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.k_controller import (
    PLAIN_FACTOR_RANGE,
    AdaptiveKController,
    KControllerConfig,
    best_k,
    round_time,
)
from orchestrator.k_estimates import ControllerPriors, PriorEstimates
from orchestrator.k_policy import PlainStretches
from orchestrator.pipeline_policy import PipelineConfig, PipelinePriorEstimates, PipelinePriors
from orchestrator.pipelining import AheadObservation
from tests.unit.test_k_controller import K_MAX, Conditions, SimulatedServices, play, slow_draft_hop


def play_with_stretches(controller: AdaptiveKController, services: SimulatedServices, world: Conditions,
                        tokens: int, plain_factor: float) -> tuple[list[int], list[int]]:
    """Like play(), but K = 0 rounds the controller commits to run as one stretch, at plain_factor
    times a K = 0 Verify round's time per token. Returns (K of each round, length of each stretch)."""
    ks: list[int] = []
    stretches: list[int] = []
    while len(ks) < tokens:
        rounds = min(controller.plain_rounds(), tokens - len(ks))
        if rounds > 0:
            pace = plain_factor * (world.verify(1) + world.rtt_target)
            for _ in range(rounds):
                services.round(0, world)  # the simulated draft falls behind by one token each
            controller.observe_plain(rounds, pace)
            ks += [0] * rounds
            stretches.append(rounds)
            continue
        k = controller.choose(K_MAX)
        controller.observe(services.round(k, world))
        ks.append(k)
    return ks, stretches


def test_round_time_prices_k0_at_the_plain_factor() -> None:
    costs = replace(Conditions().costs(), others_rows=3)
    plain = costs.verify_fn(4) + costs.rtt_target
    assert round_time(0, replace(costs, plain_factor=0.6)) == pytest.approx(0.6 * plain)
    assert round_time(0, costs) == pytest.approx(plain)
    for k in (1, 3):  # drafted rounds are Verify rounds whatever the factor
        assert round_time(k, replace(costs, plain_factor=0.6)) == pytest.approx(round_time(k, costs))


def test_the_adaptive_controller_is_a_plain_stretches_policy() -> None:
    assert isinstance(AdaptiveKController(), PlainStretches)


def test_no_stretch_while_drafting() -> None:
    controller = AdaptiveKController(KControllerConfig(max_num_speculative_tokens=K_MAX))
    assert controller.plain_rounds() == 0  # it starts at its initial K
    play(controller, SimulatedServices(0), Conditions(alpha=0.9), 50)
    assert controller.plain_rounds() == 0


def draft_hop_world() -> Conditions:
    """A 20 ms draft hop: plain drafting does not pay for it, drafting ahead can (a hit skips it)."""
    return Conditions(alpha=0.5, t_draft=0.003, verify_a=0.020, verify_b=0.0005, rtt_draft=0.020,
                      rtt_target=0.010, decodes=True)


def measured(priors: PipelinePriors, rank: int | None = None) -> PipelinePriors:
    """A pool whose sessions have drafted ahead often enough for its candidate ranks to count as
    measured: that many corrections, the target's token at `rank` among the draft's candidates
    (None: not among them), which decisions then read (the bonus curve stays the priors'; play()
    drafts no branches)."""
    for _ in range(PipelineConfig().measured_outcomes):
        priors.add_outcome(rank=rank)
    return priors


def auto_controller(priors: PipelinePriors, shadow_probes: bool = False, ranks_beside: bool = False) -> AdaptiveKController:
    controller = AdaptiveKController(KControllerConfig(max_num_speculative_tokens=K_MAX),
                                     shadow_probes=shadow_probes, ranks_beside=ranks_beside)
    controller.pipeline(max_fanout=3, priors=priors)
    return controller


def test_pipelining_auto_stretches_where_drafting_ahead_does_not_pay_either() -> None:
    world = draft_hop_world()
    assert best_k(world.alpha, world.costs(), K_MAX) == 0
    # The default pair's candidate ranks: a hit too rare to pay for the misses' hops.
    controller = auto_controller(measured(PipelinePriors()))
    ks = play(controller, SimulatedServices(1), world, 200)
    assert ks[-40:] == [0] * 40
    assert controller.plain_rounds() > 0


def test_pipelining_auto_tries_drafting_ahead_at_hopeful_ranks_until_they_are_measured() -> None:
    """Until the pool has seen enough drafted-ahead outcomes, drafting ahead is weighed at the
    ranks the outcomes so far leave most hopeful (before the first: every round a hit), not at
    the prior ranks: those (the default pair's) alone would rule it out, and a much better draft
    would never be found out. Measured at those ranks, a stretch wins."""
    world = draft_hop_world()
    priors = PipelinePriors()
    controller = auto_controller(priors)
    play(controller, SimulatedServices(1), world, 200)
    assert controller.estimates()["num_speculative_tokens"] == 0  # plain drafting does not pay
    assert controller.plain_rounds() == 0  # no stretch: drafting ahead is tried
    assert controller.choose(K_MAX) > 0 and controller.planned_fanout > 0
    measured(priors)
    assert controller.plain_rounds() > 0


def test_pipelining_auto_stretches_first_until_the_pool_has_a_stretch_pace() -> None:
    """Before the session or its pool has measured a K = 0 stretch's pace, K = 0 comes first, as a
    stretch to the next probe, even where the pending ranks would have drafting ahead tried: its
    price until then (a target pass per token) is no measure of a target whose Decode runs
    faster. Once its pace is measured drafting ahead is weighed against it (here: tried), and a
    later session of the pool starts from that pace, without a stretch first."""
    world = draft_hop_world()
    pool = ControllerPriors()

    def session() -> AdaptiveKController:
        controller = AdaptiveKController(KControllerConfig(max_num_speculative_tokens=K_MAX), priors=pool)
        controller.pipeline(max_fanout=3, priors=PipelinePriors())
        return controller

    first = session()
    services = SimulatedServices(1)
    first.observe(services.round(first.choose(K_MAX), world))  # its opening round, at the initial K
    assert "plain_factor" not in first.estimates()
    stretch = first.plain_rounds()
    assert stretch > 0
    assert first.choose(K_MAX) == 0 and first.planned_fanout == 0  # no drafting ahead before it
    for _ in range(stretch):
        services.round(0, world)
    first.observe_plain(stretch, world.plain_pace(stretch))
    assert first.plain_rounds() == 0
    assert first.choose(K_MAX) > 0 and first.planned_fanout > 0 and first.planned_test

    later = session()
    later.observe(SimulatedServices(2).round(later.choose(K_MAX), world))
    assert later.plain_rounds() == 0
    assert later.choose(K_MAX) > 0 and later.planned_fanout > 0


def test_pipelining_auto_stops_testing_a_draft_whose_candidates_keep_missing() -> None:
    """The drafted-ahead tests end early where their outcomes rule drafting ahead out: with the
    candidates missing on every test so far, K = 0 is priced at its stretched pace (and stretches)
    long before the pool counts the ranks as measured; with them hitting, the tests go on."""
    world = draft_hop_world()

    def after_tests(rank: int | None) -> AdaptiveKController:
        priors = PipelinePriors()
        controller = auto_controller(priors)
        play(controller, SimulatedServices(1), world, 100)
        for _ in range(6):
            controller.observe_ahead(AheadObservation(
                num_speculative_tokens=2, num_accepted=0, rank=rank, candidates=8, fanout=3, branches=0,
                branch_num_speculative_tokens=2, compute_seconds=0.0, after_proposal_seconds=0.0,
                call_hop_seconds=None))
        assert priors.outcomes < PipelineConfig().measured_outcomes
        return controller

    assert after_tests(rank=None).plain_rounds() > 0
    assert after_tests(rank=1).plain_rounds() == 0


def test_a_session_runs_its_share_of_the_tests_then_drafts_ahead_only_on_its_merits() -> None:
    """While the pool's ranks are pending a session prices K = 0 as a Verify round, so that
    drafting ahead is tried, for its first PipelineConfig.session_test_rounds drafted-ahead rounds
    only: after them its K = 0 is priced at its streamed pace again. Outcomes that leave the ranks
    hopeful enough to keep testing (half of them hits) stop this session's tests at its share,
    not the pool's: a new session tests again until the pool has measured the ranks."""
    world = replace(draft_hop_world(), alpha=0.5)
    share = PipelineConfig().session_test_rounds
    assert 0 < share < PipelineConfig().measured_outcomes
    priors = PipelinePriors()
    controller = auto_controller(priors)
    play(controller, SimulatedServices(1), world, 100)

    def test_round(rank: int | None) -> None:
        controller.observe_ahead(AheadObservation(
            num_speculative_tokens=2, num_accepted=0, rank=rank, candidates=8, fanout=3, branches=0,
            branch_num_speculative_tokens=2, compute_seconds=0.0, after_proposal_seconds=0.0,
            call_hop_seconds=None))

    ranks = [1 if i % 2 == 0 else None for i in range(share)]
    for rank in ranks[:-1]:
        test_round(rank)
    assert controller.plain_rounds() == 0  # still testing
    assert controller.choose(K_MAX) > 0 and controller.planned_test
    test_round(ranks[-1])
    assert priors.outcomes == share < PipelineConfig().measured_outcomes
    # Its share spent: K = 0 is priced at its pace, so drafting ahead runs only where it beats
    # that (here a near tie, kept either way by the hysteresis), never as a test.
    controller.choose(K_MAX)
    assert not controller.planned_test

    newcomer = auto_controller(priors)
    play(newcomer, SimulatedServices(1), world, 100)
    assert newcomer.plain_rounds() == 0  # the pool's ranks are still pending: it tests
    assert newcomer.choose(K_MAX) > 0 and newcomer.planned_test


def target_hop_world() -> Conditions:
    """The default pair's pass times with a 30 ms hop each way and a draft accepted 40 % of the
    time: a hit round still pays the target's hop and a pass for ~1.5 tokens, while a stretch pays
    the hop once, so drafting ahead cannot pay even were every round a hit."""
    return Conditions(alpha=0.4, t_draft=0.004, verify_a=0.032, verify_b=0.0019, rtt_draft=0.030,
                      rtt_target=0.030, decodes=True)


def test_pipelining_auto_stretches_unmeasured_where_no_ranks_could_make_drafting_ahead_pay() -> None:
    """Measuring the candidate ranks (drafted-ahead rounds in place of stretches) is skipped where
    drafting ahead would lose to a stretch even with every round a hit: no ranks could change the
    choice. In the world where a hit would pay (a draft hop to skip) the rounds still run."""
    priors = PipelinePriors()
    controller = auto_controller(priors)
    play(controller, SimulatedServices(1), target_hop_world(), 200)
    assert priors.outcomes < PipelineConfig().measured_outcomes
    assert controller.estimates()["num_speculative_tokens"] == 0
    assert controller.plain_rounds() > 0  # unmeasured, yet stretched

    hopeful = auto_controller(PipelinePriors())
    play(hopeful, SimulatedServices(1), draft_hop_world(), 200)
    assert hopeful.plain_rounds() == 0


def test_pipelining_auto_probes_from_k0_draft_ahead() -> None:
    """At K = 0 under pipelining auto the probes draft ahead at fan-out 1, so that the candidate
    ranks that price drafting ahead against K = 0 are measured there too."""
    controller = auto_controller(measured(PipelinePriors()))
    play(controller, SimulatedServices(1), draft_hop_world(), 200)
    stretch = controller.plain_rounds()
    assert stretch > 0
    controller.observe_plain(stretch, draft_hop_world().plain_pace(stretch))
    assert controller.plain_rounds() == 0  # the probe is due
    assert controller.choose(K_MAX) == KControllerConfig().probe_num_speculative_tokens
    assert controller.planned_fanout == 1


def test_pipelining_auto_keeps_its_rounds_where_drafting_ahead_pays() -> None:
    """Where the draft's top candidates nearly always hold the target's token, a hit round is the
    target's hop and pass alone: drafting ahead beats K = 0 even decoded in one call."""
    world = draft_hop_world()
    sure = PipelinePriorEstimates(c_bonus=(0.97, 0.98, 0.99), c_corr=(0.97, 0.98, 0.99))
    controller = auto_controller(measured(PipelinePriors(initial=sure), rank=1))
    ks = play(controller, SimulatedServices(1), world, 200)
    assert all(k > 0 for k in ks[-40:])
    assert controller.plain_rounds() == 0
    assert controller.choose(K_MAX) > 0 and controller.planned_fanout > 0


def test_a_new_session_says_whether_it_would_draft_from_its_start() -> None:
    """would_draft: what a session of a pool would do first, as the pool's estimates stand (the
    way pipelining auto's next request runs turns on it: RequestStreaming)."""
    world = draft_hop_world()

    def session(pool: ControllerPriors, ranks: PipelinePriors | None) -> AdaptiveKController:
        controller = AdaptiveKController(KControllerConfig(max_num_speculative_tokens=K_MAX), priors=pool)
        if ranks is not None:
            controller.pipeline(max_fanout=3, priors=ranks)
        return controller

    sure = measured(PipelinePriors(initial=PipelinePriorEstimates(c_bonus=(0.97, 0.98, 0.99),
                                                                  c_corr=(0.97, 0.98, 0.99))), rank=1)
    ahead_pool = ControllerPriors()
    play(session(ahead_pool, sure), SimulatedServices(1), world, 200)
    assert session(ahead_pool, sure).would_draft()  # drafting ahead pays from the start
    assert not session(ahead_pool, None).would_draft()  # plain drafting does not at this hop

    missing = measured(PipelinePriors())  # the default pair's ranks: hits too rare to pay
    stretch_pool = ControllerPriors()
    play(session(stretch_pool, missing), SimulatedServices(1), world, 200)
    assert not session(stretch_pool, missing).would_draft()

    near_pool = ControllerPriors()  # no hops to speak of: plain drafting pays
    near = Conditions(alpha=0.8, t_draft=0.003, verify_a=0.020, verify_b=0.0005, rtt_draft=0.001,
                      rtt_target=0.001, decodes=True)
    play(session(near_pool, None), SimulatedServices(1), near, 200)
    assert session(near_pool, None).would_draft()


def test_stretches_run_to_the_probes_which_back_off_as_per_round() -> None:
    """Stretched or not, K = 0 rounds count towards the probes the same: the same K every round."""
    config = KControllerConfig(max_num_speculative_tokens=K_MAX, probe_interval_rounds=10, probe_backoff=2.0)
    world = slow_draft_hop()
    per_round = play(AdaptiveKController(config), SimulatedServices(2), world, 400)
    # At factor 1 a stretch's pace is the K = 0 round's, so nothing else differs.
    stretched, stretches = play_with_stretches(AdaptiveKController(config), SimulatedServices(2), world, 400, 1.0)
    assert stretched == per_round
    whole = stretches[:-1]  # the last one is cut where the play ends
    assert len(whole) >= 3 and whole == sorted(whole) and whole[-1] > whole[0], stretches
    # Every stretch ends where a probe is due: the round after it drafts (K = probe K).
    position = 0
    for index, (k, following) in enumerate(zip(stretched, stretched[1:])):
        if k == 0 and following > 0:
            position += 1
            assert following == config.probe_num_speculative_tokens, index
    assert position >= len(stretches) - 1


def break_even_world() -> Conditions:
    """A draft that pays a little at the price of a K = 0 Verify round, but not at 0.7 of it."""
    return Conditions(alpha=0.5, t_draft=0.003, verify_a=0.020, verify_b=0.001, rtt_draft=0.002, rtt_target=0.002)


def test_a_pool_that_measured_cheap_stretches_settles_at_k0() -> None:
    world = break_even_world()
    assert best_k(world.alpha, world.costs(), K_MAX) > 0
    assert best_k(world.alpha, replace(world.costs(), plain_factor=0.7), K_MAX) == 0
    config = KControllerConfig(max_num_speculative_tokens=K_MAX)

    def settled(priors: ControllerPriors, seed: int) -> tuple[list[int], AdaptiveKController]:
        controller = AdaptiveKController(config, priors=priors)
        ks, _ = play_with_stretches(controller, SimulatedServices(seed), world, 400, 0.7)
        return ks, controller

    # A pool that never measured a stretch prices K = 0 as a Verify round whose target hop is paid
    # once per stretch, which here still leaves drafting ahead: a new session opens drafting.
    unmeasured = ControllerPriors()
    ks, _ = settled(unmeasured, 3)
    assert ks[0] > 0
    # One that did (earlier sessions' stretches at 0.7 of a Verify round) settles at K = 0, and
    # its sessions keep measuring the factor.
    measured = ControllerPriors(initial=replace(unmeasured.snapshot(), plain_factor=0.7))
    ks, controller = settled(measured, 3)
    assert sum(k == 0 for k in ks[-100:]) > 90
    assert controller.estimates()["plain_factor"] == pytest.approx(0.7, rel=0.05)
    assert measured.snapshot().plain_factor == pytest.approx(0.7, rel=0.05)


def test_observed_stretches_teach_the_pool_their_pace_and_owe_the_draft_its_tokens() -> None:
    priors = ControllerPriors()
    controller = AdaptiveKController(KControllerConfig(max_num_speculative_tokens=K_MAX), priors=priors)
    play(controller, SimulatedServices(5), slow_draft_hop(), 60)  # at K = 0 by now
    assert controller.plain_rounds() > 0
    world = slow_draft_hop()  # a target without Decode: its stretches so far ran at a Verify round's pace
    verify_round = world.verify(1) + world.rtt_target
    earlier = controller.estimates()["plain_factor"]
    assert earlier == pytest.approx(1.0, abs=0.05)  # against the controller's own fit of the round
    pooled = priors.snapshot().plain_factor
    assert pooled == pytest.approx(1.0, abs=0.05)
    before = controller.plain_rounds()
    controller.observe_plain(4, 0.5 * verify_round)
    assert controller.plain_rounds() == before - 4
    factor = controller.estimates()["plain_factor"]
    assert factor < earlier - 0.04  # an EWMA: a step of at least its weight towards 0.5
    assert factor < priors.snapshot().plain_factor < pooled
    # A stretch cut short (no pace) still counts its rounds, but prices nothing.
    before = controller.plain_rounds()
    controller.observe_plain(2, None)
    assert controller.plain_rounds() == before - 2
    assert controller.estimates()["plain_factor"] == factor
    # A pace far outside the range is taken as its bound, not as K = 0's price.
    for _ in range(50):
        controller.observe_plain(1, 1000.0 * verify_round)
    assert controller.estimates()["plain_factor"] == pytest.approx(PLAIN_FACTOR_RANGE[1], rel=0.01)


def test_the_pool_prior_carries_the_plain_factor() -> None:
    seeded = AdaptiveKController(priors=ControllerPriors(initial=PriorEstimates(plain_factor=0.8)))
    assert seeded.estimates()["plain_factor"] == pytest.approx(0.8)


def test_fixed_k0_commits_to_a_whole_decode_and_fixed_k_to_none() -> None:
    from orchestrator.k_policy import FixedK
    from specdec.protocol import MAX_DECODE_STEPS

    assert isinstance(FixedK(0), PlainStretches)
    assert FixedK(0).plain_rounds() == MAX_DECODE_STEPS
    assert FixedK(3).plain_rounds() == 0
    assert not FixedK(0).would_draft() and FixedK(3).would_draft()


def test_stretches_do_not_pull_the_pool_alpha_towards_a_stale_estimate() -> None:
    """A session that went to K = 0 after poorly accepted rounds measures no acceptance in its
    stretches: they teach the pool their pace, not that session's last alpha again."""
    priors = ControllerPriors(initial=PriorEstimates(alpha=0.6))
    world = slow_draft_hop()
    controller = AdaptiveKController(KControllerConfig(max_num_speculative_tokens=K_MAX), priors=priors)
    play(controller, SimulatedServices(0), replace(world, alpha=0.05), 12)
    session_alpha = controller.estimates()["alpha"]
    after_rounds = priors.snapshot().alpha
    assert after_rounds is not None and session_alpha < after_rounds < 0.6  # the rounds measured it
    for _ in range(40):
        controller.observe_plain(8, 0.04)
    assert priors.snapshot().alpha == after_rounds
    assert priors.snapshot().plain_factor is not None  # the stretches' pace did reach the pool


def test_a_streamed_calls_pace_prices_k0_for_the_pool_without_counting_rounds() -> None:
    """A streamed request's Decode is the call a stretch runs: its pace teaches the pool K = 0's
    price, so the next session (the first to run rounds after streamed ones) does not price K = 0
    at a Verify round per token and draft where a stretch is faster; it counts no round, towards a
    probe or as the draft's catch-up."""
    world = break_even_world()
    config = KControllerConfig(max_num_speculative_tokens=K_MAX)
    priors = ControllerPriors()
    streamed = AdaptiveKController(config, priors=priors)
    play(streamed, SimulatedServices(3), world, 30)  # the timings a streamed request's first calls teach
    before = streamed.estimates()
    assert priors.snapshot().plain_factor is None  # rounds alone price no stretch
    for _ in range(10):
        streamed.observe_stream_pace(0.7 * (world.verify(1) + world.rtt_target))
    after = streamed.estimates()
    assert after["plain_factor"] == pytest.approx(0.7, rel=0.05)
    assert priors.snapshot().plain_factor == pytest.approx(0.7, rel=0.05)
    for name in ("probe_interval_rounds", "num_speculative_tokens", "alpha"):
        assert after[name] == before[name], name
    # The session after it settles at K = 0 where one from a pool without the pace drafts.
    ks, _ = play_with_stretches(AdaptiveKController(config, priors=priors), SimulatedServices(3), world, 400, 0.7)
    assert sum(k == 0 for k in ks[-100:]) > 90
    unpriced, _ = play_with_stretches(AdaptiveKController(config, priors=ControllerPriors()), SimulatedServices(3),
                                      world, 400, 0.7)
    assert unpriced[0] > 0


def test_fixed_k_ignores_streamed_paces() -> None:
    from orchestrator.k_policy import FixedK

    policy = FixedK(2)
    policy.observe_stream_pace(0.01)
    assert policy.choose(8) == 2 and policy.estimates() == {}


def test_a_round_drafted_ahead_while_the_ranks_are_pending_is_planned_as_a_test() -> None:
    """The plan of a round that drafts ahead says whether it is a test (the ranks still pending,
    K = 0 priced as a Verify round) or chosen on measured figures: a request's pace with tests in
    it is no measure of its way (RequestStreaming)."""
    world = draft_hop_world()
    pending = auto_controller(PipelinePriors())
    play(pending, SimulatedServices(1), world, 200)
    assert pending.choose(K_MAX) > 0 and pending.planned_fanout > 0
    assert pending.planned_test
    sure = PipelinePriorEstimates(c_bonus=(0.97, 0.98, 0.99), c_corr=(0.97, 0.98, 0.99))
    measured_pool = auto_controller(measured(PipelinePriors(initial=sure), rank=1))
    play(measured_pool, SimulatedServices(1), world, 200)
    assert measured_pool.choose(K_MAX) > 0 and measured_pool.planned_fanout > 0
    assert not measured_pool.planned_test
