"""Online estimators behind the adaptive K controller (orchestrator/k_controller.py).

Each estimator takes one sample per round and knows the index of the round it last saw, so that a
sample arriving after a long gap (say the draft hop's RTT, measured again by a probe after many
K = 0 rounds in which no draft call was made) counts for more than one arriving every round: old
information is discounted by the rounds elapsed, not by the samples taken.

- :class:`RunningEstimate`: an EWMA that starts as a running mean (so a session's first samples
  are not swamped by its seed) and forgets by rounds elapsed.
- :class:`AcceptanceEstimate`: alpha, the per-token acceptance probability, as accepted /
  (accepted + rejections) with a Beta prior and discounted counts. A round with n < K accepted gives
  n successes and one failure; a full round gives K successes and no failure. That is the maximum
  likelihood estimate under geometric acceptance; accepted / drafted is biased low, because the
  positions after the first rejection were never tested.
- :class:`VerifyFit`: T_pass(R) ~ a + b * R over the rows R of the whole target pass (every
  session batched into it, not only this one's K + 1), discounted least squares with a ridge pull
  towards a prior (a0, b0), so it is defined from rounds that all had the same rows; plus each row
  count's own residual from that line, because real costs step at kernel block sizes.
- The load a session shares the target with (the mean sessions per pass and the mean rows the
  others put in it) is kept by :class:`RunningEstimate` instances in the controller.
- :class:`ControllerPriors`: pool-wide figures that sessions update and new sessions start from:
  the timings an EWMA of the sessions' estimates, alpha the pool's own accepted / rejected counts.

Pure Python: no I/O, no protobuf, no module-level state.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

# The verify slope's ridge penalty is scaled as if measured at this many rows, so that a prior
# strength of "s rounds" pulls the intercept and the slope about equally hard.
_VERIFY_SLOPE_REFERENCE_ROWS = 4.0


def staleness_weight(weight: float, rounds_elapsed: int) -> float:
    """Weight of a new sample when the previous one is `rounds_elapsed` rounds old."""
    return 1.0 - (1.0 - weight) ** max(1, rounds_elapsed)


@dataclass
class RunningEstimate:
    """EWMA with weight `weight` per round; a running mean while it has few samples."""

    weight: float
    value: float | None = None
    samples: float = 0.0  # samples (and pseudo-samples of a seed) behind `value`
    last_round: int | None = None
    session_samples: int = 0  # real samples seen by this estimate (not the seed)

    @classmethod
    def seeded(cls, weight: float, seed: float | None, seed_samples: float) -> RunningEstimate:
        if seed is None:
            return cls(weight)
        return cls(weight, value=seed, samples=seed_samples)

    def update(self, sample: float, round_index: int) -> None:
        if self.value is None:
            self.value = sample
        else:
            elapsed = 1 if self.last_round is None else round_index - self.last_round
            running_mean = 1.0 / (self.samples + 1.0)
            step = max(self.weight, running_mean, staleness_weight(self.weight, elapsed))
            self.value += step * (sample - self.value)
        self.samples += 1.0
        self.last_round = round_index
        self.session_samples += 1


@dataclass
class AcceptanceEstimate:
    """alpha = (accepted + prior successes) / (accepted + rejections + prior strength)."""

    prior_alpha: float
    prior_strength: float  # pseudo-trials behind prior_alpha
    decay: float  # fraction of the counts kept per round elapsed (1.0: never forget)
    accepted: float = 0.0
    rejected: float = 0.0
    last_round: int | None = None
    session_samples: int = 0  # rounds with K > 0 seen

    def update(self, num_speculative_tokens: int, num_accepted: int, round_index: int) -> tuple[float, float]:
        """A round's outcome; returns the (accepted, rejected) counts it added."""
        if num_speculative_tokens <= 0:
            return 0.0, 0.0  # K = 0: nothing was tested
        return self._add(num_accepted, 1.0 if num_accepted < num_speculative_tokens else 0.0, round_index)

    def update_expected(self, acceptances: Sequence[float], round_index: int) -> tuple[float, float]:
        """Positions tested by their chance of acceptance instead of its outcome (each in [0, 1],
        an unbiased estimate of sum(min(p, q~)) there): each adds its chance to the accepted and
        the rest to the rejected, as a position accepted (1, 0) or rejected (0, 1) does. Returns
        the counts added."""
        if not acceptances:
            return 0.0, 0.0
        chances = [min(1.0, max(0.0, chance)) for chance in acceptances]
        return self._add(sum(chances), len(chances) - sum(chances), round_index)

    def _add(self, accepted: float, rejected: float, round_index: int) -> tuple[float, float]:
        if self.last_round is not None:
            keep = self.decay ** max(0, round_index - self.last_round)
            self.accepted *= keep
            self.rejected *= keep
        self.accepted += accepted
        self.rejected += rejected
        self.last_round = round_index
        self.session_samples += 1
        return accepted, rejected

    @property
    def alpha(self) -> float:
        successes = self.accepted + self.prior_alpha * self.prior_strength
        trials = self.accepted + self.rejected + self.prior_strength
        return successes / trials if trials > 0 else self.prior_alpha

    @property
    def alpha_sd(self) -> float:
        """Standard deviation of the Beta posterior behind `alpha`."""
        alpha = self.alpha
        trials = self.accepted + self.rejected + self.prior_strength
        return math.sqrt(alpha * (1.0 - alpha) / (trials + 1.0))


@dataclass
class VerifyFit:
    """T_pass(n) ~ a + b * n, n the rows of one target pass; ridge towards (a0, b0).

    n is the whole pass's rows: K + 1 when the session's Verify ran alone, the sum over every
    session batched into it otherwise, so one line describes the pass whoever shares it.

    Minimises  sum_i w_i (t_i - a - b n_i)^2 + s (a - a0)^2 + s r^2 (b - b0)^2  with w_i = decay^age
    and r a reference row count. When nothing seeds the prior, the first sample sets it, splitting
    its time as b0 = slope_ratio * a0.

    A line is only the prior shape: on CPU the cost of a pass steps up at kernel block sizes (the
    default target: 64, 68, 72 ms for 1-3 rows, then 98 ms for 4; the pair benchmark). So each
    row count also keeps its mean residual from the line, discounted by `row_decay` per round (the
    shape of the curve changes slowly; its level, which the line tracks, with the context), and
    :meth:`seconds` adds it, shrunk by `row_shrink` rounds' worth of weight towards zero.
    """

    prior_strength: float  # s, in rounds
    decay: float  # fraction of old rounds' weight kept per round elapsed
    slope_ratio: float  # b0 / a0 when the first sample sets the prior
    row_shrink: float = 1.0  # rounds' worth of pull of a row count's residual towards zero
    row_decay: float = 0.998  # fraction of a row count's residual weight kept per round elapsed
    prior_a: float | None = None
    prior_b: float | None = None
    prior_residuals: tuple[tuple[int, float], ...] = ()  # (rows, residual): one pseudo-sample each
    last_round: int | None = None
    session_samples: int = 0
    # Discounted sufficient statistics: sum w, w n, w n^2, w t, w n t.
    _sw: float = 0.0
    _sn: float = 0.0
    _snn: float = 0.0
    _st: float = 0.0
    _snt: float = 0.0
    # Per row count: (discounted weight, discounted sum of residuals, round of the last sample).
    _by_rows: dict[int, tuple[float, float, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for rows, residual in self.prior_residuals:
            self._by_rows[rows] = (1.0, residual, 0)

    def residuals(self) -> tuple[tuple[int, float], ...]:
        """(rows, mean residual from the line) for each row count with a sample or prior."""
        now = self.last_round or 0
        sums = {rows: self._row_sums(rows, now) for rows in self._by_rows}
        return tuple((rows, total / weight) for rows, (weight, total) in sorted(sums.items())
                     if weight > 1e-9)

    def update(self, rows: int, seconds: float, round_index: int, weight: float = 1.0) -> None:
        """One pass of `rows` rows took `seconds`. weight > 1: the mean of that many passes (a
        Decode's), which moves the line as that many samples would; its distance from the line
        before it is then the line's error more than a step of its row count, so it leaves the
        row counts' residuals alone."""
        if self.prior_a is None or self.prior_b is None:
            self.prior_a = seconds / (1.0 + self.slope_ratio * rows)
            self.prior_b = self.slope_ratio * self.prior_a
        residual = seconds - self._line(rows)  # against the line before this sample joins it
        if self.last_round is not None:
            keep = self.decay ** max(0, round_index - self.last_round)
            self._sw, self._sn, self._snn = self._sw * keep, self._sn * keep, self._snn * keep
            self._st, self._snt = self._st * keep, self._snt * keep
        self._sw += weight
        self._sn += weight * rows
        self._snn += weight * rows * rows
        self._st += weight * seconds
        self._snt += weight * rows * seconds
        if weight == 1.0:
            row_weight, total = self._row_sums(rows, round_index)
            self._by_rows[rows] = (row_weight + 1.0, total + residual, round_index)
        self.last_round = round_index
        self.session_samples += 1

    def _row_sums(self, rows: int, round_index: int) -> tuple[float, float]:
        """A row count's discounted (weight, sum of residuals) as of `round_index`."""
        if rows not in self._by_rows:
            return 0.0, 0.0
        weight, total, last = self._by_rows[rows]
        keep = self.row_decay ** max(0, round_index - last)
        return weight * keep, total * keep

    def row_weight(self, rows: int) -> float:
        """Discounted count of the samples measured at this row count (0 if never)."""
        if self.last_round is None:
            return 0.0
        return self._row_sums(rows, self.last_round)[0]

    def _fitted_line(self) -> tuple[float, float]:
        coefficients = self.coefficients()
        if coefficients is None:
            raise ValueError("VerifyFit has no sample and no prior yet")
        return coefficients

    def _line(self, rows: int) -> float:
        a, b = self._fitted_line()
        return a + b * rows

    def line_seconds(self, rows: int) -> float:
        """Predicted T_pass(rows) by the line alone, without the row count's residual."""
        return max(0.0, self._line(rows))

    def seconds(self, rows: int) -> float:
        """Predicted T_pass(rows): the line plus the row count's shrunk mean residual."""
        return self.seconds_up_to(rows, first=rows)[0]

    def seconds_up_to(self, max_rows: int, first: int = 1) -> list[float]:
        """seconds(rows) for rows = first .. max_rows, solving the line once."""
        a, b = self._fitted_line()
        now = self.last_round or 0
        predictions = []
        for rows in range(first, max_rows + 1):
            weight, total = self._row_sums(rows, now)
            predictions.append(max(0.0, a + b * rows + total / (weight + self.row_shrink)))
        return predictions

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) with a, b >= 0, or None before any sample or prior."""
        if self.prior_a is None or self.prior_b is None:
            return None
        ridge_a = self.prior_strength
        ridge_b = self.prior_strength * _VERIFY_SLOPE_REFERENCE_ROWS**2
        # Normal equations [[sw + ra, sn], [sn, snn + rb]] [a, b] = [st + ra a0, snt + rb b0].
        m11, m12, m22 = self._sw + ridge_a, self._sn, self._snn + ridge_b
        y1 = self._st + ridge_a * self.prior_a
        y2 = self._snt + ridge_b * self.prior_b
        det = m11 * m22 - m12 * m12
        a = (y1 * m22 - m12 * y2) / det
        b = (m11 * y2 - m12 * y1) / det
        if b < 0.0:  # CPU timings are not monotone in n; never predict that more rows are cheaper
            return max(0.0, y1 / m11), 0.0
        if a < 0.0:
            return 0.0, max(0.0, y2 / m22)
        return a, b


@dataclass(frozen=True)
class PriorEstimates:
    """Figures a session starts from; None where nothing is known. Seconds, probabilities."""

    alpha: float | None = None
    # The pool's (discounted) accepted + rejected drafts behind alpha; None: alpha was given, not
    # counted. Few counts are little evidence: a pool's first round can put alpha at 0 or 1.
    alpha_trials: float | None = None
    t_draft_per_token: float | None = None
    t_feed_per_token: float | None = None
    verify_a: float | None = None
    verify_b: float | None = None
    rtt_draft: float | None = None
    rtt_target: float | None = None
    # (rows, mean residual from the verify line in seconds) for each row count measured: the shape
    # of T_verify(n) that a line misses, e.g. the step at 4 rows on this CPU
    verify_residuals: tuple[tuple[int, float], ...] | None = None
    # K = 0 rounds decoded in one call: their time per token over a K = 0 Verify round's
    plain_factor: float | None = None


def _blend(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


class ControllerPriors:
    """Pool-wide priors. Timings: an EWMA, over all sessions' updates, of each session's own
    estimates. Acceptance: the pool's own accepted and rejected counts, every session's tested
    rounds added as they come, each addition keeping (1 - acceptance_weight) of the counts before
    it; alpha is their ratio (at 0.01, about the last hundred rounds: a round tests two or three
    drafts, so a pool alpha of 0.6 is known to about 0.03). Not an average of the sessions' alphas: one session tests a few rounds, and
    accepted / (accepted + rejected) over a few geometric rounds is biased low (a pool of
    sessions whose rounds accepted 0.645 of the drafts averaged 0.55-0.60), where a ratio of the
    pooled counts is not.

    Shared by the sessions of one orchestrator (one draft pool, one target pool), so a new session
    starts from what the pool measured instead of from defaults. Thread-safe.
    """

    def __init__(self, weight: float = 0.05, initial: PriorEstimates | None = None,
                 acceptance_weight: float = 0.01) -> None:
        for name, value in (("weight", weight), ("acceptance_weight", acceptance_weight)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        self._weight = weight
        self._acceptance_keep = 1.0 - acceptance_weight
        self._current = initial if initial is not None else PriorEstimates()
        # An initial alpha without its trials counts as many as the counts hold at one per addition.
        seed_trials = 0.0
        if self._current.alpha is not None:
            seed_trials = self._current.alpha_trials or 1.0 / acceptance_weight
        self._accepted = (self._current.alpha or 0.0) * seed_trials
        self._rejected = seed_trials - self._accepted
        self._lock = threading.Lock()

    def snapshot(self) -> PriorEstimates:
        with self._lock:
            return self._current

    def add_acceptance(self, accepted: float, rejected: float) -> None:
        """One session's tested round (or probe): the drafts it accepted and the rejections."""
        if accepted + rejected <= 0.0:
            return
        with self._lock:
            self._accepted = self._accepted * self._acceptance_keep + accepted
            self._rejected = self._rejected * self._acceptance_keep + rejected
            trials = self._accepted + self._rejected
            self._current = replace(self._current, alpha=self._accepted / trials, alpha_trials=trials)

    def update(self, session: PriorEstimates) -> None:
        """Blend in one session's current estimates (its None fields leave the prior alone); its
        alpha is not blended: acceptance reaches the pool as counts (add_acceptance)."""
        with self._lock:
            changes: dict[str, object] = {}
            for field in fields(PriorEstimates):
                new = getattr(session, field.name)
                if new is None or field.name in ("alpha", "alpha_trials"):
                    continue
                old = getattr(self._current, field.name)
                if field.name == "verify_residuals":  # blended row count by row count
                    merged = dict(old or ())
                    for rows, residual in new:
                        merged[rows] = _blend(merged.get(rows), residual, self._weight)
                    changes[field.name] = tuple(sorted(merged.items()))
                else:
                    changes[field.name] = _blend(old, new, self._weight)
            self._current = replace(self._current, **changes)
