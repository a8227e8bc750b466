"""Server hardening (issue 20): one bad request never hurts another, the process or the host.

The real server on 127.0.0.1 (tiny random llama, SmolLM2 tokenizer) with the openai client
and plain HTTP; each test ends by checking the server still serves.
"""

from __future__ import annotations

import json
import select
import signal
import socket
import time

import jsonschema
import openai
import pytest
import requests

from tests.serving.launch import running_server

KEY = "test-key"
KEY2 = "second-key"
CONFIG = """
[limits]
active_requests = 8
active_state_mib = 64
request_bytes = 65536
max_output_tokens = 256
max_schema_bytes = 16384
body_seconds = 2
max_connections = 12
profile_max_seconds = 1
profile_max_mib = 1
[engine]
max_slots = 4
kv_mib = 8
max_seq_len = 512
chunk_buckets = [32, 128]
"""
MSGS = [{"role": "user", "content": "Where do I live?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hardening")
    (tmp / "keys").write_text(f"# a second client\n{KEY2}\n")
    args = [
        "tests.serving.tiny_server",
        "--api-key",
        KEY,
        "--api-key-file",
        str(tmp / "keys"),
        "--profile-dir",
        str(tmp / "trace"),
    ]
    with running_server(args, tmp, CONFIG, health_timeout=240) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


class Http:
    """requests with a base URL and the API key."""

    def __init__(self, base: str, key: str | None = KEY):
        self.base = base
        self.s = requests.Session()
        if key is not None:
            self.s.headers["authorization"] = f"Bearer {key}"

    def get(self, path, **kw):
        return self.s.get(self.base + path, timeout=60, **kw)

    def post(self, path, **kw):
        return self.s.post(self.base + path, **{"timeout": 60, **kw})


@pytest.fixture
def http(server):
    return Http(server["base"])


def _wait_idle(http, timeout: float = 30.0) -> dict:
    """/v1/state once no request is active or queued (the worker publishes after each round)."""
    deadline = time.monotonic() + timeout
    while True:
        s = http.get("/v1/state").json()
        if (
            s["active_requests"] == 0
            and s["queued_requests"] == 0
            and s["free_slots"] == 4
            or time.monotonic() > deadline
        ):
            return s
        time.sleep(0.05)


def still_serves(server, client) -> None:
    """The process is alive, healthy and answers a normal request."""
    assert server["proc"].poll() is None, server["log"].read_text()[-3000:]
    assert requests.get(server["base"] + "/health", timeout=10).status_code == 200
    ok = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def tool(parameters: dict) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {"name": "locate", "description": "Where someone lives", "parameters": parameters},
        }
    ]


FORCED = {"type": "function", "function": {"name": "locate"}}
ADDRESS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
# A pointer that exists only in the server's wrapper object around the arguments, not in the schema.
WRAPPER_REF = {
    "$defs": {"Address": ADDRESS},
    "type": "object",
    "properties": {"home": {"$ref": "#/properties/arguments/$defs/Address"}},
    "required": ["home"],
    "additionalProperties": False,
}


def test_a_request_failing_in_host_code_fails_alone(server, client, http):
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": MSGS,
            "tools": tool(WRAPPER_REF),
            "tool_choice": FORCED,
            "max_tokens": 64,
            "temperature": 0,
        },
    )
    assert r.status_code in (400, 500), r.text
    assert r.json()["error"]["message"]
    still_serves(server, client)


# pydantic's shape for a model with a nested model: the nested one in $defs, referenced from the root.
PYDANTIC = {
    "$defs": {"Address": ADDRESS},
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "home": {"$ref": "#/$defs/Address"}},
    "required": ["name", "home"],
    "additionalProperties": False,
    "title": "Person",
}
RECURSIVE = {
    "$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}, "required": ["next"]}},
    "$ref": "#/$defs/Node",
}


def test_refs_and_defs_work_for_forced_tools_and_response_format(server, client):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=tool(PYDANTIC), tool_choice=FORCED, max_tokens=120, temperature=0
    )
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), PYDANTIC)
    r = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=120,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PYDANTIC}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), PYDANTIC)
    still_serves(server, client)


@pytest.mark.parametrize(
    "schema",
    [
        RECURSIVE,
        {"type": "object", "properties": {"me": {"$ref": "#"}}},
        WRAPPER_REF,
        {"properties": {"a": {"$ref": "https://example.com/a.json"}}},
    ],
)
def test_schemas_the_server_cannot_enforce_are_400_naming_the_field(server, client, http, schema):
    for body, param in [
        ({"tools": tool(schema), "tool_choice": FORCED}, "tools"),
        ({"tools": tool(schema)}, "tools"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            "response_format",
        ),
    ]:
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 8, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and "$ref" in err["message"]
    still_serves(server, client)


def test_a_sequence_failing_in_admission_gives_back_its_slot_and_pages(server, client, http):
    # top_k beyond int32 fails after the engine took a slot; max_slots + 1 of them used to
    # leave every later request queued for good while /health said ok.
    for _ in range(5):
        r = http.post(
            "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "top_k": 2**40}, timeout=20
        )
        assert r.status_code in (200, 400, 500), r.text
    state = _wait_idle(http)
    assert state["free_slots"] == 4 and state["pages_in_use"] == 0 and state["stuck"] is None
    still_serves(server, client)


def _chat(**fields) -> str:
    return json.dumps({"model": "tiny", "messages": MSGS, "max_tokens": 2, **fields})


BIG = "1" + "0" * 400  # an integer past float range
MALFORMED = [  # (path, raw JSON body, the param the 400 names)
    (
        "/v1/chat/completions",
        '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        "messages[0].content",
    ),
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\udc00", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": "ab", "stop": ["\\ud800"], "max_tokens": 2}', "stop[0]"),
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
    (
        "/v1/completions",
        '{"model": "tiny", "prompt": "ab", "max_tokens": 2, "temperature": ' + BIG + "}",
        "temperature",
    ),
    (
        "/v1/completions",
        '{"model": "tiny", "prompt": "ab", "max_tokens": 2, "logit_bias": {"5": ' + BIG + "}}",
        "logit_bias",
    ),
    ("/v1/completions", '{"model": "tiny", "prompt": "ab", "max_tokens": 2, "top_k": ' + BIG + "}", "top_k"),
    ("/v1/completions", '{"model": "tiny", "prompt": "ab", "max_tokens": 2, "temperature": Infinity}', "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": "ab", "max_tokens": 2, "top_p": NaN}', "top_p"),
    (
        "/v1/completions",
        '{"model": "tiny", "prompt": "ab", "max_tokens": 2, "presence_penalty": 1e400}',
        "presence_penalty",
    ),
    (
        "/v1/chat/completions",
        _chat(messages=MSGS + [{"role": "assistant", "tool_calls": [{"id": "x"}]}]),
        "messages[1].tool_calls[0].function",
    ),
    (
        "/v1/chat/completions",
        _chat(messages=MSGS + [{"role": "assistant", "tool_calls": "call"}]),
        "messages[1].tool_calls",
    ),
    (
        "/v1/chat/completions",
        _chat(messages=MSGS + [{"role": "assistant", "tool_calls": [7]}]),
        "messages[1].tool_calls[0]",
    ),
    ("/v1/chat/completions", _chat(tools=[{"function": {"name": ["a"]}}]), "tools[0].function.name"),
    (
        "/v1/chat/completions",
        _chat(tools=[{"type": "function", "function": {"name": "a", "description": 5}}]),
        "tools[0].function.description",
    ),
    (
        "/v1/chat/completions",
        _chat(tools=[{"function": {"name": "a"}}], tool_choice={"function": "a"}),
        "tool_choice.function",
    ),
    ("/v1/chat/completions", _chat(tools=[{"function": {"name": "a"}}], tool_choice=5), "tool_choice"),
    ("/tokenize", "[1, 2]", None),
    ("/tokenize", '"text"', None),
    ("/detokenize", "[1, 2]", None),
    ("/detokenize", '{"tokens": [true]}', "tokens"),
    ("/v1/completions", '{"model": "tiny", "prompt": "ab", "max_tokens": 2, "temperature": -1}', "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": "ab", "max_tokens": 2, "min_tokens": 5}', "min_tokens"),
    (
        "/v1/completions",
        '{"model": "tiny", "prompt": "ab", "max_tokens": 2, "stop_token_ids": [99999999]}',
        "stop_token_ids",
    ),
]


@pytest.mark.parametrize("path,raw,param", MALFORMED)
def test_malformed_input_is_a_400_naming_the_field(http, path, raw, param):
    r = http.post(path, data=raw.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": r.json()["error"]["message"],
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }
    assert r.json()["error"]["message"]


def test_n_over_the_slots_is_a_400_naming_n(server, client, http):
    # More choices than sequence slots can never be admitted, however idle the server: the
    # client must change the request (400), not retry it later (503).
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 2, "n": 5})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and err["type"] == "invalid_request_error" and "n <= 4" in err["message"]
    with pytest.raises(openai.BadRequestError, match="n <= 4"):
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, n=5)
    assert len(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, n=4).choices) == 4
    still_serves(server, client)


def test_message_tool_and_schema_counts_are_capped_with_clear_400s(server, client, http):
    many = [{"role": "user", "content": "x"}] * 1025
    for path in ("/v1/chat/completions", "/tokenize"):
        r = http.post(path, json={"model": "tiny", "messages": many, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "max_messages" in r.json()["error"]["message"]
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "tools": tools, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools" and "max_tools" in r.text
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": "d" * 40} for i in range(400)},
    }
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": MSGS,
            "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format" and "max_schema_bytes" in r.text
    still_serves(server, client)


@pytest.mark.parametrize(
    "line",
    [
        'active_requests = "8"',
        "active_requests = 0",
        "prefill_chunk_seconds = -1.0",
        "max_output_tokens = true",
        "starvation_seconds = nan",
    ],
)
def test_a_reload_with_a_wrong_value_is_refused_and_the_old_settings_stay(server, client, http, line):
    before = http.get("/v1/state").json()["settings_generation"]
    good = server["config"].read_text()
    key = line.split()[0]
    kept = "".join(x for x in good.splitlines(keepends=True) if not x.startswith(key + " "))
    server["config"].write_text(kept.replace("[limits]\n", f"[limits]\n{line}\n"))
    try:
        r = http.post("/v1/settings/reload")
    finally:
        server["config"].write_text(good)
    assert r.status_code == 400 and line.split()[0] in r.json()["error"]["message"], r.text
    assert http.get("/v1/state").json()["settings_generation"] == before
    still_serves(server, client)


def test_settings_are_checked_the_same_at_start_up():
    from serving.settings import parse_settings

    for table in (
        {"limits": {"active_requests": "8"}},
        {"defaults": {"top_p": 0}},
        {"engine": {"max_slots": "4"}},
        {"defaults": {"tool_call_format": "xml"}},
        {"limits": []},
    ):
        with pytest.raises(ValueError):
            parse_settings(table)
    assert parse_settings({"limits": {"starvation_seconds": 3}}).limits.starvation_seconds == 3.0


def _raw(server, head: str, body: bytes = b"", *, timeout: float = 20) -> bytes:
    """Sends a request head (and part of a body) on a fresh socket; returns what comes back
    until the server closes or `timeout` passes."""
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=timeout) as s:
        s.sendall(head.encode() + body)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and b'"error"' in out:
                    break
        except TimeoutError:
            pass
        return out


def test_a_wrong_key_is_refused_on_the_headers_before_the_body(server):
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer wrong\r\n"
        "content-type: application/json\r\ncontent-length: 60000\r\n\r\n"
    )
    got = _raw(server, head, b'{"messages": [')  # the rest of the body never comes
    assert got.startswith(b"HTTP/1.1 401"), got[:200]


def test_a_body_that_does_not_arrive_in_time_is_a_408(server, client):
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
        + KEY
        + "\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    )
    got = _raw(server, head, b'{"prompt": ')  # 11 of 100 bytes; body_seconds = 2 in this config
    assert got.startswith(b"HTTP/1.1 408") and b"body_seconds" in got, got[:300]
    still_serves(server, client)


def test_connections_past_the_cap_are_refused_with_503(server, client):
    opened = [socket.create_connection(("127.0.0.1", server["port"]), timeout=10) for _ in range(24)]
    try:
        refused = 0
        for s in opened:
            s.settimeout(0.5)
            try:
                refused += s.recv(4096).startswith(b"HTTP/1.1 503")
            except TimeoutError:
                pass
        assert refused >= 24 - 12, refused  # max_connections = 12 in this config
    finally:
        for s in opened:
            s.close()
    time.sleep(0.5)  # the server sees the closes
    still_serves(server, client)


def test_sessions_belong_to_their_key_and_are_listed_to_it_alone(server, client, http):
    other = Http(server["base"], KEY2)
    first = http.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 2, "session": True}
    )
    sid = first.headers["x-session-id"]
    assert other.get(f"/v1/sessions/{sid}").status_code == 404
    r = other.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 2, "session": sid})
    assert r.status_code == 404 and r.json()["error"]["param"] == "session"
    assert other.s.delete(server["base"] + f"/v1/sessions/{sid}").status_code == 404
    # A long turn is running: /v1/state names its session to the owner only.
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Go on."}],
        max_tokens=200,
        stream=True,
        extra_body={"session": sid, "ignore_eos": True},
    )
    it = iter(stream)
    next(it)
    try:
        mine = [a["session"] for a in http.get("/v1/state").json()["active"]]
        theirs = [a["session"] for a in other.get("/v1/state").json()["active"]]
        assert sid in mine and sid not in theirs and sid not in other.get("/v1/state").text
        # A second turn of the same session meanwhile would interleave the history: 409.
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 2, "session": sid})
        assert r.status_code == 409 and r.json()["error"]["param"] == "session", r.text
    finally:
        list(it)
    got = http.get(f"/v1/sessions/{sid}").json()
    assert got["turns"] == 2 and [m["role"] for m in got["messages"]] == ["user", "assistant"] * 2
    assert (
        other.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 2}).status_code == 200
    )


def test_a_rejected_request_creates_no_session(server, client, http):
    still_serves(server, client)  # a round ends with a fresh /v1/state
    created = _wait_idle(http)["sessions"]["created"]
    for extra in ({"temperature": -1}, {"n": 5}, {"max_tokens": 100000}, {"tools": [{"function": {"name": 5}}]}):
        r = http.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 2, "session": True, **extra}
        )
        assert r.status_code in (400, 503) and "x-session-id" not in r.headers, r.text
    still_serves(server, client)
    assert _wait_idle(http)["sessions"]["created"] == created


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tmp_path):
    with running_server(["tests.serving.tiny_server", "--api-key", KEY], tmp_path, CONFIG, health_timeout=240) as s:
        client = openai.OpenAI(base_url=s["base"] + "/v1", api_key=KEY, max_retries=0, timeout=60)
        stream = client.completions.create(
            model="tiny", prompt="Once", max_tokens=250, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        it = iter(stream)
        text = next(it).choices[0].text
        s["proc"].send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the server has seen the signal
        r = requests.post(
            s["base"] + "/v1/completions",
            headers={"authorization": f"Bearer {KEY}"},
            timeout=10,
            json={"model": "tiny", "prompt": "late", "max_tokens": 2},
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        chunks = list(it)  # the in-flight stream runs to its end
        assert chunks[-1].choices[0].finish_reason == "length"
        text += "".join(c.choices[0].text for c in chunks)
        assert s["proc"].wait(60) == 0
        assert "drain" in s["log"].read_text()


def test_a_profile_stops_by_itself_and_a_full_profile_dir_refuses_a_new_one(server, client, http):
    r = http.post("/start_profile")
    assert r.status_code == 200 and r.json()["max_seconds"] == 1, r.text
    deadline = time.monotonic() + 60
    while "profiler trace timed out" not in server["log"].read_text():
        assert time.monotonic() < deadline, "the trace never stopped by itself"
        time.sleep(0.2)
    assert http.post("/stop_profile").status_code == 400  # nothing runs any more
    (server["tmp"] / "trace" / "old.bin").write_bytes(b"\0" * (2 << 20))
    r = http.post("/start_profile")
    assert r.status_code == 409 and r.json()["error"]["code"] == "profile_dir_full", r.text
    still_serves(server, client)


def test_profiling_is_refused_on_a_server_without_an_api_key(tmp_path):
    args = ["tests.serving.tiny_server", "--profile-dir", str(tmp_path / "trace")]
    with running_server(args, tmp_path, CONFIG, health_timeout=240) as s:
        r = requests.post(s["base"] + "/start_profile", timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "profiling_needs_api_key", r.text


def test_headers_sent_a_byte_at_a_time_time_out(server, client):
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-padding: " + b"a" * 200
    got, started = b"", time.monotonic()
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=20) as s:
        try:
            for byte in head:  # each byte well within the idle timeout, the whole head (20 s) far past it
                s.sendall(bytes([byte]))
                if select.select([s], [], [], 0.1)[0]:
                    got = s.recv(4096)
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
    waited = time.monotonic() - started
    # body_seconds = 2 bounds the head; the error answer passes the key check first (401 or 408).
    assert waited < 10 and (got[:12] in (b"HTTP/1.1 408", b"HTTP/1.1 401") or got == b""), (waited, got[:200])
    still_serves(server, client)
