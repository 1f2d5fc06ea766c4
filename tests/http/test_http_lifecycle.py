"""The HTTP API's gates and lifecycle: the bearer token (401), admission (429), the drain (503
for new requests while the streams in flight finish), and a client that goes away mid-request,
whose sessions are released on both model services as for a cancelled gRPC call."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import uuid

import grpc
import openai
import pytest

from specdec.rpc.auth import bearer_token_matches
from specdec.sessions import SessionBudget
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc

from tests.http.conftest import start_api
from tests.waiting import eventually

MESSAGES = [{"role": "user", "content": "tell me a long story"}]
TOKEN = "s3cret-token"


def _client(api, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url, api_key=key, max_retries=0, timeout=120)


def _live_sessions(stack) -> tuple[int, int]:
    return len(stack.target.store), len(stack.draft.store)


# -- the bearer token --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def authed_api(loop_thread, stack):
    running = start_api(loop_thread, stack.orchestrator, auth_token=TOKEN)
    yield running
    loop_thread.run(running.stop())


def test_without_the_right_token_every_route_is_a_401(authed_api):
    for key in ("wrong", TOKEN + "x"):
        with _client(authed_api, key) as client:
            with pytest.raises(openai.AuthenticationError) as raised:
                client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=2)
            assert raised.value.status_code == 401 and raised.value.code == "invalid_api_key"
            assert raised.value.body["type"] == "invalid_request_error"
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
    # The token is checked before the body is read: an unauthenticated caller's bytes are never parsed.
    connection = http.client.HTTPConnection("127.0.0.1", authed_api.port, timeout=60)
    connection.request("POST", "/v1/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 401 and response.getheader("WWW-Authenticate") == "Bearer"
    assert set(json.loads(response.read())["error"]) == {"message", "type", "param", "code"}
    connection.close()


@pytest.mark.parametrize("value, matches", [
    (f"Bearer {TOKEN}", True), (f"bearer  {TOKEN} ", True), (TOKEN, False), (f"Basic {TOKEN}", False),
    ("Bearer wrong", False), (f"Bearer {TOKEN}x", False), ("", False), (None, False),
])
def test_the_authorization_header_check_shared_with_grpc(value, matches):
    assert bearer_token_matches(value, TOKEN) is matches


def test_with_the_token_requests_pass(authed_api):
    with _client(authed_api, TOKEN) as client:
        response = client.completions.create(model="any", prompt="hi", max_tokens=3, temperature=0)
        assert response.usage.completion_tokens >= 1
        assert client.models.list().data


# -- admission ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_session_stack(loop_thread, tiny_pair):
    """Target and draft with room for one session each."""
    from tests import stack as stack_module

    running = loop_thread.run(stack_module.start_stack(tiny_pair.target_dir, tiny_pair.draft_dir,
                                                       budget=SessionBudget(max_sessions=1)))
    api = start_api(loop_thread, running.orchestrator)
    yield running, api
    loop_thread.run(api.stop())
    loop_thread.run(running.stop())


def test_a_request_admission_refuses_is_a_429_streamed_or_not(one_session_stack):
    stack, api = one_session_stack
    session_id = uuid.uuid4().hex
    with grpc.insecure_channel(stack.target_address) as channel:
        target = target_pb2_grpc.TargetServiceStub(channel)
        target.Prefill(target_pb2.TargetPrefillRequest(  # takes the target's only session
            session_id=session_id, token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams()), timeout=60)
        try:
            with _client(api) as client:
                with pytest.raises(openai.RateLimitError) as raised:
                    client.completions.create(model="any", prompt="hi", max_tokens=3)
                assert raised.value.status_code == 429 and raised.value.code == "overloaded"
                assert raised.value.body["type"] == "rate_limit_error"
                with pytest.raises(openai.RateLimitError):  # refused before the stream opens
                    client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=3,
                                                   stream=True)
        finally:
            target.Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=60)
    eventually(lambda: _live_sessions(stack) == (0, 0), "the refused requests left no session")
    with _client(api) as client:
        assert client.completions.create(model="any", prompt="hi", max_tokens=3).usage.completion_tokens


# -- the drain ---------------------------------------------------------------------------------


def test_draining_refuses_new_requests_with_503_and_finishes_streams_in_flight(loop_thread, stack):
    api = start_api(loop_thread, stack.orchestrator)
    try:
        with _client(api) as client:
            stream = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=40,
                                                    temperature=0, stream=True)
            chunks = [next(stream)]  # in flight
            drain = asyncio.run_coroutine_threadsafe(api.drain(60), loop_thread.loop)
            eventually(lambda: api.closed, "the drain began")
            with _client(api) as other:
                with pytest.raises(openai.InternalServerError) as raised:
                    other.completions.create(model="any", prompt="hi", max_tokens=2)
            assert raised.value.status_code == 503 and raised.value.code == "unavailable"
            chunks.extend(stream)  # the stream in flight runs to its end
            assert chunks[-1].choices[0].finish_reason in ("length", "stop")
            assert drain.result(timeout=60) is True
    finally:
        loop_thread.run(api.stop())


# -- a client that goes away -------------------------------------------------------------------


@pytest.fixture
def generation_ends(monkeypatch, stack):
    """How each generation of the orchestrator ended: "finished" or "closed early"."""
    ends: list[str] = []
    original = stack.orchestrator.generate

    def watched(*args, **kwargs):
        chunks = original(*args, **kwargs)

        async def relay():
            finished = False
            try:
                async for chunk in chunks:
                    finished = chunk.finish_reason is not None
                    yield chunk
            finally:
                ends.append("finished" if finished else "closed early")
                await chunks.aclose()

        return relay()

    monkeypatch.setattr(stack.orchestrator, "generate", watched)
    return ends


def test_a_client_that_disconnects_mid_stream_releases_its_sessions(api, stack, generation_ends):
    assert _live_sessions(stack) == (0, 0)
    client = _client(api)
    stream = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=3000,
                                            temperature=0, stream=True,
                                            extra_body={"specdec": {"speculation": "fixed"}})
    for _ in range(3):
        next(stream)
    assert _live_sessions(stack) == (1, 1)
    stream.close()
    client.close()
    eventually(lambda: generation_ends, "the generation ended")
    assert generation_ends == ["closed early"]
    eventually(lambda: _live_sessions(stack) == (0, 0), "target and draft sessions released")


def test_a_client_that_disconnects_before_a_whole_answer_releases_its_sessions(api, stack, generation_ends):
    assert _live_sessions(stack) == (0, 0)
    connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=60)
    body = {"model": "any", "messages": MESSAGES, "max_tokens": 3000, "temperature": 0,
            "specdec": {"speculation": "fixed"}}
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                       headers={"Content-Type": "application/json"})
    eventually(lambda: _live_sessions(stack) == (1, 1), "the generation is running")
    connection.sock.shutdown(2)  # gone, without reading the answer
    with contextlib.suppress(OSError):
        connection.close()
    eventually(lambda: generation_ends, "the generation ended")
    assert generation_ends == ["closed early"]
    eventually(lambda: _live_sessions(stack) == (0, 0), "target and draft sessions released")


# -- TLS ---------------------------------------------------------------------------------------


def test_with_tls_the_api_is_served_over_https_only(loop_thread, stack, tmp_path):
    import ssl

    from specdec.rpc.server import TlsConfig
    from tests.cli.test_cli_tls import make_pki

    pki = make_pki(tmp_path)
    api = start_api(loop_thread, stack.orchestrator,
                    tls=TlsConfig(cert_file=pki / "server.crt", key_file=pki / "server.key"))
    try:
        assert api.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.check_hostname = False  # the certificate names orchestrator.test, dialled as 127.0.0.1
        connection = http.client.HTTPSConnection("127.0.0.1", api.port, timeout=60, context=context)
        connection.request("GET", "/v1/models")
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["data"]
        connection.close()
        plain = http.client.HTTPConnection("127.0.0.1", api.port, timeout=60)
        with pytest.raises((http.client.HTTPException, OSError)):
            plain.request("GET", "/v1/models")
            plain.getresponse()
        plain.close()
    finally:
        loop_thread.run(api.stop())
