"""The seam between the orchestrator loop and whatever chooses K each round.

The loop asks a policy for K before each round and reports what the round measured after it.
Fixed K (K = 0 is speculation off) and Hugging Face's heuristic live here; the adaptive controller
(docs/architecture.md, "Choosing K") implements the same protocol in orchestrator/k_controller.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from orchestrator.pipelining import PipelineMode
from specdec.protocol import MAX_DECODE_STEPS

SpeculationMode = Literal["off", "fixed", "adaptive", "heuristic"]
SPECULATION_MODES: tuple[SpeculationMode, ...] = ("off", "fixed", "adaptive", "heuristic")


@dataclass(frozen=True)
class Speculation:
    """What a request asks of speculation; None leaves a field to the server's default."""

    mode: SpeculationMode | None = None
    # fixed K, the heuristic's starting K, or the adaptive controller's maximum
    num_speculative_tokens: int | None = None
    # drafting ahead while the target verifies (orchestrator/pipelining.py): off, on or auto
    pipeline: PipelineMode | None = None
    pipeline_fanout: int | None = None  # candidates per outcome when on; the maximum when auto


@dataclass(frozen=True)
class DecodedPasses:
    """The target's passes behind a Decode's K = 0 rounds, server-reported: each pass's mean time
    (seconds) and its mean rows and sessions (this session's rows and everyone else's); own_rows,
    this session's rows per pass (1, and the drafts offered to its passes or looked up in them);
    count, how many passes."""

    seconds: float
    rows: float
    sessions: float
    own_rows: float = 1.0
    count: int = 1


@dataclass(frozen=True)
class RoundObservation:
    """What one guess-verify round measured. Times in seconds."""

    num_speculative_tokens: int  # K used this round (0: no draft call)
    num_accepted: int  # n in [0, K]
    acceptance_signal: tuple[float, ...]  # per draft position, from the target (len K)
    draft_compute_seconds: float  # server-reported; 0 when K = 0
    draft_wall_seconds: float  # client wall time of the Propose call; 0 when K = 0
    draft_fed_tokens: int  # tokens the draft fed this round: catch-up + K - 1 drafts
    verify_compute_seconds: float  # server-reported time of the one forward pass it ran in
    verify_wall_seconds: float  # client wall time of the Verify call
    # The verify pass as a whole: rows (tokens fed) and sessions of all sessions batched into it,
    # this round's K + 1 rows included. 0 means unknown (a server that predates batching) and is
    # taken as alone: K + 1 rows, 1 session.
    verify_pass_rows: float = 0.0
    verify_pass_sessions: float = 0.0
    # The proposal was drafted ahead during the previous round's verify (a pipelining hit): no
    # draft call was waited for, and the draft figures above are 0.
    drafted_ahead: bool = False
    # The draft drafted the next round ahead during this round's verify (its compute may have
    # slowed the verify pass where the two share cores).
    drafting_ahead: bool = False
    # A lookup proposed this round's drafts (orchestrator/local_draft.py): each token's match
    # length, one per draft; the draft figures above are then the lookup's, not a model's. Empty:
    # the model draft proposed (or nothing did).
    lookup_match_lengths: tuple[int, ...] = ()

    @property
    def pass_rows(self) -> int:
        """Rows of the verify pass; K + 1 when unknown, never fewer than this round's own."""
        own = self.num_speculative_tokens + 1
        return max(own, round(self.verify_pass_rows)) if self.verify_pass_rows > 0 else own

    @property
    def pass_sessions(self) -> float:
        """Sessions in the verify pass, this one included; 1 when unknown."""
        return max(1.0, self.verify_pass_sessions)


class KPolicy(Protocol):
    def choose(self, max_num_speculative_tokens: int) -> int:
        """K for the next round, in [0, max_num_speculative_tokens].

        max_num_speculative_tokens already accounts for the tokens left (K <= remaining - 1), the
        servers' limit, and draft availability (0 when no draft replica can serve).
        """

    def observe(self, observation: RoundObservation) -> None:
        """Record one finished round."""

    def estimates(self) -> dict[str, float]:
        """Current estimates by name, reported in the request's stats."""


@runtime_checkable
class LookupChooser(Protocol):
    """A policy that decides after a lookup has answered how many of its tokens to verify
    (the adaptive controller: orchestrator/lookup_policy.py). Other policies verify a lookup's
    proposal of up to their K whole."""

    def choose_lookup(self, match_lengths: Sequence[int], model_num_speculative_tokens: int | None) -> int:
        """0 (the round goes without the lookup: the model draft's at the K choose() gave, or
        K = 0 where model_num_speculative_tokens is None) or how many of its tokens to verify."""

    def decode_lookup_min_chance(self) -> float:
        """The chance of being accepted a token looked up by the target in a Decode pass needs to
        pay for its row there (specdec.protocol.DecodeLookup.min_chance)."""

    def observe_decoded_passes(self, passes: DecodedPasses) -> None:
        """The target's passes behind a Decode this policy did not choose (the speculation guard's
        K = 0): their time and load only, which price those rows."""


@runtime_checkable
class PlainStretches(Protocol):
    """A policy that can say ahead how many K = 0 rounds it will run, so that the loop decodes them
    in one streamed target call (a Decode) instead of a Verify each (the adaptive controller, while
    its choice is K = 0: until its next probe). Other policies are asked for K every round."""

    def plain_rounds(self, shadow: bool = False) -> int:
        """K = 0 rounds this policy commits to from now on, whatever they commit; 0: ask choose().
        shadow: the caller can run a probe beside them (ShadowProbes)."""

    def observe_plain(self, rounds: int, seconds_per_token: float | None,
                      passes: DecodedPasses | None = None) -> None:
        """Record K = 0 rounds run as one Decode, at seconds_per_token of the call's wall time;
        None when the call was cut short of the rounds plain_rounds() committed to (the request's
        end, the context's, or the guard's): its round trip, spread over fewer tokens, is not the
        pace of a stretch. passes: the target passes the rounds ran in (None: not reported)."""

    def would_draft(self) -> bool:
        """Whether, as its estimates stand, the policy would draft now (K > 0, or drafting ahead
        under pipelining auto) rather than stretch K = 0: a new request's first choice."""

    def measures_beside(self) -> bool:
        """Whether its K = 0 stretches are still measuring, beside them, what decides whether it
        drafts (under pipelining auto the pool's candidate ranks): a request that streamed instead
        would measure none of it."""

    def observe_stream_pace(self, seconds_per_token: float, passes: DecodedPasses | None = None) -> None:
        """Record a streamed Decode call (no rounds; MIN_PACE_TOKENS tokens or more) at
        seconds_per_token: the pace of the Decode a stretch runs, which prices K = 0."""


@runtime_checkable
class ShadowProbes(Protocol):
    """A policy that can measure acceptance beside a stretch of K = 0 rounds instead of in a probe
    round of its own (the adaptive controller of a session with a model draft): the draft proposes
    from where the stretch starts while the target decodes it. Under greedy decoding the drafts
    that match the decoded tokens are exactly those a Verify would have accepted; under sampling
    each decoded token y up to the first draft it differs from (the drafts after that follow
    another prefix) gives min(1, q~(y) / p(y)), whose mean is that position's acceptance."""

    def shadow_probe(self) -> int:
        """K of the probe that plain_rounds(shadow=True) took for the coming stretch; 0: none."""

    @property
    def shadow_probe_fanout(self) -> int:
        """That probe's fan-out, read before shadow_probe(): > 0 where it drafts ahead (a Speculate)
        to measure the draft's candidate ranks, its outcome read off the stretch's tokens and told
        to the pipeline policy (observe_ahead) as a drafted-ahead round's."""

    def observe_shadow(self, observation: RoundObservation, tested: int, behind: int) -> None:
        """Record it: its K, the drafts matched and the Propose's timings (no target figures);
        under sampling its acceptance_signal holds min(1, q~(y) / p(y)) for each position tested
        (empty when greedy); tested: the positions the stretch tested (greedy: the drafts it had
        tokens for); behind: tokens the draft has not seen since."""


@dataclass
class FixedK:
    """The same K every round (K = 0 is target-only decoding)."""

    num_speculative_tokens: int

    def choose(self, max_num_speculative_tokens: int) -> int:
        return max(0, min(self.num_speculative_tokens, max_num_speculative_tokens))

    def observe(self, observation: RoundObservation) -> None:
        pass

    def estimates(self) -> dict[str, float]:
        return {}

    def plain_rounds(self, shadow: bool = False) -> int:
        """K = 0 every round: as many as a Decode takes (PlainStretches); none at K > 0."""
        return MAX_DECODE_STEPS if self.num_speculative_tokens == 0 else 0

    def observe_plain(self, rounds: int, seconds_per_token: float | None,
                      passes: DecodedPasses | None = None) -> None:
        pass

    def would_draft(self) -> bool:
        return self.num_speculative_tokens > 0

    def measures_beside(self) -> bool:
        return False

    def observe_stream_pace(self, seconds_per_token: float, passes: DecodedPasses | None = None) -> None:
        pass


class HeuristicK:
    """Hugging Face's schedule (assisted generation, "heuristic"): +2 after a round that accepted
    every draft, -1 otherwise, never below 1. For benchmarks."""

    def __init__(self, initial_num_speculative_tokens: int = 5, max_num_speculative_tokens: int | None = None) -> None:
        if initial_num_speculative_tokens < 1:
            raise ValueError("initial_num_speculative_tokens must be >= 1")
        self._max_num_speculative_tokens = max_num_speculative_tokens
        self._num_speculative_tokens = self._capped(initial_num_speculative_tokens)

    def _capped(self, num_speculative_tokens: int) -> int:
        if self._max_num_speculative_tokens is None:
            return num_speculative_tokens
        return min(num_speculative_tokens, self._max_num_speculative_tokens)

    def choose(self, max_num_speculative_tokens: int) -> int:
        return max(0, min(self._num_speculative_tokens, max_num_speculative_tokens))

    def observe(self, observation: RoundObservation) -> None:
        if observation.num_speculative_tokens == 0:
            return
        if observation.num_accepted == observation.num_speculative_tokens:
            self._num_speculative_tokens = self._capped(self._num_speculative_tokens + 2)
        else:
            self._num_speculative_tokens = max(1, self._num_speculative_tokens - 1)

    def estimates(self) -> dict[str, float]:
        return {"num_speculative_tokens": float(self._num_speculative_tokens)}
