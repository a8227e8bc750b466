"""Structured output of a chat request: `response_format` and forced tool calls -> constraints.

Runs in request preparation (off the device thread): the grammar is compiled and validated
once (an invalid schema is a 400 here, before admission), and each choice gets its own
matcher, since a matcher is the state of one sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

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


MAX_SCHEMA_DEPTH = 32  # nesting of one schema (objects and arrays), past which a request is refused
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values are data, not schemas


def check_json_schema(schema: Any, param: str) -> None:
    """Refuses what the grammar and the argument check cannot both handle the same way.

    `$ref` must be local ("#" or "#/...") and resolve within `schema` itself (pydantic's
    "#/$defs/X"), and the references must not form a cycle: a recursive schema can have no
    finite document the model is sure to close, so it is a 400 rather than cut output.

    Raises:
      StructuredOutputError: naming `param`.
    """
    if not isinstance(schema, Mapping):
        raise StructuredOutputError("a JSON schema must be an object", param)
    done: set[str] = set()  # references already checked to end without a cycle

    def walk(node: Any, depth: int, expanding: tuple[str, ...]) -> None:
        if depth > MAX_SCHEMA_DEPTH:
            raise StructuredOutputError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param)
        if isinstance(node, list):
            for v in node:
                walk(v, depth + 1, expanding)
            return
        if not isinstance(node, Mapping):
            return
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                follow(v, depth, expanding)
            elif k not in _DATA_KEYWORDS:
                walk(v, depth + 1, expanding)

    def follow(ref: str, depth: int, expanding: tuple[str, ...]) -> None:
        if ref in done:
            return
        if ref in expanding:
            raise StructuredOutputError(
                f"recursive JSON schemas are not supported ($ref {ref!r} refers to itself)", param
            )
        walk(_resolve(schema, ref, param), depth + 1, (*expanding, ref))
        done.add(ref)

    walk(schema, 0, ())


def _resolve(root: Mapping[str, Any], ref: str, param: str) -> Any:
    """The node a local JSON pointer `ref` names in `root`."""
    if ref != "#" and not ref.startswith("#/"):
        raise StructuredOutputError(f"only local $ref ('#/...') is supported, not {ref!r}", param)
    node: Any = root
    for raw in ref[2:].split("/") if ref != "#" else []:
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise StructuredOutputError(f"$ref {ref!r} does not exist in the schema", param)
    return node


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
        check_json_schema(schema, "response_format")
        return json_schema_grammar(schema), "json_schema"
    raise StructuredOutputError(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)", "response_format"
    )


def build_constraints(
    response_format: Mapping[str, Any], tools: ToolContract | None, tokenizer: Tokenizer, model_vocab: int, n: int
) -> tuple[GrammarConstraint, ...]:
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
