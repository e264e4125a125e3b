"""OpenAI-compatible HTTP ingress: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models, /health,
/healthz, /readyz, /tokenize, /metrics.

Validates requests (the bodies: protocol.py; errors in OpenAI's shape: errors.py), tokenizes, and sends
each request to the engine group with the fewest requests in flight. The answers (answers.py) stream as
server-sent events the way the openai python client expects: one chunk per accepted piece of text, then
`data: [DONE]`. A Router replica dying mid-request does not end the stream: the request goes again to the
group with the tokens already received as context (upstream.py). `drain()` stops admitting for a shutdown.
"""


import asyncio
import hmac
import importlib.metadata
import json
import logging
import os
import re
import time

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from serve_app import tools as toolcalls
from serve_app.config import StructuredOutput
from serve_app.models import load_tokenizer
from serve_app.prompts import RESERVED_TEMPLATE_VARS, ChatTemplating, check_text, encode_chat, encode_prompt, message_text

from . import openai_fields
from .answers import Shape, collect, sse
from .errors import APIError, install_handlers
from .prometheus import render_metrics
from .protocol import (ChatRequest, CompletionRequest, DetokenizeRequest, SamplingFields, TokenizeRequest, _json_value,
                       _response_format)
from .responses import create_response
from .router import Router
from .upstream import GroupLease, InProcessRouter, RouterStream, request_id

GROUP_HEADER = "x-specserve-group"
"""Request header: serve on this engine group (a GPU type), not the least-loaded one (tests, debugging one
group). Response header: the group(s) that served, comma-separated."""

app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding server")
install_handlers(app)


class NameTheGroup:
    """ASGI middleware: the answer names the engine group(s) that served it (`GROUP_HEADER`, which `start_streams`
    leaves in the request's state). Plain ASGI, not Starlette's BaseHTTPMiddleware, so streamed answers and
    clients that leave behave exactly as without it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                groups = scope.get("state", {}).get("groups")
                if groups:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (GROUP_HEADER.encode(), groups.encode())]}
            await send(message)

        await self.app(scope, receive, named)


app.add_middleware(NameTheGroup)
log = logging.getLogger("ray.serve")
try:
    SERVER_VERSION = importlib.metadata.version("specserve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    SERVER_VERSION = "0+unknown"

MAX_CHOICES = 16
"""Most choices one request may ask for (prompts x n): each is a sequence in the batch."""


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(app)
class OpenAIIngress:
    async def __init__(self, routers: list, groups: list[str], target: str, served_model_name: str,
                       max_tokens_limit: int, max_stop_strings: int, max_resubmits: int = 2,
                       resubmit_wait_s: float = 120.0, store=None, group_replicas: list[int] | None = None):
        # routers: per group its Router deployment's handle, or {"in_process": Router's arguments} to host
        # that Router here (`AppConfig.router_in_ingress`)
        routers = [await InProcessRouter.start(Router.func_or_class, *r["in_process"]) if isinstance(r, dict) else r
                   for r in routers]
        self.hosted = [r for r in routers if isinstance(r, InProcessRouter)]
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

    async def check_health(self) -> None:
        """Serve's health check: a Router hosted here is checked (and its workers repaired) as its own
        deployment would be; one that keeps failing takes this replica down, and Serve replaces it whole."""
        for r in self.hosted:
            await r.router.check_health()

    def __del__(self):
        for r in getattr(self, "hosted", []):
            r.router.__del__()

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

    async def breakdown(self) -> dict:
        """Each engine group's step breakdown since the last call (`Router.breakdown`; one replica of each)."""
        return await self._each_group("breakdown")

    async def stats(self) -> dict:
        """Each engine group's `Router.stats()` (one replica of each): what a Router deployment's handle gives, also
        where the ingress hosts the Router (`specserve stats`-like tools, tests)."""
        return await self._each_group("stats")

    async def _each_group(self, method: str) -> dict:
        """One Router replica's `method()` per group; a group that fails gives {"error": ...}."""
        names = list(self.routers)
        out = await asyncio.gather(*(getattr(self.routers[g], method).remote() for g in names), return_exceptions=True)
        return {g: ({"error": f"{type(b).__name__}: {b}"} if isinstance(b, BaseException) else b) for g, b in zip(names, out)}

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

        def reply(firsts: list[dict], leases: list[GroupLease], rid: str):
            meta = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "created": int(time.time()), "model": self.model_name}
            answers = [toolcalls.ChatAnswer(tools) for _ in jobs] if chat else None
            echoes = None  # completions' echo: per choice, the prompt's text and its tokens' logprobs (if asked)
            if echo is not None:
                echoes = [(text, self._prompt_logprobs(first, ids, shape.as_ids) if params["logprobs"] is not None else None)
                          for text, first, (ids, _) in zip(echo, firsts, jobs)]
            if shape.prompt_logprobs:  # vLLM's own shape, beside OpenAI's echo
                shape.prompt_logprobs = [self._vllm_prompt_logprobs(first, ids) for first, (ids, _) in zip(firsts, jobs)]
            if not body.stream:
                return collect(self, firsts, leases, meta, n_prompt, chat, answers, echoes, shape)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(self, firsts, leases, meta, n_prompt, chat, include_usage, answers, echoes, shape)

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
        pinned = getattr(request, "headers", {}).get(GROUP_HEADER)
        if pinned is not None and pinned not in self.routers:
            raise APIError(400, f"{GROUP_HEADER}: no engine group {pinned!r} (groups: {', '.join(self.routers)})",
                           code="invalid_value")
        self._watch()
        leases: list[GroupLease] = []
        events = None  # once set, the SSE generator owns the leases
        try:
            for c, (ids, p) in enumerate(jobs):
                lease = GroupLease(self.in_flight, pinned or self._pick_group(), self)
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
            if hasattr(request, "state"):  # for `NameTheGroup` (a test's stand-in request may have none)
                request.state.groups = ",".join(dict.fromkeys(lease.group for lease in leases))
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
