"""Request preparation and response shapes of the newcomer cases (no model): sampling
defaults from the model's generation config, `echo` and `session` on /v1/completions, the
`param` of sampler 400s, logprob tokens as text with their bytes."""

from __future__ import annotations

import dataclasses

import pytest

from jaxllm.tokenizer import Tokenizer
from serving.errors import ApiError
from serving.output import Delta, Done, Finish, Formatter
from serving.protocol import parse_chat, parse_completion
from serving.settings import Defaults, Settings, SettingsStore, parse_settings

TOK = Tokenizer.synthetic(64)


def completion(body: dict, settings: Settings = Settings()):
    return parse_completion(
        {"prompt": "t1 t2 t3", "max_tokens": 4, **body}, TOK, settings, max_context=256, model_name="m", vocab=64
    )


def chat(body: dict, settings: Settings = Settings()):
    return parse_chat(
        {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 4, **body},
        TOK,
        settings,
        max_context=256,
        model_name="m",
        vocab=64,
    )


def error_of(fn, body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(body)
    return e.value


def test_sampling_defaults_settings_then_model_then_openai():
    store = SettingsStore(Settings())
    assert completion({}, store.current).params[0].temperature == 1.0  # OpenAI's
    store.use_model_defaults({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "bogus": 3.0})
    p = completion({}, store.current).params[0]
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.6, 20, 0.95, 0.0)
    assert chat({"temperature": 0.2}, store.current).params[0].temperature == 0.2  # the request wins
    pinned = dataclasses.replace(store.current, defaults=Defaults(temperature=0.9))
    assert completion({}, pinned).params[0].temperature == 0.9  # the settings file wins over the model
    # A settings file read from TOML leaves the sampling defaults unset unless it names them.
    assert parse_settings({"defaults": {"top_p": 1}}).defaults == Defaults(top_p=1.0)


def test_model_defaults_survive_a_reload(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text("[defaults]\nmax_tokens = 8\n")
    store = SettingsStore(parse_settings({}), path)
    store.use_model_defaults({"temperature": 0.3})
    store.reload()
    assert store.current.sampling_defaults["temperature"] == 0.3 and store.current.defaults.max_tokens == 8


def test_completion_echo_and_session():
    p = completion({"echo": True})
    assert p.echo_text == "t1 t2 t3" and completion({}).echo_text == ""
    e = error_of(completion, {"echo": True, "logprobs": 1})
    assert e.status == 400 and e.param == "echo"
    e = error_of(completion, {"session": True})
    assert e.status == 400 and e.param == "session"


def test_echo_puts_the_prompt_before_each_choice():
    fmt = Formatter("completion", "id", "m", include_usage=False, logprobs=False, echo="Say: ")
    first = fmt.chunks(Delta(0, "hi", (), ()))[0]["choices"][0]["text"]
    second = fmt.chunks(Delta(0, " there", (), ()))[0]["choices"][0]["text"]
    finish_only = fmt.chunks(Finish(1, "length", "", (), ()))[0]["choices"][0]["text"]  # a choice with no text
    assert (first, second, finish_only) == ("Say: hi", " there", "Say: ")
    body = Formatter("completion", "id", "m", include_usage=False, logprobs=False, echo="Say: ").response(
        [Finish(0, "stop", "hi", (), ())], Done(usage={})
    )
    assert body["choices"][0]["text"] == "Say: hi"


@pytest.mark.parametrize(
    "fn, body, param",
    [
        (completion, {"logprobs": 99}, "logprobs"),
        (completion, {"temperature": -1}, "temperature"),
        (completion, {"top_p": 0}, "top_p"),
        (completion, {"min_tokens": 9}, "min_tokens"),
        (chat, {"top_k": -5}, "top_k"),
        (chat, {"max_completion_tokens": 4, "min_tokens": 9}, "min_tokens"),
        (chat, {"presence_penalty": 3}, "presence_penalty"),
        (chat, {"logit_bias": {"999": 1}}, "logit_bias"),
        (chat, {"drafts": 2}, "drafts"),
    ],
)
def test_sampler_errors_name_their_field(fn, body, param):
    e = error_of(fn, body)
    assert e.status == 400 and e.param == param, (e.message, e.param)


def test_logprob_bytes_follow_the_token():
    fmt = Formatter("chat", "id", "m", include_usage=False, logprobs=True)
    items = ((" sea", -0.5, [(" sea", -0.5), ("bytes:\\xe6\\x97", -2.0)]),)
    lp = fmt.chunks(Delta(0, " sea", (), items))[0]["choices"][0]["logprobs"]["content"][0]
    assert lp["token"] == " sea" and lp["bytes"] == list(b" sea")
    assert lp["top_logprobs"][1]["bytes"] == [0xE6, 0x97]


def test_warmup_progress_is_logged_by_tenths(caplog):
    from serving.app import Server

    srv = Server(
        SettingsStore(Settings()), loader=lambda: None, model_name="m", api_keys=frozenset(), warmup=True, on_death=None
    )
    with caplog.at_level("INFO", logger="jaxllm.serve"):
        for done in range(41):
            srv.warmup_progress(done, 40)
    lines = [r.getMessage() for r in caplog.records if "warm-up" in r.getMessage()]
    assert lines[0] == "warm-up 0/40 shape variants compiled" and lines[-1] == "warm-up 40/40 shape variants compiled"
    assert len(lines) == 11 and (srv.warmup_done, srv.warmup_total) == (40, 40)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_generation_request_while_the_model_loads_is_a_503(kind):
    """Before the scheduler exists (the model still loading) a generation request is refused
    with a 503, not failed by the handler timing it on the scheduler's clock (a 500 on the
    GPU benchmark's first requests)."""
    import asyncio
    import types

    from serving.app import Server
    from serving.routes.openai_api import _generate

    srv = Server(
        SettingsStore(Settings()),
        loader=lambda: None,
        model_name="m",
        api_keys=frozenset(),
        warmup=False,
        on_death=None,
    )
    request = types.SimpleNamespace(app=types.SimpleNamespace(ctx=types.SimpleNamespace(server=srv)))
    with pytest.raises(ApiError) as e:
        asyncio.run(_generate(request, kind))
    assert e.value.status == 503 and "loading" in str(e.value)
