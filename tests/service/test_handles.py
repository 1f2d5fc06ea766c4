"""Handles and recovery (docs/architecture.md, "Handles and retries"): lost sessions are rebuilt
from C without changing the output, and a round's request bytes do not grow with the context."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import grpc
import pytest
import torch

from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

from tests import stack as stack_module


def _reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return output[0, len(prompt):].tolist()


async def _generate_and_lose_sessions(stack, request: pb.GenerateRequest, service, after_chunks: int):
    """Streams a request; after some chunks, drops every session the given service holds."""
    async with grpc.aio.insecure_channel(stack.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        tokens, last = [], None
        chunks = 0
        async for response in stub.Generate(request, timeout=120):
            tokens.extend(response.token_ids)
            last = response
            chunks += 1
            if chunks == after_chunks:
                for session_id in list(service.store._sessions):
                    service.store.release(session_id)
        return tokens, last


@pytest.mark.parametrize("side", ["target", "draft"])
def test_lost_session_is_rebuilt_and_output_is_unchanged(loop_thread, stack, reference_target, side):
    prompt = [7, 3, 19, 22, 5, 14]
    request = pb.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=40,
        speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=2),
    )
    service = stack.target if side == "target" else stack.draft
    tokens, last = loop_thread.run(_generate_and_lose_sessions(stack, request, service, after_chunks=3))
    assert tokens == _reference(reference_target, prompt, 40)
    if side == "target":
        assert last.stats.re_prefills >= 1
    else:
        assert last.stats.drafted_tokens > 0 and last.stats.re_prefills == 0


class RequestSizes(grpc.aio.ServerInterceptor):
    """Records the serialized size of every request, by method."""

    def __init__(self) -> None:
        self.sizes: dict[str, list[int]] = defaultdict(list)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        behavior, method = handler.unary_unary, details.method.rsplit("/", 1)[-1]

        async def recorded(request, context):
            self.sizes[method].append(request.ByteSize())
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            recorded, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


@pytest.fixture(scope="module")
def recorded_stack(loop_thread, tiny_pair):
    sizes = RequestSizes()
    running = loop_thread.run(stack_module.start_stack(
        tiny_pair.target_dir, tiny_pair.draft_dir, interceptors=(sizes,)))
    yield running, sizes
    loop_thread.run(running.stop())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_round_bytes_do_not_grow_with_context(recorded_stack, temperature):
    running, sizes = recorded_stack
    largest = {}
    for context in (50, 2000):
        sizes.sizes.clear()
        prompt = [(i * 7) % 40 + 3 for i in range(context)]
        request = pb.GenerateRequest(
            prompt_token_ids=prompt, max_new_tokens=30,
            sampling={"temperature": temperature, "seed": 5},
            speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=4),
        )
        stack_module.generate(running.address, request)
        assert sizes.sizes["Verify"] and sizes.sizes["Propose"]
        largest[context] = (max(sizes.sizes["Verify"]), max(sizes.sizes["Propose"]))
        assert max(sizes.sizes["Prefill"]) > context  # the prompt itself crosses once
    verify_50, propose_50 = largest[50]
    verify_2000, propose_2000 = largest[2000]
    # Only varints of lengths may grow (by a byte or two each), never with the context's tokens.
    assert verify_2000 <= verify_50 + 4, largest
    assert propose_2000 <= propose_50 + 4, largest
