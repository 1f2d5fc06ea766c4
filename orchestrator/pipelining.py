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
from dataclasses import dataclass
from typing import Literal, Protocol

PipelineMode = Literal["off", "on", "auto", "stream"]
PIPELINE_MODES: tuple[PipelineMode, ...] = ("off", "on", "auto", "stream")
MAX_PIPELINE_FANOUT = 8  # the draft's candidates per position (draft_service/engine.py)
DEFAULT_PIPELINE_FANOUT = 3


@dataclass(frozen=True)
class AheadPlan:
    """What a round asks the draft to draft ahead: fanout 0 is a plain Propose."""

    fanout: int = 0
    branch_num_speculative_tokens: int = 0

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


@dataclass
class StreamedDrafts:
    """Streamed speculation: no rounds; the target verifies at most num_speculative_tokens of the
    draft's offered tokens in each pass. An offer drafts that many beyond where the target is
    expected to be when it arrives: `lookahead` tokens past the C it was drafted from, the
    smoothed number the target committed between an offer's drafting and its arrival."""

    num_speculative_tokens: int
    lookahead: float = 1.0
    weight: float = 0.3  # of each new observation in the smoothed lookahead

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"streamed speculation verifies at least 1 draft a pass, got "
                             f"{self.num_speculative_tokens}")

    def drafts_per_offer(self, max_num_speculative_tokens: int) -> int:
        """K past the expected lookahead (rounded up, a tenth of a token forgiven)."""
        return max(1, min(max_num_speculative_tokens,
                          self.num_speculative_tokens + max(0, math.ceil(self.lookahead - 0.1))))

    def observe_lag(self, committed_meanwhile: int) -> None:
        """An offer drafted from a C of length n arrived at the target when it had n + committed_meanwhile."""
        self.lookahead += self.weight * (max(0, committed_meanwhile) - self.lookahead)

    def plan(self, num_speculative_tokens: int, max_num_speculative_tokens: int) -> AheadPlan:
        return NO_AHEAD  # no rounds to draft ahead of

    def observe_ahead(self, observation: AheadObservation) -> None:
        pass
