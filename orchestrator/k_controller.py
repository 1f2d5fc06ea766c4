"""Choosing K, the number of draft tokens per round, from live measurements (docs/architecture.md,
"Choosing K").

Terms (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
arXiv 2211.17192, section 3; their gamma is our K):

- K (``num_speculative_tokens``): draft tokens proposed in a round. K = 0 is plain decoding on the
  target: one Verify of one row, no draft call; or, while the controller's choice is K = 0, its
  rounds up to the next probe decoded in one streamed call (``plain_rounds``; priced by
  ``RoundCosts.plain_factor``).
- alpha: the probability that the target accepts a draft token, taken as the same at every
  position (per-position alpha_i are accepted by :func:`expected_committed_tokens`).
- E(K): expected committed tokens per round, accepted drafts plus the one token the target always
  adds (correction or bonus): sum_{i=0..K} alpha^i = (1 - alpha^(K+1)) / (1 - alpha).
- t_draft: seconds per drafted token, i.e. per draft forward pass (a Propose of K makes K passes).
- t_feed: seconds per extra committed token the draft must feed in one pass to catch up after
  K = 0 rounds, during which it was not called.
- T_pass(R): seconds of one target forward pass over R rows, all sessions batched into it
  together (this session's K + 1 and R_others of the others), fitted as a + b * R plus, while
  the session runs alone, each row count's measured residual from that line (CPU costs step at
  kernel block sizes).
- n: sessions in the verify pass, this one included; R_others: the rows the other n - 1 put in it.
  Both are running means of what the target reports (0 reported: alone, n = 1, R_others = 0).
- RTT_draft, RTT_target: per-hop network and RPC overhead, client wall time minus server time.
- T_round(K) = K t_draft + RTT_draft [K > 0] + T_pass(R_others + K + 1) + RTT_target
  (+ catch-up).

The marginal cost of rows. When the target batches the Verify calls of n sessions into one pass,
this session's K + 1 rows lengthen the pass every other session waits for. Relative to K = 0 the
extra rows cost each of the other n - 1 sessions

    dT(K) = T_pass(R_others + K + 1) - T_pass(R_others + 1)

per pass, and a session committing r tokens per second loses r dT(K) tokens to it. This session
joins one pass per round, so per second of its time it commits E(K) / T_round(K) and costs the
others (n - 1) r dT(K) / T_round(K). The system's goodput from choosing K is

    G(K) = (E(K) - (n - 1) r dT(K)) / T_round(K)

and the controller picks K* = argmax G(K), i.e. argmin of T_round(K) / (E(K) - (n - 1) r dT(K)),
the seconds of its round per token the system gains (infinite when the round loses more than it
commits). The others are taken as like this session (its alpha, draft and hop times) at the mean
K their rows show, K_o = R_others / (n - 1) - 1, waiting for the same pass:
r = E(K_o) / (K_o t_draft + RTT_draft min(1, K_o) + T_pass(R_others + K_current + 1) + RTT_target),
which is E(K_current) / T_round(K_current) when they run this session's K. (Taking their K to be
this session's own would make r, and so the choice, depend on the K being left: near the break
even point a session at K = 1 charged itself less than one at K = 0 and stayed there.)

With n = 1 the penalty is zero and this is exactly argmin T_round(K) / E(K), expected seconds per
committed token. As n grows the penalty grows; when every row is paid for in full (T_pass ~ b R,
so with the others at this session's K, (n - 1) r dT(K) ~ K E(K_current) / (K_current + 1)), each
draft token costs the others about E(K_current) / (K_current + 1), the mean tokens per row, while
the K-th one wins alpha^K, less than that mean at K = K_current; so under saturation K steps down
to 0. There is nothing to tune: n, R_others and the slope b are measured.

The controller switches only when the new K beats the current one by a margin (hysteresis). While
K = 0 alpha is not observed, so it probes with a small K on a schedule that backs off while probes
keep losing (the probes are also how K comes back when the load drops and alpha is stale). A
session that can probe in the shadow (``shadow_probes``: a model draft) runs a due probe beside
its next stretch instead of as a round: the draft proposes from where the stretch starts while the
target decodes it. Under greedy decoding the drafts that match the target's tokens are exactly
what a Verify would have accepted; under sampling each decoded token y, up to the first draft it
differs from, tells min(1, q~(y) / p(y)) with p(y) from the target's Decode, an unbiased estimate
of the acceptance sum(min(p, q~)) there. So alpha is measured without a round of drafting, and
without interrupting the stretch (``shadow_probe`` / ``observe_shadow``). Such probes back off as
probe rounds do only where the draft computes on the target's hardware (``shadow_probes_contend``):
there they take the stretch's cores. Where the draft has hardware of its own they cost the stretch
nothing, and they keep the base interval, so that alpha is measured along the whole answer, each
probe's position drawn around its interval (``probe_rng``) so that the probes of different
answers do not all fall on the same positions. Two kinds of optimism keep it measuring what it
cannot see: K = 0 is chosen only if it also wins at an alpha one
posterior sd higher (at K = 0 alpha is no longer observed; not where drafting at the estimate
loses more than optimism_max_loss per token: the probes explore there; nor with shadow probes,
which observe alpha at K = 0 at no round's cost), and row counts
little measured are taken as a little cheaper than predicted, so that a K whose cost the line misjudges
gets tried once. Once others share the pass (R_others rounds to 1 or more) the prediction is the line
alone, without per-row residuals or that optimism: the others' rows move the pass across the
kernel steps from round to round, so a row count's residual there is mostly noise, and a
discount of a whole shared pass would dwarf the few milliseconds the session's own rows add. A
session that starts from pool-wide priors (ControllerPriors) takes their timings and verify shape
firmly but their alpha as 4 pseudo-trials (acceptance is a property of the prompt), and when the
pool's alpha alone puts it at K = 0 it opens with a probe. The cost model is pure functions; the
estimators live in orchestrator/k_estimates.py.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from orchestrator.k_estimates import (
    AcceptanceEstimate,
    ControllerPriors,
    PriorEstimates,
    RunningEstimate,
    VerifyFit,
)
from orchestrator.k_policy import DecodedPasses, RoundObservation
from orchestrator.pipelining import (
    NO_AHEAD,
    AheadObservation,
    AheadPlan,
    PipelinePolicy,
)
from specdec.chain_acceptance import expected_committed_tokens
from specdec.lookup_acceptance import LookupAcceptance, LookupPriors

if TYPE_CHECKING:
    from orchestrator.pipeline_policy import PipelineController, PipelinePriors

# The chance a looked-up token needs in a Decode pass before the pass's cost is measured: between
# the prices measured on a float32 CPU alone (0.04-0.06) and among 4-8 sessions (0.1-0.3).
UNPRICED_LOOKUP_CHANCE = 0.1

# ---------------------------------------------------------------------------------------------
# The cost model (pure)


def mean_committed_tokens(alpha: float | Sequence[float], num_speculative_tokens: float) -> float:
    """E at a K that need not be whole (a mean over sessions): linear between the whole K either
    side of it."""
    whole = math.floor(num_speculative_tokens)
    below = expected_committed_tokens(alpha, whole)
    if num_speculative_tokens == whole:
        return below
    above = expected_committed_tokens(alpha, whole + 1)
    return below + (num_speculative_tokens - whole) * (above - below)


@dataclass(frozen=True)
class LinearVerifyTime:
    """T_pass(rows) = verify_a + verify_b * rows, seconds."""

    verify_a: float
    verify_b: float

    def __call__(self, rows: int) -> float:
        return self.verify_a + self.verify_b * rows


@dataclass(frozen=True)
class RoundCosts:
    """Per-round cost figures in seconds; `verify_fn(rows)` gives T_pass, the target pass's time.

    The last three describe the other sessions batched into the same verify pass; all zero (the
    default) is a session alone.
    """

    t_draft: float
    verify_fn: Callable[[int], float]
    rtt_draft: float
    rtt_target: float
    catchup_seconds: float = 0.0  # draft catch-up owed from K = 0 rounds, paid by the next K > 0
    others_rows: int = 0  # R_others: rows the other sessions put in the verify pass
    others_sessions: float = 0.0  # n - 1: the other sessions in the verify pass
    others_tokens_per_second: float = 0.0  # r: what each of them commits per second
    # K = 0 rounds decoded in one streamed call (a Decode: no round trip between tokens, and no
    # draft pass between target passes): their measured time per token over that of the K = 0
    # round above (T_pass(R_others + 1) + RTT_target). None: K = 0 rounds are Verify rounds.
    plain_factor: float | None = None


def round_time(num_speculative_tokens: int, costs: RoundCosts) -> float:
    """T_round(K), seconds: the draft side and a verify pass of R_others + K + 1 rows (K = 0:
    times plain_factor where K = 0 rounds are decoded in one call)."""
    verify = costs.verify_fn(costs.others_rows + num_speculative_tokens + 1)
    if num_speculative_tokens == 0:
        plain = verify + costs.rtt_target
        return plain * costs.plain_factor if costs.plain_factor is not None else plain
    draft_side = num_speculative_tokens * costs.t_draft + costs.rtt_draft + costs.catchup_seconds
    return draft_side + verify + costs.rtt_target


def pass_delay(num_speculative_tokens: int, costs: RoundCosts) -> float:
    """dT(K) = T_pass(R_others + K + 1) - T_pass(R_others + 1) >= 0: how much longer this session's
    K drafts make the pass that every session in it waits for."""
    if num_speculative_tokens == 0:
        return 0.0
    base = costs.others_rows + 1
    return max(0.0, costs.verify_fn(base + num_speculative_tokens) - costs.verify_fn(base))


def others_lost_tokens(num_speculative_tokens: int, costs: RoundCosts) -> float:
    """(n - 1) r dT(K): tokens the other sessions in the pass lose per round of this one."""
    if costs.others_sessions <= 0.0 or costs.others_tokens_per_second <= 0.0:
        return 0.0
    delay = pass_delay(num_speculative_tokens, costs)
    return costs.others_sessions * costs.others_tokens_per_second * delay


def others_commit_rate(
    alpha: float | Sequence[float], num_speculative_tokens: int, costs: RoundCosts
) -> float:
    """r: tokens per second that each other session in the pass commits, while this one runs K.

    The others are taken as like this session (its alpha, draft and hop times) at the mean K
    their rows show, K_o = R_others / (n - 1) - 1, each waiting for the same pass of
    R_others + K + 1 rows: r = E(K_o) / (K_o t_draft + RTT_draft min(1, K_o) + T_pass + RTT_target).
    When they run this session's K, that is E(K) / T_round(K).
    """
    if costs.others_sessions <= 0.0:
        return 0.0
    others_k = max(0.0, costs.others_rows / costs.others_sessions - 1.0)
    their_round = (others_k * costs.t_draft + min(1.0, others_k) * costs.rtt_draft
                   + costs.verify_fn(costs.others_rows + num_speculative_tokens + 1) + costs.rtt_target)
    return mean_committed_tokens(alpha, others_k) / their_round


def session_rate(alpha: float | Sequence[float], num_speculative_tokens: int, costs: RoundCosts) -> float:
    """E(K) / T_round(K): this session's own committed tokens per second."""
    return expected_committed_tokens(alpha, num_speculative_tokens) / round_time(num_speculative_tokens, costs)


def goodput(alpha: float | Sequence[float], num_speculative_tokens: int, costs: RoundCosts) -> float:
    """G(K) = (E(K) - (n - 1) r dT(K)) / T_round(K): tokens per second the system gains from this
    session running K, its own minus what its rows cost the others (negative when they cost more)."""
    committed = expected_committed_tokens(alpha, num_speculative_tokens)
    lost = others_lost_tokens(num_speculative_tokens, costs)
    return (committed - lost) / round_time(num_speculative_tokens, costs)


def seconds_per_token(
    alpha: float | Sequence[float], num_speculative_tokens: int, costs: RoundCosts
) -> float:
    """T_round(K) / (E(K) - (n - 1) r dT(K)) = 1 / G(K): seconds of this session's round per token
    the system gains; T_round(K) / E(K) when alone. Infinite when G(K) <= 0."""
    committed = expected_committed_tokens(alpha, num_speculative_tokens)
    lost = others_lost_tokens(num_speculative_tokens, costs)
    if committed - lost <= 0.0:
        return math.inf
    return round_time(num_speculative_tokens, costs) / (committed - lost)


def best_k(alpha: float | Sequence[float], costs: RoundCosts, max_num_speculative_tokens: int) -> int:
    """K* = argmin over 0..max_num_speculative_tokens of seconds_per_token, i.e. argmax G(K); the
    smallest K on ties. Alone this is argmin T_round(K) / E(K)."""
    times = [seconds_per_token(alpha, num, costs) for num in range(max_num_speculative_tokens + 1)]
    return min(range(max_num_speculative_tokens + 1), key=times.__getitem__)


def speedup_bound(
    alpha: float | Sequence[float],
    t_step: float,
    t_draft: float,
    verify_fn: Callable[[int], float],
    rtt_draft: float,
    rtt_target: float,
    max_num_speculative_tokens: int,
) -> float:
    """Best achievable speedup over target-only decoding (T_step + RTT_target per token).

    max over K in 0..max_num_speculative_tokens of E(K) (T_step + RTT_target) / T_round(K). K = 0
    is included because
    the controller may choose it, so the bound is below 1 only when T_verify(1) > T_step.
    """
    costs = RoundCosts(t_draft, verify_fn, rtt_draft=rtt_draft, rtt_target=rtt_target)
    baseline = t_step + rtt_target
    candidates = range(max_num_speculative_tokens + 1)
    return max(baseline / seconds_per_token(alpha, num, costs) for num in candidates)


# ---------------------------------------------------------------------------------------------
# Policies

# A plain decoding pace outside this range of the predicted K = 0 round is taken as its bound (a
# stalled stream, or a first token that came at once, is not the pace of K = 0 rounds).
PLAIN_FACTOR_RANGE = (0.25, 4.0)
# K = 0 rounds between probes beside a stretch while they measure the pool's candidate ranks
# (pipelining auto, measures_beside): a rank each, PipelineConfig.measured_outcomes of them
# within the first request or two.
RANK_PROBE_INTERVAL = 8


@dataclass(frozen=True)
class KControllerConfig:
    """Settings of :class:`AdaptiveKController`. Weights are per round; times in seconds."""

    max_num_speculative_tokens: int = 8  # largest K considered
    initial_num_speculative_tokens: int = 4  # K until the cost model has its figures
    hysteresis: float = 0.03  # switch K only when seconds per token improve by this fraction
    probe_num_speculative_tokens: int = 2  # K of a probe round while the chosen K is 0
    probe_interval_rounds: int = 16  # K = 0 rounds before the first probe
    probe_interval_max_rounds: int = 512  # ceiling of the backed-off interval
    probe_backoff: float = 2.0  # interval multiplier after a probe that leaves K at 0
    shadow_probe_num_speculative_tokens: int = 4  # K of a probe run beside a stretch (shadow_probes):
    # no round waits for it, so it measures more positions than a probe round's
    shadow_probe_jitter: float = 0.5  # with a probe_rng: each stretch to a probe beside it is its
    # interval times a factor drawn from [1 - this, 1 + this], so that the probes do not fall at
    # the same positions of every answer
    prior_alpha: float = 0.6  # alpha before any measurement, when the pool has none
    prior_alpha_strength: float = 4.0  # pseudo-trials behind the prior alpha
    pool_alpha_strength: float = 4.0  # pseudo-trials behind the pool's alpha when a session starts
    # from it. Acceptance differs between prompts far more than timings do, but not without bound:
    # the default pair's per-prompt alpha spreads by ~0.13 around 0.42 (bench_pair, K = 4), which a
    # Beta prior of ~10 pseudo-trials expresses; 4 also lets alpha drift within one answer. At 1,
    # one fully accepted round of K = 3 put a new session's alpha near 0.9 and K at 8
    zero_k_optimism: float = 1.0  # K = 0 only if it also wins at alpha + this many posterior sd:
    # K = 0 stops measuring alpha, so leaving drafting on a few unlucky rounds is the costly mistake
    optimism_max_loss: float = 0.2  # ... but only while drafting at the estimate costs at most this
    # fraction more per token than K = 0: the optimism is exploration paid for in rounds drafted at
    # a loss, and where each such round loses more (a hop dearer than the target's pass), the
    # probes measure acceptance more cheaply
    acceptance_decay: float = 0.99  # fraction of acceptance counts kept per round
    timing_weight: float = 0.1  # EWMA weight of a new t_draft / t_feed / RTT sample
    prior_timing_samples: float = 1.0  # pseudo-samples behind a pool prior's timing figure
    verify_decay: float = 0.98  # fraction of the verify fit's old weight kept per round
    verify_prior_strength: float = 2.0  # rounds' worth of ridge pull towards the verify prior
    verify_prior_slope_ratio: float = 0.05  # b / a when the first Verify sets the prior
    verify_row_shrink: float = 1.0  # rounds' worth of pull of a row count's residual to zero
    verify_row_decay: float = 0.998  # fraction of a row count's residual weight kept per round
    verify_optimism: float = 0.15  # a row count measured w (discounted) times is taken to cost
    # 1 - this / sqrt(1 + w) of its prediction when choosing K: a line through the row counts in
    # use cannot see a step elsewhere (CPU kernel blocking), so K values not measured lately get
    # tried now and then, and one measurement mostly settles them

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"KControllerConfig: {message}")

        limit = self.max_num_speculative_tokens
        check(limit >= 1, f"max_num_speculative_tokens must be >= 1, got {limit}")
        initial = self.initial_num_speculative_tokens
        check(0 <= initial <= limit, f"initial K must be in [0, max_num_speculative_tokens], got {initial}")
        check(0.0 <= self.hysteresis < 1.0, f"hysteresis must be in [0, 1), got {self.hysteresis}")
        check(1 <= self.probe_num_speculative_tokens <= limit, "probe K must be in [1, max_num_speculative_tokens]")
        check(1 <= self.shadow_probe_num_speculative_tokens <= limit,
              "shadow probe K must be in [1, max_num_speculative_tokens]")
        check(self.probe_interval_rounds >= 1, "probe_interval_rounds must be >= 1")
        check(self.probe_interval_max_rounds >= self.probe_interval_rounds, "probe max < interval")
        check(self.probe_backoff >= 1.0, f"probe_backoff must be >= 1, got {self.probe_backoff}")
        check(0.0 <= self.shadow_probe_jitter < 1.0, "shadow_probe_jitter must be in [0, 1)")
        check(0.0 < self.prior_alpha < 1.0, f"prior_alpha must be in (0, 1): {self.prior_alpha}")
        check(self.prior_alpha_strength >= 0.0, "prior_alpha_strength must be >= 0")
        check(self.pool_alpha_strength >= 0.0, "pool_alpha_strength must be >= 0")
        check(self.zero_k_optimism >= 0.0, "zero_k_optimism must be >= 0")
        check(self.optimism_max_loss >= 0.0, "optimism_max_loss must be >= 0")
        check(0.0 < self.acceptance_decay <= 1.0, "acceptance_decay must be in (0, 1]")
        check(0.0 < self.timing_weight <= 1.0, "timing_weight must be in (0, 1]")
        check(self.prior_timing_samples >= 0.0, "prior_timing_samples must be >= 0")
        check(0.0 < self.verify_decay <= 1.0, "verify_decay must be in (0, 1]")
        check(self.verify_prior_strength > 0.0, "verify_prior_strength must be > 0")
        check(self.verify_prior_slope_ratio >= 0.0, "verify_prior_slope_ratio must be >= 0")
        check(self.verify_row_shrink > 0.0, "verify_row_shrink must be > 0")
        check(0.0 < self.verify_row_decay <= 1.0, "verify_row_decay must be in (0, 1]")
        check(0.0 <= self.verify_optimism < 1.0, "verify_optimism must be in [0, 1)")


class AdaptiveKController:
    """K* = argmax G(K) from one session's online estimates (see module docstring); alone, that is
    argmin T_round(K) / E(K).

    One instance per session; `priors`, if given, is shared by the sessions of a pool: it seeds
    this session's estimates and receives them after every round. shadow_probes: the session can
    probe beside a stretch (a model draft; see the module docstring). ranks_beside: those probes
    can also measure the draft's candidate ranks for pipelining auto (greedy: the stretch's tokens
    are what a Verify would commit; measures_beside). shadow_probes_contend: the draft
    computes on the target's hardware, so those probes take the stretch's cores and back off as
    probe rounds do; otherwise they keep the base interval (see the module docstring).
    probe_rng: where given, draws where each probe beside a stretch falls (shadow_probe_jitter);
    without it they fall every interval exactly.
    """

    def __init__(
        self, config: KControllerConfig | None = None, priors: ControllerPriors | None = None,
        lookup_priors: LookupPriors | None = None, shadow_probes: bool = False, ranks_beside: bool = False,
        shadow_probes_contend: bool = True, probe_rng: random.Random | None = None,
    ) -> None:
        self._config = config if config is not None else KControllerConfig()
        self._shadow_probes = shadow_probes
        self._shadow_probes_contend = shadow_probes_contend
        self._probe_rng = probe_rng
        self._ranks_beside = shadow_probes and ranks_beside
        self._shadow_num_speculative_tokens = 0  # a probe taken beside the coming stretch, not yet run
        self._shadow_fanout = 0  # its fan-out: > 0 where it drafts ahead to measure a rank
        self._beside = shadow_probes  # whether the caller can run probes beside its stretches (plain_rounds)
        self._priors = priors
        self._lookup_priors = lookup_priors
        self._lookups: LookupAcceptance | None = None  # made at the first lookup round
        cfg = self._config
        seed = priors.snapshot() if priors is not None else PriorEstimates()
        if seed.alpha is None:
            prior_alpha, strength = cfg.prior_alpha, cfg.prior_alpha_strength
        else:
            prior_alpha, strength = seed.alpha, cfg.pool_alpha_strength
            if seed.alpha_trials is not None:  # the pool's counts: pulled towards the default while few
                default = cfg.prior_alpha * cfg.prior_alpha_strength
                prior_alpha = (seed.alpha * seed.alpha_trials + default) / (seed.alpha_trials + cfg.prior_alpha_strength)
        self._alpha = AcceptanceEstimate(prior_alpha, strength, cfg.acceptance_decay)
        self._t_draft = self._timing_estimate(seed.t_draft_per_token)
        self._t_feed = self._timing_estimate(seed.t_feed_per_token)
        self._rtt_draft = self._timing_estimate(seed.rtt_draft)
        self._rtt_target = self._timing_estimate(seed.rtt_target)
        # K = 0 rounds decoded in one call (plain_rounds): their time per token over a K = 0 round's
        self._plain_factor = self._timing_estimate(seed.plain_factor)
        self._verify = VerifyFit(
            cfg.verify_prior_strength,
            cfg.verify_decay,
            cfg.verify_prior_slope_ratio,
            cfg.verify_row_shrink,
            cfg.verify_row_decay,
            prior_a=seed.verify_a,
            prior_b=seed.verify_b,
            prior_residuals=seed.verify_residuals or (),
        )
        # The verify pass's load: its rows and sessions, and the rows the other sessions add.
        self._pass_rows = RunningEstimate(cfg.timing_weight)
        self._pass_sessions = RunningEstimate(cfg.timing_weight)
        self._others_rows = RunningEstimate(cfg.timing_weight)
        self._round = 0
        self._ahead: PipelineController | None = None  # pipeline auto: drafting ahead, chosen with K
        self._max_fanout = 0
        self._planned_fanout = 0  # this round's fan-out, chosen in choose()
        self._planned_test = False  # whether drafting ahead this round is a test (_ranks_pending)
        self._num_speculative_tokens = cfg.initial_num_speculative_tokens
        self._pending_catchup_tokens = 0  # committed tokens the draft missed during K = 0 rounds
        self._rounds_since_probe = 0
        self._probe_interval = cfg.probe_interval_rounds
        self._probe_outstanding = False
        costs = self._costs()
        if costs is not None:  # the pool's figures are complete: start at their best K
            times = self._seconds_per_token_by_k(costs)
            self._num_speculative_tokens = min(range(len(times)), key=times.__getitem__)
            prior_best = best_k(cfg.prior_alpha, costs, cfg.max_num_speculative_tokens)
            if self._num_speculative_tokens == 0 and (prior_best > 0 or self._shadow_probes):
                # K = 0 because earlier prompts were accepted poorly, not because the timings
                # rule drafting out: this prompt's acceptance is unknown, so open with a probe
                # (with shadow probes at once whatever the reason: it costs no round).
                self._rounds_since_probe = self._probe_interval

    # -- KPolicy ---------------------------------------------------------------------------------

    def choose(self, max_num_speculative_tokens: int) -> int:
        num_speculative_tokens = self._choose(max_num_speculative_tokens)
        self._planned_test = self._planned_fanout > 0 and self._ranks_pending()
        return num_speculative_tokens

    def _choose(self, max_num_speculative_tokens: int) -> int:
        max_num_speculative_tokens = min(max_num_speculative_tokens, self._config.max_num_speculative_tokens)
        self._planned_fanout = 0
        num_speculative_tokens = self._choose_plain(max_num_speculative_tokens)
        if self._ahead is None or max_num_speculative_tokens <= 0:
            return num_speculative_tokens
        if self._probe_outstanding and self._ahead.ranks_measured and self._ahead_pays():
            # Drafting ahead is expected to pay from K = 0: its own round measures what the probe
            # would (alpha, and the candidate ranks), at the K and fan-out that pay.
            self._probe_outstanding = False
        if self._probe_outstanding:
            # A probe from K = 0 drafts ahead at fan-out 1: besides alpha it measures how often the
            # draft's candidates hold the target's token (all its candidates are ranked, whatever
            # the fan-out), which weighing drafting ahead against K = 0 needs; at K = 0 nothing
            # else measures it.
            self._planned_fanout = min(1, self._max_fanout)
            return num_speculative_tokens
        if num_speculative_tokens == 0 and self._plain_pace_unmeasured():
            return 0  # a stretch first (plain_rounds), its pace what drafting ahead is weighed against
        costs = self._costs()
        if costs is None:
            return num_speculative_tokens
        # Drafting ahead makes a hit round cheaper, so it may pay to draft more, or at all where
        # plain rounds would not: K and the fan-out together (orchestrator/pipeline_policy.py);
        # not pipelining, K stays the plain choice (with its probes while at 0).
        ahead_k, fanout = self._ahead.choose(self._alpha.alpha, costs, max_num_speculative_tokens, self._max_fanout)
        if ahead_k > 0 and fanout > 0:
            self._planned_fanout = fanout
            return ahead_k
        return num_speculative_tokens

    def plain_rounds(self, shadow: bool = False) -> int:
        """K = 0 rounds up to the next probe while the choice is K = 0 (PlainStretches): nothing
        else changes the choice without a round's measurements. 0 while drafting, with a probe
        due, or under pipelining auto when drafting ahead beats those rounds (it may pay where
        plain drafting does not; until its ranks are measured, at hopeful ranks against K = 0
        priced as Verify rounds, so that it is tried: _ranks_pending).
        shadow: the caller can run a probe beside the stretch; a probe due then does not end
        the stretch but is taken for it (shadow_probe() gives its K, shadow_probe_fanout whether
        it drafts ahead). Where it can, the pool's candidate ranks are measured by those probes
        (measures_beside) and drafting ahead waits for them, with K = 0 at its pace: each
        probe drafts ahead at fan-out 1 and its outcome's rank is read off the stretch's tokens
        (and goes on doing so once they are measured: they are what weighs drafting ahead against
        K = 0 while no round drafts ahead)."""
        self._shadow_num_speculative_tokens = self._shadow_fanout = 0
        self._beside = shadow
        if self._num_speculative_tokens != 0:
            return 0
        measuring = self.measures_beside()
        if self._drafts_ahead_from_k0(measuring):
            # Drafting ahead beats K = 0 (while the ranks are pending and no probe beside a stretch
            # can measure them, at hopeful ranks against K = 0 priced as Verify rounds, so that it
            # is tried; where even so it does not, K = 0 stretches to the next probe, which drafts
            # ahead and measures a rank).
            return 0
        interval = min(self._probe_interval, RANK_PROBE_INTERVAL) if measuring else self._probe_interval
        if shadow and self._shadows and self._rounds_since_probe >= interval:
            self._shadow_num_speculative_tokens = self._config.shadow_probe_num_speculative_tokens
            self._shadow_fanout = 1 if self._ahead is not None and self._ranks_beside else 0
            self._rounds_since_probe = self._probe_offset(interval)
        return max(0, interval - self._rounds_since_probe)

    def _probe_offset(self, interval: int) -> int:
        """Rounds counted towards the next probe as a probe beside a stretch is taken: 0, or with
        a probe_rng a draw within shadow_probe_jitter of the interval either way. The probe runs
        at its stretch's end, so at fixed intervals every answer would be probed at the same
        positions; an answer's opening tokens (and a text's periodic ones) are not accepted as
        its others are, and a pool that counts only those learns a skewed alpha (on the
        emulated pair every answer's probes fell on its 13th and 29th tokens, where 8 probes
        matched 3 drafts in all: a pool alpha of 0.25-0.4 for a draft that probes at every
        position would measure at 0.6)."""
        if self._probe_rng is None:
            return 0
        spread = int(interval * self._config.shadow_probe_jitter)
        # A stretch shorter than the probe's drafts (and the token after them, where it drafts
        # ahead) would test fewer of them, and give no rank: never drawn below that.
        longest = max(0, interval - (self._config.shadow_probe_num_speculative_tokens + 1))
        return self._probe_rng.randint(-spread, min(spread, longest))

    def would_draft(self) -> bool:
        """Whether this session, as its estimates stand, would draft now rather than stretch
        K = 0: its plain K, or under pipelining auto drafting ahead once a stretch's pace is
        measured (PlainStretches)."""
        return self._num_speculative_tokens > 0 or self._drafts_ahead_from_k0(self.measures_beside())

    def _drafts_ahead_from_k0(self, measuring: bool) -> bool:
        """Under pipelining auto at a plain K of 0, whether the next round drafts ahead rather
        than stretching K = 0: not while the ranks are measured beside the stretches (measuring:
        measures_beside) or a stretch's pace is unmeasured, and then where it pays."""
        return (self._ahead is not None and not measuring and not self._plain_pace_unmeasured()
                and self._ahead_pays())

    def measures_beside(self) -> bool:
        """Under pipelining auto, whether the pool's candidate ranks are still to be measured
        (PipelineConfig.measured_outcomes) and this session measures them beside its stretches:
        its probes there draft ahead (shadow_probe_fanout) and the stretch's tokens give each
        one's outcome and rank, as a drafted-ahead round would, without the round. Until then
        drafting ahead from K = 0 waits and K = 0 is priced at its pace (on the default pair at
        30 ms a fresh pool's drafted-ahead tests in place of stretches cost its first requests
        10-25 %). Greedy only: under sampling a round's correction is drawn from the residual and its
        bonus with the round's own uniform, which a stretch's tokens are not, so there (and
        without probes beside stretches) the ranks are measured by drafted-ahead rounds instead
        (_ranks_pending). Also PlainStretches': while it holds, pipelining auto's way choice runs
        the rounds (a stream would measure none of the ranks)."""
        return (self._ahead is not None and self._ranks_beside and self._beside
                and not self._ahead.ranks_measured)

    def _plain_pace_unmeasured(self) -> bool:
        """Under pipelining auto, whether neither this session nor its pool has measured a K = 0
        stretch's pace yet: then K = 0 comes first, stretched to the next probe, so that drafting
        ahead is weighed against the pace measured. Until then K = 0 is priced at a target pass
        per token, and a target whose Decode runs faster than that (its own draft head) would
        lose its first requests to drafted-ahead rounds that a measured stretch outruns (a fresh
        orchestrator's first request on the default pair at 30 ms: 0.7-0.8x a stretch's pace)."""
        return self._ahead is not None and self._plain_factor.value is None

    def _ahead_pays(self) -> bool:
        """Under pipelining auto, whether drafting ahead now beats K = 0 (with its hysteresis)."""
        costs = self._costs()
        return (self._ahead is not None and costs is not None
                and self._ahead.drafts_ahead(self._alpha.alpha, costs, self._config.max_num_speculative_tokens,
                                             self._max_fanout))

    @property
    def _shadows(self) -> bool:
        """Whether this session probes beside its stretches: shadow_probes, and under pipelining
        auto not while the draft's candidate ranks are pending and measured by drafted-ahead
        rounds (_ranks_pending: no probe beside a stretch measures them there), whose probes from
        K = 0 then draft ahead as rounds."""
        return self._shadow_probes and not self._ranks_pending()

    @property
    def shadow_probe_fanout(self) -> int:
        """The fan-out of the probe shadow_probe() gives (before it is taken): > 0 where it drafts
        ahead, to measure the candidate ranks (pipelining auto, ranks_beside); its outcome goes to
        the pipeline's observe_ahead."""
        return self._shadow_fanout

    def shadow_probe(self) -> int:
        """K of the probe plain_rounds(shadow=True) took for the stretch the caller now runs (0:
        none); the caller proposes that many drafts from where the stretch starts and reports
        how many the stretch's tokens matched to observe_shadow()."""
        k, self._shadow_num_speculative_tokens = self._shadow_num_speculative_tokens, 0
        return k

    def observe_shadow(self, observation: RoundObservation, tested: int, behind: int) -> None:
        """A probe run beside a stretch: observation holds its K, the drafts the stretch's tokens
        matched (greedy: exactly those a Verify would have accepted), under sampling each tested
        position's chance of acceptance (acceptance_signal), and the Propose's timings, nothing
        of the target's; tested: the drafts the stretch had tokens for (fewer than K when it ended
        first); behind: committed tokens the draft has not seen since. Then K is chosen again,
        and the probe interval backs off as after a probe round that leaves K at 0.

        Its Propose ran while the target decoded: where the draft computes on the target's
        hardware the two took the cores from each other (it took up to ten times a round's), so
        its timings bound a round's from above only. They lower the draft's estimates (a first
        round on a cold device timed far too slow) but never raise them: priced at a contended
        Propose, drafting never paid again, for this session or, through the pool, for the
        sessions after it."""
        index = self._round
        if observation.acceptance_signal:
            counts = self._alpha.update_expected(observation.acceptance_signal, index)
        else:
            counts = self._alpha.update(min(tested, observation.num_speculative_tokens), observation.num_accepted, index)
        self._pool_acceptance(*counts)
        self._update_draft_estimates(observation, index, upper_bounds=True)
        self._pending_catchup_tokens = max(0, behind)
        self._decide()
        if not self.measures_beside():  # those probes measure the ranks, not a K = 0 to back off from
            self._space_probes(backs_off=self._shadow_probes_contend)
        if self._priors is not None:
            self._priors.update(self._session_estimates())

    def observe_plain(self, rounds: int, seconds_per_token: float | None,
                      passes: DecodedPasses | None = None) -> None:
        """K = 0 rounds run as one Decode: the draft owes them as catch-up, they count towards the
        next probe, and their pace, over what a K = 0 Verify round is predicted to take, prices
        K = 0 from now on (RoundCosts.plain_factor); a stretch cut short (None) teaches no pace:
        its round trip is spread over fewer tokens than a stretch's (a request that ends after
        one token would price K = 0 at a whole round trip per token).

        passes, the target's passes the rounds ran in, are verify passes like any other: their
        time joins the verify fit at their rows, and their load the estimates of who shares the
        pass. Without them a session at K = 0 would price drafting from its last Verify rounds
        for good, however long ago or unrepresentative they were (a device's first passes, which
        load kernels, cost many times a later one's: a fit left there keeps K at 0)."""
        if rounds <= 0:
            return
        self._round += rounds
        self._pending_catchup_tokens += rounds
        if self._num_speculative_tokens == 0:
            self._rounds_since_probe += rounds
        if passes is not None:
            self._observe_pass(passes.rows, passes.seconds, passes.sessions, passes.own_rows, self._round,
                               weight=rounds)
        self._observe_plain_pace(seconds_per_token)

    def observe_stream_pace(self, seconds_per_token: float, passes: DecodedPasses | None = None) -> None:
        """A streamed Decode call of the request (pipelining's streamed requests: no rounds, the
        draft's offers in the target's passes) ran at seconds_per_token. It is the Decode a K = 0
        stretch runs, offered the same drafts as auto's stretches are, so its pace prices K = 0
        as a stretch's does (RoundCosts.plain_factor), and its passes join the verify fit; no
        round is counted, towards a probe or as catch-up (the draft was fed every token). Without
        it a fresh orchestrator under auto, which streams its first requests, prices K = 0 for
        the first request that runs rounds at a Verify round per token, hop and all, and that
        request drafts where a stretch is faster."""
        if passes is not None:
            self.observe_decoded_passes(passes)
        self._observe_plain_pace(seconds_per_token)

    def _observe_plain_pace(self, seconds_per_token: float | None) -> None:
        """A Decode's pace per token, over what a K = 0 Verify round is predicted to take, prices
        K = 0 from now on; the pool hears of it."""
        base = self._base_costs()
        if base is not None and seconds_per_token is not None and seconds_per_token > 0:
            predicted = round_time(0, replace(base, plain_factor=None))
            if predicted > 0:
                factor = min(PLAIN_FACTOR_RANGE[1], max(PLAIN_FACTOR_RANGE[0], seconds_per_token / predicted))
                self._plain_factor.update(factor, self._round)
        if self._priors is not None:
            self._priors.update(self._session_estimates())

    def pipeline(self, max_fanout: int, priors: PipelinePriors | None = None) -> PipelinePolicy:
        """Drafting ahead chosen with K from this session's estimates (pipeline auto)."""
        # pipeline_policy builds on this module: imported here, not at the top
        from orchestrator.pipeline_policy import PipelineController

        self._ahead = PipelineController(priors=priors)
        self._max_fanout = max_fanout
        return _AutoPipeline(self)

    @property
    def planned_test(self) -> bool:
        """Whether this round's drafting ahead is a test: chosen while the draft's candidate
        ranks were still to be measured, with K = 0 priced as a Verify round (_ranks_pending)."""
        return self._planned_test

    @property
    def planned_fanout(self) -> int:
        """The fan-out chosen with this round's K (0: no drafting ahead)."""
        return self._planned_fanout

    def observe_ahead(self, observation: AheadObservation) -> None:
        """A round that drafted ahead: the outcome's candidate rank and the branches' cost."""
        assert self._ahead is not None, "pipeline() was not called"
        self._ahead.observe_outcome(observation.num_accepted == observation.num_speculative_tokens,
                                    observation.rank, observation.candidates, observation.fanout)
        if observation.branches:  # rows per pass: one per branch
            self._ahead.observe_branches(observation.compute_seconds, observation.branch_num_speculative_tokens + 1,
                                         observation.branches, observation.after_proposal_seconds,
                                         observation.call_hop_seconds)

    def choose_lookup(self, match_lengths: Sequence[int], model_num_speculative_tokens: int | None) -> int:
        """How many of a lookup's proposed tokens this round verifies (orchestrator/lookup_policy.py):
        0 leaves the round to the model draft at model_num_speculative_tokens, the K choose() gave
        (None: no model draft this round, so K = 0). match_lengths: each proposed token's match."""
        # lookup_policy builds on this module's cost model: imported here, not at the top
        from orchestrator.lookup_policy import choose_lookup_k

        match_lengths = match_lengths[: self._config.max_num_speculative_tokens]
        costs = self._costs()
        model_seconds = None
        if model_num_speculative_tokens is not None:
            if costs is not None:
                model_seconds = seconds_per_token(self._alpha.alpha, model_num_speculative_tokens, costs)
            elif model_num_speculative_tokens > 0:
                model_seconds = math.inf  # the model draft's costs are not known yet: the lookup first
        verify_costs = costs if costs is not None else self._verify_costs()
        if model_num_speculative_tokens is None and verify_costs is not None:
            # No model draft this round (a lookup alone): without the lookup's tokens the round is
            # a Verify at K = 0, not a stretch of them (those follow the model's choice of K = 0).
            verify_costs = replace(verify_costs, plain_factor=None)
        return choose_lookup_k(self._lookup_acceptance(), match_lengths, verify_costs, model_seconds)

    def observe_decoded_passes(self, passes: DecodedPasses) -> None:
        """A Decode the guard ran (no K chosen, nothing towards a probe): its passes' time joins
        the verify fit and their load the estimates of who shares the pass, as a stretch's do."""
        self._observe_pass(passes.rows, passes.seconds, passes.sessions, passes.own_rows, self._round,
                           weight=passes.count)

    def decode_lookup_min_chance(self) -> float:
        """The chance of being accepted that a looked-up token needs to be worth its row in a
        Decode pass (DecodeLookup.min_chance): the tokens that row costs the sessions in the pass.
        It makes the pass dT(1) = T_pass(R + 2) - T_pass(R + 1) longer (R: the others' rows), and
        each of the n sessions in it commits about one token per pass there, so n dT(1) /
        T_pass(R + 1) (goodput's charge at K = 0 with no hop between a Decode's tokens).
        UNPRICED_LOOKUP_CHANCE before a pass has been measured."""
        if self._verify.coefficients() is None:
            return UNPRICED_LOOKUP_CHANCE
        others_rows, others_sessions = self._load()
        # The line, not a row count's residual: the rows a lookup adds vary from pass to pass.
        plain = self._verify.line_seconds(others_rows + 1)
        if plain <= 0.0:
            return UNPRICED_LOOKUP_CHANCE
        delay = max(0.0, self._verify.line_seconds(others_rows + 2) - plain)
        return min(1.0, (1.0 + others_sessions) * delay / plain)

    def _lookup_acceptance(self) -> LookupAcceptance:
        if self._lookups is None:
            self._lookups = LookupAcceptance(priors=self._lookup_priors)
        return self._lookups

    def _choose_plain(self, max_num_speculative_tokens: int) -> int:
        if max_num_speculative_tokens <= 0:
            return 0
        if self._num_speculative_tokens == 0 and self._rounds_since_probe >= self._probe_interval:
            self._probe_outstanding = True
            return min(self._config.probe_num_speculative_tokens, max_num_speculative_tokens)
        if self._num_speculative_tokens <= max_num_speculative_tokens:
            return self._num_speculative_tokens
        costs = self._costs()  # capped below our K (end of output): best K that fits
        if costs is None:
            return max_num_speculative_tokens
        return best_k(self._alpha.alpha, costs, max_num_speculative_tokens)

    def observe(self, observation: RoundObservation) -> None:
        self._round += 1
        self._update_estimates(observation)
        previous_k = self._num_speculative_tokens
        self._decide()
        # A lookup's round tested no model K: to the model's probe schedule it is no round at all.
        if not observation.lookup_match_lengths:
            self._schedule_probes(previous_k, observation.num_speculative_tokens)
        if self._priors is not None:
            self._priors.update(self._session_estimates())

    def estimates(self) -> dict[str, float]:
        figures: dict[str, float] = {
            "alpha": self._alpha.alpha,
            "num_speculative_tokens": float(self._num_speculative_tokens),
            "probe_interval_rounds": float(self._probe_interval),
        }
        named = {
            "t_draft_per_token": self._t_draft.value,
            "t_feed_per_token": self._t_feed.value,
            "rtt_draft": self._rtt_draft.value,
            "rtt_target": self._rtt_target.value,
            "plain_factor": self._plain_factor.value,
            "verify_pass_rows": self._pass_rows.value,  # mean rows of the verify pass, all sessions
            "verify_pass_sessions": self._pass_sessions.value,  # mean sessions in it, n
            "verify_pass_others_rows": self._others_rows.value,  # mean rows of the others, R_others
        }
        figures.update({name: value for name, value in named.items() if value is not None})
        coefficients = self._verify.coefficients()
        if coefficients is not None:
            figures["verify_a"], figures["verify_b"] = coefficients
            figures["decode_lookup_min_chance"] = self.decode_lookup_min_chance()
        if self._ahead is not None:
            figures.update(self._ahead.estimates())
        if self._lookups is not None:
            figures.update(self._lookups.estimates())
        costs = self._costs(include_catchup=False)
        if costs is not None:
            alpha, current = self._alpha.alpha, self._num_speculative_tokens
            own = session_rate(alpha, current, costs)
            figures["predicted_tokens_per_second"] = own
            figures["predicted_speedup_vs_k0"] = own / session_rate(alpha, 0, costs)
            # own rate less what this session's drafted rows cost the others in the pass
            figures["predicted_goodput_tokens_per_second"] = goodput(alpha, current, costs)
        return figures

    # -- internals -------------------------------------------------------------------------------

    def _timing_estimate(self, seed: float | None) -> RunningEstimate:
        cfg = self._config
        return RunningEstimate.seeded(cfg.timing_weight, seed, cfg.prior_timing_samples)

    def _update_estimates(self, observation: RoundObservation) -> None:
        num_speculative_tokens, index = observation.num_speculative_tokens, self._round
        if observation.lookup_match_lengths:
            # A lookup proposed: its acceptance by match length. The model draft's alpha and
            # timings were not measured, and it has the round's tokens to catch up on.
            self._lookup_acceptance().update(observation.lookup_match_lengths, observation.num_accepted)
            self._pending_catchup_tokens += observation.num_accepted + 1
        else:
            self._pool_acceptance(*self._alpha.update(num_speculative_tokens, observation.num_accepted, index))
            self._update_draft_estimates(observation, index)
        # The fit is over the whole pass's rows: the time is that of the pass, whoever was in it.
        rows = observation.pass_rows
        verify_seconds = observation.verify_compute_seconds
        if self._ahead is not None:
            # Branches drafted on the target's cores slow its pass: the pipeline model measures
            # by how much, and the fit gets the time the pass takes without them.
            if self._verify.coefficients() is not None:
                self._ahead.observe_verify(observation.drafting_ahead, verify_seconds, self._verify.seconds(rows))
            verify_seconds = self._ahead.plain_verify_seconds(verify_seconds, observation.drafting_ahead)
        self._observe_pass(rows, verify_seconds, observation.pass_sessions, num_speculative_tokens + 1, index)
        target_overhead = observation.verify_wall_seconds - observation.verify_compute_seconds
        self._rtt_target.update(max(0.0, target_overhead), index)

    def _pool_acceptance(self, accepted: float, rejected: float) -> None:
        """The pool's alpha counts what this session's rounds tested (ControllerPriors)."""
        if self._priors is not None:
            self._priors.add_acceptance(accepted, rejected)

    def _observe_pass(self, rows: float, seconds: float, sessions: float, own_rows: float, index: int,
                      weight: float = 1.0) -> None:
        """A target pass (weight > 1: the mean of that many) of `rows` rows over `sessions`
        sessions, own_rows of them this session's: the verify fit and the load estimates."""
        self._verify.update(max(1, round(rows)), seconds, index, weight=weight)
        self._pass_rows.update(float(rows), index)
        self._pass_sessions.update(sessions, index)
        self._others_rows.update(max(0.0, float(rows - own_rows)), index)

    def _update_draft_estimates(self, observation: RoundObservation, index: int, upper_bounds: bool = False) -> None:
        """The model draft's timings and catch-up, from a round it proposed (or not: K = 0).
        upper_bounds: the timings only bound a round's from above (observe_shadow), and lower an
        estimate they are below."""

        def update(estimate: RunningEstimate, sample: float) -> None:
            if not upper_bounds or estimate.value is None or sample < estimate.value:
                estimate.update(sample, index)

        num_speculative_tokens = observation.num_speculative_tokens
        if num_speculative_tokens > 0 and observation.drafted_ahead:
            self._pending_catchup_tokens = 0  # drafted ahead: no draft call, nothing owed
        elif num_speculative_tokens > 0:
            # A Propose of K makes K draft passes; the first also feeds the catch-up. Tokens fed
            # beyond one per pass are catch-up (one extra is normal after a fully accepted round).
            extra_tokens = observation.draft_fed_tokens - num_speculative_tokens
            if extra_tokens <= 1:
                update(self._t_draft, observation.draft_compute_seconds / num_speculative_tokens)
            elif self._t_draft.value is not None:
                drafting = num_speculative_tokens * self._t_draft.value
                excess = max(0.0, observation.draft_compute_seconds - drafting)
                update(self._t_feed, excess / extra_tokens)
            draft_overhead = observation.draft_wall_seconds - observation.draft_compute_seconds
            update(self._rtt_draft, max(0.0, draft_overhead))
            self._pending_catchup_tokens = 0
        else:
            self._pending_catchup_tokens += 1

    def _load(self) -> tuple[int, float]:
        """(R_others rounded, n - 1) from the running means; (0, 0.0) alone or before any round."""
        others_rows = self._others_rows.value
        sessions = self._pass_sessions.value
        return (round(others_rows) if others_rows is not None else 0,
                max(0.0, sessions - 1.0) if sessions is not None else 0.0)

    def _base_costs(self) -> RoundCosts | None:
        """The verify pass and the target's hop, with the rows the others put in the pass; no
        draft figures and no rate of the others yet. None before the first verify."""
        costs = self._verify_round_costs()
        if costs is None or self._ranks_pending(costs):
            return costs  # K = 0 as Verify rounds until drafting ahead is measured (PipelineConfig)
        return self._at_plain_pace(costs)

    def _verify_round_costs(self) -> RoundCosts | None:
        """_base_costs with K = 0 priced as a Verify round."""
        coefficients = self._verify.coefficients()
        rtt_target = self._rtt_target.value
        if coefficients is None or rtt_target is None:
            return None
        others_rows, _ = self._load()
        # Alone, a row count's own residual (kernel steps) sharpens the line; with others in the
        # pass their rows move it across those steps from round to round, so the line alone.
        verify_fn = self._verify.seconds if others_rows == 0 else self._verify.line_seconds
        return RoundCosts(0.0, verify_fn, 0.0, rtt_target, others_rows=others_rows)

    def _at_plain_pace(self, costs: RoundCosts) -> RoundCosts:
        """K = 0 rounds are decoded in one call: at their measured pace, or until it is measured, at
        the K = 0 round with its target hop paid once per stretch (to the next probe)."""
        plain = self._plain_factor.value
        if plain is None:
            verify_round = round_time(0, costs)
            plain = (verify_round - costs.rtt_target * (1.0 - 1.0 / self._probe_interval)) / verify_round
        return replace(costs, plain_factor=plain)

    def _ranks_pending(self, verify_round_costs: RoundCosts | None = None) -> bool:
        """Under pipelining auto, whether the draft's candidate ranks are still to be measured
        (PipelineConfig.measured_outcomes: until then K = 0 is priced as Verify rounds and the
        ranks read at their most hopeful, so that drafting ahead is tried) and could make drafting
        ahead pay: with the ranks at their most hopeful (every round a hit before any
        drafted-ahead outcome, then the outcomes' hit rates as if the next few were hits too:
        PipelineController.could_pay) and alpha optimistic (zero_k_optimism posterior sd above
        the estimate), some K drafted ahead beats K = 0 at its streamed pace. Where even that
        loses, no ranks (or none the tests so far leave likely) would change the choice, so K = 0
        is priced at its pace. Nor once this session has run its share of the tests
        (PipelineConfig.session_test_rounds): from then on its drafted-ahead rounds have to beat
        K = 0 at its pace. True while the costs are not known."""
        if (self._ahead is None or self._ahead.ranks_measured or self._ahead.tests_spent
                or self.measures_beside()):
            return False
        base = verify_round_costs if verify_round_costs is not None else self._verify_round_costs()
        costs = self._with_draft(self._at_plain_pace(base), include_catchup=False) if base is not None else None
        if costs is None:
            return True
        alpha = min(1.0, self._alpha.alpha + self._config.zero_k_optimism * self._alpha.alpha_sd)
        return self._ahead.could_pay(alpha, costs, self._config.max_num_speculative_tokens, self._max_fanout)

    def _verify_costs(self) -> RoundCosts | None:
        """The round's costs without a draft (no draft time, hop or catch-up): all a lookup needs."""
        base = self._base_costs()
        return self._with_others(base) if base is not None else None

    def _costs(self, include_catchup: bool = True) -> RoundCosts | None:
        base = self._base_costs()
        return self._with_draft(base, include_catchup) if base is not None else None

    def _with_draft(self, base: RoundCosts, include_catchup: bool = True) -> RoundCosts | None:
        """base with the draft's figures and the others' rate; None before the draft's are known."""
        t_draft, rtt_draft = self._t_draft.value, self._rtt_draft.value
        if t_draft is None or rtt_draft is None:
            return None
        t_feed = self._t_feed.value if self._t_feed.value is not None else t_draft
        catchup = self._pending_catchup_tokens * t_feed if include_catchup else 0.0
        return self._with_others(replace(base, t_draft=t_draft, rtt_draft=rtt_draft, catchup_seconds=catchup))

    def _with_others(self, costs: RoundCosts) -> RoundCosts:
        """costs with the other sessions in the pass and what each of them commits per second."""
        _, others_sessions = self._load()
        if others_sessions > 0.0:
            current = min(self._num_speculative_tokens, self._config.max_num_speculative_tokens)
            costs = replace(costs, others_sessions=others_sessions)
            rate = others_commit_rate(self._alpha.alpha, current, costs)
            costs = replace(costs, others_tokens_per_second=rate)
        return costs

    def _decide(self) -> None:
        costs = self._costs()
        if costs is None:
            return
        times = self._seconds_per_token_by_k(costs)
        best = min(range(len(times)), key=times.__getitem__)
        current = min(self._num_speculative_tokens, self._config.max_num_speculative_tokens)
        if best != current and times[best] < times[current] * (1.0 - self._config.hysteresis):
            self._num_speculative_tokens = best

    def _optimistic_verify_seconds(self, max_rows: int) -> list[float]:
        """T_verify(1 .. max_rows), each row count taken as cheaper the less it was measured."""
        optimism = self._config.verify_optimism
        return [seconds * (1.0 - optimism / math.sqrt(1.0 + self._verify.row_weight(rows)))
                for rows, seconds in enumerate(self._verify.seconds_up_to(max_rows), start=1)]

    def _seconds_per_token_by_k(self, costs: RoundCosts) -> list[float]:
        """Seconds per token (1 / G) for K = 0..max_num_speculative_tokens. Alone, verify times of
        little-measured row counts are taken optimistically. K = 0 is ruled out (infinite) while
        an optimistic alpha, zero_k_optimism posterior sd above the estimate, would still draft,
        unless drafting at the estimate itself gains the system nothing or costs more than
        optimism_max_loss over K = 0 per token, or the session probes in the shadow (at K = 0 it
        still observes alpha)."""
        cfg = self._config
        alpha = self._alpha.alpha
        if costs.others_rows == 0:
            # Each row count's optimistic time once per decision: both argmins below read it.
            verify = self._optimistic_verify_seconds(cfg.max_num_speculative_tokens + 1)
            costs = replace(costs, verify_fn=lambda rows: verify[rows - 1])
        times = [seconds_per_token(alpha, num, costs) for num in range(cfg.max_num_speculative_tokens + 1)]
        optimistic_alpha = min(1.0, alpha + cfg.zero_k_optimism * self._alpha.alpha_sd)
        # inf: drafting gains the system nothing at the estimate
        drafting_loss = min(times[1:]) / times[0] - 1.0 if times[0] > 0 else 0.0
        if (not self._shadows and drafting_loss <= cfg.optimism_max_loss
                and best_k(optimistic_alpha, costs, cfg.max_num_speculative_tokens) > 0):
            times[0] = math.inf
        return times

    def _schedule_probes(self, previous_k: int, observed_k: int) -> None:
        """Count K = 0 rounds to the next probe; back off after a probe that left K at 0."""
        if self._probe_outstanding and observed_k > 0:
            self._probe_outstanding = False
            self._rounds_since_probe = 0
            self._space_probes()
        elif self._num_speculative_tokens == 0 and (
                previous_k != 0 or (observed_k > 0 and self._ahead is not None and not self._ahead_pays())):
            # Drafting just stopped (plain drafting, or drafting ahead under pipelining auto, whose
            # rounds run at a plain K of 0), on a few rounds' evidence. A probe beside the first
            # stretch costs no round and checks that evidence before a whole interval goes by at
            # K = 0; a probe round costs one, and waits for the interval.
            self._rounds_since_probe = self._probe_interval if self._shadows else 0
        elif self._num_speculative_tokens == 0 and observed_k == 0:
            self._rounds_since_probe += 1

    def _space_probes(self, backs_off: bool = True) -> None:
        """After a probe (a round's or one beside a stretch): back the interval off if it left K
        at 0 (and backs_off: the probe cost something), else start it over."""
        cfg = self._config
        if self._num_speculative_tokens == 0 and backs_off:
            backed_off = math.ceil(self._probe_interval * cfg.probe_backoff)
            self._probe_interval = min(cfg.probe_interval_max_rounds, backed_off)
        else:
            self._probe_interval = cfg.probe_interval_rounds

    def _session_estimates(self) -> PriorEstimates:
        """This session's own timings for the pool (None where it has measured nothing yet); its
        acceptance goes as counts, round by round (_pool_acceptance)."""

        def own(estimate: RunningEstimate) -> float | None:
            return estimate.value if estimate.session_samples > 0 else None

        coefficients = self._verify.coefficients() if self._verify.session_samples > 0 else None
        return PriorEstimates(
            t_draft_per_token=own(self._t_draft),
            t_feed_per_token=own(self._t_feed),
            verify_a=coefficients[0] if coefficients else None,
            verify_b=coefficients[1] if coefficients else None,
            rtt_draft=own(self._rtt_draft),
            rtt_target=own(self._rtt_target),
            plain_factor=own(self._plain_factor),
            verify_residuals=self._verify.residuals() if self._verify.session_samples > 0 else None,
        )


class _AutoPipeline:
    """Pipeline auto: the fan-out the controller chose with this round's K."""

    def __init__(self, controller: AdaptiveKController) -> None:
        self._controller = controller

    def plan(self, num_speculative_tokens: int, max_num_speculative_tokens: int) -> AheadPlan:
        fanout = self._controller.planned_fanout
        if not fanout:
            return NO_AHEAD
        return AheadPlan(fanout, min(num_speculative_tokens, max_num_speculative_tokens),
                         test=self._controller.planned_test)

    def observe_ahead(self, observation: AheadObservation) -> None:
        self._controller.observe_ahead(observation)
