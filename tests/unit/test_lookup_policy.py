"""How the adaptive controller weighs a lookup's proposal (orchestrator/lookup_policy.py,
specdec/lookup_acceptance.py): by the
match each token rests on, against verify rows and, in hybrid, against the model draft's round.
Synthetic rounds, seeded: no servers, no clocks."""

from __future__ import annotations

import random

import pytest

from orchestrator.k_controller import AdaptiveKController, KControllerConfig, RoundCosts
from orchestrator.k_policy import FixedK, HeuristicK, LookupChooser, RoundObservation
from orchestrator.lookup_policy import best_lookup_k, lookup_costs
from specdec.lookup_acceptance import (
    MATCH_BUCKETS,
    LookupAcceptance,
    LookupConfidenceConfig,
    LookupPriors,
    bucket_name,
    match_bucket,
)

# A target whose rows are dear: 50 ms a pass plus 20 ms a row, 1 ms of hop.
VERIFY_A, VERIFY_B, RTT_TARGET = 0.050, 0.020, 0.001


def verify(rows: int) -> float:
    return VERIFY_A + VERIFY_B * rows


def true_alpha(match_length: int) -> float:
    """Tokens after short matches are rarely right, after long ones nearly always."""
    return 0.05 if match_length <= 2 else 0.5 if match_length <= 4 else 0.95


def lookup_round(rng: random.Random, match_lengths: tuple[int, ...]) -> RoundObservation:
    accepted = 0
    while accepted < len(match_lengths) and rng.random() < true_alpha(match_lengths[accepted]):
        accepted += 1
    k = len(match_lengths)
    seconds = verify(k + 1)
    signal = tuple(1.0 if i < accepted else 0.0 for i in range(k))
    return RoundObservation(k, accepted, signal, 1e-5, 1e-5, 0, seconds, seconds + RTT_TARGET,
                            lookup_match_lengths=match_lengths)


def model_round(rng: random.Random, k: int, alpha: float, t_draft: float, rtt_draft: float) -> RoundObservation:
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    seconds = verify(k + 1)
    draft = k * t_draft
    signal = tuple(1.0 if i < accepted else 0.0 for i in range(k))
    return RoundObservation(k, accepted, signal, draft, draft + rtt_draft, k, seconds, seconds + RTT_TARGET)


def trained(rounds: int = 300, seed: int = 0, taken: dict[int, list[int]] | None = None) -> AdaptiveKController:
    """A controller that has seen lookup rounds with short, middling and long matches; taken, if
    given, gets for each first match length the tokens verified of each proposal."""
    rng = random.Random(seed)
    controller = AdaptiveKController(KControllerConfig())
    for _ in range(rounds):
        start = rng.choice((0, 1, 2, 3, 4, 6, 8))  # 0: the lookup found nothing (a K = 0 round)
        proposed = tuple(range(start, start + rng.randint(1, 6))) if start else ()
        chosen = controller.choose_lookup(proposed, None)
        if taken is not None:
            taken.setdefault(start, []).append(chosen)
        controller.observe(lookup_round(rng, proposed[:chosen]) if chosen else
                           RoundObservation(0, 0, (), 0.0, 0.0, 0, verify(1), verify(1) + RTT_TARGET))
    return controller


# ------------------------------------------------------------------------------------ pure parts


def test_match_buckets_cover_every_length_once():
    assert [match_bucket(n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16, 500)] == \
        [0, 0, 1, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    assert [bucket_name(b) for b in range(len(MATCH_BUCKETS))] == \
        ["1", "2", "3", "4-5", "6-7", "8-11", "12-15", "16+"]


def test_a_lookup_costs_no_draft_time_hop_or_catch_up():
    costs = lookup_costs(RoundCosts(0.007, verify, 0.010, RTT_TARGET, catchup_seconds=0.02))
    assert (costs.t_draft, costs.rtt_draft, costs.catchup_seconds) == (0.0, 0.0, 0.0)
    assert costs.verify_fn is verify and costs.rtt_target == RTT_TARGET


def test_best_lookup_k_stops_where_the_next_row_costs_more_than_it_is_expected_to_earn():
    costs = RoundCosts(0.0, verify, 0.0, RTT_TARGET)
    assert best_lookup_k([0.99] * 6, costs)[0] == 6  # all nearly certain: all of them
    assert best_lookup_k([0.02] * 6, costs)[0] == 0  # all nearly hopeless: none
    # sure tokens then a doubtful one: a row costs ~28 % of a pass, a doubtful token earns less
    assert best_lookup_k([0.95, 0.95, 0.05, 0.95], costs)[0] == 2
    k, seconds = best_lookup_k([0.9, 0.9], costs)
    assert k == 2 and seconds < (VERIFY_A + VERIFY_B + RTT_TARGET)


def test_acceptance_counts_accepted_tokens_and_the_first_rejection_only():
    acceptance = LookupAcceptance(LookupConfidenceConfig(decay=1.0))
    acceptance.update((8, 9, 2, 1), num_accepted=2)
    figures = acceptance.estimates()
    # 8 and 9: two successes in "8-11"; 2: one failure in "2"; 1 (after the rejection): untested
    assert set(figures) == {"lookup_alpha_match_8-11", "lookup_alpha_match_2"}
    # each bucket's prior: the session's acceptance of all its lookup tokens (2 of 3, pulled
    # towards 0.5 by 4 pseudo-trials), there being no pool figure
    overall = (2 + 0.5 * 4) / (3 + 4)
    assert figures["lookup_alpha_match_8-11"] == pytest.approx((2 + overall * 4) / (2 + 4))
    assert figures["lookup_alpha_match_2"] == pytest.approx((0 + overall * 4) / (1 + 4))
    assert acceptance.alphas((3,)) == [pytest.approx(overall)]  # an untested bucket


def test_a_new_session_starts_from_the_pools_bucket_alphas():
    priors = LookupPriors(weight=1.0)
    first = LookupAcceptance(priors=priors)
    for _ in range(30):
        first.update((12, 13, 14), num_accepted=3)
    second = LookupAcceptance(priors=priors)
    fresh = LookupAcceptance()
    assert second.alphas((12,))[0] > fresh.alphas((12,))[0] + 0.2
    assert second.alphas((1,)) == fresh.alphas((1,))  # a bucket the pool never saw: the default


# ------------------------------------------------------------------------------------ the controller


def test_only_the_adaptive_controller_chooses_after_the_lookup():
    assert isinstance(AdaptiveKController(), LookupChooser)
    assert not isinstance(FixedK(2), LookupChooser) and not isinstance(HeuristicK(), LookupChooser)


def test_before_any_verify_the_whole_lookup_is_tried():
    assert AdaptiveKController().choose_lookup((1, 2, 3), None) == 3
    assert AdaptiveKController().choose_lookup((), None) == 0


def test_long_matches_are_verified_and_short_ones_dropped():
    taken: dict[int, list[int]] = {}
    controller = trained(taken=taken)
    assert controller.choose_lookup((8, 9, 10, 11), None) == 4
    # After the first rounds, proposals after a 1-token match are dropped (testing stops once the
    # estimate falls below what a row costs, ~28 % of a pass here); those after an 8-token match
    # are all verified.
    late = {start: counts[len(counts) // 3:] for start, counts in taken.items()}
    assert sum(1 for count in late[1] if count) <= 0.25 * len(late[1])
    assert all(count > 0 for count in late[8])
    # a strong start and a weak tail: the strong part only (a weak tail can come from a lookup
    # whose match falls back to a shorter context)
    assert controller.choose_lookup((8, 9, 1, 1), None) == 2
    figures = controller.estimates()
    assert figures["lookup_alpha_match_8-11"] > 0.85 and figures["lookup_alpha_match_1"] < 0.3


def test_lookup_rounds_leave_the_model_drafts_estimates_alone():
    rng = random.Random(1)
    controller = AdaptiveKController(KControllerConfig())
    for _ in range(40):
        controller.observe(model_round(rng, controller.choose(8), alpha=0.4, t_draft=0.007, rtt_draft=0.002))
    before = {key: value for key, value in controller.estimates().items()
              if key in ("alpha", "t_draft_per_token", "rtt_draft")}
    for _ in range(40):
        controller.observe(lookup_round(rng, (8, 9, 10, 11)))
    after = controller.estimates()
    assert {key: after[key] for key in before} == before
    assert after["lookup_alpha_match_8-11"] > 0.8


def test_hybrid_takes_a_strong_lookup_over_a_poor_model_and_a_good_model_over_a_weak_lookup():
    rng = random.Random(2)
    poor_model = trained(seed=3)
    for _ in range(60):  # the model draft: accepted 30 %, 7 ms a token
        k = poor_model.choose(8)
        poor_model.observe(model_round(rng, k, alpha=0.3, t_draft=0.007, rtt_draft=0.002))
    k = poor_model.choose(8)
    assert poor_model.choose_lookup((8, 9, 10), k) == 3
    good_model = trained(seed=4)
    for _ in range(60):  # accepted 90 %, 1 ms a token
        k = good_model.choose(8)
        good_model.observe(model_round(rng, k, alpha=0.9, t_draft=0.001, rtt_draft=0.0005))
    k = good_model.choose(8)
    assert k >= 3
    assert good_model.choose_lookup((3, 4), k) == 0  # a middling match: the model's round instead
    assert good_model.choose_lookup((8, 9, 10, 11), k) == 4  # near-certain, and no draft cost


def test_a_model_probe_waits_while_lookups_win():
    """While K = 0 the model is probed on a schedule of K = 0 rounds; lookup rounds are not
    K = 0 rounds of the model, so they neither count towards a probe nor end one."""
    rng = random.Random(5)
    controller = AdaptiveKController(KControllerConfig(probe_interval_rounds=4))
    for _ in range(60):  # the model draft is useless: K falls to 0
        controller.observe(model_round(rng, controller.choose(8), alpha=0.02, t_draft=0.007, rtt_draft=0.002))
    assert controller.estimates()["num_speculative_tokens"] == 0
    interval = controller.estimates()["probe_interval_rounds"]
    for _ in range(50):
        controller.observe(lookup_round(rng, (8, 9)))
    assert controller.estimates()["probe_interval_rounds"] == interval
