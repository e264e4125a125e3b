"""OpenAI-compatible HTTP ingress: /v1/completions, /v1/chat/completions, /v1/models, /healthz, /readyz.

Validates requests (OpenAI-style JSON errors with the right status), tokenizes, and sends each
request to the engine group with the fewest requests in flight. Streams as server-sent events the
way the openai python client expects: one chunk per accepted piece of text, then `data: [DONE]`.
A Router replica dying mid-request does not end the stream: the request goes again to the group with
the tokens already received as context (`RouterStream`). `drain()` stops admitting for a shutdown.
"""


import asyncio
import hmac
import importlib.metadata
import json
import logging
import os
import re
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ray import serve

from serve_app import tools as toolcalls
from serve_app.config import StructuredOutput
from serve_app.models import load_tokenizer
from serve_app.prompts import RESERVED_TEMPLATE_VARS, ChatTemplating, check_text, encode_chat, encode_prompt, message_text

from . import openai_fields

app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding server")
log = logging.getLogger("ray.serve")
try:
    SERVER_VERSION = importlib.metadata.version("specserve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    SERVER_VERSION = "0+unknown"

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               429: "rate_limit_error", 503: "service_unavailable"}


def error_type(status: int) -> str:
    """OpenAI's error type: any other 4xx (404, 405, 413, ...) is the request's fault too."""
    return ERROR_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
    body = {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}
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
    message = str(e.detail)
    if e.status_code in (404, 405):  # as OpenAI words it: which URL and method
        message = f"{message}: {request.method} {request.url.path}"
    return error_response(e.status_code, message, code={404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request"),
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
    if err["type"] == "extra_forbidden":
        return error_response(400, f"unknown field '{param}': not a field of this endpoint in OpenAI's API, nor one of "
                                   "the vLLM extras this server implements (docs/http-api.md lists them)", param, "unknown_parameter")
    msg = str(err["ctx"]["error"]) if err["type"] == "value_error" and "error" in err.get("ctx", {}) else err["msg"]
    return error_response(400, f"{param}: {msg}" if param else msg, param, "invalid_value")


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


class StreamOptions(BaseModel):
    """OpenAI's stream_options."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None
    """A last chunk with the usage of the whole request, before `data: [DONE]`."""

    include_obfuscation: bool | None = None
    """OpenAI pads its stream chunks against side channels; accepted, nothing is padded here."""

    continuous_usage_stats: bool | None = None
    """vLLM's: every chunk carries the usage so far (with include_usage)."""


class VllmStructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint on the output."""

    model_config = ConfigDict(extra="forbid")

    json_schema: dict | str | None = Field(None, alias="json")
    """A JSON schema (or its JSON text) the output validates against."""

    json_object: bool | None = None
    """The output is a JSON object."""

    regex: str | None = None
    """The output matches this regular expression."""

    choice: list[str] | None = None
    """The output is exactly one of these strings."""

    grammar: str | None = None
    """The output follows this Lark grammar."""


class SamplingFields(BaseModel):
    """Request fields shared by completions and chat completions.

    Every field of OpenAI's requests takes effect, is accepted without effect, or is refused unless it
    asks for nothing (the tables in deployments/openai_fields.py); any other field is a 400. Null
    means the default, as in OpenAI's API.
    """

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI's optional fields take null for "not given": drop those nulls so the defaults apply."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields or cls.model_fields[k].default is None}
        return data

    model: str
    """The served model's name (GET /v1/models)."""

    max_tokens: int | None = Field(None, ge=1)
    """Most tokens to generate (default: 16 for completions, 256 for chat)."""

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    """0 decodes greedily; above 0 samples at this temperature."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""

    n: int = Field(1, ge=1)
    """Choices per prompt, each its own sequence (seeded: seed + i for choice i)."""

    stream: bool = False
    """Server-sent events, one chunk per piece of text, then `data: [DONE]`."""

    stream_options: StreamOptions | None = None
    """Streaming options (include_usage)."""

    stop: str | list[str] | None = None
    """Generation ends before the first of these strings."""

    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    """Seeded sampling: the same text at any speculation length, batch or replica."""

    logprobs: bool | int | None = None
    """Chat: true for the tokens' log-probabilities; completions: how many alternatives per token."""

    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """Subtracted from a token's logit once per time it already appears in the output."""

    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """Subtracted once from the logit of every token already in the output."""

    logit_bias: dict[str, float] | None = None
    """Token id (a string key, as OpenAI's clients send it) -> value in [-100, 100] added to its logit."""

    user: str | None = None
    """An end-user id; accepted without effect (openai_fields.NO_EFFECT)."""

    # ---- vLLM's extra fields (openai_fields.VLLM_HANDLED, VLLM_REFUSED) ----
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)
    """Keep only the top_k most likely tokens; -1 or 0 keeps all."""

    min_tokens: int = Field(0, ge=0)
    """End-of-sequence and stop_token_ids are banned until this many tokens are generated."""

    ignore_eos: bool = False
    """Generate past the end-of-sequence token, up to max_tokens."""

    stop_token_ids: list[int] | None = None
    """Generation also ends after any of these token ids (kept in the output)."""

    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    """Logits of tokens already in the prompt or output are divided (positive) or multiplied (negative) by it; 1 is off."""

    bad_words: list[str] | None = None
    """Words never generated (vLLM's semantics)."""

    guided_json: dict | str | None = None
    """The output is JSON valid against this schema (or its JSON text)."""

    guided_regex: str | None = None
    """The output matches this regular expression."""

    guided_choice: list[str] | None = None
    """The output is exactly one of these strings."""

    guided_grammar: str | None = None
    """The output follows this Lark grammar."""

    structured_outputs: VllmStructuredOutputs | None = None
    """vLLM's newer form of the four above: one of json, json_object, regex, choice, grammar."""

    min_p: float | None = Field(None, ge=0.0, le=1.0)
    """Keep only tokens at least min_p times as likely as the most likely one; 0 or null keeps all."""

    skip_special_tokens: bool = True
    """Special tokens are left out of the text; false keeps them (an end-of-sequence marker, chat markers)."""

    spaces_between_special_tokens: bool | None = None
    """Refused unless true or null."""

    include_stop_str_in_output: bool = False
    """The stop string that ended the output stays at the end of its text."""

    allowed_token_ids: list[int] | None = None
    """Only these token ids may be generated (beside logit_bias)."""

    priority: int = Field(0, ge=-(2**31), lt=2**31)
    """Admission order while requests wait: lower first (vLLM's meaning); FIFO within a priority."""

    request_id: str | None = Field(None, min_length=1, max_length=256)
    """The request's id, in the response's id (default: the X-Request-Id header's, or a new one)."""

    return_tokens_as_token_ids: bool = False
    """Logprobs name their tokens "token_id:<id>" rather than by their text (text that is not valid UTF-8 alone)."""

    return_token_ids: bool = False
    """The response carries the prompt's token ids and each choice's generated token ids."""

    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    """Prefix-cache entries are shared only between requests with the same salt (tenants kept apart)."""

    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """Keep only the prompt's last this-many tokens (-1: as many as the context limit leaves room for)."""

    add_special_tokens: bool | None = None
    """Let the tokenizer add its special tokens (BOS) to the prompt; default true for completions, false for
    chat (the chat template writes its own)."""

    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    """The prompt tokens' log-probabilities with this many alternatives (vLLM's `prompt_logprobs` field)."""

    length_penalty: float | None = None
    """Beam search's length penalty: accepted without effect (openai_fields.VLLM_NO_EFFECT)."""

    use_beam_search: bool | None = None
    """Refused unless false or null: beam search is not implemented here."""


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    """A string, several strings (one choice each), token ids, or several lists of token ids."""

    echo: bool = False
    """Put the prompt's text before each choice's text (with logprobs: the prompt tokens' too)."""

    suffix: str | None = None
    """Refused unless null or "" (insertion is not supported)."""

    best_of: int | None = Field(None, ge=1)
    """Refused unless null or equal to n (every generated choice is returned)."""


class ChatMessage(BaseModel):
    """One message of a chat, in any of the shapes OpenAI's API defines for text."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    """Who speaks; `developer` reaches the chat template as `system`."""

    content: str | list | None = None
    """A string or a list of text parts; null for an assistant turn that only called tools."""

    name: str | None = None
    """A participant's name; accepted without effect."""

    tool_calls: list | None = None
    """An assistant turn's calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""

    tool_call_id: str | None = None
    """A tool result's call id (required for role `tool`)."""

    refusal: str | None = None
    """An assistant turn's refusal text, kept in the conversation."""

    audio: Any = None
    """An earlier audio answer's id: refused unless null (this model writes text only)."""

    function_call: Any = None
    """The deprecated form of tool_calls: refused unless null (send tool_calls)."""

    @model_validator(mode="after")
    def _text_only(self) -> "ChatMessage":
        if self.audio is not None:
            raise ValueError("audio: not supported (this model writes text only); send the turn's text as content")
        if self.function_call is not None:
            raise ValueError("function_call: the deprecated form of tool_calls is not supported; send tool_calls")
        return self


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    """The conversation so far."""

    max_completion_tokens: int | None = Field(None, ge=1)
    """Most tokens to generate (OpenAI's newer name of max_tokens; it wins when both are set)."""

    top_logprobs: int | None = Field(None, ge=0, le=20)
    """Alternatives per token with logprobs: true (0-20)."""

    response_format: dict | None = None
    """{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", ...}}."""

    tools: list | None = None
    """Function tools the model may call: [{"type": "function", "function": {"name", "description", "parameters"}}]."""

    tool_choice: str | dict | None = None
    """"none", "auto", "required", {"type": "function", "function": {"name"}} or {"type": "allowed_tools", ...}."""

    parallel_tool_calls: bool = True
    """More than one call per answer (false: at most one)."""

    # ---- accepted without effect (openai_fields.NO_EFFECT) ----
    metadata: dict[str, str] | None = None
    """Tags for stored completions (nothing is stored here)."""

    store: bool | None = None
    """Keep the completion at OpenAI (nothing is stored here)."""

    service_tier: str | None = None
    """OpenAI's processing tier."""

    safety_identifier: str | None = None
    """An end-user id for OpenAI's abuse monitoring."""

    prompt_cache_key: str | None = None
    """A hint for OpenAI's prompt cache (prefix caching here is automatic)."""

    prompt_cache_options: dict | None = None
    """OpenAI's prompt cache options."""

    prompt_cache_retention: str | None = None
    """OpenAI's prompt cache lifetime."""

    prediction: dict | None = None
    """Predicted Outputs: {"type": "content", "content": text or text parts}, the text the answer mostly repeats;
    drafted from directly (fewer target steps), the answer is the same without it."""

    # ---- vLLM's chat extras: how the messages become the prompt (prompts.ChatTemplating) ----
    chat_template: str | None = None
    """A Jinja chat template to use instead of the model's."""

    chat_template_kwargs: dict | None = None
    """Extra variables for the chat template (Qwen3's enable_thinking, ...)."""

    add_generation_prompt: bool = True
    """End the prompt with the opening of the assistant's turn."""

    continue_final_message: bool = False
    """Leave the last (assistant) message open so the answer continues it (with add_generation_prompt false)."""

    documents: list[dict] | None = None
    """Documents for chat templates that render them (retrieval-augmented generation)."""

    # ---- refused unless they ask for nothing (openai_fields.REFUSED) ----
    audio: Any = None
    """Audio output parameters: null only."""

    modalities: Any = None
    """Output modalities: null or ["text"]."""

    functions: Any = None
    """The deprecated functions API: null or []."""

    function_call: Any = None
    """The deprecated functions API: null, "none" or "auto"."""

    reasoning_effort: Any = None
    """Reasoning effort: null or "none"."""

    verbosity: Any = None
    """Answer length: null or "medium"."""

    web_search_options: Any = None
    """Web search: null only."""

    moderation: Any = None
    """Moderation: null only."""


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


def _json_value(value, field: str):
    """A JSON schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise APIError(400, f"{field}: not valid JSON", field, "invalid_value") from None
    return value


def _response_format(fmt: dict) -> dict | None:
    """The output constraint of OpenAI's response_format (None for plain text); a malformed one is a
    400 naming response_format."""
    def bad(why: str):
        return APIError(400, f"response_format: {why}", "response_format", "invalid_value")

    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        if set(fmt) != {"type"}:
            raise bad(f"type {kind!r} takes no other field (got {sorted(set(fmt) - {'type'})})")
        return None if kind == "text" else {"json_object": True}
    if kind != "json_schema":
        raise bad("{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'name', 'schema'}}")
    spec = fmt.get("json_schema")
    if set(fmt) != {"type", "json_schema"} or not isinstance(spec, dict):
        raise bad("type 'json_schema' takes one more field, json_schema: {'name', 'schema', 'strict', 'description'}")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise bad(f"json_schema: unknown field {sorted(unknown)[0]!r}")
    if not isinstance(spec.get("name"), str) or not toolcalls.NAME.fullmatch(spec["name"]):
        raise bad("json_schema.name: required, 1-64 letters, digits, '_' or '-'")
    if not isinstance(spec.get("schema", {}), dict):
        raise bad("json_schema.schema: a JSON schema object")
    if not isinstance(spec.get("strict", False), (bool, type(None))) or not isinstance(spec.get("description", ""), str):
        raise bad("json_schema: 'strict' is a boolean and 'description' a string")
    # strict or not, the output follows the schema: every token is constrained to it. Strict also means
    # OpenAI's rule that objects allow no keys beyond their properties: a schema silent on it is closed.
    schema = spec.get("schema", {})
    return {"json_schema": toolcalls.closed(schema) if spec.get("strict") else schema}


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


def _joined(first: dict | None, then: dict | None) -> dict | None:
    """Two completions logprobs objects as one (an echoed prompt's, then the output's)."""
    if first is None or then is None:
        return first or then
    return {key: first[key] + then[key] for key in first}


def _usage(n_prompt: int, n_out: int, cached: int, predicted: dict | None = None) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens whose KV came from the prefix cache (the
    prompt is shared by a request's choices: the largest of theirs); predicted: with a prediction, its
    accepted and rejected token counts over the choices."""
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
             "prompt_tokens_details": {"cached_tokens": cached}}
    if predicted is not None:
        usage["completion_tokens_details"] = dict(predicted)
    return usage


PREDICTION_COUNTS = ("accepted_prediction_tokens", "rejected_prediction_tokens")


def _add_prediction(total: dict | None, stats: dict | None) -> dict | None:
    """A finished choice's prediction counts (its final event's stats) added to the request's."""
    if total is None:
        return None
    for key in PREDICTION_COUNTS:
        total[key] += (stats or {}).get(key, 0)
    return total


@dataclass
class Shape:
    """vLLM's extras that shape a request's answer, not its generation."""

    as_ids: bool = False
    """return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"."""
    prompt_ids: list[list[int]] | None = None
    """return_token_ids: each choice's prompt ids (its generated ids go beside its text)."""
    prompt_logprobs: bool | list = False
    """prompt_logprobs: the prompt tokens' logprobs are asked for; once the first events came, per choice
    in vLLM's shape."""
    continuous_usage: bool = False
    """stream_options.continuous_usage_stats: usage in every streamed chunk."""
    prediction: bool = False
    """A prediction was given: usage reports its accepted and rejected tokens."""


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
    calibrated = {r: s["calibration"] for r, s in snapshots.items() if s.get("calibration")}
    name = "specserve_calibration_factor"
    lines += [f"# HELP {name} Measured / profiled step time of one part (draft, verify, other) at a profiled batch size, "
              "as this replica's calibration has it (1: as profiled).", f"# TYPE {name} gauge"]
    lines += [f"{name}{{{labels(r, snapshots[r], part=part, batch_size=b)}}} {float(f)}"
              for r, cal in calibrated.items() for part, by_size in cal["factors"].items() for b, f in by_size.items()]
    name = "specserve_calibration_drift"
    lines += [f"# HELP {name} Largest |calibrated / profiled - 1| of a whole step over the profile's cells.",
              f"# TYPE {name} gauge"]
    lines += [f"{name}{{{labels(r, snapshots[r])}}} {float(cal['drift'])}" for r, cal in calibrated.items()]
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

    @app.get("/health")
    async def health(self):
        """vLLM's, SGLang's and TGI's health check (load tools and probes call it): 200 with an empty body while
        this server can serve requests, 503 (the reason in its body) while it cannot (see /readyz)."""
        ready = await self.readyz()
        return Response(status_code=200) if ready.status_code == 200 else ready

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping(self):
        """SageMaker's health check, as vLLM serves it: the same as /health."""
        return await self.health()

    @app.get("/version")
    async def version(self):
        """The server's version, as vLLM reports its own."""
        return {"version": SERVER_VERSION}

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
        self._refuse_unsupported(body, "completions")
        prompts = self._completion_prompts(body.prompt, body.add_special_tokens is not False)
        truncated = body.truncate_prompt_tokens is not None
        prompts = [await self._truncated(ids, body) for ids in prompts]
        echo = None
        if body.echo:  # each prompt's own text where the client sent text, else its tokens' text; one per choice
            if (isinstance(body.prompt, str) or isinstance(body.prompt[0], str)) and not truncated:
                texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            else:
                texts = [self.tokenizer.decode(ids) for ids in prompts]
            echo = [t for t in texts for _ in range(body.n)]
        return await self._respond(request, body, prompts, body.max_tokens or 16, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatRequest, request: Request):
        self._auth(request)
        self._refuse_unsupported(body, "chat")
        choice = self._tool_choice(body)
        rendered = None  # tools go to a template that renders them, unless no call may be made
        if choice.mode != "none" and toolcalls.template_supports_tools(self.tokenizer):
            rendered = [{"type": "function", "function": t} for t in choice.tools]
        kwargs = body.chat_template_kwargs or {}
        if reserved := sorted(RESERVED_TEMPLATE_VARS & set(kwargs)):
            raise APIError(400, f"chat_template_kwargs: {', '.join(reserved)} are set by the server, not here",
                           "chat_template_kwargs", "invalid_value")
        if body.continue_final_message and (body.add_generation_prompt or not body.messages
                                            or body.messages[-1].role != "assistant"):
            raise APIError(400, "continue_final_message: continues a last assistant message, with add_generation_prompt "
                           "false", "continue_final_message", "invalid_value")
        templating = ChatTemplating(body.chat_template, kwargs, body.add_generation_prompt, body.continue_final_message,
                                    body.documents, bool(body.add_special_tokens))
        try:
            ids = encode_chat(self.tokenizer, [m.model_dump(exclude_none=True) for m in body.messages], tools=rendered,
                              templating=templating)
        except toolcalls.ToolError as e:
            raise APIError(400, str(e), e.param, "invalid_value") from None
        except jinja2.TemplateError as e:  # a request's own template, or its variables, broke rendering
            field = "chat_template" if body.chat_template is not None else "chat_template_kwargs"
            raise APIError(400, f"{field}: the chat template failed to render: {e}", field, "invalid_value") from None
        except ValueError as e:
            raise APIError(400, str(e), "messages", "invalid_value") from None
        ids = await self._truncated(ids, body)
        return await self._respond(request, body, [ids], body.max_completion_tokens or body.max_tokens or 256, chat=True,
                                   tools=choice)

    @app.post("/v1/responses")
    async def responses(self, body: dict, request: Request):
        """OpenAI's Responses API over the same engine (deployments/responses.py)."""
        self._auth(request)
        from .responses import create_response  # imported here: responses.py builds on this module
        return await create_response(self, request, body)

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest, request: Request):
        self._auth(request)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", code="invalid_value")
        if body.messages is not None:
            ids = self._encode(messages=[m.model_dump(exclude_none=True) for m in body.messages])
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

    def _encode(self, prompt=None, messages=None, add_special_tokens: bool = True) -> list[int]:
        try:
            return encode_prompt(self.tokenizer, prompt, messages, add_special_tokens)
        except ValueError as e:
            raise APIError(400, str(e), "messages" if messages is not None else "prompt", "invalid_value") from None

    def _completion_prompts(self, prompt, add_special_tokens: bool = True) -> list[list[int]]:
        """One list of token ids per prompt: a string, strings, token ids, or lists of token ids."""
        if isinstance(prompt, str):
            return [self._encode(prompt=prompt, add_special_tokens=add_special_tokens)]
        if not prompt:
            raise APIError(400, "prompt: an empty list", "prompt", "invalid_value")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], str):
            return [self._encode(prompt=p, add_special_tokens=add_special_tokens) for p in prompt]
        if any(not ids for ids in prompt):
            raise APIError(400, "prompt: an empty list of token ids", "prompt", "invalid_value")
        return [list(ids) for ids in prompt]

    async def _truncated(self, ids: list[int], body: SamplingFields) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: what the context limit leaves room for)."""
        keep = body.truncate_prompt_tokens
        if keep == -1:
            keep = (await self._max_model_len() or len(ids) + 1) - 1
        if keep is None or len(ids) <= keep:
            return ids
        if keep == 0:
            raise APIError(400, "truncate_prompt_tokens: 0 would leave no prompt", "truncate_prompt_tokens", "invalid_value")
        return ids[len(ids) - keep :]

    def _prediction(self, body: SamplingFields) -> list[int]:
        """Predicted Outputs' token ids ({"type": "content", "content": text or text parts}); [] without one."""
        pred = getattr(body, "prediction", None)
        if pred is None:
            return []
        if pred.get("type") != "content" or set(pred) - {"type", "content"}:
            raise APIError(400, 'prediction: {"type": "content", "content": ...} is the one kind of prediction',
                           "prediction", "invalid_value")
        try:
            text = message_text(pred.get("content"), "prediction.content")
        except ValueError as e:
            raise APIError(400, str(e), "prediction", "invalid_value") from None
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

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

    def _params(self, body: SamplingFields, max_tokens: int, tools: toolcalls.Choice | None = None) -> dict:
        """The engine's SamplingParams (as a dict) for this request; tools: how its tool_choice resolved."""
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
        params = {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                  "top_k": max(body.top_k, 0), "seed": body.seed, "stop": stop, "logprobs": logprobs}
        return params | self._controls(body, max_tokens, logprobs, tools) | self._extras(body)

    def _extras(self, body: SamplingFields) -> dict:
        """vLLM's extras that change how the engine serves the request, only those the request sets."""
        out: dict = {}
        for name, off in (("include_stop_str_in_output", False), ("skip_special_tokens", True), ("priority", 0),
                          ("cache_salt", None)):
            if getattr(body, name) != off:
                out[name] = getattr(body, name)
        if body.allowed_token_ids is not None:
            vocab = len(self.tokenizer)
            if not body.allowed_token_ids or any(not 0 <= t < vocab for t in body.allowed_token_ids):
                raise APIError(400, f"allowed_token_ids: a non-empty list of ids in [0, {vocab})", "allowed_token_ids",
                               "invalid_value")
            out["allowed_token_ids"] = sorted(set(body.allowed_token_ids))
        prediction = self._prediction(body)
        if prediction:
            out["predicted_output"] = prediction
        return out

    def _controls(self, body: SamplingFields, max_tokens: int, logprobs: int | None, tools: toolcalls.Choice | None) -> dict:
        """The engine's further controls, only those the request sets (a plain request's params stay
        what they were). Token ids are checked against the vocabulary here, so a 400 names the field."""
        out: dict = {}
        vocab = len(self.tokenizer) if body.logit_bias or body.stop_token_ids else 0
        if body.logit_bias:
            out["logit_bias"] = {}
            for key, value in body.logit_bias.items():
                tid = int(key) if re.fullmatch(r"\s*[0-9]+\s*", key) else None  # ASCII digits only
                if tid is None or not 0 <= tid < vocab:
                    raise APIError(400, f"logit_bias: key {key!r} is not a token id in the vocabulary [0, {vocab})",
                                   "logit_bias", "invalid_value")
                if not -100 <= value <= 100:
                    raise APIError(400, f"logit_bias: the value for {key!r} is {value}, outside [-100, 100]", "logit_bias", "invalid_value")
                out["logit_bias"][tid] = value
        for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("ignore_eos", False)):
            if getattr(body, name) != off:
                out[name] = getattr(body, name)
        if body.min_p:
            out["min_p"] = body.min_p
        if body.min_tokens:
            if body.min_tokens > max_tokens:
                raise APIError(400, f"min_tokens: {body.min_tokens} is more than max_tokens ({max_tokens})", "min_tokens", "invalid_value")
            out["min_tokens"] = body.min_tokens
        if body.stop_token_ids:
            if any(not 0 <= t < vocab for t in body.stop_token_ids):
                raise APIError(400, f"stop_token_ids: ids must be in [0, {vocab})", "stop_token_ids", "invalid_value")
            out["stop_token_ids"] = list(body.stop_token_ids)
        if body.bad_words:
            if any(not w.strip() for w in body.bad_words):
                raise APIError(400, "bad_words: words must be non-empty", "bad_words", "invalid_value")
            try:
                out["bad_words"] = [check_text(w, "bad_words") for w in body.bad_words]
            except ValueError as e:
                raise APIError(400, str(e), "bad_words", "invalid_value") from None
        structured = self._structured(body, tools)
        if structured is not None:
            out["structured"] = structured
        asked = [n for n in (logprobs if getattr(body, "echo", False) else None, body.prompt_logprobs) if n is not None]
        if asked:
            out["prompt_logprobs"] = max(asked)  # the echoed prompt's tokens get theirs too
        return out

    def _structured(self, body: SamplingFields, choice: toolcalls.Choice | None) -> dict | None:
        """The request's one output constraint (serve_app.config.StructuredOutput), from response_format,
        a forced tool call (tool_choice "required" or named), or vLLM's guided_* / structured_outputs;
        None without one. Two at once, or a malformed one, is a 400 naming the field."""
        given = []  # (field, constraint)
        fmt = getattr(body, "response_format", None)
        if fmt is not None:
            constraint = _response_format(fmt)
            if constraint is not None:
                given.append(("response_format", constraint))
        schema = toolcalls.forced_schema(choice) if choice is not None else None
        if schema is not None:
            given.append(("tool_choice", {"json_schema": schema}))
        if body.guided_json is not None:
            given.append(("guided_json", {"json_schema": _json_value(body.guided_json, "guided_json")}))
        for field, key in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(body, field) is not None:
                given.append((field, {key: getattr(body, field)}))
        if body.structured_outputs is not None:
            so = body.structured_outputs.model_dump(exclude_none=True)
            if "json_schema" in so:
                so["json_schema"] = _json_value(so["json_schema"], "structured_outputs")
            given.append(("structured_outputs", so))
        if len(given) > 1:
            raise APIError(400, f"{given[1][0]}: one output constraint per request, and {given[0][0]} is one already",
                           given[1][0], "invalid_value")
        if choice is not None and choice.mode == "auto" and given:
            raise APIError(400, f"{given[0][0]}: an output constraint leaves no room for tool calls under tool_choice "
                           "'auto'; use tool_choice 'none', 'required' or a named function", given[0][0], "invalid_value")
        if not given:
            return None
        field, constraint = given[0]
        try:
            json.dumps(constraint, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # the grammar compiler would choke on it
            raise APIError(400, f"{field} holds a lone surrogate (invalid Unicode)", field, "invalid_value") from None
        try:
            return StructuredOutput(**constraint).model_dump(exclude_defaults=True)
        except ValidationError as e:
            raise APIError(400, f"{field}: {e.errors()[0]['msg']}", field, "invalid_value") from None

    def _refuse_unsupported(self, body: SamplingFields, endpoint: str) -> None:
        """A 400 naming a field set to a value this server cannot honour (openai_fields.refused)."""
        for name, rule in openai_fields.refused(endpoint).items():
            if name in body.model_fields_set and not rule.ok(getattr(body, name), body):
                raise APIError(400, f"{name} is not supported here: {rule.why}. Accepted only as {rule.accepts}",
                               name, "unsupported_parameter")

    def _tool_choice(self, body: ChatRequest) -> toolcalls.Choice:
        """How tools and tool_choice resolve; "auto" needs a chat template that renders tools, or the
        model never learnt how to call one."""
        try:
            tools = toolcalls.check_tools(body.tools)
            choice = toolcalls.check_tool_choice(body.tool_choice, tools, body.parallel_tool_calls)
        except toolcalls.ToolError as e:
            raise APIError(400, str(e), e.param, "invalid_value") from None
        if choice.mode == "auto" and not toolcalls.template_supports_tools(self.tokenizer):
            raise APIError(400, "tool_choice: 'auto' (the default with tools) lets the model decide to call a tool, but "
                           "this model's chat template does not render tools; use tool_choice 'required' or a named "
                           "function (the output is then constrained to a call), or 'none'", "tool_choice", "unsupported_value")
        return choice

    def _token(self, tid: int, as_ids: bool = False) -> dict:
        text = f"token_id:{tid}" if as_ids else self.tokenizer.decode([tid])
        return {"token": text, "bytes": list(text.encode("utf-8", "surrogatepass"))}

    def _format_logprobs(self, ids: list[int], lps: list | None, chat: bool, offset: int = 0,
                         as_ids: bool = False) -> dict | None:
        """OpenAI's logprobs object: chat {"content": [...]}, completions {tokens, token_logprobs, ...}.
        Completions also take None for a token without one (an echoed prompt's first: null, as OpenAI's).
        as_ids: tokens named "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
        if lps is None:
            return None
        tok = lambda t: self._token(t, as_ids)  # noqa: E731
        if chat:
            return {"content": [{**tok(t), "logprob": lp, "top_logprobs": [{**tok(a), "logprob": alp} for a, alp in alts]}
                                for t, (lp, alts) in zip(ids, lps)], "refusal": None}
        tokens = [tok(t)["token"] for t in ids]
        offsets = [offset + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [None if e is None else e[0] for e in lps], "text_offset": offsets,
                "top_logprobs": [None if e is None else {tok(a)["token"]: alp for a, alp in e[1]} for e in lps]}

    def _engine_prompt_logprobs(self, first: dict, ids: list[int]) -> list:
        entries = first.get("prompt_logprobs")
        if entries is None or len(entries) != len(ids):
            log.error("the engine's first event has no prompt_logprobs for %d prompt tokens", len(ids))
            raise APIError(500, "internal error: the engine did not return the prompt's logprobs", code="internal_error")
        return entries

    def _prompt_logprobs(self, first: dict, ids: list[int], as_ids: bool = False) -> dict:
        """An echoed prompt's logprobs object (completions), from the engine's first event: one entry per
        prompt token, None for the first (null in the answer, as OpenAI's)."""
        return self._format_logprobs(ids, self._engine_prompt_logprobs(first, ids), chat=False, as_ids=as_ids)

    def _vllm_prompt_logprobs(self, first: dict, ids: list[int]) -> list:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: {logprob, rank,
        decoded_token}} for the token itself and its top alternatives. A token outside the alternatives gets
        their count + 1 as its rank (a lower bound: only the top ones are ranked)."""
        out = []
        for t, e in zip(ids, self._engine_prompt_logprobs(first, ids)):
            if e is None:
                out.append(None)
                continue
            lp, alts = e
            rank = next((i + 1 for i, (a, _) in enumerate(alts) if a == t), 1 + sum(alp > lp for _, alp in alts))
            entry = {str(t): {"logprob": lp, "rank": rank, "decoded_token": self.tokenizer.decode([t])}}
            for i, (a, alp) in enumerate(alts):
                entry.setdefault(str(a), {"logprob": alp, "rank": i + 1, "decoded_token": self.tokenizer.decode([a])})
            out.append(entry)
        return out

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

    async def _respond(self, request: Request, body: SamplingFields, prompts: list[list[int]], max_tokens: int, chat: bool,
                       tools: toolcalls.Choice | None = None, echo: list[str] | None = None):
        """Each choice (prompts x n) is its own request to the least-loaded group; the answers merge.
        tools: chat's resolved tool_choice (calls found in or forced on each choice's text); echo:
        completions' prompt text to put before each choice's text."""
        params = self._params(body, max_tokens, tools)
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"n: at most {MAX_CHOICES} choices per request (prompts x n)", "n", "invalid_value")
        jobs = [(ids, params if params["seed"] is None else {**params, "seed": params["seed"] + j})
                for ids in prompts for j in range(body.n)]  # choice index = prompt index * n + j
        n_prompt = sum(len(ids) for ids in prompts)
        opts = body.stream_options
        shape = Shape(body.return_tokens_as_token_ids, [ids for ids, _ in jobs] if body.return_token_ids else None,
                      body.prompt_logprobs is not None, bool(opts and opts.include_usage and opts.continuous_usage_stats),
                      "predicted_output" in params)

        def reply(firsts: list[dict], leases: list[_GroupLease], rid: str):
            meta = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "created": int(time.time()), "model": self.model_name}
            answers = [toolcalls.ChatAnswer(tools) for _ in jobs] if chat else None
            echoes = None  # completions' echo: per choice, the prompt's text and its tokens' logprobs (if asked)
            if echo is not None:
                echoes = [(text, self._prompt_logprobs(first, ids, shape.as_ids) if params["logprobs"] is not None else None)
                          for text, first, (ids, _) in zip(echo, firsts, jobs)]
            if shape.prompt_logprobs:  # vLLM's own shape, beside OpenAI's echo
                shape.prompt_logprobs = [self._vllm_prompt_logprobs(first, ids) for first, (ids, _) in zip(firsts, jobs)]
            if not body.stream:
                return self._collect(firsts, leases, meta, n_prompt, chat, answers, echoes, shape)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._sse(firsts, leases, meta, n_prompt, chat, include_usage, answers, echoes, shape)

        return await self.start_streams(request, jobs, body.stream, reply, body.request_id)

    async def start_streams(self, request: Request, jobs: list[tuple[list[int], dict]], stream: bool, reply,
                            given_id: str | None = None):
        """Send each job (prompt ids, engine params) to the least-loaded group as its own router request,
        wait for every first event (an error event becomes the HTTP error), then let `reply(firsts,
        leases, rid)` answer: unstreamed, a coroutine giving the body; streamed, an async generator of
        server-sent events that owns the leases from then on (its `finally` must end them). Every
        endpoint that generates goes through here, so draining, leases, rerouting and a client that
        leaves are handled once."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another instance", code="draining", retry_after=5)
        rid = given_id or request_id(request)  # the body's id (vLLM's request_id) names the answer
        self._watch()
        leases: list[_GroupLease] = []
        events = None  # once set, the SSE generator owns the leases
        try:
            for c, (ids, p) in enumerate(jobs):
                lease = _GroupLease(self.in_flight, self._pick_group(), self)
                leases.append(lease)
                lease.upstream = RouterStream(self.routers[lease.group], ids, p, rid if len(jobs) == 1 else f"{rid}-{c}",
                                              stream, self.max_resubmits, self.resubmit_wait_s,
                                              reroute=lease.reroute if len(self.routers) > 1 else None)
                lease.upstream.start()
            firsts = await asyncio.gather(*(lease.upstream.next() for lease in leases))
            for first in firsts:
                if "error" in first:
                    status = first["status"]
                    code = {400: "invalid_value", 503: "engine_unavailable"}.get(status)
                    raise APIError(status, first["error"], code=code, retry_after=first.get("retry_after"))
            if not stream:
                return await reply(firsts, leases, rid)
            events = reply(firsts, leases, rid)
            for lease in leases:
                lease.end_with(events)
            return StreamingResponse(events, media_type="text/event-stream")
        except asyncio.CancelledError:  # the client left while this handler waited on the engine
            for lease in leases:
                lease.end(finished=False)
            raise
        finally:
            if events is None:  # answered or refused here: cancel what is still generating for nobody
                for lease in leases:
                    lease.end(finished=lease.upstream is None or lease.upstream.finished)

    async def _collect(self, firsts: list[dict], leases: list[_GroupLease], meta: dict, n_prompt: int, chat: bool,
                       answers: list[toolcalls.ChatAnswer] | None = None, echoes: list[tuple[str, dict | None]] | None = None,
                       shape: Shape = Shape()):
        """The unstreamed answer. answers: chat's per-choice message builders (tool calls); echoes:
        completions' per-choice prompt text and its logprobs, put first; shape: vLLM's extras for the answer."""
        cached = [0] * len(leases)
        finals: list[dict] = [{}] * len(leases)

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
            finals[c] = ev.get("stats", {})
            return "".join(text), ids, lps, ev["finish_reason"]

        outputs = await asyncio.gather(*(one(c, f, lease.upstream) for c, (f, lease) in enumerate(zip(firsts, leases))))
        choices = []
        top: dict = {}  # vLLM's response-level extras (chat)
        for c, (text, ids, lps, reason) in enumerate(outputs):
            if chat:
                message, reason = (answers[c] if answers else toolcalls.ChatAnswer(None)).message(text, reason)
                choice = {"index": c, "message": message, "logprobs": self._format_logprobs(ids, lps, chat, as_ids=shape.as_ids)}
            else:
                prompt_text, prompt_lps = echoes[c] if echoes else ("", None)
                logprobs = self._format_logprobs(ids, lps, chat, offset=len(prompt_text), as_ids=shape.as_ids)
                choice = {"index": c, "text": prompt_text + text, "logprobs": _joined(prompt_lps, logprobs)}
            choice["finish_reason"] = reason
            if shape.prompt_ids is not None:
                choice["token_ids"] = ids
                if chat:
                    top["prompt_token_ids"] = shape.prompt_ids[c]
                else:
                    choice["prompt_token_ids"] = shape.prompt_ids[c]
            if shape.prompt_logprobs:
                if chat:
                    top["prompt_logprobs"] = shape.prompt_logprobs[c]
                else:
                    choice["prompt_logprobs"] = shape.prompt_logprobs[c]
            choices.append(choice)
        n_out = sum(len(ids) for _, ids, _, _ in outputs)
        predicted = None
        if shape.prediction:
            predicted = dict.fromkeys(PREDICTION_COUNTS, 0)
            for stats in finals:
                _add_prediction(predicted, stats)
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": _usage(n_prompt, n_out, max(cached), predicted), **top}

    async def _sse(self, firsts: list[dict], leases: list[_GroupLease], meta: dict, n_prompt: int, chat: bool,
                   include_usage: bool, answers: list[toolcalls.ChatAnswer] | None = None,
                   echoes: list[tuple[str, dict | None]] | None = None, shape: Shape = Shape()):
        """The streamed answer: chat deltas (text, or tool calls as `answers` find or force them) or
        completions text (after the echoed prompt of `echoes`), then usage and [DONE]. shape: vLLM's extras
        (token ids with the chunks that carry them, the prompt's in each choice's first chunk; usage in every
        chunk)."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        answers = answers or [toolcalls.ChatAnswer(None) for _ in leases]

        offsets = [0] * len(leases)  # completions' text_offset runs on across chunks
        predicted = dict.fromkeys(PREDICTION_COUNTS, 0) if shape.prediction else None
        n_out, cached = 0, 0

        def chunk(c: int, finish: str | None, delta: dict | None = None, text: str = "", lps: dict | None = None,
                  ids: list[int] | None = None, first: bool = False) -> str:
            if chat:
                choice = {"index": c, "delta": delta or {}, "logprobs": lps, "finish_reason": finish}
            else:
                choice = {"index": c, "text": text, "logprobs": lps, "finish_reason": finish}
                offsets[c] += len(text)
            top = {}
            if shape.prompt_ids is not None:
                choice["token_ids"] = ids or []
                if first:
                    (top if chat else choice)["prompt_token_ids"] = shape.prompt_ids[c]
            if first and shape.prompt_logprobs:
                (top if chat else choice)["prompt_logprobs"] = shape.prompt_logprobs[c]
            if shape.continuous_usage:
                top["usage"] = _usage(n_prompt, n_out, cached, predicted)
            return f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice], **top})}\n\n"

        def logprobs(c: int, ev: dict) -> dict | None:
            return (self._format_logprobs(ev["token_ids"], ev["logprobs"], chat, offsets[c], shape.as_ids)
                    if "logprobs" in ev else None)

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
        open_choices = len(pumps)
        opened = [False] * len(pumps)  # the choice's first chunk went out (it carries the prompt's extras)
        try:
            for c in range(len(pumps)):
                if chat:
                    yield chunk(c, None, {"role": "assistant", "content": ""}, first=True)
                    opened[c] = True
                elif echoes:
                    yield chunk(c, None, text=echoes[c][0], lps=echoes[c][1], first=True)
                    opened[c] = True
            while open_choices:
                c, ev = await queue.get()
                n_out += len(ev["token_ids"])
                ids = ev["token_ids"]
                if ev.get("error"):
                    err = {"message": ev["error"], "type": ERROR_TYPES[503], "param": None, "code": "engine_error"}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    return
                lps = logprobs(c, ev) if ev.get("logprobs") else None
                if ev["finished"]:
                    cached = max(cached, ev.get("stats", {}).get("cached_tokens", 0))
                    _add_prediction(predicted, ev.get("stats"))
                if chat:
                    # text held back (a tool call being read) still sends its tokens' logprobs (and ids)
                    deltas = answers[c].deltas(ev["text"]) or ([{}] if lps or (ids and shape.prompt_ids) else [])
                    for i, delta in enumerate(deltas):
                        yield chunk(c, None, delta, lps=lps if i == 0 else None, ids=ids if i == 0 else None)
                elif ev["text"] or lps or (ids and shape.prompt_ids is not None):
                    yield chunk(c, None, text=ev["text"], lps=lps, ids=ids, first=not opened[c])
                    opened[c] = True
                if ev["finished"]:
                    open_choices -= 1
                    reason = ev["finish_reason"]
                    if chat:
                        deltas, reason = answers[c].end(reason)
                        for delta in deltas:
                            yield chunk(c, None, delta)
                    yield chunk(c, reason, first=not opened[c])
                    opened[c] = True
            if include_usage:
                usage = _usage(n_prompt, n_out, cached, predicted)
                yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for t in pumps:
                t.cancel()
            # A choice not finished: the client left mid-stream (or an error event ended it), so cancel
            # its router request. A generator that never started never gets here: see `_GroupLease`.
            for lease in leases:
                lease.end(lease.upstream.finished)
