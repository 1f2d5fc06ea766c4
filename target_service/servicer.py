"""TargetService over gRPC: convert, call, convert back."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import grpc

from specdec.rpc import convert
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.protocol import BranchProposal, DecodedToken, DecodeLookup, DraftOffer, DraftTally
from target_service.service import TargetService


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, service: TargetService) -> None:
        self.service = service

    async def Prefill(self, request: target_pb2.TargetPrefillRequest, context: grpc.aio.ServicerContext):
        handle, first, timing = await self.service.prefill(
            request.session_id,
            list(request.token_ids),
            convert.sampling_from_proto(request.sampling),
            request.resume,
            request.prompt_length,
        )
        return target_pb2.TargetPrefillResponse(
            handle=convert.handle_to_proto(handle),
            next_token_id=first,
            **convert.timing_fields(timing),
        )

    async def Verify(self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext):
        proposal = convert.proposal_from_proto(request)
        handle, outcome, timing = await self.service.verify(
            convert.handle_from_proto(request.handle), proposal
        )
        return target_pb2.VerifyResponse(
            handle=convert.handle_to_proto(handle),
            num_accepted=outcome.num_accepted,
            next_token_id=outcome.next_token_id,
            acceptance_signal=list(outcome.acceptance_signal),
            **convert.timing_fields(timing),
        )

    async def Decode(self, request: target_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        """Streams each token as its pass ends, with what the call's passes did with offered and
        looked-up drafts so far; the last message carries the call's timing."""
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue[tuple[DecodedToken, DraftTally, DraftTally, DraftTally]] = asyncio.Queue()
        stop = threading.Event()
        tally, looked_up, headed = DraftTally(), DraftTally(), DraftTally()
        lookup = (DecodeLookup(request.lookup_max_tokens, request.lookup_min_chance, request.head_max_tokens)
                  if request.lookup_max_tokens or request.head_max_tokens else None)
        start = convert.handle_from_proto(request.handle)
        decoding = asyncio.ensure_future(self.service.decode(
            start, request.max_tokens,
            # on the model thread, right after the token's pass: the tallies as that pass left them
            lambda token: loop.call_soon_threadsafe(
                steps.put_nowait, (token, replace(tally), replace(looked_up), replace(headed))),
            stop.is_set, tally, lookup, looked_up, headed))
        sent = 0
        try:
            while True:
                step = asyncio.ensure_future(steps.get())
                await asyncio.wait((step, decoding), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    break
                sent += 1
                token, offered_so_far, looked_up_so_far, headed_so_far = step.result()
                yield target_pb2.DecodeResponse(handle=convert.handle_to_proto(
                    replace(start, committed_length=start.committed_length + sent)), **_decoded([token]),
                    **_offered(offered_so_far), **_looked_up(looked_up_so_far), **_headed(headed_so_far))
            handle, tokens, timing = await decoding
            yield target_pb2.DecodeResponse(handle=convert.handle_to_proto(handle), **_decoded(tokens[sent:]),
                                            last=True, **convert.timing_fields(timing), **_offered(tally),
                                            **_looked_up(looked_up), **_headed(headed))
        finally:
            stop.set()  # the caller went away: the job stops before its next step

    async def Offer(self, request: target_pb2.OfferRequest, context: grpc.aio.ServicerContext):
        branches = tuple(BranchProposal(b.num_accepted, b.next_token_id, convert.proposal_from_proto(b))
                         for b in request.branches)
        offer = DraftOffer(request.start, convert.proposal_from_proto(request), request.max_verified, branches)
        held, committed_length = self.service.offer(request.session_id, offer)
        return target_pb2.OfferResponse(held=held, committed_length=committed_length)

    async def EndDecode(self, request: target_pb2.EndDecodeRequest, context: grpc.aio.ServicerContext):
        return target_pb2.EndDecodeResponse(ending=self.service.end_decode(request.session_id, request.start))

    async def Release(self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext):
        return common_pb2.ReleaseResponse(released=await self.service.release(request.session_id))

    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext):
        return convert.info_to_proto(self.service.info())

    async def GetTokenizer(self, request: target_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext):
        return target_pb2.GetTokenizerResponse(
            files=[target_pb2.TokenizerFile(name=n, content=c) for n, c in self.service.tokenizer_files()],
            tokenizer_hash=self.service.loaded.tokenizer_hash,
        )


def _offered(tally: DraftTally) -> dict[str, int]:
    return {"offered_passes": tally.passes, "offered_drafts": tally.drafts, "offered_accepted": tally.accepted,
            "offered_branch_passes": tally.branch_passes}


def _looked_up(tally: DraftTally) -> dict[str, int]:
    return {"lookup_passes": tally.passes, "lookup_drafts": tally.drafts, "lookup_accepted": tally.accepted}


def _headed(tally: DraftTally) -> dict[str, int]:
    return {"head_passes": tally.passes, "head_drafts": tally.drafts, "head_accepted": tally.accepted}


def _decoded(tokens: list[DecodedToken]) -> dict[str, list]:
    """A DecodeResponse's token_ids and, under sampling, their token_probabilities."""
    fields: dict[str, list] = {"token_ids": [token.token_id for token in tokens]}
    if tokens and all(token.probability is not None for token in tokens):
        fields["token_probabilities"] = [token.probability for token in tokens]
    return fields
