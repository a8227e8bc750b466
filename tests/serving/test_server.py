"""The real server on 127.0.0.1 (tiny random llama, SmolLM2 tokenizer) with the openai client."""

from __future__ import annotations

import concurrent.futures
import re
import time

import requests
import openai
import pytest
from tests.serving.launch import running_server

KEY = "test-key"
CONFIG = """
[limits]
active_requests = {active}
active_state_mib = 64
request_bytes = 65536
max_output_tokens = 480
prefix_cache_min_tokens = 16
[engine]
max_slots = 8
kv_mib = 8
max_seq_len = 512
chunk_buckets = [32, 128]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    with running_server(
        ["tests.serving.tiny_server", "--api-key", KEY], tmp, CONFIG.format(active=8), health_timeout=240
    ) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


class Http:
    """requests with a base URL and the API key."""

    def __init__(self, base: str):
        self.base = base
        self.s = requests.Session()
        self.s.headers["authorization"] = f"Bearer {KEY}"

    def get(self, path, **kw):
        return self.s.get(self.base + path, timeout=60, **kw)

    def post(self, path, **kw):
        return self.s.post(self.base + path, timeout=60, **kw)

    def delete(self, path, **kw):
        return self.s.delete(self.base + path, timeout=60, **kw)


@pytest.fixture
def http(server):
    return Http(server["base"])


MSGS = [{"role": "user", "content": "Tell me a short story about a robot."}]


def _state(http):
    return http.get("/v1/state").json()


def _wait_idle(http, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        s = _state(http)
        if s["active_requests"] == 0 and s["queued_requests"] == 0:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def test_stream_equals_non_stream_and_usage(client, http):
    # ignore_eos: the tiny random model runs to max_tokens, so every count below is known.
    full = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MSGS,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == full.choices[0].finish_reason
    ids = http.post("/tokenize", json={"messages": MSGS}).json()["tokens"]
    assert full.usage.prompt_tokens == len(ids) == chunks[-1].usage.prompt_tokens
    assert full.usage.completion_tokens == chunks[-1].usage.completion_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 20


def test_completions_text_and_token_ids(client, http):
    a = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    b = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, logprobs=2)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == len(ids)
    assert len(b.choices[0].logprobs.token_logprobs) == b.usage.completion_tokens
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == "Once upon a time"
    streamed = list(
        client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == a.choices[0].text
    assert sum(1 for c in streamed if c.choices and c.choices[0].finish_reason) == 1


def test_sixteen_concurrent_equal_solo(client):
    prompts = [f"Request number {i}: list {i % 5 + 2} colours of the rainbow" for i in range(16)]

    def one(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text

    solo = [one(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(one, prompts))
    assert together == solo


def test_request_mid_decode_streams_before_first_finishes(client):
    long = client.completions.create(
        model="tiny",
        prompt="Count to a thousand:",
        max_tokens=250,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(long)
    next(it)
    short = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0, stream=True)
    first_short = next(iter(short))
    assert first_short.choices[0].text is not None
    rest = list(it)  # the long one is still going after the short one's first token
    assert rest and rest[-1].choices[0].finish_reason == "length"


def test_shared_prefix_uses_cache_and_same_output(client):
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    msgs = [system, {"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    other = client.chat.completions.create(
        model="tiny", messages=[system, {"role": "user", "content": "And Spain?"}], max_tokens=4, temperature=0
    )
    assert other.usage.prompt_tokens_details.cached_tokens > 0


def test_cancel_mid_stream_frees_reservation(client, http):
    stream = client.completions.create(
        model="tiny",
        prompt="Go on forever",
        max_tokens=250,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    next(it)
    next(it)
    stream.close()
    s = _wait_idle(http)
    assert s["reserved_state_bytes"] == 0 and s["pages_in_use"] == 0 and s["reserved_pages"] == 0
    assert s["requests"]["cancelled"] >= 1


def test_pages_in_use_equal_reservations(client, http):
    stream = client.completions.create(
        model="tiny", prompt="Keep going", max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it)
    s = _state(http)
    assert s["active_requests"] == 1 and s["pages_in_use"] == s["reserved_pages"] > 0
    assert s["reserved_state_bytes"] == s["active"][0]["reserved_state_bytes"]
    list(it)


def _expect(status, fn):
    with pytest.raises(openai.APIStatusError) as e:
        fn()
    assert e.value.status_code == status, e.value
    return e.value


def test_error_statuses_then_normal_request(server, client, http):
    _expect(400, lambda: client.chat.completions.create(model="tiny", messages=MSGS, temperature=-1))
    err = _expect(400, lambda: client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1000))
    assert err.body["param"] == "max_tokens"  # the client hands over the body's "error" object
    _expect(400, lambda: client.completions.create(model="tiny", prompt=[1] * 400, max_tokens=200))
    bad_key = openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0)
    _expect(401, lambda: bad_key.models.list())
    _expect(404, lambda: client.chat.completions.create(model="nope", messages=MSGS))
    _expect(404, lambda: client.chat.completions.create(model="tiny", messages=MSGS, extra_body={"session": "f" * 32}))
    _expect(
        413, lambda: client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 70000}])
    )
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "n": 9, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # more choices than slots: never
    r = http.post("/v1/completions", data=b"{not json")
    assert r.status_code == 400 and "error" in r.json()
    ok = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 3
    metrics = http.get("/metrics").text
    for status in ("400", "401", "404", "413"):
        assert f'jaxllm_http_errors_total{{status="{status}"}}' in metrics


def test_client_gone_before_admission_is_499(server, client, http):
    server["config"].write_text(CONFIG.format(active=1))
    gen = http.post("/v1/settings/reload").json()["generation"]
    try:
        # The longest stream the context holds keeps the one slot busy well past the impatient
        # client's timeout (250 tokens took under 0.3 s on the CPU once decode rounds stopped
        # sampling every slot).
        long = client.completions.create(
            model="tiny", prompt="Busy", max_tokens=480, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        it = iter(long)
        next(it)
        impatient = openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=0.2)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="tiny", prompt="queued", max_tokens=2)
        list(it)
    finally:
        server["config"].write_text(CONFIG.format(active=8))
        assert http.post("/v1/settings/reload").json()["generation"] == gen + 1
    s = _wait_idle(http)
    assert s["requests"]["cancelled_queued"] >= 1 and s["settings_generation"] >= gen
    assert 'jaxllm_http_errors_total{status="499"}' in http.get("/metrics").text
    assert "499 client went away before admission" in server["log"].read_text()
    assert client.completions.create(model="tiny", prompt="after", max_tokens=2).choices


def test_stop_string_not_leaked(client):
    base = (
        client.completions.create(
            model="tiny", prompt="The weather today", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    assert len(base) >= 6, base  # 16 tokens of a random model: long enough to cut
    stop = base[3:6]
    cut = base[: base.find(stop)]
    r = client.completions.create(model="tiny", prompt="The weather today", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    s = list(
        client.completions.create(
            model="tiny", prompt="The weather today", max_tokens=16, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in s if c.choices) == cut


def test_n_and_seed(client, http):
    """Choice i of a request seeded s draws what a single request seeded s + i draws."""
    kw = dict(model="tiny", prompt="Pick a word:", max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    before = _wait_idle(http)["requests"]["prefilled_tokens"]
    r = client.completions.create(n=3, seed=7, **kw)
    # One prefill: choices 1 and 2 fork from choice 0's state and recompute the last position only.
    assert _wait_idle(http)["requests"]["prefilled_tokens"] - before == r.usage.prompt_tokens + 2
    again = client.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    assert len({c.text for c in r.choices}) == 3  # sampled at temperature 1: three different completions
    singles = [client.completions.create(n=1, seed=7 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == singles
    assert r.usage.completion_tokens == 3 * 6 and all(c.finish_reason == "length" for c in r.choices)


def test_sessions(server, client, http):
    first = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MSGS, max_tokens=4, temperature=0, extra_body={"session": True}
    )
    sid = first.headers["x-session-id"]
    body = first.parse()
    assert len(sid) == 32
    second = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "More."}],
        max_tokens=4,
        temperature=0,
        extra_body={"session": sid},
    )
    assert second.usage.prompt_tokens > body.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    got = http.get(f"/v1/sessions/{sid}").json()
    assert got["turns"] == 2 and [m["role"] for m in got["messages"]] == ["user", "assistant", "user", "assistant"]
    other = requests.get(f"{server['base']}/v1/sessions/{sid}", headers={"authorization": "Bearer other"})
    assert other.status_code == 401
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    assert http.get(f"/v1/sessions/{sid}").status_code == 404


def test_research_samplers_need_the_extra_samplers_setting(client):
    """This server runs without [engine] extra_samplers: a request turning a research sampler
    on is a 400 naming the field; one leaving them at their neutral values runs."""
    e = _expect(
        400,
        lambda: client.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=2, extra_body={"xtc_probability": 1.0}
        ),
    )
    assert e.body["param"] == "xtc_probability" and "extra_samplers" in e.body["message"]
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=2, extra_body={"typical_p": 1.0, "ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_tools_round_trip_renders(client, smollm2_gguf_path):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=TOOLS, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8  # no call: a random model
    msgs = MSGS + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant"
    # The history reached the prompt: the call and its result, after the user's message.
    from jaxllm.tokenizer import Tokenizer
    from serving.protocol import parse_chat
    from serving.settings import Settings

    tok = Tokenizer.from_gguf(smollm2_gguf_path)
    prepared = parse_chat(
        {"model": "tiny", "messages": msgs, "tools": TOOLS, "max_tokens": 8},
        tok,
        Settings(),
        max_context=512,
        model_name="tiny",
        vocab=tok.vocab_size,
    )
    assert r.usage.prompt_tokens == len(prepared.prompt)
    rendered = tok.decode(prepared.prompt, skip_special_tokens=False)
    story = rendered.find("short story about a robot")
    call = rendered.find('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', story)
    result = rendered.find("<tool_response>\nsunny\n</tool_response>", call)
    assert -1 < story < call < result, rendered
    s = list(
        client.chat.completions.create(
            model="tiny", messages=msgs, tools=TOOLS, max_tokens=8, temperature=0, stream=True
        )
    )
    assert sum(1 for c in s if c.choices and c.choices[0].finish_reason) == 1


def test_models_metrics_state(client, http):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert "jaxllm_generated_tokens_total" in http.get("/metrics").text
    s = _state(http)
    assert s["ready"] and s["requests"]["reconcile_errors"] == 0 and s["requests"]["failed_rounds"] == 0
    assert s["model"]["name"] == "tiny" and s["model"]["costs"]["kv_bytes_per_position"] > 0


def test_profiling_endpoints_need_a_profile_dir(http):
    for path in ("/start_profile", "/stop_profile"):
        r = http.post(path)
        assert r.status_code == 400 and "--profile-dir" in r.json()["error"]["message"]


def test_bad_engine_settings_fail_when_read():
    from serving.settings import parse_settings

    with pytest.raises(ValueError, match="chunk_segments"):
        parse_settings({"engine": {"chunk_segments": 0}})
    with pytest.raises(ValueError, match="extra_samplers = 1: must be true or false"):
        parse_settings({"engine": {"extra_samplers": 1}})
    assert parse_settings({"engine": {"extra_samplers": True}}).engine.engine_config().extra_samplers


def test_newcomer_cases(server, client, http):
    """404 and 405 are counted; echo puts the prompt first (stream or not), session is a 400 on
    completions; logprob tokens are text with their bytes; no log line printed twice (the
    warm-up's progress lines: test_bench_serve, whose server warms up)."""
    assert http.get("/nope").status_code == 404
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    metrics = http.get("/metrics").text
    for status in ("404", "405"):
        assert f'jaxllm_http_errors_total{{status="{status}"}}' in metrics

    whole = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0)
    assert whole.choices[0].text == "Once upon" + plain.choices[0].text
    streamed = client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    err = _expect(400, lambda: client.completions.create(model="tiny", prompt="x", max_tokens=2, echo=True, logprobs=1))
    assert err.body["param"] == "echo"
    err = _expect(
        400, lambda: client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"session": True})
    )
    assert err.body["param"] == "session"

    out = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    items = out.choices[0].logprobs.content
    assert items and all("Ġ" not in i.token for i in items)
    for i in items + [t for i in items for t in i.top_logprobs]:
        raw = bytes.fromhex(i.token[6:].replace("\\x", "")) if i.token.startswith("bytes:") else i.token.encode()
        assert bytes(i.bytes) == raw, i

    log = server["log"].read_text()
    lines = [line.split(" ", 2)[-1] for line in log.splitlines() if line.strip()]
    assert len([x for x in lines if "Starting worker" in x]) == 1, log[-2000:]
    # Each report line's KV fullness counts the reported request's own pages (at least one).
    reports = re.findall(r"kv cache (\d+)/\d+ pages", log)
    assert reports and "0" not in reports, reports
    # No loading bar in a log file (stderr is no terminal) and no TPU probe at INFO.
    assert "\r" not in log and "loading gguf" not in log and "Unable to initialize backend" not in log
