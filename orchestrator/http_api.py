"""The OpenAI-compatible HTTP API: POST /v1/completions and /v1/chat/completions (whole, or
streamed as server-sent events ending in `data: [DONE]`), GET /v1/models.

A second front door to the one generation path: like the gRPC servicer, it translates the request,
calls OrchestratorService.generate and translates the chunks back. FastAPI parses and validates
the JSON, sse-starlette frames the stream, uvicorn serves it in the orchestrator's own event loop
(its signal handlers off: the orchestrator's SIGTERM drain covers both doors). specdec's
statistics of a request ride in a `specdec` field that OpenAI's clients ignore. What this API
accepts, refuses and adds, against OpenAI's: docs/architecture.md ("The OpenAI-compatible HTTP
API").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from orchestrator.generation import Chunk
from orchestrator.k_policy import Speculation, SpeculationMode
from orchestrator.pipelining import MAX_PIPELINE_FANOUT, PipelineMode
from orchestrator.service import OrchestratorService, PromptInput
from orchestrator.stats import GenerationStats
from specdec import errors
from specdec.protocol import SamplingParams
from specdec.rpc.auth import matching_token, token_partition
from specdec.rpc.server import TlsConfig, check_port_free

log = logging.getLogger(__name__)

Result = TypeVar("Result")
OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; specdec's gRPC API defaults to greedy (0)
SSE_PING_SECONDS = 15.0  # a comment line every so often keeps proxies from closing a quiet stream


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port
    # None: no token asked for; several: several clients, each with its own token
    auth_token: str | tuple[str, ...] | None = field(default=None, repr=False)
    tls: TlsConfig | None = None  # HTTPS; with tls.ca_file, client certificates signed by it

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"the HTTP port must be in [0, 65536), got {self.port}")

    @property
    def auth_tokens(self) -> tuple[str, ...] | None:
        token = self.auth_token
        return (token,) if isinstance(token, str) else token


# -- errors in OpenAI's shape ------------------------------------------------------------------


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


# Each domain error's (HTTP status, OpenAI error type, code); the first match along the MRO.
ERROR_OF: dict[type[errors.SpecdecError], tuple[int, str, str | None]] = {
    errors.InvalidInput: (400, "invalid_request_error", None),
    errors.OutOfRange: (400, "invalid_request_error", None),
    errors.Overloaded: (429, "rate_limit_error", "overloaded"),
    errors.Refused: (429, "rate_limit_error", "overloaded"),
    errors.Unavailable: (503, "server_error", "unavailable"),
    errors.ReplicaError: (503, "server_error", "unavailable"),
}


def api_error(error: errors.SpecdecError) -> ApiError:
    for kind in type(error).__mro__:
        if kind in ERROR_OF:
            status, name, code = ERROR_OF[kind]
            return ApiError(status, str(error), name, code=code)
    return ApiError(500, str(error), "server_error")


def _validation_error(error: RequestValidationError) -> ApiError:
    """FastAPI's 422 becomes OpenAI's 400, naming the first field at fault."""
    first = error.errors()[0] if error.errors() else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        cause = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON ({cause})".replace(" ()", ""))
    param = location[0] if location else None
    where = ".".join(location) or "the request body"
    return ApiError(400, f"{where}: {first.get('msg', 'invalid')}", param=param)


# -- requests ----------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class SpecdecOptions(BaseModel):
    """The `specdec` extension of a request (extra_body={"specdec": {...}} in OpenAI's client)."""

    model_config = ConfigDict(extra="forbid")
    speculation: SpeculationMode | None = None  # off, fixed, adaptive, heuristic; None: the server's
    num_speculative_tokens: int | None = Field(default=None, ge=0)
    pipeline: PipelineMode | None = None  # drafting ahead: off, on, auto, stream; None: the server's
    pipeline_fanout: int | None = Field(default=None, ge=0, le=MAX_PIPELINE_FANOUT)


# Parameters OpenAI defines that specdec does not implement: refused (400) unless they carry a
# value that asks for nothing (None or the neutral one); quietly ignoring them would change what
# the caller gets. Fields nobody defines are ignored, so newer clients keep working.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "logprobs": (False, 0),
    "top_logprobs": (0,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
    "tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
    "response_format": ({"type": "text"},), "prediction": (), "audio": (), "modalities": (["text"],),
}


class _GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None  # any value: the orchestrator serves one model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # not OpenAI's; vLLM and others take it too
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    specdec: SpecdecOptions | None = None

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value is not None and value not in UNSUPPORTED[name]:
                raise ApiError(400, f"{name} is not supported by specdec", param=name,
                               code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true",
                           param="stream_options")

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def sampling(self) -> SamplingParams:
        seed = secrets.randbits(63) if self.seed is None else self.seed % 2**64  # an int64 seed too
        return SamplingParams(
            temperature=OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=seed,
        )

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def speculation(self) -> Speculation:
        options = self.specdec or SpecdecOptions()
        return Speculation(mode=options.speculation, num_speculative_tokens=options.num_speculative_tokens,
                           pipeline=options.pipeline, pipeline_fanout=options.pipeline_fanout)


class CompletionRequest(_GenerateRequest):
    # A string or token ids; OpenAI's lists of several prompts are taken when they hold one.
    # Checked by hand: pydantic's errors for a union of four list types name types, not the field.
    prompt: Any

    def prompt_input(self) -> PromptInput:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request, got {len(prompt)}: send them as "
                                    f"separate requests", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return PromptInput(prompt=prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return PromptInput(prompt_token_ids=tuple(prompt))
        if prompt in ("", []):
            raise ApiError(400, "the prompt is empty", param="prompt")
        raise ApiError(400, "prompt: a string or a list of token ids (or a list holding one of "
                            "either) is expected", param="prompt")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt_input(self) -> PromptInput:
        messages = []
        for index, message in enumerate(self.messages):
            content = message.content
            if isinstance(content, list):
                if any(part.type != "text" or part.text is None for part in content):
                    raise ApiError(400, "only text content parts are supported",
                                   param=f"messages.{index}.content")
                content = "\n".join(part.text or "" for part in content)
            messages.append((message.role, content or ""))
        return PromptInput(messages=tuple(messages))


# -- responses ---------------------------------------------------------------------------------

FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such an estimate becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def specdec_extension(stats: GenerationStats, finish_reason: str) -> dict[str, Any]:
    """The `specdec` field of a response: the statistics the gRPC API's last message carries,
    and specdec's own finish reason (eos, stop, length or context)."""
    return _finite({
        "finish_reason": finish_reason,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "rounds": stats.rounds,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "mean_accepted_length": stats.mean_accepted_length,
        "acceptance_rate": stats.acceptance_rate,
        "num_speculative_tokens_per_round": list(stats.num_speculative_tokens_per_round),
        "num_accepted_per_round": list(stats.num_accepted_per_round),
        "tokens_per_second": stats.tokens_per_second,
        "wall_seconds": stats.wall_seconds,
        "time_to_first_token_seconds": stats.time_to_first_token_seconds,
        "draft_seconds": stats.draft_seconds,
        "verify_seconds": stats.verify_seconds,
        "network_seconds": stats.network_seconds,
        "re_prefills": stats.re_prefills,
        "draft_unavailable_rounds": stats.draft_unavailable_rounds,
        "pipelined_rounds": stats.pipelined_rounds,
        "pipeline_hits": stats.pipeline_hits,
        "pipeline_misses": stats.pipeline_misses,
        "offers": stats.offers,
        "offers_dropped": stats.offers_dropped,
        "offered_passes": stats.offered_passes,
        "offered_drafts": stats.offered_drafts,
        "offered_accepted": stats.offered_accepted,
        "offered_branch_passes": stats.offered_branch_passes,
        "decode_lookup_passes": stats.decode_lookup_passes,
        "decode_lookup_drafts": stats.decode_lookup_drafts,
        "decode_lookup_accepted": stats.decode_lookup_accepted,
        "decode_head_passes": stats.decode_head_passes,
        "decode_head_drafts": stats.decode_head_drafts,
        "decode_head_accepted": stats.decode_head_accepted,
        "branches_drafted": stats.branches_drafted,
        "fanout_per_round": list(stats.fanout_per_round),
        "decode_calls": stats.decode_calls,
        "shadow_probes": stats.shadow_probes,
        "decoded_tokens": stats.decoded_tokens,
        "target_replica": stats.target_replica,
        "draft_replica": stats.draft_replica,
        "controller_estimates": dict(stats.controller_estimates),
        # by the method that proposed them: model, ngram, suffix (as the gRPC stats' maps)
        "drafted_tokens_by_method": dict(stats.drafted_by_method),
        "accepted_tokens_by_method": dict(stats.accepted_by_method),
    })


def usage(stats: GenerationStats) -> dict[str, int]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


@dataclass
class _Shape:
    """One response's JSON, chat or text completion, whole or as stream chunks."""

    chat: bool
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, streamed: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if streamed else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, last: Chunk) -> dict[str, Any]:
        assert last.stats is not None and last.finish_reason is not None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": FINISH_REASON[last.finish_reason]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": FINISH_REASON[last.finish_reason]}
        return {**self._envelope(False), "choices": [choice], "usage": usage(last.stats),
                "specdec": specdec_extension(last.stats, last.finish_reason)}

    def _chunk(self, piece: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": piece, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": piece.get("content", ""), "logprobs": None,
                      "finish_reason": finish_reason}
        chunk = {**self._envelope(True), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: null on every chunk but the last
        return chunk

    def stream(self, chunk: Chunk, first: bool) -> list[dict[str, Any]]:
        """The stream chunks of one generated chunk."""
        out = []
        if first and self.chat:
            out.append(self._chunk({"role": "assistant", "content": ""}, None))
        if chunk.text:
            out.append(self._chunk({"content": chunk.text}, None))
        if chunk.finish_reason is not None:
            assert chunk.stats is not None
            final = self._chunk({}, FINISH_REASON[chunk.finish_reason])
            final["specdec"] = specdec_extension(chunk.stats, chunk.finish_reason)
            out.append(final)
            if self.include_usage:
                out.append({**self._envelope(True), "choices": [], "usage": usage(chunk.stats)})
        return out


def _event(payload: dict[str, Any] | str) -> ServerSentEvent:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return ServerSentEvent(data=data, sep="\n")


# -- the server --------------------------------------------------------------------------------


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def _unless_disconnected(request: Request, awaitable: Awaitable[Result]) -> Result:
    """Awaits `awaitable`; if the client disconnects first, cancels it (a generation's sessions
    are then released, as for a cancelled gRPC call) and raises ClientGone."""
    work = asyncio.ensure_future(awaitable)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
    if work.cancelled():
        raise ClientGone()
    return work.result()


class _Gate:
    """ASGI middleware in front of every route: the bearer token (before anything of the request
    is parsed), then the drain (503 once the server is shutting down), and a count of the
    requests in flight, streams included, for the drain to wait on."""

    def __init__(self, app: ASGIApp, api: HttpApi) -> None:
        self.app, self.api = app, api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tokens = self.api.config.auth_tokens
        if tokens is not None and matching_token(Headers(scope=scope).get("authorization"), tokens) is None:
            refusal = ApiError(401, "missing or wrong bearer token (header 'Authorization: Bearer <token>')",
                               code="invalid_api_key")
            await refusal.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        if self.api.closed:
            await ApiError(503, "the server is shutting down", "server_error", code="unavailable") \
                .response()(scope, receive, send)
            return
        self.api.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.api.in_flight -= 1


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside the orchestrator's loop: the orchestrator owns SIGTERM and SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpApi:
    """The HTTP front door of one OrchestratorService: start(), then drain() and stop()."""

    def __init__(self, service: OrchestratorService, config: HttpConfig = HttpConfig()) -> None:
        self.service = service
        self.config = config
        self.closed = False
        self.in_flight = 0
        self.port = 0
        self.created = int(time.time())
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def model_id(self) -> str:
        reference = self.service.reference
        return reference.model_id if reference is not None and reference.model_id else "specdec"

    @property
    def url(self) -> str:
        scheme = "https" if self.config.tls is not None else "http"
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"{scheme}://{host}:{self.port}/v1"

    # -- life -----------------------------------------------------------------------------------

    async def start(self) -> None:
        sock = _listen(self.config.host, self.config.port)
        self.port = sock.getsockname()[1]
        tls = self.config.tls
        config = uvicorn.Config(
            # log_config None: uvicorn's warnings and errors go through the orchestrator's logging
            _Gate(self.app, self), lifespan="off", log_config=None, log_level="warning", access_log=False,
            ssl_certfile=str(tls.cert_file) if tls else None, ssl_keyfile=str(tls.key_file) if tls else None,
            ssl_ca_certs=str(tls.ca_file) if tls and tls.ca_file else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.ca_file else ssl.CERT_NONE,
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it did not start
                raise errors.Unavailable("the HTTP API did not start")
            await asyncio.sleep(0.01)

    async def drain(self, timeout_seconds: float) -> bool:
        """New requests get 503; waits up to timeout_seconds for those in flight to end."""
        self.closed = True
        deadline = time.monotonic() + timeout_seconds
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    async def stop(self, timeout_seconds: float = 1.0) -> None:
        """Closes the port; requests still running after timeout_seconds are cancelled (their
        sessions released)."""
        if self._server is None or self._task is None:
            return
        self.closed = True
        self._server.config.timeout_graceful_shutdown = max(timeout_seconds, 0.1)
        self._server.should_exit = True
        await self._task

    # -- routes ---------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="specdec", docs_url=None, redoc_url=None)

        @app.exception_handler(ApiError)
        async def on_api_error(request: Request, error: ApiError):
            return error.response()

        @app.exception_handler(errors.SpecdecError)
        async def on_domain_error(request: Request, error: errors.SpecdecError):
            return api_error(error).response()

        @app.exception_handler(RequestValidationError)
        async def on_invalid(request: Request, error: RequestValidationError):
            return _validation_error(error).response()

        @app.exception_handler(Exception)
        async def on_bug(request: Request, error: Exception):  # logged by Starlette, then this
            return ApiError(500, "internal error", "server_error").response()

        @app.exception_handler(HTTPException)
        async def on_http(request: Request, error: HTTPException):
            code = "not_found" if error.status_code == 404 else None
            return ApiError(error.status_code, str(error.detail), code=code).response(error.headers)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model()]}

        @app.get("/v1/models/{model:path}")
        async def model(model: str):
            if model != self.model_id:
                raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                    f"{self.model_id!r}", param="model", code="model_not_found")
            return self._model()

        @app.post("/v1/completions")
        async def completions(request: Request, body: CompletionRequest):
            return await self._generate(request, body, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request, body: ChatCompletionRequest):
            return await self._generate(request, body, chat=True)

        return app

    def _model(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "specdec"}

    async def _generate(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                        chat: bool):
        body.check_supported()
        prompt = body.prompt_input()
        prompt_ids = self.service.tokenize(prompt)
        limit = body.token_limit
        max_context = self.service.limits().max_context
        if limit is not None and len(prompt_ids) + limit > max_context:
            name = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
            raise ApiError(400, f"this model's maximum context length is {max_context} tokens; the "
                                f"prompt has {len(prompt_ids)} and {name} asks for {limit} more",
                           param=name, code="context_length_exceeded")
        tokens = self.config.auth_tokens  # the gate let the request in: it carries one of them
        partition = token_partition(matching_token(request.headers.get("authorization"), tokens)) if tokens else ""
        chunks = self.service.generate(
            PromptInput(prompt_token_ids=prompt_ids), max_new_tokens=limit, sampling=body.sampling(),
            stop=body.stop_strings(), speculation=body.speculation(), partition=partition,
        )
        shape = _Shape(chat=chat, model=self.model_id,
                       include_usage=bool(body.stream_options and body.stream_options.include_usage))
        try:
            # The first chunk comes after the prefill, before any byte of the answer: a refusal
            # (429) or a failure there gets its own status, streamed or not.
            first = await _unless_disconnected(request, anext(chunks))
            if not body.stream:
                text, last = await _unless_disconnected(request, _collect(first, chunks))
                return JSONResponse(shape.whole(text, last))
        except ClientGone:
            await chunks.aclose()
            return JSONResponse({}, status_code=499)  # nobody reads it
        except BaseException:
            await chunks.aclose()
            raise
        return EventSourceResponse(_events(shape, first, chunks), ping=SSE_PING_SECONDS, sep="\n")


async def _collect(first: Chunk, chunks: AsyncIterator[Chunk]) -> tuple[str, Chunk]:
    pieces, last = [first.text], first
    while last.finish_reason is None:
        last = await anext(chunks)
        pieces.append(last.text)
    return "".join(pieces), last


async def _events(shape: _Shape, first: Chunk, chunks) -> AsyncIterator[ServerSentEvent]:
    """The stream: OpenAI's chunks, then `data: [DONE]`. A failure after the first chunk (the
    status line is sent by then) is an error event in OpenAI's shape before [DONE]. A client that
    goes away cancels this generator inside anext(chunks), which releases the sessions."""
    async with contextlib.aclosing(chunks):
        chunk, first_chunk = first, True
        try:
            while True:
                for payload in shape.stream(chunk, first_chunk):
                    yield _event(payload)
                if chunk.finish_reason is not None:
                    break
                chunk, first_chunk = await anext(chunks), False
        except errors.SpecdecError as error:
            failure = api_error(error)
            yield _event({"error": {"message": failure.message, "type": failure.kind,
                                    "param": None, "code": failure.code}})
    yield _event("[DONE]")


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: an ephemeral port); a port in use fails clearly."""
    check_port_free(host, port)
    family, _, _, _, address = socket.getaddrinfo(
        host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    try:
        return socket.create_server(address, family=family)
    except OSError as error:
        raise errors.Unavailable(f"cannot listen on {host}:{port} for HTTP: {error.strerror or error}") from error
