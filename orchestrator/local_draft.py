"""Model-free drafts inside the orchestrator: no model, no draft hop (docs/architecture.md,
"Model-free drafts").

The draft method of an orchestrator comes from its --draft and --draft-method:

- ``--draft local:ngram`` / ``--draft local:suffix``: that lookup alone, no draft pool;
- ``--draft host:port --draft-method hybrid``: per round, the suffix lookup's proposal or the
  model draft's: with adaptive K whichever the controller expects to commit tokens faster
  (orchestrator/lookup_policy.py); with fixed K the lookup's where its match is strong (at least
  hybrid_min_match context tokens matched);
- ``--draft host:port`` (``--draft-method model``, the default): the model draft alone.

With adaptive K the lookup proposes up to the round's maximum and the controller chooses how many
of its tokens to verify from the match each rests on; with fixed K it proposes up to K. With no
match (or none worth verifying) the round runs at K = 0 (hybrid: the model draft's round). When
sampling, each proposed token comes with a one-hot q~, so the target verifies it with the rule it
applies to any draft, unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.lookup import (
    DRAFT_METHODS,
    SUFFIX_CACHE_MODES,
    Lookup,
    NgramProposer,
    PartitionedSuffixCaches,
    Proposer,
    SuffixCache,
    SuffixProposer,
)
from orchestrator.discovery import Endpoint
from specdec.protocol import CallTiming, Handle, Proposal, Reply, SamplingParams

LOCAL_PREFIX = "local:"


def draft_method_of(draft: str, draft_method: str) -> str:
    """The effective draft method of --draft and --draft-method ("" = from --draft)."""
    local = draft.strip().startswith(LOCAL_PREFIX)
    if local:
        named = draft.strip()[len(LOCAL_PREFIX):]
        if named not in ("ngram", "suffix"):
            raise ValueError(f"--draft local:METHOD takes ngram or suffix, got {draft!r}")
        if draft_method and draft_method != named:
            raise ValueError(f"--draft {draft} and --draft-method {draft_method} disagree")
        return named
    method = draft_method or "model"
    if method not in DRAFT_METHODS:
        raise ValueError(f"draft method must be one of {DRAFT_METHODS}, got {method!r}")
    return method


@dataclass(frozen=True)
class NoReplicas:
    """The draft pool's source under --draft local:METHOD: no replicas, ever."""

    description: str

    async def endpoints(self) -> list[Endpoint]:
        return []

    async def close(self) -> None:
        pass


@dataclass(frozen=True)
class LookupConfig:
    ngram_min: int = 2
    ngram_max: int = 4
    suffix_max_depth: int = 8
    suffix_min_share: float = 0.3
    suffix_cache: str = "session"  # "shared": one cache of recent outputs for all requests
    suffix_cache_tokens: int = 200_000  # bound of the shared cache
    hybrid_min_match: int = 3  # context tokens a lookup must match for hybrid to take it (fixed K)

    def __post_init__(self) -> None:
        if self.suffix_cache not in SUFFIX_CACHE_MODES:
            raise ValueError(f"suffix_cache must be one of {SUFFIX_CACHE_MODES}, got {self.suffix_cache!r}")
        if self.hybrid_min_match < 1:
            raise ValueError("hybrid_min_match must be >= 1")


class LocalDrafts:
    """The orchestrator's lookup drafts: makes one per request, holds the shared caches.

    The shared suffix cache is partitioned: a request's lookups see (and its output joins) only
    the cache of its partition. With bearer tokens configured the partition is the request's token
    (orchestrator/servicer.py, http_api.py), so no proposal for one token's session is drawn from
    what only another token's sessions saw; without tokens every request is in partition "".
    Each partition is bounded by suffix_cache_tokens; there are as many as configured tokens."""

    def __init__(self, method: str, config: LookupConfig = LookupConfig()) -> None:
        self.method = method
        self.config = config
        self.shared = config.suffix_cache == "shared" and method in ("suffix", "hybrid")
        self.caches = PartitionedSuffixCaches(config.suffix_cache_tokens, config.suffix_max_depth)
        if self.shared:
            self.cache_of("")

    @property
    def cache(self) -> SuffixCache | None:
        """The shared cache of the requests without a token (None: no shared cache)."""
        return self.caches.get("")

    def cache_of(self, partition: str) -> SuffixCache | None:
        return self.caches.of(partition) if self.shared else None

    def session(self, partition: str = "") -> LocalDraft | None:
        """A request's lookup draft (its shared cache: its partition's), or None for the model
        draft alone."""
        config = self.config
        if self.method == "ngram":
            proposer: Proposer = NgramProposer(config.ngram_min, config.ngram_max)
        elif self.method in ("suffix", "hybrid"):
            proposer = SuffixProposer(config.suffix_max_depth, config.suffix_min_share, self.cache_of(partition))
        else:
            return None
        lookup_method = "suffix" if self.method == "hybrid" else self.method
        return LocalDraft(self.method, lookup_method, proposer, config.hybrid_min_match)


class LocalDraft:
    """One request's lookup draft."""

    def __init__(self, method: str, lookup_method: str, proposer: Proposer, hybrid_min_match: int) -> None:
        self.method = method  # "ngram" | "suffix" | "hybrid"
        self.lookup_method = lookup_method  # the method named in the stats for a lookup proposal
        self.proposer = proposer
        self.hybrid_min_match = hybrid_min_match

    @property
    def uses_model(self) -> bool:
        return self.method == "hybrid"

    def lookup(self, committed: Sequence[int], num_speculative_tokens: int) -> tuple[Lookup, float]:
        started = time.perf_counter()
        found = self.proposer.propose(committed, num_speculative_tokens)
        return found, time.perf_counter() - started

    def takes(self, found: Lookup) -> bool:
        """Under fixed or heuristic K, whether the round goes with the lookup (hybrid: only on a
        strong match); adaptive K decides by the cost model instead."""
        return not self.uses_model or (bool(found.token_ids) and found.match_length >= self.hybrid_min_match)

    def finish(self, committed: Sequence[int], prompt_length: int) -> None:
        self.proposer.finish(committed, prompt_length)


def lookup_reply(found: Lookup, sampling: SamplingParams, session_id: str, committed_length: int,
                 seconds: float) -> Reply[Proposal]:
    """A lookup's proposal as a draft's reply: one-hot q~ when sampling, its match lengths; its
    time as compute."""
    return Reply(Handle(session_id, "local", committed_length, 0), found.proposal(sampling),
                 CallTiming(seconds, seconds))
