"""StreamedDrafts: an offer drafts K beyond where the target is expected to be when it arrives,
learnt from how far the target had moved when earlier offers arrived."""

from __future__ import annotations

import pytest

from orchestrator.pipelining import StreamedDrafts


def test_an_offer_drafts_k_past_the_expected_lookahead():
    streamed = StreamedDrafts(num_speculative_tokens=2)
    assert streamed.drafts_per_offer(16) == 3  # before any offer arrived: one token ahead
    for _ in range(20):
        streamed.observe_lag(3)  # the target had committed 3 more tokens when each arrived
    assert streamed.lookahead == pytest.approx(3.0, abs=0.01)
    assert streamed.drafts_per_offer(16) == 5
    assert streamed.drafts_per_offer(4) == 4  # never past the servers' limit


def test_the_lookahead_follows_a_network_that_speeds_up():
    streamed = StreamedDrafts(num_speculative_tokens=1, lookahead=4.0)
    for _ in range(20):
        streamed.observe_lag(0)  # arrived before the target moved
    assert streamed.drafts_per_offer(16) == 1
    streamed.observe_lag(-2)  # a stale length never makes the lookahead negative
    assert streamed.lookahead >= 0


def test_streaming_verifies_at_least_one_draft_a_pass():
    with pytest.raises(ValueError):
        StreamedDrafts(num_speculative_tokens=0)
