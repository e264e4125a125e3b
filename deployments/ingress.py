"""OpenAI-compatible HTTP ingress: /v1/completions, /v1/chat/completions, /v1/models, /healthz, /readyz.

Validates requests (OpenAI-style JSON errors with the right status), tokenizes, and sends each
request to the engine group with the fewest requests in flight. Streams as server-sent events the
way the openai python client expects: one chunk per accepted piece of text, then `data: [DONE]`.
A Router replica dying mid-request does not end the stream: the request goes again to the group with
the tokens already received as context (`RouterStream`). `drain()` stops admitting for a shutdown.
"""


import asyncio
import hmac
import json
import logging
import os
import time
import uuid
import weakref
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from serve_app.models import load_tokenizer
from serve_app.prompts import check_text, encode_prompt

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


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException):
    """FastAPI's own refusals (a body it cannot parse, an unknown path or method) in OpenAI's shape too."""
    return error_response(e.status_code, str(e.detail), code={404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request"),
                          headers=getattr(e, "headers", None))


@app.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception):
    """A bug, not the client's fault: an OpenAI-style 500 that says nothing internal (the log has it)."""
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(500, "internal error; the server log has the details", code="internal_error")


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
                 max_resubmits: int = 2, wait_s: float = 120.0, reroute=None):
        self.handle, self.ids, self.params, self.rid, self.stream = handle, ids, params, rid, stream
        # reroute(): the (handle, is_down) of the group to use now - another one when this group is down
        # (its nodes gone): resubmissions go there, and a request waiting for its first event moves.
        self.reroute = reroute
        self.group_down = lambda: False
        if reroute is not None:
            self.handle, self.group_down = reroute()
        self.max_resubmits, self.wait_s = max_resubmits, wait_s
        self.received: list[int] = []
        self.sent_chars = 0  # characters of text the client has been given
        self.resubmits = 0
        self.events = None
        self.finished = False  # the last event ended the request (nothing left to cancel)
        self._got_event = False

    def start(self) -> None:
        resume = {"output_ids": self.received, "sent_chars": self.sent_chars} if self.received else None
        self._got_event = False
        self.events = self.handle.options(stream=True).generate.remote(self.ids, self.params, self.rid, self.stream, resume)
        self._pending = None

    async def _event(self) -> dict:
        """The stream's next event. While it waits for its first one, it watches its group: a group
        marked down (no replica reachable) would hold the request in Serve's queue for a replica that
        never comes, so the request moves to the group `reroute` gives now."""
        while not self._got_event and self.reroute is not None:
            if self._pending is None:
                self._pending = asyncio.ensure_future(self.events.__anext__())
            done, _ = await asyncio.wait({self._pending}, timeout=1.0)
            if done:
                task, self._pending = self._pending, None
                return task.result()
            if self.group_down():
                handle, down = self.reroute()
                if handle is not self.handle:
                    log.warning("request %s: its engine group is down; moving it to another group", self.rid)
                    self.cancel()
                    self.handle, self.group_down = handle, down
                    self.start()
        return await self.events.__anext__()

    def cancel(self) -> None:
        if getattr(self, "_pending", None) is not None:
            self._pending.cancel()  # a first event still awaited (see _event)
            self._pending = None
        if self.events is not None:
            self.events.cancel()  # the router aborts the request: frees its queue place or batch slot and KV

    def _end(self, message: str) -> dict:
        """The request is over without an answer: an error event, and nothing left to cancel."""
        self.finished = True
        return _error_event(message)

    async def next(self) -> dict:
        """The next event; a router that is gone for good becomes an error event, not a hang."""
        deadline = None
        while True:
            try:
                ev = await self._event()
            except StopAsyncIteration:
                return self._end("engine stream ended early")
            except Exception as e:  # the Router replica died (or is unreachable)
                if self._got_event:
                    self.resubmits += 1
                    if self.resubmits > self.max_resubmits:
                        return self._end(f"the request failed {self.resubmits} times because an engine "
                                            "replica crashed; giving up (retry later)")
                    deadline = None
                deadline = deadline or time.monotonic() + self.wait_s
                if time.monotonic() > deadline:
                    return self._end("no engine replica of this group is available; retry later")
                log.warning("request %s: engine replica failed (%s); resubmitting with %d tokens received",
                            self.rid, type(e).__name__, len(self.received))
                await asyncio.sleep(0.5)
                if self.reroute is not None:  # the same group while it is up, else a live one
                    self.handle, self.group_down = self.reroute()
                self.start()
                continue
            self._got_event = True
            self.received += ev.get("token_ids", [])
            self.sent_chars += len(ev.get("text", ""))
            self.finished = bool(ev.get("finished")) or "error" in ev
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

    def __init__(self, in_flight: dict[str, int], group: str, ingress=None):
        self.in_flight, self.group, self.ingress = in_flight, group, ingress
        self.upstream: RouterStream | None = None  # the router's event stream, once asked for
        self.ended = False
        in_flight[group] += 1

    def reroute(self):
        """(handle, is_down) of the group this request should use now: its own while that group is
        up, else the least loaded live one (the request's place in the counts moves with it)."""
        ing = self.ingress
        if self.group in ing.down and not self.ended:
            group = ing._pick_group()
            if group != self.group:
                self.in_flight[self.group] -= 1
                self.in_flight[group] += 1
                self.group = group
        return ing.routers[self.group], (lambda g=self.group: g in ing.down)

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
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    logprobs: bool | int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    """A string, several strings (one choice each), token ids, or several lists of token ids."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_calls, tool_call_id, ...

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


# (name, type, help, how to read it from a snapshot: counter/gauge key)
_SERIES = [
    ("specserve_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", ("counters", "prompt_tokens")),
    ("specserve_generated_tokens_total", "counter", "Tokens generated.", ("counters", "generated_tokens")),
    ("specserve_proposed_tokens_total", "counter", "Draft tokens proposed.", ("counters", "draft_tokens")),
    ("specserve_accepted_tokens_total", "counter", "Draft tokens accepted.", ("counters", "accepted_tokens")),
    ("specserve_batch_size", "gauge", "Sequences in the last engine step.", ("gauges", "batch_size")),
    ("specserve_speculation_k", "gauge", "Speculation length chosen for the last step.", ("gauges", "k")),
    ("specserve_queue_depth", "gauge", "Requests waiting for admission.", ("gauges", "waiting")),
    ("specserve_acceptance_estimate", "gauge", "Live per-token draft acceptance estimate.", ("gauges", "acceptance_estimate")),
    ("vllm:num_requests_running", "gauge", "Requests admitted: decoding or prefilling.", ("gauges", "running")),
    ("vllm:kv_cache_usage_perc", "gauge", "KV pool share counted for admitted requests (0-1; shared prefix blocks counted per holder).", ("gauges", "kv_usage")),
    ("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache (whole blocks).", ("counters", "prefix_queries")),
    ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", ("counters", "prefix_hits")),
    ("vllm:num_preemptions_total", "counter", "Requests sent back to the queue because the KV pool ran short.", ("counters", "preemptions")),
    ("vllm:num_requests_waiting", "gauge", "Requests waiting for admission.", ("gauges", "waiting")),
    ("vllm:prompt_tokens_total", "counter", "Prompt tokens of finished requests.", ("counters", "prompt_tokens")),
    ("vllm:generation_tokens_total", "counter", "Tokens generated.", ("counters", "generated_tokens")),
    ("vllm:spec_decode_num_drafts_total", "counter", "Draft proposals (one per sequence per step with k > 0).", ("counters", "drafts")),
    ("vllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", ("counters", "draft_tokens")),
    ("vllm:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", ("counters", "accepted_tokens")),
]


def _usage(n_prompt: int, n_out: int, cached: int) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens whose KV came from the prefix cache (the
    prompt is shared by a request's choices: the largest of theirs)."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": cached}}


def render_metrics(snapshots: dict[str, dict], model_name: str) -> str:
    """Prometheus text exposition of the Router replicas' snapshots (labels: model_name, group,
    gpu_type, replica)."""
    def labels(replica: str, snap: dict, **extra) -> str:
        pairs = {"model_name": model_name, "group": snap["group"], "gpu_type": snap["gpu_type"], "replica": replica, **extra}
        return ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                        for k, v in pairs.items())

    lines = []
    for name, kind, help_text, (part, key) in _SERIES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{{{labels(r, s)}}} {float(s[part][key])}" for r, s in snapshots.items()]
    name = "specserve_requests_total"
    lines += [f"# HELP {name} Finished requests by status.", f"# TYPE {name} counter"]
    lines += [f"{name}{{{labels(r, s, status=st)}}} {float(n)}"
              for r, s in snapshots.items() for st, n in sorted(s["counters"]["requests"].items())]
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    lines += [f"# HELP {name} Draft tokens accepted, by position in the draft.", f"# TYPE {name} counter"]
    lines += [f"{name}{{{labels(r, s, position=i)}}} {float(n)}"
              for r, s in snapshots.items() for i, n in enumerate(s["counters"]["accepted_per_position"])]
    name = "specserve_profile_info"
    lines += [f"# HELP {name} 1 for the kind of profile a replica steers by (measured, predicted, none), 0 for the others.",
              f"# TYPE {name} gauge"]
    lines += [f"{name}{{{labels(r, s, source=src, version=s['profile']['version'])}}} {float(src == s['profile']['source'])}"
              for r, s in snapshots.items() if "profile" in s for src in ("measured", "predicted", "none")]
    return "\n".join(lines) + "\n"


MAX_CHOICES = 16
"""Most choices one request may ask for (prompts x n): each is a sequence in the batch."""


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, routers: list, groups: list[str], target: str, served_model_name: str,
                 max_tokens_limit: int, max_stop_strings: int, max_resubmits: int = 2, resubmit_wait_s: float = 120.0,
                 store=None, group_replicas: list[int] | None = None):
        self.routers = dict(zip(groups, routers))
        self.replicas = dict(zip(groups, group_replicas or [1] * len(groups)))  # Router replicas per group
        self.down: set[str] = set()  # groups no Router replica answers for (their nodes gone): see _watch_groups
        self._watcher = None
        self.store = store  # the ProfileStore, where Router replicas leave their counters (/metrics)
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
        """Readiness: 200 once every live engine group can serve (its models loaded, no worker being
        replaced), 503 before that, while draining for a shutdown, and when no group is live. A group
        marked down (no replica answering: its nodes are gone) does not hold the others back."""
        self._watch()
        async def group_ready(name: str) -> dict:
            try:
                return await asyncio.wait_for(self.routers[name].ready.remote(), timeout=5)
            except Exception as e:  # no replica yet, or it is not answering
                return {"ready": False, "reason": f"engine group not reachable ({type(e).__name__})"}

        groups = dict(zip(self.routers, await asyncio.gather(*(group_ready(g) for g in self.routers))))
        live = [body for g, body in groups.items() if g not in self.down]
        for g in self.down:
            groups[g] = {**groups[g], "down": True}
        ready = not self.draining and bool(live) and all(g["ready"] for g in live)
        body = {"status": "ready" if ready else ("draining" if self.draining else "not ready"), "groups": groups}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def drain(self) -> int:
        """Stop admitting new requests (503 + Retry-After, readiness false); returns requests in flight."""
        self.draining = True  # async: runs on the loop that owns the counts, like the handlers
        return sum(self.in_flight.values())

    async def in_flight_total(self) -> int:
        return sum(self.in_flight.values())

    async def pid(self) -> int:
        return os.getpid()

    @app.get("/metrics")
    async def metrics(self):
        """Prometheus text on the API port: every Router replica's counters and gauges, as of its last
        report (every `profile_poll_s`), including speculative decoding under vLLM's series names."""
        snapshots = await self.store.metrics.remote() if self.store is not None else {}
        return PlainTextResponse(render_metrics(snapshots, self.model_name), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._auth(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specserve"}]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._auth(request)
        return await self._respond(request, body, self._completion_prompts(body.prompt), body.max_tokens or 16, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatRequest, request: Request):
        self._auth(request)
        ids = self._encode(messages=[m.model_dump() for m in body.messages])
        return await self._respond(request, body, [ids], body.max_completion_tokens or body.max_tokens or 256, chat=True)

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest, request: Request):
        self._auth(request)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", code="invalid_value")
        if body.messages is not None:
            ids = self._encode(messages=[m.model_dump() for m in body.messages])
        else:
            try:
                ids = self.tokenizer.encode(check_text(body.prompt, "prompt"), add_special_tokens=body.add_special_tokens)
            except ValueError as e:
                raise APIError(400, str(e), "prompt", "invalid_value") from None
        return {"count": len(ids), "max_model_len": await self._max_model_len(), "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest, request: Request):
        self._auth(request)
        self._check_model(body.model)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens: ids must be in [0, {vocab})", "tokens", "invalid_value")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    # ---- helpers -----------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        # constant time: how long the comparison takes says nothing about how much of the key matched
        if self.api_key and not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(400, f"model '{model}' is not served here; available: {self.model_name}", "model", "model_not_found")

    async def _max_model_len(self) -> int | None:
        if not hasattr(self, "_model_len"):
            try:  # every group serves the same target; ask one
                self._model_len = await self.routers[next(iter(self.routers))].max_model_len.remote()
            except Exception:
                return None
        return self._model_len

    def _encode(self, prompt=None, messages=None) -> list[int]:
        try:
            return encode_prompt(self.tokenizer, prompt, messages)
        except ValueError as e:
            raise APIError(400, str(e), "messages" if messages is not None else "prompt", "invalid_value") from None

    def _completion_prompts(self, prompt) -> list[list[int]]:
        """One list of token ids per prompt: a string, strings, token ids, or lists of token ids."""
        if isinstance(prompt, str):
            return [self._encode(prompt=prompt)]
        if not prompt:
            raise APIError(400, "prompt: an empty list", "prompt", "invalid_value")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], str):
            return [self._encode(prompt=p) for p in prompt]
        if any(not ids for ids in prompt):
            raise APIError(400, "prompt: an empty list of token ids", "prompt", "invalid_value")
        return [list(ids) for ids in prompt]

    def _logprobs(self, body: SamplingFields) -> int | None:
        """How many alternatives per token to return log-probabilities for (None: no log-probabilities).
        Chat: `logprobs: true` + `top_logprobs`; completions: `logprobs: N`."""
        if isinstance(body, ChatRequest):
            if body.top_logprobs is not None and not body.logprobs:
                raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs", "invalid_value")
            return (body.top_logprobs or 0) if body.logprobs else None
        if body.logprobs is None or body.logprobs is False:
            return None
        if not 0 <= int(body.logprobs) <= 20:
            raise APIError(400, "logprobs: an integer from 0 to 20", "logprobs", "invalid_value")
        return int(body.logprobs)

    def _params(self, body: SamplingFields, max_tokens: int) -> dict:
        self._check_model(body.model)
        logprobs = self._logprobs(body)
        if max_tokens > self.max_tokens_limit:
            raise APIError(400, f"max_tokens: {max_tokens} is over this server's limit of {self.max_tokens_limit}", "max_tokens", "invalid_value")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > self.max_stop_strings or any(not s for s in stop):
            raise APIError(400, f"stop: at most {self.max_stop_strings} non-empty stop strings", "stop", "invalid_value")
        try:
            for s in stop:
                check_text(s, "stop")
        except ValueError as e:
            raise APIError(400, str(e), "stop", "invalid_value") from None
        return {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                "top_k": max(body.top_k, 0), "seed": body.seed, "stop": stop, "logprobs": logprobs}

    def _token(self, tid: int) -> dict:
        text = self.tokenizer.decode([tid])
        return {"token": text, "bytes": list(text.encode("utf-8", "surrogatepass"))}

    def _format_logprobs(self, ids: list[int], lps: list | None, chat: bool, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object: chat {"content": [...]}, completions {tokens, token_logprobs, ...}."""
        if lps is None:
            return None
        if chat:
            return {"content": [{**self._token(t), "logprob": lp,
                                 "top_logprobs": [{**self._token(a), "logprob": alp} for a, alp in alts]}
                                for t, (lp, alts) in zip(ids, lps)], "refusal": None}
        tokens = [self._token(t)["token"] for t in ids]
        offsets = [offset + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in lps], "text_offset": offsets,
                "top_logprobs": [{self._token(a)["token"]: alp for a, alp in alts} for _, alts in lps]}

    def _pick_group(self) -> str:
        """The live group with the fewest requests in flight per Router replica (a group of 4 replicas
        takes 4 times the requests of a group of 1); every group when none is live."""
        live = [g for g in self.in_flight if g not in self.down] or list(self.in_flight)
        return min(live, key=lambda g: self.in_flight[g] / self.replicas[g])

    def _watch(self) -> None:
        if self._watcher is None and len(self.routers) > 1:  # one group has nowhere else to send requests
            self._watcher = asyncio.get_running_loop().create_task(self._watch_groups())

    async def _watch_groups(self, period_s: float = 2.0, misses: int = 3) -> None:
        """Mark a group down when `misses` pings in a row get no answer from any of its Router
        replicas (its nodes are gone: Serve would hold its requests until a replica comes back), and up
        at the first answer. New requests go to live groups; requests waiting on a down group move."""
        async def ping(g: str) -> bool:
            try:
                await asyncio.wait_for(self.routers[g].ready.remote(), timeout=period_s * 1.5)
                return True
            except Exception:
                return False

        missed = {g: 0 for g in self.routers}
        while True:
            for g, ok in zip(self.routers, await asyncio.gather(*(ping(g) for g in self.routers))):
                missed[g] = 0 if ok else missed[g] + 1
                if missed[g] >= misses and g not in self.down:
                    log.warning("engine group %s is not answering: sending its requests to the other groups", g)
                    self.down.add(g)
                elif ok and g in self.down:
                    log.warning("engine group %s answers again", g)
                    self.down.discard(g)
            await asyncio.sleep(period_s)

    async def _respond(self, request: Request, body: SamplingFields, prompts: list[list[int]], max_tokens: int, chat: bool):
        """Each choice (prompts x n) is its own request to the least-loaded group; the answers merge."""
        params = self._params(body, max_tokens)
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"n: at most {MAX_CHOICES} choices per request (prompts x n)", "n", "invalid_value")
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance", code="draining", retry_after=5)
        rid = request_id(request)
        self._watch()
        jobs = [(ids, params if params["seed"] is None else {**params, "seed": params["seed"] + j})
                for ids in prompts for j in range(body.n)]  # choice index = prompt index * n + j
        leases: list[_GroupLease] = []
        stream = None  # once set, the SSE generator owns the leases
        try:
            for c, (ids, p) in enumerate(jobs):
                lease = _GroupLease(self.in_flight, self._pick_group(), self)
                leases.append(lease)
                lease.upstream = RouterStream(self.routers[lease.group], ids, p, rid if len(jobs) == 1 else f"{rid}-{c}",
                                              body.stream, self.max_resubmits, self.resubmit_wait_s,
                                              reroute=lease.reroute if len(self.routers) > 1 else None)
                lease.upstream.start()
            firsts = await asyncio.gather(*(lease.upstream.next() for lease in leases))
            for first in firsts:
                if "error" in first:
                    status = first["status"]
                    code = {400: "invalid_value", 503: "engine_unavailable"}.get(status)
                    raise APIError(status, first["error"], code=code, retry_after=first.get("retry_after"))
            meta = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "created": int(time.time()), "model": self.model_name}
            n_prompt = sum(len(ids) for ids in prompts)
            if not body.stream:
                return await self._collect(firsts, leases, meta, n_prompt, chat)
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            stream = self._sse(firsts, leases, meta, n_prompt, chat, include_usage)
            for lease in leases:
                lease.end_with(stream)
            return StreamingResponse(stream, media_type="text/event-stream")
        except asyncio.CancelledError:  # the client left while this handler waited on the engine
            for lease in leases:
                lease.end(finished=False)
            raise
        finally:
            if stream is None:  # answered or refused here: cancel what is still generating for nobody
                for lease in leases:
                    lease.end(finished=lease.upstream is None or lease.upstream.finished)

    async def _collect(self, firsts: list[dict], leases: list[_GroupLease], meta: dict, n_prompt: int, chat: bool):
        cached = [0] * len(leases)

        async def one(c: int, first: dict, events: RouterStream) -> tuple[str, list[int], list | None, str | None]:
            text, ids, ev = [first["text"]], list(first["token_ids"]), first
            lps = list(first["logprobs"]) if "logprobs" in first else None
            while not ev["finished"]:
                ev = await events.next()
                text.append(ev["text"])
                ids += ev["token_ids"]
                if lps is not None:
                    lps += ev.get("logprobs", [])
            if ev.get("error"):
                raise APIError(503, ev["error"], code="engine_error")
            cached[c] = ev.get("stats", {}).get("cached_tokens", 0)
            return "".join(text), ids, lps, ev["finish_reason"]

        answers = await asyncio.gather(*(one(c, f, lease.upstream) for c, (f, lease) in enumerate(zip(firsts, leases))))
        choices = []
        for c, (content, ids, lps, reason) in enumerate(answers):
            choice = {"index": c, "finish_reason": reason, "logprobs": self._format_logprobs(ids, lps, chat)}
            choice.update({"message": {"role": "assistant", "content": content}} if chat else {"text": content})
            choices.append(choice)
        n_out = sum(len(ids) for _, ids, _, _ in answers)
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": _usage(n_prompt, n_out, max(cached))}

    async def _sse(self, firsts: list[dict], leases: list[_GroupLease], meta: dict, n_prompt: int, chat: bool,
                   include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        offsets = [0] * len(leases)  # completions' text_offset runs on across chunks

        def chunk(c: int, text: str | None, finish: str | None, role: bool = False, ev: dict | None = None) -> str:
            lps = self._format_logprobs(ev["token_ids"], ev["logprobs"], chat, offsets[c]) if ev and "logprobs" in ev else None
            if chat:
                delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
                choice = {"index": c, "delta": delta, "logprobs": lps, "finish_reason": finish}
            else:
                choice = {"index": c, "text": text or "", "logprobs": lps, "finish_reason": finish}
                offsets[c] += len(text or "")
            return f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice]})}\n\n"

        # One pump per choice feeds a queue, so choices stream as their tokens come, interleaved. The
        # queue is small: a slow client slows the pumps (backpressure), and a client that leaves finds
        # the router requests still going, so they are cancelled.
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(leases))

        async def pump(c: int, ev: dict, events: RouterStream) -> None:
            while True:
                await queue.put((c, ev))
                if ev["finished"]:
                    return
                ev = await events.next()

        pumps = [asyncio.ensure_future(pump(c, f, lease.upstream)) for c, (f, lease) in enumerate(zip(firsts, leases))]
        n_out, open_choices, cached = 0, len(pumps), 0
        try:
            if chat:
                for c in range(len(pumps)):
                    yield chunk(c, "", None, role=True)
            while open_choices:
                c, ev = await queue.get()
                n_out += len(ev["token_ids"])
                if ev.get("error"):
                    err = {"message": ev["error"], "type": ERROR_TYPES[503], "param": None, "code": "engine_error"}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    return
                if ev["text"] or ev.get("logprobs"):
                    yield chunk(c, ev["text"], None, ev=ev)
                if ev["finished"]:
                    open_choices -= 1
                    cached = max(cached, ev.get("stats", {}).get("cached_tokens", 0))
                    yield chunk(c, None if chat else "", ev["finish_reason"])
            if include_usage:
                usage = _usage(n_prompt, n_out, cached)
                yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for t in pumps:
                t.cancel()
            # A choice not finished: the client left mid-stream (or an error event ended it), so cancel
            # its router request. A generator that never started never gets here: see `_GroupLease`.
            for lease in leases:
                lease.end(lease.upstream.finished)
