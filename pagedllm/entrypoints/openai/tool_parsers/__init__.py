"""Tool calling for ``/v1/chat/completions``.

- ``tool_choice='auto'``: a parser per model format reads the calls out of the model's text,
  picked by ``--tool-call-parser`` (``ToolParserManager.get_tool_parser(name)``) or from the chat
  template (``tool_parser_for_chat_template``).
- ``tool_choice='required'`` or a named function: ``tool_choice_json_schema`` gives the JSON
  schema the structured-output grammar enforces, and ``ConstrainedToolParser`` reads the output.

Every parser returns OpenAI's wire format: ``message.tool_calls`` entries for a finished reply and
``delta.tool_calls`` chunks while it streams.
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
