"""apply_chat_template's refusals name the message and the part (before any tokenizer work)."""

import pytest

from pagedllm.entrypoints.chat_utils import apply_chat_template, text_messages


@pytest.mark.parametrize("part,kind", [({"type": "image_url", "image_url": {"url": "x"}}, "image_url"),
                                       ({"type": "input_audio"}, "input_audio"), (7, "int")])
def test_non_text_parts_are_refused_naming_the_part(part, kind):
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "a"}, part]}]
    with pytest.raises(ValueError, match=rf"messages\[1\]\.content: a '{kind}' part is not supported"):
        apply_chat_template(None, messages)


@pytest.mark.parametrize("message,match", [
    ({"role": "wizard", "content": "hi"}, r"messages\[0\]\.role must be one of"),
    ({"role": "user", "content": None}, r"messages\[0\]\.content is required for a 'user' message"),
    ({"role": "system"}, r"messages\[0\]\.content is required"),
])
def test_roles_and_missing_content_are_refused_as_openai(message, match):
    with pytest.raises(ValueError, match=match):
        apply_chat_template(None, [message])


def test_an_assistant_message_may_have_no_content():
    assert text_messages([{"role": "assistant", "content": None}]) == [{"role": "assistant", "content": ""}]
