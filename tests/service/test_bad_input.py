"""Bad input gets its own clear status code, never INTERNAL or UNKNOWN, and the service answers the
next good request: a client's mistake must say what was wrong and must not take the service
down. Also: a mismatched draft / target pair is refused when the orchestrator starts."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import orchestrator.server
from orchestrator.pool import PoolConfig
from orchestrator.service import OrchestratorConfig
from specdec.errors import IncompatibleModels
from specdec.rpc.server import ServerConfig
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

from tests import stack as stack_module
from tests import tiny_models

Code = grpc.StatusCode
TIMEOUT = 60  # seconds per call; only a hung server comes near it


# ----------------------------------------------------------------------------- clients and helpers


@pytest.fixture(scope="module")
def target_stub(stack):
    with grpc.insecure_channel(stack.target_address) as channel:
        yield target_pb2_grpc.TargetServiceStub(channel)


@pytest.fixture(scope="module")
def draft_stub(stack):
    with grpc.insecure_channel(stack.draft_address) as channel:
        yield draft_pb2_grpc.DraftServiceStub(channel)


@pytest.fixture(scope="module")
def orchestrator_stub(stack):
    with grpc.insecure_channel(stack.address) as channel:
        yield orchestrator_pb2_grpc.OrchestratorStub(channel)


@pytest.fixture(scope="module")
def target_info(target_stub) -> common_pb2.InfoResponse:
    return target_stub.Info(common_pb2.InfoRequest(), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def draft_info(draft_stub) -> common_pb2.InfoResponse:
    return draft_stub.Info(common_pb2.InfoRequest(), timeout=TIMEOUT)


def expect_status(code: grpc.StatusCode, call: Callable[..., Any], request: Any) -> str:
    """Calls a unary or server-streaming method, expects it to fail with code; returns details."""
    with pytest.raises(grpc.RpcError) as raised:
        response = call(request, timeout=TIMEOUT)
        if not hasattr(response, "ByteSize"):  # a stream: the error arrives while reading it
            list(response)
    error = raised.value
    assert error.code() == code, f"expected {code.name}, got {error.code().name}: {error.details()}"
    assert error.details(), "a refusal must say why"
    return error.details()


_session_ids: list[str] = []  # made by this module; released after each test


def new_session_id() -> str:
    session_id = f"bad-input-{uuid.uuid4().hex}"
    _session_ids.append(session_id)
    return session_id


@pytest.fixture(autouse=True)
def _release_sessions(target_stub, draft_stub):
    """The stack is shared by the whole test session: leave no session behind in its budget."""
    yield
    while _session_ids:
        request = common_pb2.ReleaseRequest(session_id=_session_ids.pop())
        target_stub.Release(request, timeout=TIMEOUT)
        draft_stub.Release(request, timeout=TIMEOUT)


def greedy() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0)


def sampled(seed: int = 1) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=1.0, seed=seed)


def prefill_target(stub, sampling: common_pb2.SamplingParams | None = None, session_id: str | None = None,
                   prompt: tuple[int, ...] = (5, 6, 7, 8)) -> target_pb2.TargetPrefillResponse:
    return stub.Prefill(
        target_pb2.TargetPrefillRequest(
            session_id=session_id or new_session_id(), token_ids=list(prompt), sampling=sampling or greedy()
        ),
        timeout=TIMEOUT,
    )


def prefill_draft(stub, sampling: common_pb2.SamplingParams | None = None,
                  prompt: tuple[int, ...] = (5, 6, 7, 8)) -> draft_pb2.DraftPrefillResponse:
    return stub.Prefill(
        draft_pb2.DraftPrefillRequest(session_id=new_session_id(), token_ids=list(prompt),
                                      sampling=sampling or greedy()),
        timeout=TIMEOUT,
    )


def good_target_round(stub) -> None:
    """A prefill and a K = 2 verify on a fresh session answer as they should."""
    prefill = prefill_target(stub)
    assert prefill.HasField("next_token_id")
    verify = stub.Verify(target_pb2.VerifyRequest(handle=prefill.handle, draft_token_ids=[3, 4]), timeout=TIMEOUT)
    assert 0 <= verify.num_accepted <= 2
    assert verify.handle.committed_length == prefill.handle.committed_length + verify.num_accepted + 1
    assert stub.Release(common_pb2.ReleaseRequest(session_id=prefill.handle.session_id), timeout=TIMEOUT).released


def good_draft_round(stub) -> None:
    prefill = prefill_draft(stub)
    propose = stub.Propose(
        draft_pb2.ProposeRequest(handle=prefill.handle, num_speculative_tokens=2), timeout=TIMEOUT
    )
    assert len(propose.draft_token_ids) == 2
    assert stub.Release(common_pb2.ReleaseRequest(session_id=prefill.handle.session_id), timeout=TIMEOUT).released


def good_generation(stub) -> None:
    tokens = []
    for response in stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=4), timeout=TIMEOUT):
        tokens.extend(response.token_ids)
    assert len(tokens) == 4


# ----------------------------------------------------------------------------- target: prefill

BAD_SAMPLING = [
    pytest.param(common_pb2.SamplingParams(temperature=-0.5), id="temperature<0"),
    pytest.param(common_pb2.SamplingParams(temperature=math.nan), id="temperature-nan"),
    pytest.param(common_pb2.SamplingParams(temperature=math.inf), id="temperature-inf"),
    pytest.param(common_pb2.SamplingParams(temperature=1.0, top_p=0.0), id="top_p-0"),
    pytest.param(common_pb2.SamplingParams(temperature=1.0, top_p=1.5), id="top_p-1.5"),
    pytest.param(common_pb2.SamplingParams(temperature=1.0, top_p=math.nan), id="top_p-nan"),
    pytest.param(common_pb2.SamplingParams(temperature=1.0, top_k=-1), id="top_k<0"),
]


def test_target_prefill_token_ids_outside_the_vocabulary(target_stub, target_info):
    for token_ids in ([5, target_info.vocab_size], [5, -1], [2**31 - 1]):
        details = expect_status(Code.OUT_OF_RANGE, target_stub.Prefill, target_pb2.TargetPrefillRequest(
            session_id=new_session_id(), token_ids=token_ids, sampling=greedy()))
        assert "vocabulary" in details
        good_target_round(target_stub)


def test_target_prefill_empty_prompt(target_stub):
    for resume in (False, True):
        expect_status(Code.INVALID_ARGUMENT, target_stub.Prefill, target_pb2.TargetPrefillRequest(
            session_id=new_session_id(), token_ids=[], sampling=greedy(), resume=resume))
        good_target_round(target_stub)


def test_target_prefill_longer_than_the_max_context(target_stub, target_info):
    too_long = [5] * (target_info.max_context + 1)
    details = expect_status(Code.OUT_OF_RANGE, target_stub.Prefill, target_pb2.TargetPrefillRequest(
        session_id=new_session_id(), token_ids=too_long, sampling=greedy()))
    assert "max context" in details
    good_target_round(target_stub)


@pytest.mark.parametrize("sampling", BAD_SAMPLING)
def test_target_prefill_bad_sampling(target_stub, sampling):
    expect_status(Code.INVALID_ARGUMENT, target_stub.Prefill, target_pb2.TargetPrefillRequest(
        session_id=new_session_id(), token_ids=[5, 6], sampling=sampling))
    good_target_round(target_stub)


@pytest.mark.parametrize("session_id", ["", "x" * 129], ids=["empty", "too-long"])
def test_target_prefill_bad_session_id(target_stub, session_id):
    expect_status(Code.INVALID_ARGUMENT, target_stub.Prefill, target_pb2.TargetPrefillRequest(
        session_id=session_id, token_ids=[5, 6], sampling=greedy()))
    good_target_round(target_stub)


# ----------------------------------------------------------------------------- target: verify


def _verify(handle: common_pb2.SessionHandle, drafts=(), distributions=()) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(handle=handle, draft_token_ids=list(drafts),
                                    draft_distributions=list(distributions))


def _still_usable(stub, handle: common_pb2.SessionHandle, distributions=()) -> None:
    """The refused call changed nothing: the same handle verifies normally afterwards."""
    response = stub.Verify(_verify(handle, [3], distributions), timeout=TIMEOUT)
    assert response.handle.committed_length == handle.committed_length + response.num_accepted + 1


def test_verify_more_drafts_than_the_maximum(target_stub, target_info):
    handle = prefill_target(target_stub).handle
    too_many = [3] * (target_info.max_num_speculative_tokens + 1)
    details = expect_status(Code.OUT_OF_RANGE, target_stub.Verify, _verify(handle, too_many))
    assert "max_num_speculative_tokens" in details
    _still_usable(target_stub, handle)


def test_verify_draft_tokens_outside_the_vocabulary(target_stub, target_info):
    handle = prefill_target(target_stub).handle
    for drafts in ([3, target_info.vocab_size], [-4]):
        expect_status(Code.OUT_OF_RANGE, target_stub.Verify, _verify(handle, drafts))
    _still_usable(target_stub, handle)


def test_verify_past_the_max_context(target_stub, target_info):
    """The context check runs on the model worker; its error still maps to OUT_OF_RANGE."""
    prompt = tuple([5, 6] * target_info.max_context)[: target_info.max_context - 1]
    prefill = prefill_target(target_stub, prompt=prompt)
    assert prefill.handle.committed_length == target_info.max_context
    expect_status(Code.OUT_OF_RANGE, target_stub.Verify, _verify(prefill.handle, [3, 4]))
    target_stub.Release(common_pb2.ReleaseRequest(session_id=prefill.handle.session_id), timeout=TIMEOUT)
    good_target_round(target_stub)


def test_verify_unknown_session(target_stub):
    handle = common_pb2.SessionHandle(session_id=new_session_id(), replica_id="target-0",
                                      committed_length=4, epoch=1)
    details = expect_status(Code.NOT_FOUND, target_stub.Verify, _verify(handle, [3]))
    assert "unknown session" in details
    good_target_round(target_stub)


def test_verify_handle_of_another_replica(target_stub):
    handle = prefill_target(target_stub).handle
    foreign = common_pb2.SessionHandle()
    foreign.CopyFrom(handle)
    foreign.replica_id = "some-other-replica"
    expect_status(Code.NOT_FOUND, target_stub.Verify, _verify(foreign, [3]))
    _still_usable(target_stub, handle)


def test_verify_handle_without_session_id(target_stub):
    expect_status(Code.INVALID_ARGUMENT, target_stub.Verify, _verify(common_pb2.SessionHandle(), [3]))
    good_target_round(target_stub)


def test_verify_handle_from_an_older_epoch(target_stub):
    session_id = new_session_id()
    first = prefill_target(target_stub, session_id=session_id).handle
    second = prefill_target(target_stub, session_id=session_id).handle
    assert second.epoch > first.epoch
    details = expect_status(Code.NOT_FOUND, target_stub.Verify, _verify(first, [3]))
    assert "epoch" in details
    _still_usable(target_stub, second)


def test_verify_stale_committed_length(target_stub):
    handle = prefill_target(target_stub).handle
    ahead = common_pb2.SessionHandle()
    ahead.CopyFrom(handle)
    ahead.committed_length += 5
    details = expect_status(Code.ABORTED, target_stub.Verify, _verify(ahead, [3]))
    assert "committed length" in details
    # Two applied rounds later, the first handle is neither current nor the last applied one.
    second = target_stub.Verify(_verify(handle, [3]), timeout=TIMEOUT).handle
    third = target_stub.Verify(_verify(second, [3]), timeout=TIMEOUT).handle
    expect_status(Code.ABORTED, target_stub.Verify, _verify(handle, [3]))
    _still_usable(target_stub, third)


def test_repeated_verify_returns_the_stored_response_once_applied(stack, target_stub):
    prefill = prefill_target(target_stub)
    handle = prefill.handle
    session = stack.target.store.lookup(handle.session_id, handle.epoch)
    first = target_stub.Verify(_verify(handle, [3, 4, 9]), timeout=TIMEOUT)
    applied_length = session.state.committed_length
    assert applied_length == handle.committed_length + first.num_accepted + 1
    assert len(session.state.cache) == applied_length - 1  # the cache invariant: C[:-1]
    for _ in range(2):
        repeat = target_stub.Verify(_verify(handle, [3, 4, 9]), timeout=TIMEOUT)
        assert repeat == first  # the identical stored message, timings included
        assert session.state.committed_length == applied_length
        assert len(session.state.cache) == applied_length - 1
    following = target_stub.Verify(_verify(first.handle, [3]), timeout=TIMEOUT)
    assert following.handle.committed_length == applied_length + following.num_accepted + 1


def test_sampled_verify_without_draft_distributions(target_stub):
    handle = prefill_target(target_stub, sampled()).handle
    details = expect_status(Code.INVALID_ARGUMENT, target_stub.Verify, _verify(handle, [3, 4]))
    assert "distribution" in details
    _still_usable(target_stub, handle, [common_pb2.SparseDistribution(token_ids=[3], probs=[1.0])])


def _dist(token_ids, probs) -> common_pb2.SparseDistribution:
    return common_pb2.SparseDistribution(token_ids=token_ids, probs=probs)


BAD_DISTRIBUTIONS = [
    pytest.param(lambda vocab: [_dist([3, vocab], [0.5, 0.5])], Code.OUT_OF_RANGE, id="id>=vocab"),
    pytest.param(lambda vocab: [_dist([3, -1], [0.5, 0.5])], Code.OUT_OF_RANGE, id="negative-id"),
    pytest.param(lambda vocab: [_dist([3, 4], [1.5, -0.5])], Code.INVALID_ARGUMENT, id="negative-prob"),
    pytest.param(lambda vocab: [_dist([3, 4], [math.nan, 0.5])], Code.INVALID_ARGUMENT, id="nan-prob"),
    pytest.param(lambda vocab: [_dist([3, 4], [math.inf, 0.5])], Code.INVALID_ARGUMENT, id="inf-prob"),
    pytest.param(lambda vocab: [_dist([3], [0.0])], Code.INVALID_ARGUMENT, id="zero-mass"),
    pytest.param(lambda vocab: [_dist([3, 4], [1.0])], Code.INVALID_ARGUMENT, id="length-mismatch"),
    pytest.param(lambda vocab: [_dist([], [])], Code.INVALID_ARGUMENT, id="empty"),
    pytest.param(lambda vocab: [_dist([3, 3], [0.5, 0.5])], Code.INVALID_ARGUMENT, id="duplicate-ids"),
    pytest.param(lambda vocab: [_dist([4, 5], [0.5, 0.5])], Code.INVALID_ARGUMENT, id="draft-token-absent"),
    pytest.param(lambda vocab: [_dist([3, 4], [0.0, 1.0])], Code.INVALID_ARGUMENT, id="draft-token-zero-prob"),
    pytest.param(lambda vocab: [_dist(list(range(vocab)), [1.0 / vocab] * vocab)] if vocab > 64
                 else [_dist([3] + [0] * 64, [1.0] * 65)], Code.INVALID_ARGUMENT, id="over-64-entries"),
    pytest.param(lambda vocab: [_dist([3], [1.0])] * 2, Code.INVALID_ARGUMENT, id="two-for-one-token"),
]


@pytest.mark.parametrize("distributions, code", BAD_DISTRIBUTIONS)
def test_sampled_verify_bad_draft_distribution(target_stub, target_info, distributions, code):
    handle = prefill_target(target_stub, sampled()).handle
    expect_status(code, target_stub.Verify, _verify(handle, [3], distributions(target_info.vocab_size)))
    _still_usable(target_stub, handle, [_dist([3, 4], [0.75, 0.25])])


# ----------------------------------------------------------------------------- draft


def _propose(handle, num_speculative_tokens: int, new=()) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(handle=handle, num_speculative_tokens=num_speculative_tokens,
                                    new_committed_token_ids=list(new))


def test_draft_prefill_bad_prompts(draft_stub, draft_info):
    cases = [
        ([], Code.INVALID_ARGUMENT),
        ([5, draft_info.vocab_size], Code.OUT_OF_RANGE),
        ([-2], Code.OUT_OF_RANGE),
        ([5] * (draft_info.max_context + 1), Code.OUT_OF_RANGE),
    ]
    for token_ids, code in cases:
        expect_status(code, draft_stub.Prefill, draft_pb2.DraftPrefillRequest(
            session_id=new_session_id(), token_ids=token_ids, sampling=greedy()))
        good_draft_round(draft_stub)


@pytest.mark.parametrize("sampling", BAD_SAMPLING)
def test_draft_prefill_bad_sampling(draft_stub, sampling):
    expect_status(Code.INVALID_ARGUMENT, draft_stub.Prefill, draft_pb2.DraftPrefillRequest(
        session_id=new_session_id(), token_ids=[5, 6], sampling=sampling))
    good_draft_round(draft_stub)


def test_propose_k_outside_its_range(draft_stub, draft_info):
    handle = prefill_draft(draft_stub).handle
    for k in (draft_info.max_num_speculative_tokens + 1, 0, -1):
        details = expect_status(Code.OUT_OF_RANGE, draft_stub.Propose, _propose(handle, k))
        assert "num_speculative_tokens" in details
    assert len(draft_stub.Propose(_propose(handle, 2), timeout=TIMEOUT).draft_token_ids) == 2


def test_propose_committed_tokens_outside_the_vocabulary(draft_stub, draft_info):
    handle = prefill_draft(draft_stub).handle
    expect_status(Code.OUT_OF_RANGE, draft_stub.Propose, _propose(handle, 2, [3, draft_info.vocab_size]))
    assert len(draft_stub.Propose(_propose(handle, 2, [3]), timeout=TIMEOUT).draft_token_ids) == 2


def test_propose_unknown_session_older_epoch_and_stale_length(draft_stub):
    unknown = common_pb2.SessionHandle(session_id=new_session_id(), replica_id="draft-0",
                                       committed_length=4, epoch=1)
    expect_status(Code.NOT_FOUND, draft_stub.Propose, _propose(unknown, 2))
    session_id = new_session_id()
    request = draft_pb2.DraftPrefillRequest(session_id=session_id, token_ids=[5, 6, 7], sampling=greedy())
    first = draft_stub.Prefill(request, timeout=TIMEOUT).handle
    second = draft_stub.Prefill(request, timeout=TIMEOUT).handle
    expect_status(Code.NOT_FOUND, draft_stub.Propose, _propose(first, 2))
    ahead = common_pb2.SessionHandle()
    ahead.CopyFrom(second)
    ahead.committed_length += 3
    expect_status(Code.ABORTED, draft_stub.Propose, _propose(ahead, 2))
    proposal = draft_stub.Propose(_propose(second, 2), timeout=TIMEOUT)
    # A retry carries no new committed tokens, so it may be applied again; reconciliation makes
    # that idempotent: the same drafts from the same C.
    retry = draft_stub.Propose(_propose(second, 2), timeout=TIMEOUT)
    assert (retry.handle, retry.draft_token_ids, retry.fed_tokens) == (
        proposal.handle, proposal.draft_token_ids, proposal.fed_tokens)
    good_draft_round(draft_stub)


# ----------------------------------------------------------------------------- orchestrator


def _generate(**fields) -> pb.GenerateRequest:
    fields.setdefault("max_new_tokens", 4)
    return pb.GenerateRequest(**fields)


BAD_GENERATE = [
    pytest.param(_generate(prompt_token_ids=[5], max_new_tokens=0), Code.INVALID_ARGUMENT, id="max_new_tokens-0"),
    pytest.param(_generate(prompt_token_ids=[5], max_new_tokens=-3), Code.INVALID_ARGUMENT, id="max_new_tokens<0"),
    pytest.param(_generate(), Code.INVALID_ARGUMENT, id="no-prompt"),
    pytest.param(_generate(prompt="ab", prompt_token_ids=[5]), Code.INVALID_ARGUMENT, id="prompt+ids"),
    pytest.param(_generate(prompt="ab", messages=[pb.ChatMessage(role="user", content="hi")]),
                 Code.INVALID_ARGUMENT, id="prompt+messages"),
    pytest.param(_generate(prompt_token_ids=[5], messages=[pb.ChatMessage(role="user", content="hi")]),
                 Code.INVALID_ARGUMENT, id="ids+messages"),
    pytest.param(_generate(prompt="ab", prompt_token_ids=[5], messages=[pb.ChatMessage(role="user", content="x")]),
                 Code.INVALID_ARGUMENT, id="all-three"),
    pytest.param(_generate(prompt_token_ids=[5, 10_000]), Code.OUT_OF_RANGE, id="id>=vocab"),
    pytest.param(_generate(prompt_token_ids=[-1]), Code.OUT_OF_RANGE, id="negative-id"),
    pytest.param(_generate(prompt_token_ids=[5], speculation=pb.SpeculationConfig(
        num_speculative_tokens=1000)), Code.OUT_OF_RANGE, id="K-1000"),
    pytest.param(_generate(prompt_token_ids=[5], speculation=pb.SpeculationConfig(
        mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=-1)), Code.OUT_OF_RANGE, id="K<0"),
    pytest.param(_generate(prompt_token_ids=[5], speculation=pb.SpeculationConfig(mode=9)),
                 Code.INVALID_ARGUMENT, id="unknown-mode"),
    pytest.param(_generate(prompt_token_ids=[5], stop=[""]), Code.INVALID_ARGUMENT, id="empty-stop"),
    pytest.param(_generate(prompt_token_ids=[5], stop=["ab", ""]), Code.INVALID_ARGUMENT, id="one-empty-stop"),
    *[
        pytest.param(_generate(prompt_token_ids=[5], sampling=param.values[0]), Code.INVALID_ARGUMENT,
                     id=f"sampling-{param.id}")
        for param in BAD_SAMPLING
    ],
]


@pytest.mark.parametrize("request_, code", BAD_GENERATE)
def test_generate_bad_request(orchestrator_stub, request_, code):
    expect_status(code, orchestrator_stub.Generate, request_)
    good_generation(orchestrator_stub)


def test_generate_k_above_the_servers_maximum(orchestrator_stub, target_info, draft_info):
    limit = min(target_info.max_num_speculative_tokens, draft_info.max_num_speculative_tokens)
    details = expect_status(Code.OUT_OF_RANGE, orchestrator_stub.Generate, _generate(
        prompt_token_ids=[5], speculation=pb.SpeculationConfig(
            mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=limit + 1)))
    assert "num_speculative_tokens" in details
    good_generation(orchestrator_stub)


def test_generate_prompt_longer_than_the_max_context(orchestrator_stub, target_info):
    expect_status(Code.OUT_OF_RANGE, orchestrator_stub.Generate,
                  _generate(prompt_token_ids=[5] * (target_info.max_context + 1)))
    good_generation(orchestrator_stub)


# ----------------------------------------------------------------------------- a retry after a cancel


def test_retry_after_a_cancelled_verify_gets_the_stored_response(loop_thread, stack, target_stub):
    """A client whose Verify was cancelled (a deadline, a dropped connection) retries the same
    handle. The round was applied on the worker anyway, so the retry must get the stored
    response (docs/architecture.md, "Handles and retries"), and the cache must not advance twice.

    Made deterministic by holding the model worker (single thread) with a gate, so the Verify is
    still queued when the server cancels its handler task (seen through grpc.aio's task name)."""
    service = stack.target
    handle = prefill_target(target_stub).handle
    session = service.store.lookup(handle.session_id, handle.epoch)
    gate = threading.Event()
    blocker = asyncio.run_coroutine_threadsafe(service.worker.run(gate.wait), loop_thread.loop)
    try:
        _wait_for(lambda: service.worker.load * service.worker.max_queue >= 1)
        call = target_stub.Verify.future(_verify(handle, [3, 4]), timeout=TIMEOUT)
        _wait_for(lambda: service.worker.load * service.worker.max_queue >= 2)  # queued behind the gate
        call.cancel()
        _wait_for(lambda: loop_thread.run(_verify_handler_cancelled()))
    finally:
        gate.set()
        blocker.result(TIMEOUT)
    _wait_for(lambda: service.worker.load == 0)
    applied_length = session.state.committed_length
    assert applied_length > handle.committed_length, "the cancelled round still ran on the worker"

    retry = target_stub.Verify(_verify(handle, [3, 4]), timeout=TIMEOUT)

    assert retry.handle.committed_length == applied_length
    assert session.state.committed_length == applied_length
    assert len(session.state.cache) == applied_length - 1


async def _verify_handler_cancelled() -> bool:
    return any("TargetService/Verify" in task.get_name() and task.cancelling()
               for task in asyncio.all_tasks())


def _wait_for(condition: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# ----------------------------------------------------------------------------- mismatched pairs


def _permuted_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer's vocabulary in another order: same size, different token ids."""
    chars = list(reversed(tiny_models.CHARS))
    vocab = {token: i for i, token in enumerate(tiny_models.SPECIALS + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


async def _start_orchestrator_against(target_address: str, draft_dir) -> str:
    """Starts a draft from draft_dir and an orchestrator on (target, that draft); returns why the
    orchestrator refused to start."""
    draft_server, _ = await stack_module.start_draft(draft_dir, replica_id="mismatched-draft")
    try:
        config = OrchestratorConfig(
            draft=f"127.0.0.1:{draft_server.port}", target=target_address,
            pool=PoolConfig(refresh_seconds=0.5), startup_timeout_seconds=30,
        )
        try:
            running, service = await orchestrator.server.start(config, ServerConfig(port=0))
        except IncompatibleModels as error:
            return str(error)
        await service.close()
        await running.stop()
        raise AssertionError("the orchestrator started with a mismatched pair")
    finally:
        await draft_server.stop()


def test_pair_with_different_vocabulary_sizes_is_refused(loop_thread, stack, tmp_path, target_info):
    bigger = tiny_models.make_model(seed=3, vocab_size=target_info.vocab_size + 1)
    draft_dir = tiny_models.save(bigger, tmp_path / "bigger-vocab")  # same tokenizer files
    message = loop_thread.run(_start_orchestrator_against(stack.target_address, draft_dir))
    assert "vocabulary" in message
    assert str(target_info.vocab_size) in message and str(target_info.vocab_size + 1) in message
    good_generation_after_refusal(stack)


def test_pair_with_a_different_tokenizer_is_refused(loop_thread, stack, tmp_path, target_info):
    draft_dir = tiny_models.save(tiny_models.make_model(seed=3), tmp_path / "permuted", with_tokenizer=False)
    tokenizer = _permuted_tokenizer()
    assert len(tokenizer) == target_info.vocab_size
    tokenizer.save_pretrained(draft_dir)
    message = loop_thread.run(_start_orchestrator_against(stack.target_address, draft_dir))
    assert "tokenizer" in message
    good_generation_after_refusal(stack)


def good_generation_after_refusal(stack) -> None:
    """The target that took part in the refused start still serves the running stack."""
    tokens, _, _ = stack_module.generate(stack.address, _generate(prompt_token_ids=[5, 6], max_new_tokens=3))
    assert len(tokens) == 3


def test_permuted_tokenizer_really_differs():
    """Guards the case above: the permuted tokenizer maps the same text to other ids."""
    assert _permuted_tokenizer()("ab")["input_ids"] != tiny_models.make_tokenizer()("ab")["input_ids"]
