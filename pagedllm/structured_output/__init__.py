"""Structured output: constrain generated text to a JSON schema, regex, choice or EBNF grammar.

``manager.StructuredOutputManager`` (owned by the engine core) compiles grammars on a thread pool
with a cache, gives each constrained request a ``request.StructuredOutputRequest`` (its matcher),
and fills each step's batched token bitmask; ``backend.XgrammarBackend`` wraps xgrammar;
``jump_forward.JumpForward`` turns the text a grammar forces into tokens (jump-forward decoding).
"""

from pagedllm.structured_output.manager import StructuredOutputManager, StructuredOutputStats
from pagedllm.structured_output.request import StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest", "StructuredOutputStats"]
