"""Hypothesis fuzz of the host code a request's bytes reach (issue 20): the request parser,
the incremental detokenizer and the tool-call decoder. Each must turn any input into a
result or a 4xx `ApiError`, never another exception. Example counts are bounded so the
module runs in seconds."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm.tokenizer import Tokenizer
from serving.errors import ApiError
from serving.protocol import parse_chat, parse_completion
from serving.settings import Defaults, Limits, Settings
from serving.tool_calls import FORMATS, ToolCallDecoder, ToolContract
from serving.validation import BOOL_FIELDS, FLOAT_FIELDS, INT_FIELDS, parse_json

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
MAX_CONTEXT = 256
SETTINGS = Settings(
    limits=Limits(max_output_tokens=16, max_messages=16, max_tools=4, max_schema_bytes=4096),
    defaults=Defaults(max_tokens=8),
)


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path)


# ---- JSON values: arbitrary, and near-valid request bodies --------------------------------
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)
_FIELDS = (
    *FLOAT_FIELDS,
    *INT_FIELDS,
    *BOOL_FIELDS,
    "stop",
    "logit_bias",
    "stop_token_ids",
    "stream_options",
    "user",
    "model",
    "tools",
    "tool_choice",
    "response_format",
    "logprobs",
    "messages",
    "prompt",
    "session",
    "drafts",
)
_CONTENT = (
    st.text(max_size=20)
    | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2)
    | JSON
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"]), "content": _CONTENT},
    optional={"name": JSON, "tool_call_id": JSON, "tool_calls": JSON},
)
_TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "get_weather", ""])}, optional={"parameters": JSON, "description": JSON}
        ),
    }
)
# Values that sit on the edges of what each field accepts.
_EDGE = (
    st.sampled_from(
        [
            0,
            1,
            -1,
            2,
            16,
            17,
            2**31,
            2**63,
            2**64,
            -(2**63) - 1,
            0.0,
            0.5,
            1.0,
            1e38,
            3.5e38,
            -1e-9,
            True,
            False,
            None,
            "",
            "a",
            [],
            {},
            [1],
            {"1": 2},
            {"-5": 1e9},
            {"x": 1},
            ["\n"],
            ["a"] * 17,
            "auto",
            "none",
            "required",
            {"type": "json_object"},
            {"type": "json_schema"},
            {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}},
            {"function": {"name": "f"}},
            {"function": {"name": "g"}},
        ]
    )
    | JSON
)


@st.composite
def bodies(draw, kind: str) -> dict:
    base = (
        {"messages": draw(st.lists(_MESSAGE, min_size=0, max_size=3))}
        if kind == "chat"
        else {"prompt": draw(st.text(max_size=16) | st.lists(st.integers(-2, 50_000), max_size=4) | JSON)}
    )
    if kind == "chat" and draw(st.booleans()):
        base["tools"] = draw(st.lists(_TOOL, max_size=2))
    extra = draw(st.dictionaries(st.sampled_from(_FIELDS), _EDGE, max_size=5))
    return {**base, **extra}


def _parse(kind: str, body, tok: Tokenizer):
    parse = parse_chat if kind == "chat" else parse_completion
    return parse(body, tok, SETTINGS, max_context=MAX_CONTEXT, model_name="tiny", vocab=tok.vocab_size)


def _parsed_or_4xx(kind: str, body, tok: Tokenizer) -> None:
    try:
        p = _parse(kind, body, tok)
    except ApiError as e:
        assert 400 <= e.status < 500 and e.message, (e.status, e.message)
        assert json.dumps(e.body())  # the error body always serializes
        return
    assert p.prompt and 1 <= p.n <= 16 and len(p.prompt) + p.max_tokens <= MAX_CONTEXT
    assert all(0 <= t < tok.vocab_size for t in p.prompt)


@FUZZ
@given(body=bodies("chat"))
def test_any_chat_body_parses_or_is_a_4xx(tok, body):
    _parsed_or_4xx("chat", body, tok)


@FUZZ
@given(body=bodies("completion"))
def test_any_completion_body_parses_or_is_a_4xx(tok, body):
    _parsed_or_4xx("completion", body, tok)


@FUZZ
@given(kind=st.sampled_from(["chat", "completion"]), value=JSON)
def test_any_json_value_parses_or_is_a_4xx(tok, kind, value):
    _parsed_or_4xx(kind, value, tok)


@FUZZ
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_any_bytes_are_json_or_a_400(tok, raw):
    try:
        body = parse_json(raw)
    except ApiError as e:
        assert e.status == 400
        return
    _parsed_or_4xx("completion", body, tok)


# ---- incremental detokenizer ---------------------------------------------------------------
@FUZZ
@given(data=st.data(), skip=st.booleans())
def test_streamed_pieces_concatenate_to_the_full_decode(tok, data, skip):
    # Ids of every kind: byte-fallback pieces that split UTF-8 characters, special tokens and
    # the rest of the vocabulary.
    specials = sorted(tok.eos_ids) + [0, 1, 2]
    ids = data.draw(
        st.lists(st.integers(0, tok.vocab_size - 1) | st.sampled_from(specials) | st.integers(0, 300), max_size=24)
    )
    detok = tok.detokenizer(skip)
    streamed = "".join(detok.feed(t) for t in ids) + detok.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=skip)


# ---- tool-call decoder ---------------------------------------------------------------------
_TOOL_FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "_call>",
    "<|python_tag|>",
    '{"name": "f"',
    ', "arguments": ',
    '"parameters"',
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    '"',
    "'",
    "\\",
    ",",
    ";",
    "=",
    " ",
    "\n",
    "f(",
    "f",
    "nope",
    "null",
    "1e999",
    "-",
    "\ud7ff",
    "🙂",
    "\x00",
]
_ANY_TEXT = st.lists(st.sampled_from(_TOOL_FRAGMENTS) | st.text(max_size=6), max_size=16).map("".join)
_CONTRACTS = st.builds(
    ToolContract,
    tools=st.just({"f": {"type": "object", "properties": {"a": {"type": "integer"}}}, "get_weather": {}}),
    format=st.sampled_from(FORMATS),
    tool_choice=st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]),
)


def _decode(contract: ToolContract, pieces: list[str]):
    ids = itertools.count()
    decoder = ToolCallDecoder(contract, new_id=lambda: f"call_{next(ids)}")
    content, deltas = [], []
    for piece in pieces:
        ev = decoder.feed(piece)
        content.append(ev.content)
        deltas.extend(ev.tool_calls)
    term = decoder.finish()
    return "".join(content) + term.content_tail, deltas + list(term.tool_call_deltas), term


@FUZZ
@given(contract=_CONTRACTS, text=_ANY_TEXT, cuts=st.lists(st.integers(0, 1000), max_size=10))
def test_any_text_is_calls_or_content_and_streaming_agrees(contract, text, cuts):
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    one_content, one_deltas, one = _decode(contract, [text])
    streamed_content, streamed_deltas, streamed = _decode(contract, pieces)
    assert streamed_content == one_content
    assert streamed_deltas == one_deltas
    assert streamed.tool_calls == one.tool_calls and streamed.diagnostics == one.diagnostics
    for call in one.tool_calls:
        assert call.name in contract.tools and isinstance(json.loads(call.arguments_json), dict)
    if not one.tool_calls:  # no call accepted: the text comes back whole
        assert one_content == text
