"""One choice's text pipeline without an engine: token ids of the real SmolLM2 tokenizer in,
frames and the finish record out, checked against expectations worked out by hand."""

from __future__ import annotations

import json

import pytest

from serving.choice_text import ChoiceText, ChoiceTextError, usage
from serving.output import Delta, Finish
from serving.partial_match import find_first, holdback, partial_suffix
from serving.tool_calls import ToolContract

EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path):
    from jaxllm.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_gguf_path)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def texts(frames) -> list[str]:
    return [f.text for f in frames if isinstance(f, Delta)]


def test_stop_string_held_back_then_cut(tok):
    # 'Hello', ' world', '.', ' ST', 'OP', ' here': " ST" may begin " STOP", so it waits; "OP"
    # completes the stop string, which ends the choice before it.
    t = ChoiceText(0, tok, stop=(" STOP",))
    seen = [texts(t.feed([i])) for i in ids(tok, "Hello world. STOP here")[:5]]
    assert seen == [["Hello"], [" world"], ["."], [], []]
    assert t.ended
    end = t.finish()
    assert end.reason == "stop" and end.content == "Hello world." and end.tool_calls == ()
    assert end.frames == (Finish(0, "stop", "Hello world."),)


def test_eos_finish_and_a_character_split_over_byte_tokens(tok):
    # 'Z', 'o', 'Ã«', 'Ġ', 'ðĿ', 'Ķ', 'ĺ', 'Ġok': 𝔘 is four bytes over three tokens, sent
    # only whole; the eos token that ends the choice is no text.
    t = ChoiceText(0, tok)
    out = [texts(t.feed([i])) for i in ids(tok, "Zoë 𝔘 ok")]
    out.append(texts(t.feed([EOS], finish_reason="stop")))
    assert out == [["Z"], ["o"], ["ë"], [" "], [], [], ["𝔘"], [" ok"], []]
    end = t.finish()
    assert (end.reason, end.content) == ("stop", "Zoë 𝔘 ok")
    assert t.generated[-1] == EOS and len(t.generated) == 9


def test_length_finish_in_one_event(tok):
    t = ChoiceText(1, tok)
    frames = t.feed(ids(tok, " café 🙂 ok"), finish_reason="length")
    assert frames == [Delta(1, " café 🙂 ok")]
    assert t.finish().frames == (Finish(1, "length", " café 🙂 ok"),)


def test_tool_call_becomes_a_call_and_finish_reason_tool_calls(tok):
    tools = ToolContract(tools={"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}})
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    t = ChoiceText(0, tok, tools=tools)
    frames = [f for i in ids(tok, text) for f in t.feed([i])] + t.feed([EOS], finish_reason="stop")
    assert "".join(texts(frames)) == "Sure."
    end = t.finish()
    assert end.reason == "tool_calls" and end.content == "Sure."
    (call,) = end.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert end.frames[-1] == Finish(0, "tool_calls", "Sure.", end.tool_calls)
    streamed = [d for f in frames + list(end.frames[:-1]) if isinstance(f, Delta) for d in f.tool_calls]
    assert streamed and streamed[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("stop", [(), (" world",), ("rld.",)])
def test_any_split_of_the_same_ids_gives_the_same_text(tok, stop):
    tokens = ids(tok, "Hello world. Zoë 𝔘 ok")
    ends = []
    for size in (1, 2, 3, len(tokens)):
        t = ChoiceText(0, tok, stop=stop)
        streamed = []
        for i in range(0, len(tokens), size):
            if t.ended:
                break
            last = i + size >= len(tokens)
            streamed += texts(t.feed(tokens[i : i + size], finish_reason="length" if last else None))
        end = t.finish()
        assert "".join(streamed) == end.content
        ends.append((end.reason, end.content))
    assert len(set(ends)) == 1
    expected = {(): "Hello world. Zoë 𝔘 ok", (" world",): "Hello", ("rld.",): "Hello wo"}[stop]
    assert ends[0] == ("length" if not stop else "stop", expected)


def test_logprobs_name_each_token_and_its_alternatives(tok):
    t = ChoiceText(0, tok, logprobs=True)
    hello, world = ids(tok, "Hello world")
    (delta,) = t.feed([hello, world], [-0.5, -1.5], [[(world, -0.1)], []])
    # Tokens are named by their decoded text (OpenAI's form), not by vocabulary pieces ('Ġworld').
    assert delta.logprobs == (("Hello", -0.5, [(" world", -0.1)]), (" world", -1.5, []))
    assert t.feed([EOS], [-0.2], [[]], finish_reason="stop")[0].logprobs == (("<|im_end|>", -0.2, []),)
    assert len(t.finish().frames[-1].logprobs) == 3


def test_text_past_response_bytes_fails_the_choice(tok):
    t = ChoiceText(0, tok, response_bytes=8)
    t.feed(ids(tok, "Hello"))
    with pytest.raises(ChoiceTextError) as e:
        t.feed(ids(tok, " world"))
    assert e.value.status == 400


def test_streamed_text_that_a_final_decode_disagrees_with_is_a_500(tok):
    class Drifting:  # the real tokenizer, but its one-shot decode says something else
        eos_ids = tok.eos_ids
        detokenizer = tok.detokenizer
        token_text = tok.token_text

        @staticmethod
        def decode(i, skip_special_tokens=True):
            return tok.decode(i, skip_special_tokens=skip_special_tokens) + "!"

    t = ChoiceText(0, Drifting())
    t.feed(ids(tok, "Hello"), finish_reason="length")
    with pytest.raises(ChoiceTextError) as e:
        t.finish()
    assert e.value.status == 500 and e.value.reconcile == "'Hello' vs 'Hello!'"


def test_usage_counts():
    assert usage(10, 3, 4) == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert usage(1, 5, 0, drafts=(6, 4))["completion_tokens_details"] == {
        "accepted_prediction_tokens": 4,
        "rejected_prediction_tokens": 2,
    }


def test_partial_suffix_holdback_and_find_first():
    assert partial_suffix("abc<tool", "<tool_call>") == 5
    assert partial_suffix("abc<tool_call>", "<tool_call>") == 0  # whole markers are found, not held
    assert partial_suffix("", "<x>") == 0
    assert holdback("Hello wo", (" world", "wor", "xyz")) == 3
    assert holdback("Hello", ()) == 0
    assert find_first("a STOP b END", ("END", " STOP")) == 1
    assert find_first("a STOP b", ("STOP",), start=3) is None
