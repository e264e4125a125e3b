"""Tool calling for chat completions, as pure functions: check the request's tools and tool_choice,
build the JSON schema that forces a call, tell whether a chat template renders tools, turn earlier
calls into what the template reads, and find the calls in what the model wrote.

Calls the model writes on its own (`tool_choice: auto`) are read in the Hermes / Qwen convention the
chat templates of those models teach: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A
template that does not render tools never taught the model any convention, so `auto` needs one that
does (`template_supports_tools`).
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names (fullmatch)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""A function declared without `parameters` takes none (OpenAI: "an empty parameter list")."""


class ToolError(ValueError):
    """A request's tools, tool_choice or tool-call history are malformed; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Choice:
    """What tool_choice asks for, resolved against the tools."""

    mode: str
    """"none" (no call), "auto" (the model decides), "required" (at least one call) or "named"."""

    tools: tuple[dict, ...]
    """The functions the model may call: {"name", "description", "parameters"} (allowed_tools narrows them)."""

    parallel: bool = True
    """More than one call per answer is allowed (parallel_tool_calls)."""

    @property
    def names(self) -> list[str]:
        return [t["name"] for t in self.tools]


def check_tools(tools) -> list[dict]:
    """The request's function tools as {"name", "description", "parameters"}; other tool types and
    malformed entries raise ToolError naming `tools`."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError("tools: a list of {'type': 'function', 'function': {...}}", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ToolError(f"{where}: only function tools are supported (got type {kind!r})", "tools")
        unknown = set(tool) - {"type", "function"}
        if unknown:
            raise ToolError(f"{where}: unknown field {sorted(unknown)[0]!r}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function: an object with 'name' (and 'description', 'parameters')", "tools")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolError(f"{where}.function: unknown field {sorted(unknown)[0]!r}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name: 1-64 letters, digits, '_' or '-'", "tools")
        if name in seen:
            raise ToolError(f"{where}.function.name: {name!r} is declared twice", "tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters: a JSON schema object", "tools")
        if not isinstance(fn.get("description", ""), str) or not isinstance(fn.get("strict", False), (bool, type(None))):
            raise ToolError(f"{where}.function: 'description' is a string and 'strict' a boolean", "tools")
        try:  # the tool reaches the tokenizer (rendered) or the grammar compiler (forced)
            json.dumps(fn, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ToolError(f"{where}.function holds a lone surrogate (invalid Unicode)", "tools") from None
        out.append({"name": name, "description": fn.get("description", ""), "parameters": params or NO_PARAMETERS})
    return out


def check_tool_choice(choice, tools: list[dict], parallel: bool = True) -> Choice:
    """Resolve tool_choice ("none", "auto", "required", a named function or allowed_tools) against the
    checked tools. Default: "auto" with tools, "none" without (OpenAI's)."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise ToolError("tool_choice: 'required' needs tools", "tool_choice")
        return Choice(choice if tools else "none", tuple(tools), parallel)
    if not isinstance(choice, dict):
        raise ToolError("tool_choice: 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                        "tool_choice")
    by_name = {t["name"]: t for t in tools}
    if choice.get("type") == "function" and set(choice) == {"type", "function"}:
        name = choice["function"].get("name") if isinstance(choice["function"], dict) else None
        if name not in by_name:
            raise ToolError(f"tool_choice: no function named {name!r} in tools (declared: {sorted(by_name)})", "tool_choice")
        return Choice("named", (by_name[name],), parallel)
    if choice.get("type") == "allowed_tools" and isinstance(choice.get("allowed_tools"), dict):
        allowed = choice["allowed_tools"]
        mode, listed = allowed.get("mode"), allowed.get("tools")
        if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
            raise ToolError("tool_choice.allowed_tools: {'mode': 'auto' or 'required', 'tools': [...]}", "tool_choice")
        names = []
        for t in listed:
            fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if name not in by_name:
                raise ToolError(f"tool_choice.allowed_tools: {t!r} is not one of the declared function tools", "tool_choice")
            names.append(name)
        return Choice(mode, tuple(by_name[n] for n in by_name if n in names), parallel)
    if choice.get("type") == "custom":
        raise ToolError("tool_choice: custom tools are not supported (function tools only)", "tool_choice")
    raise ToolError("tool_choice: 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                    "tool_choice")


def closed(schema):
    """A copy of a function's parameter schema where every object that lists its properties and says
    nothing about others allows no others: a forced call then holds the arguments the function takes,
    not keys a small model invents to fill its budget (OpenAI's strict function calling asks the same)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in ("items", "anyOf", "oneOf", "allOf", "prefixItems", "not") else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(s) for name, s in schema[key].items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def required_schema(choice: Choice) -> dict:
    """The JSON schema of a forced answer under "required": a list of calls, each {"name": one of the
    tools, "parameters": that tool's schema}; exactly one call when parallel calls are off."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["name"]]}, "parameters": closed(t["parameters"])},
              "required": ["name", "parameters"], "additionalProperties": False} for t in choice.tools]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not choice.parallel:
        schema["maxItems"] = 1
    return schema


def forced_schema(choice: Choice) -> dict | None:
    """The JSON schema the output is constrained to: the named function's parameters, the list of
    calls for "required"; None for "auto" and "none" (free text)."""
    if choice.mode == "named":
        return closed(choice.tools[0]["parameters"])
    if choice.mode == "required":
        return required_schema(choice)
    return None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str) -> dict:
    """One entry of OpenAI's message.tool_calls."""
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_required(text: str) -> list[dict] | None:
    """The calls of a "required" answer ({"name", "arguments" as JSON text}); None when the text is not
    a complete list of calls (it ran out of tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(x, dict) and isinstance(x.get("name"), str) for x in items):
        return None
    return [{"name": x["name"], "arguments": json.dumps(x.get("parameters", {}), ensure_ascii=False)} for x in items]


# ---- chat templates ---------------------------------------------------------------------------------

def template_source(tokenizer) -> str | None:
    """The chat template's source; of a set of named templates, the one Hugging Face uses with tools."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return template.get("tool_use") or template.get("default")
    return template


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template renders `tools`: it reads the template variable `tools` (Jinja's
    own analysis of the source; a template Jinja cannot parse alone is searched for the word)."""
    source = template_source(tokenizer)
    return bool(source) and _reads_tools(source)


@functools.lru_cache(maxsize=8)  # asked for every chat request; a template is parsed once
def _reads_tools(source: str) -> bool:
    import jinja2
    from jinja2 import meta

    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateSyntaxError:  # e.g. Hugging Face's own {% generation %} tag
        return re.search(r"\btools\b", source) is not None


def check_tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls, checked: [{"id", "name", "arguments" (a dict)}]."""
    if not isinstance(calls, list):
        raise ToolError(f"{where}: a list of {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", "messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError(f"{at}: {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", "messages")
        if not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise ToolError(f"{at}.function: 'name' and 'arguments' (a JSON string) are required", "messages")
        try:
            arguments = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
        except ValueError:
            raise ToolError(f"{at}.function.arguments: not valid JSON", "messages") from None
        out.append({"id": call.get("id") or "", "name": fn["name"], "arguments": arguments})
    return out


def render_history(messages: list[dict], native: bool) -> list[dict]:
    """Messages with earlier tool calls and results in the form the chat template reads.

    native (the template renders tools): tool_calls in Hugging Face's shape (arguments as a dict), tool
    results as role "tool" with their tool_call_id. Otherwise both become text, so nothing is lost: a
    call as a <tool_call> block after the assistant's text, a result as a user turn in <tool_response>.
    """
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if m["role"] == "assistant" and calls:
            if native:
                shaped = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                          for c in calls]
                out.append({"role": "assistant", "content": m["content"], "tool_calls": shaped})
            else:
                blocks = [f"{CALL_OPEN}{json.dumps({'name': c['name'], 'arguments': c['arguments']}, ensure_ascii=False)}{CALL_CLOSE}"
                          for c in calls]
                out.append({"role": "assistant", "content": "\n".join([m["content"]] * bool(m["content"]) + blocks)})
        elif m["role"] == "tool":
            if native:
                out.append({"role": "tool", "content": m["content"], "tool_call_id": m.get("tool_call_id", "")})
            else:
                out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


# ---- calls the model wrote on its own (tool_choice "auto") --------------------------------------------

def _read_call(raw: str, names: set[str]) -> dict | None:
    """{"name", "arguments" (JSON text)} from the inside of a <tool_call> block; None when it is not a
    call of a declared function (the block then stays text)."""
    try:
        call = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}


class CallStream:
    """Text as the model writes it in, content and calls out, as soon as each is certain.

    `feed(text)` and `finish()` return events: ("content", str) or ("call", {"name", "arguments"}).
    Held back until certain: a tail that may be the start of a <tool_call> block, a block not yet
    closed, and trailing whitespace (dropped when a call follows it). Whitespace around calls is
    dropped; an answer without calls comes out exactly as written. A block that is not a call of a
    declared function stays text. With `parallel` off, the first call ends the answer.
    """

    def __init__(self, names, parallel: bool = True):
        self.names, self.parallel = set(names), parallel
        self.buf = ""  # text not yet released
        self.ws = ""  # whitespace held at the end of the released content
        self.calls = 0
        self.after_call = False  # the last thing released was a call: leading whitespace is dropped
        self.done = False

    def feed(self, text: str) -> list[tuple]:
        if self.done:
            return []
        self.buf += text
        out = []
        while self.buf and not self.done:
            if self.buf.startswith(CALL_OPEN):
                end = self.buf.find(CALL_CLOSE)
                if end < 0:
                    break  # the block goes on
                block, self.buf = self.buf[: end + len(CALL_CLOSE)], self.buf[end + len(CALL_CLOSE):]
                out += self._block(block, block[len(CALL_OPEN): end])
                continue
            start = self.buf.find(CALL_OPEN)
            cut = start if start >= 0 else len(self.buf) - _partial_open(self.buf)
            released, self.buf = self.buf[:cut], self.buf[cut:]
            out += self._content(released)
            if start < 0:
                break
        return out

    def finish(self) -> list[tuple]:
        """The end of the answer: what was held back. An unclosed block whose JSON is complete still
        counts as a call (a model may stop right after it)."""
        if self.done:
            return []
        rest, self.buf = self.buf, ""
        out = self._block(rest, rest[len(CALL_OPEN):]) if rest.startswith(CALL_OPEN) else self._content(rest)
        if self.ws and not self.calls:
            out.append(("content", self.ws))
        self.ws = ""
        return out

    def _content(self, text: str) -> list[tuple]:
        text = self.ws + text
        if self.after_call:
            text = text.lstrip()
        body = text.rstrip()
        self.ws = text[len(body):]
        if not body:
            return []
        self.after_call = False
        return [("content", body)]

    def _block(self, block: str, inside: str) -> list[tuple]:
        call = _read_call(inside.strip(), self.names)
        if call is None:
            return self._content(block)
        self.ws, self.after_call = "", True
        self.calls += 1
        self.done = not self.parallel
        return [("call", call)]


def _partial_open(buf: str) -> int:
    """Length of the longest tail of buf that could grow into <tool_call>."""
    for n in range(min(len(CALL_OPEN) - 1, len(buf)), 0, -1):
        if buf.endswith(CALL_OPEN[:n]):
            return n
    return 0


def parse_calls(text: str, names, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """(content, calls) of a whole answer under "auto": the text outside <tool_call> blocks (None when
    there were calls and no other text) and the calls of declared functions."""
    stream = CallStream(names, parallel)
    events = stream.feed(text) + stream.finish()
    calls = [e[1] for e in events if e[0] == "call"]
    content = "".join(e[1] for e in events if e[0] == "content")
    return (content or None) if calls else content, calls


# ---- one chat choice's answer -------------------------------------------------------------------------

def finish_reason(engine_reason: str | None, calls: bool) -> str | None:
    """OpenAI's "tool_calls" when an answer that ended normally holds calls; else the engine's reason
    (a forced call cut short by max_tokens stays "length")."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


class ChatAnswer:
    """One chat choice's text as OpenAI's message (whole) or deltas (streamed), by how tool_choice
    resolved: plain text, calls read from the text ("auto"), or a forced call ("named": the text is
    the arguments; "required": the text is a list of calls, parsed once complete)."""

    def __init__(self, choice: Choice | None):
        self.choice = choice
        self.mode = choice.mode if choice is not None else "none"
        self.calls = 0  # tool calls streamed so far
        self.held: list[str] = []  # "required": the whole text, parsed at the end
        self.reader = CallStream(choice.names, choice.parallel) if self.mode == "auto" else None
        self.named_id = call_id()

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """(message, finish_reason) of the whole answer."""
        content, calls = text, []
        if self.mode == "named":
            content, calls = None, [{"name": self.choice.tools[0]["name"], "arguments": text}]
        elif self.mode == "required":
            parsed = parse_required(text)  # None: cut short, so the text stays as it is
            if parsed is not None:
                content, calls = None, parsed
        elif self.mode == "auto":
            content, calls = parse_calls(text, self.choice.names, self.choice.parallel)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [tool_call(c["name"], c["arguments"]) for c in calls]
        return message, finish_reason(reason, bool(calls))

    def deltas(self, text: str) -> list[dict]:
        """The deltas of the next piece of streamed text (none while text is held back)."""
        if self.mode == "named":
            out = [] if self.calls else [self._call_head(self.choice.tools[0]["name"], self.named_id)]
            self.calls = 1
            return out + ([{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else [])
        if self.mode == "required":
            self.held.append(text)
            return []
        if self.mode == "auto":
            return self._events(self.reader.feed(text))
        return [{"content": text}] if text else []

    def end(self, reason: str | None) -> tuple[list[dict], str | None]:
        """(last deltas, finish_reason) once the text is complete."""
        if self.mode == "named":
            return self.deltas(""), finish_reason(reason, True)
        if self.mode == "required":
            text = "".join(self.held)
            calls = parse_required(text)
            if calls is None:
                return ([{"content": text}] if text else []), reason
            return self._events([("call", c) for c in calls]), finish_reason(reason, True)
        if self.mode == "auto":
            out = self._events(self.reader.finish())
            return out, finish_reason(reason, self.calls > 0)
        return [], reason

    def _call_head(self, name: str, cid: str) -> dict:
        """A call's first delta: its index, id and name, and empty arguments (OpenAI's stream shape)."""
        return {"tool_calls": [{"index": self.calls, "id": cid, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _events(self, events: list[tuple]) -> list[dict]:
        out = []
        for kind, value in events:
            if kind == "content":
                out.append({"content": value})
                continue
            out.append(self._call_head(value["name"], call_id()))
            out.append({"tool_calls": [{"index": self.calls, "function": {"arguments": value["arguments"]}}]})
            self.calls += 1
        return out
