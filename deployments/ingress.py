"""OpenAI-compatible HTTP ingress: /v1/completions, /v1/chat/completions, /v1/models, /healthz, /readyz.

Validates requests (OpenAI-style JSON errors with the right status), tokenizes, and sends each
request to the engine group with the fewest requests in flight. Streams as server-sent events the
way the openai python client expects: one chunk per accepted piece of text, then `data: [DONE]`.
A Router replica dying mid-request does not end the stream: the request goes again to the group with
the tokens already received as context (`RouterStream`). `drain()` stops admitting for a shutdown.
"""


import asyncio
import json
import logging
import os
import time
import uuid
import weakref
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from serve_app.models import load_tokenizer
from serve_app.prompts import encode_prompt

app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding server")
log = logging.getLogger("ray.serve")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 429: "rate_limit_error", 503: "service_unavailable"}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after or (1 if status in (429, 503) else None)


@app.exception_handler(APIError)
async def _api_error(request: Request, e: APIError):
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return error_response(e.status, e.message, e.param, e.code, headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return error_response(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}", code="invalid_json")
    loc = [str(x) for x in err["loc"] if x not in ("body", "query")]
    param = ".".join(loc) or None
    return error_response(400, f"{param}: {err['msg']}" if param else err["msg"], param, "invalid_value")


def request_id(request: Request) -> str:
    """The request's id: Serve's proxy echoes a client's X-Request-Id (or makes one) on the response."""
    return request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex[:16]}"


def _error_event(message: str) -> dict:
    return {"error": message, "text": "", "token_ids": [], "finished": True, "finish_reason": None, "status": 503}


class RouterStream:
    """One request's events from its engine group, surviving the death of the Router replica serving it.

    The ingress knows what it already received: on a failure it sends the request to the group again
    (Serve routes it to a live replica, or holds it until the replacement is up) with the tokens
    received so far and how much of their text the client has, so the new replica's engine continues
    the request where it stopped (greedy: token for token; text held back there for a partial
    character or stop string is released by the new one). A submission failing before its first
    event is retried until `wait_s` has passed; after `max_resubmits` resumes the request ends with 503.
    """

    def __init__(self, handle, ids: list[int], params: dict, rid: str, stream: bool,
                 max_resubmits: int = 2, wait_s: float = 120.0):
        self.handle, self.ids, self.params, self.rid, self.stream = handle, ids, params, rid, stream
        self.max_resubmits, self.wait_s = max_resubmits, wait_s
        self.received: list[int] = []
        self.sent_chars = 0  # characters of text the client has been given
        self.resubmits = 0
        self.events = None
        self._got_event = False

    def start(self) -> None:
        resume = {"output_ids": self.received, "sent_chars": self.sent_chars} if self.received else None
        self._got_event = False
        self.events = self.handle.options(stream=True).generate.remote(self.ids, self.params, self.rid, self.stream, resume)

    def cancel(self) -> None:
        if self.events is not None:
            self.events.cancel()  # the router aborts the request: frees its queue place or batch slot and KV

    async def next(self) -> dict:
        """The next event; a router that is gone for good becomes an error event, not a hang."""
        deadline = None
        while True:
            try:
                ev = await self.events.__anext__()
            except StopAsyncIteration:
                return _error_event("engine stream ended early")
            except Exception as e:  # the Router replica died (or is unreachable)
                if self._got_event:
                    self.resubmits += 1
                    if self.resubmits > self.max_resubmits:
                        return _error_event(f"the request failed {self.resubmits} times because an engine "
                                            "replica crashed; giving up (retry later)")
                    deadline = None
                deadline = deadline or time.monotonic() + self.wait_s
                if time.monotonic() > deadline:
                    return _error_event("no engine replica of this group is available; retry later")
                log.warning("request %s: engine replica failed (%s); resubmitting with %d tokens received",
                            self.rid, type(e).__name__, len(self.received))
                await asyncio.sleep(0.5)
                self.start()
                continue
            self._got_event = True
            self.received += ev.get("token_ids", [])
            self.sent_chars += len(ev.get("text", ""))
            return ev


class _GroupLease:
    """One request's place in its engine group's in-flight count (what `_pick_group` balances on),
    and the router request behind it.

    `end` gives both back exactly once, whichever path gets there first: the handler (unstreamed
    answers, refusals, a client gone while it waited), the SSE generator's `finally` (normal end,
    error event, client gone mid-stream), or the finalizer of an SSE generator collected without
    ever having started: its `finally` then never runs (the client left before the body began, or
    the response was discarded), and without the finalizer the count would stay high for good and
    the router would go on generating for nobody.

    Every `end` runs on the ingress's event-loop thread (the finalizer hops there), so the flag and
    the count need no lock.
    """

    def __init__(self, in_flight: dict[str, int], group: str):
        self.in_flight, self.group = in_flight, group
        self.upstream: RouterStream | None = None  # the router's event stream, once asked for
        self.ended = False
        in_flight[group] += 1

    def end(self, finished: bool) -> None:
        """finished: the router's stream is over (or never began), so there is nothing to cancel."""
        if self.ended:
            return
        self.ended = True
        self.in_flight[self.group] -= 1
        if not finished and self.upstream is not None:
            self.upstream.cancel()

    def end_with(self, stream) -> None:
        """Hand the lease to an SSE generator: its `finally` ends it once started; if it is collected
        without ever starting, this finalizer does."""
        loop = asyncio.get_running_loop()

        def collected():  # the collector may run in any thread; `end` belongs on the loop
            try:
                loop.call_soon_threadsafe(self.end, False)
            except RuntimeError:  # loop closed: the replica is going away, and its counts with it
                pass

        weakref.finalize(stream, collected).atexit = False  # at interpreter exit there is nothing to free


class SamplingFields(BaseModel):
    """Request fields shared by completions and chat completions (unknown OpenAI fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, routers: list, groups: list[str], target: str, served_model_name: str,
                 max_tokens_limit: int, max_stop_strings: int, max_resubmits: int = 2, resubmit_wait_s: float = 120.0):
        self.routers = dict(zip(groups, routers))
        self.max_resubmits, self.resubmit_wait_s = max_resubmits, resubmit_wait_s
        self.draining = False
        self.in_flight = {g: 0 for g in groups}
        self.tokenizer = load_tokenizer(target)
        self.model_name = served_model_name
        self.max_tokens_limit, self.max_stop_strings = max_tokens_limit, max_stop_strings
        self.api_key = os.environ.get("SPECSERVE_API_KEY") or None
        self.created = int(time.time())

    # ---- endpoints ---------------------------------------------------------------------------
    @app.get("/healthz")
    async def healthz(self):
        """Liveness: this ingress answers. Whether requests can be served: /readyz."""
        return {"status": "ok", "groups": list(self.routers)}

    @app.get("/readyz")
    async def readyz(self):
        """Readiness: 200 once every engine group can serve (its models loaded, no worker being
        replaced), 503 before that and while draining for a shutdown."""
        async def group_ready(name: str) -> dict:
            try:
                return await asyncio.wait_for(self.routers[name].ready.remote(), timeout=5)
            except Exception as e:  # no replica yet, or it is not answering
                return {"ready": False, "reason": f"engine group not reachable ({type(e).__name__})"}

        groups = dict(zip(self.routers, await asyncio.gather(*(group_ready(g) for g in self.routers))))
        ready = not self.draining and all(g["ready"] for g in groups.values())
        body = {"status": "ready" if ready else ("draining" if self.draining else "not ready"), "groups": groups}
        return JSONResponse(body, status_code=200 if ready else 503)

    def drain(self) -> int:
        """Stop admitting new requests (503 + Retry-After, readiness false); returns requests in flight."""
        self.draining = True
        return self.in_flight_total()

    def in_flight_total(self) -> int:
        return sum(self.in_flight.values())

    def pid(self) -> int:
        return os.getpid()

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._auth(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specserve"}]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._auth(request)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "prompt: send one prompt per request (a list of exactly one string)", "prompt")
            prompt = prompt[0]
        ids = self._encode(prompt=prompt)
        return await self._respond(request, body, ids, body.max_tokens or 16, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatRequest, request: Request):
        self._auth(request)
        ids = self._encode(messages=[m.model_dump() for m in body.messages])
        return await self._respond(request, body, ids, body.max_completion_tokens or body.max_tokens or 256, chat=True)

    # ---- helpers -----------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")

    def _encode(self, prompt=None, messages=None) -> list[int]:
        try:
            return encode_prompt(self.tokenizer, prompt, messages)
        except ValueError as e:
            raise APIError(400, str(e), "messages" if messages is not None else "prompt", "invalid_value") from None

    def _params(self, body: SamplingFields, max_tokens: int) -> dict:
        if body.model != self.model_name:
            raise APIError(400, f"model '{body.model}' is not served here; available: {self.model_name}", "model", "model_not_found")
        if body.n != 1:
            raise APIError(400, "n: only n=1 is supported", "n", "invalid_value")
        if body.logprobs:
            raise APIError(400, "logprobs: not supported", "logprobs", "invalid_value")
        if max_tokens > self.max_tokens_limit:
            raise APIError(400, f"max_tokens: {max_tokens} is over this server's limit of {self.max_tokens_limit}", "max_tokens", "invalid_value")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > self.max_stop_strings or any(not s for s in stop):
            raise APIError(400, f"stop: at most {self.max_stop_strings} non-empty stop strings", "stop", "invalid_value")
        return {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                "top_k": max(body.top_k, 0), "seed": body.seed, "stop": stop}

    def _pick_group(self) -> str:
        return min(self.in_flight, key=self.in_flight.get)

    async def _respond(self, request: Request, body: SamplingFields, ids: list[int], max_tokens: int, chat: bool):
        params = self._params(body, max_tokens)
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance", code="draining", retry_after=5)
        rid = request_id(request)
        group = self._pick_group()
        lease = _GroupLease(self.in_flight, group)
        stream = None  # once set, the SSE generator owns the lease
        try:
            events = lease.upstream = RouterStream(self.routers[group], ids, params, rid, body.stream,
                                                   self.max_resubmits, self.resubmit_wait_s)
            events.start()
            first = await events.next()
            if "error" in first:
                status = first["status"]
                code = {400: "invalid_value", 503: "engine_unavailable"}.get(status)
                raise APIError(status, first["error"], code=code, retry_after=first.get("retry_after"))
            meta = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "created": int(time.time()), "model": self.model_name}
            if not body.stream:
                return await self._collect(first, events, meta, len(ids), chat)
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            stream = self._sse(first, events, meta, len(ids), chat, include_usage, lease)
            lease.end_with(stream)
            return StreamingResponse(stream, media_type="text/event-stream")
        except asyncio.CancelledError:  # the client left while this handler waited on the engine
            lease.end(finished=False)
            raise
        finally:
            if stream is None:  # answered or refused here: the router's stream is over (or never began)
                lease.end(finished=True)

    async def _collect(self, first: dict, events, meta: dict, n_prompt: int, chat: bool):
        text, n_out, ev = [first["text"]], len(first["token_ids"]), first
        while not ev["finished"]:
            ev = await events.next()
            text.append(ev["text"])
            n_out += len(ev["token_ids"])
        if ev.get("error"):
            raise APIError(503, ev["error"], code="engine_error")
        content = "".join(text)
        choice = {"index": 0, "finish_reason": ev["finish_reason"]}
        choice.update({"message": {"role": "assistant", "content": content}} if chat else {"text": content, "logprobs": None})
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}

    async def _sse(self, first: dict, events, meta: dict, n_prompt: int, chat: bool, include_usage: bool,
                   lease: _GroupLease):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice]})}\n\n"

        n_out, finished = 0, False
        try:
            if chat:
                yield chunk("", None, role=True)
            ev = first
            while True:
                n_out += len(ev["token_ids"])
                if ev.get("error"):
                    err = {"message": ev["error"], "type": ERROR_TYPES[503], "param": None, "code": "engine_error"}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    return
                if ev["text"]:
                    yield chunk(ev["text"], None)
                if ev["finished"]:
                    finished = True
                    yield chunk(None if chat else "", ev["finish_reason"])
                    break
                ev = await events.next()
            if include_usage:
                usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
                yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            # Not finished: the client left mid-stream (or an error event ended it), so cancel the
            # router request. A generator that never started never gets here: see `_GroupLease`.
            lease.end(finished)
