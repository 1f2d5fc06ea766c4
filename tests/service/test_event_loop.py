"""Forward passes run off the asyncio event loop (docs/architecture.md, "Serving"): health checks
and Info answer while a long forward pass runs, and concurrent requests on the orchestrator each
get the output the target alone would give. Ordering is asserted with events, never durations."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

from tests import stack as stack_module
from tests import tiny_models

# Big enough that one prefill of LONG_PROMPT tokens keeps the worker busy for about a second on
# one CPU thread, while health and Info need milliseconds.
LARGER_MODEL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4)
LONG_PROMPT = 1000
TIMEOUT = 120


@pytest.fixture(scope="module")
def larger_target(loop_thread, tmp_path_factory):
    model_dir = tiny_models.save(tiny_models.make_model(seed=5, **LARGER_MODEL),
                                 tmp_path_factory.mktemp("larger") / "target", with_tokenizer=False)
    server, service = loop_thread.run(stack_module.start_target(model_dir, replica_id="larger-target"))
    yield f"127.0.0.1:{server.port}", service
    loop_thread.run(server.stop())
    service.worker.shutdown()


async def _control_calls_during_a_long_prefill(address: str, service) -> tuple[list[str], common_pb2.InfoResponse]:
    order: list[str] = []
    async with grpc.aio.insecure_channel(address) as channel:
        target = target_pb2_grpc.TargetServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)

        async def long_prefill() -> None:
            await target.Prefill(target_pb2.TargetPrefillRequest(
                session_id="long-prefill", token_ids=[5 + i % 40 for i in range(LONG_PROMPT)]), timeout=TIMEOUT)
            order.append("prefill")

        prefill = asyncio.create_task(long_prefill())
        try:
            while service.worker.load == 0:  # the prefill has reached the model worker
                assert not prefill.done(), "the prefill ended before it was seen on the worker"
                await asyncio.sleep(0.001)
            status = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            order.append("health")
            info = await target.Info(common_pb2.InfoRequest(), timeout=TIMEOUT)
            order.append("info")
        finally:
            await prefill
        await target.Release(common_pb2.ReleaseRequest(session_id="long-prefill"), timeout=TIMEOUT)
    return order, info


def test_health_and_info_answer_during_a_long_forward_pass(loop_thread, larger_target):
    address, service = larger_target
    order, info = loop_thread.run(_control_calls_during_a_long_prefill(address, service))
    assert order == ["health", "info", "prefill"]
    # Info was computed on the server while the prefill was still queued or running.
    assert info.load > 0


# ----------------------------------------------------------------------------- concurrent requests

NUM_CONCURRENT = 8
MAX_NEW_TOKENS = 20


def _prompts() -> list[list[int]]:
    return [[3 + (7 * i + 5 * j) % 44 for j in range(2 + 3 * i)] for i in range(NUM_CONCURRENT)]


def _reference(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return output[0, len(prompt):].tolist()


async def _generate_together(stack, prompts: list[list[int]]) -> list[list[int]]:
    """Sends every request while the target's model worker is held, and lets it go only once all
    of their prefills are queued there: every request is in flight at the same time."""
    worker = stack.target.worker
    gate = threading.Event()
    holder = asyncio.ensure_future(worker.run(gate.wait))
    async with grpc.aio.insecure_channel(stack.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)

        async def one(index: int, prompt: list[int]) -> list[int]:
            if index % 4 == 3:
                speculation = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_OFF)
            else:
                speculation = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED,
                                                   num_speculative_tokens=1 + index % 4)
            request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=MAX_NEW_TOKENS,
                                         speculation=speculation)
            return [t async for response in stub.Generate(request, timeout=TIMEOUT) for t in response.token_ids]

        requests = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
        try:
            while round(worker.load * worker.max_queue) < 1 + len(prompts):
                assert not any(r.done() for r in requests), "a request ended while the worker was held"
                await asyncio.sleep(0.001)
        finally:
            gate.set()
            await holder
        return list(await asyncio.gather(*requests))


def test_concurrent_greedy_requests_are_each_exact(loop_thread, stack, reference_target):
    """Eight requests held until all are queued, so their prefills share one target pass (and
    their rounds go on to share passes as they meet): every output still equals the target's
    alone."""
    prompts = _prompts()
    expected = [_reference(reference_target, prompt) for prompt in prompts]
    with stack_module.PassSizes(stack.target) as passes:
        outputs = loop_thread.run(_generate_together(stack, prompts))
    for prompt, output, reference in zip(prompts, outputs, expected):
        assert output == reference, f"prompt {prompt}"
    # Released together, all eight prefills ran in one pass.
    assert max(passes.sessions) >= len(prompts), passes.sessions
