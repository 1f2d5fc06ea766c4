"""The public Orchestrator API over gRPC: convert, call, convert back."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import grpc

from orchestrator.generation import Chunk
from orchestrator.k_policy import Speculation
from orchestrator.service import OrchestratorService, PromptInput
from orchestrator.stats import GenerationStats
from specdec.errors import InvalidInput
from specdec.rpc import convert
from specdec.rpc.auth import matching_token, metadata_authorization, token_partition
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

MODE_OF = {
    pb.SPECULATION_MODE_UNSPECIFIED: None,
    pb.SPECULATION_MODE_OFF: "off",
    pb.SPECULATION_MODE_FIXED: "fixed",
    pb.SPECULATION_MODE_ADAPTIVE: "adaptive",
    pb.SPECULATION_MODE_HEURISTIC: "heuristic",
}
PIPELINE_OF = {
    pb.PIPELINE_MODE_UNSPECIFIED: None,
    pb.PIPELINE_MODE_OFF: "off",
    pb.PIPELINE_MODE_ON: "on",
    pb.PIPELINE_MODE_AUTO: "auto",
    pb.PIPELINE_MODE_STREAM: "stream",
}
FINISH_OF = {
    "length": pb.FINISH_REASON_LENGTH,
    "eos": pb.FINISH_REASON_EOS,
    "stop": pb.FINISH_REASON_STOP,
    "context": pb.FINISH_REASON_CONTEXT,
}


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, service: OrchestratorService, auth_tokens: Sequence[str] | None = None) -> None:
        self.service = service
        # The tokens the server accepts: a request's token names its partition of shared state.
        self.auth_tokens = tuple(auth_tokens) if auth_tokens else None

    def _partition(self, context: grpc.aio.ServicerContext) -> str:
        if self.auth_tokens is None:
            return ""
        value = metadata_authorization(context.invocation_metadata())
        return token_partition(matching_token(value, self.auth_tokens))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if request.speculation.mode not in MODE_OF:
            raise InvalidInput(f"unknown speculation mode {request.speculation.mode}")
        if request.speculation.pipeline not in PIPELINE_OF:
            raise InvalidInput(f"unknown pipeline mode {request.speculation.pipeline}")
        speculation = Speculation(
            mode=MODE_OF[request.speculation.mode],
            num_speculative_tokens=(request.speculation.num_speculative_tokens
                                    if request.speculation.HasField("num_speculative_tokens") else None),
            pipeline=PIPELINE_OF[request.speculation.pipeline],
            pipeline_fanout=(request.speculation.pipeline_fanout
                             if request.speculation.HasField("pipeline_fanout") else None),
        )
        chunks = self.service.generate(
            PromptInput(
                prompt=request.prompt,
                prompt_token_ids=tuple(request.prompt_token_ids),
                messages=tuple((m.role, m.content) for m in request.messages),
            ),
            max_new_tokens=request.max_new_tokens if request.HasField("max_new_tokens") else None,
            sampling=convert.sampling_from_proto(request.sampling, draw_seed=True),
            stop=tuple(request.stop),
            speculation=speculation,
            partition=self._partition(context),
        )
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield _response(chunk)

    async def Pools(self, request: pb.PoolsRequest, context: grpc.aio.ServicerContext):
        pools = []
        for pool in (self.service.draft_pool, self.service.target_pool):
            pools.append(pb.PoolStatus(
                role=pool.role,
                source=pool.source.description,
                replicas=[
                    pb.ReplicaStatus(
                        address=r.address,
                        replica_id=r.replica_id,
                        healthy=r.healthy and not r.refused,
                        accepting=r.accepting,
                        active_sessions=r.active_sessions,
                        load=r.info.load if r.info else 0.0,
                        model_id=r.info.model_id if r.info else "",
                    )
                    for r in sorted(pool.replicas.values(), key=lambda r: r.address)
                ],
            ))
        return pb.PoolsResponse(pools=pools, draft_shares_compute=self.service.draft_shares_compute(),
                                shared_compute_without_turns=not self.service.shared_compute_takes_turns())


def _response(chunk: Chunk) -> pb.GenerateResponse:
    response = pb.GenerateResponse(token_ids=list(chunk.token_ids), text=chunk.text)
    if chunk.finish_reason is not None:
        response.finish_reason = FINISH_OF[chunk.finish_reason]
    if chunk.stats is not None:
        response.stats.CopyFrom(stats_to_proto(chunk.stats))
    return response


def stats_to_proto(stats: GenerationStats) -> pb.GenerationStats:
    return pb.GenerationStats(
        prompt_tokens=stats.prompt_tokens,
        generated_tokens=stats.generated_tokens,
        rounds=stats.rounds,
        drafted_tokens=stats.drafted_tokens,
        accepted_tokens=stats.accepted_tokens,
        mean_accepted_length=stats.mean_accepted_length,
        acceptance_rate=stats.acceptance_rate,
        num_speculative_tokens_per_round=stats.num_speculative_tokens_per_round,
        tokens_per_second=stats.tokens_per_second,
        wall_seconds=stats.wall_seconds,
        time_to_first_token_seconds=stats.time_to_first_token_seconds,
        draft_seconds=stats.draft_seconds,
        verify_seconds=stats.verify_seconds,
        network_seconds=stats.network_seconds,
        re_prefills=stats.re_prefills,
        draft_unavailable_rounds=stats.draft_unavailable_rounds,
        target_replica=stats.target_replica,
        draft_replica=stats.draft_replica,
        controller_estimates=stats.controller_estimates,
        num_accepted_per_round=stats.num_accepted_per_round,
        drafted_tokens_by_method=stats.drafted_by_method,
        accepted_tokens_by_method=stats.accepted_by_method,
        pipelined_rounds=stats.pipelined_rounds,
        pipeline_hits=stats.pipeline_hits,
        offers=stats.offers,
        offers_dropped=stats.offers_dropped,
        offered_passes=stats.offered_passes,
        offered_drafts=stats.offered_drafts,
        offered_accepted=stats.offered_accepted,
        offered_branch_passes=stats.offered_branch_passes,
        decode_lookup_passes=stats.decode_lookup_passes,
        decode_lookup_drafts=stats.decode_lookup_drafts,
        decode_lookup_accepted=stats.decode_lookup_accepted,
        decode_head_passes=stats.decode_head_passes,
        decode_head_drafts=stats.decode_head_drafts,
        decode_head_accepted=stats.decode_head_accepted,
        pipeline_misses=stats.pipeline_misses,
        branches_drafted=stats.branches_drafted,
        fanout_per_round=stats.fanout_per_round,
        decode_calls=stats.decode_calls,
        shadow_probes=stats.shadow_probes,
        decoded_tokens=stats.decoded_tokens,
    )
