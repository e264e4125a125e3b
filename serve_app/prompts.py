"""Turn a prompt or a chat into token ids, with clear errors for malformed input.

Chat messages come in every shape the OpenAI chat API defines for text: `content` a string, a list
of text parts, or null (an assistant turn that only called tools); the `developer` role (OpenAI's
newer name for `system`); `name`; an assistant's `tool_calls` and `refusal`, a tool result's
`tool_call_id`. Image, audio and file parts are refused. Earlier tool calls and results reach the
chat template in the shape it reads (serve_app/tools.py), and `tools` are rendered by templates that
render them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.tools import check_tool_calls, render_history, template_supports_tools

ROLES = ("system", "developer", "user", "assistant", "tool")
TEMPLATE_ROLES = {"developer": "system"}  # what chat templates know the newer role as


def check_text(text: str, where: str) -> str:
    """Text a tokenizer can take: a lone surrogate (e.g. "\\ud800" in JSON) is not valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where} holds a lone surrogate (invalid Unicode)") from None
    return text


def message_text(content, where: str) -> str:
    """A message's text: the string itself, or its text (and refusal) parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return check_text(content, where)
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        field = {"text": "text", "refusal": "refusal"}.get(kind)
        if field and isinstance(part.get(field), str):
            texts.append(check_text(part[field], f"{where}[{j}]"))
        elif kind in ("image_url", "input_image", "image", "input_audio", "audio", "file", "video_url"):
            raise ValueError(f"{where}[{j}]: content parts of type {kind!r} are not supported (this model reads text only)")
        else:
            raise ValueError(f"{where}[{j}] must be {{'type': 'text', 'text': string}}")
    return "\n".join(texts)


def normalize_messages(messages) -> list[dict]:
    """[{role, content: str}] in the roles chat templates know, from any OpenAI text message shape; an
    assistant turn's tool calls come along as "tool_calls" ({"id", "name", "arguments": dict}) and a
    tool result's id as "tool_call_id"."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be {{'role': one of {ROLES}, 'content': string or text parts}}")
        calls = m.get("tool_calls")
        if calls is not None and m["role"] != "assistant":
            raise ValueError(f"messages[{i}].tool_calls: only an assistant message has tool calls")
        if m.get("content") is None and m["role"] != "assistant":
            raise ValueError(f"messages[{i}].content is required for role '{m['role']}'")
        text = message_text(m.get("content"), f"messages[{i}].content")
        if m.get("refusal"):  # an assistant turn that refused: its words stay in the conversation
            text = "\n".join(t for t in (text, check_text(m["refusal"], f"messages[{i}].refusal")) if t)
        msg = {"role": TEMPLATE_ROLES.get(m["role"], m["role"]), "content": text}
        if calls:
            msg["tool_calls"] = check_tool_calls(calls, f"messages[{i}].tool_calls")
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ValueError(f"messages[{i}].tool_call_id is required for role 'tool' (the id of the call it answers)")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def encode_prompt(tokenizer, prompt: str | None = None, messages: list | None = None,
                  add_special_tokens: bool = True) -> list[int]:
    """Token ids for a plain prompt, or for chat messages through the tokenizer's chat template."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of 'prompt' or 'messages'")
    if messages is not None:
        return encode_chat(tokenizer, messages)
    if not isinstance(prompt, str):
        raise ValueError(f"'prompt' must be a string, got {type(prompt).__name__}")
    if not check_text(prompt, "prompt").strip():
        raise ValueError("prompt is empty")
    return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)


@dataclass(frozen=True)
class ChatTemplating:
    """How a chat request's messages become its prompt (vLLM's chat request extras)."""

    template: str | None = None
    """A Jinja chat template to use instead of the model's."""
    kwargs: dict = field(default_factory=dict)
    """Extra variables for the template (Qwen3's `enable_thinking`, ...)."""
    add_generation_prompt: bool = True
    """End with the template's opening of the assistant's turn."""
    continue_final_message: bool = False
    """Leave the last (assistant) message open, so the answer continues it."""
    documents: list | None = None
    """Documents for templates that render them (retrieval-augmented chat)."""
    add_special_tokens: bool = False
    """Let the tokenizer add its special tokens (BOS) around the rendered text too; the template has its own."""


RESERVED_TEMPLATE_VARS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                    "add_generation_prompt", "continue_final_message", "return_dict", "tokenizer"})
"""Template variables chat_template_kwargs may not set: the arguments the server passes itself."""


def encode_chat(tokenizer, messages: list, tools: list[dict] | None = None,
                templating: ChatTemplating = ChatTemplating()) -> list[int]:
    """Token ids of chat messages through the chat template, with `tools` (OpenAI function tools)
    rendered by it; only for a template that renders tools (`template_supports_tools`)."""
    messages = normalize_messages(messages)
    if not any(m["content"].strip() or m.get("tool_calls") for m in messages):
        raise ValueError("messages are all empty")
    if templating.template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template: send a plain 'prompt' instead")
    native = template_supports_tools(tokenizer)
    if tools and not native:
        raise ValueError("this model's chat template does not render tools")
    if templating.continue_final_message and (templating.add_generation_prompt or messages[-1]["role"] != "assistant"):
        raise ValueError("continue_final_message continues a last assistant message, with add_generation_prompt false")
    extra = dict(templating.kwargs)  # only what the request set: a plain chat renders as it always did
    if templating.continue_final_message:
        extra["continue_final_message"] = True
    if templating.documents is not None:
        extra["documents"] = templating.documents
    if templating.template is not None:
        extra["chat_template"] = templating.template
    text = tokenizer.apply_chat_template(render_history(messages, native), tools=tools or None, tokenize=False,
                                         add_generation_prompt=templating.add_generation_prompt, **extra)
    return tokenizer.encode(text, add_special_tokens=templating.add_special_tokens)
