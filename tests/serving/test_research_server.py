"""The research features through the real server (tiny random llama, openai client): sessions
that keep their rng and survive a restart (orbax, [limits] session_dir), same seed -> same
tokens whatever else is in the batch (drafting neighbours, prefix-cache hits), and the
research samplers as request fields ([engine] extra_samplers)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json

import numpy as np
import openai
import pytest
import requests
from tests.serving.launch import running_server

KEY = "research-key"
CONFIG = """
[limits]
active_requests = 32
active_state_mib = 256
max_output_tokens = 64
prefix_cache_min_tokens = 16
session_dir = "{session_dir}"
[engine]
max_slots = 8
kv_mib = 8
max_seq_len = 256
chunk_buckets = [64]
max_drafts = 2
verify_cost = 1.0  # every round with drafts verifies (the CPU's load rule would not at width): the target shares them
extra_samplers = true
"""


class Restartable:
    """The module's server, which the last test stops (SIGTERM: a graceful stop) and starts again."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.config = CONFIG.format(session_dir=tmp / "sessions")
        self._stack: contextlib.ExitStack | None = None
        self.info: dict = {}

    def start(self) -> None:
        self._stack = contextlib.ExitStack()
        self.info = self._stack.enter_context(
            running_server(["tests.serving.tiny_server", "--api-key", KEY], self.tmp, self.config, health_timeout=300)
        )

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.info["base"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Restartable(tmp_path_factory.mktemp("research_server"))
    s.start()
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return server.client()


def _chat(client, messages, **kw):
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    return client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=kw.pop("max_tokens", 8), extra_body=extra, **kw
    )


TURNS = ["Tell me about robots.", "And then?", "Why?"]


def _conversation(client, seed: int, turns=TURNS) -> tuple[str, list[str]]:
    """A session at temperature 1 whose seed is given on the first turn only."""
    first = _chat(
        client, [{"role": "user", "content": turns[0]}], temperature=1.0, seed=seed, extra_body={"session": True}
    )
    sid = first.headers["x-session-id"]
    texts = [first.parse().choices[0].message.content]
    for turn in turns[1:]:
        r = _chat(client, [{"role": "user", "content": turn}], temperature=1.0, extra_body={"session": sid})
        texts.append(r.parse().choices[0].message.content)
    return sid, texts


def test_a_session_keeps_the_rng_of_its_first_seed(client):
    _, a = _conversation(client, 11)
    _, b = _conversation(client, 11)
    assert a == b  # every turn: the later ones sample from the rng the first seed started
    _, c = _conversation(client, 12)
    assert all(x != y for x, y in zip(a, c)), (a, c)


# ---- same prompt + seed -> same tokens whatever else is in the batch ---------------------------
SYSTEM = {"role": "system", "content": "You answer in lists. Keep every answer short and plain. " * 3}
TARGET = [SYSTEM, {"role": "user", "content": "Name some colours."}]


def _target(client, **extra):
    r = client.chat.completions.create(
        model="tiny",
        messages=TARGET,
        max_tokens=16,
        temperature=1.0,
        seed=1234,
        extra_body={"ignore_eos": True, **extra},
    )
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


ALPHA = " alpha"


def _neighbour(client, i: int, alpha_id: int):
    """Mixed neighbours: lengths, greedy or sampled, filters, research samplers, repetitive
    prompts whose prompt-lookup drafts get verified, seeds and budgets."""
    words = f"Question {i}: " + "why " * (i % 9)
    if i % 4 == 0:  # " alpha" over and over, and more of it: prompt lookup drafts it, verification keeps it
        words, bias = ALPHA * 20, {str(alpha_id): 100}
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": words}],
            max_tokens=12,
            temperature=0.0,
            logit_bias=bias,
            extra_body={"ignore_eos": True},
        )
        return
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.0, extra_body={"top_k": 5}),
        dict(temperature=1.2, extra_body={"min_p": 0.1, "drafts": 0}),
        dict(temperature=1.0, extra_body={"xtc_probability": 0.5}),
        dict(temperature=0.0, logprobs=True, top_logprobs=3),
        dict(temperature=0.7, extra_body={"typical_p": 0.9}),
    ]
    kw = kinds[i % len(kinds)]
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": words}],
        max_tokens=4 + i % 13,
        seed=i,
        extra_body=extra,
        **kw,
    )


def test_same_seed_same_tokens_whatever_the_batch(server, client):
    alpha_id = _ids(server, ALPHA)
    alone, cached = _target(client, drafts=0)  # no drafts; the first run: nothing of it cached
    assert cached == 0
    again, cached = _target(client)  # a prefix-cache hit, drafting on
    assert cached > 0 and again == alone
    for concurrent_requests in (8, 32):
        with concurrent.futures.ThreadPoolExecutor(concurrent_requests) as pool:
            half = concurrent_requests // 2
            jobs = [pool.submit(_neighbour, client, i, alpha_id) for i in range(half - 1)]
            target = pool.submit(_target, client)
            jobs += [pool.submit(_neighbour, client, i, alpha_id) for i in range(half - 1, concurrent_requests - 1)]
            for j in jobs:
                j.result()
            assert target.result()[0] == alone, concurrent_requests
    state = requests.get(server.info["base"] + "/v1/state", headers={"authorization": f"Bearer {KEY}"}).json()
    assert sum(state["speculative"]["proposed"]) > 0  # neighbours' drafts were verified beside the target


# ---- the research samplers as request fields -------------------------------------------------
def _ids(server, word: str) -> int:
    ids = requests.post(
        server.info["base"] + "/tokenize", json={"prompt": word}, headers={"authorization": f"Bearer {KEY}"}
    ).json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def _complete(client, prompt, **kw):
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra, **kw).choices[0]


def test_xtc_removes_the_likeliest_tokens_as_numpy_says(server, client):
    """logit_bias +100 on three words at temperature 5 gives them nearly all the mass, in the
    order of the model's own logits, which greedy requests read (a reported logprob is the
    model's, before bias and temperature). XTC at probability 1 drops every token at or over
    its threshold but the least likely: numpy picks that token from the three logprobs."""
    words = [_ids(server, w) for w in (" red", " green", " blue")]
    bias = {str(t): 100 for t in words}
    for prompt in ("Colours:", "My favourite colour is", "Paint it"):
        forced = [
            _complete(client, prompt, temperature=0.0, logprobs=1, logit_bias={str(t): 100}).logprobs for t in words
        ]
        pieces = [f.tokens[0] for f in forced]  # the words as the server names tokens
        lps = np.array([f.token_logprobs[0] for f in forced])
        p = np.exp(lps / 5 - np.logaddexp.reduce(lps / 5))  # the three's share at temperature 5 (the rest: ~1e-4)
        threshold = float(p.min()) / 2  # all three above it
        want = pieces[int(np.argmin(p))]
        sampled = dict(temperature=5.0, logit_bias=bias, logprobs=1)
        for seed in range(3):
            plain = _complete(client, prompt, seed=seed, **sampled)
            xtc = _complete(
                client, prompt, seed=seed, extra_body={"xtc_probability": 1.0, "xtc_threshold": threshold}, **sampled
            )
            assert xtc.logprobs.tokens[0] == want, (prompt, seed, p)
            assert plain.logprobs.tokens[0] in pieces
            # With fewer than two tokens over the threshold XTC leaves the draw alone (same noise).
            off = _complete(
                client, prompt, seed=seed, extra_body={"xtc_probability": 1.0, "xtc_threshold": 0.999}, **sampled
            )
            assert off.logprobs.tokens == plain.logprobs.tokens


def test_dry_penalises_a_repeat_unless_a_breaker_cuts_it(server, client):
    """Greedy with logit_bias +100 on " alpha" after " alpha" x 12 repeats it. DRY (x100, base
    2, allowed 2) takes 100 * 2^(m - 2) off a token that extends a repeat of length m (here
    m = the whole run), far more than the bias: the first token is no longer " alpha". Named as
    a sequence breaker, " alpha" cuts every match: no penalty, " alpha" again."""
    alpha = _ids(server, ALPHA)
    greedy = dict(temperature=0.0, logit_bias={str(alpha): 100}, logprobs=1)
    dry = {"dry_multiplier": 100.0, "dry_base": 2.0, "dry_allowed_length": 2}
    plain = _complete(client, ALPHA * 12, **greedy).logprobs.tokens[0]
    penalised = _complete(client, ALPHA * 12, extra_body=dry, **greedy).logprobs.tokens[0]
    broken = _complete(
        client, ALPHA * 12, extra_body={**dry, "dry_sequence_breakers": [ALPHA]}, **greedy
    ).logprobs.tokens[0]
    assert penalised != plain and broken == plain


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("typical_p", 0, "typical_p must be in (0, 1]"),
        ("xtc_threshold", 1.5, "xtc_threshold must be in [0, 1]"),
        ("dry_allowed_length", "two", "'dry_allowed_length' must be an integer"),
        ("dry_base", 0.5, "dry_base must be >= 1"),
        ("mirostat_mode", 1, "'mirostat_mode' must be 0 (off) or 2"),
        ("top_n_sigma", -1, "top_n_sigma must be >= 0"),
        ("dry_sequence_breakers", "\n", "must be a list of up to 16 non-empty strings"),
    ],
)
def test_research_sampler_fields_are_validated(client, field, value, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=TARGET, max_tokens=2, extra_body={field: value})
    assert e.value.status_code == 400
    assert e.value.body["param"] == field and says in e.value.body["message"], e.value.body


# ---- sessions across a restart (last: it restarts the module's server) --------------------------
def test_sessions_survive_a_graceful_restart(server):
    client = server.client()
    first = _chat(
        client, [{"role": "user", "content": TURNS[0]}], temperature=1.0, seed=77, extra_body={"session": True}
    )
    sid = first.headers["x-session-id"]
    # The same conversation uninterrupted, in another session.
    _, whole = _conversation(client, 77, TURNS[:2])
    assert first.parse().choices[0].message.content == whole[0]
    server.stop()  # SIGTERM: drain, then the sessions are written
    saved = b"".join(p.read_bytes() for p in (server.tmp / "sessions").rglob("*") if p.is_file())
    assert sid.encode() in saved and KEY.encode() not in saved  # a hash of the key, never the key
    server.start()
    client = server.client()
    second = _chat(client, [{"role": "user", "content": TURNS[1]}], temperature=1.0, extra_body={"session": sid})
    assert second.parse().choices[0].message.content == whole[1]
    got = requests.get(f"{server.info['base']}/v1/sessions/{sid}", headers={"authorization": f"Bearer {KEY}"}).json()
    assert got["turns"] == 2 and [m["role"] for m in got["messages"]] == ["user", "assistant"] * 2
    assert json.dumps(got["messages"][1]["content"]) == json.dumps(whole[0])
