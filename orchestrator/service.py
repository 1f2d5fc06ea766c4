"""The orchestrator's operations (no protobuf): pools, the pair check, prompts, K policies, and
generate, which the gRPC servicer calls once per request."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from orchestrator.clients import DraftClient, TargetClient
from orchestrator.discovery import make_source
from orchestrator.generation import (
    Chunk,
    Generation,
    GenerationLimits,
    GenerationRequest,
)
from orchestrator.k_controller import AdaptiveKController, KControllerConfig
from orchestrator.k_estimates import ControllerPriors
from orchestrator.k_policy import (
    SPECULATION_MODES,
    FixedK,
    HeuristicK,
    KPolicy,
    Speculation,
    SpeculationMode,
)
from orchestrator.local_draft import (
    LocalDrafts,
    LookupConfig,
    NoReplicas,
    draft_method_of,
)
from specdec.lookup_acceptance import LookupPriors
from orchestrator.pipeline_policy import PipelinePriors
from orchestrator.pipelining import (
    default_pipeline_fanout,
    MAX_PIPELINE_FANOUT,
    PIPELINE_MODES,
    FixedPipeline,
    NoPipeline,
    PipelineMode,
    PipelinePolicy,
    RequestStreaming,
    STRETCH_OFFER_DEPTH,
    StreamedDrafts,
    StreamPaces,
)
from orchestrator.pool import PoolConfig, ReplicaPool
from orchestrator.speculation_guard import SpeculationGuard
from orchestrator.telemetry import Telemetry
from specdec.compute_units import shares_compute
from specdec.pass_lock import take_turns
from specdec.errors import IncompatibleModels, InvalidInput, OutOfRange, Unavailable
from specdec.models import load_tokenizer, tokenizer_from_files, tokenizer_hash
from specdec.protocol import (
    ReplicaInfo,
    SamplingParams,
    check_compatible,
    check_token_ids,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OrchestratorConfig:
    draft: str  # replica source of the draft pool: host:port[,...], dns:///name:port or k8s://ns/service:port
    target: str  # replica source of the target pool (same forms)
    tokenizer: Path | None = None  # else fetched from a target replica
    speculation: SpeculationMode = "adaptive"  # the default when a request leaves it unspecified
    num_speculative_tokens: int = 4  # fixed K; the starting K of the heuristic
    max_num_speculative_tokens: int = 16  # adaptive K's maximum (also bounded by the servers)
    controller: KControllerConfig = field(default_factory=KControllerConfig)
    default_max_new_tokens: int = 256
    startup_timeout_seconds: float = 120.0  # waiting for the pools to answer at start
    pool: PoolConfig = field(default_factory=PoolConfig)
    # "" (from --draft: local:ngram / local:suffix, else model), model, ngram, suffix or hybrid
    draft_method: str = ""
    lookup: LookupConfig = field(default_factory=LookupConfig)  # the model-free drafts
    # Drafting ahead while the target verifies, for requests that leave it unset: off, on, auto.
    pipeline: PipelineMode = "off"
    # Candidates per outcome (on); the maximum (auto); 0 drafts nothing ahead; None: the mode's
    # default (default_pipeline_fanout: 3 under on, 8 under auto). Streamed offers' branches take
    # only a request's own pipeline_fanout.
    pipeline_fanout: int | None = None

    def __post_init__(self) -> None:
        draft_method_of(self.draft, self.draft_method)  # raises ValueError on a bad pair
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {SPECULATION_MODES}, got {self.speculation!r}")
        if not 0 <= self.num_speculative_tokens <= 256:
            raise ValueError("num_speculative_tokens must be in [0, 256]")
        if not 1 <= self.max_num_speculative_tokens <= 256:
            raise ValueError("max_num_speculative_tokens must be in [1, 256]")
        if self.default_max_new_tokens < 1:
            raise ValueError("default_max_new_tokens must be >= 1")
        if self.pipeline not in PIPELINE_MODES:
            raise ValueError(f"pipeline must be one of {PIPELINE_MODES}, got {self.pipeline!r}")
        if self.pipeline_fanout is not None and not 0 <= self.pipeline_fanout <= MAX_PIPELINE_FANOUT:
            raise ValueError(f"pipeline_fanout must be in [0, {MAX_PIPELINE_FANOUT}]")


@dataclass(frozen=True)
class PromptInput:
    """Exactly one of the three is set."""

    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)


class OrchestratorService:
    def __init__(self, config: OrchestratorConfig) -> None:
        self.config = config
        self.reference: ReplicaInfo | None = None  # the target model's identity
        self.target_pool = ReplicaPool(TargetClient, make_source(config.target), config.pool, self._check)
        self.draft_method = draft_method_of(config.draft, config.draft_method)
        # A lookup draft alone (--draft local:METHOD) runs here: the draft pool stays empty.
        self.model_draft = self.draft_method in ("model", "hybrid")
        draft_source = make_source(config.draft) if self.model_draft else NoReplicas(f"local:{self.draft_method}")
        self.draft_pool = ReplicaPool(DraftClient, draft_source, config.pool, self._check)
        self.local_drafts = LocalDrafts(self.draft_method, config.lookup)
        self.tokenizer = None
        # Pool-wide estimates that seed each new session's controller, kept apart for greedy and
        # sampled requests: their acceptance rates differ (timings are learnt in both).
        self.controller_priors = {"greedy": ControllerPriors(), "sampled": ControllerPriors()}
        # a lookup's acceptance by match length (orchestrator/lookup_policy.py), greedy and sampled
        self.lookup_priors = {"greedy": LookupPriors(), "sampled": LookupPriors()}
        self.pipeline_priors = {"greedy": PipelinePriors(), "sampled": PipelinePriors()}
        # Whether streamed requests' offers pay (pipelining.py), and offers beside adaptive
        # stretches (auto): by greedy, since greedy and sampled drafts are accepted at different rates.
        self.stream_paces = {True: StreamPaces(), False: StreamPaces()}
        self.stretch_paces = {True: StreamPaces(), False: StreamPaces()}
        self.request_streaming = RequestStreaming()  # auto: rounds or a streamed request
        # Pipelining auto holds off where every draft replica computes on every target replica's
        # hardware (draft_shares_compute); tests that run both on one machine to exercise auto
        # turn the check off.
        self.hold_auto_pipelining_on_shared_compute = True
        self._shared_compute_logged: bool | None = None
        self._untimed_pairs_logged: frozenset[tuple[str, str]] = frozenset()
        self.guard = SpeculationGuard()  # orchestrator/speculation_guard.py: adaptive requests only
        self.telemetry = Telemetry()  # metrics (--metrics-port) and request traces

    # -- start ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Waits for a target replica, checks the pair, gets the tokenizer. Raises
        IncompatibleModels for a mismatched pair and Unavailable if no target answers in time."""
        started = time.monotonic()
        deadline, next_note = started + self.config.startup_timeout_seconds, started + 5.0
        await self.target_pool.refresh()
        await self.draft_pool.refresh()
        while not self._answered(self.target_pool) or (self.model_draft and not self._answered(self.draft_pool)):
            if time.monotonic() > deadline:
                break
            if time.monotonic() >= next_note:  # say what it waits for: a silent start looks hung
                next_note += 5.0
                silent = [f"the {role} pool ({source})" for role, source, pool in (
                    ("target", self.config.target, self.target_pool),
                    ("draft", self.config.draft, self.draft_pool)) if not self._answered(pool)]
                log.info("waiting for %s to answer: %.0f s of %.0f s (--startup-timeout)",
                         " and ".join(silent), time.monotonic() - started,
                         self.config.startup_timeout_seconds)
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
        if self.model_draft and not self.draft_pool.usable_count():
            log.warning("no draft replica answered at %s: decoding at K = 0 until one does",
                        self.config.draft)
        self.tokenizer = await self._load_tokenizer()
        self.telemetry.bind(self.reference.model_id)
        self.draft_shares_compute()  # says at start where the draft computes, and warns if it
        # shares the target's hardware without taking turns
        await self.target_pool.start()
        await self.draft_pool.start()

    @staticmethod
    def _answered(pool: ReplicaPool) -> bool:
        return any(r.healthy or r.refused for r in pool.replicas.values())

    def _check(self, info: ReplicaInfo) -> None:
        """A replica joins only if it speaks the protocol for the target's vocabulary and
        tokenizer. The first target sets the reference; a draft that answers before any target
        is checked again at its next probe."""
        check_compatible(self.reference or info, info)
        if self.reference is None and info.role == "target":
            self.reference = info

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
            check_token_ids(prompt.prompt_token_ids, self.reference.vocab_size, "prompt_token_ids")
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

    def policy(self, speculation: Speculation, greedy: bool = True, shared_compute: bool = True) -> KPolicy:
        """The K policy of one request. speculation.num_speculative_tokens: fixed K, the
        heuristic's start, or the adaptive controller's maximum (unset: the server's defaults).
        greedy picks the pool priors an adaptive controller starts from; shared_compute
        (draft_shares_compute()) whether its probes beside a stretch take the target's cores."""
        mode = speculation.mode or self.config.speculation
        limit = self.limits().max_num_speculative_tokens
        requested = speculation.num_speculative_tokens
        if requested is not None and not 0 <= requested <= limit:
            raise OutOfRange(
                f"num_speculative_tokens must be in [0, {limit}] (the servers' maximum), got {requested}"
            )
        if mode == "off":
            return FixedK(0)
        if mode in ("fixed", "heuristic"):
            fixed = min(self.config.num_speculative_tokens if requested is None else requested, limit)
            if mode == "fixed":
                return FixedK(fixed)
            return HeuristicK(initial_num_speculative_tokens=max(1, fixed), max_num_speculative_tokens=limit)
        maximum = self.config.max_num_speculative_tokens if requested is None else requested
        maximum = min(maximum, limit)
        if maximum == 0:
            return FixedK(0)  # a maximum of 0 leaves nothing to adapt: target-only decoding
        base = self.config.controller
        controller = replace(
            base, max_num_speculative_tokens=maximum,
            initial_num_speculative_tokens=min(base.initial_num_speculative_tokens, maximum),
            probe_num_speculative_tokens=min(base.probe_num_speculative_tokens, maximum),
            shadow_probe_num_speculative_tokens=min(base.shadow_probe_num_speculative_tokens, maximum),
        )
        kind = "greedy" if greedy else "sampled"
        # Probes beside a stretch, with a model draft: its matches are its acceptance (greedy), or
        # give it with the target's p (sampling). Under pipelining auto, greedy, they also measure
        # the draft's candidate ranks (drafting ahead at fan-out 1); sampled, once the ranks are
        # measured by drafted-ahead rounds (AdaptiveKController._shadows).
        return AdaptiveKController(controller, priors=self.controller_priors[kind],
                                   lookup_priors=self.lookup_priors[kind], shadow_probes=self.model_draft,
                                   ranks_beside=greedy, shadow_probes_contend=shared_compute,
                                   probe_rng=random.Random())

    def draft_shares_compute(self) -> bool:
        """Whether every draft replica computes on the hardware of every target replica (the same
        machine, CPUs or GPU in common: specdec/compute_units.py), as their Info reports it. Then
        whatever the draft computes while the target works is taken from the target: pipelining
        auto drafts nothing ahead, offers nothing and streams nothing (an explicit `on` or `stream`
        still does), and under load the speculation guard tests speculating later and more seldom.
        Logged when the answer changes."""
        targets = [r.info for r in self.target_pool.replicas.values() if r.info is not None]
        drafts = [r.info for r in self.draft_pool.replicas.values() if r.info is not None]
        shared = bool(targets and drafts) and all(
            shares_compute(t.host_id, t.compute_units, d.host_id, d.compute_units) for t in targets for d in drafts)
        if shared != self._shared_compute_logged and (targets and drafts):
            self._shared_compute_logged = shared
            if shared:
                log.info("the draft replicas compute on the target replicas' hardware: pipelining auto drafts "
                         "nothing ahead, and under load speculation is tested seldom (give the draft CPUs or a "
                         "GPU of its own for either to pay)")
            else:
                log.info("a draft replica computes on hardware of its own: pipelining auto drafts ahead where "
                         "that pays")
        self.shared_compute_takes_turns()
        return shared

    def shared_compute_takes_turns(self) -> bool:
        """Whether every draft replica that shares a target replica's hardware takes turns with it
        at each pass (the same --pass-lock, specdec/pass_lock.py; True where none shares). Two
        model services on one machine's CPUs that do not take turns slow each other's passes down
        several times over: each pair that newly does so is logged as a warning."""
        untimed = frozenset(
            (t.address, d.address)
            for t in self.target_pool.replicas.values() for d in self.draft_pool.replicas.values()
            if t.info is not None and d.info is not None
            and shares_compute(t.info.host_id, t.info.compute_units, d.info.host_id, d.info.compute_units)
            and not take_turns(t.info.pass_lock, d.info.pass_lock))
        for target, draft in sorted(untimed - self._untimed_pairs_logged):
            log.warning("the draft replica at %s computes on the hardware of the target replica at %s and "
                        "their forward passes do not take turns: each slows the other down, several times "
                        "over on shared CPUs. Start both with the same --pass-lock FILE, or give the draft "
                        "hardware of its own", draft, target)
        self._untimed_pairs_logged = untimed
        return not untimed

    def holds_auto_pipelining(self, speculation: Speculation, shared: bool) -> bool:
        """Pipelining auto, held off for this request: the draft shares the target's hardware
        (shared: draft_shares_compute(), asked once per request)."""
        return (self.pipeline_mode(speculation) == "auto"
                and self.hold_auto_pipelining_on_shared_compute and shared)

    def pipeline_mode(self, speculation: Speculation) -> PipelineMode:
        """A request's pipelining mode: its own, else the server's --pipeline."""
        return speculation.pipeline or self.config.pipeline

    def pipeline_fanout(self, speculation: Speculation) -> int:
        """A request's fan-out (candidates per outcome under on, the most under auto): its own,
        else the server's --pipeline-fanout, else the mode's default (default_pipeline_fanout)."""
        fanout = next((f for f in (speculation.pipeline_fanout, self.config.pipeline_fanout) if f is not None),
                      default_pipeline_fanout(self.pipeline_mode(speculation)))
        if not 0 <= fanout <= MAX_PIPELINE_FANOUT:
            raise OutOfRange(f"pipeline_fanout must be in [0, {MAX_PIPELINE_FANOUT}], got {fanout}")
        return fanout

    def pipeline(self, speculation: Speculation, policy: KPolicy, greedy: bool = True,
                 held: bool = False) -> PipelinePolicy:
        """Whether and how widely a request drafts ahead (orchestrator/pipelining.py); held:
        pipelining auto holds off for it (holds_auto_pipelining)."""
        mode = self.pipeline_mode(speculation)
        fanout = self.pipeline_fanout(speculation)
        if held:
            return NoPipeline()
        if mode == "off" or self.draft_method != "model":
            return NoPipeline()  # a lookup answers at once: nothing to draft ahead of
        if mode == "stream":
            # The target verifies up to K offered drafts a pass: fixed K's, else the server's K.
            depth = policy.num_speculative_tokens if isinstance(policy, FixedK) else self.config.num_speculative_tokens
            # Branches only where the request asks for them: on the default pair they earned
            # nothing greedy and cost sampled output 2 % (docs/architecture.md, "Pipelining").
            branches = speculation.pipeline_fanout or 0
            return StreamedDrafts(depth, self.stream_paces[greedy], fanout=branches) if depth > 0 else NoPipeline()
        if fanout == 0:
            return NoPipeline()
        if mode == "auto" and isinstance(policy, AdaptiveKController):
            return policy.pipeline(fanout, self.pipeline_priors["greedy" if greedy else "sampled"])
        return FixedPipeline(fanout)

    def stretch_offers(self, speculation: Speculation, policy: KPolicy, greedy: bool = True,
                       held: bool = False) -> StreamedDrafts | None:
        """Under pipelining auto, an adaptive session's K = 0 stretches (Decode calls) are
        offered the model draft's drafts as streamed requests are, where that pays (not when
        held: holds_auto_pipelining)."""
        mode = self.pipeline_mode(speculation)
        if mode != "auto" or self.draft_method != "model" or not isinstance(policy, AdaptiveKController) or held:
            return None
        return StreamedDrafts(min(STRETCH_OFFER_DEPTH, self.config.max_num_speculative_tokens),
                              self.stretch_paces[greedy])

    def generate(
        self,
        prompt: PromptInput,
        max_new_tokens: int | None,
        sampling: SamplingParams,
        stop: Sequence[str] = (),
        speculation: Speculation = Speculation(),
        partition: str = "",
    ) -> AsyncIterator[Chunk]:
        """One request, validated here and streamed by the loop (orchestrator/generation.py),
        recorded in metrics and traces (orchestrator/telemetry.py) from its arrival, now.
        partition: the caller's share of state kept across requests (the shared suffix cache):
        with bearer tokens configured, a digest of the request's token; "" otherwise."""
        arrived = time.perf_counter()
        shared = self.draft_shares_compute()
        policy = self.policy(speculation, greedy=sampling.greedy, shared_compute=shared)
        held = self.holds_auto_pipelining(speculation, shared)
        pipeline = self.pipeline(speculation, policy, greedy=sampling.greedy, held=held)
        if any(not s for s in stop):
            raise InvalidInput("stop strings must not be empty")
        if stop and self.tokenizer is None:
            raise InvalidInput("stop strings need a tokenizer; the target has none")
        request = GenerationRequest(
            prompt_token_ids=self.tokenize(prompt),
            max_new_tokens=self.config.default_max_new_tokens if max_new_tokens is None else max_new_tokens,
            sampling=sampling,
            stop=tuple(stop),
            speculate=(speculation.mode or self.config.speculation) != "off",
            cache_partition=partition,
        )
        recorder = self.telemetry.request(len(request.prompt_token_ids), arrived)
        stretch_offers = self.stretch_offers(speculation, policy, greedy=sampling.greedy, held=held)
        self.guard.set_shares_compute(shared)
        generation = Generation(request, policy, self.target_pool, self.draft_pool, self.tokenizer,
                                self.limits(), observer=recorder, local_draft=self.local_drafts.session(partition),
                                guard=self.guard if isinstance(policy, AdaptiveKController) else None,
                                pipeline=pipeline, stretch_offers=stretch_offers,
                                request_streaming=self.request_streaming if stretch_offers is not None else None,
                                pipelining_held=held)
        return recorder.stream(generation.run(), generation.stats)
