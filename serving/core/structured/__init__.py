"""Structured outputs: constraints on a request's output (JSON schema, regex, choice, Lark
grammar, enforced tool calls), compiled with llguidance into a per-step token bitmask that
the sampler applies on device.

``spec`` reads the API fields into a ``StructuredOutput`` (plain data, pickled to the engine
process); ``tool_grammar`` writes the grammar of enforced tool calls; ``grammar`` compiles a
``StructuredOutput`` into a ``GrammarMatcher`` (imports llguidance; the engine process only).
"""

from serving.core.structured.spec import StructuredOutput, from_fields, from_response_format
from serving.core.structured.tool_grammar import SUPPORTED_PARSERS, tool_call_grammar

__all__ = [
    "SUPPORTED_PARSERS",
    "StructuredOutput",
    "from_fields",
    "from_response_format",
    "tool_call_grammar",
]
