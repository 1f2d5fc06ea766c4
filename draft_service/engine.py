"""The draft's model work for one session, in plain Python and torch (no protobuf, no gRPC).

Cache invariant (docs/architecture.md, "The cache invariant"): after a Propose of K tokens the
cache holds C followed by d1 .. d(K-1) (dK is never fed). The next Propose keeps the longest prefix
of the cache that is still committed, feeds the rest of C, and drafts from there. So a rejection
costs no extra round trip: the draft reconciles on the call it gets anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.kv_cache import SequenceCache
from specdec.models import LoadedModel
from specdec.protocol import Proposal, SparseDistribution
from specdec.ragged import Feed, Job
from specdec.sampling import (
    SamplingParams,
    keyed_uniform,
    process_logits,
    sample_categorical,
    sparse_to_dense,
    truncate_top_m,
)


@dataclass
class DraftSessionState:
    cache: SequenceCache
    committed: list[int]  # C as far as the draft has been told
    sampling: SamplingParams


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
        committed = state.committed
        cache = state.cache
        keep = min(_common_prefix(cache.token_ids, committed), len(committed) - 1)
        cache.truncate(keep)  # at least C[-1] is fed, so its logits score d1
        to_feed = committed[keep:]
        logits = (yield Feed(cache, to_feed))[-1]  # (V,)
        fed = len(to_feed)
        token_ids: list[int] = []
        distributions: list[SparseDistribution] = []
        for i in range(num_speculative_tokens):
            position = len(committed) + i
            token, distribution = self._draw(logits, state.sampling, position)
            token_ids.append(token)
            if distribution is not None:
                distributions.append(distribution)
            if i < num_speculative_tokens - 1:
                logits = (yield Feed(cache, [token]))[-1]
                fed += 1
        return Proposal(tuple(token_ids), tuple(distributions), fed)

    def _draw(
        self, logits: torch.Tensor, sampling: SamplingParams, position: int
    ) -> tuple[int, SparseDistribution | None]:
        if sampling.greedy:
            return int(logits.argmax()), None
        probs = process_logits(logits, sampling)  # (V,)
        ids, wire_probs = truncate_top_m(probs, self.top_m)
        # Sample from the very vector that is sent, read the way the target reads it.
        dense = sparse_to_dense(ids, wire_probs, probs.shape[-1]).unsqueeze(0)  # (1, V)
        uniform = torch.tensor([keyed_uniform(sampling.seed, position, "draft")], dtype=torch.float64)
        sent = SparseDistribution(tuple(ids.tolist()), tuple(wire_probs.tolist()))
        return int(sample_categorical(dense, uniform)[0]), sent


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
