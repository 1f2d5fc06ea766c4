"""Clients of one draft or target replica: the orchestrator's only contact with the wire.

Every call has a deadline and returns the plain types of specdec.protocol with the call's timing.
A failed call raises a domain error (specdec.errors), never a gRPC one, so the loop decides what to
do from the kind of failure alone: SessionLost (rebuild the session from C), ReplicaLost (rebuild
it elsewhere), Refused (the replica is full: try another), InvalidInput / OutOfRange (the request
itself is wrong), ReplicaError (anything else the replica said).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc

from specdec.errors import (
    InvalidInput,
    OutOfRange,
    Refused,
    ReplicaError,
    ReplicaLost,
    SessionLost,
    SpecdecError,
)
from specdec.protocol import (
    BranchProposal,
    CallTiming,
    DecodeLookup,
    DraftedAhead,
    DraftOffer,
    DraftTally,
    Handle,
    Proposal,
    ReplicaInfo,
    Reply,
    SamplingParams,
    VerifyOutcome,
)
from specdec.rpc import convert
from specdec.rpc.server import TlsConfig, channel_options
from specdec.tracing import client_interceptors
from specdec.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

Response = TypeVar("Response")

# A replica that comes back on the same address (a restart, a rescheduled pod with a stable name)
# is found within about this long; grpc's default backoff grows to two minutes.
MAX_RECONNECT_BACKOFF_MS = 2000

_KIND_OF_STATUS: dict[grpc.StatusCode, type[ReplicaError]] = {
    grpc.StatusCode.NOT_FOUND: SessionLost,
    grpc.StatusCode.ABORTED: SessionLost,
    grpc.StatusCode.UNAVAILABLE: ReplicaLost,
    grpc.StatusCode.DEADLINE_EXCEEDED: ReplicaLost,
    grpc.StatusCode.CANCELLED: ReplicaLost,
    grpc.StatusCode.INTERNAL: ReplicaLost,
    grpc.StatusCode.UNKNOWN: ReplicaLost,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Refused,
}


@dataclass(frozen=True)
class RpcTimeouts:
    """Deadlines (seconds). A stalled replica is treated like a failed one."""

    prefill_seconds: float = 300.0  # long prompts on a CPU take a while
    step_seconds: float = 60.0  # Propose, Verify
    control_seconds: float = 10.0  # Info, Release, GetTokenizer

    def __post_init__(self) -> None:
        if min(self.prefill_seconds, self.step_seconds, self.control_seconds) <= 0:
            raise ValueError("timeouts must be > 0")


def open_channel(address: str, tls: TlsConfig | None, max_message_bytes: int) -> grpc.aio.Channel:
    """A channel to one replica: message limits, quick reconnects, and with tls mutual TLS (the
    orchestrator presents tls.cert_file and checks the replica's certificate against tls.ca_file)."""
    options: list[tuple[str, int | str]] = [
        *channel_options(max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]
    interceptors = client_interceptors(address)  # trace context to the replica, when tracing is on
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options,
                                   interceptors=interceptors)


def domain_error(address: str, error: grpc.aio.AioRpcError) -> SpecdecError:
    """A replica's gRPC status as the domain error the loop acts on."""
    details = error.details() or ""
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidInput(f"{address}: {details}")
    if error.code() == grpc.StatusCode.OUT_OF_RANGE:
        return OutOfRange(f"{address}: {details}")
    kind = _KIND_OF_STATUS.get(error.code(), ReplicaError)
    return kind(address, f"{error.code().name}: {details}")


class ReplicaClient:
    """Info and Release, common to both roles."""

    def __init__(self, address: str, channel: grpc.aio.Channel, timeouts: RpcTimeouts, stub: Any) -> None:
        self.address = address
        self.channel = channel
        self.timeouts = timeouts
        self._stub = stub

    async def _call(self, method: Callable[..., Awaitable[Response]], request: object,
                    timeout: float) -> tuple[Response, float]:
        """(response, wall seconds), or the domain error of a failed call."""
        started = time.perf_counter()
        try:
            response = await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise domain_error(self.address, error) from error
        return response, time.perf_counter() - started

    async def _call_if_implemented(self, method: Callable[..., Awaitable[Response]], request: object,
                                   timeout: float) -> Response | None:
        """The response, None where the replica answered UNIMPLEMENTED (it predates the method),
        or the domain error of a failed call."""
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise domain_error(self.address, error) from error
            return None

    async def info(self) -> ReplicaInfo:
        response, _ = await self._call(self._stub.Info, common_pb2.InfoRequest(), self.timeouts.control_seconds)
        return convert.info_from_proto(response)

    async def release(self, session_id: str) -> bool:
        response, _ = await self._call(self._stub.Release, common_pb2.ReleaseRequest(session_id=session_id),
                                       self.timeouts.control_seconds)
        return response.released


def _timing(wall_seconds: float, response: Any) -> CallTiming:
    return CallTiming(wall_seconds, response.compute_seconds, response.queue_seconds,
                      response.pass_rows, response.pass_sessions)


def _propose_request(handle: Handle, new_committed_token_ids: Sequence[int],
                     num_speculative_tokens: int) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        handle=convert.handle_to_proto(handle),
        new_committed_token_ids=list(new_committed_token_ids),
        num_speculative_tokens=num_speculative_tokens,
    )


def _proposal_reply(response: draft_pb2.ProposeResponse, wall_seconds: float) -> Reply[Proposal]:
    proposal = replace(convert.proposal_from_proto(response, response.fed_tokens),
                       match_lengths=tuple(response.match_lengths))
    return Reply(convert.handle_from_proto(response.handle), proposal, _timing(wall_seconds, response))


@dataclass(frozen=True)
class DecodeStep:
    """What one message of a Decode brings: the session's handle after its tokens, and on the
    last message the call's timing."""

    handle: Handle
    token_ids: tuple[int, ...]
    timing: CallTiming | None = None
    # Under sampling, each token's probability in the target's distribution it was drawn from
    # (specdec.protocol.DecodedToken); empty when greedy, or from a target that does not send them.
    probabilities: tuple[float, ...] = ()
    # What the call's passes did so far with the drafts offered to it (Offer), and with the tokens
    # they looked up themselves (DecodeLookup).
    offered: DraftTally | None = None
    looked_up: DraftTally | None = None
    headed: DraftTally | None = None  # and with its draft head's drafts


class TargetClient(ReplicaClient):
    role = "target"

    def __init__(self, address: str, channel: grpc.aio.Channel, timeouts: RpcTimeouts) -> None:
        super().__init__(address, channel, timeouts, target_pb2_grpc.TargetServiceStub(channel))
        self.decodes = True  # False once the replica answered Decode with UNIMPLEMENTED
        self.offers = True  # False once it answered Offer so
        self.ends_decodes = True  # False once it answered EndDecode so

    async def prefill(self, session_id: str, token_ids: Sequence[int], sampling: SamplingParams,
                      resume: bool = False, prompt_length: int = 0) -> Reply[int | None]:
        """Feeds C; the value is the first new token (None when resume rebuilds a committed C, whose
        first prompt_length tokens are the request's prompt)."""
        request = target_pb2.TargetPrefillRequest(
            session_id=session_id, token_ids=list(token_ids),
            sampling=convert.sampling_to_proto(sampling), resume=resume, prompt_length=prompt_length,
        )
        response, wall = await self._call(self._stub.Prefill, request, self.timeouts.prefill_seconds)
        first = response.next_token_id if response.HasField("next_token_id") else None
        return Reply(convert.handle_from_proto(response.handle), first, _timing(wall, response))

    async def verify(self, handle: Handle, proposal: Proposal) -> Reply[VerifyOutcome]:
        request = target_pb2.VerifyRequest(
            handle=convert.handle_to_proto(handle),
            draft_token_ids=list(proposal.token_ids),
            draft_distributions=[convert.distribution_to_proto(d) for d in proposal.distributions],
        )
        response, wall = await self._call(self._stub.Verify, request, self.timeouts.step_seconds)
        outcome = VerifyOutcome(response.num_accepted, response.next_token_id,
                                tuple(response.acceptance_signal))
        return Reply(convert.handle_from_proto(response.handle), outcome, _timing(wall, response))

    async def decode(self, handle: Handle, max_tokens: int,
                     lookup: DecodeLookup | None = None) -> AsyncIterator[DecodeStep]:
        """Plain decoding of up to max_tokens tokens in one call (fewer after an end-of-sequence
        token or at the max context), each step as it comes; the last step has the call's timing.
        With lookup its passes also verify tokens looked up in the session's own. Closing the
        iterator early cancels the call. A target without Decode gets one Verify without drafts."""
        if self.decodes:
            request = target_pb2.DecodeRequest(handle=convert.handle_to_proto(handle), max_tokens=max_tokens)
            if lookup is not None:
                request.lookup_max_tokens = lookup.max_tokens
                request.lookup_min_chance = lookup.min_chance
                request.head_max_tokens = lookup.head_max_tokens
            started = time.perf_counter()
            # A step's deadline per token asked for, and one at least: with a deadline of 0 a call
            # for no tokens would race its own INVALID_ARGUMENT and could come back as lost.
            call = self._stub.Decode(request, timeout=self.timeouts.step_seconds * max(1, max_tokens))
            try:
                while True:
                    try:
                        # The step deadline holds for each token: a stalled replica is a lost one.
                        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                        # cancellation that lands as the read completes (the request would then
                        # run on after its caller went away).
                        async with asyncio.timeout(self.timeouts.step_seconds):
                            response = await call.read()
                    except asyncio.TimeoutError as error:
                        raise ReplicaLost(self.address, f"DEADLINE_EXCEEDED: no Decode step within "
                                                        f"{self.timeouts.step_seconds:g} s") from error
                    except grpc.aio.AioRpcError as error:
                        if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                            raise domain_error(self.address, error) from error
                        self.decodes = False
                        break
                    if response is grpc.aio.EOF:
                        raise ReplicaError(self.address, "the Decode stream ended without its last message")
                    timing = _timing(time.perf_counter() - started, response) if response.last else None
                    probabilities = tuple(response.token_probabilities)
                    offered = DraftTally(response.offered_passes, response.offered_drafts,
                                         response.offered_accepted, response.offered_branch_passes)
                    looked_up = DraftTally(response.lookup_passes, response.lookup_drafts, response.lookup_accepted)
                    headed = DraftTally(response.head_passes, response.head_drafts, response.head_accepted)
                    yield DecodeStep(convert.handle_from_proto(response.handle), tuple(response.token_ids), timing,
                                     probabilities if len(probabilities) == len(response.token_ids) else (),
                                     offered, looked_up, headed)
                    if response.last:
                        return
            finally:
                call.cancel()  # nothing is cancelled once the stream has ended
        verified = await self.verify(handle, Proposal(token_ids=()))
        yield DecodeStep(verified.handle, (verified.value.next_token_id,), verified.timing)

    async def offer(self, session_id: str, offer: DraftOffer) -> tuple[bool, int]:
        """Offers drafts to the session's running Decode (-> whether it holds them, and its
        committed length when they arrived). A target without Offer holds none."""
        if not self.offers:
            return False, 0
        request = target_pb2.OfferRequest(
            session_id=session_id, start=offer.start, draft_token_ids=list(offer.proposal.token_ids),
            draft_distributions=[convert.distribution_to_proto(d) for d in offer.proposal.distributions],
            max_verified=offer.max_verified,
            branches=[target_pb2.OfferedBranch(
                num_accepted=b.num_accepted, next_token_id=b.next_token_id,
                draft_token_ids=list(b.proposal.token_ids),
                draft_distributions=[convert.distribution_to_proto(d) for d in b.proposal.distributions])
                for b in offer.branches],
        )
        response = await self._call_if_implemented(self._stub.Offer, request, self.timeouts.step_seconds)
        if response is None:
            self.offers = False
            return False, 0
        return response.held, response.committed_length

    async def end_decode(self, session_id: str, start: int) -> bool:
        """Ends the session's running Decode that started from C of length `start` after its
        current pass (-> whether one was running); its stream then brings the rest of its tokens
        and its last message. A target without EndDecode ends none: its Decode runs on."""
        if not self.ends_decodes:
            return False
        request = target_pb2.EndDecodeRequest(session_id=session_id, start=start)
        response = await self._call_if_implemented(self._stub.EndDecode, request, self.timeouts.step_seconds)
        if response is None:
            self.ends_decodes = False
            return False
        return response.ending

    async def tokenizer_files(self) -> tuple[list[tuple[str, bytes]], str]:
        response, _ = await self._call(self._stub.GetTokenizer, target_pb2.GetTokenizerRequest(),
                                       self.timeouts.control_seconds)
        return [(f.name, f.content) for f in response.files], response.tokenizer_hash


class DraftClient(ReplicaClient):
    role = "draft"

    def __init__(self, address: str, channel: grpc.aio.Channel, timeouts: RpcTimeouts) -> None:
        super().__init__(address, channel, timeouts, draft_pb2_grpc.DraftServiceStub(channel))
        self.follows = True  # False once it answered Follow as unimplemented (a model-free draft)

    async def prefill(self, session_id: str, token_ids: Sequence[int], sampling: SamplingParams,
                      cache_partition: str = "") -> Reply[None]:
        """cache_partition: the request's partition of state the replica keeps across sessions."""
        request = draft_pb2.DraftPrefillRequest(
            session_id=session_id, token_ids=list(token_ids), sampling=convert.sampling_to_proto(sampling),
            cache_partition=cache_partition,
        )
        response, wall = await self._call(self._stub.Prefill, request, self.timeouts.prefill_seconds)
        return Reply(convert.handle_from_proto(response.handle), None, _timing(wall, response))

    async def propose(self, handle: Handle, new_committed_token_ids: Sequence[int],
                      num_speculative_tokens: int) -> Reply[Proposal]:
        """new_committed_token_ids: the tokens of C the draft has not been told yet."""
        request = _propose_request(handle, new_committed_token_ids, num_speculative_tokens)
        response, wall = await self._call(self._stub.Propose, request, self.timeouts.step_seconds)
        return _proposal_reply(response, wall)

    def speculate(self, handle: Handle, new_committed_token_ids: Sequence[int], num_speculative_tokens: int,
                  fanout: int, branch_num_speculative_tokens: int, branch_outcomes: int = 0) -> SpeculateCall:
        """Starts a Speculate: a Propose whose second answer, the branches drafted ahead for the
        outcomes of the round it starts (those j < branch_outcomes; 0: all), comes while the
        target verifies."""
        request = draft_pb2.SpeculateRequest(
            propose=_propose_request(handle, new_committed_token_ids, num_speculative_tokens),
            fanout=fanout,
            branch_num_speculative_tokens=branch_num_speculative_tokens,
            branch_outcomes=branch_outcomes,
        )
        return SpeculateCall(self.address, self._stub.Speculate(request, timeout=self.timeouts.step_seconds))

    def follow(self, handle: Handle, new_committed_token_ids: Sequence[int], num_speculative_tokens: int,
               fanout: int = 0, branch_num_speculative_tokens: int = 0, branch_outcomes: int = 0,
               timeout_seconds: float | None = None) -> FollowCall:
        """Opens a Follow (streamed speculation) from the session's handle; start() sends its first
        message. timeout_seconds bounds the whole stream (None: none; the caller cancels it)."""
        first = draft_pb2.SpeculateRequest(
            propose=_propose_request(handle, new_committed_token_ids, num_speculative_tokens),
            fanout=fanout, branch_num_speculative_tokens=branch_num_speculative_tokens,
            branch_outcomes=branch_outcomes)
        return FollowCall(self, self._stub.Follow(timeout=timeout_seconds), first)


def _drafted_ahead(branches: draft_pb2.Branches) -> DraftedAhead:
    return DraftedAhead(
        branches=tuple(BranchProposal(b.num_accepted, b.next_token_id, convert.proposal_from_proto(b))
                       for b in branches.branches),
        candidates=tuple(tuple(c.token_ids) for c in branches.candidates),
    )


class FollowCall:
    """One Follow in flight (streamed speculation): grow() sends C's next tokens, read() the
    draft's answers as they come (a proposal, or the branches after the proposal before them;
    None once the draft ended the stream); cancel() when no more are wanted."""

    def __init__(self, client: DraftClient, call: Any, first: draft_pb2.SpeculateRequest) -> None:
        self.address = client.address
        self._client = client
        self._call = call
        self._first: draft_pb2.SpeculateRequest | None = first
        self._last_proposal = time.perf_counter()

    async def _write(self, request: draft_pb2.SpeculateRequest) -> None:
        try:
            await self._call.write(request)
        except grpc.aio.AioRpcError as error:
            raise domain_error(self.address, error) from error

    async def start(self) -> None:
        assert self._first is not None, "start() once"
        first, self._first = self._first, None
        self._last_proposal = time.perf_counter()
        await self._write(first)

    async def done(self) -> None:
        """No more tokens: the draft answers what it was sent, then ends the stream."""
        await self._call.done_writing()

    async def grow(self, new_committed_token_ids: Sequence[int], num_speculative_tokens: int, fanout: int,
                   branch_num_speculative_tokens: int, branch_outcomes: int = 0) -> None:
        await self._write(draft_pb2.SpeculateRequest(
            propose=draft_pb2.ProposeRequest(new_committed_token_ids=list(new_committed_token_ids),
                                             num_speculative_tokens=num_speculative_tokens),
            fanout=fanout, branch_num_speculative_tokens=branch_num_speculative_tokens,
            branch_outcomes=branch_outcomes))

    async def read(self) -> Reply[Proposal] | tuple[DraftedAhead, CallTiming] | None:
        """The next answer; a proposal's wall time runs from the answer before it (or the start).
        A draft without Follow ends the stream at once (None; its client's `follows` turns False)."""
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._client.follows = False
                return None
            raise domain_error(self.address, error) from error
        now = time.perf_counter()
        if response is grpc.aio.EOF:
            return None
        if response.WhichOneof("message") == "proposal":
            wall, self._last_proposal = now - self._last_proposal, now
            return _proposal_reply(response.proposal, wall)
        return _drafted_ahead(response.branches), _timing(now - self._last_proposal, response.branches)

    def cancel(self) -> None:
        self._call.cancel()


class SpeculateCall:
    """One Speculate in flight: read proposal() first, then branches(); cancel() when the
    branches are no longer wanted."""

    def __init__(self, address: str, call: Any) -> None:
        self.address = address
        self._call = call
        self._started = time.perf_counter()
        self._proposal_arrived: float | None = None

    async def _read(self, field: str) -> Any:
        try:
            response = await self._call.read()
        except grpc.aio.AioRpcError as error:
            raise domain_error(self.address, error) from error
        if response is grpc.aio.EOF or response.WhichOneof("message") != field:
            raise ReplicaError(self.address, f"the Speculate stream ended without its {field}")
        return getattr(response, field)

    async def proposal(self) -> Reply[Proposal]:
        response = await self._read("proposal")
        self._proposal_arrived = time.perf_counter()
        return _proposal_reply(response, self._proposal_arrived - self._started)

    async def branches(self) -> tuple[DraftedAhead, CallTiming]:
        """The branches, after proposal(); the timing's wall time runs from the proposal's arrival:
        what the branches take beyond it (the draft's compute for them, its scheduling of their
        jobs, their transfer), as the loop waits for them."""
        response = await self._read("branches")
        assert self._proposal_arrived is not None, "read proposal() first"
        return _drafted_ahead(response), _timing(time.perf_counter() - self._proposal_arrived, response)

    def cancel(self) -> None:
        self._call.cancel()
