"""Decode: several plain rounds in one target call. Each token must be exactly what a Verify without
drafts would have returned at that step (greedy and seeded sampling), a retried call must get the
same answer, and the orchestrator's speculation-off requests, which use it, must still give the
target's own output."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch

from orchestrator.clients import DecodeStep, RpcTimeouts, TargetClient, open_channel
from specdec.errors import InvalidInput
from specdec.models import ModelConfig, load_model
from specdec.protocol import DraftOffer, DraftTally, Proposal, SamplingParams, SparseDistribution
from specdec.ragged import run_alone
from specdec.sampling import process_logits
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc
from target_service.engine import TargetEngine

from tests import stack as stack_module

PROMPT = [18, 29, 13, 10, 26, 13, 25, 5]  # no end of sequence in its first 12 tokens, greedy or sampled
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "sampled": SamplingParams(temperature=0.9, top_p=0.95, seed=11),
}


async def _decode(client: TargetClient, handle, steps: int) -> list[DecodeStep]:
    return [step async for step in client.decode(handle, steps)]


def _tokens(steps: list[DecodeStep]) -> list[int]:
    return [token for step in steps for token in step.token_ids]


async def _with_client(address: str, work, sessions: tuple[str, ...]):
    """work(client) against the shared stack's target; the sessions it opened are released after
    (the stack outlives this module, and other tests count its live sessions)."""
    channel = open_channel(address, None, 64 * 2**20)
    client = TargetClient(address, channel, RpcTimeouts())
    try:
        return await work(client)
    finally:
        for session_id in sessions:
            await client.release(session_id)
        await channel.close()


@pytest.mark.parametrize("mode", sorted(SAMPLINGS))
def test_decode_returns_the_tokens_of_as_many_plain_verifies(loop_thread, stack, mode):
    sampling = SAMPLINGS[mode]

    async def work(client: TargetClient):
        decoded = await client.prefill(f"decode-{mode}", PROMPT, sampling)
        stepped = await client.prefill(f"verify-{mode}", PROMPT, sampling)
        assert decoded.value == stepped.value
        handle, by_verify = stepped.handle, []
        for _ in range(10):
            reply = await client.verify(handle, Proposal(token_ids=()))
            handle = reply.handle
            by_verify.append(reply.value.next_token_id)
        first = await _decode(client, decoded.handle, 6)
        second = await _decode(client, first[-1].handle, 4)
        again = await _decode(client, first[-1].handle, 4)  # a retry of the last call: the same answer
        return by_verify, first, second, again, handle

    by_verify, first, second, again, handle = loop_thread.run(
        _with_client(stack.target_address, work, (f"decode-{mode}", f"verify-{mode}")))
    assert len(_tokens(first)) == 6 and len(_tokens(second)) == 4
    assert _tokens(first) + _tokens(second) == by_verify
    # Streamed: a message per step, each with the handle after it; the timing on the last.
    assert [len(step.token_ids) for step in first] == [1] * 6 + [0]
    assert [step.handle.committed_length for step in first] == [len(PROMPT) + 1 + i for i in (1, 2, 3, 4, 5, 6, 6)]
    assert all(step.timing is None for step in first[:-1])
    assert first[-1].timing.compute_seconds > 0 and first[-1].timing.pass_rows >= 1
    assert _tokens(again) == _tokens(second) and again[-1].handle == second[-1].handle
    assert second[-1].handle.committed_length == handle.committed_length == len(PROMPT) + 1 + 10
    # Under sampling each token comes with its probability (the engine test checks its value); a
    # retry's with the same; greedy sends none.
    for step in first + second + again:
        if mode == "greedy":
            assert step.probabilities == ()
        else:
            assert len(step.probabilities) == len(step.token_ids)
            assert all(0.0 < p <= 1.0 for p in step.probabilities)
    assert [p for s in again for p in s.probabilities] == [p for s in second for p in s.probabilities]


def test_a_cancelled_decode_stops_and_its_handle_tells_how_far_it_went(loop_thread, stack):
    async def work(client: TargetClient):
        prefilled = await client.prefill("decode-cancel", PROMPT, SAMPLINGS["greedy"])
        steps = client.decode(prefilled.handle, 64)
        first = await anext(steps)
        await steps.aclose()  # cancels the call
        await asyncio.sleep(0.5)
        session = stack.target.store.get("decode-cancel")
        return first, session.committed_length

    first, length = loop_thread.run(_with_client(stack.target_address, work, ("decode-cancel",)))
    assert first.token_ids and first.handle.committed_length == len(PROMPT) + 2
    # It stopped soon after the cancel (how many steps ran meanwhile depends on the machine),
    # short of the 64 asked for, which take this model a fraction of the half second waited.
    assert first.handle.committed_length <= length < len(PROMPT) + 1 + 64


def test_end_decode_ends_the_running_decode_after_its_pass_and_the_session_goes_on(loop_thread, stack):
    """EndDecode from the length a running Decode started at ends it after its current pass: its
    stream brings every token the session decoded and its last message, whose handle is current,
    so the session's next call goes on from there (the tokens those of one uninterrupted call).
    An EndDecode from another length, or with no Decode running, ends nothing."""
    greedy = SAMPLINGS["greedy"]

    async def work(client: TargetClient):
        ended = await client.prefill("decode-end", PROMPT, greedy)
        whole = await client.prefill("decode-whole", PROMPT, greedy)
        reference = _tokens(await _decode(client, whole.handle, 64))
        start = ended.handle.committed_length
        idle = await client.end_decode("decode-end", start)
        steps = client.decode(ended.handle, 64)
        first = await anext(steps)
        elsewhere = await client.end_decode("decode-end", start + 1)
        ending = await client.end_decode("decode-end", start)
        rest = [step async for step in steps]
        received = _tokens([first, *rest])
        more = _tokens(await _decode(client, rest[-1].handle, 64 - len(received)))
        return idle, elsewhere, ending, start, rest[-1], received, more, reference

    idle, elsewhere, ending, start, last, received, more, reference = loop_thread.run(
        _with_client(stack.target_address, work, ("decode-end", "decode-whole")))
    assert (idle, elsewhere, ending) == (False, False, True)
    assert 1 <= len(received) < 64  # ended well short of the 64 asked for
    assert last.timing is not None and last.handle.committed_length == start + len(received)
    assert received + more == reference


def test_decode_refuses_a_step_count_out_of_range(loop_thread, stack):
    async def work(client: TargetClient):
        prefilled = await client.prefill("decode-range", PROMPT, SAMPLINGS["greedy"])
        errors = []
        for steps in (0, 65):
            with pytest.raises(InvalidInput) as caught:
                await _decode(client, prefilled.handle, steps)
            errors.append(str(caught.value))
        return errors

    for message in loop_thread.run(_with_client(stack.target_address, work, ("decode-range",))):
        assert "max_tokens must be in [1, 64]" in message


def test_decode_stops_after_an_end_of_sequence_token(tiny_pair):
    loaded = load_model(ModelConfig(str(tiny_pair.target_dir), "target", dtype="float64"))
    greedy = SamplingParams(temperature=0.0)

    def decode(engine: TargetEngine, steps: int) -> list[int]:
        state, _ = run_alone(loaded.model, engine.prefill(PROMPT, greedy, resume=False))
        return [token.token_id for token in run_alone(loaded.model, engine.decode(state, steps))]

    free = decode(TargetEngine(dataclasses.replace(loaded, eos_token_ids=()), 8), 8)
    # The first decoded token that occurs only once, made the model's end of sequence.
    stop_at = next(i for i, token in enumerate(free) if free.count(token) == 1)
    ending = dataclasses.replace(loaded, eos_token_ids=(free[stop_at],))
    assert decode(TargetEngine(ending, 8), 8) == free[:stop_at + 1]
    near_the_end = dataclasses.replace(loaded, eos_token_ids=(), max_context=len(PROMPT) + 4)
    assert decode(TargetEngine(near_the_end, 8), 8) == free[:3]  # C reaches the max context


def test_a_sampled_decode_gives_each_token_its_probability_under_the_request_sampling(tiny_pair):
    """p(y) of each decoded token is its probability in the target's processed distribution at
    that position (temperature, top-k, top-p), as a full forward pass over the prefix gives it:
    a probe beside a stretch divides the draft's q~(y) by it. So too for the tokens of passes that
    verified offered drafts, accepted drafts and the token after them alike (the offers here: the
    target's own most likely next two tokens, one-hot)."""
    loaded = load_model(ModelConfig(str(tiny_pair.target_dir), "target", dtype="float64"))
    engine = TargetEngine(dataclasses.replace(loaded, eos_token_ids=()), 8)

    def distribution(prefix: list[int], sampling: SamplingParams) -> torch.Tensor:
        with torch.no_grad():
            return process_logits(loaded.model(torch.tensor([prefix])).logits[0, -1], sampling)

    for sampling, offers in ((SamplingParams(temperature=0.9, top_p=0.95, seed=11), False),
                             (SamplingParams(temperature=1.3, top_k=5, seed=4), False),
                             (SamplingParams(temperature=0.2, seed=5), True),
                             (SamplingParams(temperature=0.0), False)):
        state, first = run_alone(loaded.model, engine.prefill(PROMPT, sampling, resume=False))

        def offer() -> DraftOffer:  # from C as it is at the pass
            committed = [*PROMPT, *state.tokens[len(PROMPT):]]
            drafts: list[int] = []
            for _ in range(2):
                drafts.append(int(distribution([*committed, *drafts], sampling).argmax()))
            return DraftOffer(len(committed), Proposal(tuple(drafts), tuple(
                SparseDistribution((token,), (1.0,)) for token in drafts)), 2)

        tally = DraftTally()
        decoded = run_alone(loaded.model, engine.decode(state, 12, offered=offer if offers else lambda: None,
                                                        tally=tally))
        if offers:  # passes that verified drafts, some accepted, some not
            assert tally.passes > 0 and 0 < tally.accepted < tally.drafts, tally
        prefix = [*PROMPT, first]
        for token in decoded:
            if sampling.greedy:
                assert token.probability is None
            else:
                expected = distribution(prefix, sampling)[token.token_id].item()
                assert expected > 0 and token.probability == pytest.approx(expected, rel=1e-9)
            prefix.append(token.token_id)


def _reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return output[0, len(prompt):].tolist()


def _off_request(max_new_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=max_new_tokens,
                              speculation=pb.SpeculationConfig(mode=pb.SPECULATION_MODE_OFF))


def test_speculation_off_decodes_several_tokens_per_target_call(stack, reference_target):
    tokens, _, last = stack_module.generate(stack.address, _off_request(11))
    assert tokens == _reference(reference_target, PROMPT, 11)
    # The prefill gives the first token; the other ten come streamed from one call.
    assert last.stats.decode_calls == 1
    assert last.stats.rounds == 10 and list(last.stats.num_speculative_tokens_per_round) == [0] * 10


def test_a_long_answer_streams_every_token_from_consecutive_decodes(stack, reference_target):
    """More than one Decode's worth: each message brings tokens (a call's closing message, which
    carries only its timing, is not passed on as an empty chunk)."""
    request = _off_request(70)
    with grpc.insecure_channel(stack.address) as channel:
        responses = list(orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(request, timeout=120))
    tokens = [token for response in responses for token in response.token_ids]
    assert tokens == _reference(reference_target, PROMPT, 70)
    assert len(tokens) == 70 and responses[-1].stats.decode_calls == 2  # 64, then the last 5
    assert all(response.token_ids for response in responses)


class RefuseMethod(grpc.aio.ServerInterceptor):
    """A target that predates one of its methods (Decode by default): it is unimplemented."""

    def __init__(self, method: str = "Decode") -> None:
        self.method = method
        self.refused = 0

    async def intercept_service(self, continuation, details):
        if not details.method.endswith(f"/{self.method}"):
            return await continuation(details)

        async def unimplemented(request, context):
            self.refused += 1
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

        return grpc.unary_unary_rpc_method_handler(unimplemented)


def test_a_target_without_decode_gets_plain_verifies(loop_thread, tiny_pair, reference_target):
    refuse = RefuseMethod()

    async def start():
        return await stack_module.start_stack(tiny_pair.target_dir, tiny_pair.draft_dir,
                                              interceptors=(refuse,))

    running = loop_thread.run(start())
    try:
        tokens, _, last = stack_module.generate(running.address, _off_request(9))
        assert tokens == _reference(reference_target, PROMPT, 9)
        assert refuse.refused == 1  # asked once; the client then remembers
        assert last.stats.rounds == 8
    finally:
        loop_thread.run(running.stop())
