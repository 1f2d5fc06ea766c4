"""The orchestrator's operations (no protobuf): pools, the pair check, prompts, K policies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from orchestrator.discovery import make_source
from orchestrator.generation import Chunk, Generation, GenerationLimits, GenerationRequest
from orchestrator.k_controller import AdaptiveKController, HeuristicK, KControllerConfig
from orchestrator.k_estimates import ControllerPriors
from orchestrator.k_policy import FixedK, KPolicy
from orchestrator.pool import PoolConfig, ReplicaPool
from specdec.errors import IncompatibleModels, InvalidInput, OutOfRange, Unavailable
from specdec.models import load_tokenizer, tokenizer_from_files, tokenizer_hash
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)

SpeculationMode = Literal["off", "fixed", "adaptive", "heuristic"]
SPECULATION_MODES: tuple[SpeculationMode, ...] = ("off", "fixed", "adaptive", "heuristic")


@dataclass(frozen=True)
class OrchestratorConfig:
    draft: str  # replica source of the draft pool: host:port[,...], dns:///name:port or k8s://ns/service:port
    target: str  # replica source of the target pool (same forms)
    tokenizer: Path | None = None  # else fetched from a target replica
    speculation: SpeculationMode = "adaptive"  # the default when a request leaves it unspecified
    num_speculative_tokens: int = 4  # fixed K; the starting K of the heuristic
    max_num_speculative_tokens: int = 16  # the cap of adaptive K (also bounded by the servers)
    controller: KControllerConfig = field(default_factory=KControllerConfig)
    default_max_new_tokens: int = 256
    startup_timeout_seconds: float = 600.0  # waiting for the pools to answer at start
    pool: PoolConfig = field(default_factory=PoolConfig)

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {SPECULATION_MODES}, got {self.speculation!r}")
        if not 0 <= self.num_speculative_tokens <= 256:
            raise ValueError("num_speculative_tokens must be in [0, 256]")
        if not 1 <= self.max_num_speculative_tokens <= 256:
            raise ValueError("max_num_speculative_tokens must be in [1, 256]")
        if self.default_max_new_tokens < 1:
            raise ValueError("default_max_new_tokens must be >= 1")


@dataclass(frozen=True)
class PromptInput:
    """Exactly one of the three is set."""

    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)


class OrchestratorService:
    def __init__(self, config: OrchestratorConfig) -> None:
        self.config = config
        self.reference: common_pb2.InfoResponse | None = None  # the target model's identity
        self.target_pool = ReplicaPool("target", make_source(config.target), config.pool, self._check)
        self.draft_pool = ReplicaPool("draft", make_source(config.draft), config.pool, self._check)
        self.tokenizer = None
        # Pool-wide estimates that seed each new session's controller, kept apart for greedy and
        # sampled requests: their acceptance rates differ (timings are learnt in both).
        self.controller_priors = {"greedy": ControllerPriors(), "sampled": ControllerPriors()}

    # -- start ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Waits for a target replica, checks the pair, gets the tokenizer. Raises
        IncompatibleModels for a mismatched pair and Unavailable if no target answers in time."""
        deadline = time.monotonic() + self.config.startup_timeout_seconds
        await self.target_pool.refresh()
        await self.draft_pool.refresh()
        while not self._answered(self.target_pool) or not self._answered(self.draft_pool):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
            await self.target_pool.refresh()
            await self.draft_pool.refresh()
        if self.reference is None:
            raise Unavailable(f"no target replica answered at {self.config.target} within "
                              f"{self.config.startup_timeout_seconds:.0f} s")
        for pool in (self.target_pool, self.draft_pool):
            refused = [r.refused for r in pool.replicas.values() if r.refused]
            if refused and not pool.usable_count():
                raise IncompatibleModels(refused[0])
        if not self.draft_pool.usable_count():
            log.warning("no draft replica answered at %s: decoding at K = 0 until one does",
                        self.config.draft)
        self.tokenizer = await self._load_tokenizer()
        await self.target_pool.start()
        await self.draft_pool.start()

    @staticmethod
    def _answered(pool: ReplicaPool) -> bool:
        return any(r.healthy or r.refused for r in pool.replicas.values())

    def _check(self, info: common_pb2.InfoResponse) -> None:
        """A replica joins only if it speaks for the same vocabulary and tokenizer."""
        if info.protocol_version != "specdec.v1":
            raise IncompatibleModels(f"replica {info.replica_id} speaks {info.protocol_version!r}")
        if self.reference is None:
            if info.role != "target":
                return  # drafts are checked once a target has set the reference
            self.reference = info
            return
        ref = self.reference
        if info.vocab_size != ref.vocab_size:
            raise IncompatibleModels(
                f"{info.role} model {info.model_id!r} has a vocabulary of {info.vocab_size} tokens but "
                f"the target {ref.model_id!r} has {ref.vocab_size}: draft and target must share a tokenizer"
            )
        if info.tokenizer_hash and ref.tokenizer_hash and info.tokenizer_hash != ref.tokenizer_hash:
            raise IncompatibleModels(
                f"{info.role} model {info.model_id!r} uses a different tokenizer from the target "
                f"{ref.model_id!r} (tokenizer hash {info.tokenizer_hash[:12]} vs {ref.tokenizer_hash[:12]})"
            )

    async def _load_tokenizer(self):
        if self.config.tokenizer is not None:
            tokenizer = load_tokenizer(self.config.tokenizer)
            if tokenizer is None:
                raise InvalidInput(f"no tokenizer files in {self.config.tokenizer}")
            assert self.reference is not None
            if self.reference.tokenizer_hash and tokenizer_hash(tokenizer) != self.reference.tokenizer_hash:
                raise IncompatibleModels(f"--tokenizer {self.config.tokenizer} differs from the target's")
            return tokenizer
        replica = self.target_pool.pick()
        if replica is None:
            raise Unavailable("no target replica to fetch the tokenizer from")
        files, _ = await replica.client.tokenizer_files()
        return await asyncio.to_thread(tokenizer_from_files, files)

    async def close(self) -> None:
        await self.target_pool.close()
        await self.draft_pool.close()

    # -- requests -------------------------------------------------------------------------------

    def limits(self) -> GenerationLimits:
        infos = [r.info for pool in (self.target_pool, self.draft_pool)
                 for r in pool.replicas.values() if r.info is not None and not r.refused]
        target_infos = [r.info for r in self.target_pool.replicas.values() if r.info is not None and not r.refused]
        if not target_infos:  # discovery may list none for a while (a pool scaled to zero, a rollout)
            raise Unavailable("no target replica is in the pool")
        eos = {t for info in target_infos for t in info.eos_token_ids}
        return GenerationLimits(
            max_context=min(info.max_context for info in infos),
            max_num_speculative_tokens=min(info.max_num_speculative_tokens for info in infos),
            eos_token_ids=frozenset(eos),
        )

    def tokenize(self, prompt: PromptInput) -> tuple[int, ...]:
        given = sum(bool(x) for x in (prompt.prompt, prompt.prompt_token_ids, prompt.messages))
        if given != 1:
            raise InvalidInput("set exactly one of prompt, prompt_token_ids and messages")
        if prompt.prompt_token_ids:
            assert self.reference is not None
            vocab = self.reference.vocab_size
            bad = next((t for t in prompt.prompt_token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise OutOfRange(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
            return tuple(prompt.prompt_token_ids)
        if self.tokenizer is None:
            raise InvalidInput("the target model has no tokenizer: send prompt_token_ids")
        if prompt.prompt:
            return tuple(self.tokenizer(prompt.prompt)["input_ids"])
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidInput("the target's tokenizer has no chat template: send a prompt")
        messages = [{"role": role, "content": content} for role, content in prompt.messages]
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return tuple(int(t) for t in ids)

    def policy(self, mode: SpeculationMode | None, num_speculative_tokens: int | None,
               greedy: bool = True) -> KPolicy:
        """The K policy of one request. num_speculative_tokens: fixed K, the heuristic's start, or
        the adaptive controller's cap (unset: the server's defaults). greedy picks the pool priors
        an adaptive controller starts from."""
        mode = mode or self.config.speculation
        limit = self.limits().max_num_speculative_tokens
        if num_speculative_tokens is not None and not 0 <= num_speculative_tokens <= limit:
            raise OutOfRange(
                f"num_speculative_tokens must be in [0, {limit}] (the servers' maximum), "
                f"got {num_speculative_tokens}"
            )
        if mode == "off":
            return FixedK(0)
        if mode == "fixed":
            k = self.config.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
            return FixedK(min(k, limit))
        if mode == "heuristic":
            k = self.config.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
            return HeuristicK(initial_num_speculative_tokens=max(1, min(k, limit)), k_max=limit)
        k_max = self.config.max_num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        k_max = min(k_max, limit)
        if k_max == 0:
            return FixedK(0)  # a cap of 0 leaves nothing to adapt: target-only decoding
        base = self.config.controller
        controller = replace(base, k_max=k_max,
                             initial_num_speculative_tokens=min(base.initial_num_speculative_tokens, k_max),
                             probe_num_speculative_tokens=min(base.probe_num_speculative_tokens, k_max))
        priors = self.controller_priors["greedy" if greedy else "sampled"]
        return AdaptiveKController(controller, priors=priors)

    def generate(
        self,
        prompt: PromptInput,
        max_new_tokens: int | None,
        sampling: SamplingParams,
        stop: Sequence[str],
        policy: KPolicy,
        speculate: bool,
    ) -> AsyncIterator[Chunk]:
        if any(not s for s in stop):
            raise InvalidInput("stop strings must not be empty")
        if stop and self.tokenizer is None:
            raise InvalidInput("stop strings need a tokenizer; the target has none")
        request = GenerationRequest(
            prompt_token_ids=self.tokenize(prompt),
            max_new_tokens=self.config.default_max_new_tokens if max_new_tokens is None else max_new_tokens,
            sampling=sampling,
            stop=tuple(stop),
        )
        generation = Generation(request, policy, self.target_pool, self.draft_pool, self.tokenizer,
                                self.limits(), speculate=speculate)
        return generation.run()
