"""`jaxllm serve --model DIR` on a tiny hybrid (Gated DeltaNet + gated attention MoE)
checkpoint, through the official openai client: streaming, cached tokens on a repeat,
cancellation freeing the slot's recurrent state, speculative drafts that leave the text as it is."""

from __future__ import annotations

import json
import time

import openai
import pytest
import requests
from hf_tiny import make_tiny_hf_model
from tests.serving.launch import running_server

KEY = "hybrid-key"
CONFIG = """
[limits]
active_requests = 4
active_state_mib = 64
max_output_tokens = 128
prefix_cache_min_tokens = 4
[engine]
max_slots = 4
kv_mib = 4
max_seq_len = 256
chunk_buckets = [16, 64]
decode_steps_per_call = 2
max_drafts = 3
"""


def _tiny_hybrid_dir(root):
    """A qwen3_5_moe_text model at toy sizes with the default model's tokenizer beside it."""
    from jaxllm.loading.default_model import default_model_path
    from jaxllm.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    model_dir = make_tiny_hf_model("qwen3_5_moe_text", root, vocab_size=tok.vocab_size, noise=0.5)
    tok.hf.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": tok.chat_template,
                "eos_token": tok.hf.id_to_token(tok.eos_id),
            }
        )
    )
    return model_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid")
    model_dir = _tiny_hybrid_dir(tmp)
    args = [
        "serving.cli",
        "serve",
        "--model",
        str(model_dir),
        "--api-key",
        KEY,
        "--host",
        "127.0.0.1",
        "--served-model-name",
        "m",
    ]
    with running_server(args, tmp, CONFIG, health_timeout=300) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _state(server) -> dict:
    return requests.get(server["base"] + "/v1/state", headers={"authorization": f"Bearer {KEY}"}, timeout=30).json()


def _wait_idle(server, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = _state(server)
        if s["active_requests"] == 0 and s["queued_requests"] == 0:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


MSGS = [{"role": "user", "content": "Tell me a short story about a robot and a lighthouse."}]


def test_stream_equals_non_stream(client, server):
    full = client.chat.completions.create(
        model="m", messages=MSGS, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=MSGS,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert full.usage.completion_tokens == 24 and full.choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 24


def test_metrics_count_the_distinct_experts_of_each_step(client, server):
    """/metrics: a histogram of each step's distinct routed experts (mean over layers); a
    lone decoding request touches exactly top-k (2 of the tiny model's experts) a step."""

    def histogram() -> dict[str, float]:
        text = requests.get(server["base"] + "/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=30).text
        rows = [line.split() for line in text.splitlines() if line.startswith("jaxllm_moe_distinct_experts_")]
        return {name: float(value) for name, value in rows}

    _wait_idle(server)
    before = histogram()
    client.completions.create(
        model="m",
        prompt="Tell me a long story about one robot and seven lighthouses",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = histogram()
    steps = after["jaxllm_moe_distinct_experts_count"] - before["jaxllm_moe_distinct_experts_count"]
    total = after["jaxllm_moe_distinct_experts_sum"] - before["jaxllm_moe_distinct_experts_sum"]
    assert steps >= 5  # the prompt round, then the decode steps
    at_most_k = 'jaxllm_moe_distinct_experts_bucket{le="2.0"}'
    assert after[at_most_k] - before[at_most_k] >= steps - 1  # every decode step: top-2 exactly
    assert total > 2 * (steps - 1)  # the prompt round spreads over more experts


def test_exact_repeat_is_served_from_the_cache(client, server):
    prompt = "The lighthouse keeper counted the ships: one, two, three,"
    first = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
    again = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details is None or first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert again.choices[0].text == first.choices[0].text


def test_cancel_frees_the_recurrent_state(client, server):
    stream = client.completions.create(
        model="m", prompt="Go on forever", max_tokens=120, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it)
    busy = _state(server)
    assert busy["recurrent_state_bytes_in_use"] > 0
    next(it)
    stream.close()
    s = _wait_idle(server)
    assert s["recurrent_state_bytes_in_use"] == 0 and s["free_slots"] == 4
    assert s["reserved_state_bytes"] == 0 and s["pages_in_use"] == 0
    assert s["recurrent_state_bytes_total"] > 0
    # The server goes on serving afterwards.
    ok = client.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_drafts_leave_the_text_unchanged(client, server):
    prompt = "one two three four one two three four one two three four one two"
    common = dict(model="m", prompt=prompt, max_tokens=32, temperature=0.7, seed=11)
    plain = client.completions.create(**common, extra_body={"drafts": 0, "ignore_eos": True})
    drafted = client.completions.create(**common, extra_body={"drafts": 3, "ignore_eos": True})
    assert drafted.choices[0].text == plain.choices[0].text
    details = drafted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 0 and details.rejected_prediction_tokens >= 0
    state = _state(server)["speculative"]
    assert len(state["proposed"]) == 3
    models = client.models.list().data[0].model_extra
    assert models["speculative"] == {"draft_source": "prompt_lookup", "max_drafts": 3}
    with pytest.raises(openai.BadRequestError, match="drafts"):
        client.completions.create(model="m", prompt="x", max_tokens=2, extra_body={"drafts": 9})


def test_n_forks_the_recurrent_state_after_one_prefill(client, server):
    """n = 2 on a hybrid model: the prompt runs once and choice 1 starts from the recurrent
    state of prompt[:-1]; each choice i equals a single request seeded 5 + i."""
    kw = dict(
        model="m",
        prompt="Name a colour, a fruit and a river:",
        max_tokens=8,
        temperature=1.0,
        extra_body={"ignore_eos": True, "drafts": 0},
    )
    before = _wait_idle(server)["requests"]["prefilled_tokens"]
    both = client.completions.create(n=2, seed=5, **kw)
    assert _wait_idle(server)["requests"]["prefilled_tokens"] - before == both.usage.prompt_tokens + 1
    texts = [c.text for c in sorted(both.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]
    assert texts == [client.completions.create(n=1, seed=5 + i, **kw).choices[0].text for i in range(2)]
