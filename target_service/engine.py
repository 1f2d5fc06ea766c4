"""The target's model work for one session, in plain Python and torch (no protobuf, no gRPC).

Cache invariant (DESIGN.md section 2): between calls the cache holds exactly C[:-1]; C[-1] was
sampled by this model (or given on resume) and is fed first by the next Verify.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.errors import InvalidInput, OutOfRange
from specdec.kv_cache import SequenceCache
from specdec.models import LoadedModel
from specdec.sampling import (
    SamplingParams,
    VerifyOutcome,
    keyed_uniform,
    process_logits,
    sample_categorical,
    sparse_to_dense,
    verify_greedy,
    verify_sampled_one,
)


@dataclass
class TargetSessionState:
    cache: SequenceCache  # holds C[:-1]
    last_token_id: int  # C[-1]
    sampling: SamplingParams

    @property
    def committed_length(self) -> int:
        return len(self.cache) + 1


@dataclass(frozen=True)
class DraftProposal:
    """What the draft sent for one round. distributions: (token_ids (M,), probs (M,)) per token."""

    token_ids: tuple[int, ...]
    distributions: tuple[tuple[torch.Tensor, torch.Tensor], ...]


class TargetEngine:
    def __init__(self, loaded: LoadedModel, max_num_speculative_tokens: int) -> None:
        self.loaded = loaded
        self.max_num_speculative_tokens = max_num_speculative_tokens

    def check_tokens(self, token_ids: list[int] | tuple[int, ...], what: str) -> None:
        vocab = self.loaded.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise OutOfRange(f"{what}: token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def prefill(
        self, token_ids: list[int], sampling: SamplingParams, resume: bool
    ) -> tuple[TargetSessionState, int | None]:
        """Feeds the prompt and samples C's first new token (or rebuilds a committed C)."""
        cache = SequenceCache(self.loaded.model)
        if resume:
            if len(token_ids) >= 2:
                cache.feed(token_ids[:-1])
            return TargetSessionState(cache, token_ids[-1], sampling), None
        logits = cache.feed(token_ids)[-1:]  # (1, V)
        position = len(token_ids)
        first = self._sample(logits, sampling, keyed_uniform(sampling.seed, position, "target"))
        return TargetSessionState(cache, first, sampling), first

    def verify(self, state: TargetSessionState, proposal: DraftProposal) -> VerifyOutcome:
        """One round: feeds [C[-1], d1..dK] in one pass, accepts a prefix, truncates to C'[:-1]."""
        num_draft = len(proposal.token_ids)
        committed = state.committed_length
        if committed + num_draft > self.loaded.max_context:
            raise OutOfRange(
                f"verifying {num_draft} tokens at length {committed} exceeds the max context "
                f"{self.loaded.max_context}"
            )
        logits = state.cache.feed([state.last_token_id, *proposal.token_ids])  # (K + 1, V)
        drafts = torch.tensor(proposal.token_ids, dtype=torch.long)  # (K,)
        sampling = state.sampling
        if sampling.greedy:
            outcome = verify_greedy(logits, drafts)
        else:
            outcome = verify_sampled_one(
                target_probs=process_logits(logits, sampling),
                draft_token_ids=drafts,
                draft_probs=self._dense_drafts(proposal),
                accept_uniforms=torch.tensor(
                    [keyed_uniform(sampling.seed, committed + i, "accept") for i in range(num_draft)],
                    dtype=torch.float64,
                ),
                # One final draw per round, keyed by where the round starts.
                final_uniform=keyed_uniform(sampling.seed, committed, "target"),
            )
        state.cache.truncate(committed + outcome.num_accepted)
        state.last_token_id = outcome.next_token_id
        return outcome

    def _dense_drafts(self, proposal: DraftProposal) -> torch.Tensor:
        """(K, V) float64: each q~ as the draft sampled from it."""
        vocab = self.loaded.vocab_size
        rows = [sparse_to_dense(ids, probs, vocab) for ids, probs in proposal.distributions]
        if not rows:
            return torch.zeros(0, vocab, dtype=torch.float64)
        return torch.stack(rows)

    def _sample(self, logits: torch.Tensor, sampling: SamplingParams, uniform: float) -> int:
        if sampling.greedy:
            return int(logits[-1].argmax())
        probs = process_logits(logits, sampling)  # (1, V)
        return int(sample_categorical(probs, torch.tensor([uniform], dtype=torch.float64))[0])

    def validate_proposal(self, proposal: DraftProposal, sampling: SamplingParams) -> None:
        num_draft = len(proposal.token_ids)
        if num_draft > self.max_num_speculative_tokens:
            raise OutOfRange(
                f"{num_draft} draft tokens exceed max_num_speculative_tokens "
                f"{self.max_num_speculative_tokens}"
            )
        self.check_tokens(proposal.token_ids, "draft_token_ids")
        if sampling.greedy:
            return
        if len(proposal.distributions) != num_draft:
            raise InvalidInput(
                f"sampling needs one draft distribution per draft token: got "
                f"{len(proposal.distributions)} for {num_draft} tokens"
            )
        for ids, probs in proposal.distributions:
            validate_distribution(ids, probs, self.loaded.vocab_size)
        for token, (ids, probs) in zip(proposal.token_ids, proposal.distributions):
            if not bool(((ids == token) & (probs > 0)).any()):
                raise InvalidInput(f"draft token {token} has zero probability in its distribution")


def validate_distribution(ids: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> None:
    from specdec.sampling import MAX_DRAFT_TOP_M

    if ids.numel() == 0 or ids.numel() != probs.numel():
        raise InvalidInput("a draft distribution needs as many probs as token_ids, at least one")
    if ids.numel() > MAX_DRAFT_TOP_M:
        raise InvalidInput(f"a draft distribution has at most {MAX_DRAFT_TOP_M} entries")
    if bool(((ids < 0) | (ids >= vocab_size)).any()):
        raise OutOfRange(f"draft distribution token ids must be in [0, {vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise InvalidInput("draft distribution token ids must be distinct")
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()) or not float(probs.sum()) > 0:
        raise InvalidInput("draft distribution probs must be finite, >= 0, with a positive sum")
