"""Tests for the streaming tool-call decoder (serving/tool_calls.py)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.tool_calls import (
    FORMATS,
    DEFAULT_TOOL_SYSTEM_PROMPT,
    FallbackReason,
    ParsedCall,
    Terminal,
    ToolCallDecoder,
    ToolCallDelta,
    ToolContract,
    finish_reason_for,
    pick_format,
    render_tool_calls_as_text,
    render_tool_result_as_text,
    tool_call_id,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = {"get_weather": WEATHER, "f": {"type": "object"}}
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
]


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything one decode published, in order."""

    content: str
    per_feed: tuple[str, ...]
    deltas: tuple[ToolCallDelta, ...]
    terminal: Terminal

    @property
    def calls(self) -> list[tuple[str, dict]]:
        return [(c.name, json.loads(c.arguments_json)) for c in self.terminal.tool_calls]

    @property
    def reason(self) -> FallbackReason:
        return self.terminal.diagnostics.fallback_reason


def decode(text_or_pieces: str | list[str], fmt: str = "hermes", tool_choice="auto", tools=TOOLS) -> Run:
    pieces = [text_or_pieces] if isinstance(text_or_pieces, str) else text_or_pieces
    ids = itertools.count()
    decoder = ToolCallDecoder(
        ToolContract(tools=tools, format=fmt, tool_choice=tool_choice), new_id=lambda: f"call_{next(ids)}"
    )
    per_feed, deltas = [], []
    for piece in pieces:
        events = decoder.feed(piece)
        per_feed.append(events.content)
        deltas.extend(events.tool_calls)
    terminal = decoder.finish()
    deltas.extend(terminal.tool_call_deltas)
    content = "".join(per_feed) + terminal.content_tail
    return Run(content, tuple(per_feed), tuple(deltas), terminal)


def call(name: str, args: object = None, *, key: str = "arguments") -> str:
    body = {"name": name} if args is None else {"name": name, key: args}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


# -- hermes -------------------------------------------------------------------


def test_hermes_complete_call_and_delta_shape():
    run = decode(call("get_weather", {"city": "Paris"}))
    assert run.content == ""
    assert run.calls == [("get_weather", {"city": "Paris"})]
    assert run.reason is FallbackReason.NONE
    assert [d.to_openai() for d in run.deltas] == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": "Paris"}'}},
    ]
    assert run.terminal.tool_calls[0] == ParsedCall(name="get_weather", arguments_json='{"city": "Paris"}', id="call_0")


def test_hermes_text_before_and_after_a_call():
    run = decode("Let me check.\n\n" + call("get_weather", {"city": "Oslo"}) + "\nDone, it is cold.")
    assert run.content == "Let me check.\nDone, it is cold."
    assert run.calls == [("get_weather", {"city": "Oslo"})]
    assert run.reason is FallbackReason.NONE


def test_hermes_truncated_call_returns_raw_text_and_keeps_earlier_calls():
    first = call("f", {"x": 1})
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    run = decode(first + "\n" + cut)
    assert run.calls == [("f", {"x": 1})]
    assert run.content == "\n" + cut
    assert run.reason is FallbackReason.TRUNCATED_CALL
    assert run.terminal.diagnostics.fallback_calls == 1


def test_whitespace_only_trailing_or_between_calls_is_dropped():
    assert decode(call("f", {}) + "\n \n").content == ""
    assert decode([call("f", {}), "\n", " "]).content == ""
    assert decode("[f(a=1)]\n", "pythonic").content == ""
    assert decode('{"name": "f", "parameters": {}} ;\n', "llama3").content == ""


def test_hermes_escaped_quotes_inside_strings():
    args = {"q": 'say \\"}\\" and \\\\', "r": '"</tool_call>"'}
    run = decode(list(call("f", args)))
    assert run.calls == [("f", args)]


def test_hermes_cut_inside_the_marker_is_content():
    run = decode("Answer: <tool_ca")
    assert run.content == "Answer: <tool_ca"
    assert run.per_feed == ("Answer:",)  # the separator and marker prefix wait
    assert run.calls == []


def test_hermes_strings_with_brackets_and_markers_do_not_end_the_call():
    args = {"html": '<a href="x">}{</a>', "q": '</tool_call> <tool_call> \\"', "nested": {"l": [1, {"k": "]"}]}}
    run = decode(["pre ", call("f", args)[:20], call("f", args)[20:], " post"])
    assert run.calls == [("f", args)]
    assert run.content == "pre post"


def test_hermes_several_calls_and_unicode_arguments():
    text = call("get_weather", {"city": "Zürich 🌧"}) + "\n" + call("f", {"emoji": "🙂👍", "ja": "東京"})
    run = decode(list(text))  # one character per delta
    assert run.calls == [("get_weather", {"city": "Zürich 🌧"}), ("f", {"emoji": "🙂👍", "ja": "東京"})]
    assert "🙂👍" in run.terminal.tool_calls[1].arguments_json  # not \\u-escaped
    assert [d.index for d in run.deltas] == [0, 0, 1, 1]
    assert run.content == ""


def test_hermes_unknown_tool_is_returned_as_content():
    text = "x " + call("rm_rf", {"path": "/"}) + " y"
    run = decode(text)
    assert run.calls == []
    assert run.content == text
    assert run.reason is FallbackReason.UNKNOWN_TOOL


def test_hermes_schema_mismatch_keeps_the_call_and_counts_it():
    run = decode(call("get_weather", {"city": 3, "extra": True}) + call("get_weather", {"city": "Rome"}))
    assert run.calls == [("get_weather", {"city": 3, "extra": True}), ("get_weather", {"city": "Rome"})]
    assert run.terminal.diagnostics.schema_mismatch_arguments == 1
    assert run.reason is FallbackReason.NONE


def test_hermes_unresolvable_ref_in_a_schema_counts_as_mismatch_not_an_exception():
    schema = {"type": "object", "properties": {"home": {"$ref": "#/properties/arguments/$defs/A"}}}
    run = decode(call("g", {"home": {"city": "Rome"}}), tools={"g": schema})
    assert run.calls == [("g", {"home": {"city": "Rome"}})]
    assert run.terminal.diagnostics.schema_mismatch_arguments == 1


@pytest.mark.parametrize(
    "block", [call("f"), call("f", None), '<tool_call>{"name": "f", "arguments": null}</tool_call>', call("f", "")]
)
def test_hermes_empty_arguments_become_empty_object(block):
    run = decode(block)
    assert run.calls == [("f", {})]
    assert run.terminal.diagnostics.empty_arguments_omitted == 1


def test_hermes_explicit_empty_object_is_not_counted_as_omitted():
    run = decode(call("f", {}))
    assert run.calls == [("f", {})]
    assert run.terminal.diagnostics.empty_arguments_omitted == 0


def test_hermes_string_encoded_arguments_and_parameters_alias():
    run = decode(call("get_weather", json.dumps({"city": "Lima"})) + call("f", {"a": 1}, key="parameters"))
    assert run.calls == [("get_weather", {"city": "Lima"}), ("f", {"a": 1})]


@pytest.mark.parametrize(
    "broken",
    [
        '<tool_call>{"name": "f", "arguments": {}}}</tool_call>',  # extra brace
        "<tool_call><function=f><parameter=a>1</parameter></function></tool_call>",
        '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',  # trailing comma
        '<tool_call>{"name": "f", "arguments": {</tool_call>',  # unbalanced: `<` outside a string ends it
    ],
)
def test_hermes_malformed_block_is_content_and_later_calls_still_parse(broken):
    run = decode(list("a " + broken + " b " + call("f", {"ok": True})))  # close marker split too
    assert run.content == "a " + broken + " b"
    assert run.calls == [("f", {"ok": True})]
    assert run.reason is FallbackReason.MALFORMED_JSON


def test_hermes_not_a_call_object_is_malformed_call():
    text = '<tool_call>{"function_name": "f"}</tool_call>'
    run = decode(text)
    assert (run.content, run.calls, run.reason) == (text, [], FallbackReason.MALFORMED_CALL)


def test_hermes_complete_json_without_close_marker_is_recovered():
    run = decode('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_')
    assert run.calls == [("f", {"a": 1})]
    assert run.content == ""
    assert run.reason is FallbackReason.UNCLOSED_CALL
    assert len(run.terminal.tool_call_deltas) == 2  # decided only at finish


def test_hermes_plain_text_is_published_immediately():
    decoder = ToolCallDecoder(ToolContract(tools=TOOLS))
    assert decoder.feed("Hello").content == "Hello"
    assert decoder.feed(" world, a < b").content == " world, a < b"
    assert decoder.feed(" <").content == ""
    assert decoder.feed("p>").content == " <p>"


def test_tool_choice_named_none_and_required():
    named = {"type": "function", "function": {"name": "f"}}
    run = decode(call("get_weather", {"city": "x"}), tool_choice=named)
    assert (run.calls, run.reason) == ([], FallbackReason.UNKNOWN_TOOL)
    text = call("f", {})
    assert decode(text, tool_choice="none").content == text
    assert decode(text, tool_choice="none").calls == []
    assert decode("no calls", tool_choice="required").reason is FallbackReason.MISSING_REQUIRED_CALL
    assert decode(text, tool_choice="required").reason is FallbackReason.NONE


def test_feed_after_finish_is_an_error():
    decoder = ToolCallDecoder(ToolContract(tools=TOOLS))
    decoder.finish()
    with pytest.raises(RuntimeError):
        decoder.feed("x")


# -- llama3 -------------------------------------------------------------------


def test_llama3_tagged_and_untagged_calls():
    tagged = decode('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "llama3")
    assert (tagged.content, tagged.calls) == ("", [("get_weather", {"city": "Paris"})])
    plain = decode(' \n{"name": "f", "parameters": {"a": "<b>"}}; {"name": "f", "parameters": {}}', "llama3")
    assert (plain.content, plain.calls) == ("", [("f", {"a": "<b>"}), ("f", {})])


def test_llama3_withholds_while_ambiguous_and_releases_non_calls():
    decoder = ToolCallDecoder(ToolContract(tools=TOOLS, format="llama3"))
    assert decoder.feed('  {"name": "get_we').content == ""
    assert decoder.feed('ather", "parameters": {"city": "Ba').content == ""
    assert decoder.feed('ku"}}').tool_calls[0].name == "get_weather"
    text_decoder = ToolCallDecoder(ToolContract(tools=TOOLS, format="llama3"))
    assert text_decoder.feed("Hello").content == "Hello"  # decided at the first character
    json_decoder = ToolCallDecoder(ToolContract(tools=TOOLS, format="llama3"))
    assert json_decoder.feed('{"answer": 4').content == '{"answer": 4'  # first key is not a call key


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"name": "Bob", "age": 3} is a person.', FallbackReason.NONE),  # JSON, not a call
        ('Use {"name": "f", "parameters": {}}', FallbackReason.NONE),  # not at the start
        ('<|python_tag|>{"name": "f", "parameters": {"a": ', FallbackReason.TRUNCATED_CALL),
        ('{"name": "nope", "parameters": {}}', FallbackReason.UNKNOWN_TOOL),
        ("<|python_tag|>get_weather(city='x')", FallbackReason.MALFORMED_JSON),
    ],
)
def test_llama3_non_calls_become_content(text, reason):
    run = decode(text, "llama3")
    assert (run.content, run.calls, run.reason) == (text, [], reason)


def test_llama3_suffix_after_call_is_content():
    run = decode('{"name": "f", "parameters": {"a": 1}}\n\nI called f.', "llama3")
    assert (run.content, run.calls) == ("I called f.", [("f", {"a": 1})])


# -- pythonic -----------------------------------------------------------------


def test_pythonic_calls_with_mixed_literals():
    text = '[get_weather(city="Paris", days=-2), f(flag=True, none=null, xs=[1, 2.5], d={"k": (1, "🙂")})]'
    run = decode(text, "pythonic")
    assert run.content == ""
    assert run.calls == [
        ("get_weather", {"city": "Paris", "days": -2}),
        ("f", {"flag": True, "none": None, "xs": [1, 2.5], "d": {"k": [1, "🙂"]}}),
    ]


@pytest.mark.parametrize(
    "text, reason",
    [
        ("[1, 2, 3]", FallbackReason.NONE),
        ("[Note] remember this", FallbackReason.NONE),
        ("The list: [f(a=1)]", FallbackReason.NONE),
        ('[get_weather(city="Pa', FallbackReason.TRUNCATED_CALL),
        ('[get_weather("Paris")]', FallbackReason.MALFORMED_CALL),  # positional
        ("[os.system(cmd='ls')]", FallbackReason.UNKNOWN_TOOL),
        ("[f(a=1) f(b=2)]", FallbackReason.MALFORMED_JSON),
        ("[f(a=open('x'))]", FallbackReason.MALFORMED_CALL),  # not a literal, never evaluated
    ],
)
def test_pythonic_non_calls_become_content(text, reason):
    run = decode(list(text), "pythonic")
    assert (run.content, run.calls, run.reason) == (text, [], reason)


def test_pythonic_ambiguous_head_is_withheld_then_released():
    decoder = ToolCallDecoder(ToolContract(tools=TOOLS, format="pythonic"))
    assert decoder.feed("[get_wea").content == ""
    assert decoder.feed("ther is nice]").content == "[get_weather is nice]"


def test_pythonic_suffix_after_call():
    run = decode("[f(a='x]y')] and then", "pythonic")
    assert (run.content, run.calls) == (" and then", [("f", {"a": "x]y"})])


# -- helpers ------------------------------------------------------------------


def test_finish_reason_for():
    assert finish_reason_for("stop", True) == "tool_calls"
    assert finish_reason_for("stop", False) == "stop"
    assert finish_reason_for("length", True) == "length"
    assert finish_reason_for("cancelled", True) == "cancelled"


def test_tool_call_id_shape_and_uniqueness():
    ids = {tool_call_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


@pytest.mark.parametrize(
    "hint, override, expected",
    [
        ("qwen2.5", None, "hermes"),
        ("Qwen3-MoE", None, "hermes"),
        ("hermes", None, "hermes"),
        ("smollm2", None, "hermes"),
        ("llama3", None, "llama3"),
        ("Llama-3.1-8B", None, "llama3"),
        ("qwen3", "pythonic", "pythonic"),
    ],
)
def test_pick_format(hint, override, expected):
    assert pick_format(hint, override) == expected


def test_unknown_format_is_rejected():
    with pytest.raises(ValueError):
        pick_format("qwen", "xml")
    with pytest.raises(ValueError):
        ToolContract(tools={}, format="xml")


def test_contract_from_openai():
    contract = ToolContract.from_openai(OPENAI_TOOLS, format="llama3", tool_choice="required")
    assert contract.tools == TOOLS
    assert (contract.format, contract.tool_choice) == ("llama3", "required")


def test_default_system_prompt_lists_tools_and_the_call_format():
    prompt = DEFAULT_TOOL_SYSTEM_PROMPT(OPENAI_TOOLS)
    inner = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in inner.splitlines()] == OPENAI_TOOLS
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt


def test_rendered_tool_calls_decode_back_to_the_same_calls():
    message_calls = [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Kyiv"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "f", "arguments": "{}"}},
    ]
    run = decode(render_tool_calls_as_text(message_calls))
    assert [(c.name, c.arguments_json) for c in run.terminal.tool_calls] == [
        ("get_weather", '{"city": "Kyiv"}'),
        ("f", "{}"),
    ]
    assert run.content == ""


def test_render_tool_result():
    assert (
        render_tool_result_as_text("f", "22C") == '<tool_response>\n{"name": "f", "content": "22C"}\n</tool_response>'
    )
    assert render_tool_result_as_text(None, "22C") == "<tool_response>\n22C\n</tool_response>"


# -- properties ---------------------------------------------------------------

# Fragments that hit every marker, bracket, quote and escape boundary.
FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "_call>",
    "<|python_tag|>",
    "<|py",
    '{"name": "get_weather", "arguments": {"city": "P<a>ris"}}',
    '{"name": "f"}',
    '{"name": "f", "parameters": {"x": "}{"}}',
    '{"name": "nope", "arguments": {}}',
    "get_weather(city='x')",
    "f(a=[1, {'b': ')'}])",
    "nope(a=1)",
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
    ":",
    " ",
    "\n",
    "Hi",
    "é🙂",
    "<",
    ">",
    "null",
]
TEXT = st.text(alphabet='ab <>{}[]"\\\n🙂', max_size=8)


@st.composite
def outputs(draw) -> tuple[str, str]:
    fmt = draw(st.sampled_from(FORMATS))
    soup = draw(st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join))
    args = st.dictionaries(st.sampled_from(["city", "q", "n"]), st.one_of(TEXT, st.integers()), max_size=3)
    calls = draw(st.lists(st.tuples(st.sampled_from(["get_weather", "f", "nope"]), args), max_size=3))
    if fmt == "hermes":
        shaped = draw(TEXT) + "".join(call(n, a) + draw(TEXT) for n, a in calls)
    elif fmt == "llama3":
        shaped = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls) + draw(TEXT)
    else:
        body = ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls)
        shaped = f"[{body}]" + draw(TEXT)
    return fmt, draw(st.sampled_from([soup, shaped, shaped[: draw(st.integers(0, len(shaped)))]]))


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


PROPERTY = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(outputs(), st.lists(st.integers(0, 10_000), max_size=12))
def test_any_split_publishes_the_same_content_and_calls(output, cuts):
    fmt, text = output
    whole = decode(text, fmt)
    pieces = decode(split(text, cuts), fmt)
    assert pieces.content == whole.content
    assert pieces.deltas == whole.deltas
    assert pieces.terminal.tool_calls == whole.terminal.tool_calls
    assert pieces.terminal.diagnostics == whole.terminal.diagnostics


@PROPERTY
@given(outputs(), st.lists(st.integers(0, 10_000), max_size=12))
def test_streamed_deltas_rebuild_the_final_calls(output, cuts):
    fmt, text = output
    run = decode(split(text, cuts), fmt)
    calls = run.terminal.tool_calls
    assert sorted({d.index for d in run.deltas}) == list(range(len(calls)))
    for i, final in enumerate(calls):
        mine = [d for d in run.deltas if d.index == i]
        assert (mine[0].id, mine[0].name, mine[0].arguments) == (final.id, final.name, "")
        assert all(d.id is None and d.name is None for d in mine[1:])
        assert "".join(d.arguments for d in mine) == final.arguments_json
        assert isinstance(json.loads(final.arguments_json), dict)
    if not calls:
        assert run.content == text  # nothing is dropped unless a call was accepted


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            TEXT.filter(lambda t: "<tool_call>" not in t),
            st.dictionaries(st.sampled_from(["city", "q"]), st.one_of(TEXT, st.integers(), st.none()), max_size=3),
        ),
        max_size=4,
    ),
    st.lists(st.integers(0, 10_000), max_size=12),
)
def test_hermes_finds_exactly_the_calls_that_were_written(calls, cuts):
    text = "".join(before + call("f", args) for before, args in calls) + " tail"
    run = decode(split(text, cuts))
    assert run.calls == [("f", args) for _, args in calls]
    assert run.reason is FallbackReason.NONE
    assert run.content.endswith(" tail")


def test_invalid_client_schema_skips_validation_instead_of_failing():
    run = decode(call("g", {"a": 1}), tools={"g": {"type": "not-a-type"}})
    assert run.calls == [("g", {"a": 1})]
    assert run.terminal.diagnostics.schema_mismatch_arguments == 0
