"""Tool calling for ``/v1/chat/completions``.

- ``tool_choice='auto'``: a parser per model format reads the calls out of the model's text,
  picked by ``--tool-call-parser`` (``ToolParserManager.get_tool_parser(name)``) or from the chat
  template (``tool_parser_for_chat_template``).
- ``tool_choice='required'`` or a named function: ``tool_choice_json_schema`` gives the JSON
  schema the structured-output grammar enforces, and ``ConstrainedToolParser`` reads the output.

Every parser returns OpenAI's wire format: ``message.tool_calls`` entries for a finished reply and
``delta.tool_calls`` chunks while it streams.

A parser implements ``advance(text_so_far, final)``; the base class builds the whole-reply and the
streaming methods on it. The server's wiring is ``serving_tools.py``. How a chat request uses it
(one parser per choice of a request)::

    tools = validate_tools(request.tools)              # ValueError naming tools[i]...
    schema = tool_choice_json_schema(tools, request.tool_choice, request.parallel_tool_calls)
    if schema is not None:                             # 'required' or a named function
        # constrain the sampling with the JSON schema `schema`
        parser = ConstrainedToolParser(tools, request.tool_choice)
    elif tools and request.tool_choice in (None, "auto"):
        name = cli_tool_call_parser or tool_parser_for_chat_template(chat_template)
        parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    # whole reply: parser.extract_tool_calls(text) -> tool_calls, content (None if only calls)
    # streaming: parser.extract_tool_calls_streaming(prev, text, delta) each step, then
    #            parser.finish_streaming(text) once; each returns a delta dict or None
"""

from .abstract_tool_parser import (
    DEFAULT_TOOL_PARSER,
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
    tool_parser_for_chat_template,
)
from .hermes_tool_parser import HermesToolParser
from .json_tool_calls import make_tool_call_id
from .llama3_json_tool_parser import Llama3JsonToolParser
from .mistral_tool_parser import MistralToolParser
from .pythonic_tool_parser import PythonicToolParser
from .tool_choice import ConstrainedToolParser, tool_choice_json_schema, validate_tool_choice, validate_tools

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "ConstrainedToolParser",
    "ExtractedToolCallInformation",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "ToolParser",
    "ToolParserManager",
    "make_tool_call_id",
    "tool_choice_json_schema",
    "tool_parser_for_chat_template",
    "validate_tool_choice",
    "validate_tools",
]
