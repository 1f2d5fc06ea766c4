"""The choice between a pass's offered drafts and its draft head's (specdec/chain_acceptance.py)."""

from __future__ import annotations

import pytest

from specdec.chain_acceptance import OFFER_TRIALS, PRIOR_ALPHA, ChainAcceptance, OfferOrHead


def test_the_rate_is_accepted_drafts_over_those_and_the_chains_cut_short():
    chain = ChainAcceptance()
    assert chain.alpha == PRIOR_ALPHA
    for _ in range(200):  # chains of 3: all accepted once, then the first rejected, then 1 of 3
        chain.observe(3, 3)
        chain.observe(3, 0)
        chain.observe(3, 1)
    assert (chain.accepted, chain.cut, chain.chains) == (800, 400, 600)
    assert chain.alpha == pytest.approx(800 / 1200, abs=0.002)
    chain.observe(0, 0)  # a pass that verified none of its drafts tells nothing
    assert (chain.accepted, chain.cut) == (800, 400)
    with pytest.raises(ValueError):
        chain.observe(2, 3)


def test_a_chain_is_worth_its_rate_summed_over_powers():
    chain = ChainAcceptance(accepted=996, cut=4)  # alpha = 0.994...
    assert chain.worth(0) == 0.0
    assert chain.worth(3) == pytest.approx(sum(chain.alpha ** i for i in (1, 2, 3)))
    assert ChainAcceptance().worth(2) == pytest.approx(0.5 + 0.25)


def test_offers_are_tried_first_then_the_chain_worth_more_is_verified():
    sources = OfferOrHead.new()
    for _ in range(OFFER_TRIALS):  # the offers' first trials, however long the head's chain
        assert not sources.prefers_head(offered_drafts=1, head_drafts=4)
        sources.offered.observe(1, 1)
    assert sources.prefers_head(offered_drafts=1, head_drafts=4)
    sources = OfferOrHead.new()
    sources.offered = ChainAcceptance(accepted=OFFER_TRIALS, cut=OFFER_TRIALS, chains=2 * OFFER_TRIALS)
    assert not sources.prefers_head(offered_drafts=2, head_drafts=2)  # a tie
    assert sources.prefers_head(offered_drafts=1, head_drafts=2)
    for _ in range(6):
        sources.offered.observe(2, 0)  # offers always wrong
    assert sources.prefers_head(offered_drafts=4, head_drafts=1)
    sources = OfferOrHead.new()
    for _ in range(20):
        sources.offered.observe(2, 2)  # offers always right, the head half the time
        sources.head.observe(2, 1)
    assert not sources.prefers_head(offered_drafts=1, head_drafts=4)
