"""Structured output of a chat request: `response_format` and forced tool calls -> constraints.

Runs in request preparation (off the device thread): the grammar is compiled and validated
once (an invalid schema is a 400 here, before admission), and each choice gets its own
matcher, since a matcher is the state of one sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxllm.constrained import (
    GrammarConstraint,
    GrammarError,
    constraint_for,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from jaxllm.tokenizer import Tokenizer
from serving.tool_calls import ToolContract


class StructuredOutputError(ValueError):
    """A `response_format` or forced tool the server cannot enforce; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _grammar_of(response_format: Mapping[str, Any], tools: ToolContract | None) -> tuple[str, str] | None:
    """(grammar text, kind) the request asks for, or None for free text."""
    if tools is not None and (tools.tool_choice == "required" or isinstance(tools.tool_choice, Mapping)):
        # Only the Hermes format has a grammar; other formats keep the tolerant decoder alone.
        if tools.format != "hermes":
            return None
        return tool_call_grammar(tools.tools, tools.allowed_names()), "tool_call"
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar(), "json_object"
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise StructuredOutputError("response_format.json_schema needs a 'schema' object", "response_format")
        schema = spec.get("schema") or {"type": "object"}
        return json_schema_grammar(schema), "json_schema"
    raise StructuredOutputError(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)", "response_format"
    )


def build_constraints(response_format: Mapping[str, Any], tools: ToolContract | None, tokenizer: Tokenizer,
                      model_vocab: int, n: int) -> tuple[GrammarConstraint, ...]:
    """One constraint per choice, or () when the output is free.

    Raises:
      StructuredOutputError: an unknown format or a schema the grammar library rejects.
    """
    try:
        spec = _grammar_of(response_format, tools)
        if spec is None:
            return ()
        first = constraint_for(tokenizer, model_vocab, *spec)
    except GrammarError as e:
        param = "tools" if tools is not None and tools.tool_choice != "auto" else "response_format"
        raise StructuredOutputError(str(e), param) from None
    return (first, *(first.copy() for _ in range(n - 1)))
