"""The HTTP routes of `cartridge serve` (Starlette, run by uvicorn): OpenAI's /v1/models,
/v1/chat/completions and /v1/completions, with and without server-sent events, the same without /v1, and
mlx_lm.server's /health; CORS headers for the allowed origins (mlx_lm.server's --allowed-origins).

Every refusal is a JSON error body with a 4xx status; an unexpected failure is a 500 JSON body and the
server keeps serving.
"""

import asyncio
import contextlib
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .engine import Job
from .protocol import APIError, Sampling, parse_body, parse_chat, parse_completion
from .sampling import completion_logprobs

MAX_BODY = 16 << 20  # 16 MiB: far above any prompt that fits a context, far below what hurts the server
POLL_S = 0.25  # how often a waiting request checks that its client is still there


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def error_response(e):
    """The JSONResponse of an APIError."""
    return JSONResponse(e.body(), status_code=e.status)


async def read_body(request, limit):
    """The request body, refused past `limit` bytes without reading the rest into memory.

    Raises:
        APIError: 413 if the body (or its declared Content-Length) is larger than `limit`.
    """
    declared = request.headers.get("content-length", "")
    too_big = APIError(413, f"the request body is larger than {limit:,} bytes", code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def next_event(job, request, pending):
    """The job's next event, checking every POLL_S that the client is still connected.

    Args:
        pending (dict): holds the one queue read in flight across calls (a timed-out read is kept, not lost).

    Raises:
        ClientGone: the client disconnected (the job is cancelled).
    """
    while True:
        if "get" not in pending:
            pending["get"] = asyncio.ensure_future(job.events.get())
        task = pending["get"]
        done, _ = await asyncio.wait({task}, timeout=POLL_S)
        if done:
            del pending["get"]
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            job.cancel()
            raise ClientGone


class Answer:
    """Builds the OpenAI response objects of one request, chat or text completion.

    Args:
        request (protocol.Request). start (dict): the job's "start" event. model (str): the model id to
            report (the request's, or the base model's id when it named none).
    """

    def __init__(self, request, start, model):
        self.request, self.start, self.model = request, start, model
        self.chat = request.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text, self.tokens, self.logprobs = [], [], []
        self.sent_chars = 0  # text streamed so far (a completion's logprobs text_offset)

    def _head(self, obj):
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, entries, offset=0):
        if not self.request.sampling.logprobs:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        return completion_logprobs(entries, offset)

    def usage(self, completion_tokens):
        return {"prompt_tokens": self.start["prompt_tokens"], "completion_tokens": completion_tokens,
                "total_tokens": self.start["prompt_tokens"] + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.start["cached_tokens"]}}

    def _choice(self, text, tokens, finish, delta, logprobs=None):
        if not self.chat:
            body = {"text": text or ""}
        elif delta:
            body = {"delta": {} if text is None else {"content": text}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        choice = {"index": 0, **body, "logprobs": logprobs, "finish_reason": finish}
        if self.request.return_token_ids and tokens is not None:
            choice["token_ids"] = tokens
        return choice

    def final(self, done):
        """The whole (non-streamed) response."""
        text = "".join(self.text)
        out = self._head("chat.completion" if self.chat else "text_completion")
        out["choices"] = [self._choice(text, self.tokens, done["finish_reason"], False, self._logprobs(self.logprobs))]
        out["usage"] = self.usage(done["completion_tokens"])
        return out

    def chunk(self, text=None, tokens=None, finish=None, usage=None, role=False, logprobs=None):
        """One server-sent event's data, as a `data: ...` line pair."""
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        lp = self._logprobs([logprobs], self.sent_chars) if logprobs else None
        self.sent_chars += len(text or "")
        out["choices"] = [] if usage else [self._choice(text, tokens, finish, True, lp)]
        if role:
            out["choices"][0]["delta"]["role"] = "assistant"
        if usage:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"


class EventStream(StreamingResponse):
    """A StreamingResponse that cancels its job however it ends (finished, client gone, error)."""

    def __init__(self, body, job):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:  # uvicorn shutting down past its grace (SHUTDOWN_GRACE_S): the stream ends
            pass
        finally:
            self.job.cancel()


async def _stream(job, answer):
    if answer.chat:
        yield answer.chunk(text="", role=True)  # the role, first, as OpenAI does
    while True:
        kind, data = await job.events.get()
        if kind == "delta":
            if data["text"] or data["logprobs"] or (answer.request.return_token_ids and data["token"] is not None):
                yield answer.chunk(text=data["text"], tokens=None if data["token"] is None else [data["token"]],
                                   logprobs=data["logprobs"])
        elif kind == "done":
            yield answer.chunk(finish=data["finish_reason"])
            if answer.request.include_usage:
                yield answer.chunk(usage=answer.usage(data["completion_tokens"]))
            yield "data: [DONE]\n\n"
            return
        else:  # a failure after the first token: report it in the stream, as OpenAI's servers do
            yield f"data: {json.dumps(data['error'].body())}\n\n"
            return


async def _collect(job, request, answer, pending):
    while True:
        kind, data = await next_event(job, request, pending)
        if kind == "delta":
            answer.text.append(data["text"])
            if data["token"] is not None:
                answer.tokens.append(data["token"])
            if data["logprobs"]:
                answer.logprobs.append(data["logprobs"])
        elif kind == "done":
            return JSONResponse(answer.final(data))
        else:
            return error_response(data["error"])


def make_app(engine, max_body=MAX_BODY, defaults=None, allowed_origins=("*",)):
    """The Starlette app serving `engine`'s pool.

    Args:
        engine (Engine): the worker and its pool. max_body (int): largest request body in bytes. Default: 16 MiB.
        defaults (Sampling | None): sampling of a request that sets none (--temp, --top-p, --top-k, --min-p).
        allowed_origins (tuple[str]): origins a browser may call from ("*": any, mlx_lm.server's default; empty:
            no CORS headers). Default: ("*",).

    Returns:
        Starlette
    """
    defaults = defaults or Sampling()

    async def models(request):
        return JSONResponse({"object": "list", "data": engine.pool.models()})

    async def model(request):  # the openai client's models.retrieve
        name = request.path_params["name"]
        row = next((m for m in engine.pool.models() if m["id"] == name), None)
        if row is None:
            return error_response(APIError(404, f"the model {name!r} does not exist; GET /v1/models lists them",
                                           "model", "model_not_found"))
        return JSONResponse(row)

    async def stats(request):
        return JSONResponse(engine.stats())

    async def health(request):  # mlx_lm.server's
        return JSONResponse({"status": "ok" if engine.healthy else "unavailable"}, 200 if engine.healthy else 503)

    async def answer(request, parse):
        try:
            req = parse(parse_body(await read_body(request, max_body)), defaults)
        except APIError as e:
            engine.note_rejected()
            return error_response(e)
        job = Job(req, asyncio.get_running_loop())
        engine.submit(job)
        pending, streaming = {}, False
        try:
            kind, data = await next_event(job, request, pending)
            if kind == "error":
                return error_response(data["error"])
            out = Answer(req, data, req.model or engine.pool.base_id)
            if req.stream:
                streaming = True  # from here the EventStream cancels the job when it ends
                return EventStream(_stream(job, out), job)
            return await _collect(job, request, out, pending)
        except ClientGone:
            return JSONResponse({}, status_code=499)
        finally:
            if not streaming:
                job.cancel()  # a no-op once answered; frees the queue if this handler failed

    async def chat(request):
        return await answer(request, parse_chat)

    async def completions(request):
        return await answer(request, parse_completion)

    async def http_error(request, exc):
        return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    async def server_error(request, exc):
        return error_response(APIError(500, f"{type(exc).__name__}: {exc}", type="server_error"))

    routes = [Route("/health", health, methods=["GET"]), Route("/stats", stats, methods=["GET"])]
    for root in ("/v1", ""):  # mlx_lm.server also answers /chat/completions; the others alike, for clients without /v1
        routes += [Route(f"{root}/models", models, methods=["GET"]),
                   Route(f"{root}/models/{{name:path}}", model, methods=["GET"]),
                   Route(f"{root}/chat/completions", chat, methods=["POST"]),
                   Route(f"{root}/completions", completions, methods=["POST"])]
    cors = [Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                       allow_headers=["*"])] if allowed_origins else []

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    return Starlette(routes=routes, middleware=cors, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: server_error})
