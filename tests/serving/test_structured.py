"""Request preparation of structured output: which constraint each request gets (no model)."""

from __future__ import annotations

import pytest

from jaxllm.constrained import GrammarConstraint
from jaxllm.tokenizer import Tokenizer
from serving.protocol import ApiError, parse_chat
from serving.settings import Settings

MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    }
]


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path)


def prepare(tok, model_name="smollm2", **body):
    return parse_chat(
        {"messages": MSGS, "max_tokens": 16, **body},
        tok,
        Settings(),
        max_context=512,
        model_name=model_name,
        vocab=tok.vocab_size,
    )


def kinds(p) -> list[str]:
    return [c.grammar.kind for c in p.constraints]


def test_free_text_and_auto_tools_are_unconstrained(tok):
    assert prepare(tok).constraints == ()
    assert prepare(tok, tools=TOOLS).constraints == ()
    assert prepare(tok, response_format={"type": "text"}).constraints == ()


def test_one_independent_constraint_per_choice(tok):
    p = prepare(tok, n=3, response_format={"type": "json_object"})
    assert kinds(p) == ["json_object"] * 3
    assert len({id(c.matcher) for c in p.constraints}) == 3
    assert all(isinstance(c, GrammarConstraint) for c in p.constraints)


def test_schema_and_forced_tools(tok):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert kinds(
        prepare(tok, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    ) == ["json_schema"]
    assert kinds(prepare(tok, tools=TOOLS, tool_choice="required")) == ["tool_call"]
    assert kinds(prepare(tok, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})) == [
        "tool_call"
    ]
    # Only the Hermes format has a grammar; llama3-style models keep the tolerant decoder.
    assert prepare(tok, model_name="llama3.1-8b", tools=TOOLS, tool_choice="required").constraints == ()


@pytest.mark.parametrize(
    "fmt, match",
    [
        ({"type": "yaml"}, "not supported"),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}}, "nonsense"),
        ({"type": "json_schema", "json_schema": "nope"}, "schema"),
    ],
)
def test_bad_response_format_is_400(tok, fmt, match):
    with pytest.raises(ApiError, match=match) as e:
        prepare(tok, response_format=fmt)
    assert e.value.status == 400 and e.value.param == "response_format"
