"""The target's model work for one session, in plain Python and torch (no protobuf, no gRPC).

Cache invariant (docs/architecture.md, "The cache invariant"): between calls the cache holds
exactly C[:-1]; C[-1] was sampled by this model (or given on resume) and is fed first by the next
Verify, whose logits at C[-1] score the first draft token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.chain_acceptance import OfferOrHead
from specdec.errors import InvalidInput, OutOfRange
from specdec.kv_cache import SequenceCache
from specdec.lookup import NgramProposer
from specdec.lookup_acceptance import LookupAcceptance, LookupPriors
from specdec.models import LoadedModel
from specdec.draft_head import DraftHead
from specdec.ragged import Feed, HeadFeed, Job
from specdec.protocol import (
    MAX_DECODE_STEPS,
    MAX_DRAFT_TOP_M,
    DecodedToken,
    DecodeLookup,
    DraftOffer,
    DraftTally,
    Proposal,
    SparseDistribution,
    check_token_ids,
)
from specdec.sampling import (
    SamplingParams,
    VerifyOutcome,
    keyed_uniform,
    process_logits,
    round_uniform,
    sample_categorical,
    sparse_to_dense,
    verify_greedy,
    verify_sampled_one,
)


_NO_DRAFTS = Proposal(token_ids=())
# Where a Decode pass's drafts came from.
_OFFERED, _LOOKED_UP, _HEADED = "offered", "looked up", "head"


@dataclass
class SessionLookup:
    """A session's lookups in its Decode passes: the prompt lookup over its tokens, and how often
    its looked-up tokens were accepted, per match length (the replica's figures its prior)."""

    proposer: NgramProposer
    acceptance: LookupAcceptance


@dataclass
class TargetSessionState:
    cache: SequenceCache  # holds C[:-1]
    last_token_id: int  # C[-1]
    sampling: SamplingParams
    tokens: list[int]  # C
    lookup: SessionLookup | None = None  # from its first Decode with lookups
    # With a draft head: the last hidden state at the row that chose C[-1] (what the head drafts
    # from), None where no pass of this replica chose it (after a prompt or a rebuild).
    head_hidden: torch.Tensor | None = None
    # How often its offered drafts and its head's were accepted: a pass that has both verifies the
    # chain worth more (specdec.chain_acceptance).
    sources: OfferOrHead = field(default_factory=OfferOrHead.new)

    @property
    def committed_length(self) -> int:
        return len(self.cache) + 1


class TargetEngine:
    def __init__(self, loaded: LoadedModel, max_num_speculative_tokens: int,
                 row_price: Callable[[], float] = lambda: 0.0, head: DraftHead | None = None) -> None:
        self.loaded = loaded
        # Drafts in a Decode's own passes where nothing else proposes (specdec.draft_head).
        self.head = head
        self.max_num_speculative_tokens = max_num_speculative_tokens
        # The chance a looked-up token needs to pay for its row, as this replica measures its
        # passes (specdec.pass_costs); a Decode's caller may ask for more.
        self.row_price = row_price
        # The replica's acceptance of looked-up tokens per match length, greedy and sampled apart:
        # a session's first lookups start from it.
        self.lookup_priors = {True: LookupPriors(), False: LookupPriors()}

    def prefill(
        self, token_ids: list[int], sampling: SamplingParams, resume: bool, prompt_length: int = 0
    ) -> Job[tuple[TargetSessionState, int | None]]:
        """Feeds the prompt and samples C's first new token (or rebuilds a committed C: its first
        prompt_length tokens fed as a prompt was, the rest one by one, as the rounds fed them)."""
        cache = SequenceCache(self.loaded.model)
        if resume:
            fed = token_ids[:-1]
            prompt = prompt_length if 0 < prompt_length <= len(fed) else len(fed)
            if prompt:
                yield Feed(cache, fed[:prompt])
            if prompt < len(fed):
                yield Feed(cache, fed[prompt:], one_by_one=True)
            return TargetSessionState(cache, token_ids[-1], sampling, list(token_ids)), None
        feed = Feed(cache, token_ids, keep_hidden=self.head is not None)
        logits = yield feed  # (1, V): the last row
        position = len(token_ids)
        first = self._sample(logits, sampling, keyed_uniform(sampling.seed, position, "target"))
        head_hidden = None if feed.hidden is None else feed.hidden[-1]
        return TargetSessionState(cache, first, sampling, [*token_ids, first], head_hidden=head_hidden), first

    def verify(self, state: TargetSessionState, proposal: Proposal) -> Job[VerifyOutcome]:
        """One round: feeds [C[-1], d1..dK] in one pass, accepts a prefix, truncates to C'[:-1]."""
        outcome, _ = yield from self._verify(state, proposal)
        return outcome

    def _verify(self, state: TargetSessionState, proposal: Proposal
                ) -> Job[tuple[VerifyOutcome, torch.Tensor | None]]:
        """verify, with the round's processed target distributions ((K + 1, V); None if greedy)."""
        num_speculative_tokens = len(proposal.token_ids)
        committed = state.committed_length
        if committed + num_speculative_tokens > self.loaded.max_context:
            raise OutOfRange(
                f"verifying {num_speculative_tokens} tokens at length {committed} exceeds the max context "
                f"{self.loaded.max_context}"
            )
        rows = [state.last_token_id, *proposal.token_ids]
        feed = Feed(state.cache, rows, keep_all=True, keep_hidden=self.head is not None)
        logits = yield feed  # (K + 1, V)
        drafts = torch.tensor(proposal.token_ids, dtype=torch.long)  # (K,)
        sampling = state.sampling
        target_probs = None
        if sampling.greedy:
            outcome = verify_greedy(logits, drafts)
        else:
            target_probs = process_logits(logits, sampling)
            outcome = verify_sampled_one(
                target_probs=target_probs,
                draft_token_ids=drafts,
                draft_probs=self._dense_drafts(proposal),
                accept_uniforms=torch.tensor(
                    [keyed_uniform(sampling.seed, committed + i, "accept") for i in range(num_speculative_tokens)],
                    dtype=torch.float64,
                ),
                final_uniform=round_uniform(sampling.seed, committed),
            )
        state.cache.truncate(committed + outcome.num_accepted)
        state.last_token_id = outcome.next_token_id
        state.head_hidden = None if feed.hidden is None else feed.hidden[outcome.num_accepted]
        state.tokens.extend((*proposal.token_ids[:outcome.num_accepted], outcome.next_token_id))
        return outcome, target_probs

    def decode(self, state: TargetSessionState, max_tokens: int,
               emit: Callable[[DecodedToken], None] = lambda token: None,
               stopped: Callable[[], bool] = lambda: False,
               offered: Callable[[], DraftOffer | None] = lambda: None,
               tally: DraftTally | None = None, lookup: DecodeLookup | None = None,
               looked_up: DraftTally | None = None, headed: DraftTally | None = None) -> Job[list[DecodedToken]]:
        """Plain decoding: up to max_tokens Verify rounds without drafts, one pass each, so every
        token is exactly the one those rounds would return (under sampling with its probability
        p, DecodedToken); emit(token) after each. Stops after an end-of-sequence token of the
        model's, at the max context, or once stopped() (checked before each step).

        offered() is the session's latest DraftOffer (streamed speculation): where it holds drafts
        after C as it is now, the step verifies them as a Verify round would (the round's tokens
        each emitted, with its p at its row), so the tokens are the same greedy and distributed the
        same sampled; a round stops short of max_tokens and the max context. tally counts them.

        lookup: a step with no offered drafts verifies, in the same way, tokens looked up in C
        itself (_looked_up); looked_up counts them. Where the lookup finds none either and the
        replica has a draft head, up to lookup.head_max_tokens of the head's drafts (_headed);
        headed counts them. A step with offered drafts and the head's both verifies the chain
        worth more by how often each source's drafts were accepted in the session so far
        (state.sources)."""
        if not 1 <= max_tokens <= MAX_DECODE_STEPS:
            raise InvalidInput(f"max_tokens must be in [1, {MAX_DECODE_STEPS}], got {max_tokens}")
        if state.committed_length >= self.loaded.max_context:
            raise OutOfRange(f"decoding at length {state.committed_length} exceeds the max context "
                             f"{self.loaded.max_context}")
        tokens: list[DecodedToken] = []
        committed_from = state.committed_length - 1  # C[committed_from:] = [C[-1], *tokens]
        known = [state.last_token_id]
        while len(tokens) < max_tokens and state.committed_length < self.loaded.max_context and not stopped():
            room = min(max_tokens - len(tokens), self.loaded.max_context - state.committed_length) - 1
            proposal, from_branch, source = _NO_DRAFTS, False, None
            offer = offered() if room > 0 else None
            if offer is not None:
                proposal, from_branch = offer.drafts_after(known, committed_from, state.committed_length)
                proposal = proposal.first(room)
                source = _OFFERED if proposal.token_ids else None
            if source is None and lookup is not None and room > 0:
                proposal = self._looked_up(state, min(room, lookup.max_tokens), lookup.min_chance)
                source = _LOOKED_UP if proposal.token_ids else None
            if (source in (None, _OFFERED) and lookup is not None and lookup.head_max_tokens > 0 and room > 0
                    and self.head is not None and state.head_hidden is not None):
                headed_drafts = yield from self._headed(state, min(room, lookup.head_max_tokens), lookup.min_chance)
                if headed_drafts.token_ids and (source is None or state.sources.prefers_head(
                        len(proposal.token_ids), len(headed_drafts.token_ids))):
                    proposal, from_branch, source = headed_drafts, False, _HEADED
            outcome, target_probs = yield from self._verify(state, proposal)
            round_ids = [*proposal.token_ids[:outcome.num_accepted], outcome.next_token_id]
            counted = {_OFFERED: tally, _LOOKED_UP: looked_up, _HEADED: headed}.get(source)
            if counted is not None:
                counted.passes += 1
                counted.drafts += len(proposal.token_ids)
                counted.accepted += outcome.num_accepted
                counted.branch_passes += from_branch
            if source == _LOOKED_UP:
                assert state.lookup is not None
                state.lookup.acceptance.update(proposal.match_lengths, outcome.num_accepted)
            elif source is not None:
                chain = state.sources.offered if source == _OFFERED else state.sources.head
                chain.observe(len(proposal.token_ids), outcome.num_accepted)
            for row, token_id in enumerate(round_ids):
                # p(y) at the token's own row: whether drafted or drawn there, y is distributed as p
                probability = (None if target_probs is None
                               else float(target_probs[row, token_id] / target_probs[row].sum()))
                token = DecodedToken(token_id, probability)
                tokens.append(token)
                known.append(token_id)
                emit(token)
            if any(token_id in self.loaded.eos_token_ids for token_id in round_ids):
                break
        return tokens

    def _looked_up(self, state: TargetSessionState, max_tokens: int, min_chance: float) -> Proposal:
        """Up to max_tokens tokens to follow C, looked up in C itself (the last 2 to 4 tokens
        matched where they occurred before, the continuation there proposed), as many of them as
        have at least min_chance (or the replica's own price of a row, if higher) of being
        accepted together with the ones before them, by the session's acceptance of looked-up
        tokens so far per match length."""
        max_tokens = min(max_tokens, self.max_num_speculative_tokens)
        if max_tokens <= 0:
            return _NO_DRAFTS
        if state.lookup is None:
            state.lookup = SessionLookup(
                NgramProposer(), LookupAcceptance(priors=self.lookup_priors[state.sampling.greedy]))
        found = state.lookup.proposer.propose(state.tokens, max_tokens)
        if found.token_ids:
            min_chance = max(min_chance, self.row_price())
        chance, count = 1.0, 0
        for alpha in state.lookup.acceptance.alphas(found.match_lengths):
            chance *= alpha
            if chance < min_chance:
                break
            count += 1
        return found.first(count).proposal(state.sampling)

    def _headed(self, state: TargetSessionState, max_tokens: int, min_chance: float) -> Job[Proposal]:
        """Up to max_tokens drafts of the draft head after C (from the hidden state that chose
        C[-1]), as many as have at least min_chance (or the replica's own price of a row, if
        higher) of being accepted together with the ones before them, by the head's own
        probabilities; one-hot q~ when sampling."""
        max_tokens = min(max_tokens, self.max_num_speculative_tokens)
        assert self.head is not None and state.head_hidden is not None
        if max_tokens <= 0:
            return _NO_DRAFTS
        min_chance = max(min_chance, self.row_price())
        drafts, chances = yield HeadFeed(self.head, state.head_hidden, state.last_token_id, max_tokens, min_chance)
        together, count = 1.0, 0
        for chance in chances:
            together *= chance
            if together < min_chance:
                break
            count += 1
        token_ids = drafts[:count]
        distributions = () if state.sampling.greedy else tuple(
            SparseDistribution((token,), (1.0,)) for token in token_ids)
        return Proposal(token_ids, distributions)

    def _dense_drafts(self, proposal: Proposal) -> torch.Tensor:
        """(K, V) float64: each q~ as the draft sampled from it."""
        vocab = self.loaded.vocab_size
        rows = [sparse_to_dense(*_tensors(d), vocab) for d in proposal.distributions]
        if not rows:
            return torch.zeros(0, vocab, dtype=torch.float64)
        return torch.stack(rows)

    def _sample(self, logits: torch.Tensor, sampling: SamplingParams, uniform: float) -> int:
        if sampling.greedy:
            return int(logits[-1].argmax())
        probs = process_logits(logits, sampling)  # (1, V)
        return int(sample_categorical(probs, torch.tensor([uniform], dtype=torch.float64))[0])

    def validate_proposal(self, proposal: Proposal, sampling: SamplingParams, limit: int | None = None) -> None:
        """A Verify's drafts (at most max_num_speculative_tokens), or limit of an Offer's."""
        num_speculative_tokens = len(proposal.token_ids)
        if num_speculative_tokens > (self.max_num_speculative_tokens if limit is None else limit):
            what = "max_num_speculative_tokens" if limit is None else "the most an offer holds,"
            raise OutOfRange(
                f"{num_speculative_tokens} draft tokens exceed {what} "
                f"{self.max_num_speculative_tokens if limit is None else limit}"
            )
        check_token_ids(proposal.token_ids, self.loaded.vocab_size, "draft_token_ids")
        if sampling.greedy:
            return
        if len(proposal.distributions) != num_speculative_tokens:
            raise InvalidInput(
                f"sampling needs one draft distribution per draft token: got "
                f"{len(proposal.distributions)} for {num_speculative_tokens} tokens"
            )
        for token, distribution in zip(proposal.token_ids, proposal.distributions):
            validate_distribution(distribution, self.loaded.vocab_size)
            if not any(i == token and p > 0 for i, p in zip(distribution.token_ids, distribution.probs)):
                raise InvalidInput(f"draft token {token} has zero probability in its distribution")


def validate_distribution(distribution: SparseDistribution, vocab_size: int) -> None:
    ids, probs = distribution.token_ids, distribution.probs
    if not ids or len(ids) != len(probs):
        raise InvalidInput("a draft distribution needs as many probs as token_ids, at least one")
    if len(ids) > MAX_DRAFT_TOP_M:
        raise InvalidInput(f"a draft distribution has at most {MAX_DRAFT_TOP_M} entries")
    if any(not 0 <= t < vocab_size for t in ids):
        raise OutOfRange(f"draft distribution token ids must be in [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise InvalidInput("draft distribution token ids must be distinct")
    if not all(math.isfinite(p) and p >= 0 for p in probs) or not sum(probs) > 0:
        raise InvalidInput("draft distribution probs must be finite, >= 0, with a positive sum")


def _tensors(distribution: SparseDistribution) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids (M,) int64, probs (M,) float32), exactly as sent."""
    return (torch.tensor(distribution.token_ids, dtype=torch.long),
            torch.tensor(distribution.probs, dtype=torch.float32))
