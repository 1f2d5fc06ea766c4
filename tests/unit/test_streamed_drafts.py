"""StreamedDrafts: an offer drafts K beyond where the target is expected to be when it arrives,
learnt from how far C had moved when the draft answered earlier offers and how far the target
was ahead of the orchestrator when the sent ones arrived."""

from __future__ import annotations

import pytest

from orchestrator.pipelining import RequestStreaming, StreamedDrafts, StreamPaces


def test_an_offer_drafts_k_past_the_expected_lookahead():
    streamed = StreamedDrafts(num_speculative_tokens=2)
    assert streamed.drafts_per_offer(16) == 3  # before any offer arrived: one token ahead
    for _ in range(20):
        streamed.observe_drafting(2)  # C grew by 2 while the draft drafted,
        streamed.observe_hop(1)  # and the target was 1 further when each arrived
    assert streamed.lookahead == pytest.approx(3.0, abs=0.01)
    assert streamed.drafts_per_offer(16) == 5
    assert streamed.drafts_per_offer(4) == 4  # never past the servers' limit


def test_the_lookahead_follows_a_network_that_speeds_up():
    streamed = StreamedDrafts(num_speculative_tokens=1, drafting_lag=3.0, hop_lag=1.0)
    for _ in range(20):
        streamed.observe_drafting(0)  # answered and arrived before the target moved
        streamed.observe_hop(0)
    assert streamed.drafts_per_offer(16) == 1
    streamed.observe_drafting(-2)  # a stale length never makes the lookahead negative
    streamed.observe_hop(-2)
    assert streamed.lookahead >= 0


def test_offers_not_sent_still_teach_the_drafting_lag():
    """Offers C has left by the time the draft answers are not sent (nothing arrives to measure
    the hop), yet how far C moved while they were drafted is learnt from each."""
    streamed = StreamedDrafts(num_speculative_tokens=2, hop_lag=1.0)
    for _ in range(20):
        streamed.observe_drafting(3)
    assert streamed.lookahead == pytest.approx(4.0, abs=0.01)
    assert streamed.drafts_per_offer(16) == 6


def test_offers_branch_at_the_positions_the_target_passes_before_they_arrive():
    streamed = StreamedDrafts(num_speculative_tokens=2, fanout=3, drafting_lag=0.3)
    assert streamed.branch_outcomes(streamed.drafts_per_offer(16)) == 0  # offers mostly arrive in time
    for lag, outcomes in ((1, 1), (2, 2), (4, 4)):
        for _ in range(30):
            streamed.observe_drafting(lag)
        drafts = streamed.drafts_per_offer(16)
        assert streamed.branch_outcomes(drafts) == outcomes
        assert outcomes < drafts  # each branch has the drafts after its position
    assert StreamedDrafts(2, fanout=0, drafting_lag=3.0).branch_outcomes(5) == 0  # fan-out 0: no branches
    assert StreamedDrafts(2, fanout=3, drafting_lag=6.0).branch_outcomes(3) == 2  # never past the drafts


def test_streaming_verifies_at_least_one_draft_a_pass():
    with pytest.raises(ValueError):
        StreamedDrafts(num_speculative_tokens=0)


def _calls(paces: StreamPaces, seconds: dict[bool, float], count: int) -> list[bool]:
    """count Decode calls, each measured at the pace its way has (seconds per token)."""
    offered = []
    for _ in range(count):
        offers = paces.offer_next()
        paces.observe(offers, seconds[offers])
        offered.append(offers)
    return offered


def test_offers_stop_where_they_slow_the_target_and_are_tested_seldom():
    paces = StreamPaces()
    # a draft on the target's cores: offering makes each token 2.5x slower
    offered = _calls(paces, {True: 0.100, False: 0.040}, 200)
    assert offered[:2] == [True, False]  # each way measured once, offering first
    assert sum(offered[2:]) <= 10  # then the other way only at the tests, ever rarer
    assert offered[-64:].count(True) <= 2


def test_offers_go_on_where_they_pay_and_a_change_is_followed():
    paces = StreamPaces()
    offered = _calls(paces, {True: 0.030, False: 0.036}, 100)
    assert sum(offered[2:]) >= 90  # the draft on its own machine: offering stays on
    # the draft is moved onto the target's machine: offering turns itself off
    later = _calls(paces, {True: 0.080, False: 0.036}, 200)
    assert later[-100:].count(True) <= 4


def test_a_call_whose_offers_clearly_slow_it_is_told_apart():
    paces = StreamPaces(early_end_loss=0.3)
    assert not paces.clearly_slower(1.0)  # nothing to compare with yet
    paces.observe(False, 0.040)
    assert paces.clearly_slower(0.060) and not paces.clearly_slower(0.050)


def _choices(streaming: RequestStreaming, paces: dict[bool, dict[bool, float]], requests: int) -> dict[bool, list[bool]]:
    """Whether each of `requests` greedy and sampled requests streamed, each measured at
    paces[greedy][streamed] seconds per token."""
    chosen: dict[bool, list[bool]] = {True: [], False: []}
    for _ in range(requests):
        for greedy in (True, False):
            streams = streaming.streams_next(greedy)
            streaming.observe(greedy, streams, paces[greedy][streams])
            chosen[greedy].append(streams)
    return chosen


def test_requests_stream_where_that_is_faster_greedy_and_sampled_apart():
    streaming = RequestStreaming()
    paces = {True: {True: 0.030, False: 0.036}, False: {True: 0.040, False: 0.033}}  # by greedy, by streamed
    chosen = _choices(streaming, paces, 100)
    assert chosen[True][:2] == [False, True] and chosen[False][:2] == [False, True]  # rounds measured first
    assert sum(chosen[True][2:]) >= 90  # greedy requests stream
    assert sum(chosen[False][2:]) <= 8  # sampled ones run rounds


def test_streaming_takes_over_only_when_clearly_faster():
    """Streaming measured a little faster than the rounds (within the margin, 10 %): requests run
    the controller's rounds on, as adaptive K without pipelining does; clearly faster: they
    stream."""
    close = _choices(RequestStreaming(margin=0.1), {g: {True: 0.033, False: 0.035} for g in (True, False)}, 100)
    assert all(sum(chosen[2:]) <= 8 for chosen in close.values()), close
    clear = _choices(RequestStreaming(margin=0.1), {g: {True: 0.030, False: 0.035} for g in (True, False)}, 100)
    assert all(sum(chosen[2:]) >= 90 for chosen in clear.values()), clear
    # with no margin, the lower pace wins
    even = _choices(RequestStreaming(margin=0.0), {g: {True: 0.033, False: 0.035} for g in (True, False)}, 100)
    assert all(sum(chosen[2:]) >= 90 for chosen in even.values()), even


def test_a_request_that_tests_the_slower_way_is_told_apart():
    streaming = RequestStreaming(margin=0.1)
    assert not streaming.is_test(True, False)  # nothing measured: the first request runs rounds
    assert not streaming.clearly_slower(True, False, 1.0)
    streaming.observe(True, False, 0.040)  # rounds measured
    assert streaming.is_test(True, True)  # streaming not yet measured: a test
    assert streaming.clearly_slower(True, True, 0.060) and not streaming.clearly_slower(True, True, 0.050)
    assert not streaming.is_test(False, True)  # sampled requests have measured nothing
    streaming.observe(True, True, 0.038)  # streaming measured faster, within the margin: rounds hold
    assert streaming.is_test(True, True) and not streaming.is_test(True, False)
    streaming.observe(True, True, 0.020)  # streaming now clearly faster (smoothed: 0.0326)
    assert streaming.is_test(True, False) and not streaming.is_test(True, True)
    assert streaming.clearly_slower(True, False, 0.045) and not streaming.clearly_slower(True, True, 0.035)


def test_each_network_measures_its_own_ways():
    """Paces measured on one network (the caller's bucket of its round trips) do not choose the
    way on another: there both ways are measured afresh, rounds first."""
    streaming = RequestStreaming()
    near = {g: {True: 0.030, False: 0.020} for g in (True, False)}  # rounds faster, near
    for _ in range(10):
        for greedy in (True, False):
            streams = streaming.streams_next(greedy, network=3)
            streaming.observe(greedy, streams, near[greedy][streams], network=3)
    assert not streaming.streams_next(True, network=3)
    far = [streaming.streams_next(True, network=6)]  # rounds first, measured at 0.040
    streaming.observe(True, far[-1], 0.040, network=6)
    far.append(streaming.streams_next(True, network=6))  # then streaming, measured faster
    streaming.observe(True, far[-1], 0.030, network=6)
    far.append(streaming.streams_next(True, network=6))
    assert far == [False, True, True]
    assert not streaming.streams_next(True, network=3)  # the near network keeps its own answer


def test_a_request_still_measuring_what_decides_its_rounds_runs_them():
    """Streams measured clearly faster than a first request's K = 0 stretches; a request whose
    controller is still measuring, beside its stretches, what decides whether its rounds draft
    (the pool's candidate ranks) runs the rounds all the same, and leaves the choice of the
    requests after it as it was (a stream measures none of that, and the ranks stayed unmeasured
    while streams won)."""
    def measured() -> RequestStreaming:
        streaming = RequestStreaming(margin=0.1)
        streaming.observe(True, False, 0.036, drafted=False)  # rounds at K = 0 throughout
        streaming.observe(True, True, 0.029, accepted_share=0.2)
        return streaming

    streaming, untouched = measured(), measured()
    assert not streaming.streams_next(True, measuring=True)
    assert not streaming.streams_next(True, drafts=True, measuring=True)
    choices = [streaming.streams_next(True) for _ in range(12)]
    assert choices == [untouched.streams_next(True) for _ in range(12)]
    assert choices.count(True) > choices.count(False)  # the streams: clearly faster than K = 0


def test_rounds_that_stayed_at_k0_do_not_stand_for_rounds_that_draft():
    """A fresh orchestrator's first request ran its rounds at K = 0 throughout (its first probes
    found little accepted: a stretch's pace), and a stream beat that. A later request whose
    controller would draft from its start runs the rounds again, and what it measures replaces
    the K = 0 pace: drafting, they are faster, and they are kept. Requests that would not draft
    go the way the paces say, and without the rule nothing brings the rounds back soon."""
    streaming = RequestStreaming(margin=0.1)
    streaming.observe(True, False, 0.036, drafted=False)  # rounds at K = 0 throughout
    assert streaming.streams_next(True)  # streaming, not yet measured
    streaming.observe(True, True, 0.029, accepted_share=0.2)
    assert streaming.streams_next(True, drafts=False)  # streams are clearly faster than K = 0
    assert not streaming.streams_next(True, drafts=True)  # ... not measured against drafting rounds
    streaming.observe(True, False, 0.022, drafted=True)
    assert streaming.paces[(True, 0)].seconds[False] == pytest.approx(0.022)  # replaced, not smoothed
    assert streaming.is_test(True, True) and not streaming.is_test(True, False)  # the rounds are favoured
    # rounds that stop drafting are a stretch's pace again
    streaming.observe(True, False, 0.040, drafted=False)
    assert streaming.paces[(True, 0)].seconds[False] == pytest.approx(0.040)
    assert not streaming.streams_next(True, drafts=True)

    # Without the rule (no drafted told) the K = 0 pace is smoothed in: the drafting rounds taken
    # as slower than the stream they beat.
    plain = RequestStreaming(margin=0.1)
    plain.observe(True, False, 0.036)
    plain.observe(True, True, 0.029, accepted_share=0.2)
    plain.observe(True, False, 0.022)
    assert plain.paces[(True, 0)].seconds[False] > 0.029


def test_a_stream_whose_offers_were_not_accepted_is_not_taken_as_faster():
    """The ways are measured on different requests, whose texts run at different paces. A stream
    whose offered drafts the target accepted for none of its tokens was a plain Decode: measured
    faster than the rounds, it ran on an easier text, and the rounds go on; one whose offers made
    a share of its tokens may be faster by up to that share, and streaming takes over."""
    streaming = RequestStreaming(margin=0.1)
    streaming.observe(True, False, 0.040)  # rounds
    streaming.observe(True, True, 0.025, accepted_share=0.0)
    assert streaming.paces[(True, 0)].seconds[True] == pytest.approx(0.040)
    assert streaming.is_test(True, True)  # the rounds hold
    streaming.observe(True, True, 0.025, accepted_share=0.02)  # one offered draft in 50 tokens
    assert streaming.is_test(True, True)
    credited = RequestStreaming(margin=0.1)
    credited.observe(True, False, 0.040)
    credited.observe(True, True, 0.030, accepted_share=0.25)  # within what its offers explain
    assert credited.paces[(True, 0)].seconds[True] == pytest.approx(0.030)
    assert credited.is_test(True, False)  # streaming takes over
    # The bound holds for a stretch's offered calls the same way, against its calls without offers.
    paces = StreamPaces()
    paces.observe(False, 0.040)
    paces.observe(True, 0.020, accepted_share=0.1)
    assert paces.seconds[True] == pytest.approx(0.036)
