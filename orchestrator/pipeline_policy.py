"""Whether to draft ahead, and how widely: the cost model of pipelined speculation
(docs/architecture.md, "Choosing K", "Pipelining: the cost model").

A round of K drafts: the draft proposes d1 .. dK (the draft side, D(K) = K t_draft + RTT_draft),
then the target verifies them in one pass of R_others + K + 1 rows (the verify path,
V(K) = RTT_target + T_pass(R_others + K + 1)). A pipelined round also drafts ahead while the target
verifies: for every outcome "j of the K drafts accepted, then token t", j = 0..K, t among the
draft's top f candidates at position j (for j < K the rejected draft d(j+1) excluded, for j = K the
bonus position's own top f), K' drafts each: (K + 1) f branches, drafted in K' + 1 batched passes
of up to (K + 1) f rows, T_branch seconds of draft time. When the outcome has a branch (a hit)
the next round's proposal is already there and no draft call is waited for; otherwise (a miss) the
next round proposes as usual.

The model, per round of K drafts and fan-out f (f = 0: not pipelined; K = 0 is never pipelined):

- Hit rate. With P_all = alpha^K (prod of the per-position alphas when given) the probability
  that all K drafts are accepted,

      h(K, f) = P_all c_bonus(f) + (1 - P_all) c_corr(f)

  c_bonus(f): P(the target's bonus token is in the draft's top f at the bonus position);
  c_corr(f): P(its correction is in the draft's top f there, the rejected draft excluded).
  :class:`CandidateRanks` estimates both from the rank of the target's token among the draft's
  candidates, seeded with measured priors for the default pair (c_corr = .19/.27/.33, c_bonus =
  .41/.52/.58 at f = 1/2/3, gently extrapolated beyond).
- Round time. The branches run concurrently with the verify and the loop waits for both; with
  h_prev the probability that this round's proposal was drafted ahead:

      T_pipe(K, f) = catch-up + (1 - h_prev) (D(K) + max(V_s, hop_miss + T_branch))
                              +      h_prev  max(V_s, hop_hit + T_branch)

  V_s = RTT_target + s T_pass(R_others + K + 1): s >= 1 is the verify slowdown, what the branch
  compute takes from a target sharing the draft's cores (1 apart). hop_hit (RTT_draft, or the
  measured round trip of branch calls up to their proposal): on a hit the branch call starts with
  the verify. hop_miss: on a miss the branches follow the proposal on the same call (Speculate),
  so they add no hop of their own (0, the default); pass RTT_draft for a design that sends them as
  a call of their own. With
  hop_miss = hop_hit this is the simpler (1 - h) D(K) + max(V_s, RTT_draft + T_branch).
  Steady state: the next round runs the same K and f, so h_prev = h(K, f) and K' = K.
- T_branch(rows, passes) = passes (t0 + t1 (rows - 1)), rows = (K + 1) f, passes = K' + 1:
  :class:`BranchCost` fits t0 (pulled to t_draft, one row's pass) and t1 >= 0 (each further row)
  to what the branches take after their call's proposal as the client sees it (at least the
  draft's reported compute): the draft runs one job per branch, and their scheduling and transfer
  grow with the branches, so they belong to T_branch, not to a fixed hop.
- Choice. Seconds per token as k_controller.seconds_per_token: T / (E(K) - L), E(K) the expected
  committed tokens (unchanged by pipelining: a branch holds the very drafts a Propose would
  draft), L the tokens the other sessions in the verify pass lose to it, (n - 1) r (s T_pass(R_others
  + K + 1) - T_pass(R_others + 1)): this session's rows and, co-located, the slowdown. (K, f) =
  argmin over K in 0..max_k and f in 0..max_fanout; f = 0 is the plain k_controller.round_time.
  A fan-out is chosen only when it beats the best plain round by `margin` (3 %), so pipelining
  turns itself off when its gain is noise, and the smallest f within `fanout_tolerance` (1 %) of
  the best fan-out's time, since more branches cost the draft compute the model does not charge.

Intended calls (one :class:`PipelineController` per session, `PipelinePriors` per pool):

    (K, f) = controller.choose(alpha, costs, max_k, max_fanout)  # once per round; costs from
                                                                  # the K controller's RoundCosts
    ... the round: Speculate(K, fanout=f, branch K' = K) if f > 0, else Propose(K) ...
    controller.observe_verify(pipelined=f > 0, compute_seconds, predicted_seconds)
    controller.observe_branches(compute_seconds, passes, rows_per_pass, after_proposal_seconds,
                                hop_seconds)  # f > 0
    controller.observe_outcome(bonus=num_accepted == K, rank, candidates, fanout=f)  # f > 0

observe_outcome needs the candidates the draft returned for the outcome's position, so it is
called for rounds that drafted ahead. The pure pieces (`hit_rate`, `pipelined_round_time`,
`pipeline_seconds_per_token`, `pipeline_times`, `choose_from_table`, `best_pipeline`) take any
object with c_bonus(f)/c_corr(f) (:class:`FixedCoverage`) and seconds()/hop_seconds()
(:class:`LinearBranchTime`), for simulations.

Pure Python: no I/O, no torch, no gRPC.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Protocol

from orchestrator.k_controller import (
    RoundCosts,
    expected_committed_tokens,
    others_lost_tokens,
    round_time,
    seconds_per_token,
)
from orchestrator.k_estimates import RunningEstimate

# Measured on the default pair (bench_pair): the draft's top-1 matches the target on ~41 % of
# positions (the bonus position's coverage at f = 1); when the draft misses, the target's token is
# among its next 1/2/3 candidates 19/27/33 % of the time (the correction's coverage).
DEFAULT_C_BONUS_MEASURED: tuple[float, ...] = (0.41, 0.52, 0.58)
DEFAULT_C_CORR_MEASURED: tuple[float, ...] = (0.19, 0.27, 0.33)
DEFAULT_MAX_FANOUT = 8


def extend_coverage(curve: Sequence[float], length: int, ratio: float = 0.75,
                    cap: float = 0.95) -> tuple[float, ...]:
    """`curve` (c(1), c(2), ...) made non-decreasing, in [0, cap], and extended to `length` points:
    each further increment is `ratio` times the one before it."""
    if not curve:
        raise ValueError("a coverage curve needs at least one point")
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    points: list[float] = []
    for value in curve[:length]:
        points.append(min(cap, max(0.0, value, points[-1] if points else 0.0)))
    step = points[-1] - points[-2] if len(points) >= 2 else points[-1] * (1.0 - ratio)
    while len(points) < length:
        step *= ratio
        points.append(min(cap, points[-1] + step))
    return tuple(points)


DEFAULT_C_BONUS: tuple[float, ...] = extend_coverage(DEFAULT_C_BONUS_MEASURED, DEFAULT_MAX_FANOUT, cap=0.75)
DEFAULT_C_CORR: tuple[float, ...] = extend_coverage(DEFAULT_C_CORR_MEASURED, DEFAULT_MAX_FANOUT, cap=0.5)


# ---------------------------------------------------------------------------------------------
# What the pure functions read


class Coverage(Protocol):
    def c_bonus(self, fanout: int) -> float:
        """P(the target's bonus token is among the draft's top `fanout`); 0 at fanout 0."""

    def c_corr(self, fanout: int) -> float:
        """P(the target's correction is among the draft's top `fanout`, the rejected draft
        excluded); 0 at fanout 0."""


class BranchTime(Protocol):
    def seconds(self, rows_per_pass: int, passes: int, t_draft: float) -> float:
        """T_branch: the draft's compute for `passes` passes of `rows_per_pass` rows."""

    def hop_seconds(self, default: float) -> float:
        """A branch call's overhead beyond its compute; `default` (RTT_draft) if unmeasured."""


@dataclass(frozen=True)
class FixedCoverage:
    """Coverage curves given outright: c(f) = curve[f - 1], the last point beyond the curve."""

    bonus: tuple[float, ...] = DEFAULT_C_BONUS
    corr: tuple[float, ...] = DEFAULT_C_CORR

    def c_bonus(self, fanout: int) -> float:
        return _curve_at(self.bonus, fanout)

    def c_corr(self, fanout: int) -> float:
        return _curve_at(self.corr, fanout)


# Coverage at every fan-out 1: every round's outcome among the draft's first candidates.
EVERY_ROUND_A_HIT = FixedCoverage((1.0,), (1.0,))


def _curve_at(curve: Sequence[float], fanout: int) -> float:
    if fanout <= 0 or not curve:
        return 0.0
    return curve[min(fanout, len(curve)) - 1]


@dataclass(frozen=True)
class LinearBranchTime:
    """T_branch = passes (t0 + t1 (rows - 1)); t0 None: t_draft. hop None: RTT_draft."""

    t1: float
    t0: float | None = None
    hop: float | None = None

    def seconds(self, rows_per_pass: int, passes: int, t_draft: float) -> float:
        t0 = t_draft if self.t0 is None else self.t0
        return passes * (t0 + self.t1 * max(0, rows_per_pass - 1))

    def hop_seconds(self, default: float) -> float:
        return default if self.hop is None else self.hop


# ---------------------------------------------------------------------------------------------
# The cost model (pure)


def branch_rows(num_speculative_tokens: int, fanout: int) -> int:
    """Rows per branch pass: one per outcome, (K + 1) f."""
    return (num_speculative_tokens + 1) * fanout


def branch_passes(branch_num_speculative_tokens: int) -> int:
    """Branch passes for K' drafts per branch: K' + 1 (the outcome's token, the drafts but the
    last, and dK for the bonus position)."""
    return branch_num_speculative_tokens + 1


def all_accepted_probability(alpha: float | Sequence[float], num_speculative_tokens: int) -> float:
    """P_all: alpha^K, or the product of per-position alphas (the last one repeating)."""
    if isinstance(alpha, (int, float)):
        return float(alpha) ** num_speculative_tokens
    if not alpha:
        raise ValueError("per-position alpha must not be empty")
    product = 1.0
    for position in range(num_speculative_tokens):
        product *= alpha[min(position, len(alpha) - 1)]
    return product


def hit_rate(alpha: float | Sequence[float], num_speculative_tokens: int, fanout: int,
             ranks: Coverage) -> float:
    """h(K, f) = P_all c_bonus(f) + (1 - P_all) c_corr(f): the probability that the round's outcome
    has a branch. 0 at f = 0 and at K = 0 (never pipelined)."""
    if num_speculative_tokens <= 0 or fanout <= 0:
        return 0.0
    every = all_accepted_probability(alpha, num_speculative_tokens)
    return every * ranks.c_bonus(fanout) + (1.0 - every) * ranks.c_corr(fanout)


def pipelined_round_time(
    num_speculative_tokens: int,
    fanout: int,
    branch_num_speculative_tokens: int,
    costs: RoundCosts,
    hit: float,
    branch_seconds: float,
    slowdown: float = 1.0,
    *,
    branch_hop: float | None = None,
    miss_branch_hop: float = 0.0,
) -> float:
    """Expected seconds of a round of K drafts that drafts ahead with fan-out f, K' drafts per
    branch (f = 0: k_controller.round_time).

        catch-up + (1 - hit) (D(K) + max(V_s, miss_branch_hop + branch_seconds))
                 +      hit  max(V_s, branch_hop + branch_seconds)

    D(K) = K t_draft + RTT_draft, V_s = RTT_target + slowdown T_pass(R_others + K + 1). `hit` is
    the probability that this round's own proposal was drafted ahead by the round before it
    (h(K, f) in the steady state); `branch_seconds` is T_branch of this round's branches (those for
    K' drafts; K' enters only through it); branch_hop None is RTT_draft. miss_branch_hop: what
    the branches wait beyond the proposal on a miss, 0 when they stream on the proposal's call.
    At hit 0, slowdown 1 and a branch path within the verify path this is round_time exactly.
    """
    if fanout == 0:
        return round_time(num_speculative_tokens, costs)
    if fanout < 0 or num_speculative_tokens < 1 or branch_num_speculative_tokens < 1:
        raise ValueError("a pipelined round needs K >= 1, f >= 1 and K' >= 1, got "
                         f"K={num_speculative_tokens}, f={fanout}, K'={branch_num_speculative_tokens}")
    if not 0.0 <= hit <= 1.0:
        raise ValueError(f"hit must be in [0, 1], got {hit}")
    if slowdown <= 0.0:
        raise ValueError(f"slowdown must be > 0, got {slowdown}")
    hop = costs.rtt_draft if branch_hop is None else branch_hop
    draft_side = num_speculative_tokens * costs.t_draft + costs.rtt_draft
    verify_path = costs.rtt_target + slowdown * costs.verify_fn(costs.others_rows + num_speculative_tokens + 1)
    miss = draft_side + max(verify_path, miss_branch_hop + branch_seconds)
    hit_path = max(verify_path, hop + branch_seconds)
    return costs.catchup_seconds + (1.0 - hit) * miss + hit * hit_path


def pipelined_others_lost_tokens(num_speculative_tokens: int, costs: RoundCosts, slowdown: float) -> float:
    """(n - 1) r (s T_pass(R_others + K + 1) - T_pass(R_others + 1)): the others' loss to this
    session's rows and, co-located, to the verify slowdown its branches cause."""
    lost = others_lost_tokens(num_speculative_tokens, costs)
    if costs.others_sessions <= 0.0 or costs.others_tokens_per_second <= 0.0 or slowdown <= 1.0:
        return lost
    slower = (slowdown - 1.0) * costs.verify_fn(costs.others_rows + num_speculative_tokens + 1)
    return lost + costs.others_sessions * costs.others_tokens_per_second * slower


def pipeline_seconds_per_token(
    alpha: float | Sequence[float],
    num_speculative_tokens: int,
    fanout: int,
    costs: RoundCosts,
    ranks: Coverage,
    branch_cost: BranchTime,
    slowdown: float = 1.0,
    *,
    miss_branch_hop: float = 0.0,
) -> float:
    """Seconds per token the system gains (k_controller.seconds_per_token) of K drafts at fan-out
    f in the steady state (the next round the same, so K' = K and h_prev = h(K, f)); f = 0 is
    seconds_per_token itself; K = 0 with f > 0 is infinite (never pipelined)."""
    if fanout == 0:
        return seconds_per_token(alpha, num_speculative_tokens, costs)
    if num_speculative_tokens == 0:
        return math.inf
    hit = hit_rate(alpha, num_speculative_tokens, fanout, ranks)
    seconds = branch_cost.seconds(branch_rows(num_speculative_tokens, fanout),
                                  branch_passes(num_speculative_tokens), costs.t_draft)
    elapsed = pipelined_round_time(
        num_speculative_tokens, fanout, num_speculative_tokens, costs, hit, seconds, slowdown,
        branch_hop=branch_cost.hop_seconds(costs.rtt_draft), miss_branch_hop=miss_branch_hop,
    )
    gained = (expected_committed_tokens(alpha, num_speculative_tokens)
              - pipelined_others_lost_tokens(num_speculative_tokens, costs, slowdown))
    return elapsed / gained if gained > 0.0 else math.inf


def pipeline_times(
    alpha: float | Sequence[float],
    costs: RoundCosts,
    max_num_speculative_tokens: int,
    max_fanout: int,
    ranks: Coverage,
    branch_cost: BranchTime,
    slowdown: float = 1.0,
    *,
    miss_branch_hop: float = 0.0,
) -> list[list[float]]:
    """times[K][f], seconds per token for K in 0..max_k and f in 0..max_fanout (column 0 is
    k_controller.seconds_per_token; row 0 beyond column 0 is infinite)."""
    return [[pipeline_seconds_per_token(alpha, num, fanout, costs, ranks, branch_cost, slowdown,
                                        miss_branch_hop=miss_branch_hop)
             for fanout in range(max_fanout + 1)]
            for num in range(max_num_speculative_tokens + 1)]


def choose_from_table(times: Sequence[Sequence[float]], margin: float = 0.03,
                      fanout_tolerance: float = 0.01) -> tuple[int, int]:
    """(K, f) from times[K][f]: the best plain K (f = 0, smallest K on ties) unless some f > 0
    beats it by `margin`; then the smallest such f whose best time is within `fanout_tolerance` of
    the best fan-out's (and that f's best K, the smallest on ties)."""
    plain = min(range(len(times)), key=lambda num: times[num][0])
    plain_seconds = times[plain][0]
    best_by_fanout: list[tuple[float, int, int]] = []  # (seconds, f, K)
    for fanout in range(1, len(times[0])):
        num = min(range(len(times)), key=lambda k: times[k][fanout])
        if times[num][fanout] < plain_seconds * (1.0 - margin):
            best_by_fanout.append((times[num][fanout], fanout, num))
    if not best_by_fanout:
        return plain, 0
    best_seconds = min(seconds for seconds, _, _ in best_by_fanout)
    for seconds, fanout, num in best_by_fanout:  # ascending f
        if seconds <= best_seconds * (1.0 + fanout_tolerance):
            return num, fanout
    raise AssertionError("unreachable: the best fan-out is within tolerance of itself")


def best_pipeline(
    alpha: float | Sequence[float],
    costs: RoundCosts,
    max_num_speculative_tokens: int,
    max_fanout: int,
    ranks: Coverage,
    branch_cost: BranchTime,
    slowdown: float = 1.0,
    *,
    margin: float = 0.03,
    fanout_tolerance: float = 0.01,
    miss_branch_hop: float = 0.0,
) -> tuple[int, int]:
    """(K, f) = argmin of seconds per token over K in 0..max_k and f in 0..max_fanout, f > 0 only
    when it beats the best plain round by `margin` (see choose_from_table). (0, 0) at max_k 0."""
    if max_num_speculative_tokens < 0 or max_fanout < 0:
        raise ValueError("max_num_speculative_tokens and max_fanout must be >= 0")
    times = pipeline_times(alpha, costs, max_num_speculative_tokens, max_fanout, ranks, branch_cost,
                           slowdown, miss_branch_hop=miss_branch_hop)
    return choose_from_table(times, margin, fanout_tolerance)


# ---------------------------------------------------------------------------------------------
# Estimators


class _RankHazards:
    """The rank distribution of the target's token among the draft's candidates, as hazards
    lambda_r = P(rank = r | rank >= r), r = 1..F, from discounted counts plus prior pseudo-counts.
    c(f) = 1 - prod_{r <= f} (1 - lambda_r). Hazards take censoring in their stride: a call that
    returned m candidates, none of them the target's, says nothing about ranks beyond m."""

    def __init__(self, prior: Sequence[float], max_fanout: int, strength: float, decay: float) -> None:
        curve = extend_coverage(prior, max_fanout, cap=0.999)
        before = (0.0, *curve[:-1])
        self._prior_at_risk = [strength * (1.0 - c0) for c0 in before]
        self._prior_events = [strength * (c1 - c0) for c0, c1 in zip(before, curve)]
        self._at_risk = [0.0] * max_fanout
        self._events = [0.0] * max_fanout
        self._decay = decay
        self.samples = 0

    def update(self, rank: int | None, candidates: int | None) -> None:
        size = len(self._at_risk)
        if rank is not None and rank < 1:
            raise ValueError(f"rank is 1-based, got {rank}")
        if candidates is not None and candidates < 0:
            raise ValueError(f"candidates must be >= 0, got {candidates}")
        if self._decay < 1.0:
            self._at_risk = [count * self._decay for count in self._at_risk]
            self._events = [count * self._decay for count in self._events]
        if rank is not None and rank <= size:
            for level in range(rank):
                self._at_risk[level] += 1.0
            self._events[rank - 1] += 1.0
        else:  # not among the first `seen` candidates
            seen = size if rank is not None or candidates is None else min(size, candidates)
            for level in range(seen):
                self._at_risk[level] += 1.0
        self.samples += 1

    def curve(self) -> tuple[float, ...]:
        points, missed = [], 1.0
        for level in range(len(self._at_risk)):
            at_risk = self._at_risk[level] + self._prior_at_risk[level]
            events = self._events[level] + self._prior_events[level]
            missed *= 1.0 - (events / at_risk if at_risk > 0.0 else 0.0)
            points.append(1.0 - missed)
        return tuple(points)


class CandidateRanks:
    """Online c_bonus(f) and c_corr(f), f = 1..max_fanout, from where the target's token ranked
    among the draft's candidates: `update(bonus, rank, candidates)` once per round that drafted
    ahead. Each curve is a discounted (`decay` per update of that curve) estimate under
    `strength` pseudo-observations drawn from its prior curve (the pool's, or the measured
    defaults). Implements :class:`Coverage`."""

    def __init__(
        self,
        max_fanout: int = DEFAULT_MAX_FANOUT,
        prior_bonus: Sequence[float] = DEFAULT_C_BONUS,
        prior_corr: Sequence[float] = DEFAULT_C_CORR,
        strength: float = 8.0,
        decay: float = 0.99,
    ) -> None:
        if max_fanout < 1:
            raise ValueError(f"max_fanout must be >= 1, got {max_fanout}")
        if strength <= 0.0:
            raise ValueError(f"strength must be > 0, got {strength}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.max_fanout = max_fanout
        self._bonus = _RankHazards(prior_bonus, max_fanout, strength, decay)
        self._corr = _RankHazards(prior_corr, max_fanout, strength, decay)

    def update(self, bonus: bool, rank: int | None, candidates: int | None = None) -> None:
        """One outcome: `bonus` (all K accepted: the target's token is the bonus) or a correction;
        `rank` the 1-based rank of the target's token among the candidates the draft returned for
        that position (for a correction, the rejected draft excluded), None if not among them;
        `candidates` how many it returned (None: max_fanout or more)."""
        (self._bonus if bonus else self._corr).update(rank, candidates)

    def c_bonus(self, fanout: int) -> float:
        return _curve_at(self._bonus.curve(), fanout)

    def c_corr(self, fanout: int) -> float:
        return _curve_at(self._corr.curve(), fanout)

    def curves(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(c_bonus(1..F), c_corr(1..F))."""
        return self._bonus.curve(), self._corr.curve()

    @property
    def bonus_samples(self) -> int:
        return self._bonus.samples

    @property
    def corr_samples(self) -> int:
        return self._corr.samples


class RankTally:
    """Drafted-ahead outcomes counted as they came, no prior and no decay: how many, and how many
    had the target's token within the draft's first f candidates (f = 1..F), bonus and correction
    apart. hopeful() turns them into coverage curves as if `hoped` more outcomes had come, every
    one a hit: every round a hit before any outcome (what drafting ahead earns at best, whatever
    the ranks turn out to be), the counts themselves in the long run."""

    def __init__(self, max_fanout: int) -> None:
        self.outcomes = 0
        self._seen = {True: 0, False: 0}  # by bonus
        self._hits = {True: [0] * max_fanout, False: [0] * max_fanout}  # [f - 1]: rank <= f

    def add(self, bonus: bool, rank: int | None) -> None:
        self.outcomes += 1
        self._seen[bonus] += 1
        hits = self._hits[bonus]
        if rank is not None:
            for index in range(max(0, rank - 1), len(hits)):
                hits[index] += 1

    def hopeful(self, hoped: float) -> FixedCoverage:
        """The counted hit rates with `hoped` more outcomes, every one a hit."""
        return self.shrunk(EVERY_ROUND_A_HIT, hoped)

    def shrunk(self, prior: FixedCoverage, strength: float) -> FixedCoverage:
        """The counted hit rates, each curve pulled towards the prior's by `strength`
        pseudo-outcomes (a curve with no outcomes yet is the prior's)."""
        def curve(bonus: bool) -> tuple[float, ...]:
            seen = self._seen[bonus]
            prior_at = prior.c_bonus if bonus else prior.c_corr
            return tuple((hit + strength * prior_at(f)) / (seen + strength)
                         for f, hit in enumerate(self._hits[bonus], start=1))

        return FixedCoverage(curve(True), curve(False))


class BranchCost:
    """T_branch(rows, passes) = passes (t0 + t1 (rows - 1)), fitted to the branch calls' reported
    compute per pass by discounted ridge least squares: t0 pulled towards t_draft (a pass of one
    row is a Propose's pass), t1 >= 0 towards `prior_t1` (None: slope_ratio t_draft). The prior is
    applied when predicting, with the t_draft of the moment, so a fit from one row count keeps
    t0 near t_draft and puts the rest in t1. Each sample is the longer of the draft's compute and
    the client's wait from the proposal to the branches. Also the hop of a branch call of its own
    (its round trip up to its proposal), an EWMA. Implements :class:`BranchTime`."""

    def __init__(
        self,
        prior_strength: float = 2.0,
        decay: float = 0.98,
        slope_ratio: float = 0.25,
        prior_t1: float | None = None,
        prior_hop: float | None = None,
        hop_weight: float = 0.1,
        prior_hop_samples: float = 1.0,
    ) -> None:
        if prior_strength <= 0.0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if slope_ratio < 0.0 or (prior_t1 is not None and prior_t1 < 0.0):
            raise ValueError("the prior slope must be >= 0")
        self._strength = prior_strength
        self._decay = decay
        self._slope_ratio = slope_ratio
        self._prior_t1 = prior_t1
        self._hop = RunningEstimate.seeded(hop_weight, prior_hop, prior_hop_samples)
        self._last_seconds = RunningEstimate(hop_weight)
        # Discounted sums over samples of per-pass seconds y at x = rows - 1: w, wx, wx^2, wy, wxy.
        self._sw = self._sx = self._sxx = self._sy = self._sxy = 0.0
        self.samples = 0

    def observe(self, compute_seconds: float, passes: int, rows_per_pass: int,
                after_proposal_seconds: float | None = None, hop_seconds: float | None = None) -> None:
        """One branch call: its server compute over `passes` passes of `rows_per_pass` rows;
        after_proposal_seconds, if given, the time from the proposal's arrival to the branches' at
        the client, which is what the loop waits for and what the fit takes when it is the longer
        (it adds the draft's scheduling of one job per branch and their transfer, which grow with
        the branches, to its compute); hop_seconds, if given, the round trip of a call of their
        own up to its proposal (after a hit)."""
        if passes < 1 or rows_per_pass < 1:
            raise ValueError(f"passes and rows_per_pass must be >= 1, got {passes}, {rows_per_pass}")
        if compute_seconds < 0.0:
            raise ValueError(f"compute_seconds must be >= 0, got {compute_seconds}")
        seconds = compute_seconds if after_proposal_seconds is None else max(compute_seconds, after_proposal_seconds)
        per_pass, x = seconds / passes, float(rows_per_pass - 1)
        keep = self._decay
        self._sw = self._sw * keep + 1.0
        self._sx = self._sx * keep + x
        self._sxx = self._sxx * keep + x * x
        self._sy = self._sy * keep + per_pass
        self._sxy = self._sxy * keep + x * per_pass
        self.samples += 1
        self._last_seconds.update(seconds, self.samples)
        if hop_seconds is not None:
            self._hop.update(max(0.0, hop_seconds), self.samples)

    def coefficients(self, t_draft: float) -> tuple[float, float]:
        """(t0, t1), both >= 0, given the current t_draft as t0's prior."""
        p0 = max(0.0, t_draft)
        p1 = self._prior_t1 if self._prior_t1 is not None else self._slope_ratio * p0
        ridge = self._strength  # in samples, at x = 1 for the slope: data at x >= 1 soon outweigh it
        # Normal equations [[sw + s, sx], [sx, sxx + s]] [t0, t1] = [sy + s p0, sxy + s p1].
        m11, m12, m22 = self._sw + ridge, self._sx, self._sxx + ridge
        y1, y2 = self._sy + ridge * p0, self._sxy + ridge * p1
        det = m11 * m22 - m12 * m12
        t0, t1 = (y1 * m22 - m12 * y2) / det, (m11 * y2 - m12 * y1) / det
        if t1 < 0.0:  # more rows are never cheaper
            return max(0.0, y1 / m11), 0.0
        if t0 < 0.0:
            return 0.0, max(0.0, y2 / m22)
        return t0, t1

    def seconds(self, rows_per_pass: int, passes: int, t_draft: float) -> float:
        t0, t1 = self.coefficients(t_draft)
        return passes * (t0 + t1 * max(0, rows_per_pass - 1))

    def hop_seconds(self, default: float) -> float:
        return default if self._hop.value is None else self._hop.value

    @property
    def measured_hop(self) -> float | None:
        return self._hop.value if self._hop.session_samples > 0 else None

    @property
    def measured_seconds(self) -> float | None:
        """EWMA of the branch calls' seconds as fitted (compute, or the longer wait after the
        proposal), None before any."""
        return self._last_seconds.value


class VerifySlowdown:
    """s >= 1: how much longer the target's pass takes while the draft drafts ahead (draft and
    target on the same cores), as the ratio of two EWMAs of verify compute / the verify fit's
    prediction, in pipelined rounds over plain ones (each seeded: `prior` and 1). Taking the ratio
    makes it right whether or not the fit was fed the slowed passes. Clipped to [1, max_slowdown]."""

    def __init__(self, weight: float = 0.1, max_slowdown: float = 3.0, prior: float = 1.0,
                 prior_samples: float = 1.0) -> None:
        if max_slowdown < 1.0:
            raise ValueError(f"max_slowdown must be >= 1, got {max_slowdown}")
        self._max = max_slowdown
        self._pipelined = RunningEstimate.seeded(weight, prior, prior_samples)
        self._plain = RunningEstimate.seeded(weight, 1.0, prior_samples)

    def observe(self, pipelined: bool, compute_seconds: float, predicted_seconds: float) -> None:
        if predicted_seconds <= 0.0 or compute_seconds < 0.0:
            return  # no prediction yet: nothing to compare with
        estimate = self._pipelined if pipelined else self._plain
        # Each kind forgets by its own samples: plain rounds are rare while pipelining (refreshes),
        # and one of them should not replace the baseline.
        estimate.update(compute_seconds / predicted_seconds, estimate.session_samples + 1)

    @property
    def value(self) -> float:
        pipelined, plain = self._pipelined.value, self._plain.value
        if pipelined is None or plain is None or plain <= 0.0:
            return 1.0
        return min(self._max, max(1.0, pipelined / plain))

    @property
    def pipelined_samples(self) -> int:
        return self._pipelined.session_samples

    def plain_seconds(self, compute_seconds: float, pipelined: bool) -> float:
        """A verify pass's time as it would have been without drafting ahead (for the verify fit)."""
        return compute_seconds / self.value if pipelined else compute_seconds


# ---------------------------------------------------------------------------------------------
# Probes


class ProbeSchedule:
    """When a round that would not draft ahead runs one at fan-out 1 instead (a probe), to measure
    what the estimates that turned pipelining off only guessed: after `interval` such plain
    rounds, an interval that doubles (up to `max_interval`) while probes leave pipelining off and
    starts over when one turns it on or a round drafts ahead by decision. Shared by a pool's
    sessions (:meth:`PipelinePriors.probes`), it counts the plain rounds of all of them: sessions
    shorter than the interval, which start from the pool's estimates, still get probes.
    Thread-safe."""

    def __init__(self, interval: int, max_interval: int) -> None:
        if interval < 0 or max_interval < interval:
            raise ValueError(f"need 0 <= interval <= max_interval, got {interval}, {max_interval}")
        self._base = self._interval = interval
        self._max = max_interval
        self._plain = 0
        self._lock = threading.Lock()

    def due(self) -> bool:
        """Called for a plain round that could draft ahead: whether it should probe instead."""
        with self._lock:
            if not self._interval:
                return False  # probes off
            if self._plain >= self._interval:
                self._plain = 0
                return True
            self._plain += 1
            return False

    def probed(self, turned_on: bool) -> None:
        """What the probe's estimates decided for the round after it."""
        with self._lock:
            self._interval = self._base if turned_on else min(self._max, 2 * self._interval)

    def drafting_ahead(self) -> None:
        """A round drafts ahead by decision: the plain rounds start over."""
        with self._lock:
            self._plain = 0


# ---------------------------------------------------------------------------------------------
# Pool priors


@dataclass(frozen=True)
class PipelinePriorEstimates:
    """Figures a session's pipelining estimates start from; None where nothing is known."""

    c_bonus: tuple[float, ...] | None = None
    c_corr: tuple[float, ...] | None = None
    branch_t1: float | None = None  # seconds per extra row of a branch pass
    branch_hop: float | None = None  # a branch call's overhead beyond its compute
    verify_slowdown: float | None = None


def _blend(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


class PipelinePriors:
    """Pool-wide pipelining priors, an EWMA over the sessions' updates (as ControllerPriors).
    Thread-safe."""

    def __init__(self, weight: float = 0.05, initial: PipelinePriorEstimates | None = None) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self._weight = weight
        self._current = initial if initial is not None else PipelinePriorEstimates()
        self._lock = threading.Lock()
        self._probes: ProbeSchedule | None = None
        self._tally = RankTally(DEFAULT_MAX_FANOUT)  # drafted-ahead outcomes of the pool's sessions

    def add_outcome(self, bonus: bool = False, rank: int | None = None) -> None:
        """One drafted-ahead outcome of a session (as CandidateRanks.update)."""
        with self._lock:
            self._tally.add(bonus, rank)

    @property
    def outcomes(self) -> int:
        """Drafted-ahead outcomes (candidate ranks) the pool's sessions have observed."""
        with self._lock:
            return self._tally.outcomes

    def hopeful_coverage(self, hoped: float) -> FixedCoverage:
        """RankTally.hopeful over the pool's outcomes."""
        with self._lock:
            return self._tally.hopeful(hoped)

    def counted_coverage(self, prior: FixedCoverage, strength: float) -> FixedCoverage:
        """RankTally.shrunk over the pool's outcomes."""
        with self._lock:
            return self._tally.shrunk(prior, strength)

    def probes(self, interval: int, max_interval: int) -> ProbeSchedule:
        """The pool's probe schedule (made with the first caller's intervals)."""
        with self._lock:
            if self._probes is None:
                self._probes = ProbeSchedule(interval, max_interval)
            return self._probes

    def snapshot(self) -> PipelinePriorEstimates:
        with self._lock:
            return self._current

    def update(self, session: PipelinePriorEstimates) -> None:
        """Blend in one session's estimates (None fields leave the prior alone); curves point by
        point."""
        with self._lock:
            changes: dict[str, object] = {}
            for field in fields(PipelinePriorEstimates):
                new = getattr(session, field.name)
                if new is None:
                    continue
                old = getattr(self._current, field.name)
                if isinstance(new, tuple):
                    before = old or ()
                    changes[field.name] = tuple(
                        _blend(before[i] if i < len(before) else None, value, self._weight)
                        for i, value in enumerate(new)
                    ) + tuple(before[len(new):])
                else:
                    changes[field.name] = _blend(old, new, self._weight)
            self._current = replace(self._current, **changes)


# ---------------------------------------------------------------------------------------------
# The controller


@dataclass(frozen=True)
class PipelineConfig:
    """Settings of :class:`PipelineController`."""

    max_fanout: int = DEFAULT_MAX_FANOUT  # F: the largest fan-out, and the candidates tracked
    margin: float = 0.03  # f > 0 only if it beats the best plain round by this fraction (to turn
    # on; once on, leaving takes the plain round to be `hysteresis` better)
    fanout_tolerance: float = 0.01  # the smallest f within this fraction of the best f's time
    hysteresis: float = 0.03  # leave the current (K, f) only for this fraction better
    miss_branch_hop: float = 0.0  # the branches' wait beyond the proposal on a miss (streamed: 0)
    prior_c_bonus: tuple[float, ...] = DEFAULT_C_BONUS
    prior_c_corr: tuple[float, ...] = DEFAULT_C_CORR
    coverage_strength: float = 8.0  # pseudo-observations behind the prior curves
    coverage_decay: float = 0.99  # fraction of the rank counts kept per update
    branch_prior_strength: float = 2.0  # samples' worth of pull towards (t_draft, prior slope)
    branch_decay: float = 0.98  # fraction of the branch fit's weight kept per sample
    branch_slope_ratio: float = 0.25  # t1 / t_draft before measurement (a CPU-ish guess)
    timing_weight: float = 0.1  # EWMA weight of hop, slowdown and hit-rate samples
    max_verify_slowdown: float = 3.0
    # While pipelining, one plain round after this many pipelined ones, so that the verify
    # slowdown keeps a fresh baseline (0: never).
    refresh_interval_rounds: int = 64
    # While not pipelining (K >= 1), a round at fan-out 1 after this many plain ones (counted over
    # the pool's sessions when the controller has pool priors: ProbeSchedule), to measure the
    # ranks, the branch cost and the slowdown the priors guessed; the interval doubles (up to the
    # max) while probes leave pipelining off (0: never probe).
    probe_interval_rounds: int = 32
    probe_interval_max_rounds: int = 512
    # Drafted-ahead outcomes (pool-wide with priors) before the candidate ranks count as measured.
    # Until then decisions read the ranks at their most hopeful (RankTally.hopeful: the outcomes
    # so far as if the next `hoped_outcomes` were all hits; every round a hit before the first),
    # and the K controller prices K = 0 as a Verify round, not at its cheaper streamed pace: the
    # prior ranks (the default pair's) and a K = 0 measured by a few probes would rule drafting
    # ahead out against cheap stretches, and a draft much better than the default pair's would
    # never be found out (probes measure a rank a time). Where drafting ahead does not beat even
    # that, K = 0 still stretches (to its next probe). Not where it could not pay with the ranks
    # so hoped for (could_pay): a draft whose candidates keep missing is found out in a few rounds.
    measured_outcomes: int = 8
    hoped_outcomes: float = 4.0
    # Once they are measured, decisions read the pool's outcomes as counted, each curve pulled
    # towards the pool's prior curves by this many pseudo-outcomes (RankTally.shrunk), not a session's
    # CandidateRanks: outcomes measured beside stretches come one per probe, and a session's
    # curves, 8 pseudo-outcomes of the default pair's behind them, would keep a better draft's
    # ranks near the default pair's (and drafting ahead off) for dozens of probes.
    pool_rank_strength: float = 2.0
    # A session's own drafted-ahead rounds while the ranks are pending (its tests) before its K = 0
    # is priced at its streamed pace again, the ranks still read hopefully: a test that went well
    # goes on on its merits, one that did not stops. Without it one session could run a dozen
    # tests where its lagging alpha kept them hopeful, each a round in place of a cheap stretch.
    session_test_rounds: int = 4

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"PipelineConfig: {message}")

        check(self.max_fanout >= 1, f"max_fanout must be >= 1, got {self.max_fanout}")
        check(0.0 <= self.margin < 1.0, "margin must be in [0, 1)")
        check(self.fanout_tolerance >= 0.0, "fanout_tolerance must be >= 0")
        check(0.0 <= self.hysteresis < 1.0, "hysteresis must be in [0, 1)")
        check(self.miss_branch_hop >= 0.0, "miss_branch_hop must be >= 0")
        check(self.refresh_interval_rounds >= 0, "refresh_interval_rounds must be >= 0")
        check(self.probe_interval_rounds >= 0, "probe_interval_rounds must be >= 0")
        check(self.probe_interval_max_rounds >= self.probe_interval_rounds, "probe max < interval")
        check(self.measured_outcomes >= 0, "measured_outcomes must be >= 0")
        check(self.hoped_outcomes > 0.0, "hoped_outcomes must be > 0")
        check(self.session_test_rounds >= 0, "session_test_rounds must be >= 0")


class PipelineController:
    """(K, f) per round from one session's estimates; see the module docstring for the model and
    the intended calls. `priors`, if given, is shared by a pool's sessions: it seeds this session
    and receives its estimates after each observation."""

    def __init__(self, config: PipelineConfig | None = None, priors: PipelinePriors | None = None) -> None:
        self._config = cfg = config if config is not None else PipelineConfig()
        self._priors = priors
        seed = priors.snapshot() if priors is not None else PipelinePriorEstimates()
        prior = self._prior_coverage(seed)
        self.ranks = CandidateRanks(cfg.max_fanout, prior.bonus, prior.corr, cfg.coverage_strength,
                                    cfg.coverage_decay)
        self.branch_cost = BranchCost(cfg.branch_prior_strength, cfg.branch_decay, cfg.branch_slope_ratio,
                                      prior_t1=seed.branch_t1, prior_hop=seed.branch_hop,
                                      hop_weight=cfg.timing_weight)
        self.slowdown = VerifySlowdown(cfg.timing_weight, cfg.max_verify_slowdown,
                                       prior=seed.verify_slowdown if seed.verify_slowdown is not None else 1.0)
        self._observed_hits = RunningEstimate(cfg.timing_weight)
        self._choice: tuple[int, int] | None = None  # the decision, refresh and probe rounds apart
        self._returned = (0, 0)  # what choose() last returned
        self._last: tuple[float | Sequence[float], RoundCosts] | None = None
        self._rounds_in_mode = 0  # rounds since the last one of the other kind (plain / ahead)
        self._probes = (priors.probes(cfg.probe_interval_rounds, cfg.probe_interval_max_rounds)
                        if priors is not None
                        else ProbeSchedule(cfg.probe_interval_rounds, cfg.probe_interval_max_rounds))
        self._probing = False
        self._tally = RankTally(cfg.max_fanout)  # this session's drafted-ahead outcomes (its tests)

    @property
    def ranks_measured(self) -> bool:
        """Whether enough drafted-ahead outcomes were observed (by the pool, with priors) for the
        candidate ranks to stand on measurement rather than on the prior curves."""
        observed = self._priors.outcomes if self._priors is not None else self._tally.outcomes
        return observed >= self._config.measured_outcomes

    @property
    def tests_spent(self) -> bool:
        """Whether this session has run its share of drafted-ahead tests
        (PipelineConfig.session_test_rounds): its outcomes so far."""
        return self._tally.outcomes >= self._config.session_test_rounds

    # -- decisions -------------------------------------------------------------------------------

    def times(self, alpha: float | Sequence[float], costs: RoundCosts, max_num_speculative_tokens: int,
              max_fanout: int) -> list[list[float]]:
        """times[K][f] from the current estimates, the candidate ranks as decisions read them
        (_decided_coverage)."""
        max_fanout = max(0, min(max_fanout, self._config.max_fanout))
        return pipeline_times(alpha, costs, max(0, max_num_speculative_tokens), max_fanout,
                              self._decided_coverage(), self.branch_cost, self.slowdown.value,
                              miss_branch_hop=self._config.miss_branch_hop)

    def _decided_coverage(self) -> Coverage:
        """The candidate ranks decisions read: measured (CandidateRanks) once ranks_measured; until
        then the drafted-ahead outcomes so far at their most hopeful (RankTally.hopeful, the
        pool's with priors): every round a hit before the first outcome, so that drafting ahead
        is tried wherever it could pay, less so with every outcome that misses. Prior ranks (the
        default pair's, or a pool's that drafted ahead a few times) would rule drafting ahead
        out for a much better draft, which would then never be measured."""
        if not self.ranks_measured:
            return self._hopeful_coverage()
        if self._priors is not None:
            prior = self._prior_coverage(self._priors.snapshot())
            return self._priors.counted_coverage(prior, self._config.pool_rank_strength)
        return self.ranks

    def _prior_coverage(self, seed: PipelinePriorEstimates) -> FixedCoverage:
        """The candidate ranks' prior curves: the pool's, else the configured defaults."""
        cfg = self._config
        return FixedCoverage(seed.c_bonus if seed.c_bonus is not None else cfg.prior_c_bonus,
                             seed.c_corr if seed.c_corr is not None else cfg.prior_c_corr)

    def _hopeful_coverage(self) -> Coverage:
        """RankTally.hopeful over the pool's outcomes (this session's without priors)."""
        if self._priors is not None:
            return self._priors.hopeful_coverage(self._config.hoped_outcomes)
        return self._tally.hopeful(self._config.hoped_outcomes)

    def choose(self, alpha: float | Sequence[float], costs: RoundCosts, max_num_speculative_tokens: int,
               max_fanout: int) -> tuple[int, int]:
        """(K, f) for the next round, K in 0..max_k, f in 0..max_fanout (0 when K = 0). Call once
        per round: it also schedules the refresh and probe rounds."""
        cfg = self._config
        best = self._best(alpha, costs, max_num_speculative_tokens, max_fanout)
        if self._probing:  # the probe round just run: did it turn pipelining on?
            self._probing = False
            self._probes.probed(turned_on=best[1] > 0)
        self._choice = best
        self._last = (alpha, costs)
        num, fanout = best
        ahead = fanout > 0
        if ahead:
            self._probes.drafting_ahead()
        if ahead and cfg.refresh_interval_rounds and self._rounds_in_mode >= cfg.refresh_interval_rounds:
            fanout, ahead = 0, False  # a refresh: one plain round
        elif not ahead and num >= 1 and max_fanout >= 1 and self._probes.due():
            fanout, ahead, self._probing = 1, True, True  # a probe: one round at fan-out 1
        was_ahead = self._returned[1] > 0
        self._rounds_in_mode = self._rounds_in_mode + 1 if ahead == was_ahead else 1
        self._returned = (num, fanout)
        return self._returned

    def drafts_ahead(self, alpha: float | Sequence[float], costs: RoundCosts, max_num_speculative_tokens: int,
                     max_fanout: int) -> bool:
        """Whether choose() would now pick a fan-out above 0, with its hysteresis; nothing is
        scheduled (the K controller asks before committing to K = 0 rounds decoded in one call)."""
        return self._best(alpha, costs, max_num_speculative_tokens, max_fanout)[1] > 0

    def could_pay(self, alpha: float | Sequence[float], costs: RoundCosts, max_num_speculative_tokens: int,
                  max_fanout: int) -> bool:
        """Whether some K drafted ahead would beat the best plain round (by the margin) with the
        candidate ranks at their most hopeful (RankTally.hopeful over the pool's outcomes, or
        this session's without priors: every round a hit before any drafted-ahead outcome, the
        outcomes' own hit rates ever more as they come in) and the verify not slowed by the
        branches: where it would not, measuring more ranks is not worth its rounds at these
        costs."""
        cfg = self._config
        max_fanout = max(0, min(max_fanout, cfg.max_fanout))
        times = pipeline_times(alpha, costs, max(0, max_num_speculative_tokens), max_fanout,
                               self._hopeful_coverage(), self.branch_cost, 1.0,
                               miss_branch_hop=cfg.miss_branch_hop)
        return choose_from_table(times, cfg.margin, cfg.fanout_tolerance)[1] > 0

    def _best(self, alpha: float | Sequence[float], costs: RoundCosts, max_num_speculative_tokens: int,
              max_fanout: int) -> tuple[int, int]:
        """The best (K, f), kept at the current choice unless another beats it by the hysteresis."""
        cfg = self._config
        times = self.times(alpha, costs, max_num_speculative_tokens, max_fanout)
        best = choose_from_table(times, cfg.margin, cfg.fanout_tolerance)
        current = self._choice
        if (current is not None and current != best and current[0] < len(times)
                and current[1] < len(times[0])
                and times[best[0]][best[1]] >= times[current[0]][current[1]] * (1.0 - cfg.hysteresis)):
            best = current
        return best

    # -- observations ----------------------------------------------------------------------------

    def observe_verify(self, pipelined: bool, compute_seconds: float, predicted_seconds: float) -> None:
        """A round's verify pass: its compute seconds and the verify fit's prediction for its rows
        (made without the slowdown); `pipelined` if the draft drafted ahead during it."""
        self.slowdown.observe(pipelined, compute_seconds, predicted_seconds)
        self._publish()

    def plain_verify_seconds(self, compute_seconds: float, pipelined: bool) -> float:
        """The verify time to feed the verify fit: a pipelined round's divided by the slowdown."""
        return self.slowdown.plain_seconds(compute_seconds, pipelined)

    def observe_branches(self, compute_seconds: float, passes: int, rows_per_pass: int,
                         after_proposal_seconds: float | None = None, hop_seconds: float | None = None) -> None:
        """A round's branches: the draft's compute for them, its passes and this session's rows per
        pass; after_proposal_seconds the client's wait for them from its proposal's arrival;
        hop_seconds the round trip of their own call up to its proposal (a branch call after a
        hit; None when they followed the round's own proposal). See BranchCost.observe."""
        self.branch_cost.observe(compute_seconds, passes, rows_per_pass, after_proposal_seconds, hop_seconds)
        self._publish()

    def observe_outcome(self, bonus: bool, rank: int | None, candidates: int | None = None,
                        fanout: int = 0) -> None:
        """A drafted-ahead round's outcome: `bonus` if all K drafts were accepted; `rank` the 1-based
        rank of the target's token among the draft's candidates for that position (the rejected
        draft excluded), None if not among them; `candidates` how many were returned; `fanout` the
        round's fan-out (a hit iff rank <= fanout)."""
        self.ranks.update(bonus, rank, candidates)
        self._tally.add(bonus, rank)
        if self._priors is not None:
            self._priors.add_outcome(bonus, rank)
        if fanout > 0:
            self._observed_hits.update(1.0 if rank is not None and rank <= fanout else 0.0,
                                       self.ranks.bonus_samples + self.ranks.corr_samples)
        self._publish()

    # -- reporting -------------------------------------------------------------------------------

    def estimates(self) -> dict[str, float]:
        """pipeline_fanout, pipeline_hit_rate (predicted at the current choice), verify_slowdown,
        pipeline_c_bonus / pipeline_c_corr (at the current fan-out, 1 when off; the candidate ranks
        as decisions read them, _decided_coverage) always;
        pipeline_observed_hit_rate, branch_seconds (predicted for the current K and fan-out, 1 when
        off), branch_t0 / branch_t1, branch_hop_seconds, branch_measured_seconds and
        pipeline_predicted_gain (plain / chosen seconds per token) once known."""
        num, fanout = self._returned
        shown = max(1, fanout)
        ranks = self._decided_coverage()
        figures: dict[str, float] = {
            "pipeline_fanout": float(fanout),
            "pipeline_hit_rate": 0.0,
            "verify_slowdown": self.slowdown.value,
            "pipeline_c_bonus": ranks.c_bonus(shown),
            "pipeline_c_corr": ranks.c_corr(shown),
        }
        if self._observed_hits.value is not None:
            figures["pipeline_observed_hit_rate"] = self._observed_hits.value
        if self.branch_cost.measured_seconds is not None:
            figures["branch_measured_seconds"] = self.branch_cost.measured_seconds
        if self._last is not None:
            alpha, costs = self._last
            figures["pipeline_hit_rate"] = hit_rate(alpha, num, fanout, ranks)
            figures["branch_t0"], figures["branch_t1"] = self.branch_cost.coefficients(costs.t_draft)
            figures["branch_hop_seconds"] = self.branch_cost.hop_seconds(costs.rtt_draft)
            if num > 0:
                shown_rows = branch_rows(num, shown)
                figures["branch_seconds"] = self.branch_cost.seconds(shown_rows, branch_passes(num), costs.t_draft)
                plain = seconds_per_token(alpha, num, costs)
                chosen = pipeline_seconds_per_token(alpha, num, fanout, costs, ranks, self.branch_cost,
                                                    self.slowdown.value,
                                                    miss_branch_hop=self._config.miss_branch_hop)
                if math.isfinite(plain) and math.isfinite(chosen) and chosen > 0.0:
                    figures["pipeline_predicted_gain"] = plain / chosen
        return figures

    def session_estimates(self) -> PipelinePriorEstimates:
        """This session's own figures for the pool (None where it has measured nothing)."""
        bonus, corr = self.ranks.curves()
        t1 = None
        if self.branch_cost.samples > 0 and self._last is not None:
            t1 = self.branch_cost.coefficients(self._last[1].t_draft)[1]
        return PipelinePriorEstimates(
            c_bonus=bonus if self.ranks.bonus_samples > 0 else None,
            c_corr=corr if self.ranks.corr_samples > 0 else None,
            branch_t1=t1,
            branch_hop=self.branch_cost.measured_hop,
            verify_slowdown=self.slowdown.value if self.slowdown.pipelined_samples > 0 else None,
        )

    def _publish(self) -> None:
        if self._priors is not None:
            self._priors.update(self.session_estimates())
