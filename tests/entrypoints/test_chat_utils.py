"""apply_chat_template's refusals name the message and the part (before any tokenizer work)."""

import json

import pytest

from pagedllm.entrypoints.chat_utils import (
    apply_chat_template,
    check_chat_template_kwargs,
    template_reads,
    text_messages,
    tool_turns_as_text,
    tools_in_system_prompt,
)


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


# -- tools ------------------------------------------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def test_assistant_tool_calls_get_object_arguments_and_tool_results_need_their_id():
    [_, assistant, tool] = text_messages([{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                          {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "3 C"}])
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert tool["tool_call_id"] == "chatcmpl-tool-1"
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_call_id is required"):
        text_messages([{"role": "tool", "content": "3 C"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls: only an assistant"):
        text_messages([{"role": "user", "content": "x", "tool_calls": [CALL]}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls\[0\] must be"):
        text_messages([{"role": "assistant", "tool_calls": [{"type": "function"}]}])


def test_tools_go_to_the_system_prompt_in_hermes_form():
    with_system = tools_in_system_prompt([{"role": "system", "content": "Be brief."}], [TOOL])
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(TOOL) in with_system[0]["content"] and "<tool_call>" in with_system[0]["content"]
    added = tools_in_system_prompt([{"role": "user", "content": "hi"}], [TOOL])
    assert [m["role"] for m in added] == ["system", "user"]


def test_tool_turns_become_hermes_text():
    messages = text_messages([{"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
                              {"role": "tool", "tool_call_id": "x", "content": "3 C"}])
    assistant, tool = tool_turns_as_text(messages)
    assert assistant["content"] == ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                    "\n</tool_call>")
    assert tool["content"] == "<tool_response>\n3 C\n</tool_response>"


def test_template_reads_finds_variables_not_words():
    assert template_reads("{% for t in tools %}{{ t }}{% endfor %}", "tools")
    assert not template_reads("{{ messages[0]['content'] }} tools", "tools")
    assert template_reads("{{ m.tool_calls }}", "tool_calls")


def test_chat_template_kwargs_may_not_replace_the_request_fields():
    assert check_chat_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    for key in ("tools", "add_generation_prompt", "messages"):
        with pytest.raises(ValueError, match=rf"^chat_template_kwargs\.{key}: reserved"):
            check_chat_template_kwargs({key: 1})
