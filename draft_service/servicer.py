"""DraftService over gRPC: convert, call, convert back."""

from __future__ import annotations

import grpc

from draft_service.lookup_service import LookupDraftService
from draft_service.service import DraftService, FollowStep
from specdec.protocol import DraftedAhead, Handle, Proposal, Timing
from specdec.rpc import convert
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, service: DraftService | LookupDraftService) -> None:
        self.service = service

    async def Prefill(self, request: draft_pb2.DraftPrefillRequest, context: grpc.aio.ServicerContext):
        handle, _, timing = await self.service.prefill(
            request.session_id, list(request.token_ids), convert.sampling_from_proto(request.sampling),
            request.cache_partition,
        )
        return draft_pb2.DraftPrefillResponse(
            handle=convert.handle_to_proto(handle),
            **convert.timing_fields(timing),
        )

    async def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext):
        return _propose_response(*await self.service.propose(
            convert.handle_from_proto(request.handle),
            list(request.new_committed_token_ids),
            request.num_speculative_tokens,
        ))

    async def Speculate(self, request: draft_pb2.SpeculateRequest, context: grpc.aio.ServicerContext):
        propose = request.propose
        handle = convert.handle_from_proto(propose.handle)
        new_committed = list(propose.new_committed_token_ids)
        if not isinstance(self.service, DraftService):
            # A model-free draft answers at once: nothing to draft ahead, no branches.
            answer = await self.service.propose(handle, new_committed, propose.num_speculative_tokens)
            yield draft_pb2.SpeculateResponse(proposal=_propose_response(*answer))
            yield draft_pb2.SpeculateResponse(branches=draft_pb2.Branches())
            return
        async for item in self.service.speculate(handle, new_committed, propose.num_speculative_tokens,
                                                 request.fanout, request.branch_num_speculative_tokens,
                                                 request.branch_outcomes):
            if isinstance(item[0], DraftedAhead):
                yield draft_pb2.SpeculateResponse(branches=_branches(*item))
            else:
                yield draft_pb2.SpeculateResponse(proposal=_propose_response(*item))

    async def Follow(self, request_iterator, context: grpc.aio.ServicerContext):
        if not isinstance(self.service, DraftService):
            # A model-free draft answers each Propose at once: there is nothing to stream.
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a model-free draft does not follow a stream")
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return

        async def steps():
            yield _follow_step(first)
            async for request in request_iterator:
                yield _follow_step(request)

        async for item in self.service.follow(convert.handle_from_proto(first.propose.handle), steps()):
            if isinstance(item[0], DraftedAhead):
                yield draft_pb2.SpeculateResponse(branches=_branches(*item))
            else:
                yield draft_pb2.SpeculateResponse(proposal=_propose_response(*item))

    async def Release(self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext):
        return common_pb2.ReleaseResponse(released=await self.service.release(request.session_id))

    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext):
        return convert.info_to_proto(self.service.info())


def _follow_step(request: draft_pb2.SpeculateRequest) -> FollowStep:
    return FollowStep(tuple(request.propose.new_committed_token_ids), request.propose.num_speculative_tokens,
                      request.fanout, request.branch_num_speculative_tokens, request.branch_outcomes)


def _propose_response(handle: Handle, proposal: Proposal, timing: Timing) -> draft_pb2.ProposeResponse:
    return draft_pb2.ProposeResponse(
        handle=convert.handle_to_proto(handle),
        draft_token_ids=list(proposal.token_ids),
        draft_distributions=[convert.distribution_to_proto(d) for d in proposal.distributions],
        **convert.timing_fields(timing),
        fed_tokens=proposal.fed_tokens,
        match_lengths=list(proposal.match_lengths),
    )


def _branches(ahead: DraftedAhead, timing: Timing) -> draft_pb2.Branches:
    return draft_pb2.Branches(
        branches=[draft_pb2.Branch(
            num_accepted=branch.num_accepted,
            next_token_id=branch.next_token_id,
            draft_token_ids=list(branch.proposal.token_ids),
            draft_distributions=[convert.distribution_to_proto(d) for d in branch.proposal.distributions],
        ) for branch in ahead.branches],
        candidates=[draft_pb2.Candidates(token_ids=list(c)) for c in ahead.candidates],
        **convert.timing_fields(timing),
    )
