"""How many of a lookup's tokens a round verifies, and whether a hybrid round goes with the lookup
or with the model draft (docs/architecture.md, "Model-free drafts").

A lookup (specdec/lookup.py) proposes at no draft compute and over no hop: its only cost is the
verify rows it adds. So it is asked for as many tokens as the round may hold, and the choice comes
after it answers, from what it answered: each proposed token rests on a match of some length (the
context matched, the proposed tokens before it included), and a token continuing a long match is
accepted far more often than one after a short match. Acceptance is estimated per match-length
bucket (MATCH_BUCKETS), each a Beta posterior like the model draft's alpha, its prior the pool's
figure for the bucket (LookupPriors) or, where the pool has none, the session's acceptance of all
its lookup tokens; updated as the target's verdicts come: of a round's tokens, those accepted
count as successes in their buckets, the first rejected one as a failure, the rest were not
judged. The i-th token's alpha_i is its bucket's, and with the cost model of
orchestrator/k_controller.py at zero draft time and hop,

    k* = argmin over k = 0..L of T_round_lookup(k) / E(k; alpha_1..alpha_k)

(k = 0: a plain K = 0 round; L at most the controller's maximum K). k* is chosen at the
estimates themselves: on the default pair, taking each bucket one posterior sd optimistic (so that
a poor-looking bucket is retried now and then) verified more rows than it won back. A bucket that
stops being verified in a session keeps its estimate; the pool's figure, which new sessions start
from, still moves with the sessions that do verify it.

Hybrid: the lookup's k* is compared, at the alphas themselves, with the model draft's round at the
K the controller chose for it (its own alpha, draft time, hop and catch-up): the round goes with
whichever commits tokens at the lower expected seconds per token. Lookup rounds leave the model
draft's alpha and timings alone (they measured none of them) and add their tokens to what it must
catch up on.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from orchestrator.k_controller import RoundCosts, seconds_per_token

# Lower bounds of the match-length buckets, in context tokens: 1, 2, 3, 4-5, 6-7, 8-11, 12-15, 16+.
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)


def match_bucket(match_length: int) -> int:
    """The bucket index of a match length (lengths below 1 count as 1)."""
    return max(0, bisect.bisect_right(MATCH_BUCKETS, match_length) - 1)


def bucket_name(bucket: int) -> str:
    """'4-5', '16+': a bucket's lengths, for stats."""
    low = MATCH_BUCKETS[bucket]
    if bucket + 1 == len(MATCH_BUCKETS):
        return f"{low}+"
    high = MATCH_BUCKETS[bucket + 1] - 1
    return str(low) if high == low else f"{low}-{high}"


def lookup_costs(costs: RoundCosts) -> RoundCosts:
    """A round's costs when a lookup proposes: no draft time, no hop, nothing to catch up."""
    return replace(costs, t_draft=0.0, rtt_draft=0.0, catchup_seconds=0.0)


def best_lookup_k(alphas: Sequence[float], costs: RoundCosts) -> tuple[int, float]:
    """(k*, its seconds per token) over k = 0..len(alphas), alphas[i] for the (i + 1)-th token;
    costs as lookup_costs gives them. The smallest k on ties."""
    best, best_seconds = 0, seconds_per_token(1.0, 0, costs)
    for num in range(1, len(alphas) + 1):
        seconds = seconds_per_token(alphas[:num], num, costs)
        if seconds < best_seconds:
            best, best_seconds = num, seconds
    return best, best_seconds


@dataclass(frozen=True)
class LookupConfidenceConfig:
    """Settings of LookupAcceptance."""

    prior_alpha: float = 0.5  # a bucket's alpha before anything is known of it
    prior_strength: float = 4.0  # pseudo-trials behind the prior (the pool's or the default)
    decay: float = 0.99  # fraction of a bucket's counts kept per token of it tested

    def __post_init__(self) -> None:
        if not 0.0 < self.prior_alpha < 1.0:
            raise ValueError(f"prior_alpha must be in (0, 1), got {self.prior_alpha}")
        if self.prior_strength <= 0.0:
            raise ValueError("prior_strength must be > 0")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")


class LookupPriors:
    """Pool-wide per-bucket alphas: an EWMA over every session's updates of its own bucket
    estimates. Shared by the sessions of one orchestrator (greedy and sampled apart). Thread-safe."""

    def __init__(self, weight: float = 0.05) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self._weight = weight
        self._alphas: list[float | None] = [None] * len(MATCH_BUCKETS)
        self._lock = threading.Lock()

    def snapshot(self) -> tuple[float | None, ...]:
        with self._lock:
            return tuple(self._alphas)

    def update(self, bucket: int, alpha: float) -> None:
        with self._lock:
            old = self._alphas[bucket]
            self._alphas[bucket] = alpha if old is None else old + self._weight * (alpha - old)


@dataclass
class _BucketCounts:
    accepted: float = 0.0
    rejected: float = 0.0
    tests: int = 0  # tokens of this bucket the target has judged, this session


class LookupAcceptance:
    """One session's acceptance of lookup tokens, per match-length bucket.

    alpha_b = (accepted_b + prior_b S) / (accepted_b + rejected_b + S), S = config.prior_strength,
    with prior_b the pool's figure for the bucket where it has one, else this session's acceptance
    of all its lookup tokens (itself pulled towards config.prior_alpha): a bucket not yet tested
    starts from what the others show, not from a fixed guess. A bucket's counts decay per token of
    it tested, not per round, so one that rounds rarely reach keeps what it learnt."""

    def __init__(self, config: LookupConfidenceConfig = LookupConfidenceConfig(),
                 priors: LookupPriors | None = None) -> None:
        self._config = config
        self._priors = priors
        self._pool = priors.snapshot() if priors is not None else (None,) * len(MATCH_BUCKETS)
        self._buckets = [_BucketCounts() for _ in MATCH_BUCKETS]
        self._all = _BucketCounts()

    def _alpha(self, counts: _BucketCounts, prior: float) -> float:
        strength = self._config.prior_strength
        return (counts.accepted + prior * strength) / (counts.accepted + counts.rejected + strength)

    def _overall(self) -> float:
        return self._alpha(self._all, self._config.prior_alpha)

    def alpha(self, bucket: int) -> float:
        pool = self._pool[bucket]
        return self._alpha(self._buckets[bucket], self._overall() if pool is None else pool)

    def alphas(self, match_lengths: Sequence[int]) -> list[float]:
        """alpha_i for each proposed token: its bucket's."""
        return [self.alpha(match_bucket(length)) for length in match_lengths]

    def update(self, match_lengths: Sequence[int], num_accepted: int) -> None:
        """The target's verdict on a round of len(match_lengths) lookup tokens: the accepted ones
        count as successes in their buckets, the first rejected one as a failure, the rest were not
        judged."""
        decay = self._config.decay
        for position, length in enumerate(match_lengths[: num_accepted + 1]):
            bucket = match_bucket(length)
            for counts in (self._buckets[bucket], self._all):
                counts.accepted *= decay
                counts.rejected *= decay
                counts.tests += 1
                if position < num_accepted:
                    counts.accepted += 1.0
                else:
                    counts.rejected += 1.0
            if self._priors is not None:
                self._priors.update(bucket, self.alpha(bucket))

    def estimates(self) -> dict[str, float]:
        """The buckets this session has tested: lookup_alpha_match_<lengths>."""
        return {f"lookup_alpha_match_{bucket_name(bucket)}": self.alpha(bucket)
                for bucket, counts in enumerate(self._buckets) if counts.tests > 0}


def choose_lookup_k(acceptance: LookupAcceptance, match_lengths: Sequence[int], costs: RoundCosts | None,
                    model_seconds_per_token: float | None) -> int:
    """How many of a lookup's tokens to verify: 0 (the round goes without them: the model's, or
    K = 0) or k*; under hybrid only when k* is expected to commit tokens at fewer seconds each
    than the model's round (model_seconds_per_token; None: no model draft this round). costs: the
    session's round costs (any draft figures in them are ignored); None before the first verify:
    all of the lookup."""
    if not match_lengths:
        return 0
    if costs is None:
        return len(match_lengths)
    costs = lookup_costs(costs)
    num, seconds = best_lookup_k(acceptance.alphas(match_lengths), costs)
    if num == 0 or not math.isfinite(seconds):
        return 0
    if model_seconds_per_token is not None and not seconds < model_seconds_per_token:
        return 0
    return num
