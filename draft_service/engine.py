"""The draft's model work for one session, in plain Python and torch (no protobuf, no gRPC).

Cache invariant (docs/architecture.md, "The cache invariant"): after a Propose of K tokens the
cache holds C followed by d1 .. d(K-1) (dK is never fed). The next Propose keeps the longest prefix
of the cache that is still committed, feeds the rest of C, and drafts from there. So a rejection
costs no extra round trip: the draft reconciles on the call it gets anyway.

Drafting ahead (pipelining): while the target verifies d1 .. dK, `branch` drafts the next round
for likely outcomes "j accepted, then t", each on a fork of the cache (a copy of C + d1 .. dj),
so the session's cache is never touched by a branch. The next Propose whose new committed tokens
begin with d1 .. dj t takes that branch's fork as the session's cache: it holds C' + b1 .. b(K'-1),
the very state a Propose of K' tokens after C' leaves, with the very drafts (a draft depends only
on the committed prefix, the seed and its position); where C grew on by b1 .. bi (streamed
offers' branches), the drafts after them are kept as after any proposal. Any other Propose drops
the branches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.kv_cache import SequenceCache
from specdec.models import LoadedModel
from specdec.protocol import Proposal, SparseDistribution
from specdec.ragged import Feed, Job
from specdec.sampling import (
    SamplingParams,
    draft_distribution,
    keyed_uniform,
    process_logits,
    round_uniform,
    sample_categorical,
    sample_sparse,
)

# Candidate ids kept per drafted position: the fan-out is at most this, and the orchestrator learns
# from the rest how often a larger fan-out would have hit.
NUM_CANDIDATES = 8


@dataclass
class Drafted:
    """Drafts after a committed prefix: the tokens, their q~ (sampling mode only), and at each
    drafted position the draft's top candidate ids, best first (the drafted token among them)."""

    token_ids: list[int]
    distributions: list[SparseDistribution]
    candidates: list[list[int]]

    def first(self, count: int) -> Drafted:
        return Drafted(self.token_ids[:count], self.distributions[:count], self.candidates[:count])

    def proposal(self, fed_tokens: int) -> Proposal:
        return Proposal(tuple(self.token_ids), tuple(self.distributions), fed_tokens)


@dataclass
class Branch:
    """The drafts that follow one outcome of the round being verified, "j drafts accepted, then
    token t", and a cache of their own: C + d1 .. dj + t + b1 .. b(K'-1), the state a Propose of
    K' tokens after that outcome would leave."""

    num_accepted: int
    next_token_id: int
    cache: SequenceCache
    drafted: Drafted


@dataclass
class DraftSessionState:
    cache: SequenceCache
    committed: list[int]  # C as far as the draft has been told
    sampling: SamplingParams
    last: Drafted | None = None  # the last proposal's drafts, after `committed`
    # Drafted ahead for the outcomes of the last proposal, by the committed tokens each follows
    # (d1 .. dj + t): the next Propose adopts the one that matches, and drops them all.
    branches: dict[tuple[int, ...], Branch] = field(default_factory=dict)


class DraftEngine:
    def __init__(self, loaded: LoadedModel, top_m: int) -> None:
        self.loaded = loaded
        self.top_m = top_m

    def prefill(self, token_ids: list[int], sampling: SamplingParams) -> Job[DraftSessionState]:
        cache = SequenceCache(self.loaded.model)
        yield Feed(cache, token_ids)
        return DraftSessionState(cache=cache, committed=list(token_ids), sampling=sampling)

    def propose(
        self, state: DraftSessionState, new_committed: list[int], num_speculative_tokens: int
    ) -> Job[Proposal]:
        state.committed.extend(new_committed)
        followed = _branch_followed(state.branches, new_committed)
        state.branches = {}
        last, state.last = state.last, None
        if followed is not None:
            # C took the outcome a branch was drafted for (drafted ahead while the target verified,
            # or beside a streamed offer): its cache and drafts are the session's now (the same
            # drafts a Propose would draft: they depend only on the committed prefix, the seed and
            # the position).
            key, branch = followed
            state.cache, last, new_committed = branch.cache, branch.drafted, new_committed[len(key):]
            if not new_committed and len(last.token_ids) >= num_speculative_tokens:
                state.last = last.first(num_speculative_tokens)
                state.cache.truncate(len(state.committed) + num_speculative_tokens - 1)
                return state.last.proposal(fed_tokens=0)
        committed = state.committed
        cache = state.cache
        # (C exactly at a followed branch's outcome: all its drafts are still ahead)
        reused = last if followed is not None and not new_committed else _drafts_still_ahead(last, new_committed)
        if reused is not None and len(cache) == len(committed) + len(reused.token_ids) - 1:
            # C grew by the last proposal's first drafts only (as it does under streamed
            # speculation): its other drafts are the ones a Propose would draft now (they depend
            # only on the prefix, the seed and the position), and the cache holds C and all of
            # them but the last. Draft on after them.
            if len(reused.token_ids) >= num_speculative_tokens:
                state.last = reused.first(num_speculative_tokens)
                cache.truncate(len(committed) + num_speculative_tokens - 1)
                return state.last.proposal(fed_tokens=0)
            position = len(committed) + len(reused.token_ids)
            logits = (yield Feed(cache, [reused.token_ids[-1]]))[-1]
            more = yield from self._draft(cache, logits, state.sampling, position,
                                          num_speculative_tokens - len(reused.token_ids))
            state.last = Drafted(reused.token_ids + more.token_ids, reused.distributions + more.distributions,
                                 reused.candidates + more.candidates)
            return state.last.proposal(fed_tokens=len(more.token_ids))
        keep = min(_common_prefix(cache.token_ids, committed), len(committed) - 1)
        cache.truncate(keep)  # at least C[-1] is fed, so its logits score d1
        to_feed = committed[keep:]
        logits = (yield Feed(cache, to_feed))[-1]  # (V,)
        state.last = yield from self._draft(cache, logits, state.sampling, len(committed), num_speculative_tokens)
        return state.last.proposal(fed_tokens=len(to_feed) + num_speculative_tokens - 1)

    def bonus_logits(self, state: DraftSessionState) -> Job[tuple[SequenceCache, torch.Tensor]]:
        """Feeds dK (never fed by a Propose) into a fork of the cache after d1 .. d(K-1): the
        logits of the position after all K drafts, where the target's bonus token comes from."""
        drafted = _last(state)
        fork = state.cache.fork(len(state.committed) + len(drafted.token_ids) - 1)
        logits = (yield Feed(fork, [drafted.token_ids[-1]]))[-1]
        return fork, logits

    def branch(self, state: DraftSessionState, parent: SequenceCache, num_accepted: int,
               next_token_id: int, num_speculative_tokens: int) -> Job[Branch]:
        """Drafts num_speculative_tokens after the outcome "num_accepted drafts accepted, then
        next_token_id", on a fork of `parent` (the session's cache, or bonus_logits' fork when
        every draft is accepted): the session's own cache is left as it is."""
        length = len(state.committed) + num_accepted  # C + d1 .. dj
        cache = parent.fork(length)
        logits = (yield Feed(cache, [next_token_id]))[-1]
        drafted = yield from self._draft(cache, logits, state.sampling, length + 1, num_speculative_tokens)
        return Branch(num_accepted, next_token_id, cache, drafted)

    def _draft(self, cache: SequenceCache, logits: torch.Tensor, sampling: SamplingParams,
               position: int, num_speculative_tokens: int) -> Job[Drafted]:
        """Drafts from `logits` (those of the last committed token) at sequence positions
        position, position + 1, ...; feeds every draft but the last."""
        drafted = Drafted([], [], [])
        for i in range(num_speculative_tokens):
            token, distribution = self._draw(logits, sampling, position + i)
            drafted.token_ids.append(token)
            drafted.candidates.append(top_candidates(logits))
            if distribution is not None:
                drafted.distributions.append(distribution)
            if i < num_speculative_tokens - 1:
                logits = (yield Feed(cache, [token]))[-1]
        return drafted

    def _draw(
        self, logits: torch.Tensor, sampling: SamplingParams, position: int
    ) -> tuple[int, SparseDistribution | None]:
        if sampling.greedy:
            return int(logits.argmax()), None
        ids, wire_probs = draft_distribution(logits, sampling, self.top_m)
        # Sample from the very vector that is sent, read the way the target reads it.
        token = sample_sparse(ids, wire_probs, keyed_uniform(sampling.seed, position, "draft"))
        return token, SparseDistribution(tuple(ids.tolist()), tuple(wire_probs.tolist()))


def top_candidates(logits: torch.Tensor) -> list[int]:
    """The NUM_CANDIDATES most likely ids under `logits`, best first."""
    return logits.topk(min(NUM_CANDIDATES, logits.shape[-1])).indices.tolist()


def bonus_candidates(logits: torch.Tensor, sampling: SamplingParams, round_start: int) -> list[int]:
    """The draft's candidates for a round's bonus token (every draft accepted), best first, from
    its logits at the bonus position; round_start: the committed length before the round.

    Greedy, its most likely ids. Sampled, first the token the draft's own distribution gives at the
    uniform the target draws the bonus with (sampling.round_uniform), by the target's procedure
    (inverse CDF in token-id order): a coupled guess. Where the two distributions are close, the
    two draws at one uniform mostly land on the same token, far more often than the target's
    sampled token is the draft's most likely one."""
    top = top_candidates(logits)
    if sampling.greedy:
        return top
    probs = process_logits(logits, sampling).unsqueeze(0)  # (1, V)
    uniform = torch.tensor([round_uniform(sampling.seed, round_start)], dtype=torch.float64)
    coupled = int(sample_categorical(probs, uniform)[0])
    return [coupled, *(token for token in top if token != coupled)][:NUM_CANDIDATES]


def _branch_followed(branches: dict[tuple[int, ...], Branch],
                     new_committed: list[int]) -> tuple[tuple[int, ...], Branch] | None:
    """The branch whose outcome new_committed starts with, and that outcome."""
    for key, branch in branches.items():
        if tuple(new_committed[:len(key)]) == key:
            return key, branch
    return None


def _drafts_still_ahead(last: Drafted | None, new_committed: list[int]) -> Drafted | None:
    """The last proposal's drafts after new_committed, when C grew by its first drafts and no
    other token (a round's outcome always ends with the target's own token: then None)."""
    if last is None or not new_committed or len(new_committed) >= len(last.token_ids):
        return None
    if last.token_ids[:len(new_committed)] != list(new_committed):
        return None
    skip = len(new_committed)
    return Drafted(last.token_ids[skip:], last.distributions[skip:], last.candidates[skip:])


def _last(state: DraftSessionState) -> Drafted:
    if state.last is None or not state.last.token_ids:
        raise ValueError("the session has no proposal to draft ahead from")
    return state.last


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
