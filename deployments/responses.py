"""OpenAI's Responses API, `POST /v1/responses`, over the same engine as chat completions.

A request becomes chat messages (`instructions` first, as a system message, then `input`) that go
through the chat template, and is sent to an engine group the way a chat completion is
(`OpenAIIngress.start_streams`: leases, rerouting, draining, a client that leaves). The answer is
OpenAI's Response object, or, with `stream: true`, its typed server-sent events.

Every field of OpenAI's request schema is in exactly one of three sets (tests/test_responses.py walks
the schema of the installed openai package): HANDLED fields take effect; NO_EFFECT fields are
accepted and change nothing here; REFUSED fields get a 400 naming them when set to a value that
would change the answer (tools, stored state, background runs, reasoning). A field outside the schema
gets a 400 too: silently ignoring it would answer a different question than the one asked. Nothing
is stored, so there is no `GET /v1/responses/{id}`.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serve_app import tools as toolcalls
from serve_app.prompts import check_text, encode_chat

from .errors import APIError

DEFAULT_MAX_OUTPUT_TOKENS = 256
"""Tokens generated when `max_output_tokens` is not given (as chat's default), or the server's
`max_tokens_limit` if that is lower."""

LOGPROBS = "message.output_text.logprobs"
INCLUDE_HANDLED = frozenset({LOGPROBS})
"""`include` values that take effect: the target's log-probabilities of the output tokens."""
INCLUDE_NO_EFFECT = frozenset({"reasoning.encrypted_content"})
"""`include` values accepted without effect: they ask for parts of items this server never makes
(no reasoning items). Every other value names tool or image items, and is refused."""


class TextConfig(BaseModel):
    """`text`: the output's format."""

    model_config = ConfigDict(extra="forbid")

    format: dict | None = None
    """{"type": "text"} (the default), {"type": "json_schema", "schema": {...}, "name": ...} or
    {"type": "json_object"}: the JSON ones constrain decoding through the engine's `structured`."""

    verbosity: Literal["low", "medium", "high"] | None = None
    """Only "medium" (the default): a model that was not trained for it cannot be told to be terser."""


class ResponsesRequest(BaseModel):
    """The body of `POST /v1/responses`, in OpenAI's field names (see HANDLED, NO_EFFECT, REFUSED)."""

    model_config = ConfigDict(extra="forbid")

    # ---- HANDLED: these take effect -------------------------------------------------------------
    model: str
    """The served model's name (`GET /v1/models`); any other gets a 400."""

    input: str | list
    """A string (one user message), or a list of message items: {"role": user | system | developer |
    assistant, "content": a string or a list of input_text / output_text / refusal parts}, with or
    without "type": "message". Other item types (tool calls and outputs, reasoning, item references)
    and image, audio or file parts get a 400."""

    instructions: str | None = None
    """A system message placed before `input`."""

    max_output_tokens: int | None = Field(None, ge=1)
    """Most tokens to generate; the response is "incomplete" (reason max_output_tokens) when it stops
    there. Default: DEFAULT_MAX_OUTPUT_TOKENS."""

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    """Sampling temperature; 0 is greedy. Default 1, as in OpenAI's API."""

    top_p: float | None = Field(None, gt=0.0, le=1.0)
    """Nucleus sampling. Default 1."""

    stream: bool | None = None
    """Answer with server-sent events (response.created ... response.completed)."""

    text: TextConfig | None = None
    """The output's format (see TextConfig)."""

    include: list[str] | None = None
    """Extra output: "message.output_text.logprobs" gives the target's log-probabilities of the output
    tokens (with `top_logprobs` alternatives each); "reasoning.encrypted_content" is accepted and adds
    nothing; any other value gets a 400."""

    top_logprobs: int | None = Field(None, ge=0, le=20)
    """Alternatives per output token when `include` asks for logprobs (without it, no effect, as in vLLM)."""

    # ---- NO_EFFECT: accepted, and change nothing here ---------------------------------------------
    user: str | None = None
    """An end-user id for OpenAI's abuse checks; not used."""

    safety_identifier: str | None = None
    """An end-user id for OpenAI's abuse checks; not used."""

    metadata: dict[str, str] | None = None
    """Key-value pairs echoed on the response (nothing is stored to query them by)."""

    store: bool | None = None
    """Nothing is stored, whatever this says: a response cannot be fetched again, and
    `previous_response_id` is refused."""

    service_tier: str | None = None
    """There is one tier; responses say "default"."""

    prompt_cache_key: str | None = None
    """Prefix caching here is automatic (shared prompt prefixes reuse their KV) and needs no key."""

    prompt_cache_retention: str | None = None
    """Cached prefixes live while the KV pool has room; there is no retention to choose."""

    parallel_tool_calls: bool | None = None
    """There are no tools (see `tools`)."""

    max_tool_calls: int | None = None
    """There are no tools (see `tools`)."""

    stream_options: dict | None = None
    """`include_obfuscation`: stream events never carry obfuscation padding here."""

    image: dict | None = None
    """Image options; images are refused in `input`, so there is nothing to apply them to."""

    access_programs: dict | None = None
    """OpenAI's access programs for some models; not applicable here."""

    # ---- REFUSED: a 400 when set to a value that would change the answer (see REFUSED) ----------
    tools: list | None = None
    """Only empty: no function calling or built-in tools."""

    tool_choice: str | dict | None = None
    """Only "auto" or "none" (with no tools both mean: answer in text)."""

    previous_response_id: str | None = None
    """Only null: nothing is stored, so send the whole conversation in `input`."""

    conversation: str | dict | None = None
    """Only null: nothing is stored."""

    prompt: dict | None = None
    """Only null: there are no stored prompt templates."""

    background: bool | None = None
    """Only false: there are no background runs (nothing stored to poll)."""

    background_options: dict | None = None
    """Only empty, as there are no background runs."""

    reasoning: dict | None = None
    """Only empty or effort "none": this model does not reason."""

    context_management: list | None = None
    """Only empty: no context compaction."""

    moderation: dict | None = None
    """Only null: no moderation model here."""

    truncation: Literal["auto", "disabled"] | None = None
    """Only "disabled" (the default): an input over the context gets a 400, it is never cut."""

    prompt_cache_options: dict | None = None
    """Accepted without effect, except `prewarm: true` (caching without generating): refused."""

    # ---- VLLM_HANDLED: vLLM's sampling extras on this endpoint (load tools such as guidellm send them) ----
    stop: str | list[str] | None = None
    """Generation ends before the first of these strings."""

    ignore_eos: bool | None = None
    """Generate past the end-of-sequence token, up to max_output_tokens."""

    min_tokens: int | None = Field(None, ge=0)
    """End-of-sequence is banned until this many tokens."""

    top_k: int | None = Field(None, ge=-1)
    """Keep the k most likely tokens (-1 or 0: all)."""

    min_p: float | None = Field(None, ge=0.0, le=1.0)
    """Keep tokens at least min_p times as likely as the most likely one."""

    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    """Logits of tokens already seen divided (positive) or multiplied (negative) by it."""

    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    """Seeded sampling: the same text at any speculation length."""

    priority: int | None = Field(None, ge=-(2**31), lt=2**31)
    """Admission order while requests wait: lower first."""

    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    """Prefix-cache entries are shared only between requests with the same salt."""

    request_id: str | None = Field(None, min_length=1, max_length=256)
    """The request's id, in the response's id (resp_<id>)."""

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, v):
        # checked here so a wrong type reads as one message, not one per member of the union
        if not isinstance(v, (str, list)):
            raise ValueError("a string or a list of message items")
        return v


def _unset(v) -> bool:
    return v is None


def _empty(v) -> bool:
    return not v


def _no_reasoning(v) -> bool:
    """Reasoning settings that ask for no reasoning (or only say what is default)."""
    default = {("effort", "none"), ("mode", "standard")}
    return not v or all(x is None or (k, x) in default for k, x in v.items())


HANDLED = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
                     "text", "include", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"})
"""Fields that take effect."""

VLLM_HANDLED = frozenset({"stop", "ignore_eos", "min_tokens", "top_k", "min_p", "repetition_penalty", "seed", "priority",
                          "cache_salt", "request_id"})
"""vLLM's extra fields that take effect here, as on chat completions."""

NO_EFFECT = frozenset({"user", "safety_identifier", "metadata", "store", "service_tier", "prompt_cache_key",
                       "prompt_cache_retention", "max_tool_calls", "stream_options", "image", "access_programs"})
"""Fields accepted whatever their (well-typed) value, that change nothing here."""

REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # field: (accepts: the values that change nothing here, why any other value gets a 400)
    "previous_response_id": (_unset, "nothing is stored here: send the whole conversation in `input`"),
    "conversation": (_unset, "nothing is stored here: send the whole conversation in `input`"),
    "prompt": (_unset, "there are no stored prompt templates here: send the text in `input`"),
    "background": (_empty, "background responses are not supported (nothing is stored to poll)"),
    "background_options": (_empty, "background responses are not supported"),
    "reasoning": (_no_reasoning, "this model does not reason; leave reasoning unset"),
    "context_management": (_empty, "context compaction is not supported"),
    "moderation": (_unset, "moderation is not available here"),
    "truncation": (lambda v: v in (None, "disabled"), "only 'disabled': an input over the context is refused, never cut"),
    "prompt_cache_options": (lambda v: not (v or {}).get("prewarm"),
                             "prewarm is not supported (prefix caching here is automatic)"),
}
"""Fields refused (400 naming them) when set to a value that would change the answer."""


def parse_request(body: dict) -> ResponsesRequest:
    """The validated request; a 400 naming the field for unknown fields, bad values and refusals."""
    unknown = [k for k in body if k not in ResponsesRequest.model_fields]
    if unknown:
        raise APIError(400, f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
                       "not part of OpenAI's Responses API", unknown[0], "unknown_parameter")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param, "invalid_value") from None
    for field, (accepts, why) in REFUSED.items():
        if not accepts(getattr(req, field)):
            raise APIError(400, f"{field}: {why}", field, "unsupported_parameter")
    for value in req.include or []:
        if value not in INCLUDE_HANDLED | INCLUDE_NO_EFFECT:
            raise APIError(400, f"include: {value!r} is not available here (only {LOGPROBS!r})", "include", "unsupported_value")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise APIError(400, "text.verbosity: only 'medium'", "text.verbosity", "unsupported_value")
    structured_output(req.text)  # a bad text.format is refused before any work
    tool_choice(req)  # so are bad tools
    return req


def tool_choice(req: ResponsesRequest) -> toolcalls.Choice:
    """How `tools` and `tool_choice` resolve, through chat's rules (`serve_app.tools`): Responses' flat function
    tools ({"type": "function", "name", "parameters", ...}) are chat's nested ones; built-in tools are a 400."""
    chat_tools = []
    for i, t in enumerate(req.tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise APIError(400, f"tools[{i}]: only function tools are supported here (no built-in tools; got {kind!r})",
                           "tools", "unsupported_value")
        chat_tools.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        listed = [{"type": "function", "function": {"name": t.get("name")}} if isinstance(t, dict) else t
                  for t in choice.get("tools") or []]
        choice = {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": listed}}
    try:
        return toolcalls.check_tool_choice(choice, toolcalls.check_tools(chat_tools), req.parallel_tool_calls is not False)
    except toolcalls.ToolError as e:
        raise APIError(400, str(e), e.param, "invalid_value") from None


def structured_output(text: TextConfig | None) -> dict | None:
    """The engine's `structured` constraint for `text.format`; None for plain text."""
    fmt = (text.format if text is not None else None) or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format.schema: a JSON schema object is required for type 'json_schema'",
                           "text.format.schema", "invalid_value")
        return {"json_schema": fmt["schema"]}
    raise APIError(400, f"text.format.type: one of 'text', 'json_schema' or 'json_object', not {kind!r}",
                   "text.format.type", "invalid_value")


ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}  # part type -> its text field
MEDIA_PARTS = ("input_image", "input_file", "input_audio")


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"{where}: a string", where, "invalid_value")
    try:
        return check_text(value, where)
    except ValueError as e:
        raise APIError(400, str(e), where, "invalid_value") from None


def _content_text(content, where: str) -> str:
    """A message item's text: the string itself, or its text parts joined by newlines."""
    if isinstance(content, str):
        return _text(content, where)
    if not isinstance(content, list):
        raise APIError(400, f"{where}: a string or a list of input_text parts", where, "invalid_value")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        field = TEXT_PARTS.get(kind)
        if field and isinstance(part.get(field), str):
            texts.append(_text(part[field], f"{where}[{j}]"))
        elif kind in MEDIA_PARTS:
            raise APIError(400, f"{where}[{j}]: parts of type {kind!r} are not supported (this model reads text only)",
                           f"{where}[{j}].type", "unsupported_value")
        else:
            raise APIError(400, f"{where}[{j}] must be {{'type': 'input_text', 'text': string}}", f"{where}[{j}]",
                           "invalid_value")
    return "\n".join(texts)


def to_messages(req: ResponsesRequest) -> list[dict]:
    """Chat messages [{role, content: str}] for the chat template: instructions, then input."""
    messages = [{"role": "system", "content": _text(req.instructions, "instructions")}] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": _text(req.input, "input")}]
    if not req.input:
        raise APIError(400, "input: an empty list", "input", "invalid_value")
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: a message item {{'role': ..., 'content': ...}}", where, "invalid_value")
        kind = item.get("type", "message")
        if kind == "function_call":  # an earlier answer's call: an assistant turn's tool_calls (consecutive ones: one turn)
            call = {"id": _text(item.get("call_id"), f"{where}.call_id"), "type": "function",
                    "function": {"name": _text(item.get("name"), f"{where}.name"),
                                 "arguments": _text(item.get("arguments"), f"{where}.arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":  # its result: a tool turn
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _text(item.get("call_id"), f"{where}.call_id"),
                             "content": _content_text(output, f"{where}.output")})
            continue
        if kind != "message":
            raise APIError(400, f"{where}: items of type {kind!r} are not supported (messages, function calls and their "
                           "outputs only: no reasoning or item references)", f"{where}.type", "unsupported_value")
        if item.get("role") not in ROLES:
            raise APIError(400, f"{where}.role: one of {', '.join(ROLES)}", f"{where}.role", "invalid_value")
        messages.append({"role": item["role"], "content": _content_text(item.get("content"), f"{where}.content")})
    return messages


def engine_params(req: ResponsesRequest, max_tokens: int, choice: toolcalls.Choice | None = None) -> dict:
    """The engine's sampling parameters (serve_app.config.SamplingParams) for this request (choice: how its
    tools resolved, if the caller has it already)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        if any(not check_text(s, "stop") for s in stop):
            raise ValueError("stop: stop strings must be non-empty")
    except ValueError as e:
        raise APIError(400, str(e), "stop", "invalid_value") from None
    params = {"max_tokens": max_tokens, "temperature": 1.0 if req.temperature is None else req.temperature,
              "top_p": 1.0 if req.top_p is None else req.top_p, "top_k": max(req.top_k or 0, 0), "seed": req.seed,
              "stop": stop,
              "logprobs": (req.top_logprobs or 0) if LOGPROBS in (req.include or []) else None}
    if req.min_tokens and req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens: {req.min_tokens} is more than max_output_tokens ({max_tokens})", "min_tokens",
                       "invalid_value")
    for name, off in (("ignore_eos", False), ("min_tokens", 0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                      ("priority", 0), ("cache_salt", None)):
        value = getattr(req, name)
        if value is not None and value != off:  # only what the request sets: plain params stay as they were
            params[name] = value
    structured = structured_output(req.text)
    choice = choice or tool_choice(req)
    forced = toolcalls.forced_schema(choice)
    if structured is not None and choice.mode == "auto":
        raise APIError(400, "text.format: a JSON format leaves no room for tool calls under tool_choice 'auto'; use "
                       "'none', 'required' or a named function", "text.format", "invalid_value")
    if forced is not None:  # the answer is calls, no text: text.format (the format of text output) has nothing to shape
        structured = {"json_schema": forced}
    if structured is not None:  # only then: plain requests do not depend on the engine knowing the key
        params["structured"] = structured
    return params


class ResponseWriter:
    """One response's Response objects and stream events, built from its engine events
    ({text, token_ids, finished, finish_reason, logprobs?, stats?} or {error})."""

    def __init__(self, req: ResponsesRequest, rid: str, model: str, n_prompt: int,
                 logprobs_of: Callable[[list[int], list], list[dict]] | None = None, choice: toolcalls.Choice | None = None):
        self.req, self.model, self.n_prompt = req, model, n_prompt
        # the request id in both ids, as chat's chatcmpl-<request id>: one id in the logs and the body
        self.id, self.item_id, self.rid = f"resp_{rid}", f"msg_{rid}", rid
        choice = choice or tool_choice(req)
        self.answer = toolcalls.ChatAnswer(choice) if choice.mode != "none" else None  # calls read from or forced on the text
        self.created_at = int(time.time())
        self.logprobs_of = logprobs_of  # (token ids, the engine's logprobs) -> OpenAI's logprob entries
        self.seq = 0  # the next event's sequence_number
        self.text: list[str] = []
        self.ids: list[int] = []
        self.lps: list = []
        self.finish_reason: str | None = None
        self.cached = 0

    def add(self, ev: dict) -> None:
        self.text.append(ev["text"])
        self.ids += ev["token_ids"]
        self.lps += ev.get("logprobs") or []
        if ev["finished"]:
            self.finish_reason = ev["finish_reason"]
            self.cached = ev.get("stats", {}).get("cached_tokens", 0)

    def status(self) -> str:
        """"incomplete" when the output stopped at max_output_tokens (or the context), else "completed"."""
        return "incomplete" if self.finish_reason == "length" else "completed"

    def entries(self, ids: list[int], lps: list | None) -> list[dict]:
        if not lps or self.logprobs_of is None:
            return []
        return self.logprobs_of(ids, lps)

    def part(self) -> dict:
        return {"type": "output_text", "text": "".join(self.text), "annotations": [], "logprobs": self.entries(self.ids, self.lps)}

    def message(self, status: str) -> dict:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": [self.part()]}

    def output(self, status: str) -> list[dict]:
        """The output items: the message, or with tools the text outside calls (if any) and a function_call
        item per call (as chat's tool_calls)."""
        if self.answer is None:
            return [self.message(status)]
        message, _ = self.answer.message("".join(self.text), self.finish_reason)
        items = []
        if message["content"]:
            items.append({**self.message(status), "content": [{**self.part(), "text": message["content"]}]})
        for i, call in enumerate(message.get("tool_calls", [])):
            items.append({"type": "function_call", "id": f"fc_{self.rid}_{i}", "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status})
        return items or [self.message(status)]

    def usage(self) -> dict:
        n_out = len(self.ids)
        # cache_write_tokens: the prompt tokens computed here, which the prefix cache then holds (in whole
        # blocks: up to a block's worth of the last ones is not kept)
        details = {"cached_tokens": self.cached, "cache_write_tokens": self.n_prompt - self.cached}
        return {"input_tokens": self.n_prompt, "input_tokens_details": details,
                "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.n_prompt + n_out}

    def response(self, status: str) -> dict:
        """The Response object: "in_progress" (no output yet), "completed" or "incomplete"."""
        req, done = self.req, status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model, "output": self.output(status) if done else [],
            "usage": self.usage() if done else None,
            # the request's settings as they applied, which OpenAI's Response echoes
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "top_logprobs": req.top_logprobs or 0,
            "text": {"format": (req.text.format if req.text else None) or {"type": "text"}, "verbosity": "medium"},
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {}, "user": req.user,
            "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "truncation": "disabled",
            "service_tier": "default", "background": False, "store": False,
        }

    def event(self, kind: str, **fields) -> str:
        """One server-sent event in OpenAI's shape: an `event:` line and the typed JSON."""
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    async def collect(self, first: dict, next_event) -> dict:
        """The whole Response, from the first event and `next_event()` for the rest."""
        ev = first
        while True:
            if ev.get("error"):
                raise APIError(503, ev["error"], code="engine_error")
            self.add(ev)
            if ev["finished"]:
                return self.response(self.status())
            ev = await next_event()

    def item_events(self, index: int, item: dict):
        """A whole output item's events, opened and closed at once (a message's text or a call's arguments
        as one delta)."""
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            yield self.event("response.output_item.added", output_index=index,
                             item={**item, "arguments": "", "status": "in_progress"})
            yield self.event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield self.event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            yield self.event("response.output_item.added", output_index=index,
                             item={**item, "content": [], "status": "in_progress"})
            yield self.event("response.content_part.added", **at, content_index=0, part={**part, "text": "", "logprobs": []})
            yield self.event("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=part["logprobs"])
            yield self.event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=part["logprobs"])
            yield self.event("response.content_part.done", **at, content_index=0, part=part)
        yield self.event("response.output_item.done", output_index=index, item=item)

    async def stream(self, first: dict, next_event):
        """The events of a streamed response: created, in_progress, the message item and its text part
        opening, one output_text.delta per piece of text, their closings, then completed (or incomplete).
        With tools the items (text outside calls, calls) are known once the text is whole: each goes out whole
        at the end. An engine failure mid-way is an `error` event, and the stream ends there."""
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        live = self.answer is None  # text streams as it comes
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        if live:
            item = {"type": "message", "id": self.item_id, "status": "in_progress", "role": "assistant", "content": []}
            yield self.event("response.output_item.added", output_index=0, item=item)
            yield self.event("response.content_part.added", **at,
                             part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        ev = first
        while True:
            if ev.get("error"):
                yield self.event("error", code="engine_error", message=ev["error"], param=None)
                return
            self.add(ev)
            if live and (ev["text"] or ev.get("logprobs")):
                yield self.event("response.output_text.delta", **at, delta=ev["text"],
                                 logprobs=self.entries(ev["token_ids"], ev.get("logprobs")))
            if ev["finished"]:
                break
            ev = await next_event()
        status = self.status()
        if live:
            part = self.part()
            yield self.event("response.output_text.done", **at, text=part["text"], logprobs=part["logprobs"])
            yield self.event("response.content_part.done", **at, part=part)
            yield self.event("response.output_item.done", output_index=0, item=self.message(status))
        else:
            for index, item in enumerate(self.output(status)):
                for chunk in self.item_events(index, item):
                    yield chunk
        yield self.event(f"response.{status}", response=self.response(status))


async def create_response(ingress, request, body: dict):
    """POST /v1/responses on `ingress` (an OpenAIIngress): one request to the least-loaded group."""
    req = parse_request(body)
    ingress._check_model(req.model)
    limit = ingress.max_tokens_limit
    max_tokens = req.max_output_tokens or min(DEFAULT_MAX_OUTPUT_TOKENS, limit)
    if max_tokens > limit:
        raise APIError(400, f"max_output_tokens: {max_tokens} is over this server's limit of {limit}",
                       "max_output_tokens", "invalid_value")
    choice = tool_choice(req)
    native = toolcalls.template_supports_tools(ingress.tokenizer)
    if choice.mode == "auto" and not native:
        raise APIError(400, "tool_choice: 'auto' (the default with tools) lets the model decide to call a tool, but this "
                       "model's chat template does not render tools; use tool_choice 'required' or a named function "
                       "(the output is then constrained to a call), or 'none'", "tool_choice", "unsupported_value")
    rendered = [{"type": "function", "function": t} for t in choice.tools] if choice.mode != "none" and native else None
    try:
        ids = encode_chat(ingress.tokenizer, to_messages(req), tools=rendered)
    except ValueError as e:  # every message empty, or no chat template
        raise APIError(400, f"input: {e}", "input", "invalid_value") from None
    params = engine_params(req, max_tokens, choice)
    stream = bool(req.stream)

    def logprobs_of(token_ids: list[int], lps: list) -> list[dict]:
        return ingress._format_logprobs(token_ids, lps, chat=True)["content"]  # chat's entries are Responses' too

    def reply(firsts: list[dict], leases: list, rid: str):
        writer = ResponseWriter(req, rid, ingress.model_name, len(ids), logprobs_of, choice)
        if not stream:
            return writer.collect(firsts[0], leases[0].upstream.next)
        return _sse(writer, firsts[0], leases[0])

    return await ingress.start_streams(request, [(ids, params)], stream, reply, req.request_id)


async def _sse(writer: ResponseWriter, first: dict, lease):
    """The streamed body; it owns the request's lease (see OpenAIIngress.start_streams): ended when the
    stream ends, and the router request cancelled if it was not finished (the client left)."""
    try:
        async for chunk in writer.stream(first, lease.upstream.next):
            yield chunk
    finally:
        lease.end(lease.upstream.finished)
