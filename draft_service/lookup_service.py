"""A draft service without a model: Propose answers from a lookup (`specdec serve draft --method
ngram|suffix`), so a draft pool can offer model-free drafts to orchestrators that run none
themselves, on machines without an accelerator.

Sessions, handles, retries, budgets and expiry are the model draft's (specdec.serving); the job
of a call is plain Python run inline (no model worker, no forward pass). A session's proposer sees
C grow as the orchestrator tells it; it proposes up to K tokens (fewer or none where its match
ends: the round then verifies what it got, K = 0 included), with one-hot q~ when sampling, which
the target verifies with its unchanged rule. With --suffix-cache shared, a bounded cache of recent
outputs serves the replica's sessions: a session's output joins it at Release. The cache is kept
apart per the partition each Prefill names (an orchestrator with bearer tokens sends a digest of
the request's token), so no session draws on text that only another partition's sessions saw; the
replica keeps the caches of the most recently used partitions, up to max_cache_partitions.

Identity: the replica speaks the target's vocabulary, read from --model (the target's config and
tokenizer only; no weights are loaded), and names itself `lookup:METHOD` in Info, which the
orchestrator reads to count the replica's proposals under METHOD.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from draft_service.service import check_propose
from specdec.errors import InvalidInput
from specdec.lookup import (
    LOOKUP_METHODS,
    LOOKUP_MODEL_PREFIX,
    SUFFIX_CACHE_MODES,
    NgramProposer,
    PartitionedSuffixCaches,
    Proposer,
    SuffixCache,
    SuffixProposer,
)
from specdec.models import LoadedModel
from specdec.protocol import (
    Handle,
    Proposal,
    ReplicaInfo,
    SamplingParams,
    Timing,
)
from specdec.ragged import Job
from specdec.serving import ServiceConfig, SessionService
from specdec.worker import Timed


@dataclass(frozen=True)
class LookupDraftConfig:
    method: str = "suffix"  # ngram or suffix
    suffix_cache: str = "session"  # shared: a cache of recent outputs for the replica's sessions
    suffix_cache_tokens: int = 200_000  # bound of each partition's shared cache
    max_cache_partitions: int = 64  # shared caches kept (least recently used dropped first)
    ngram_min: int = 2
    ngram_max: int = 4
    suffix_max_depth: int = 8
    suffix_min_share: float = 0.3

    def __post_init__(self) -> None:
        if self.method not in LOOKUP_METHODS:
            raise ValueError(f"a lookup draft's method is one of {LOOKUP_METHODS}, got {self.method!r}")
        if self.suffix_cache not in SUFFIX_CACHE_MODES:
            raise ValueError(f"suffix_cache must be one of {SUFFIX_CACHE_MODES}, got {self.suffix_cache!r}")
        if self.max_cache_partitions < 1:
            raise ValueError(f"max_cache_partitions must be >= 1, got {self.max_cache_partitions}")


@dataclass
class LookupSessionState:
    committed: list[int]  # C as far as the replica has been told
    prompt_length: int
    sampling: SamplingParams
    proposer: Proposer


def load_vocabulary(model: str, max_context: int = 0) -> LoadedModel:
    """The identity of the target's vocabulary, from its directory (or 'default': the default
    target): config and tokenizer only, no weights. LoadedModel.model is None."""
    from transformers import AutoConfig, GenerationConfig

    from specdec.models import eos_token_ids, load_tokenizer, resolve_model_dir, tokenizer_hash

    path = resolve_model_dir(model, "target")
    if not (path / "config.json").is_file():
        raise InvalidInput(f"{model!r}: a lookup draft needs the target's model directory (its "
                           "config.json and tokenizer) to speak its vocabulary")
    config = AutoConfig.from_pretrained(path)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except (OSError, ValueError):
        generation = None
    tokenizer = load_tokenizer(path)
    return LoadedModel(
        model=None,  # type: ignore[arg-type]  # no forward pass ever runs
        tokenizer=tokenizer,
        model_id=model,
        vocab_size=int(config.vocab_size),
        tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer is not None else "",
        eos_token_ids=eos_token_ids(SimpleNamespace(generation_config=generation, config=config), tokenizer),
        max_context=max_context or int(getattr(config, "max_position_embeddings", 2048)),
        dtype="none",
        device="cpu",
    )


class LookupDraftService(SessionService[LookupSessionState]):
    role = "draft"

    def __init__(self, vocabulary: LoadedModel, config: ServiceConfig,
                 lookup: LookupDraftConfig = LookupDraftConfig()) -> None:
        super().__init__(vocabulary, config, size_of=lambda state: len(state.committed))
        self.lookup = lookup
        self.shared = lookup.suffix_cache == "shared" and lookup.method == "suffix"
        self.caches = PartitionedSuffixCaches(lookup.suffix_cache_tokens, lookup.suffix_max_depth,
                                              lookup.max_cache_partitions)

    @property
    def cache(self) -> SuffixCache | None:
        """The shared cache of the sessions that name no partition (None: no shared cache)."""
        return self.cache_of("")

    def cache_of(self, partition: str) -> SuffixCache | None:
        return self.caches.of(partition) if self.shared else None

    def info(self) -> ReplicaInfo:
        # The replica's name for what proposes: the orchestrator counts its tokens under it.
        return dataclasses.replace(super().info(), model_id=f"{LOOKUP_MODEL_PREFIX}{self.lookup.method}")

    def _proposer(self, partition: str) -> Proposer:
        lookup = self.lookup
        if lookup.method == "ngram":
            return NgramProposer(lookup.ngram_min, lookup.ngram_max)
        return SuffixProposer(lookup.suffix_max_depth, lookup.suffix_min_share, self.cache_of(partition))

    async def run_job(self, make_job: Callable[[], Job[Any]], session_id: str) -> Timed:
        """The job inline: a lookup feeds no model, so the job returns without yielding a Feed."""
        started = time.perf_counter()
        job = make_job()
        try:
            job.send(None)
        except StopIteration as stop:
            return Timed(stop.value, time.perf_counter() - started, 0.0)
        job.close()
        raise RuntimeError("a lookup job asked for a forward pass")

    async def prefill(
        self, session_id: str, token_ids: list[int], sampling: SamplingParams, cache_partition: str = ""
    ) -> tuple[Handle, None, Timing]:
        """cache_partition: the shared cache the session draws on and its output joins."""
        self.check_prompt(token_ids)

        def build() -> Job[tuple[LookupSessionState, int, None]]:
            state = LookupSessionState(list(token_ids), len(token_ids), sampling, self._proposer(cache_partition))
            return state, len(token_ids), None
            yield  # a generator: the service's job form, run inline

        return await self.new_session(session_id, token_ids, build)

    async def propose(
        self, handle: Handle, new_committed: list[int], num_speculative_tokens: int
    ) -> tuple[Handle, Proposal, Timing]:
        new_length = check_propose(self, handle, new_committed, num_speculative_tokens)

        def apply(state: LookupSessionState) -> Job[tuple[int, Proposal]]:
            state.committed.extend(new_committed)
            found = state.proposer.propose(state.committed, num_speculative_tokens)
            return new_length, found.proposal(state.sampling)
            yield  # a generator: the service's job form, run inline

        return await self.call(handle, apply)

    async def release(self, session_id: str) -> bool:
        """Ends a session; its output joins the replica's shared cache (if it keeps one)."""
        session = self.store.get(session_id)
        released = await super().release(session_id)
        if released and session is not None:
            state = session.state
            state.proposer.finish(state.committed, state.prompt_length)
        return released
