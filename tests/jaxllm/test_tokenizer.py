"""Tokenizer tests: GGUF tokenization against llama.cpp, detokenization, HF dirs, synthetic."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import regex
import tokenizers

from jaxllm.tokenizer import IncrementalDetokenizer, Tokenizer

FIXTURE = Path(__file__).parent.parent / "fixtures" / "smollm2_tokens.json"
CASES: list[dict[str, Any]] = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path)


def _stream(tokenizer: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    """Feeds ids one at a time; returns the deltas (the final flush appended)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    return [detok.feed(i) for i in ids] + [detok.flush()]


# ------------------------------------------------------------------ SmolLM2 vs llama.cpp
@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"])[:40] for c in CASES])
def test_encode_matches_llama_cpp(tok: Tokenizer, case: dict[str, Any]) -> None:
    assert tok.encode(case["text"]) == case["ids"]


def test_fixture_covers_tricky_inputs() -> None:
    texts = [c["text"] for c in CASES]
    assert len(texts) >= 30
    assert any("   " in t and any(ch.isdigit() for ch in t) for t in texts)
    assert any("<|im_start|>" in t for t in texts)
    assert any("😀" in t for t in texts)


def test_smollm2_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1 and tok.eos_id == 2
    # <|im_end|> is the eos; <|endoftext|> also ends generation (as in llama.cpp).
    assert tok.eos_ids == {0, 2}
    assert tok.special_ids == frozenset(range(17))
    assert tok.special_tokens_map == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


def test_special_markup_is_single_ids(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>user\n")[:1] == [1]
    assert tok.encode("<|im_start|>") == [1]
    # add_bos_token is false in this GGUF, so add_special_tokens adds nothing.
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"])[:40] for c in CASES])
def test_decode_inverts_encode(tok: Tokenizer, case: dict[str, Any]) -> None:
    text, ids = case["text"], case["ids"]
    assert tok.hf.decode(ids, skip_special_tokens=False) == text
    stops = ["<|im_end|>", "<|endoftext|>"]
    no_stops = text
    for s in stops:
        no_stops = no_stops.replace(s, "")
    assert tok.decode(ids, skip_special_tokens=False) == no_stops
    assert tok.decode(ids) == no_stops.replace("<|im_start|>", "")


# ------------------------------------------------------------------ incremental detokenizer
@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_decode_on_fixture(tok: Tokenizer, skip: bool) -> None:
    for case in CASES:
        ids = case["ids"]
        deltas = _stream(tok, ids, skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert deltas[-1] == ""  # Valid text ends on a whole character: nothing held.
        assert not any("\ufffd" in d for d in deltas), case["text"]


def test_stream_holds_back_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1  # The emoji's four bytes span several byte-level tokens.
    detok = tok.detokenizer()
    assert [detok.feed(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_stream_prefixes_never_contain_replacement_char(tok: Tokenizer) -> None:
    text = "naïve 😀🎉 日本語 👨‍👩‍👧 done"
    ids = tok.encode(text)
    detok = tok.detokenizer()
    so_far = ""
    for i in ids:
        so_far += detok.feed(i)
        assert "\ufffd" not in so_far
        assert text.startswith(so_far)
    assert so_far == text


def test_stream_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi!<|im_end|><|endoftext|>")
    assert ids[0] == 1 and ids[-2:] == [2, 0]
    assert "".join(_stream(tok, ids, skip=True)) == "assistant\nHi!"
    assert "".join(_stream(tok, ids, skip=False)) == "<|im_start|>assistant\nHi!"
    detok = tok.detokenizer(skip_special_tokens=False)
    assert detok.feed(2) == "" and detok.feed(0) == ""  # Stop ids never become text.


@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_decode_on_random_ids(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234)
    # Bias toward byte tokens and specials so partial UTF-8 and skipping happen often.
    byte_ids = [i for i in range(tok.vocab_size) if len(tok.id_to_piece(i)) == 1]
    pool = [list(range(tok.vocab_size)), byte_ids, list(range(17))]
    saw_fffd = False
    for _ in range(300):
        ids = [rng.choice(rng.choice(pool)) for _ in range(rng.randint(1, 24))]
        full = tok.decode(ids, skip_special_tokens=skip)
        deltas = _stream(tok, ids, skip)
        assert "".join(deltas) == full, ids
        saw_fffd |= "\ufffd" in full
    assert saw_fffd  # The sampling did exercise invalid UTF-8.


# ------------------------------------------------------------------ pre-tokenizer regexes
_LLAMA3_HF = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_HF = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable byte alphabet."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _fake_reader(pre: str, tokens: list[str], types: list[int] | None = None, **extra: Any) -> Any:
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types or [1] * len(tokens),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": 0,
        **{f"tokenizer.ggml.{k}": v for k, v in extra.items()},
    }
    return SimpleNamespace(fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in meta.items()})


@pytest.mark.parametrize("pre,pattern", [("llama-bpe", _LLAMA3_HF), ("qwen2", _QWEN2_HF)])
def test_pretokenizer_matches_hf_regex(pre: str, pattern: str) -> None:
    b2u = _bytes_to_unicode()
    tokenizer = Tokenizer.from_gguf(_fake_reader(pre, list(b2u.values())))
    texts = [c["text"] for c in CASES] + ["I'M HERE, You'RE there", "x\r\n\r\n  y", "1234567"]
    for text in texts:
        ours = [p for p, _ in tokenizer.hf.pre_tokenizer.pre_tokenize_str(text)]
        ref = ["".join(b2u[b] for b in m.encode()) for m in regex.findall(pattern, text)]
        assert ours == ref, text


def test_added_tokens_and_bos() -> None:
    b2u = _bytes_to_unicode()
    tokens = ["<eos>", "<s>", "<tool>", *b2u.values()]
    reader = _fake_reader("qwen2", tokens, [3, 3, 4] + [1] * 256, bos_token_id=1, add_bos_token=True)
    t = Tokenizer.from_gguf(reader)
    assert t.bos_id == 1 and t.eos_ids == {0} and t.special_ids == {0, 1}
    a = tokens.index("a")
    assert t.encode("a<tool>a") == [a, 2, a]  # User-defined tokens match as one id...
    assert t.encode("a", add_special_tokens=True) == [1, a]
    assert t.decode([1, a, 2, 0]) == "a<tool>"  # ...and are text, not skipped specials.
    assert t.decode([1, a, 2, 0], skip_special_tokens=False) == "<s>a<tool>"


def test_unsupported_pre_tokenizer_is_rejected() -> None:
    with pytest.raises(ValueError, match="tokenizer.ggml.pre"):
        Tokenizer.from_gguf(_fake_reader("no-such-pre", ["a", "b"]))


# ------------------------------------------------------------------ HF directory
def test_from_hf_dir(tok: Tokenizer, tmp_path: Path) -> None:
    tok.hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|im_start|>"},
                "eos_token": "<|im_end|>",
                "chat_template": [{"name": "default", "template": "T"}, {"name": "tool_use", "template": "U"}],
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    hf_tok = Tokenizer.from_hf_dir(tmp_path)
    assert hf_tok.bos_id == 1 and hf_tok.eos_id == 2
    assert hf_tok.eos_ids == {0, 2, 7}
    assert hf_tok.chat_template == "T"
    assert hf_tok.special_ids == tok.special_ids | {7}
    for case in CASES:
        assert hf_tok.encode(case["text"]) == case["ids"]
    (tmp_path / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "J"


# ------------------------------------------------------------------ synthetic
def test_synthetic_covers_vocab() -> None:
    vocab = 1000
    syn = Tokenizer.synthetic(vocab)
    assert syn.vocab_size == vocab and syn.eos_ids == {0} and syn.chat_template
    pieces = set()
    for i in range(vocab):
        piece = syn.id_to_piece(i)
        text = syn.decode([i]) if i not in syn.eos_ids else piece
        assert text and text.isprintable() and text.strip() == text, i
        pieces.add(text)
    assert len(pieces) == vocab
    with pytest.raises(KeyError):
        syn.id_to_piece(vocab)


def test_synthetic_round_trips_and_streams() -> None:
    syn = Tokenizer.synthetic(50_000)
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(1, syn.vocab_size) for _ in range(rng.randint(1, 30))]
        text = syn.decode(ids)
        assert syn.encode(text) == ids
        assert "".join(_stream(syn, ids, skip=True)) == text
    assert syn.decode([5, 0, 6]) == "t5 t6"  # The eos id never becomes text.


# ------------------------------------------------------------------ logprob tokens, saving
def test_token_text_is_decoded_text_with_its_bytes(tok: Tokenizer) -> None:
    """Logprob tokens read as text (' sea', not the byte-level 'Ġsea'); a token holding part
    of a character spells its bytes out, OpenAI style; every token's bytes join to the text."""
    text = " the sea é 日本語 🙂"
    ids = tok.encode(text)
    assert tok.token_text(tok.encode(" sea")[0]) == " sea" and tok.id_to_piece(tok.encode(" sea")[0]) == "Ġsea"
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == text
    for i in ids:
        t = tok.token_text(i)
        assert "Ġ" not in t
        if t.startswith("bytes:"):
            assert bytes.fromhex(t[6:].replace("\\x", "")) == tok.token_bytes(i)
        else:
            assert t.encode() == tok.token_bytes(i)
    assert any(tok.token_text(i).startswith("bytes:") for i in ids)  # the emoji is split over tokens
    assert tok.token_text(tok.eos_id) == "<|im_end|>"


def test_save_hf_dir_round_trips(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save_hf_dir(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    assert (back.bos_id, back.eos_id, back.eos_ids, back.special_ids) == (
        tok.bos_id,
        tok.eos_id,
        tok.eos_ids,
        tok.special_ids,
    )
    assert back.chat_template == tok.chat_template and back.vocab_size == tok.vocab_size
    for case in CASES:
        assert back.encode(case["text"]) == case["ids"]


def test_token_bytes_of_a_sentencepiece_vocabulary() -> None:
    """Word markers are spaces and byte-fallback pieces are their byte (a lone token decoded
    by the tokenizer would lose its leading space)."""
    vocab = {"<unk>": 0, "▁sea": 1, "<0xE6>": 2, "<0x97>": 3, "ab": 4}
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = tokenizers.decoders.Sequence(
        [
            tokenizers.decoders.Replace("▁", " "),
            tokenizers.decoders.ByteFallback(),
            tokenizers.decoders.Fuse(),
            tokenizers.decoders.Strip(" ", 1, 0),
        ]
    )
    sp = Tokenizer(hf, bos_id=None, eos_id=None, eos_ids=(), special_ids=(), chat_template=None)
    assert [sp.token_bytes(i) for i in (1, 2, 3, 4)] == [b" sea", b"\xe6", b"\x97", b"ab"]
    assert sp.token_text(1) == " sea" and sp.token_text(2) == "bytes:\\xe6"
