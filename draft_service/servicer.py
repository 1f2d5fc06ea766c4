"""DraftService over gRPC: convert, call, convert back."""

from __future__ import annotations

import grpc

from draft_service.lookup_service import LookupDraftService
from draft_service.service import DraftService
from specdec.rpc import convert
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, service: DraftService | LookupDraftService) -> None:
        self.service = service

    async def Prefill(self, request: draft_pb2.DraftPrefillRequest, context: grpc.aio.ServicerContext):
        handle, _, timing = await self.service.prefill(
            request.session_id, list(request.token_ids), convert.sampling_from_proto(request.sampling)
        )
        return draft_pb2.DraftPrefillResponse(
            handle=convert.handle_to_proto(handle),
            **convert.timing_fields(timing),
        )

    async def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext):
        handle, proposal, timing = await self.service.propose(
            convert.handle_from_proto(request.handle),
            list(request.new_committed_token_ids),
            request.num_speculative_tokens,
        )
        return draft_pb2.ProposeResponse(
            handle=convert.handle_to_proto(handle),
            draft_token_ids=list(proposal.token_ids),
            draft_distributions=[convert.distribution_to_proto(d) for d in proposal.distributions],
            **convert.timing_fields(timing),
            fed_tokens=proposal.fed_tokens,
        )

    async def Release(self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext):
        return common_pb2.ReleaseResponse(released=await self.service.release(request.session_id))

    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext):
        return convert.info_to_proto(self.service.info())
