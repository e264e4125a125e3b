"""Turn a prompt or a chat into token ids, with clear errors for malformed input."""

from __future__ import annotations

ROLES = ("system", "user", "assistant", "tool")


def encode_prompt(tokenizer, prompt: str | None = None, messages: list | None = None) -> list[int]:
    """Token ids for a plain prompt, or for chat messages through the tokenizer's chat template."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of 'prompt' or 'messages'")
    if messages is not None:
        return encode_chat(tokenizer, messages)
    if not isinstance(prompt, str):
        raise ValueError(f"'prompt' must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError("prompt is empty")
    return tokenizer.encode(prompt)


def encode_chat(tokenizer, messages: list) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be {{'role': one of {ROLES}, 'content': string}}")
    if not any(m["content"].strip() for m in messages):
        raise ValueError("messages are all empty")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template: send a plain 'prompt' instead")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
