"""How often a lookup's proposed tokens are accepted, by the length of the match each rests on
(plain Python, no torch): the estimates that decide how many of a lookup's tokens a pass verifies,
in the orchestrator (orchestrator/lookup_policy.py) and in the target's own Decode passes
(target_service/engine.py).

A token continuing a long match is accepted far more often than one after a short match, so
acceptance is estimated per match-length bucket (MATCH_BUCKETS), each a Beta posterior, its prior
the pool's figure for the bucket (LookupPriors) or, where the pool has none, the session's
acceptance of all its lookup tokens; updated as the target's verdicts come: of a pass's tokens,
those accepted count as successes in their buckets, the first rejected one as a failure, the rest
were not judged.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass

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
