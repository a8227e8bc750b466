"""Grammar constraints: masks keep the output valid; the real default model emits valid JSON."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from jaxllm.constrained import (
    GrammarConstraint,
    GrammarError,
    compile_grammar,
    constraint_for,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
    tokenizer_adapter,
)
from jaxllm.engine_config import EngineConfig
from jaxllm.sampling import SamplingParams
from jaxllm.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
MODEL_VOCAB = 49152 + 64  # a model vocabulary padded past the tokenizer's


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path)


def allowed(mask: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def test_mask_width_covers_model_vocab_and_padding_is_never_allowed(tok):
    c = constraint_for(tok, MODEL_VOCAB, json_object_grammar(), "json_object")
    mask = c.allowed_bitmask()
    assert mask.dtype == np.uint32 and mask.shape == (-(-MODEL_VOCAB // 32),)
    assert not allowed(mask, MODEL_VOCAB) & set(range(tok.vocab_size, MODEL_VOCAB))


def test_every_allowed_token_keeps_the_output_valid(tok):
    """Walk a valid document; at each step every allowed token is accepted by a copy of the
    matcher, a sample of disallowed ones is rejected, and eos is allowed only at the end."""
    c = constraint_for(tok, MODEL_VOCAB, json_schema_grammar(SCHEMA), "json_schema")
    target = tok.encode(json.dumps({"name": "Ada", "age": 36, "city": "London"}))
    rng = np.random.default_rng(0)
    for i, token in enumerate(target):
        ok = allowed(c.allowed_bitmask(), MODEL_VOCAB)
        assert token in ok, tok.decode(target[: i + 1])
        assert not ok & set(tok.eos_ids), "eos allowed before the document is complete"
        for t in list(ok)[:50]:
            assert c.matcher.deep_copy().consume_token(t)
        for t in rng.choice(sorted(set(range(tok.vocab_size)) - ok), 50, replace=False):
            assert not c.matcher.deep_copy().consume_token(int(t))
        c.advance(token)
    assert c.is_accepting() and allowed(c.allowed_bitmask(), MODEL_VOCAB) == set(tok.eos_ids)
    c.advance(min(tok.eos_ids))
    assert c.error == ""


def test_random_walk_through_the_mask_gives_schema_valid_json(tok):
    rng = np.random.default_rng(1)
    for _ in range(5):
        c = constraint_for(tok, MODEL_VOCAB, json_schema_grammar(SCHEMA), "json_schema")
        out: list[int] = []
        for _ in range(200):
            ok = sorted(allowed(c.allowed_bitmask(), MODEL_VOCAB))
            # Favour closing quotes/eos so a random walk finishes within the budget.
            t = int(rng.choice(ok))
            if t in tok.eos_ids:
                break
            out.append(t)
            c.advance(t)
        jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)


def test_tool_call_grammar_forces_a_named_call(tok):
    adapter = tokenizer_adapter(tok, MODEL_VOCAB)
    grammar = compile_grammar(
        adapter, tool_call_grammar({"get_weather": WEATHER, "other": {}}, ["get_weather"]), "tool_call"
    )
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    c = GrammarConstraint(adapter, grammar)
    assert c.matcher.try_consume_tokens(tok.encode(good)) == len(tok.encode(good)) and c.is_accepting()
    for bad in (
        '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>',
        "Sure! <tool_call>",
    ):
        c = GrammarConstraint(adapter, grammar)
        ids = tok.encode(bad)
        assert c.matcher.try_consume_tokens(ids) < len(ids)


def test_copies_are_independent(tok):
    c = constraint_for(tok, MODEL_VOCAB, json_object_grammar(), "json_object")
    d = c.copy()
    for t in tok.encode('{"a": 1}'):
        c.advance(t)
    assert c.is_accepting() and not d.is_accepting()


def test_invalid_schema_is_a_grammar_error(tok):
    adapter = tokenizer_adapter(tok, MODEL_VOCAB)
    with pytest.raises(GrammarError, match="nonsense"):
        compile_grammar(adapter, json_schema_grammar({"type": "nonsense"}), "json_schema")
    with pytest.raises(GrammarError):
        json_schema_grammar("not a schema")  # type: ignore[arg-type]


def test_greedy_generation_with_the_default_model_matches_the_schema(smollm2_gguf_path):
    from jaxllm.api import load

    model = load(str(smollm2_gguf_path))
    engine = model.engine(
        EngineConfig(max_slots=2, max_seq_len=512, kv_bytes=32 << 20, chunk_buckets=(64, 128), decode_steps_per_call=4)
    )
    prompt = model.chat_ids(
        [{"role": "user", "content": "Describe a person as JSON with name, age and city."}], add_generation_prompt=True
    )
    c = constraint_for(model.tokenizer, model.cfg.vocab_size, json_schema_grammar(SCHEMA), "json_schema")
    free = engine.add(prompt, SamplingParams(temperature=0, max_tokens=24))
    seq = engine.add(prompt, SamplingParams(temperature=0, max_tokens=100), constraint=c)
    while seq.finish_reason is None or free.finish_reason is None:
        engine.step()
    assert seq.finish_reason == "stop", model.tokenizer.decode(seq.generated)
    text = model.tokenizer.decode(seq.generated[:-1])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert c.tokens == len(seq.generated)
