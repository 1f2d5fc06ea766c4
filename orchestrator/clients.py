"""Clients of one draft or target replica: deadlines on every call, plain results with timings."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from specdec.rpc import convert
from specdec.rpc.server import TlsConfig, channel_options
from specdec.sampling import SamplingParams
from specdec.serving import Handle
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


@dataclass(frozen=True)
class RpcTimeouts:
    """Deadlines (seconds). A stalled replica is treated like a failed one."""

    prefill_seconds: float = 300.0  # long prompts on a CPU take a while
    step_seconds: float = 60.0  # Propose, Verify
    control_seconds: float = 10.0  # Info, Release, GetTokenizer

    def __post_init__(self) -> None:
        if min(self.prefill_seconds, self.step_seconds, self.control_seconds) <= 0:
            raise ValueError("timeouts must be > 0")


@dataclass(frozen=True)
class CallTiming:
    wall_seconds: float  # as seen by the orchestrator
    compute_seconds: float  # server-reported forward time
    queue_seconds: float  # server-reported wait for the model worker

    @property
    def network_seconds(self) -> float:
        return max(0.0, self.wall_seconds - self.compute_seconds - self.queue_seconds)


@dataclass(frozen=True)
class TargetPrefillResult:
    handle: Handle
    next_token_id: int | None
    timing: CallTiming


@dataclass(frozen=True)
class VerifyResult:
    handle: Handle
    num_accepted: int
    next_token_id: int
    acceptance_signal: tuple[float, ...]
    timing: CallTiming


@dataclass(frozen=True)
class DraftPrefillResult:
    handle: Handle
    timing: CallTiming


@dataclass(frozen=True)
class ProposeResult:
    handle: Handle
    token_ids: tuple[int, ...]
    distributions: Sequence[common_pb2.SparseDistribution]  # forwarded to Verify as they are
    fed_tokens: int
    timing: CallTiming


# A replica that comes back on the same address (a restart, a rescheduled pod with a stable name)
# is found within about this long; grpc's default backoff grows to two minutes.
MAX_RECONNECT_BACKOFF_MS = 2000


def open_channel(address: str, tls: TlsConfig | None, max_message_bytes: int) -> grpc.aio.Channel:
    """A channel to one replica: message limits, quick reconnects, and with tls mutual TLS (the
    orchestrator presents tls.cert_file and checks the replica's certificate against tls.ca_file)."""
    options: list[tuple[str, int | str]] = [
        *channel_options(max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


def _timing(started: float, response: object) -> CallTiming:
    return CallTiming(
        wall_seconds=time.perf_counter() - started,
        compute_seconds=getattr(response, "compute_seconds", 0.0),
        queue_seconds=getattr(response, "queue_seconds", 0.0),
    )


class ReplicaClient:
    """Info and Release, common to both roles."""

    def __init__(self, channel: grpc.aio.Channel, timeouts: RpcTimeouts, stub: object) -> None:
        self.channel = channel
        self.timeouts = timeouts
        self._stub = stub

    async def info(self) -> common_pb2.InfoResponse:
        return await self._stub.Info(common_pb2.InfoRequest(), timeout=self.timeouts.control_seconds)

    async def release(self, session_id: str) -> bool:
        response = await self._stub.Release(
            common_pb2.ReleaseRequest(session_id=session_id), timeout=self.timeouts.control_seconds
        )
        return response.released


class TargetClient(ReplicaClient):
    def __init__(self, channel: grpc.aio.Channel, timeouts: RpcTimeouts) -> None:
        super().__init__(channel, timeouts, target_pb2_grpc.TargetServiceStub(channel))

    async def prefill(
        self, session_id: str, token_ids: list[int], sampling: SamplingParams, resume: bool = False
    ) -> TargetPrefillResult:
        started = time.perf_counter()
        response = await self._stub.Prefill(
            target_pb2.TargetPrefillRequest(
                session_id=session_id,
                token_ids=token_ids,
                sampling=convert.sampling_to_proto(sampling),
                resume=resume,
            ),
            timeout=self.timeouts.prefill_seconds,
        )
        return TargetPrefillResult(
            handle=convert.handle_from_proto(response.handle),
            next_token_id=response.next_token_id if response.HasField("next_token_id") else None,
            timing=_timing(started, response),
        )

    async def verify(
        self,
        handle: Handle,
        draft_token_ids: Sequence[int],
        draft_distributions: Sequence[common_pb2.SparseDistribution],
    ) -> VerifyResult:
        started = time.perf_counter()
        response = await self._stub.Verify(
            target_pb2.VerifyRequest(
                handle=convert.handle_to_proto(handle),
                draft_token_ids=list(draft_token_ids),
                draft_distributions=list(draft_distributions),
            ),
            timeout=self.timeouts.step_seconds,
        )
        return VerifyResult(
            handle=convert.handle_from_proto(response.handle),
            num_accepted=response.num_accepted,
            next_token_id=response.next_token_id,
            acceptance_signal=tuple(response.acceptance_signal),
            timing=_timing(started, response),
        )

    async def tokenizer_files(self) -> tuple[list[tuple[str, bytes]], str]:
        response = await self._stub.GetTokenizer(
            target_pb2.GetTokenizerRequest(), timeout=self.timeouts.control_seconds
        )
        return [(f.name, f.content) for f in response.files], response.tokenizer_hash


class DraftClient(ReplicaClient):
    def __init__(self, channel: grpc.aio.Channel, timeouts: RpcTimeouts) -> None:
        super().__init__(channel, timeouts, draft_pb2_grpc.DraftServiceStub(channel))

    async def prefill(self, session_id: str, token_ids: list[int], sampling: SamplingParams) -> DraftPrefillResult:
        started = time.perf_counter()
        response = await self._stub.Prefill(
            draft_pb2.DraftPrefillRequest(
                session_id=session_id, token_ids=token_ids, sampling=convert.sampling_to_proto(sampling)
            ),
            timeout=self.timeouts.prefill_seconds,
        )
        return DraftPrefillResult(convert.handle_from_proto(response.handle), _timing(started, response))

    async def propose(self, handle: Handle, new_committed: Sequence[int], num_draft: int) -> ProposeResult:
        started = time.perf_counter()
        response = await self._stub.Propose(
            draft_pb2.ProposeRequest(
                handle=convert.handle_to_proto(handle),
                new_committed_token_ids=list(new_committed),
                num_speculative_tokens=num_draft,
            ),
            timeout=self.timeouts.step_seconds,
        )
        return ProposeResult(
            handle=convert.handle_from_proto(response.handle),
            token_ids=tuple(response.draft_token_ids),
            distributions=response.draft_distributions,
            fed_tokens=response.fed_tokens,
            timing=_timing(started, response),
        )
