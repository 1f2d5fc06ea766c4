"""Follow (streamed speculation) at the draft service, through the real client and server: every
proposal is what a Propose from the C it names drafts, every branch what a Propose after that
outcome drafts, tokens sent while the draft drafts are answered together from the newest C, and
the session goes on from the last answer as if it had been proposed to."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

import draft_service.server
import orchestrator.server
from draft_service.lookup_service import LookupDraftConfig, load_vocabulary
from orchestrator.clients import DraftClient, RpcTimeouts, open_channel
from orchestrator.pool import PoolConfig
from orchestrator.service import OrchestratorConfig
from specdec.delay_proxy import DelayProxyConfig, start_in_thread
from specdec.errors import OutOfRange, SessionLost
from specdec.protocol import DraftedAhead, Proposal
from specdec.rpc.server import ServerConfig
from specdec.sampling import SamplingParams
from specdec.serving import ServiceConfig
from specdec.v1 import orchestrator_pb2 as pb
from tests.service.test_drafting_ahead import _after_the_fact
from tests.stack import SlowPasses, generate, start_draft, start_target

PROMPT = [5, 9, 11, 4, 20, 7]
GROWTH = [3, 17, 2, 8, 30, 12, 6, 1, 25, 14, 9, 4]  # C's tokens after the prompt, as they "stream"


def _draft(stack) -> DraftClient:
    return DraftClient(stack.draft_address, open_channel(stack.draft_address, None, 1 << 24), RpcTimeouts())


async def _follow(stack, sampling: SamplingParams, session_id: str, fanout: int) -> dict[str, int]:
    """Sends GROWTH one token at a time, without waiting for answers; checks every answer against
    drafting after the fact; returns what came."""
    draft = _draft(stack)
    prefill = await draft.prefill(session_id, PROMPT, sampling)
    num_speculative_tokens, branch_k, outcomes = 4, 3, 2
    call = draft.follow(prefill.handle, [], num_speculative_tokens, fanout, branch_k, outcomes)
    await call.start()
    committed = list(PROMPT)

    async def grow() -> None:
        for token in GROWTH:
            committed.append(token)
            await call.grow([token], num_speculative_tokens, fanout, branch_k, outcomes)
            await asyncio.sleep(0)
        await call.done()

    writer = asyncio.create_task(grow())
    counts = {"proposals": 0, "branches": 0}
    last = prefill.handle
    drafted_from: list[int] = []
    proposal: Proposal | None = None
    while (answer := await call.read()) is not None:
        if isinstance(answer, tuple):
            ahead, _ = answer
            assert isinstance(ahead, DraftedAhead)
            assert fanout > 0 and proposal is not None  # branches follow their proposal
            for branch in ahead.branches:
                assert branch.num_accepted < outcomes
                prefix = [*drafted_from, *proposal.token_ids[:branch.num_accepted], branch.next_token_id]
                reference = await _after_the_fact(draft, prefix, branch_k, sampling, f"{session_id}-ref")
                assert branch.proposal.token_ids == reference.token_ids
                assert branch.proposal.distributions == reference.distributions
            counts["branches"] += len(ahead.branches)
            continue
        last, proposal = answer.handle, answer.value
        assert last.committed_length >= len(drafted_from)  # C only grows
        drafted_from = [*PROMPT, *GROWTH][:last.committed_length]
        reference = await _after_the_fact(draft, drafted_from, num_speculative_tokens, sampling, f"{session_id}-ref")
        assert proposal.token_ids == reference.token_ids
        assert proposal.distributions == reference.distributions
        counts["proposals"] += 1
    await writer
    assert last.committed_length == len(PROMPT) + len(GROWTH)  # the last answer is from all of C
    counts["grows"] = len(GROWTH)
    # The session goes on from the last answer's handle as after a Propose.
    after = await draft.propose(last, [2], num_speculative_tokens)
    reference = await _after_the_fact(draft, [*committed, 2], num_speculative_tokens, sampling, f"{session_id}-ref")
    assert after.value.token_ids == reference.token_ids
    await draft.release(session_id)
    await draft.channel.close()
    return counts


def test_follow_answers_as_proposing_from_the_newest_c_greedy(loop_thread, stack):
    counts = loop_thread.run(_follow(stack, SamplingParams(), "follow-greedy", fanout=0))
    # Answers come from C's growth, at most one per message and the first: the draft skips C's
    # that grew again before it was free.
    assert 1 <= counts["proposals"] <= counts["grows"] + 1, counts
    assert counts["branches"] == 0


def test_follow_branches_equal_drafting_after_the_fact_sampled(loop_thread, stack):
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=5)
    counts = loop_thread.run(_follow(stack, sampling, "follow-sampled", fanout=2))
    assert counts["proposals"] >= 1 and counts["branches"] > 0, counts


def test_follow_coalesces_tokens_sent_while_the_draft_drafts(loop_thread, stack):
    """Every token sent before the first answer is read: the stream answers the start, and then
    once more at most per answer it gave, never once per message."""
    async def run() -> tuple[int, int]:
        draft = _draft(stack)
        prefill = await draft.prefill("follow-burst", PROMPT, SamplingParams())
        call = draft.follow(prefill.handle, [], 3)
        await call.start()
        for token in GROWTH:  # all at once, before any answer is read
            await call.grow([token], 3, 0, 0)
        await call.done()
        lengths = []
        while (answer := await call.read()) is not None:
            lengths.append(answer.handle.committed_length)
        await draft.release("follow-burst")
        await draft.channel.close()
        return len(lengths), lengths[-1]

    answers, last_length = loop_thread.run(run())
    assert last_length == len(PROMPT) + len(GROWTH)
    assert answers < len(GROWTH) + 1, answers


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=5)],
                         ids=["greedy", "sampled"])
def test_a_caller_that_missed_answers_goes_on_from_its_last_handle(loop_thread, stack, sampling):
    """Answers that never reached the caller (a Follow cancelled while its proposal was on its way
    back) moved the session on: a Propose, or a Follow, from the caller's last handle with C's
    tokens since is applied from where the session is, and drafts what a caller in step gets (one
    answer missed: not the stored answer of the call it missed, drafted from a shorter C); one
    whose tokens are not those the session took is out of step, as before."""
    async def run():
        draft = _draft(stack)
        start = (await draft.prefill("missed", PROMPT, sampling)).handle
        await draft.propose(start, GROWTH[:2], 3)  # its answer lost: the caller keeps `start`
        caught_up = await draft.propose(start, GROWTH[:3], 3)
        lost = await draft.propose(caught_up.handle, GROWTH[3:4], 3)  # two answers lost
        missed_again = await draft.propose(lost.handle, GROWTH[4:5], 3)
        with pytest.raises(SessionLost):  # other tokens: out of step
            await draft.propose(caught_up.handle, [GROWTH[3] + 1, *GROWTH[4:6]], 3)
        call = draft.follow(caught_up.handle, GROWTH[3:6], 3)
        await call.start()
        await call.done()
        followed = [answer async for answer in _answers(call)]
        reference = [await _after_the_fact(draft, [*PROMPT, *GROWTH[:n]], 3, sampling, "missed-ref")
                     for n in (3, 6)]
        await draft.release("missed")
        await draft.channel.close()
        return caught_up, missed_again, followed, reference

    caught_up, missed_again, followed, (after_3, after_6) = loop_thread.run(run())
    assert caught_up.handle.committed_length == len(PROMPT) + 3
    assert (caught_up.value.token_ids, caught_up.value.distributions) == (after_3.token_ids, after_3.distributions)
    assert missed_again.handle.committed_length == len(PROMPT) + 5
    (answer,) = followed
    assert answer.handle.committed_length == len(PROMPT) + 6
    assert (answer.value.token_ids, answer.value.distributions) == (after_6.token_ids, after_6.distributions)


async def _answers(call):
    while (answer := await call.read()) is not None:
        yield answer


def test_follow_bad_fanout_is_out_of_range(loop_thread, stack):
    async def run() -> None:
        draft = _draft(stack)
        prefill = await draft.prefill("follow-bad", PROMPT, SamplingParams())
        call = draft.follow(prefill.handle, [], 2, fanout=99, branch_num_speculative_tokens=2)
        await call.start()
        with pytest.raises(OutOfRange, match="fanout"):
            await call.read()
        await draft.release("follow-bad")
        await draft.channel.close()

    loop_thread.run(run())


def test_a_model_free_draft_does_not_follow_and_its_client_knows(loop_thread, tiny_pair):
    """A lookup draft answers Follow UNIMPLEMENTED: the stream ends with no answer and the client
    stops asking (the orchestrator then offers one draft call at a time)."""
    async def run() -> tuple[object, bool]:
        server, _ = await draft_service.server.start_lookup(
            load_vocabulary(str(tiny_pair.target_dir)), ServiceConfig(replica_id="lookup-follow"),
            ServerConfig(port=0), lookup=LookupDraftConfig(method="ngram"))
        address = f"127.0.0.1:{server.port}"
        draft = DraftClient(address, open_channel(address, None, 1 << 24), RpcTimeouts())
        try:
            prefill = await draft.prefill("follow-lookup", PROMPT, SamplingParams())
            call = draft.follow(prefill.handle, [], 3)
            await call.start()
            answer = await call.read()
            await draft.release("follow-lookup")
            return answer, draft.follows
        finally:
            await draft.channel.close()
            await server.stop()

    answer, follows = loop_thread.run(run())
    assert answer is None and follows is False


class MethodCounter(grpc.aio.ServerInterceptor):
    """Counts the calls a real server gets, by method name."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    async def intercept_service(self, continuation, handler_call_details):
        self.calls[(handler_call_details.method or "").rsplit("/", 1)[-1]] += 1
        return await continuation(handler_call_details)


def test_a_streamed_request_is_offered_through_follow_from_its_first_decode(loop_thread, tiny_pair):
    """The draft's first Prefill is still on its way (30 ms each way) when a streamed request's
    first Decode starts: its offers still go through one Follow stream per Decode call, no Propose
    or Speculate, once the draft is there."""
    counter = MethodCounter()

    async def start():
        target_server, target = await start_target(tiny_pair.target_dir, replica_id="target-follow")
        draft_server, _ = await start_draft(tiny_pair.draft_dir, replica_id="draft-follow", interceptors=(counter,))
        return target_server, target, draft_server

    target_server, target, draft_server = loop_thread.run(start())
    try:
        with start_in_thread(DelayProxyConfig(upstream_host="127.0.0.1", upstream_port=draft_server.port,
                                              one_way_delay_ms=30.0)) as proxy:
            async def start_orchestrator():
                config = OrchestratorConfig(draft=f"127.0.0.1:{proxy.port}", target=f"127.0.0.1:{target_server.port}",
                                            num_speculative_tokens=2, pool=PoolConfig(refresh_seconds=0.5),
                                            startup_timeout_seconds=60)
                return await orchestrator.server.start(config, ServerConfig(port=0))

            orchestrator_server, service = loop_thread.run(start_orchestrator())
            try:
                speculation = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=2,
                                                   pipeline=pb.PIPELINE_MODE_STREAM)
                request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=24, speculation=speculation)
                with SlowPasses(target, 0.03):  # a larger model's pace: the Decode outlasts the draft's Prefill
                    _, _, last = generate(f"127.0.0.1:{orchestrator_server.port}", request)
                assert last.stats.decode_calls > 0 and last.stats.drafted_tokens == 0  # streamed: no rounds
            finally:
                loop_thread.run(service.close())
                loop_thread.run(orchestrator_server.stop())
    finally:
        loop_thread.run(draft_server.stop())
        loop_thread.run(target_server.stop())
    assert counter.calls["Follow"] == last.stats.decode_calls, counter.calls
    assert counter.calls["Propose"] == 0 and counter.calls["Speculate"] == 0, counter.calls


def test_a_follow_message_that_does_not_parse_is_invalid_argument(stack):
    """Bytes on the stream that are not a SpeculateRequest end the call with INVALID_ARGUMENT (as
    any method's malformed request does), not INTERNAL."""
    with grpc.insecure_channel(stack.draft_address) as channel:
        follow = channel.stream_stream("/specdec.v1.DraftService/Follow",
                                       request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
        with pytest.raises(grpc.RpcError) as raised:
            list(follow(iter([b"\xff\xff\xff\xff"]), timeout=30))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
