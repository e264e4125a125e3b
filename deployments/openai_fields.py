"""What this server does with every request field of /v1/chat/completions and /v1/completions.

Each field of OpenAI's request schemas is in exactly one of three sets per endpoint: it takes effect
(`HANDLED`), it is accepted and changes nothing in the output (`NO_EFFECT`, with why), or it is
refused with a 400 naming it when set to a value that asks for something this server does not do
(`REFUSED`: the values that ask for nothing, such as null or the default, are accepted). vLLM's
extra fields (what clients send through `extra_body`) are sorted the same way in `VLLM_HANDLED` (and
`VLLM_CHAT_HANDLED`, chat only), `VLLM_NO_EFFECT` and `VLLM_REFUSED`. Any other field is a 400 too (the
request models forbid unknown fields).

The ingress checks requests against these tables, tests/test_semantics.py walks the openai package's
request schemas against them, and tests/test_docs.py checks that docs/http-api.md names every field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Refused:
    """A field this server cannot honour: accepted only at the values that ask for nothing."""

    accepts: str
    """The accepted values, as the error message and the docs say them."""

    why: str
    """What other values would ask for that this server does not do."""

    ok: Callable[[Any, Any], bool]
    """ok(value, request): whether the value asks for nothing (the request, for a field whose default
    depends on another)."""


def _none_or(*values) -> Callable[[Any, Any], bool]:
    return lambda v, _req: v is None or any(v == x and type(v) is type(x) for x in values)


HANDLED = {
    "chat": frozenset({
        "messages", "model", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs",
        "max_completion_tokens", "max_tokens", "n", "parallel_tool_calls", "response_format", "seed", "stop",
        "stream", "stream_options", "temperature", "top_p", "tool_choice", "tools", "prediction",
    }),
    "completions": frozenset({
        "prompt", "model", "echo", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "max_tokens",
        "n", "seed", "stop", "stream", "stream_options", "temperature", "top_p",
    }),
}
"""OpenAI's fields that take effect (docs/http-api.md says how)."""

_USER = "an end-user id for OpenAI's abuse monitoring and caching; nothing here uses it"
NO_EFFECT = {
    "chat": {
        "user": _USER,
        "safety_identifier": "an end-user id for OpenAI's abuse monitoring; nothing here uses it",
        "metadata": "tags for completions OpenAI stores; nothing is stored here",
        "store": "asks OpenAI to keep the completion for later retrieval; nothing is stored here",
        "service_tier": "OpenAI's processing tier (latency and price); every request here is served alike",
        "prompt_cache_key": "a hint for OpenAI's prompt cache; prefix caching here is automatic",
        "prompt_cache_options": "OpenAI's prompt cache breakpoints and lifetime; prefix caching here is automatic",
        "prompt_cache_retention": "OpenAI's prompt cache lifetime; prefix caching here is automatic",
    },
    "completions": {
        "user": _USER,
    },
}
"""OpenAI's fields accepted without effect on the output (any well-formed value), with why."""

REFUSED = {
    "chat": {
        "audio": Refused("null", "audio output; this model writes text only", _none_or()),
        "modalities": Refused('null or ["text"]', "audio output; this model writes text only",
                              lambda v, _req: v is None or v == ["text"]),
        "functions": Refused("null or []", "the deprecated functions API; send them as `tools`",
                             lambda v, _req: v is None or v == []),
        "function_call": Refused('null, "none" or "auto"', "the deprecated functions API; use `tool_choice`",
                                 _none_or("none", "auto")),
        "reasoning_effort": Refused('null or "none"', "this model does not reason before answering", _none_or("none")),
        "verbosity": Refused('null or "medium"', "answer length is not steered here", _none_or("medium")),
        "web_search_options": Refused("null", "web search; this server has no tools of its own", _none_or()),
        "moderation": Refused("null", "moderation of input and output; nothing here moderates", _none_or()),
    },
    "completions": {
        "suffix": Refused('null or ""', "insertion before a given suffix; this server only appends", _none_or("")),
        "best_of": Refused("null or equal to n", "generating more candidates than it returns",
                           lambda v, req: v is None or v == req.n),
    },
}
"""OpenAI's fields refused (400) unless set to a value that asks for nothing."""

VLLM_HANDLED = frozenset({
    "top_k", "min_tokens", "ignore_eos", "stop_token_ids", "repetition_penalty", "bad_words",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "min_p",
    "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "priority", "request_id",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "truncate_prompt_tokens", "add_special_tokens",
    "prompt_logprobs",
})
"""vLLM's extra fields that take effect, on both endpoints."""

VLLM_CHAT_HANDLED = frozenset({
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents",
})
"""vLLM's extra fields of chat completions that take effect: how the messages become the prompt."""

VLLM_NO_EFFECT = {
    "length_penalty": "beam search's length penalty; vLLM too uses it only in beam search, which this server does not do",
}
"""vLLM's extra fields accepted without effect (as in vLLM outside beam search), with why."""

VLLM_REFUSED = {
    "spaces_between_special_tokens": Refused("null or true", "special tokens are joined as the tokenizer decodes them",
                                             _none_or(True)),
    "use_beam_search": Refused("null or false", "beam search is not implemented here", _none_or(False)),
}
"""vLLM's extra fields refused (400) unless set to their default."""


def vllm_handled(endpoint: str) -> frozenset[str]:
    """vLLM's extra fields that take effect on `endpoint`."""
    return VLLM_HANDLED | (VLLM_CHAT_HANDLED if endpoint == "chat" else frozenset())


def no_effect(endpoint: str) -> dict[str, str]:
    """The fields of `endpoint` accepted without effect (OpenAI's and vLLM's), with why."""
    return {**NO_EFFECT[endpoint], **VLLM_NO_EFFECT}


def fields(endpoint: str) -> set[str]:
    """Every field `endpoint` ("chat" or "completions") accepts in some form."""
    return (set(HANDLED[endpoint]) | set(NO_EFFECT[endpoint]) | set(REFUSED[endpoint]) | vllm_handled(endpoint)
            | set(VLLM_NO_EFFECT) | set(VLLM_REFUSED))


def refused(endpoint: str) -> dict[str, Refused]:
    """The fields of `endpoint` accepted only at values that ask for nothing (OpenAI's and vLLM's)."""
    return {**REFUSED[endpoint], **VLLM_REFUSED}
