"""apply_chat_template's refusals name the message and the part (before any tokenizer work)."""

import pytest

from pagedllm.entrypoints.chat_utils import apply_chat_template


@pytest.mark.parametrize("part,kind", [({"type": "image_url", "image_url": {"url": "x"}}, "image_url"),
                                       ({"type": "input_audio"}, "input_audio"), (7, "int")])
def test_non_text_parts_are_refused_naming_the_part(part, kind):
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "a"}, part]}]
    with pytest.raises(ValueError, match=rf"messages\[1\]\.content: a '{kind}' part is not supported"):
        apply_chat_template(None, messages)
