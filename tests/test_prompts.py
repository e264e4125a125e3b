"""Chat messages in every text shape the OpenAI API defines, and invalid Unicode refused clearly."""

import pytest

from serve_app.prompts import encode_prompt, normalize_messages


def test_message_shapes_normalize_to_role_and_text():
    msgs = [{"role": "developer", "content": "be brief"},
            {"role": "user", "name": "ann", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "1", "content": "2"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]
    assert normalize_messages(msgs) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
                                        {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "name": "f", "arguments": {"x": 1}}]},
                                        {"role": "tool", "content": "2", "tool_call_id": "1"},
                                        {"role": "assistant", "content": "no"}]


@pytest.mark.parametrize("msgs, message", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "'image_url' are not supported"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], "text only"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0] must be"),
    ([{"role": "user", "content": None}], "content is required for role 'user'"),
    ([{"role": "user", "content": {"text": "a"}}], "a string or a list"),
    ([{"role": "robot", "content": "a"}], "messages[0] must be"),
    ([{"role": "user", "content": "a\ud800"}], "lone surrogate"),
    ([{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}], "messages[0].content[0] holds a lone surrogate"),
    ([], "non-empty list"),
    ([{"role": "tool", "content": "2"}], "tool_call_id is required for role 'tool'"),
    ([{"role": "user", "content": "a", "tool_calls": []}], "only an assistant message has tool calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]}],
     "'name' and 'arguments'"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}], "arguments: not valid JSON"),
])
def test_bad_messages_say_what_is_wrong(msgs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        normalize_messages(msgs)


def test_lone_surrogate_in_a_prompt_is_refused():
    with pytest.raises(ValueError, match="lone surrogate"):
        encode_prompt(object(), prompt="x\ud800")
