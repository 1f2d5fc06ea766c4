"""Whether a round drafts ahead, and how widely: the seam between the loop and its pipelining.

A pipelined round asks the draft for a Speculate instead of a Propose: while the target verifies
the round's K drafts, the draft drafts the next round for its likely outcomes ("j accepted, then
t", t among its top `fanout` candidates at position j), branch_num_speculative_tokens drafts each.
If the outcome is among them, the next round's proposal is already here: it goes to the target at
once, and the draft adopts the same branch on its side (a hit). Otherwise the next round proposes
as usual (a miss). Outputs do not change either way: a branch holds exactly the drafts a Propose
after that outcome would draft (docs/architecture.md, "Pipelining").

`off` never drafts ahead; `on` drafts ahead every drafted round with a fixed fan-out and the
round's own K for the branches; `auto` (orchestrator/pipeline_policy.py, through the adaptive
controller) drafts ahead where the expected hit rate pays for it.

`stream` has no rounds at all (StreamedDrafts): the target decodes on in one Decode call, and the
draft, fed each token as it streams out, offers the target its drafts from there (the target's
Offer); each of the target's passes verifies up to K of them where they still follow what it has
committed by then, and decodes one token where they do not. Neither the draft's compute nor
either hop waits in line before a target pass; the price is the offered rows in the target's
passes, verified or rejected.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Literal, Protocol

PipelineMode = Literal["off", "on", "auto", "stream"]
PIPELINE_MODES: tuple[PipelineMode, ...] = ("off", "on", "auto", "stream")
MAX_PIPELINE_FANOUT = 8  # the draft's candidates per position (draft_service/engine.py)
DEFAULT_PIPELINE_FANOUT = 3  # candidates per outcome under `on`, unless set


def default_pipeline_fanout(mode: PipelineMode) -> int:
    """The fan-out of a request that sets none, on a server that sets none: `on` drafts ahead
    DEFAULT_PIPELINE_FANOUT candidates per outcome every round; `auto` may go up to all the
    draft's candidates, since its cost model charges the branches' compute and picks the fan-out
    (the smallest within a hair of the best), and a draft that agrees often needs more than a few
    guesses per outcome to hit nearly every round."""
    return MAX_PIPELINE_FANOUT if mode == "auto" else DEFAULT_PIPELINE_FANOUT


@dataclass(frozen=True)
class AheadPlan:
    """What a round asks the draft to draft ahead: fanout 0 is a plain Propose."""

    fanout: int = 0
    branch_num_speculative_tokens: int = 0
    # A test: drafting ahead tried while the draft's candidate ranks are still to be measured
    # (pipelining auto), not chosen on measured figures; the request's pace is then no measure
    # of its way (RequestStreaming).
    test: bool = False

    @property
    def drafts_ahead(self) -> bool:
        return self.fanout > 0 and self.branch_num_speculative_tokens > 0


NO_AHEAD = AheadPlan()


@dataclass(frozen=True)
class AheadObservation:
    """What a round that drafted ahead learnt: its outcome's place among the draft's candidates,
    and what the branches cost."""

    num_speculative_tokens: int  # K of the round the branches follow
    num_accepted: int  # its outcome: j drafts accepted, then the target's token
    rank: int | None  # that token's 1-based rank among the draft's candidates at j (None: absent)
    candidates: int  # how many candidates the draft sent for position j
    fanout: int  # candidates per outcome that got a branch
    branches: int  # branches drafted
    branch_num_speculative_tokens: int  # K' of each branch
    compute_seconds: float  # the draft's compute for the branches
    after_proposal_seconds: float  # from the proposal's arrival to the branches': what the loop waits
    call_hop_seconds: float | None  # their own call's round trip to its proposal (after a hit); None:
    # they followed the round's own proposal


class PipelinePolicy(Protocol):
    def plan(self, num_speculative_tokens: int, max_num_speculative_tokens: int) -> AheadPlan:
        """What a round of num_speculative_tokens (> 0) drafts drafts ahead; branches hold at
        most max_num_speculative_tokens drafts (the servers' limit)."""

    def observe_ahead(self, observation: AheadObservation) -> None:
        """A round that drafted ahead, once its outcome is known."""


@dataclass
class NoPipeline:
    def plan(self, num_speculative_tokens: int, max_num_speculative_tokens: int) -> AheadPlan:
        return NO_AHEAD

    def observe_ahead(self, observation: AheadObservation) -> None:
        pass


@dataclass
class FixedPipeline:
    """Every drafted round drafts ahead `fanout` candidates per outcome, K drafts per branch
    (the next round's K under fixed K)."""

    fanout: int

    def __post_init__(self) -> None:
        if not 1 <= self.fanout <= MAX_PIPELINE_FANOUT:
            raise ValueError(f"pipeline fanout must be in [1, {MAX_PIPELINE_FANOUT}], got {self.fanout}")

    def plan(self, num_speculative_tokens: int, max_num_speculative_tokens: int) -> AheadPlan:
        return AheadPlan(self.fanout, min(num_speculative_tokens, max_num_speculative_tokens))

    def observe_ahead(self, observation: AheadObservation) -> None:
        pass


class StreamPaces:
    """Whether offering drafts pays, measured: the seconds per token of streamed requests' Decode
    calls with offers and without, smoothed over the orchestrator's requests. Offers cost the
    target nothing when the draft has machines of its own, and a great deal when it shares the
    target's cores (each offer is a draft call per target token): a call offers while that is the
    faster of the two, and every so often (at most 1 in `max_interval` calls, 1 in
    `min_interval` again after a flip) the other one is measured again; a call whose offers
    clearly slow it stops offering after MIN_PACE_TOKENS tokens."""

    def __init__(self, weight: float = 0.3, min_interval: int = 4, max_interval: int = 64,
                 early_end_loss: float = 0.3, first: bool = True, margin: float = 0.0) -> None:
        self.weight = weight
        self.first = first  # the way measured first
        # The other way is taken as the faster only when its pace is below the first's by more
        # than this fraction (0: whichever measures lower).
        self.margin = margin
        self.early_end_loss = early_end_loss
        self.min_interval, self.max_interval = min_interval, max_interval
        self.interval = min_interval
        self.seconds: dict[bool, float | None] = {True: None, False: None}  # by offering
        self._since_test = 0
        self._lock = threading.Lock()

    def offer_next(self) -> bool:
        """Whether the next Decode call offers drafts: each way is measured once first (`first`
        first), then the faster, and the other at the schedule's tests."""
        with self._lock:
            if self.seconds[self.first] is None:
                return self.first
            if self.seconds[not self.first] is None:
                return not self.first
            faster = self._faster()
            self._since_test += 1
            if self._since_test >= self.interval:
                self._since_test = 0
                return not faster
            return faster

    def _faster(self) -> bool:
        """The way that measures faster (both measured; the lock held): the first way unless
        the other measures lower by more than the margin."""
        first, other = self.seconds[self.first], self.seconds[not self.first]
        assert first is not None and other is not None
        return (not self.first) if other < first * (1 - self.margin) else self.first

    def clearly_slower(self, seconds_per_token: float, offered: bool = True) -> bool:
        """Whether a call that offers (offered) or not runs slower than calls the other way by
        more than `early_end_loss`: a test that is losing clearly need not run to its end."""
        with self._lock:
            other = self.seconds[not offered]
            return other is not None and seconds_per_token > other * (1 + self.early_end_loss)

    def is_test(self, offered: bool) -> bool:
        """Whether a call that offers (offered) or not goes against the measurements: the other
        way is measured, and faster or this way not yet."""
        with self._lock:
            mine, other = self.seconds[offered], self.seconds[not offered]
            if other is None:
                return False
            return mine is None or self._faster() != offered

    def observe(self, offered: bool, seconds_per_token: float, accepted_share: float | None = None,
                fresh: bool = False) -> None:
        """A Decode call's wall time per token (long enough calls only: MIN_PACE_TOKENS); fresh:
        it replaces that way's pace instead of joining it (what the way does has changed).
        accepted_share, for a call that offered: the share of its tokens that were offered drafts
        the target accepted. Such a call is a plain Decode but for those, which took
        (1 - accepted_share) of its tokens' passes at best, so it is taken as faster than the
        other way measures by that share at most: the ways are measured on different requests,
        and a call faster by more ran on an easier text, not on its offers (a stream whose offers
        were never verified once chose streaming for the requests after it, which ran slower)."""
        with self._lock:
            other = self.seconds[not offered]
            if offered and accepted_share is not None and other is not None:
                seconds_per_token = max(seconds_per_token, other * (1.0 - min(1.0, max(0.0, accepted_share))))
            before = self.seconds[True] is not None and self.seconds[False] is not None
            faster = before and self._faster()
            old = self.seconds[offered]
            smoothed = seconds_per_token if old is None or fresh else old + self.weight * (seconds_per_token - old)
            self.seconds[offered] = smoothed
            if before and faster != self._faster():
                self.interval = self.min_interval  # flipped: test the loser soon again
            elif before and offered != faster:
                self.interval = min(self.max_interval, 2 * self.interval)  # a test confirmed it


class RequestStreaming:
    """Pipelining auto's choice, request by request, between the adaptive controller's rounds and
    streaming the whole request (one Decode at a time, the draft's offers in its passes, every
    call offered): the controller's rounds unless streamed requests measure a wall time per token
    lower by more than `margin`, the other way tried again now and then (StreamPaces: True
    streams), apart for greedy and sampled requests, whose drafts are accepted at different rates,
    and for each network the requests start on (`network`: the caller's bucket of the hops' round
    trips; which way is faster turns on them, and a pace measured on another network says little
    about this one). The rounds are measured first and kept on a near tie: they are what adaptive
    K without pipelining runs (its K = 0 stretches pay the target's round trip once per Decode
    call, as a stream does), so auto is not worse than that for offers that add nothing; and a
    request's pace depends on its prompt more than on its way, so a small difference between the
    ways' smoothed paces says little. A request that tests the other way switches for the rest of
    it, after MIN_PACE_TOKENS tokens, when that way is clearly the slower
    (StreamPaces.clearly_slower).

    The rounds' pace is what the controller did in them, and that turns on what it believed:
    rounds at K = 0 throughout (a request whose first probes found little accepted) run at a
    stretch's pace, rounds that draft at theirs. So the rounds' pace is kept with whether its
    last request drafted; a request whose controller would draft from its start (`drafts`)
    runs the rounds while that pace is one of rounds that did not, and the pace it measures
    replaces the other. Without that a fresh orchestrator whose first request happened to stay at
    K = 0 streamed every request after it, where the rounds then drafted ahead at 1.3-1.5x the
    streams' pace. Likewise a request whose controller is still measuring, beside its stretches,
    what decides whether its rounds draft (`measuring`: the pool's candidate ranks) runs the
    rounds: a stream measures none of it, and while streams won against a first request's K = 0
    stretches the ranks stayed unmeasured and the rounds came back only at a test of them, a
    repetition later on the emulated pair (1.1-1.2x adaptive K where drafted-ahead rounds ran
    1.3x)."""

    def __init__(self, margin: float = 0.1) -> None:
        self.margin = margin
        self.paces: dict[tuple[bool, int], StreamPaces] = {}
        self.rounds_drafted: dict[tuple[bool, int], bool] = {}  # whether the rounds' pace drafted

    def _paces(self, greedy: bool, network: int) -> StreamPaces:
        return self.paces.setdefault((greedy, network), StreamPaces(first=False, margin=self.margin))

    def streams_next(self, greedy: bool, network: int = 0, drafts: bool = False, measuring: bool = False) -> bool:
        """Whether the next request streams; drafts: its controller would draft from its start;
        measuring: its rounds still measure what decides whether they draft."""
        if measuring or (drafts and self.rounds_drafted.get((greedy, network)) is False):
            return False
        return self._paces(greedy, network).offer_next()

    def is_test(self, greedy: bool, streams: bool, network: int = 0) -> bool:
        """Whether a request that streams (or runs rounds) goes against the measurements."""
        return self._paces(greedy, network).is_test(streams)

    def clearly_slower(self, greedy: bool, streams: bool, seconds_per_token: float, network: int = 0) -> bool:
        return self._paces(greedy, network).clearly_slower(seconds_per_token, streams)

    def observe(self, greedy: bool, streamed: bool, seconds_per_token: float, network: int = 0,
                accepted_share: float | None = None, drafted: bool | None = None) -> None:
        """The wall time per token of a request's tokens after its first, or of the part of them
        it ran one way (MIN_PACE_TOKENS tokens or more); a streamed one's accepted_share: the share
        of them that were offered drafts the target accepted (StreamPaces.observe); the rounds'
        drafted: whether they drafted."""
        fresh = False
        if not streamed and drafted is not None:
            key = (greedy, network)
            fresh = self.rounds_drafted.get(key, drafted) != drafted
            self.rounds_drafted[key] = drafted
        self._paces(greedy, network).observe(streamed, seconds_per_token, accepted_share, fresh=fresh)


# Decode calls shorter than this tell StreamPaces nothing: a call's first token carries its setup.
MIN_PACE_TOKENS = 16
# Drafts a pass of an adaptive session's K = 0 stretch verifies from the draft's offers under
# pipelining auto (the streamed K measured on the default pair).
STRETCH_OFFER_DEPTH = 2


@dataclass
class StreamedDrafts:
    """Streamed speculation: no rounds; the target verifies at most num_speculative_tokens of the
    draft's offered tokens in each pass. An offer drafts that many beyond where the target is
    expected to be when it arrives: `lookahead` tokens past the C it was drafted from, the
    smoothed number the target committed between an offer's drafting and its arrival, in two
    parts: those the orchestrator heard of while the draft drafted (drafting_lag, learnt from
    every offer, sent or not) and those the target had committed beyond the orchestrator's C
    when a sent offer reached it (hop_lag: the offer's hop and the tokens' own). Where
    that is a token or more, the offer also carries branches: at each of those positions, the
    draft's next `fanout` candidates with the drafts that follow each (the target may well have
    committed one of them where the draft guessed wrong)."""

    num_speculative_tokens: int
    paces: StreamPaces = field(default_factory=StreamPaces)  # the orchestrator's, shared
    fanout: int = 0
    drafting_lag: float = 1.0
    hop_lag: float = 0.0
    weight: float = 0.3  # of each new observation in the smoothed lags

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"streamed speculation verifies at least 1 draft a pass, got "
                             f"{self.num_speculative_tokens}")

    def drafts_per_offer(self, max_num_speculative_tokens: int) -> int:
        """K past the expected lookahead (rounded up, a tenth of a token forgiven)."""
        return max(1, min(max_num_speculative_tokens,
                          self.num_speculative_tokens + max(0, math.ceil(self.lookahead - 0.1))))

    def branch_outcomes(self, drafts_per_offer: int) -> int:
        """The first positions of an offer of drafts_per_offer drafts to branch at: those the
        target is expected to have committed when it arrives (the lookahead, to the nearest
        token); 0: no branches."""
        if self.fanout == 0:
            return 0
        return max(0, min(drafts_per_offer - 1, math.ceil(self.lookahead - 0.5)))

    @property
    def lookahead(self) -> float:
        return self.drafting_lag + self.hop_lag

    def observe_drafting(self, grown: int) -> None:
        """C, as the orchestrator has it, grew by `grown` tokens between an offer's drafting and
        the draft's answer."""
        self.drafting_lag += self.weight * (max(0, grown) - self.drafting_lag)

    def observe_hop(self, ahead: int) -> None:
        """A sent offer reached the target when it had `ahead` tokens more than the orchestrator's
        C when the offer was sent."""
        self.hop_lag += self.weight * (max(0, ahead) - self.hop_lag)

    def plan(self, num_speculative_tokens: int, max_num_speculative_tokens: int) -> AheadPlan:
        return NO_AHEAD  # no rounds to draft ahead of

    def observe_ahead(self, observation: AheadObservation) -> None:
        pass
