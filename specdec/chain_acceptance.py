"""Which of two proposals a target pass verifies: a session's offered drafts (the draft's, streamed
in with a lag) or its draft head's (made in the target at the pass itself).

A pass verifies one chain of drafts and keeps its drafts up to the first rejection. Drafts from
one source are taken to be accepted each with a chance alpha given the ones before it, so a chain
of n is worth alpha + alpha^2 + ... + alpha^n accepted tokens; the pass verifies the chain worth
more (the offered one on a tie, and until the session's offers have a record). alpha is learnt from the chains each source had verified: its accepted drafts over those
plus the chains cut short by a rejection (the maximum-likelihood rate of a chain that stops at
its first rejection), from an even prior. Which chain a pass verifies depends only on what
earlier passes did and on the drafts themselves, never on what this pass draws, so either way
the pass is a Verify round of its own (lossless).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PRIOR_ALPHA = 0.5
PRIOR_DRAFTS = 4.0  # the prior's weight, in verified drafts
# Passes with both sources verify the offered chain until this many of them were verified: a
# session's offers get a record of their own before the head's can rule them out.
OFFER_TRIALS = 4


def expected_committed_tokens(alpha: float | Sequence[float], num_speculative_tokens: int) -> float:
    """E(K): expected tokens committed by a round of K drafts.

    `alpha` is one acceptance probability, or per-position ones (alpha[i] for draft i + 1; the
    last one repeats for later positions).
    """
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    if isinstance(alpha, (int, float)):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if alpha == 1.0:
            return float(num_speculative_tokens + 1)
        return (1.0 - alpha ** (num_speculative_tokens + 1)) / (1.0 - alpha)
    if not alpha:
        raise ValueError("per-position alpha must not be empty")
    total, reach = 1.0, 1.0  # reach: probability that drafts 1..i were all accepted
    for position in range(num_speculative_tokens):
        reach *= alpha[min(position, len(alpha) - 1)]
        total += reach
    return total


@dataclass
class ChainAcceptance:
    """How often one source's drafts were accepted in a session's passes."""

    accepted: int = 0  # drafts accepted
    cut: int = 0  # chains that ended in a rejected draft
    chains: int = 0  # chains verified

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ALPHA * PRIOR_DRAFTS) / (self.accepted + self.cut + PRIOR_DRAFTS)

    def observe(self, verified: int, accepted: int) -> None:
        """A pass verified `verified` of this source's drafts and accepted the first `accepted`."""
        if not 0 <= accepted <= verified:
            raise ValueError(f"accepted must be in [0, verified = {verified}], got {accepted}")
        if verified:
            self.chains += 1
            self.accepted += accepted
            self.cut += accepted < verified

    def worth(self, drafts: int) -> float:
        """Accepted tokens a chain of `drafts` is expected to give."""
        return expected_committed_tokens(self.alpha, drafts) - 1.0


@dataclass
class OfferOrHead:
    """A session's two sources of drafts in its Decode passes, for the passes that have both."""

    offered: ChainAcceptance
    head: ChainAcceptance

    @classmethod
    def new(cls) -> OfferOrHead:
        return cls(ChainAcceptance(), ChainAcceptance())

    def prefers_head(self, offered_drafts: int, head_drafts: int) -> bool:
        """Whether the head's chain is worth more than the offered one. The first OFFER_TRIALS
        such passes verify the offer, and so does a tie: the head's drafts are verified, and
        learnt from, in every pass without offers anyway, an offer's only where it is chosen (a
        source that is not chosen keeps its rate until it is)."""
        if self.offered.chains < OFFER_TRIALS:
            return False
        return self.head.worth(head_drafts) > self.offered.worth(offered_drafts)
