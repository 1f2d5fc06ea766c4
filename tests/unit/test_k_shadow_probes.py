"""Probes beside a stretch (ShadowProbes): a session at K = 0 measures acceptance from the draft's
proposal against the tokens its stretch decoded, instead of a probe round that drafts and
verifies: greedy, by the drafts that match; sampled, by min(1, q~(y) / p(y)) of each decoded token
y up to the first draft it differs from. Synthetic rounds from tests/unit/test_k_controller.py's
simulator, and the sampled estimate against speculative sampling itself: no servers, no clocks."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from orchestrator.generation import sampled_acceptance_chances
from orchestrator.k_controller import (
    RANK_PROBE_INTERVAL,
    AdaptiveKController,
    KControllerConfig,
    best_k,
    seconds_per_token,
)
from orchestrator.k_estimates import AcceptanceEstimate, ControllerPriors, PriorEstimates
from orchestrator.k_policy import DecodedPasses, RoundObservation, ShadowProbes
from orchestrator.pipeline_policy import PipelineConfig, PipelinePriorEstimates, PipelinePriors
from orchestrator.pipelining import AheadObservation
from specdec.protocol import Proposal, SparseDistribution
from specdec.sampling import verify_sampled
from tests.unit.test_k_controller import K_MAX, Conditions, SimulatedServices, play
from tests.unit.test_k_plain_stretches import auto_controller, draft_hop_world, measured

CONFIG = KControllerConfig(max_num_speculative_tokens=K_MAX)
SHADOW_K = CONFIG.shadow_probe_num_speculative_tokens


def shadow_observation(k: int, matched: int, world: Conditions) -> RoundObservation:
    draft = k * world.t_draft
    return RoundObservation(k, matched, (), draft, draft + world.rtt_draft, k, 0.0, 0.0)


def play_shadow(controller: AdaptiveKController, world: Conditions, tokens: int,
                seed: int = 0, passes: bool = False, rank: int | None = None,
                fanouts: list[int] | None = None) -> tuple[list[int], int]:
    """Like play(), with every probe the controller takes for a stretch run beside it (its drafts
    matched as a Verify would accept them, at world.alpha). passes: each stretch reports its
    target passes (a session alone: one row each, at world.verify(1)). A probe that drafts ahead
    (shadow_probe_fanout, appended to fanouts) reports its outcome with the target's token at
    `rank` among the draft's candidates. Returns (K of each round, probes run beside stretches)."""
    services, rng = SimulatedServices(seed), random.Random(seed + 1000)
    ks: list[int] = []
    shadows = 0
    while len(ks) < tokens:
        rounds = min(controller.plain_rounds(shadow=True), tokens - len(ks))
        if rounds > 0:
            fanout = controller.shadow_probe_fanout
            k = controller.shadow_probe()
            for _ in range(rounds):
                services.round(0, world)
            decoded = DecodedPasses(world.verify(1), 1.0, 1.0) if passes else None
            controller.observe_plain(rounds, world.plain_pace(rounds), decoded)
            ks += [0] * rounds
            if k > 0:
                tested = min(k, rounds)
                matched = 0
                while matched < tested and rng.random() < world.alpha:
                    matched += 1
                # sent when the stretch had k tokens left: those are what it is tested against
                controller.observe_shadow(shadow_observation(k, matched, world), tested=tested, behind=tested)
                shadows += 1
                if fanouts is not None:
                    fanouts.append(fanout)
                if fanout:
                    controller.observe_ahead(AheadObservation(
                        num_speculative_tokens=k, num_accepted=matched, rank=rank, candidates=8, fanout=fanout,
                        branches=0, branch_num_speculative_tokens=1, compute_seconds=0.0,
                        after_proposal_seconds=0.0, call_hop_seconds=None))
            continue
        k = controller.choose(K_MAX)
        controller.observe(services.round(k, world))
        ks.append(k)
    return ks, shadows


def near_break_even() -> Conditions:
    """Slow hops, a stretch's hop paid once: K = 0 is best, but drafting loses under 20 % per
    token, so a session that cannot probe beside its stretches keeps exploring by drafting."""
    return Conditions(alpha=0.6, t_draft=0.003, verify_a=0.020, verify_b=0.0005, rtt_draft=0.012,
                      rtt_target=0.012, decodes=True)


def test_the_world_is_near_break_even() -> None:
    world = near_break_even()
    costs = world.costs()
    assert best_k(world.alpha, costs, K_MAX) == 0
    k0 = seconds_per_token(world.alpha, 0, costs)
    loss = min(seconds_per_token(world.alpha, k, costs) for k in range(1, K_MAX + 1)) / k0 - 1.0
    assert 0.0 < loss < CONFIG.optimism_max_loss, loss


def test_the_adaptive_controller_is_a_shadow_probes_policy() -> None:
    assert isinstance(AdaptiveKController(), ShadowProbes)


def test_a_due_probe_is_taken_for_the_stretch_instead_of_ending_it() -> None:
    controller = AdaptiveKController(CONFIG, shadow_probes=True)
    play_shadow(controller, near_break_even(), 200)
    assert controller.estimates()["num_speculative_tokens"] == 0
    interval = int(controller.estimates()["probe_interval_rounds"])
    stretch = controller.plain_rounds(shadow=True)
    controller.observe_plain(stretch, near_break_even().plain_pace(stretch))
    # Due now: a caller without a shadow probe would run a probe round ...
    assert controller.plain_rounds() == 0
    # ... one that can gets a whole stretch, to the probe after, and the probe's K.
    assert controller.plain_rounds(shadow=True) == interval
    assert controller.shadow_probe() == SHADOW_K
    assert controller.shadow_probe() == 0  # taken once


def test_shadow_probes_replace_the_drafted_rounds_of_exploration() -> None:
    """Near the break-even point a session that probes in rounds drafts now and then (the optimism
    about K = 0, and the probes); one that probes beside its stretches hardly ever drafts."""
    world = near_break_even()
    drafted_in_rounds = sum(k > 0 for seed in range(3)
                            for k in play(AdaptiveKController(CONFIG), SimulatedServices(seed), world, 400))
    drafted_in_shadow = probes = 0
    for seed in range(3):
        ks, shadows = play_shadow(AdaptiveKController(CONFIG, shadow_probes=True), world, 400, seed)
        drafted_in_shadow += sum(k > 0 for k in ks)
        probes += shadows
    assert probes >= 3  # acceptance was still measured at K = 0
    assert drafted_in_shadow * 3 <= drafted_in_rounds, (drafted_in_shadow, drafted_in_rounds)


def test_shadow_probes_bring_drafting_back_when_it_pays() -> None:
    """A session at K = 0 after poorly accepted drafts whose later text the draft matches: the
    shadow probes see it, and it drafts again."""
    world = Conditions(alpha=0.2, decodes=True)
    controller = AdaptiveKController(CONFIG, shadow_probes=True)
    play_shadow(controller, world, 300)
    assert controller.estimates()["num_speculative_tokens"] == 0
    ks, shadows = play_shadow(controller, Conditions(alpha=0.9, decodes=True), 600)
    assert shadows >= 1 and ks[-20:].count(0) <= 2, ks[-40:]


def test_a_shadow_probe_that_leaves_k0_backs_the_interval_off() -> None:
    world = near_break_even()
    controller = AdaptiveKController(CONFIG, shadow_probes=True)
    play_shadow(controller, world, 100)
    before = controller.estimates()["probe_interval_rounds"]
    controller.observe_shadow(shadow_observation(SHADOW_K, 0, world), tested=SHADOW_K, behind=8)
    assert controller.estimates()["probe_interval_rounds"] == min(
        CONFIG.probe_interval_max_rounds, before * CONFIG.probe_backoff)


def test_shadow_probes_on_hardware_of_their_own_keep_the_base_interval() -> None:
    """Where the draft does not compute on the target's hardware a probe beside a stretch costs the
    stretch nothing: the probes keep the base interval, so alpha is sampled along the whole
    answer (backed off, a 200-token session at K = 0 probes a handful of times, most of them early)."""
    world = near_break_even()
    free = AdaptiveKController(CONFIG, shadow_probes=True, shadow_probes_contend=False)
    ks, free_probes = play_shadow(free, world, 200)
    assert ks.count(0) >= 190  # the session stayed at K = 0 ...
    assert free.estimates()["probe_interval_rounds"] == CONFIG.probe_interval_rounds  # ... and kept probing
    assert free_probes >= 200 // CONFIG.probe_interval_rounds - 1
    _, contended_probes = play_shadow(AdaptiveKController(CONFIG, shadow_probes=True), world, 200)
    assert contended_probes < free_probes / 2, (contended_probes, free_probes)


def probed_stretches(controller: AdaptiveKController, world: Conditions, stretches: int) -> list[int]:
    """The lengths of the next stretches that carry a probe beside them (the probe runs at the
    stretch's end), each probe observed as matching nothing."""
    lengths: list[int] = []
    while len(lengths) < stretches:
        rounds = controller.plain_rounds(shadow=True)
        assert rounds > 0
        k = controller.shadow_probe()
        controller.observe_plain(rounds, world.plain_pace(rounds))
        if k > 0:
            lengths.append(rounds)
            controller.observe_shadow(shadow_observation(k, 0, world), tested=k, behind=k)
    return lengths


def test_with_a_probe_rng_the_probes_fall_at_drawn_positions() -> None:
    """At fixed intervals every answer is probed at the same positions, and a pool that counts
    only those learns their acceptance, not the answers'; drawn within the jitter around the
    interval they fall anywhere."""
    world = near_break_even()
    interval = CONFIG.probe_interval_rounds
    fixed = AdaptiveKController(CONFIG, shadow_probes=True, shadow_probes_contend=False)
    play_shadow(fixed, world, 200)
    assert set(probed_stretches(fixed, world, 20)) == {interval}
    drawn = AdaptiveKController(CONFIG, shadow_probes=True, shadow_probes_contend=False,
                                probe_rng=random.Random(0))
    play_shadow(drawn, world, 200)
    lengths = probed_stretches(drawn, world, 200)
    spread = int(interval * CONFIG.shadow_probe_jitter)
    assert min(lengths) >= interval - spread and max(lengths) <= interval + spread
    assert len(set(lengths)) >= spread  # not a few positions
    assert abs(sum(lengths) / len(lengths) - interval) < 1.5  # the interval on average
    # A short interval (the candidate ranks' probes run every 8 tokens) is never drawn shorter
    # than the probe's drafts and the token after them: a shorter stretch would test fewer.
    short = replace(CONFIG, probe_interval_rounds=6)
    drawn = AdaptiveKController(short, shadow_probes=True, shadow_probes_contend=False,
                                probe_rng=random.Random(1))
    play_shadow(drawn, world, 200)
    lengths = probed_stretches(drawn, world, 100)
    assert min(lengths) == SHADOW_K + 1 and max(lengths) == 6 + 3, sorted(set(lengths))


def test_a_contended_shadow_probe_does_not_raise_the_drafts_timings() -> None:
    """A probe beside a stretch ran while the target decoded, on the target's cores where the two
    share them: its Propose (here ten times a round's) bounds a round's from above only; taken as
    a round's it held this session, and through the pool the sessions after it, at K = 0. (A
    faster one does lower them: the cold start below.)"""
    world = near_break_even()
    priors = ControllerPriors()
    controller = AdaptiveKController(CONFIG, priors=priors, shadow_probes=True)
    play(controller, SimulatedServices(0), world, 60)  # rounds measure the draft's timings
    timings = {name: controller.estimates()[name] for name in ("t_draft_per_token", "rtt_draft")}
    pooled = priors.snapshot()
    contended = replace(world, t_draft=10 * world.t_draft, rtt_draft=10 * world.rtt_draft)
    alpha = controller.estimates()["alpha"]
    for _ in range(5):
        controller.observe_shadow(shadow_observation(SHADOW_K, 0, contended), tested=SHADOW_K, behind=SHADOW_K)
    assert {name: controller.estimates()[name] for name in timings} == timings
    # the pool only blends in the session's unchanged figures again
    assert priors.snapshot().t_draft_per_token == pytest.approx(pooled.t_draft_per_token, rel=0.01)
    assert priors.snapshot().rtt_draft == pytest.approx(pooled.rtt_draft, rel=0.01)
    assert controller.estimates()["alpha"] < alpha  # the rejections did count


def test_drafts_the_stretch_had_no_tokens_for_are_not_rejections() -> None:
    """A stretch that ended after two tokens tested two drafts: both matched is no rejection."""
    world = near_break_even()
    cut, rejected = (AdaptiveKController(CONFIG, shadow_probes=True) for _ in range(2))
    cut.observe_shadow(shadow_observation(SHADOW_K, 2, world), tested=2, behind=2)
    rejected.observe_shadow(shadow_observation(SHADOW_K, 2, world), tested=SHADOW_K, behind=4)
    assert cut.estimates()["alpha"] > rejected.estimates()["alpha"]


def test_without_shadow_probes_nothing_is_taken() -> None:
    controller = AdaptiveKController(CONFIG)  # e.g. a lookup draft's session: its probes are rounds
    play(controller, SimulatedServices(0), near_break_even(), 200)
    for _ in range(3):
        controller.plain_rounds(shadow=True)
        assert controller.shadow_probe() == 0


# -- sampled: min(1, q~(y) / p(y)) ------------------------------------------------------------------


def _sparse(probs: dict[int, float]) -> SparseDistribution:
    return SparseDistribution(tuple(probs), tuple(probs.values()))


def test_a_sampled_probe_weighs_each_token_up_to_the_first_draft_it_differs_from() -> None:
    proposal = Proposal(token_ids=(3, 5, 7, 1), distributions=(
        _sparse({3: 0.5, 4: 0.5}), _sparse({5: 0.2, 6: 0.6, 2: 0.2}), _sparse({7: 1.0}), _sparse({1: 1.0})))
    # y1 = 3 matches its draft; y2 = 6 does not (its q~ still holds: same prefix), y3 follows
    # another prefix than the draft's third token did, so it is not tested.
    chances = sampled_acceptance_chances(proposal, [3, 6, 7, 1], [0.25, 0.9, 0.5, 0.5])
    assert chances == pytest.approx((1.0, 0.6 / 0.9))
    # y1 differs from d1 at once: only position 1 is tested, whatever follows
    assert sampled_acceptance_chances(proposal, [4, 5], [0.8, 0.5]) == pytest.approx((0.5 / 0.8,))
    # a token the draft gave no mass: never accepted there
    assert sampled_acceptance_chances(proposal, [9], [0.5]) == (0.0,)
    # q~ as sent is read as the target reads it: divided by its sum
    unnormalised = Proposal(token_ids=(3,), distributions=(_sparse({3: 2.0, 4: 6.0}),))
    assert sampled_acceptance_chances(unnormalised, [4], [1.0]) == pytest.approx((0.75,))
    # without the target's p(y) nothing is measured from there on
    assert sampled_acceptance_chances(proposal, [3, 5], [None, 0.5]) == ()
    assert sampled_acceptance_chances(proposal, [3, 5], [0.5, None]) == pytest.approx((1.0,))
    assert sampled_acceptance_chances(Proposal(token_ids=(3,)), [3], [0.5]) == ()  # greedy: no q~


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_sampled_estimate_averages_to_what_speculative_sampling_accepts(seed) -> None:
    """Over y ~ p, min(1, q~(y) / p(y)) averages to sum(min(p, q~)), and speculative sampling
    (specdec.sampling.verify_sampled) accepts a draft d ~ q~ as often: the probe measures the
    acceptance a Verify would see, for peaked, flat and disjoint-ish pairs."""
    generator = torch.Generator().manual_seed(seed)
    vocab, trials = 12, 20000
    for sharpness in (0.5, 2.0, 6.0):
        p = torch.softmax(sharpness * torch.randn(vocab, generator=generator, dtype=torch.float64), -1)
        q = torch.softmax(sharpness * torch.randn(vocab, generator=generator, dtype=torch.float64), -1)
        exact = float(torch.minimum(p, q).sum())
        ys = torch.multinomial(p, trials, replacement=True, generator=generator)
        distribution = _sparse({i: float(q[i]) for i in range(vocab)})
        estimate = sum(sampled_acceptance_chances(Proposal((vocab,), (distribution,)), [int(y)], [float(p[y])])[0]
                       for y in ys.tolist()) / trials
        drafts = torch.multinomial(q, trials, replacement=True, generator=generator)
        accepted, _, _ = verify_sampled(
            p.expand(trials, 2, vocab), drafts.unsqueeze(-1), q.expand(trials, 1, vocab),
            torch.rand(trials, 1, generator=generator, dtype=torch.float64),
            torch.rand(trials, generator=generator, dtype=torch.float64))
        acceptance = float(accepted.double().mean())
        # 20000 draws: the standard error is under 0.0036 for either; 4 of them
        assert estimate == pytest.approx(exact, abs=0.015), (sharpness, estimate, exact)
        assert acceptance == pytest.approx(exact, abs=0.015), (sharpness, acceptance, exact)


def test_expected_acceptances_count_as_outcomes_do() -> None:
    """Chances of 1 and 0 are the outcomes: the same alpha as the accepted/rejected counts; a
    chance in between adds its share to each."""
    counted, expected = (AcceptanceEstimate(0.6, 4.0, 1.0) for _ in range(2))
    counted.update(4, 2, 0)  # two accepted, the third rejected
    expected.update_expected((1.0, 1.0, 0.0), 0)
    assert expected.alpha == pytest.approx(counted.alpha)
    shared = AcceptanceEstimate(0.6, 4.0, 1.0)
    shared.update_expected((0.2, 0.1), 0)
    assert shared.alpha == pytest.approx((0.6 * 4 + 0.3) / (4 + 2))


def test_a_sampled_shadow_probe_moves_alpha_by_its_chances_not_its_matches() -> None:
    """Sampled, a draft rarely equals the token the target drew even where it is often accepted:
    the controller takes the chances the observation carries, not its match count."""
    world = near_break_even()
    low, high = (AdaptiveKController(CONFIG, shadow_probes=True) for _ in range(2))
    base = shadow_observation(SHADOW_K, 0, world)
    low.observe_shadow(RoundObservation(SHADOW_K, 0, (0.05,), *_timings(base)), tested=1, behind=4)
    high.observe_shadow(RoundObservation(SHADOW_K, 0, (0.95,), *_timings(base)), tested=1, behind=4)
    assert low.estimates()["alpha"] < CONFIG.prior_alpha < high.estimates()["alpha"]


def _timings(observation: RoundObservation) -> tuple:
    return (observation.draft_compute_seconds, observation.draft_wall_seconds, observation.draft_fed_tokens,
            observation.verify_compute_seconds, observation.verify_wall_seconds)


# -- under pipelining auto ------------------------------------------------------------------------


def test_under_pipelining_auto_probes_run_beside_stretches_once_the_ranks_are_measured() -> None:
    """Until the pool has measured the draft's candidate ranks, drafting ahead is tried at the
    ranks hoped for (no stretch, no probe beside one); after, a probe runs beside the stretch like
    any other."""
    world = draft_hop_world()
    priors = PipelinePriors()
    controller = auto_controller(priors, shadow_probes=True)
    play(controller, SimulatedServices(1), world, 200)
    assert controller.plain_rounds(shadow=True) == 0 and controller.shadow_probe() == 0  # drafting ahead
    measured(priors)
    stretch = controller.plain_rounds()
    assert stretch > 0
    controller.observe_plain(stretch, world.plain_pace(stretch))
    assert controller.plain_rounds() == 0  # due: a caller without shadow probes runs a round
    assert controller.plain_rounds(shadow=True) > 0
    assert controller.shadow_probe() == SHADOW_K


def test_under_pipelining_auto_greedy_probes_beside_stretches_measure_the_ranks() -> None:
    """Where its probes beside stretches can measure the draft's candidate ranks (greedy), a fresh
    pool's ranks are measured there, not by drafted-ahead rounds in place of stretches (a session
    without such probes, in the same world, tests drafting ahead in rounds at once): K = 0
    stretches at its pace and every probe, each RANK_PROBE_INTERVAL rounds, drafts ahead at
    fan-out 1. Once the pool has its outcomes the probes go on measuring ranks, spaced as any
    probe is (backed off while K stays 0)."""
    world = draft_hop_world()
    needed = PipelineConfig().measured_outcomes
    testing = auto_controller(PipelinePriors(), shadow_probes=True)
    play(testing, SimulatedServices(1), world, 40)
    assert testing.plain_rounds(shadow=True) == 0 and testing.choose(K_MAX) > 0 and testing.planned_test

    priors = PipelinePriors()
    controller = auto_controller(priors, shadow_probes=True, ranks_beside=True)
    fanouts: list[int] = []
    ks, _ = play_shadow(controller, world, 4 + needed * RANK_PROBE_INTERVAL, rank=1, fanouts=fanouts)
    opening = next(i for i, k in enumerate(ks) if k == 0)  # the rounds before the costs are known
    assert all(k == 0 for k in ks[opening:]), ks
    assert fanouts == [1] * needed and priors.outcomes == needed
    assert controller.estimates()["probe_interval_rounds"] <= RANK_PROBE_INTERVAL * 2

    play_shadow(controller, world, 300, rank=1, fanouts=fanouts)
    assert len(fanouts) > needed and set(fanouts) == {1} and priors.outcomes == len(fanouts)
    assert controller.estimates()["probe_interval_rounds"] > 2 * RANK_PROBE_INTERVAL


def test_a_session_measuring_the_ranks_beside_its_stretches_would_not_draft() -> None:
    """would_draft (what pipelining auto's way choice asks as a request starts) says what the
    session's next choice is: a session that tests drafting ahead in rounds would draft; one that
    measures the ranks beside its stretches first would not, though at hopeful ranks drafting
    ahead would pay (told it would, the way choice ran rounds that then stretched K = 0). The way
    choice also asks measures_beside: while it does, a stream would measure nothing of what
    decides whether the rounds draft; once the pool has its outcomes, it does not."""
    world = draft_hop_world()
    testing = auto_controller(PipelinePriors(), shadow_probes=True)
    play(testing, SimulatedServices(1), world, 40)
    assert testing.would_draft() and not testing.measures_beside()
    assert testing.plain_rounds(shadow=True) == 0

    priors = PipelinePriors()
    measuring = auto_controller(priors, shadow_probes=True, ranks_beside=True)
    assert measuring.measures_beside()  # a fresh pool: from the session's start
    play_shadow(measuring, world, 20, rank=1)  # a few outcomes, every one a hit so far
    assert measuring.estimates()["num_speculative_tokens"] == 0
    assert not measuring.would_draft() and measuring.measures_beside()
    assert measuring.plain_rounds(shadow=True) > 0

    play_shadow(measuring, world, PipelineConfig().measured_outcomes * RANK_PROBE_INTERVAL * 2, rank=1)
    assert priors.outcomes >= PipelineConfig().measured_outcomes
    assert not measuring.measures_beside()
    assert not auto_controller(priors, shadow_probes=True, ranks_beside=True).measures_beside()


def test_a_fit_left_by_cold_passes_is_corrected_by_the_stretches_passes() -> None:
    """A session whose first rounds ran on a cold device (every pass and draft step 10x its later
    cost, and nothing accepted) settles at K = 0; its probes then run beside its stretches and
    time no verify pass. Told its stretches' passes, its verify fit comes back to the device's
    real cost and it drafts again where drafting pays; not told, it prices drafting at the cold
    passes for good and stays at K = 0."""
    world = Conditions(decodes=True, alpha=0.7, verify_a=0.03, verify_b=0.0005, t_draft=0.004,
                       rtt_draft=0.002, rtt_target=0.002)
    assert best_k(world.alpha, world.costs(), K_MAX) >= 3

    def after_a_cold_start(passes: bool) -> tuple[list[int], AdaptiveKController]:
        controller = AdaptiveKController(CONFIG, shadow_probes=True)
        while (k := controller.choose(K_MAX)) > 0:
            verify, draft = 10.0 * world.verify(k + 1), 10.0 * k * world.t_draft
            controller.observe(RoundObservation(k, 0, (0.0,) * k, draft, draft + world.rtt_draft, k,
                                                verify, verify + world.rtt_target))
        assert controller.plain_rounds(shadow=True) > 0
        ks, _ = play_shadow(controller, world, 3000, passes=passes)
        return ks, controller

    stuck, frozen = after_a_cold_start(passes=False)
    assert all(k == 0 for k in stuck[-1000:])
    assert frozen.estimates()["verify_a"] > 5 * world.verify_a
    drafting, corrected = after_a_cold_start(passes=True)
    assert sum(k > 0 for k in drafting[-1000:]) > 900
    assert corrected.estimates()["verify_a"] < 2 * world.verify(1)


def test_the_first_stretch_after_drafting_stops_carries_a_probe() -> None:
    """Drafting stops on a few rounds' evidence (the start of an answer the draft guesses badly):
    the first stretch at K = 0 is already tested beside it, not only the one after a whole
    interval; a session that probes in rounds waits the interval for its probe round."""
    for shadows in (True, False):
        controller = AdaptiveKController(CONFIG, shadow_probes=shadows)
        services, rounds = SimulatedServices(0), 0
        while controller.plain_rounds(shadow=shadows) == 0:
            controller.observe(services.round(controller.choose(K_MAX), Conditions(alpha=0.02, decodes=True)))
            rounds += 1
            assert rounds < 100, "drafting never stopped"
        assert controller.shadow_probe() == (SHADOW_K if shadows else 0)


def _auto_session_expecting_hits() -> AdaptiveKController:
    """A session under pipelining auto in a pool whose figures say drafting ahead pays at K = 0
    already (a 20 ms draft hop, the draft's top candidates nearly always holding the target's
    token at a fan-out of 3, the pool's alpha 0.62): plain drafting does not pay, drafting ahead
    does."""
    likely = PipelinePriorEstimates(c_bonus=(0.6, 0.85, 0.97), c_corr=(0.5, 0.8, 0.95))
    world = draft_hop_world()
    seed = PriorEstimates(alpha=0.62, t_draft_per_token=world.t_draft, rtt_draft=world.rtt_draft,
                          rtt_target=world.rtt_target, verify_a=world.verify_a, verify_b=world.verify_b,
                          plain_factor=0.75)
    controller = AdaptiveKController(CONFIG, priors=ControllerPriors(initial=seed), shadow_probes=True)
    controller.pipeline(max_fanout=3, priors=measured(PipelinePriors(initial=likely), rank=2))
    assert controller.estimates()["num_speculative_tokens"] == 0  # plain K
    return controller


def test_a_session_that_expects_hits_opens_drafting_ahead_not_with_a_probe() -> None:
    """Under pipelining auto, a session whose plain K is 0 but whose drafting ahead pays by the
    pool's figures starts with the drafted-ahead round that pays (its own round measures alpha
    and the ranks), not with a probe at fan-out 1."""
    controller = _auto_session_expecting_hits()
    assert controller.plain_rounds(shadow=True) == 0
    assert controller.choose(K_MAX) > 0 and controller.planned_fanout > 1  # a probe's is 1


def test_the_first_stretch_after_drafting_ahead_stops_carries_a_probe() -> None:
    """Drafting ahead runs at a plain K of 0: when its rounds' rejections stop it, the first
    stretch is tested beside it as after plain drafting stops, not only after a whole interval."""
    controller = _auto_session_expecting_hits()
    services, rounds = SimulatedServices(0), 0
    while controller.plain_rounds(shadow=True) == 0:
        k = controller.choose(K_MAX)
        assert k > 0
        observation = services.round(k, draft_hop_world())
        controller.observe(replace(observation, num_accepted=0, acceptance_signal=(0.0,) * k))
        rounds += 1
        assert rounds < 50, "drafting ahead never stopped"
    assert controller.shadow_probe() == SHADOW_K
