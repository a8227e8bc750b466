"""Structured output end to end: the real default model (SmolLM2) behind the real server.

Forced tool calls and `response_format` are enforced by grammar masks, so even a 135M model
returns arguments and documents that validate; a full tool round trip completes.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from tests.serving.launch import running_server

CONFIG = """
[limits]
active_requests = 4
active_state_mib = 256
max_output_tokens = 256
[defaults]
temperature = 0.0
[engine]
max_slots = 4
kv_mib = 48
max_seq_len = 1024
chunk_buckets = [64, 256]
decode_steps_per_call = 4
"""
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 40}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_gguf_path):
    tmp = tmp_path_factory.mktemp("smollm2_server")
    args = ["serving.cli", "serve", "--model", str(smollm2_gguf_path), "--served-model-name", "smollm2"]
    with running_server(args, tmp, CONFIG) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="none", max_retries=0, timeout=120)


def _check_call(name: str, arguments: str) -> dict:
    assert name in SCHEMAS
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_tool_choice_required_returns_a_valid_call(client):
    r = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    _check_call(call.function.name, call.function.arguments)


def test_named_tool_choice_streamed_matches_non_streamed(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=80, temperature=0)
    full = client.chat.completions.create(**kw)
    (call,) = full.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_call("get_time", call.function.arguments)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    names, args = [], ""
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            if d.function and d.function.name:
                names.append(d.function.name)
            if d.function and d.function.arguments:
                args += d.function.arguments
    assert names == ["get_time"]
    assert json.loads(args) == json.loads(call.function.arguments)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["tool_calls"]


def test_response_format_json_schema_validates(client):
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Invent a person: name, age and hobbies."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        max_tokens=120,
        temperature=0,
        n=2,
        seed=3,
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_response_format_json_object_streamed(client):
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Give me a JSON object describing a cat."}],
            response_format={"type": "json_object"},
            max_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a valid prefix of an object
        assert reason == "length" and text.startswith("{")


def test_invalid_schema_is_a_400_and_the_server_still_works(client):
    with pytest.raises(openai.BadRequestError, match="nonsense"):
        client.chat.completions.create(
            model="smollm2",
            messages=ASK,
            max_tokens=10,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=10, response_format={"type": "yaml"})
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_round_trip_completes(client):
    first = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    _check_call("get_weather", call.function.arguments)
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call.id,
            "name": "get_weather",
            "content": json.dumps({"temperature": 18, "sky": "sunny"}),
        },
    ]
    final = client.chat.completions.create(
        model="smollm2", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=48, temperature=0
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
