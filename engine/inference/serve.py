"""A small OpenAI-compatible completions endpoint over an InferenceEngine: `POST /v1/completions`.

Built by `serve_cli.py` (`deepfleet serve CHECKPOINT`) and by tests (`create_app(engine, ...)`).
Every request joins the engine's continuous batch: one background task steps the engine (in a worker
thread, under a lock shared with submission, since the batcher is not thread-safe) while any request
is in flight, and hands each request its tokens through its own queue; `"stream": true` sends them as
server-sent events (`data: {...}` chunks, then `data: [DONE]`), as OpenAI's API does.

API keys: with `api_keys` (`deepfleet serve` and serving jobs take them from DEEPFLEET_SERVE_API_KEY,
comma-separated so a key can be rotated), every `/v1/...` request must send `Authorization: Bearer
<key>` with one of them, as OpenAI clients do (`api_key=`); anything else gets 401 with OpenAI's error
body (`code: "invalid_api_key"`). Keys are compared in constant time and never logged. Without keys
the endpoint is open: `deepfleet serve` binds 127.0.0.1 by default.

Prompts are a string or a list of token ids (OpenAI accepts both). Strings need a tokenizer: a
Hugging Face tokenizer when one is given, else UTF-8 bytes as token ids when the vocabulary has 256
ids or more (the example GPT's), else the request is refused. Bad requests get HTTP 400 with
OpenAI's error body `{"error": {"message", "type", "param"}}`, the message one line naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from deepfleet.engine.inference.engine import InferenceEngine
from deepfleet.engine.inference.sampling import Sampling


class CompletionRequest(BaseModel):
    """The fields of OpenAI's completions request that are implemented; any other field is a 400."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    seed: int | None = None
    user: str | None = None


class Tokens:
    """Text <-> token ids: a Hugging Face tokenizer, or UTF-8 bytes (vocabulary >= 256)."""

    def __init__(self, tokenizer: Any = None, *, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos = getattr(tokenizer, "eos_token_id", None)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return list(self.tokenizer.encode(text))
        if self.vocab_size < 256:
            raise ValueError("prompt: this model has no tokenizer and fewer than 256 token ids; send token ids")
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}})


class _Loop:
    """Steps the engine while requests are in flight; one queue of (token, finish_reason) per request."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine, self.lock = engine, threading.Lock()
        self.queues: dict[int, asyncio.Queue] = {}
        self.wake = asyncio.Event()

    def submit(self, prompt: list[int], body: CompletionRequest, eos: Any) -> tuple[Any, asyncio.Queue]:
        sampling = Sampling(do_sample=body.temperature > 0, temperature=body.temperature or 1.0, top_k=0,
                            top_p=body.top_p)
        generator = None if body.seed is None else torch.Generator().manual_seed(body.seed)
        with self.lock:
            request = self.engine.submit(prompt, max_new_tokens=body.max_tokens, sampling=sampling,
                                         eos_token_id=eos, generator=generator)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request.id] = queue
        self.wake.set()
        return request, queue

    def _step(self) -> list:
        with self.lock:
            return [(r, t, r.finish_reason) for r, t in self.engine.step()]

    def cancel(self, request: Any) -> None:
        with self.lock:
            self.engine.batcher.cancel(request)
        self.queues.pop(request.id, None)

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while not self.engine.batcher.idle:
                for request, token, finish in await asyncio.to_thread(self._step):
                    queue = self.queues.get(request.id)
                    if queue is not None:
                        queue.put_nowait((token, finish))
                        if finish is not None:
                            self.queues.pop(request.id, None)


API_KEY_ENV = "DEEPFLEET_SERVE_API_KEY"


def api_keys_from(value: str | None) -> tuple[str, ...]:
    """The keys in a DEEPFLEET_SERVE_API_KEY value: comma-separated, blanks dropped."""
    return tuple(k.strip() for k in (value or "").split(",") if k.strip())


def create_app(engine: InferenceEngine, *, model_name: str = "deepfleet", tokenizer: Any = None,
               api_keys: Collection[str] = ()) -> FastAPI:
    """The FastAPI app serving `engine` (see the module docstring)."""
    tokens = Tokens(tokenizer, vocab_size=engine.module.spec.vocab_size)
    keys = [k.encode() for k in api_keys]
    loop = _Loop(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.wake = asyncio.Event()
        task = asyncio.create_task(loop.run())
        yield
        task.cancel()

    app = FastAPI(title="deepfleet inference", lifespan=lifespan)

    if keys:
        @app.middleware("http")
        async def _authorize(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            if request.url.path.startswith("/v1/"):
                scheme, _, given = request.headers.get("authorization", "").partition(" ")
                sent = given.strip().encode()
                # every key compared, whatever matches first: the time says nothing about which
                ok = scheme.lower() == "bearer" and sum(hmac.compare_digest(sent, k) for k in keys) > 0
                if not ok:
                    message = ("Authorization: missing or wrong API key; send 'Authorization: Bearer <key>' "
                               "with a key this endpoint was started with")
                    return JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"}, content={
                        "error": {"message": message, "type": "invalid_request_error", "param": None,
                                  "code": "invalid_api_key"}})
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            return _error(400, "body: is not valid JSON; send a JSON object", None)
        loc = [str(p) for p in err["loc"] if p != "body"]
        field = ".".join(loc[:1]) or "body"
        msg = "is not supported by this server" if err["type"] == "extra_forbidden" else err["msg"]
        return _error(400, f"{field}: {msg}", field)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "deepfleet"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> Any:
        if body.model is not None and body.model != model_name:
            return _error(404, f"model: {body.model!r} is not served here; use {model_name!r}", "model")
        try:
            prompt = tokens.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
            request, queue = loop.submit(prompt, body, tokens.eos)
        except ValueError as e:
            message = str(e).replace("max_new_tokens:", "max_tokens:", 1)  # the engine's name -> OpenAI's
            return _error(400, message, message.split(":", 1)[0])
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex[:24]}"

        def body_of(text: str, finish: str | None, usage: dict | None = None) -> dict:
            out = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                   "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
            if usage is not None:
                out["usage"] = usage
            return out

        def usage() -> dict:
            return {"prompt_tokens": len(prompt), "completion_tokens": len(request.tokens),
                    "total_tokens": len(prompt) + len(request.tokens)}

        if not body.stream:
            finish = None
            while finish is None:
                _, finish = await queue.get()
            return body_of(tokens.decode(request.tokens), finish, usage())

        async def events() -> AsyncIterator[str]:
            sent, finish = "", None
            try:
                while finish is None:
                    _, finish = await queue.get()
                    text = tokens.decode(request.tokens)
                    yield f"data: {json.dumps(body_of(text[len(sent):], finish))}\n\n"
                    sent = text
                yield "data: [DONE]\n\n"
            finally:
                if finish is None:  # the client went away: free the slot
                    loop.cancel(request)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
