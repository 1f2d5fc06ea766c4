"""One request's guess-verify loop.

The orchestrator owns the committed sequence C. It prefills the draft and the target together
(the first token does not wait for the draft; under hybrid the draft gets C only when the model is
first needed), then runs rounds: the K policy picks K, the draft proposes K tokens (no draft call at K = 0), the
target verifies them in one pass, and the accepted drafts plus the target's next token join C.
What is committed streams out as it comes. Where the sessions live and how they survive a lost
replica is orchestrator/recovery.py's business; docs/architecture.md has the whole picture.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from orchestrator.clients import DecodeStep, DraftClient, SpeculateCall, TargetClient
from orchestrator.k_policy import (
    DecodedPasses,
    KPolicy,
    LookupChooser,
    PlainStretches,
    RoundObservation,
    ShadowProbes,
)
from orchestrator.local_draft import LocalDraft, lookup_reply
from orchestrator.pipelining import (
    MIN_PACE_TOKENS,
    NO_AHEAD,
    AheadObservation,
    AheadPlan,
    NoPipeline,
    PipelinePolicy,
    RequestStreaming,
    StreamedDrafts,
)
from orchestrator.pool import ReplicaPool
from orchestrator.recovery import SessionReplicas
from orchestrator.speculation_guard import SpeculationGuard
from orchestrator.stats import GenerationStats, StatsObserver
from orchestrator.text import Decoder, TextStream
from specdec.errors import InvalidInput, OutOfRange, ReplicaError
from specdec.lookup import NO_LOOKUP
from specdec.protocol import (
    MAX_DECODE_STEPS,
    CallTiming,
    DecodeLookup,
    DraftedAhead,
    DraftOffer,
    DraftTally,
    Proposal,
    Reply,
    SamplingParams,
    VerifyOutcome,
)

log = logging.getLogger(__name__)

NO_PROPOSAL = Proposal(token_ids=())
# While the guard holds the system at K = 0 with a test due, a request's first Decode asks for
# this many tokens; later ones for as many as its pace fits before the guard's next test.
GUARDED_DECODE_STEPS = 8
# A session whose controller stays at K = 0 decodes its next rounds in one call; with a lookup
# draft, where the target does not look up in the call itself, at most this many, so that the
# lookup is consulted again soon.
LOOKUP_PLAIN_STEPS = 4
# While the guard holds the system at K = 0 the target verifies a token it looks up in a Decode
# pass only where it is likelier accepted than not: the prices of a row undershoot under load (on
# a float32 CPU at 4 sessions a row cost 2-3 times what they said), and there one row is paid for
# by every session in the pass.
GUARDED_LOOKUP_CHANCE = 0.5


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    speculate: bool = True  # False: speculation off, no draft session at all
    # The caller's share of state kept across requests (shared suffix caches, here and on draft
    # replicas): with bearer tokens configured a digest of the request's token, else "".
    cache_partition: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidInput("the prompt is empty")
        if self.max_new_tokens < 1:
            raise InvalidInput(f"max_new_tokens must be > 0, got {self.max_new_tokens}")


@dataclass(frozen=True)
class GenerationLimits:
    """What the replicas allow, from their Info."""

    max_context: int
    max_num_speculative_tokens: int
    eos_token_ids: frozenset[int]
    draft_retry_rounds: int = 8  # K = 0 rounds between attempts to get a draft back


@dataclass
class _ShadowProbe:
    """A probe to run beside a stretch: its K, the length of C at which it is sent, its fan-out
    (> 0: it drafts ahead, a Speculate, to measure the draft's candidate ranks), and once sent,
    the draft's proposal with what it drafted ahead (None: nothing) and the length of C it drafts
    from."""

    num_speculative_tokens: int
    launch_at: int
    fanout: int = 0
    task: asyncio.Task[tuple[Reply[Proposal], DraftedAhead | None] | None] | None = None
    start: int = 0


@dataclass
class _OpenStretch:
    """A stretch of K = 0 rounds whose Decode call goes on past the policy's next probe (that
    probe runs beside it): at each segment's end (segment_end, a length of C) the segment is told
    to the policy and its probe observed, and the policy's next choice either sets the next segment
    or ends the call (EndDecode; ending), instead of a new call paying the target's round trip."""

    call_start: int  # the length of C the Decode started from
    segment_start: int
    segment_end: int
    segment_started: float  # perf_counter at segment_start
    observed: int = 0  # the call's tokens told to the policy so far
    ending: bool = False
    call_steps: int = 0  # the tokens the Decode asked for

    def left(self, committed_length: int) -> int:
        """The tokens the call still brings (at most) when C has committed_length."""
        return self.call_steps - (committed_length - self.call_start)


@dataclass(frozen=True)
class _Branches:
    """What a Speculate drafted ahead: its branches, their timing (wall time from the proposal's
    arrival), and the call's round trip up to its proposal when they came on a call of their own
    (after a hit; None when they followed the round's own proposal)."""

    ahead: DraftedAhead
    timing: CallTiming
    hop_seconds: float | None


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "length" | "eos" | "stop" | "context" on the last chunk
    stats: GenerationStats | None = None


class Generation:
    def __init__(
        self,
        request: GenerationRequest,
        policy: KPolicy,
        target_pool: ReplicaPool[TargetClient],
        draft_pool: ReplicaPool[DraftClient],
        tokenizer: Decoder | None,
        limits: GenerationLimits,
        observer: StatsObserver | None = None,
        local_draft: LocalDraft | None = None,
        guard: SpeculationGuard | None = None,
        pipeline: PipelinePolicy | None = None,
        stretch_offers: StreamedDrafts | None = None,
        request_streaming: RequestStreaming | None = None,
        pipelining_held: bool = False,
    ) -> None:
        if len(request.prompt_token_ids) >= limits.max_context:
            raise OutOfRange(f"the prompt has {len(request.prompt_token_ids)} tokens; the max context "
                             f"is {limits.max_context}")
        self.request = request
        self.policy = policy
        self.limits = limits
        self.guard = guard  # whether speculation pays the system at all (adaptive requests only)
        self.pipeline = pipeline if pipeline is not None else NoPipeline()  # drafting ahead
        self.stretch_offers = stretch_offers  # offers beside the adaptive controller's K = 0 stretches
        # Pipelining auto: whether this request runs the controller's rounds or streams (with the
        # stretches' offers) is chosen by measured pace; None until chosen, and when not auto.
        self.request_streaming = request_streaming
        self.pipelining_held = pipelining_held  # auto, held off: the draft shares the target's hardware
        self._streams: bool | None = None
        self._network = 0  # the octave of the hops' round trips the request starts on (_network_octave)
        self._tested_ahead = False  # a round drafted ahead as a test (AheadPlan.test)
        # Since when (perf_counter, generated tokens, offered drafts accepted, tokens drafted in
        # rounds) the request has run its present way; whether that way is a test still to be
        # judged at MIN_PACE_TOKENS (_switch_if_losing); switched.
        self._way_since: tuple[float, int, int, int] = (0.0, 0, 0, 0)
        self._way_on_trial = False
        self._switched = False
        self._branch: tuple[int, Proposal] | None = None  # (length of C it follows, its drafts)
        self._decode_token_seconds: float | None = None  # wall time per token of the last Decode
        self._decoded_in_call = 0  # tokens the last Decode brought
        self._accepted_in_call = 0  # offered drafts its passes accepted
        self._offers_stopped = False  # the last Decode's offers stopped early (StreamPaces)
        # Under sampling, p(y) of each token of the current Decode by its index in C, for a probe
        # beside the stretch; a target that does not send them leaves such probes unmeasurable.
        self._decoded_probabilities: dict[int, float] = {}
        self._grew = asyncio.Event()  # set whenever C grows (streamed speculation offers from it)
        self._sampled_probes_measurable = True
        self.committed: list[int] = list(request.prompt_token_ids)
        self.text = TextStream(tokenizer, request.stop)
        self.stats = GenerationStats(prompt_tokens=len(request.prompt_token_ids), observer=observer)
        self.replicas = SessionReplicas(uuid.uuid4().hex, request.sampling, target_pool, draft_pool,
                                        self.stats, limits.draft_retry_rounds, request.cache_partition)
        # A model-free draft (orchestrator/local_draft.py); hybrid also keeps the model draft.
        self.local_draft = local_draft if request.speculate else None
        self.uses_model_draft = request.speculate and (local_draft is None or local_draft.uses_model)
        if self.local_draft is not None and not self.uses_model_draft:
            self.stats.draft_replica = f"local:{self.local_draft.method}"

    async def run(self) -> AsyncIterator[Chunk]:
        started = time.perf_counter()
        if self.guard is not None:
            self.guard.enter()
        try:
            # Hybrid sends the draft its prompt only when the model is first needed; so does a
            # request that arrives while the guard keeps the system at K = 0 (its draft's prefill
            # would take the target's CPU, or a draft replica's, for rounds that may never come).
            defer_draft = self.local_draft is not None or (self.guard is not None
                                                           and not self.guard.allows_speculation())
            first = await self.replicas.prefill(self.committed, self.uses_model_draft, defer_draft=defer_draft)
            self.stats.time_to_first_token_seconds = time.perf_counter() - started
            if self.request_streaming is not None and self._offered_stretch() is not None:
                self._network = self._network_octave()
                drafts = measuring = False
                if isinstance(self.policy, PlainStretches):
                    drafts, measuring = self.policy.would_draft(), self.policy.measures_beside()
                self._streams = self.request_streaming.streams_next(self.request.sampling.greedy, self._network,
                                                                    drafts=drafts, measuring=measuring)
            chunk: Chunk | None = self._commit([first])
            self._start_way()
            while chunk is None or chunk.finish_reason is None:
                if chunk is not None:  # None: a stretch's chunks went out as they came
                    yield chunk
                self._switch_if_losing()
                plain_rounds = 0
                shadow: _ShadowProbe | None = None
                streamed = offered = self._streamed()
                if self._speculating() and streamed is None:
                    plain_rounds = self._plain_rounds()
                    if plain_rounds == 0:
                        chunk = self._commit(await self._round())
                        continue
                    shadow = self._take_shadow_probe(plain_rounds)
                    offered = self._offered_stretch()
                decoded: Chunk | None = None
                # A streamed request under auto always offers: RequestStreaming chose it for its
                # offers; a K = 0 stretch that can go on past its probes does not (it runs as
                # adaptive K's own; offering is the streamed requests' way), another offers where
                # its Decode calls measure that faster.
                opens = self._can_open_stretch(plain_rounds, shadow, streamed is not None)
                offers = offered is not None and (bool(self._streams) or (not opens and offered.paces.offer_next()))
                stretch = self._open_stretch(plain_rounds) if opens and not offers else None
                decoding = self._decode(plain_rounds, streamed=streamed is not None, stretch=stretch)
                self._offers_stopped = False
                offering = asyncio.create_task(self._offer_drafts(offered, shadow)) if offers else None
                try:
                    if offering is None:  # else the offers' loop sends it, between its own draft calls
                        self._launch_shadow_probe(shadow)
                    async for tokens in decoding:
                        decoded = self._commit(list(tokens))
                        if decoded.finish_reason is not None:
                            break  # the last chunk goes out below, with the stats
                        yield decoded  # each token as it comes, not held back for the next
                        if offering is None or offering.done():
                            self._launch_shadow_probe(shadow)
                        if (stretch is not None and not stretch.ending
                                and len(self.committed) >= stretch.segment_end):
                            shadow = await self._next_segment(stretch, shadow)
                except BaseException:
                    if shadow is not None and shadow.task is not None:
                        shadow.task.cancel()
                    raise
                finally:
                    await decoding.aclose()  # a finished request cancels the rest of the call
                    if offering is not None:
                        offering.cancel()
                        (ended,) = await asyncio.gather(offering, return_exceptions=True)
                        if isinstance(ended, Exception):  # offers are an optimisation: the Decode went on
                            log.warning("offering drafts to the target failed: %s", ended)
                if (offered is not None and not self._streams and self._decoded_in_call >= MIN_PACE_TOKENS
                        and not self._offers_stopped):
                    assert self._decode_token_seconds is not None
                    share = self._accepted_in_call / self._decoded_in_call if offers else None
                    offered.paces.observe(offers, self._decode_token_seconds, share)
                if decoded is None:
                    chunk = self._commit([])
                else:
                    chunk = decoded if decoded.finish_reason is not None else None
                finished = chunk is not None and chunk.finish_reason is not None
                if shadow is not None and shadow.task is not None:
                    if not finished:
                        await self._observe_shadow_probe(shadow)
                    else:
                        shadow.task.cancel()  # the request is over: nothing left to choose K for
            assert chunk is not None  # the loop ends on a chunk with a finish reason
            self.stats.wall_seconds = time.perf_counter() - started
            self.stats.controller_estimates = dict(self.policy.estimates())
            if self._streams is not None:
                self.stats.controller_estimates["auto_streamed"] = float(self._streams)
                self.stats.controller_estimates["auto_switched"] = float(self._switched)
                self._observe_way_pace()
            for streamed in (self.pipeline, self.stretch_offers):
                if isinstance(streamed, StreamedDrafts) and self.stats.offers:
                    self.stats.controller_estimates["stream_lookahead"] = streamed.lookahead
            if self.pipelining_held:
                self.stats.controller_estimates["draft_shares_compute"] = 1.0
            if self.guard is not None:
                self.stats.controller_estimates["system_speculating"] = float(self.guard.speculating)
            if self.local_draft is not None:
                self.local_draft.finish(self.committed, self.stats.prompt_tokens)
            yield Chunk(chunk.token_ids, chunk.text + self.text.flush(), chunk.finish_reason, self.stats)
        finally:
            if self.guard is not None:
                self.guard.leave()
            self.replicas.release_all()

    async def _round(self) -> list[int]:
        """One guess-verify round (speculation on: _speculating); returns the tokens it commits
        (accepted drafts + next token)."""
        if self.uses_model_draft and self.local_draft is None:
            await self.replicas.settle_draft(self.committed)  # the first token did not wait for it
        if self.uses_model_draft and not self.replicas.has_draft:
            await self.replicas.reattach_draft_if_due(self.committed)
        can_draft = self.local_draft is not None or self.replicas.has_draft
        max_num_speculative_tokens = self._max_num_speculative_tokens() if can_draft else 0
        num_speculative_tokens = self.policy.choose(max_num_speculative_tokens)
        branch = self._take_branch(num_speculative_tokens)
        plan = NO_AHEAD
        if num_speculative_tokens > 0 and self.local_draft is None and self.replicas.has_draft:
            plan = self.pipeline.plan(num_speculative_tokens, self.limits.max_num_speculative_tokens)
            self._tested_ahead = self._tested_ahead or plan.test
        proposed, method, ahead_call = None, "", None
        if branch is not None:  # drafted ahead last round: the target gets it at once
            proposal = branch
            self.stats.pipeline_hits += 1
            draft_side = asyncio.create_task(self._adopt(proposal, plan))
        else:
            draft_side = None
            if num_speculative_tokens > 0 and plan.drafts_ahead:
                started = await self.replicas.speculate(self.committed, num_speculative_tokens, plan.fanout,
                                                        plan.branch_num_speculative_tokens)
                if started is not None:
                    proposed, ahead_call = started
                method = self.replicas.draft_method
            elif num_speculative_tokens > 0 or self.local_draft is not None:
                proposed, method = await self._propose(num_speculative_tokens, max_num_speculative_tokens)
            if self.uses_model_draft and not self.replicas.has_draft and not self.replicas.draft_attaching:
                self.stats.draft_unavailable_rounds += 1
            proposal = proposed.value if proposed else NO_PROPOSAL
            if ahead_call is not None:
                draft_side = asyncio.create_task(self._branches(ahead_call, hop_seconds=None))
        try:
            verified = await self.replicas.verify(self.committed, proposal)
            ahead = await draft_side if draft_side is not None else None
        finally:
            if draft_side is not None and not draft_side.done():
                draft_side.cancel()
                if ahead_call is not None:
                    ahead_call.cancel()
        outcome = verified.value
        self.stats.add_round(proposal.num_speculative_tokens, outcome.num_accepted, outcome.num_accepted + 1)
        if proposal.num_speculative_tokens:
            self.stats.add_method_round(method or self.replicas.draft_method, proposal.num_speculative_tokens,
                                        outcome.num_accepted)
        self.policy.observe(_observation(proposed, verified, proposal, hit=branch is not None,
                                         drafting_ahead=plan.drafts_ahead and draft_side is not None,
                                         lookup_match_lengths=proposal.match_lengths))
        committed = [*proposal.token_ids[: outcome.num_accepted], outcome.next_token_id]
        if ahead is not None:
            self._keep_branch(ahead, proposal, outcome, plan, len(self.committed) + len(committed))
        return committed

    def _speculating(self) -> bool:
        """Whether the next round may speculate: not when the request turned speculation off,
        nor while the guard holds the whole system at K = 0."""
        return self.request.speculate and (self.guard is None or self.guard.allows_speculation())

    def _network_octave(self) -> int:
        """The network the request starts on, as RequestStreaming keeps its measurements apart:
        the octave of the draft's and the target's round trips together, in milliseconds, as the
        session's controller starts with them (the pool's latest)."""
        figures = self.policy.estimates()
        total = figures.get("rtt_draft", 0.0) + figures.get("rtt_target", 0.0)
        return int(math.log2(max(1.0, total * 1000.0)))

    def _start_way(self) -> None:
        """The request runs its way (RequestStreaming: rounds or streamed) from here; a test of
        the way the measurements do not favour is judged at MIN_PACE_TOKENS."""
        self._way_since = (time.perf_counter(), self.stats.generated_tokens, self.stats.offered_accepted,
                           self.stats.drafted_tokens)
        self._way_on_trial = (self._streams is not None and self.request_streaming is not None
                              and self.request_streaming.is_test(self.request.sampling.greedy, self._streams,
                                                                 self._network))

    def _way_pace(self) -> tuple[int, float]:
        """Tokens committed the present way, and their wall time per token."""
        started, first, _, _ = self._way_since
        tokens = self.stats.generated_tokens - first
        return tokens, (time.perf_counter() - started) / max(1, tokens)

    def _way_accepted_share(self) -> float | None:
        """Streamed: the share of the tokens committed the present way that were offered drafts
        the target accepted (StreamPaces.observe); None for rounds."""
        if not self._streams:
            return None
        _, first, accepted, _ = self._way_since
        return (self.stats.offered_accepted - accepted) / max(1, self.stats.generated_tokens - first)

    def _way_drafted(self) -> bool | None:
        """Rounds: whether they drafted since the present way began (RequestStreaming keeps the
        rounds' pace with it); None when streamed."""
        if self._streams:
            return None
        return self.stats.drafted_tokens > self._way_since[3]

    def _switch_if_losing(self) -> None:
        """A test of the way the measurements do not favour, once it has run MIN_PACE_TOKENS
        tokens: when clearly slower than the other way measures, it is told so and the rest of
        the request runs the other way (once: no switching back)."""
        if not self._way_on_trial:
            return
        assert self.request_streaming is not None and self._streams is not None
        tokens, pace = self._way_pace()
        if tokens < MIN_PACE_TOKENS:
            return
        self._way_on_trial = False
        greedy = self.request.sampling.greedy
        if self.request_streaming.clearly_slower(greedy, self._streams, pace, self._network):
            self.request_streaming.observe(greedy, self._streams, pace, self._network, self._way_accepted_share(),
                                           self._way_drafted())
            self._streams, self._switched = not self._streams, True
            self._start_way()
            self._way_on_trial = False

    def _observe_way_pace(self) -> None:
        """Tells RequestStreaming the wall time per token of the request's tokens after its
        first that ran its last way, when there are enough of them to say, and its rounds ran no
        test of drafting ahead (a fresh pool's, while the draft's candidate ranks are measured:
        the pace of a rounds request with tests is not the rounds' own, and measured so, it chose
        streaming for requests after it that then ran slower)."""
        assert self.request_streaming is not None and self._streams is not None
        tokens, pace = self._way_pace()
        if tokens >= MIN_PACE_TOKENS and (self._streams or not self._tested_ahead):
            self.request_streaming.observe(self.request.sampling.greedy, self._streams, pace, self._network,
                                           self._way_accepted_share(), self._way_drafted())

    def _streamed(self) -> StreamedDrafts | None:
        """Streamed speculation for the coming Decode (orchestrator/pipelining.py), when the
        request speculates with a model draft and the draft is there or on its way (under
        pipelining auto, when RequestStreaming chose to stream this request)."""
        if self._streams:
            return self._offered_stretch() if self._speculating() else None
        if (not isinstance(self.pipeline, StreamedDrafts) or not self._speculating()
                or not self.uses_model_draft or not self._model_draft_in_reach()):
            return None
        return self.pipeline

    def _offered_stretch(self) -> StreamedDrafts | None:
        """Offers beside the coming K = 0 stretch (pipelining auto), when the session has its model
        draft (a hybrid session's stretches keep its lookups' turn)."""
        if (self.stretch_offers is None or not self.uses_model_draft or self.local_draft is not None
                or not self._model_draft_in_reach()):
            return None
        return self.stretch_offers

    async def _offer_drafts(self, streamed: StreamedDrafts, shadow: _ShadowProbe | None = None) -> None:
        """Beside a streamed Decode: each time C has grown, the draft drafts from it, enough to
        reach past where the target is expected to be by the time they arrive, and offers them to
        the target. With a draft that follows streams (Follow), C's tokens go to it as they come
        and it drafts from the newest C whenever it is free (_follow_offers); otherwise, and with a
        probe beside the stretch (shadow), one draft call at a time (_offer_call_by_call). Ends
        when the draft is gone or the offers clearly slow a stretch's Decode (it goes on alone; a
        streamed request's offers are judged by its test, _switch_if_losing), or when cancelled."""
        async def offer(drafted: DraftOffer, sent_at: int) -> None:
            held, length = await self.replicas.offer(drafted)
            if held and not drafted.branches:  # the same drafts' own offer measured it
                streamed.observe_hop(length - sent_at)

        def send(drafted: DraftOffer) -> None:  # not waited for: the draft drafts on meanwhile
            if not drafted.branches:  # the same drafts' own offer measured it
                streamed.observe_drafting(len(self.committed) - drafted.start)
            if not self._still_ahead(drafted):
                self.stats.offers_dropped += 1
                return
            self.stats.offers += 1
            task = asyncio.create_task(offer(drafted, len(self.committed)))
            sent.add(task)
            task.add_done_callback(sent.discard)

        sent: set[asyncio.Task[None]] = set()
        try:
            if shadow is None and await self._follow_offers(streamed, send):
                return
            await self._offer_call_by_call(streamed, send, shadow)
        finally:
            for task in list(sent):
                task.cancel()

    def _offers_slow_the_stretch(self, streamed: StreamedDrafts, started: float, first: int) -> bool:
        """Whether a stretch's offers clearly slow its Decode, by its pace since they began (then
        recorded, and the rest of the call decodes alone)."""
        decoded = len(self.committed) - first
        if decoded < MIN_PACE_TOKENS or self._streams:  # a streamed request's own test judges it
            return False
        pace = (time.perf_counter() - started) / decoded
        if not streamed.paces.clearly_slower(pace):
            return False
        streamed.paces.observe(True, pace)
        self._offers_stopped = True
        return True

    def _offer_shape(self, streamed: StreamedDrafts) -> tuple[int, int, int, int]:
        """The next offer's drafts, fan-out, drafts per branch and branched outcomes (no branches,
        fan-out 0, where the offer is expected to arrive before C passes its start)."""
        drafts = streamed.drafts_per_offer(self._max_num_speculative_tokens())
        outcomes = streamed.branch_outcomes(drafts)
        return drafts, (streamed.fanout if outcomes else 0), max(1, drafts - 1), outcomes

    async def _follow_offers(self, streamed: StreamedDrafts, send: Callable[[DraftOffer], None]) -> bool:
        """Offers from one Follow stream: C's new tokens go to the draft as they come, and each of
        its answers (a proposal, then its branches) goes to the target as it comes. Neither waits
        for the other: the draft drafts from the newest C whenever it is free, without a round trip
        of its own between offers. False where the draft turns out not to follow streams (the
        caller offers call by call)."""
        start = list(self.committed)
        await self.replicas.settle_draft(start)  # the draft's first Prefill may still be on its way
        if not self.replicas.has_draft:
            return True
        if not self.replicas.draft_follows:
            return False

        call = await self.replicas.follow(start, *self._offer_shape(streamed))
        if call is None:
            return True
        sent_up_to, started = len(start), time.perf_counter()

        async def feed() -> None:  # ends when the offers slow the stretch
            nonlocal sent_up_to
            while not self._offers_slow_the_stretch(streamed, started, len(start)):
                if len(self.committed) == sent_up_to:
                    self._grew.clear()
                    await self._grew.wait()
                    continue
                new = self.committed[sent_up_to:]
                sent_up_to = len(self.committed)
                await call.grow(new, *self._offer_shape(streamed))

        feeding = asyncio.create_task(feed())
        reading: asyncio.Future | None = None
        try:
            drafted: DraftOffer | None = None
            while True:
                reading = asyncio.ensure_future(call.read())
                await asyncio.wait((reading, feeding), return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():  # the feed ended (or failed): no more offers
                    reading.cancel()
                    feeding.result()
                    return True
                answer = reading.result()
                if answer is None:
                    return self.replicas.draft_follows  # False: it has no Follow
                if isinstance(answer, tuple):
                    ahead, _ = answer
                    if drafted is not None and ahead.branches:
                        send(replace(drafted, branches=ahead.branches))
                    continue
                self.replicas.followed(answer)
                drafted = DraftOffer(answer.handle.committed_length, answer.value, streamed.num_speculative_tokens)
                send(drafted)
        except (ReplicaError, InvalidInput, OutOfRange) as error:  # offers are an optimisation
            log.info("following on the draft failed: %s", error)
            return True
        finally:
            for task in (feeding, reading):
                if task is not None:
                    task.cancel()
            call.cancel()

    async def _offer_call_by_call(self, streamed: StreamedDrafts, send: Callable[[DraftOffer], None],
                                  shadow: _ShadowProbe | None) -> None:
        """Offers from one draft call at a time, each from C as it is when the call goes out. A
        probe beside the stretch (shadow) goes out between these draft calls when the stretch
        reaches its start, so the draft session sees C only grow."""
        offered_from = -1
        started, first = time.perf_counter(), len(self.committed)
        while True:
            if len(self.committed) == offered_from:
                self._grew.clear()
                await self._grew.wait()
                continue
            if self._offers_slow_the_stretch(streamed, started, first):
                return
            if shadow is not None and shadow.task is None and len(self.committed) >= shadow.launch_at:
                self._launch_shadow_probe(shadow)
                assert shadow.task is not None
                await asyncio.wait([shadow.task])  # its own result is read after the stretch
            start = list(self.committed)
            offered_from = len(start)
            await self.replicas.settle_draft(start)
            if not self.replicas.has_draft:
                return
            drafts, fanout, branch_drafts, outcomes = self._offer_shape(streamed)
            call: SpeculateCall | None = None
            if outcomes:
                answer = await self.replicas.speculate(start, drafts, fanout, branch_drafts, outcomes)
                reply, call = answer if answer is not None else (None, None)
            else:
                reply = await self.replicas.propose(start, drafts)
            if reply is None:
                return
            drafted = DraftOffer(len(start), reply.value, streamed.num_speculative_tokens)
            send(drafted)
            if call is not None:  # the same drafts again with their branches, as soon as they come
                try:
                    ahead = await self.replicas.branches(call)
                finally:
                    call.cancel()
                if ahead is not None and ahead[0].branches:
                    send(replace(drafted, branches=ahead[0].branches))

    def _still_ahead(self, drafted: DraftOffer) -> bool:
        """Whether an offer can still be of use when it reaches the target: C as the orchestrator
        has it (which the target's only extends) still follows its drafts, or one of its
        branches', and has not passed their end. An offer drafted from C some tokens back mostly
        guessed one of those tokens wrong by the time the draft answers; the target need not be
        told. A resend with branches counts as an offer of its own."""
        known = self.committed[drafted.start:]
        return bool(drafted.drafts_after(known, drafted.start, len(self.committed))[0].token_ids)

    def _plain_rounds(self) -> int:
        """K = 0 rounds the policy commits to from here (PlainStretches: fixed K = 0, and the
        adaptive controller while its choice is K = 0), to decode in one call; 0 runs a round.
        The adaptive controller weighs a lookup draft's proposals each round: the lookup is asked
        first, a proposal the controller would verify gets its round; a stretch whose Decode
        looks up tokens itself (_looks_up_in_decode) runs to the controller's next probe, any other
        at most LOOKUP_PLAIN_STEPS, so that the lookup is asked again soon."""
        if not isinstance(self.policy, PlainStretches):
            return 0
        rounds = self.policy.plain_rounds(shadow=self._can_shadow_probe())
        if rounds <= 0 or self.local_draft is None or not isinstance(self.policy, LookupChooser):
            return max(0, rounds)  # other policies verify up to their K of a lookup: none at K = 0
        found, _ = self.local_draft.lookup(self.committed, self._max_num_speculative_tokens())
        model_k = self._model_k_beside(self.local_draft, 0, self._model_draft_in_reach())
        if found.token_ids and self.policy.choose_lookup(found.match_lengths, model_k):
            return 0
        return rounds if self._looks_up_in_decode() else min(rounds, LOOKUP_PLAIN_STEPS)

    def _can_open_stretch(self, plain_rounds: int, shadow: _ShadowProbe | None, streamed: bool) -> bool:
        """Whether the coming stretch can go on past its probes (_OpenStretch): one the policy chose,
        its probes beside it, not a streamed request's nor a test of the request's way, on a
        target that can end a Decode early. Its probes no longer cost a call each; where one
        changes the choice, the call ends after the target's pass then running."""
        return (plain_rounds > 0 and not streamed and not self._way_on_trial and self.replicas.ends_decodes
                and (shadow is not None or self._can_shadow_probe()))

    def _open_stretch(self, plain_rounds: int) -> _OpenStretch:
        start = len(self.committed)
        return _OpenStretch(start, start, start + plain_rounds, time.perf_counter())

    async def _next_segment(self, stretch: _OpenStretch, shadow: _ShadowProbe | None) -> _ShadowProbe | None:
        """At the end of an open stretch's segment: its rounds and pace told to the policy (the
        passes' timings come with the call's end), its probe observed, and the policy's next
        choice: a further segment (-> its probe, if any) or K = 0 no longer (the Decode is ended
        after its current pass; its remaining tokens still come and are rounds like these)."""
        now = time.perf_counter()
        rounds = len(self.committed) - stretch.segment_start
        if rounds > 0 and isinstance(self.policy, PlainStretches):
            self.policy.observe_plain(rounds, (now - stretch.segment_started) / rounds)
        stretch.observed += rounds
        if shadow is not None and shadow.task is not None:
            await self._observe_shadow_probe(shadow)
        if stretch.left(len(self.committed)) <= 0:
            return None  # the call ends here anyway: the next is chosen as after any call
        next_rounds = self._plain_rounds()
        if next_rounds <= 0:
            stretch.ending = True
            await self.replicas.end_decode(stretch.call_start)
            return None
        stretch.segment_start, stretch.segment_started = len(self.committed), time.perf_counter()
        stretch.segment_end = stretch.segment_start + next_rounds
        # The probe goes out before the call's end, where the segment ends if it reaches it.
        return self._take_shadow_probe(min(next_rounds, stretch.left(len(self.committed))))

    def _can_shadow_probe(self) -> bool:
        """Whether a probe can run beside a stretch (ShadowProbes): a model draft replica holding
        the session or being given it, and under sampling a target whose Decode sends each
        token's p(y) (without it the probes are rounds)."""
        return (isinstance(self.policy, ShadowProbes) and self.uses_model_draft
                and (self.request.sampling.greedy or self._sampled_probes_measurable)
                and self._model_draft_in_reach() and self.replicas.draft_method == "model")

    def _take_shadow_probe(self, plain_rounds: int) -> _ShadowProbe | None:
        """The probe the policy took for the coming stretch, if any, to be sent when the stretch
        has its K tokens left: its drafts are then tested against the stretch's last tokens, and
        the draft is left with only those to catch up on when drafting resumes."""
        if not isinstance(self.policy, ShadowProbes):
            return None
        fanout = self.policy.shadow_probe_fanout
        num_speculative_tokens = min(self.policy.shadow_probe(), self._max_num_speculative_tokens())
        if num_speculative_tokens <= 0 or not self._model_draft_in_reach():
            return None
        remaining = self.request.max_new_tokens - self.stats.generated_tokens
        steps = min(plain_rounds, MAX_DECODE_STEPS, remaining, self.limits.max_context - len(self.committed))
        # Drafting ahead, one token earlier: the stretch then holds the token after all K drafts
        # too (an outcome's, where every draft matched).
        tested = num_speculative_tokens + (1 if fanout else 0)
        return _ShadowProbe(num_speculative_tokens, len(self.committed) + max(0, steps - tested), fanout)

    def _launch_shadow_probe(self, shadow: _ShadowProbe | None) -> None:
        """Sends the probe's Propose (a Speculate where it drafts ahead), from C as it is now, once
        the stretch has reached its start (it then runs beside the rest of the stretch)."""
        if shadow is None or shadow.task is not None or len(self.committed) < shadow.launch_at:
            return
        start = list(self.committed)
        num_speculative_tokens, fanout = shadow.num_speculative_tokens, shadow.fanout

        async def propose() -> tuple[Reply[Proposal], DraftedAhead | None] | None:
            await self.replicas.settle_draft(start)
            if not self.replicas.has_draft:
                return None
            if not fanout:
                reply = await self.replicas.propose(start, num_speculative_tokens)
                return (reply, None) if reply is not None else None
            # One draft per branch: the branches are not used, their candidates are what it measures.
            started = await self.replicas.speculate(start, num_speculative_tokens, fanout, 1)
            if started is None:
                return None
            reply, call = started
            try:
                ahead = await self.replicas.branches(call)
            finally:
                call.cancel()
            return reply, (ahead[0] if ahead is not None else None)

        shadow.start = len(start)
        shadow.task = asyncio.create_task(propose())

    async def _observe_shadow_probe(self, shadow: _ShadowProbe) -> None:
        """After the stretch: the probe's drafts against the tokens the target decoded from the
        same start, told to the policy (drafts the stretch had no tokens for are not tested)."""
        assert shadow.task is not None
        try:
            # Nothing cancels the probe alone while it is awaited here: a CancelledError is the
            # request's (it cancels the probe with it) and goes on up.
            answer = await shadow.task
        except Exception as error:  # a probe is only a measurement: the request goes on without it
            log.info("a probe beside a stretch failed: %s", error)
            return
        if answer is None or not isinstance(self.policy, ShadowProbes):
            return
        reply, ahead = answer
        drafts = reply.value.token_ids
        decoded = self.committed[shadow.start:shadow.start + len(drafts)]
        if not decoded:
            return
        matched = 0
        while matched < len(decoded) and drafts[matched] == decoded[matched]:
            matched += 1
        tested, chances = len(decoded), ()
        if not self.request.sampling.greedy:
            chances = self._sampled_chances(reply.value, shadow.start, decoded)
            if not chances:
                self._sampled_probes_measurable = False  # the target sent no p(y): probe in rounds
                log.info("the target's Decode sends no token probabilities: probes under sampling "
                         "run as rounds")
                return
            tested = len(chances)
        self.stats.shadow_probes += 1
        observation = RoundObservation(
            num_speculative_tokens=len(drafts), num_accepted=matched, acceptance_signal=chances,
            draft_compute_seconds=reply.timing.compute_seconds, draft_wall_seconds=reply.timing.wall_seconds,
            draft_fed_tokens=reply.value.fed_tokens, verify_compute_seconds=0.0, verify_wall_seconds=0.0)
        self.policy.observe_shadow(observation, tested=tested, behind=len(self.committed) - shadow.start)
        if ahead is not None and self.request.sampling.greedy:
            self._observe_shadow_outcome(shadow, len(drafts), matched, ahead)

    def _observe_shadow_outcome(self, shadow: _ShadowProbe, num_speculative_tokens: int, matched: int,
                                ahead: DraftedAhead) -> None:
        """A probe that drafted ahead beside a stretch (greedy): the stretch's tokens are what a
        Verify of its drafts would have committed, so its outcome, j drafts accepted then the
        stretch's next token t, and t's rank among the draft's candidates there are a
        drafted-ahead round's, told to the pipeline policy as one (no branch was verified)."""
        at = shadow.start + matched
        if at >= len(self.committed):
            return  # the stretch ended before the outcome's token
        token = self.committed[at]
        self.pipeline.observe_ahead(AheadObservation(
            num_speculative_tokens=num_speculative_tokens,
            num_accepted=matched,
            rank=ahead.rank(matched, token),
            candidates=len(ahead.candidates[matched]) if matched < len(ahead.candidates) else 0,
            fanout=shadow.fanout,
            branches=0,
            branch_num_speculative_tokens=1,
            compute_seconds=0.0,
            after_proposal_seconds=0.0,
            call_hop_seconds=None,
        ))

    def _sampled_chances(self, proposal: Proposal, start: int, decoded: list[int]) -> tuple[float, ...]:
        """Under sampling, min(1, q~_i(y_i) / p(y_i)) for each decoded token y_i from where the
        probe's drafts start, up to and including the first that differs from its draft (the
        drafts after it were drawn after another prefix, so their q~ is not the draft's there)."""
        return sampled_acceptance_chances(
            proposal, decoded, [self._decoded_probabilities.get(start + i) for i in range(len(decoded))])

    def _decode(self, plain_rounds: int = 0, streamed: bool = False,
                stretch: _OpenStretch | None = None) -> AsyncIterator[tuple[int, ...]]:
        """The target decodes the next tokens in one streamed call, each exactly a round without
        drafts, and keeps the session in its passes meanwhile instead of leaving it out of them
        for a round trip after every token. Up to MAX_DECODE_STEPS tokens for a request without
        speculation; plain_rounds when the controller chose them (it then observes them); while
        the guard holds the system at K = 0, _guarded_steps (no K is chosen, so the controller
        observes nothing). Under a guard both stop where its answer may change. An open stretch
        (_OpenStretch) asks for as many as a call may decode, or the guard allows: the loop ends
        it. A pipelined round's branch is dropped."""
        self._branch = None
        remaining = self.request.max_new_tokens - self.stats.generated_tokens
        context_left = self.limits.max_context - len(self.committed)
        if not self.request.speculate:
            steps = MAX_DECODE_STEPS
        elif streamed:  # the draft's offers join its passes (_offer_drafts)
            steps = self._guarded_steps() if self.guard is not None else MAX_DECODE_STEPS
            if self._way_on_trial:  # the call ends where the test is judged (_switch_if_losing)
                steps = min(steps, MIN_PACE_TOKENS - self._way_pace()[0])
        elif plain_rounds > 0:
            stretched = plain_rounds if stretch is None else MAX_DECODE_STEPS
            steps = min(stretched, self._guarded_steps()) if self.guard is not None else stretched
        else:
            steps = self._guarded_steps()
        self.stats.decode_calls += 1
        self._decoded_in_call = 0
        steps = max(1, min(steps, MAX_DECODE_STEPS, remaining, context_left))
        if stretch is not None:
            stretch.call_steps = steps
        # A stretch longer than one call takes several: each call that runs all it may is a full one.
        planned = min(plain_rounds, MAX_DECODE_STEPS)
        lookup = self._decode_lookup()
        return self._counted(self.replicas.decode(self.committed, steps, lookup), planned=planned,
                             priced=lookup is not None, streamed=streamed, stretch=stretch)

    def _decode_lookup(self) -> DecodeLookup | None:
        """Lookups in the Decode's own passes, for a speculating request whose draft method looks
        up (local_draft: hybrid, ngram, suffix) under the adaptive controller: where no drafts are
        offered, each pass verifies the tokens the target finds after C in C itself, as many as
        the price of a row allows: the controller's (LookupChooser.decode_lookup_min_chance), the
        target's own if higher, and while the guard holds K = 0 at least GUARDED_LOOKUP_CHANCE.
        The target looks them up with no hop, so a stretch of K = 0 rounds, the guard's K = 0
        and a streamed request still speculate where the text repeats itself. Any speculating
        request under the adaptive controller also lets a target with a draft head verify the
        head's drafts where nothing else proposes (at the same price; a target without one
        ignores it)."""
        looks_up, heads = self._looks_up_in_decode(), self._drafts_with_head()
        if not looks_up and not heads:
            return None
        assert isinstance(self.policy, LookupChooser)
        min_chance = self.policy.decode_lookup_min_chance()
        if not self._speculating():  # the guard holds the system at K = 0: the load is heavy
            min_chance = max(min_chance, GUARDED_LOOKUP_CHANCE)
        most = self._max_num_speculative_tokens()
        return DecodeLookup(most if looks_up else 0, min_chance, head_max_tokens=most if heads else 0)

    def _drafts_with_head(self) -> bool:
        """Whether this request's Decode calls let the target verify its draft head's drafts."""
        return (self.request.speculate and isinstance(self.policy, LookupChooser)
                and self._max_num_speculative_tokens() > 0)

    def _looks_up_in_decode(self) -> bool:
        """Whether this request's Decode calls look up tokens in their own passes (_decode_lookup)."""
        return (self.request.speculate and self.local_draft is not None and isinstance(self.policy, LookupChooser)
                and self._max_num_speculative_tokens() > 0)

    def _guarded_steps(self) -> int:
        """Tokens to decode under the guard: as many as fit before its answer may change (at the
        pace of this request's last Decode, or before it has one the sessions' recent pace), so
        that its next test finds the session between calls; GUARDED_DECODE_STEPS before any pace
        is known, unless nothing is due (a lone session's stretches are not cut for a test that
        will not come)."""
        if self.guard is None:
            return GUARDED_DECODE_STEPS
        pace = self._decode_token_seconds if self._decode_token_seconds is not None else self.guard.decode_pace
        return guarded_decode_steps(self.guard.seconds_until_change(), pace)

    async def _counted(self, steps: AsyncIterator[DecodeStep], planned: int, priced: bool = False,
                       streamed: bool = False, stretch: _OpenStretch | None = None) -> AsyncIterator[tuple[int, ...]]:
        """The Decode's tokens, each a K = 0 round in the stats (under sampling their p(y) kept
        for a probe beside the stretch); after it, told to the policy when the policy chose these
        rounds (planned > 0 of them, at most a call's), with its pace per token if it ran them all
        (a stretch cut short by the request's end or the guard is no stretch's pace); a streamed
        call's pace (streamed, MIN_PACE_TOKENS tokens or more), which prices K = 0 as a
        stretch's does; otherwise, where the call's passes looked up tokens (priced), their time
        and load only, which price those rows in the next call. Of an open stretch, the rounds
        its segments have not told (with the last segment's pace if it ran all of it)."""
        started, decoded, timing, offered, looked_up, headed = time.perf_counter(), 0, None, None, None, None
        re_prefills = self.stats.re_prefills  # a session rebuilt mid-stream: the timing covers its last call only
        self._decoded_probabilities.clear()
        try:
            async for step in steps:
                tokens = step.token_ids
                timing = step.timing or timing
                offered = step.offered or offered
                looked_up = step.looked_up or looked_up
                headed = step.headed or headed
                # C takes each step's tokens before the next is asked for: they go at len(C) on.
                for offset, probability in enumerate(step.probabilities):
                    self._decoded_probabilities[len(self.committed) + offset] = probability
                if not tokens:
                    continue  # the call's last message: its timing only
                decoded += len(tokens)
                self.stats.decoded_tokens += len(tokens)
                for _ in tokens:
                    self.stats.add_round(0, 0, 1)
                yield tokens
        finally:
            await steps.aclose()
            if offered is not None:  # the call's tally as its last message read brought it
                self.stats.offered_passes += offered.passes
                self.stats.offered_drafts += offered.drafts
                self.stats.offered_accepted += offered.accepted
                self.stats.offered_branch_passes += offered.branch_passes
            if looked_up is not None and looked_up.passes:
                self.stats.decode_lookup_passes += looked_up.passes
                self.stats.decode_lookup_drafts += looked_up.drafts
                self.stats.decode_lookup_accepted += looked_up.accepted
            if headed is not None and headed.passes:
                self.stats.decode_head_passes += headed.passes
                self.stats.decode_head_drafts += headed.drafts
                self.stats.decode_head_accepted += headed.accepted
            self._decoded_in_call = decoded
            self._accepted_in_call = offered.accepted if offered is not None else 0
            if decoded:
                self._decode_token_seconds = (time.perf_counter() - started) / decoded
                if self.guard is not None:
                    self.guard.observe_decode_pace(self._decode_token_seconds)
                passes = None
                if (timing is not None and timing.compute_seconds > 0 and timing.pass_rows >= 1
                        and self.stats.re_prefills == re_prefills):
                    passes = _decoded_passes(decoded, timing, (offered, looked_up, headed))
                if stretch is not None and isinstance(self.policy, PlainStretches):
                    # The rounds no segment told; their pace if their segment ran all it planned,
                    # or they are a whole call's (one of MAX_DECODE_STEPS within a longer segment).
                    rest = decoded - stretch.observed
                    whole_call = decoded >= stretch.call_steps == MAX_DECODE_STEPS
                    ran_all = not stretch.ending and (rest >= stretch.segment_end - stretch.segment_start or whole_call)
                    pace = (time.perf_counter() - stretch.segment_started) / rest if ran_all and rest else None
                    # The call's passes are the whole call's, its segments' too: told as such.
                    by_passes = passes is not None and isinstance(self.policy, LookupChooser)
                    if rest > 0:
                        self.policy.observe_plain(rest, pace, None if by_passes else passes)
                    if by_passes:
                        assert passes is not None and isinstance(self.policy, LookupChooser)
                        self.policy.observe_decoded_passes(passes)
                elif planned > 0 and isinstance(self.policy, PlainStretches):
                    pace = self._decode_token_seconds if decoded >= planned else None
                    self.policy.observe_plain(decoded, pace, passes)
                elif streamed and decoded >= MIN_PACE_TOKENS and isinstance(self.policy, PlainStretches):
                    self.policy.observe_stream_pace(self._decode_token_seconds, passes)
                elif passes is not None and priced and isinstance(self.policy, LookupChooser):
                    self.policy.observe_decoded_passes(passes)  # what prices the lookups' rows

    def _take_branch(self, num_speculative_tokens: int) -> Proposal | None:
        """Last round's branch for the outcome it had, if there is one and this round drafts."""
        expected = self._branch
        self._branch = None
        if expected is None or num_speculative_tokens == 0:
            return None
        committed_length, proposal = expected
        if committed_length != len(self.committed):  # the round's tokens were cut (a stop string)
            return None
        return proposal.first(min(num_speculative_tokens, proposal.num_speculative_tokens))

    def _keep_branch(self, drafted: _Branches, proposal: Proposal, outcome: VerifyOutcome, plan: AheadPlan,
                     committed_length: int) -> None:
        """Records what the draft drafted ahead of this round: the branch for its outcome (a hit
        next round), or a miss; and where the target's token ranked among the candidates."""
        ahead, timing = drafted.ahead, drafted.timing
        if not ahead.branches:
            return
        self.stats.pipelined_rounds += 1
        self.stats.branches_drafted += len(ahead.branches)
        fanout = ahead.fanout or plan.fanout
        self.stats.fanout_per_round.append(fanout)
        position = outcome.num_accepted
        self.pipeline.observe_ahead(AheadObservation(
            num_speculative_tokens=proposal.num_speculative_tokens,
            num_accepted=position,
            rank=ahead.rank(position, outcome.next_token_id),
            candidates=len(ahead.candidates[position]) if position < len(ahead.candidates) else 0,
            fanout=fanout,
            branches=len(ahead.branches),
            branch_num_speculative_tokens=max(b.proposal.num_speculative_tokens for b in ahead.branches),
            compute_seconds=timing.compute_seconds,
            after_proposal_seconds=timing.wall_seconds,
            call_hop_seconds=drafted.hop_seconds,
        ))
        branch = ahead.branch_for(outcome.num_accepted, outcome.next_token_id)
        if branch is None:
            self.stats.pipeline_misses += 1
        else:
            self._branch = (committed_length, branch)

    async def _branches(self, call: SpeculateCall, hop_seconds: float | None) -> _Branches | None:
        """A Speculate's branches, once they come (None if they do not)."""
        received = await self.replicas.branches(call)
        return None if received is None else _Branches(*received, hop_seconds)

    async def _adopt(self, proposal: Proposal, plan: AheadPlan) -> _Branches | None:
        """A hit's draft side, alongside its Verify: the draft adopts the same branch (told the
        round's new committed tokens) and, when the plan says so, drafts ahead again."""
        if not plan.drafts_ahead:
            return None  # the draft learns the committed tokens at its next call
        started = await self.replicas.speculate(self.committed, proposal.num_speculative_tokens, plan.fanout,
                                                plan.branch_num_speculative_tokens)
        if started is None:
            return None
        adopted, call = started
        if adopted.value.token_ids != proposal.token_ids:
            # Cannot happen with a deterministic draft; the round verifies what it sent, and the
            # branches drafted from the draft's own proposal would not fit the outcome: drop them.
            log.warning("the draft's proposal %s differs from its branch %s", adopted.value.token_ids,
                        proposal.token_ids)
            call.cancel()
            return None
        try:
            # The branches came on a call of their own: its round trip up to the adopted proposal
            # is what they wait for beyond their own time.
            return await self._branches(call, hop_seconds=adopted.timing.wall_seconds)
        finally:
            call.cancel()  # the stream has ended; nothing is cancelled but an unread end

    async def _propose(self, num_speculative_tokens: int, max_num_speculative_tokens: int
                       ) -> tuple[Reply[Proposal] | None, str]:
        """The round's drafts and the method that proposed them (a lookup's proposal carries each
        token's match length). The orchestrator's lookup answers first (it costs next to nothing);
        without its tokens, hybrid's model draft proposes K (its first Prefill sent only then), and
        a lookup draft alone runs the round at K = 0."""
        model_draft = self._model_draft_in_reach()
        if self.local_draft is not None:
            reply = self._local_proposal(self.local_draft, num_speculative_tokens, max_num_speculative_tokens,
                                         model_draft)
            if reply is not None:
                return reply, self.local_draft.lookup_method
        if num_speculative_tokens > 0 and model_draft:
            await self.replicas.settle_draft(self.committed)
            if self.replicas.has_draft:
                return await self._replica_proposal(num_speculative_tokens, max_num_speculative_tokens)
        return None, ""  # (a draft whose prefill failed: K = 0 until it is reattached)

    def _model_draft_in_reach(self) -> bool:
        """Whether a model draft replica holds this session, or is being given it."""
        return self.replicas.has_draft or self.replicas.draft_attaching

    @staticmethod
    def _model_k_beside(local_draft: LocalDraft, num_speculative_tokens: int, model_draft: bool) -> int | None:
        """The model draft's K that a lookup's proposal competes with (the chooser's second
        argument): the round's K under hybrid with a model draft in reach, else None."""
        return num_speculative_tokens if local_draft.uses_model and model_draft else None

    def _local_proposal(self, local_draft: LocalDraft, num_speculative_tokens: int, max_num_speculative_tokens: int,
                        model_draft: bool) -> Reply[Proposal] | None:
        """The lookup's proposal, or None to go without it. The adaptive controller, asked after
        seeing it, verifies as many of its tokens as pay, or none (orchestrator/lookup_policy.py);
        other policies take up to their K of it, and hybrid only on a strong match."""
        chooser = self.policy if isinstance(self.policy, LookupChooser) else None
        asked = max_num_speculative_tokens if chooser is not None else num_speculative_tokens
        found, seconds = local_draft.lookup(self.committed, asked)
        self.stats.draft_seconds += seconds  # no hop: no call for the observer either
        if chooser is not None:
            model_k = self._model_k_beside(local_draft, num_speculative_tokens, model_draft)
            taken = found.first(chooser.choose_lookup(found.match_lengths, model_k))
        else:
            taken = found if local_draft.takes(found) or not model_draft else NO_LOOKUP
        if not taken.token_ids:
            return None
        return lookup_reply(taken, self.request.sampling, self.replicas.session_id, len(self.committed), seconds)

    async def _replica_proposal(self, num_speculative_tokens: int, max_num_speculative_tokens: int
                                ) -> tuple[Reply[Proposal] | None, str]:
        """The draft replica's proposal of K tokens. A replica that serves a lookup is treated as
        the orchestrator's own lookup: asked for the round's maximum, then chosen from by the
        match lengths it sends (adaptive K only)."""
        method = self.replicas.draft_method  # of the replica that answers: a model's, or a lookup's
        chooser = self.policy if isinstance(self.policy, LookupChooser) and method != "model" else None
        asked = max_num_speculative_tokens if chooser is not None else num_speculative_tokens
        reply = await self.replicas.propose(self.committed, asked)
        if reply is None or chooser is None:
            return reply, method
        proposal = reply.value
        if len(proposal.match_lengths) != proposal.num_speculative_tokens:  # none sent: up to K
            taken = replace(proposal.first(num_speculative_tokens), match_lengths=())
        else:
            taken = proposal.first(chooser.choose_lookup(proposal.match_lengths, None))
        return Reply(reply.handle, taken, reply.timing), method

    def _max_num_speculative_tokens(self) -> int:
        """K <= the servers' limit, the tokens still to generate minus one, the context left minus one."""
        remaining = self.request.max_new_tokens - self.stats.generated_tokens
        context_left = self.limits.max_context - len(self.committed)
        return max(0, min(self.limits.max_num_speculative_tokens, remaining - 1, context_left - 1))

    def _commit(self, tokens: list[int]) -> Chunk:
        """Appends a round's tokens to C, cutting at EOS, a stop string or max_new_tokens."""
        kept: list[int] = []
        finish = None
        for token in tokens:
            if self.stats.generated_tokens + len(kept) >= self.request.max_new_tokens:
                break
            kept.append(token)
            if token in self.limits.eos_token_ids:
                finish = "eos"
                break
        count, text = self.text.add(kept)
        if self.text.stopped:
            kept, finish = kept[:count], "stop"
        self.committed.extend(kept)
        self._grew.set()
        self.stats.generated_tokens += len(kept)
        if self.guard is not None:
            self.guard.record(len(kept))
        if finish is None and self.stats.generated_tokens >= self.request.max_new_tokens:
            finish = "length"
        if finish is None and len(self.committed) >= self.limits.max_context:
            finish = "context"
        return Chunk(tuple(kept), text, finish)


def guarded_decode_steps(seconds_until_change: float, seconds_per_token: float | None) -> int:
    """Tokens a Decode under the guard asks for: MAX_DECODE_STEPS when the guard's answer holds
    for good (inf), else as many as fit before it may change at seconds_per_token (the request's
    last Decode's pace), and GUARDED_DECODE_STEPS while that pace is unknown; at least one."""
    if seconds_until_change == float("inf"):
        return MAX_DECODE_STEPS
    if seconds_per_token is None:
        return GUARDED_DECODE_STEPS
    return max(1, int(min(MAX_DECODE_STEPS, seconds_until_change / seconds_per_token)))


def sampled_acceptance_chances(proposal: Proposal, decoded: Sequence[int],
                               probabilities: Sequence[float | None]) -> tuple[float, ...]:
    """A probe's drafts d_1.. (each drawn from its q~_i) against the tokens y_1.. the target
    sampled from the same start, each from its p_i with probability probabilities[i]: for each
    position up to and including the first with y_i != d_i, min(1, q~_i(y_i) / p_i(y_i)), whose
    mean over y_i ~ p_i is sum(min(p_i, q~_i)), the chance a Verify accepts the draft there. Past
    that position q~_i followed a prefix the target did not take. Stops at a token without its
    probability; empty when the first has none."""
    chances: list[float] = []
    for draft, token, distribution, probability in zip(proposal.token_ids, decoded, proposal.distributions,
                                                       probabilities):
        if probability is None or probability <= 0.0:
            break
        total = sum(distribution.probs)
        q = sum(p for t, p in zip(distribution.token_ids, distribution.probs) if t == token)
        chances.append(min(1.0, (q / total if total > 0 else 0.0) / probability))
        if token != draft:
            break
    return tuple(chances)


def _decoded_passes(tokens: int, timing: CallTiming, tallies: tuple[DraftTally | None, ...]) -> DecodedPasses:
    """The target's passes behind a Decode's tokens, from its timing: one pass per token, less
    one for each draft (offered or looked up) that a pass accepted; the target's pass time
    whatever the network did."""
    accepted = sum(tally.accepted for tally in tallies if tally is not None)
    drafts = sum(tally.drafts for tally in tallies if tally is not None)
    count = max(1, tokens - accepted)
    return DecodedPasses(timing.compute_seconds / count, timing.pass_rows, timing.pass_sessions,
                         own_rows=1.0 + drafts / count, count=count)


def _observation(proposed: Reply[Proposal] | None, verified: Reply[VerifyOutcome], proposal: Proposal | None = None,
                 hit: bool = False, drafting_ahead: bool = False,
                 lookup_match_lengths: tuple[int, ...] = ()) -> RoundObservation:
    """What the round measured. proposal: what was verified (by default the draft call's); on a
    hit (drafted ahead the round before) no draft call was waited for."""
    if proposal is None:
        proposal = proposed.value if proposed else NO_PROPOSAL
    draft_timing = proposed.timing if proposed else CallTiming(0.0)
    own_rows = proposal.num_speculative_tokens + 1
    # A server that predates batching reports 0 for both: this round's pass was its own.
    pass_rows = verified.timing.pass_rows if verified.timing.pass_rows > 0 else own_rows
    pass_sessions = verified.timing.pass_sessions if verified.timing.pass_sessions > 0 else 1.0
    return RoundObservation(
        num_speculative_tokens=proposal.num_speculative_tokens,
        num_accepted=verified.value.num_accepted,
        acceptance_signal=verified.value.acceptance_signal,
        draft_compute_seconds=draft_timing.compute_seconds,
        draft_wall_seconds=draft_timing.wall_seconds,
        draft_fed_tokens=proposal.fed_tokens,
        verify_compute_seconds=verified.timing.compute_seconds,
        verify_wall_seconds=verified.timing.wall_seconds,
        verify_pass_rows=float(max(pass_rows, own_rows)),
        verify_pass_sessions=float(max(pass_sessions, 1.0)),
        drafted_ahead=hit,
        drafting_ahead=drafting_ahead,
        lookup_match_lengths=lookup_match_lengths,
    )
