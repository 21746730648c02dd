"""The OpenAI-compatible HTTP server: FastAPI routes over one engine's loop.

Every request becomes one request of the engine loop (`RagKVCache.astream`), so concurrent
clients decode in one batch and share linked prefixes. The model loads in a thread after the
server starts: `/health` answers 503 until it is ready. Every error is OpenAI's JSON shape
`{"error": {"message", "type", "code"}}`, never a traceback or an HTML page.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from rag_kvcache.answer import Answer
from rag_kvcache.chat import aunless_repeated, earlier_answers
from rag_kvcache.engine import RagKVCache
from rag_kvcache.errors import (
    ContextTooLongError,
    DtypeMismatchError,
    EngineClosedError,
    FingerprintMismatchError,
    RagKVCacheError,
    StoreError,
    UnknownCacheIdError,
)
from rag_kvcache.serving.batch import BatchLoad
from rag_kvcache.serving.loop import AsyncTokenStream
from rag_kvcache.strategy import Strategy
from rag_kvcache.tools.server.api_key import check_api_key
from rag_kvcache.tools.server.draining import Draining, ServerStopping, until_stopped
from rag_kvcache.tools.server.gate import Gate
from rag_kvcache.tools.server.limits import DEFAULT_MAX_BODY_BYTES
from rag_kvcache.tools.server.metrics import ServerMetrics
from rag_kvcache.tools.server.schema import (
    ChatRequest,
    CompletionRequest,
    RagUsage,
    Sampling,
    Usage,
)

log = logging.getLogger("rag_kvcache.server")
DEFAULT_TOP_K = 4
INTERNAL = "internal error; the server's log has the details"
DISCONNECT_POLL_S = 0.25  # how often a request not yet streaming checks that its client is there
T = TypeVar("T")


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class Loading:
    """The engine once loaded, or why it could not be."""

    engine: RagKVCache | None = None
    error: str | None = None

    def ready(self) -> RagKVCache:
        if self.engine is None:
            why = (
                f"the model failed to load: {self.error}" if self.error else "the model is loading"
            )
            raise ApiError(503, why, "model_not_ready")
        return self.engine


@dataclass(frozen=True)
class Job:
    """What one request asks the engine: a question over chunks (RAG) or a plain prompt."""

    text: str  # the question, or the whole formatted prompt
    rag: bool
    cache_ids: list[str]
    strategy: Strategy | None
    max_tokens: int | None
    alone: str = ""  # a chat's last message: asked alone if the answer repeats one of
    earlier: list[str] = field(default_factory=list)  # ... the answers its question shows
    # a text completion's plain prompt: its text is the prompt's continuation, as decoded
    continuation: bool = False


class FollowUpStream:
    """A chat follow-up's answer stream, with the repeat guard of `rag_kvcache.chat`: the
    answer to the question with its history, or, when that is an earlier answer again word for
    word, to the last message alone. `result` is the record of the answer whose pieces were
    given (the same interface as the engine's `AsyncTokenStream`)."""

    def __init__(self, start: Callable[[str], AsyncTokenStream[Answer]], job: Job) -> None:
        self._streams: list[AsyncTokenStream[Answer]] = []

        def run(text: str) -> AsyncIterator[str]:
            self._streams.append(start(text))
            return aiter(self._streams[-1])

        self._pieces = aunless_repeated(run(job.text), job.earlier, lambda: run(job.alone))

    @property
    def result(self) -> Answer | None:
        return self._streams[-1].result

    def __aiter__(self) -> AsyncIterator[str]:
        return self._pieces

    async def finish(self) -> Answer:
        async for _ in self._pieces:
            pass
        assert self.result is not None
        return self.result

    async def aclose(self) -> None:
        try:
            await self._pieces.aclose()
        finally:  # the engine's requests are aborted whatever happened above
            for stream in self._streams:
                await stream.aclose()


UNPARSED = "There was an error parsing the body"  # FastAPI's 400 for a body json cannot read


def create_app(
    load: Callable[[], RagKVCache],
    api_key: str | None = None,
    model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The app; `load` builds the engine (called once, in a thread, at start-up).
    `model_name`: what clients call the model (default: the loaded model's own name).
    `api_key` and `max_body_bytes` are checked before a body is read (`gate.Gate`).
    `app.state.draining.begin(grace_s)`, as the server is asked to stop, ends the answers
    still running shortly before the server cuts them, with a 503 (`draining`)."""
    if api_key is not None:
        check_api_key(api_key)  # now, not when the first request starts the middleware
    loading = Loading()
    draining = Draining()

    def served_name(engine: RagKVCache) -> str:
        return model_name or engine.lm.name

    def load_engine() -> None:
        try:
            loading.engine = load()
        except Exception as error:  # reported by /health and every request
            log.exception("loading the engine failed")
            loading.error = str(error)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        thread = threading.Thread(target=load_engine, name="rag-kvcache-load", daemon=True)
        thread.start()
        yield
        if loading.engine is not None:
            loading.engine.close()

    # no schema or docs pages: served outside the API key's gate, they would tell anyone
    # the routes of a server meant for key holders (the API is OpenAI's, documented there)
    app = FastAPI(
        title="rag-kvcache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.draining = draining
    metrics = ServerMetrics(
        batch=lambda: _batch_state(loading.engine), hits=lambda: _store_hits(loading.engine)
    )

    # ------------------------------------------------------------------ errors

    def error(status: int, message: str, code: str | None) -> JSONResponse:
        metrics.failed(status)
        kind = {401: "authentication_error", 404: "not_found_error"}.get(status)
        if kind is None:
            kind = "invalid_request_error" if status < 500 else "server_error"
        body = {"error": {"message": message, "type": kind, "code": code}}
        return JSONResponse(body, status_code=status)

    app.add_middleware(Gate, reject=error, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return error(e.status, e.message, e.code)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        problems = [
            f"the body is not valid JSON: {d.get('ctx', {}).get('error', d['msg'])} at "
            f"character {d['loc'][-1]}"
            if d["type"] == "json_invalid"
            else f"{'.'.join(str(p) for p in d['loc'] if p != 'body') or 'body'}: {d['msg']}"
            for d in e.errors()[:5]
        ]
        if "json" not in request.headers.get("content-type", ""):  # curl -d sends a form type
            problems.insert(0, "send the body as JSON, with Content-Type: application/json")
        return error(400, "; ".join(problems), "invalid_request")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = str(e.detail)
        if e.status_code == 400 and message == UNPARSED:  # what FastAPI says of them all
            message = (
                "the body cannot be read as JSON: send it as UTF-8, with numbers of at most "
                "4300 digits and nesting less than 1000 deep"
            )
        codes = {400: "invalid_request", 413: "request_too_large"}
        return error(e.status_code, message, codes.get(e.status_code))

    @app.exception_handler(RagKVCacheError)
    async def library_error(request: Request, e: RagKVCacheError) -> JSONResponse:
        status, code = _status_of(e)
        return error(status, str(e), code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("request failed")
        return error(500, INTERNAL, None)

    # ------------------------------------------------------------------ routes

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        if loading.engine is not None:
            return JSONResponse({"status": "ok", "model": served_name(loading.engine)})
        status = "failed" if loading.error else "loading"
        return JSONResponse({"status": status, "error": loading.error}, status_code=503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine = loading.ready()
        model = {"id": served_name(engine), "object": "model", "created": 0}
        model["owned_by"] = "rag-kvcache"
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        engine = loading.ready()
        max_tokens = body.max_completion_tokens or body.max_tokens
        _check(engine, served_name(engine), body, max_tokens)
        if body.messages[-1].role != "user":
            raise ApiError(400, "the last message must be the user's", "invalid_request")
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        if body.rag is None:  # rendered off the event loop, as every long text is
            prompt = await asyncio.to_thread(engine.chat_prompt, messages)
            job = Job(prompt, False, [], None, max_tokens)
        else:

            def questions() -> tuple[str, str, list[str]]:  # long texts: off the loop too
                asked = engine.chat_question(messages)  # with the history
                alone = engine.chat_question(messages, history_turns=0)  # if it repeats one
                return asked, alone, earlier_answers(messages[:-1])

            asked, alone, earlier = await asyncio.to_thread(questions)
            job = await _rag_job(engine, body, body.messages[-1].text, max_tokens)
            job = replace(job, text=asked, alone=alone, earlier=earlier)
        name = served_name(engine)
        return await _respond(
            engine, name, body, job, "chat.completion", metrics, request, draining
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        engine = loading.ready()
        _check(engine, served_name(engine), body, body.max_tokens)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise ApiError(400, "one prompt per request", "invalid_request")
        if body.rag is None:
            job = Job(prompts[0], False, [], None, body.max_tokens, continuation=True)
        else:
            job = await _rag_job(engine, body, prompts[0], body.max_tokens)
        name = served_name(engine)
        return await _respond(
            engine, name, body, job, "text_completion", metrics, request, draining
        )

    return app


# ---------------------------------------------------------------------- answering


async def _rag_job(
    engine: RagKVCache, body: Sampling, question: str, max_tokens: int | None
) -> Job:
    rag = body.rag
    assert rag is not None
    if not question.strip():
        raise ApiError(400, "the question is empty", "invalid_request")
    strategy = Strategy.parse(rag.strategy) if rag.strategy else engine.config.strategy
    if rag.cache_ids is not None:
        if rag.top_k is not None:
            raise ApiError(400, "give rag.cache_ids or rag.top_k, not both", "invalid_request")
        cache_ids = rag.cache_ids
    else:
        hits = await asyncio.to_thread(engine.retrieve, question, rag.top_k or DEFAULT_TOP_K)
        cache_ids = [hit.cache_id for hit in hits]
    return Job(question, True, cache_ids, strategy, max_tokens)


async def _respond(
    engine: RagKVCache,
    model: str,
    body: Sampling,
    job: Job,
    kind: str,
    metrics: ServerMetrics,
    request: Request,
    draining: Draining,
) -> Response:
    stream = await asyncio.to_thread(_stream, engine, body, job)  # tokenizing: off the loop
    pieces = aiter(stream)

    async def first_piece() -> str | None:
        try:
            return await anext(pieces)
        except StopAsyncIteration:
            return None

    # the first piece (or the request's own error: an unknown chunk, a context too long)
    # before any byte is sent, so errors keep their status code; a request waiting for room
    # in the KV budget waits here, and is dropped if its client leaves meanwhile
    try:
        first = await _unless_gone(request, first_piece(), stream, draining)
    except ClientGone:
        metrics.aborted()
        return Response(status_code=499)
    request_id = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())

    def finish_reason(answer: Answer) -> str:
        """Why the answer ended: "stop" where the model ended it, "length" where it was cut,
        at max_tokens or where the prompt and the answer filled the model's window."""
        if answer.token_ids and answer.token_ids[-1] in engine.lm.eos_ids:
            return "stop"
        limit = job.max_tokens or engine.config.generation.max_new_tokens
        window = answer.prompt_tokens + len(answer.token_ids) >= engine.lm.max_context
        return "length" if len(answer.token_ids) >= limit or window else "stop"

    if not body.stream:
        try:  # its text is the pieces joined, trimmed
            answer = await _unless_gone(request, stream.finish(), stream, draining)
        except ClientGone:  # its request was aborted: nobody to answer
            metrics.aborted()
            return Response(status_code=499)
        metrics.answered(answer)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(answer)}
        if kind == "chat.completion":
            choice["message"] = {"role": "assistant", "content": answer.text}
        else:
            choice["text"] = answer.text
        response: dict[str, Any] = {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(answer).model_dump(),
        }
        if job.rag:
            response["rag"] = _rag_usage(job, answer).model_dump()
        return JSONResponse(response)

    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"

    def chunk(
        delta: str | None, reason: str | None = None, role: bool = False, **extra: Any
    ) -> str:
        if kind == "chat.completion":
            content: dict[str, str] = {} if delta is None else {"content": delta}
            if role:
                content = {"role": "assistant", **content}
            choice = {"index": 0, "delta": content, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": reason}
        body_ = {"id": request_id, "object": chunk_kind, "created": created, "model": model}
        return f"data: {json.dumps({**body_, 'choices': [choice], **extra})}\n\n"

    async def events() -> AsyncIterator[str]:
        counted = False  # in an outcome: answered or failed (else, cut short: aborted)
        try:
            if kind == "chat.completion":
                yield chunk("", role=True)  # the first chunk names the role
            if first:
                yield chunk(first)
            async for piece in until_stopped(pieces, draining):  # (ServerStopping: below)
                yield chunk(piece)
            answer = stream.result
            assert answer is not None
            metrics.answered(answer)
            counted = True
            extra: dict[str, Any] = {"rag": _rag_usage(job, answer).model_dump()} if job.rag else {}
            yield chunk(None, finish_reason(answer), **extra)
            if body.stream_options is not None and body.stream_options.include_usage:
                usage = {"id": request_id, "object": chunk_kind, "created": created}
                usage |= {"model": model, "choices": [], "usage": _usage(answer).model_dump()}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
        except RagKVCacheError as e:  # after the first byte: the error travels in the stream
            status, code = _status_of(e)
            metrics.failed(status)
            counted = True
            failure = {"message": str(e), "type": "server_error", "code": code}
            yield f"data: {json.dumps({'error': failure})}\n\n"
        except Exception:  # a bug: the client still learns that its stream ended in error
            log.exception("request failed while streaming")
            metrics.failed(500)
            counted = True
            failure = {"message": INTERNAL, "type": "server_error", "code": None}
            yield f"data: {json.dumps({'error': failure})}\n\n"
        except (asyncio.CancelledError, GeneratorExit):  # the client left, or shutdown cut it
            if not counted:  # (not once answered, sending the last events)
                metrics.aborted()
            raise
        finally:
            await stream.aclose()  # a client that left: its request is aborted

    return StreamingResponse(events(), media_type="text/event-stream")


def _stream(
    engine: RagKVCache, body: Sampling, job: Job
) -> AsyncTokenStream[Answer] | FollowUpStream:
    """The engine's answer stream for `job` (its text tokenized here: in a worker thread)."""
    temperature, top_p, seed = body.temperature, body.top_p, body.seed
    if job.rag:

        def start(text: str) -> AsyncTokenStream[Answer]:
            return engine.astream(
                text,
                job.cache_ids,
                strategy=job.strategy,
                max_new_tokens=job.max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
            )

        return FollowUpStream(start, job) if job.earlier else start(job.text)
    return engine.astream_complete(
        job.text,
        max_new_tokens=job.max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        strip=not job.continuation,
    )


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _unless_gone(
    request: Request,
    work: Coroutine[Any, Any, T],
    stream: AsyncTokenStream[Answer] | FollowUpStream,
    draining: Draining,
) -> T:
    """`work`'s result, unless the client disconnects first: then ClientGone, and the stream's
    request is aborted (a client that gave up, waiting for room or for a whole answer, must
    not leave its request waiting or decoding for nobody); or unless the server is stopping
    and its deadline comes (`draining`): then ServerStopping, a 503, and aborted too."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            left = draining.left_s()
            if left is not None and left <= 0 and not task.done():  # (a done one is sent)
                raise ServerStopping("the server is shutting down: ask again")
            wait_s = DISCONNECT_POLL_S if left is None else min(left, DISCONNECT_POLL_S)
            done, _ = await asyncio.wait({task}, timeout=wait_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await stream.aclose()  # the engine's request is aborted


def _usage(answer: Answer) -> Usage:
    completion = len(answer.token_ids)
    return Usage(
        prompt_tokens=answer.prompt_tokens,
        completion_tokens=completion,
        total_tokens=answer.prompt_tokens + completion,
    )


def _rag_usage(job: Job, answer: Answer) -> RagUsage:
    return RagUsage(
        cache_ids=job.cache_ids,
        strategy=str(answer.strategy),
        context_tokens=answer.context_tokens,
        reused_tokens=answer.reused_tokens,
        recomputed_tokens=answer.recomputed_tokens,
        ttft_s=answer.ttft_s,
    )


def _check(engine: RagKVCache, model: str, body: Sampling, max_tokens: int | None) -> None:
    """The request's model is this server's, and its answer can fit the model's window."""
    if body.model is not None and body.model != model:
        message = f"this server serves the model {model!r}, not {body.model!r}"
        raise ApiError(404, message, "model_not_found")
    if max_tokens is not None and max_tokens >= engine.lm.max_context:
        message = f"max_tokens {max_tokens} leaves no room in the model's window of "
        raise ApiError(400, message + f"{engine.lm.max_context} tokens", "context_length_exceeded")


def _status_of(e: RagKVCacheError) -> tuple[int, str | None]:
    """The HTTP status and OpenAI error code of a library error."""
    if isinstance(e, UnknownCacheIdError):
        return 400, "unknown_cache_id"
    if isinstance(e, ContextTooLongError):
        return 400, "context_length_exceeded"
    if isinstance(e, FingerprintMismatchError | DtypeMismatchError):  # the store's state
        return 409, "model_mismatch"
    if isinstance(e, EngineClosedError):
        return 503, "engine_closed"
    if isinstance(e, ServerStopping):
        return 503, "server_shutting_down"
    if isinstance(e, StoreError):
        return 503, "store_unavailable"
    return 400, "invalid_request"


def _batch_state(engine: RagKVCache | None) -> tuple[BatchLoad, int]:
    """The engine loop's decoder as it last left it, and the KV budget (nothing before the
    model is loaded). Never waits on the engine: it is read on the event loop."""
    if engine is None:
        return BatchLoad(), 0
    return engine.batch_load(), engine.prefix_tree.budget_bytes


def _store_hits(engine: RagKVCache | None) -> dict[str, int]:
    """Chunk fetches per store tier, as the catalog counts them for every worker."""
    catalog = None if engine is None else engine.store.catalog
    if catalog is None:
        return {}
    counters = catalog.counters()
    return {k.removeprefix("hits:"): n for k, n in counters.items() if k.startswith("hits:")}
