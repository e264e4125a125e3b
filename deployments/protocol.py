"""The request bodies of /v1/chat/completions, /v1/completions, /tokenize and /detokenize (OpenAI's fields and vLLM's
extras, sorted in openai_fields.py), and the request-side checks of `response_format`."""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app import tools as toolcalls

from .errors import APIError


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
