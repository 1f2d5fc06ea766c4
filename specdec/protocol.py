"""The plain types both ends of the wire share: handles, sampling parameters, proposals, verify
outcomes, timings and a replica's identity. No torch, no gRPC, no protobuf: the model services and
the orchestrator (which imports no torch) both build on this module, and specdec.rpc.convert
turns these types into the messages of protos/specdec/v1 and back.

See docs/architecture.md ("The protocol") for what each field means on the wire.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from specdec.errors import IncompatibleModels, InvalidInput, OutOfRange

PROTOCOL_VERSION = "specdec.v1"
MAX_DRAFT_TOP_M = 64  # largest q~ a draft may send (entries)
MAX_DECODE_STEPS = 64  # most tokens one Decode call may decode
MAX_OFFER_TOKENS = 2 * MAX_DECODE_STEPS  # most drafts one Offer may hold
MAX_OFFER_BRANCHES = 64  # most branches one Offer may hold, each with at most MAX_OFFER_TOKENS
MIN_TEMPERATURE = 1e-6  # below this (and above 0) logits / temperature can overflow to NaN

Value = TypeVar("Value")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are sampled; temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidInput(f"temperature must be finite and >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidInput(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidInput(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.seed < 2**64:
            raise InvalidInput(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Handle:
    """Names one session's state on one replica. A call carrying the handle of the last applied
    call gets the stored answer again; see docs/architecture.md ("Handles and retries")."""

    session_id: str
    replica_id: str
    committed_length: int  # tokens of C the replica has taken into account
    epoch: int  # +1 on every prefill or re-prefill of the session on that replica


@dataclass(frozen=True)
class SparseDistribution:
    """The draft's truncated distribution q~ for one drafted token, exactly as it was sampled from
    (top-M entries, renormalised, float32 values); the target uses it as sent, never renormalising."""

    token_ids: tuple[int, ...]  # (M,), distinct
    probs: tuple[float, ...]  # (M,)


@dataclass(frozen=True)
class Proposal:
    """A draft's proposal for one round: K token ids and, when sampling, the q~ each was drawn from."""

    token_ids: tuple[int, ...]  # (K,)
    distributions: tuple[SparseDistribution, ...] = ()  # (K,) when sampling, () when greedy
    fed_tokens: int = 0  # tokens the draft fed for it: catch-up plus d1 .. d(K-1)
    # A lookup's proposal: the match each token rests on, in context tokens ((K,); () from a model)
    match_lengths: tuple[int, ...] = ()

    @property
    def num_speculative_tokens(self) -> int:
        return len(self.token_ids)

    def first(self, count: int) -> Proposal:
        """The first count drafts (with their q~ and match lengths)."""
        return Proposal(self.token_ids[:count], self.distributions[:count], self.fed_tokens,
                        self.match_lengths[:count])


@dataclass(frozen=True)
class DraftOffer:
    """Drafts offered to a session while it decodes (the target's Offer): proposal.token_ids[i] is
    the draft's token for C's position start + i. A pass verifies, of the drafts after the
    session's current length, at most max_verified, if the ones before match C there. Each branch
    holds the drafts after one way C may leave them ("num_accepted of them, then next_token_id"),
    used once C holds that next_token_id (a branch's next_token_id is a guess at the target's
    token, not a draw: never verified as a draft)."""

    start: int
    proposal: Proposal
    max_verified: int
    branches: tuple[BranchProposal, ...] = ()

    def drafts_after(self, committed: Sequence[int], committed_from: int,
                     length: int) -> tuple[Proposal, bool]:
        """The drafts this offer holds for positions length, length + 1, ... (at most
        max_verified), given C's tokens from position committed_from up to length (committed),
        and whether they are a branch's: the proposal's, or those of the branch C has followed;
        none when C left them all, when the offer reaches back before committed_from, or when it
        holds nothing past length."""
        none = Proposal(token_ids=()), False
        skip = length - self.start
        if self.start < committed_from or skip < 0:
            return none
        known = tuple(committed[self.start - committed_from:])
        main = self.proposal.token_ids
        if skip < len(main) and known == main[:skip]:
            return _after(self.proposal, skip, self.max_verified), False
        for branch in self.branches:
            fixed = branch.num_accepted + 1  # the proposal's first num_accepted, then next_token_id
            if (fixed <= skip < fixed + branch.proposal.num_speculative_tokens
                    and known[:fixed] == (*main[:branch.num_accepted], branch.next_token_id)
                    and known[fixed:] == branch.proposal.token_ids[:skip - fixed]):
                return _after(branch.proposal, skip - fixed, self.max_verified), True
        return none


@dataclass(frozen=True)
class DecodeLookup:
    """Lookups in a Decode's own passes: where a pass has no offered drafts to verify, it verifies
    up to max_tokens tokens looked up in the session's own tokens (prompt lookup), as many of them
    as have, by the session's acceptance so far per match length, at least min_chance of being
    accepted together with the ones before them (the caller's price of a row, in tokens). Where
    the lookup finds nothing, up to head_max_tokens drafts of the replica's draft head, if it has
    one (specdec.draft_head), by the same price and the head's own probabilities."""

    max_tokens: int
    min_chance: float = 0.0
    head_max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or self.head_max_tokens < 0:
            raise InvalidInput(f"lookup max_tokens and head_max_tokens must be >= 0, got {self.max_tokens}, "
                               f"{self.head_max_tokens}")
        if not 0.0 <= self.min_chance <= 1.0:
            raise InvalidInput(f"lookup min_chance must be in [0, 1], got {self.min_chance}")


def _after(proposal: Proposal, skip: int, count: int) -> Proposal:
    end = skip + count
    return Proposal(proposal.token_ids[skip:end], proposal.distributions[skip:end])


@dataclass
class DraftTally:
    """What a Decode did with drafts of one source (those offered to it, or those it looked up
    itself): passes that verified some (of offered ones, passes that verified a branch's), how
    many they verified, how many of those were accepted."""

    passes: int = 0
    drafts: int = 0
    accepted: int = 0
    branch_passes: int = 0


@dataclass(frozen=True)
class BranchProposal:
    """A proposal drafted ahead for one outcome of the round being verified: "num_accepted drafts
    accepted, then next_token_id"."""

    num_accepted: int
    next_token_id: int
    proposal: Proposal


@dataclass(frozen=True)
class DraftedAhead:
    """The branches a draft drafted ahead while the target verified, and its top candidates at
    each outcome position j = 0 .. K (the drafted token excluded, best first)."""

    branches: tuple[BranchProposal, ...] = ()
    candidates: tuple[tuple[int, ...], ...] = ()

    def branch_for(self, num_accepted: int, next_token_id: int) -> Proposal | None:
        for branch in self.branches:
            if branch.num_accepted == num_accepted and branch.next_token_id == next_token_id:
                return branch.proposal
        return None

    def rank(self, num_accepted: int, next_token_id: int) -> int | None:
        """The 1-based rank of next_token_id among the candidates at that outcome; None when it
        is not among them (or none were sent)."""
        if not 0 <= num_accepted < len(self.candidates):
            return None
        candidates = self.candidates[num_accepted]
        return candidates.index(next_token_id) + 1 if next_token_id in candidates else None

    @property
    def fanout(self) -> int:
        """Candidates drafted per outcome (the largest count at any position)."""
        counts: dict[int, int] = {}
        for branch in self.branches:
            counts[branch.num_accepted] = counts.get(branch.num_accepted, 0) + 1
        return max(counts.values(), default=0)


@dataclass(frozen=True)
class VerifyOutcome:
    """The target's decision on one proposal (the terms are defined in specdec/sampling.py)."""

    num_accepted: int  # n in [0, K]
    next_token_id: int  # correction when n < K, bonus when n == K
    acceptance_signal: tuple[float, ...]  # per draft position: sum(min(p, q~)), or 1/0 if greedy


@dataclass(frozen=True)
class DecodedToken:
    """One token of a Decode: under sampling with the probability p(token) it had in the target's
    distribution at its position (temperature, top-k and top-p applied), whether its pass drew it
    or accepted it as a draft (either way it is distributed as p); None when greedy. Beside a
    draft's q~ at the same position, min(1, q~(token) / p(token)) averages to sum(min(p, q~)):
    how often a draft there would be accepted."""

    token_id: int
    probability: float | None = None


@dataclass(frozen=True)
class Timing:
    """What a model service reports about one call. Seconds."""

    compute_seconds: float  # the forward pass(es)
    queue_seconds: float  # waiting for the model thread
    # The batch the call ran in: rows (tokens fed) and sessions of the whole forward pass, all
    # sessions together; the mean over passes for a call that takes several (a Propose).
    pass_rows: float = 0.0
    pass_sessions: float = 0.0


@dataclass(frozen=True)
class CallTiming:
    """One call as the caller saw it. Seconds."""

    wall_seconds: float  # from sending the request to having the response
    compute_seconds: float = 0.0  # server-reported forward time
    queue_seconds: float = 0.0  # server-reported wait for the model thread
    pass_rows: float = 0.0  # server-reported rows of the pass(es) the call ran in (see Timing)
    pass_sessions: float = 0.0  # server-reported sessions in those passes

    @property
    def network_seconds(self) -> float:
        return max(0.0, self.wall_seconds - self.compute_seconds - self.queue_seconds)


@dataclass(frozen=True)
class Reply(Generic[Value]):
    """A model service's answer to a session call: the new handle, the value, the call's timing."""

    handle: Handle
    value: Value
    timing: CallTiming


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica's identity, limits and load (the Info RPC)."""

    protocol_version: str
    role: str  # "draft" | "target"
    model_id: str
    vocab_size: int
    tokenizer_hash: str
    max_context: int  # tokens
    max_num_speculative_tokens: int
    dtype: str
    device: str
    live_sessions: int
    cached_tokens: int
    load: float  # forward passes queued or running, over the queue bound
    replica_id: str
    eos_token_ids: tuple[int, ...] = ()
    max_sessions: int = 0
    max_cached_tokens: int = 0
    # Batching: the last forward pass's rows and sessions, and running totals since the start
    # (mean batch size over an interval = its change in pass_sessions_total / passes_total).
    pass_rows: int = 0
    pass_sessions: int = 0
    passes_total: int = 0
    pass_rows_total: int = 0
    pass_sessions_total: int = 0
    linear_packing: str = ""  # "any" (oneDNN's), MKL's row counts "8,17", "": none
    # Where it computes (specdec/compute_units.py): the machine, and "cpu:N" / "cuda:UUID" units.
    host_id: str = ""
    compute_units: tuple[str, ...] = ()
    # The pass lock its passes take (specdec/pass_lock.py lock_id: "dev:inode"), "" without one.
    pass_lock: str = ""


def check_token_ids(token_ids: Iterable[int], vocab_size: int, what: str) -> None:
    """The one vocabulary check: raises OutOfRange naming the first id outside [0, vocab_size)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise OutOfRange(f"{what}: token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_compatible(reference: ReplicaInfo, info: ReplicaInfo) -> None:
    """Raises IncompatibleModels unless info speaks the protocol and shares reference's vocabulary
    and tokenizer (draft and target must agree on what every token id means)."""
    if info.protocol_version != PROTOCOL_VERSION:
        raise IncompatibleModels(
            f"replica {info.replica_id} speaks {info.protocol_version!r}, not {PROTOCOL_VERSION!r}"
        )
    if info.vocab_size != reference.vocab_size:
        raise IncompatibleModels(
            f"{info.role} model {info.model_id!r} has a vocabulary of {info.vocab_size} tokens but "
            f"the target {reference.model_id!r} has {reference.vocab_size}: draft and target must "
            "share a tokenizer"
        )
    if info.tokenizer_hash and reference.tokenizer_hash and info.tokenizer_hash != reference.tokenizer_hash:
        raise IncompatibleModels(
            f"{info.role} model {info.model_id!r} uses a different tokenizer from the target "
            f"{reference.model_id!r} (tokenizer hash {info.tokenizer_hash[:12]} vs "
            f"{reference.tokenizer_hash[:12]})"
        )

