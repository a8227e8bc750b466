"""Text <-> token ids, built on Hugging Face `tokenizers`.

A `Tokenizer` comes from a GGUF file's metadata (matching llama.cpp's tokenization), from
a Hugging Face model directory, or is synthetic (random-weight benchmark models).
`IncrementalDetokenizer` turns a stream of generated ids into text deltas.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), applied in order; each one
# isolates its matches and keeps the text between them as separate pieces, which is
# exactly `pre_tokenizers.Split(..., "isolated")`.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre name -> (regexes, ignore_merges). ignore_merges: a whole pre-token
# that is itself in the vocabulary is emitted as one id without running BPE (llama3).
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{
        n: ((r"\p{N}", _GPT2_RE), False)
        for n in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
    },
    **{n: ((_GPT2_RE,), False) for n in ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais")},
    **{n: ((_LLAMA3_RE,), True) for n in ("llama-bpe", "llama3", "llama-v3", "falcon3")},
    **{n: ((_LLAMA3_RE,), False) for n in ("dbrx", "smaug-bpe")},
    **{n: ((_QWEN2_RE,), False) for n in ("qwen2", "stablelm2", "hunyuan")},
    "default": (_DEFAULT_RES, False),
}

# Control tokens that end a turn; llama.cpp treats these as end-of-generation too.
_STOP_TOKEN_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<|return|>",
        "<EOT>",
        "<｜end▁of▁sentence｜>",
    }
)

# GGUF token types (gguf.TokenType): CONTROL=3, USER_DEFINED=4.
_CONTROL, _USER_DEFINED = 3, 4

_SYNTHETIC_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre: str) -> tokenizers.Tokenizer:
    """Builds a GPT-2 byte-level BPE tokenizer with llama.cpp's pre-tokenizer `pre`."""
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}; supported: {sorted(_PRE_TOKENIZERS)}")
    regexes, ignore_merges = _PRE_TOKENIZERS[pre]
    vocab: dict[str, int] = {}
    for i, piece in enumerate(tokens):
        vocab.setdefault(piece, i)  # Duplicates (padding entries) keep their first id.
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False)
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable stand-in character of each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _gpt2_byte_decoder()


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class Tokenizer:
    """A tokenizer with the special-token facts the runtime needs.

    Attributes are read-only properties; build instances with `from_gguf`, `from_hf_dir`
    or `synthetic`.
    """

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        eos_ids: Iterable[int],
        special_ids: Iterable[int],
        chat_template: str | None,
        vocab_size: int | None = None,
    ) -> None:
        """Wraps `hf`.

        Args:
          hf: the underlying `tokenizers.Tokenizer`.
          bos_id: beginning-of-sequence id, if the model has one.
          eos_id: the model's primary end-of-sequence id (what `eos_token` names).
          eos_ids: further ids that stop generation; with `eos_id`, they never appear in
            decoded text.
          special_ids: ids dropped by `decode(..., skip_special_tokens=True)`.
          chat_template: Jinja chat template, if any.
          vocab_size: number of ids; defaults to the tokenizer's size with added tokens.
        """
        self._hf = hf
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._eos_ids = frozenset(eos_ids) | ({eos_id} if eos_id is not None else set())
        self._special_ids = frozenset(special_ids) | self._eos_ids
        self._chat_template = chat_template
        self._vocab_size = vocab_size or hf.get_vocab_size(with_added_tokens=True)
        self._added = frozenset(hf.get_added_tokens_decoder())
        self._byte_level = isinstance(hf.decoder, decoders.ByteLevel)

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_gguf(cls, source: str | Path | Any) -> Tokenizer:
        """Builds the tokenizer from GGUF metadata (`tokenizer.ggml.model == "gpt2"`).

        Args:
          source: a GGUF path or an open `gguf.GGUFReader` (opening one parses the whole
            tensor index, so callers that already have one should pass it).

        Raises:
          ValueError: a tokenizer model or pre-tokenizer this class does not support.
        """
        if isinstance(source, (str, Path)):
            import gguf  # Deferred: only GGUF users pay for the import.

            source = gguf.GGUFReader(str(source))
        kind = _gguf_field(source, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only 'gpt2' BPE)")
        tokens: list[str] = _gguf_field(source, "tokenizer.ggml.tokens")
        types: list[int] = _gguf_field(source, "tokenizer.ggml.token_type", [1] * len(tokens))
        pre = _gguf_field(source, "tokenizer.ggml.pre", "default")
        hf = _byte_level_bpe(tokens, _gguf_field(source, "tokenizer.ggml.merges", []), pre)

        control = [i for i, t in enumerate(types) if t == _CONTROL]
        # Control tokens are special (skippable); user-defined ones are plain text that
        # must still match as one id. llama.cpp renders the latter even without special.
        hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
        user = [i for i, t in enumerate(types) if t == _USER_DEFINED]
        hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])

        bos_id = _gguf_field(source, "tokenizer.ggml.bos_token_id")
        eos_id = _gguf_field(source, "tokenizer.ggml.eos_token_id")
        eos = {
            int(v)
            for k in ("eot_token_id", "eom_token_id")
            if (v := _gguf_field(source, f"tokenizer.ggml.{k}")) is not None
        }
        eos |= {i for i in control if tokens[i] in _STOP_TOKEN_TEXTS}
        if bos_id is not None and _gguf_field(source, "tokenizer.ggml.add_bos_token", False):
            bos = tokens[int(bos_id)]
            hf.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
            )
        return cls(
            hf,
            bos_id=None if bos_id is None else int(bos_id),
            eos_id=None if eos_id is None else int(eos_id),
            eos_ids=eos,
            special_ids=control,
            chat_template=_gguf_field(source, "tokenizer.chat_template"),
            vocab_size=len(tokens),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Builds the tokenizer from a Hugging Face model directory.

        Reads `tokenizer.json`, `tokenizer_config.json` (chat template, bos/eos) and,
        when present, `chat_template.jinja` and `generation_config.json` (extra eos ids).
        """
        path = Path(path)
        hf = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))

        def read_json(name: str) -> dict[str, Any]:
            f = path / name
            return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}

        config, gen = read_json("tokenizer_config.json"), read_json("generation_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # Named templates: [{"name", "template"}, ...].
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")

        special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}

        def ids_of(key: str) -> int | None:
            return hf.token_to_id(_token_content(config.get(key)) or "")

        bos_id = ids_of("bos_token")
        if bos_id is None:
            bos_id = next(iter(_as_id_list(gen.get("bos_token_id"))), None)
        gen_eos = _as_id_list(gen.get("eos_token_id"))
        eos_id = ids_of("eos_token")
        if eos_id is None and gen_eos:
            eos_id = gen_eos[0]
        eos = set(gen_eos) | {i for i in special if hf.id_to_token(i) in _STOP_TOKEN_TEXTS}
        return cls(
            hf,
            bos_id=bos_id,
            eos_id=eos_id,
            eos_ids=eos,
            special_ids=special,
            chat_template=template,
        )

    @classmethod
    def synthetic(cls, vocab_size: int) -> Tokenizer:
        """A tokenizer covering ids [0, vocab_size) for random-weight models.

        Id 0 is `<eos>`; every other id `i` is the word `t{i}`. Words are joined by spaces
        on decode and split on whitespace on encode, so any id sequence round-trips.
        Words outside the vocabulary (e.g. prompt text) encode to id 0 rather than fail.
        """
        if vocab_size < 2:
            raise ValueError(f"synthetic vocab_size must be >= 2, got {vocab_size}")
        vocab = {"<eos>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
        hf = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
        hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        hf.add_special_tokens([AddedToken("<eos>", special=True, normalized=False)])
        return cls(
            hf,
            bos_id=None,
            eos_id=0,
            eos_ids={0},
            special_ids={0},
            chat_template=_SYNTHETIC_TEMPLATE,
            vocab_size=vocab_size,
        )

    # ----------------------------------------------------------------- properties
    @property
    def hf(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. for transformers interop)."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        """The primary end-of-sequence id (the one `eos_token` names)."""
        return self._eos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end generation (eos plus end-of-turn tokens)."""
        return self._eos_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids dropped by `decode(..., skip_special_tokens=True)`; includes `eos_ids`."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """`bos_token` / `eos_token` strings, as chat templates expect them."""
        out: dict[str, str] = {}
        if self._bos_id is not None:
            out["bos_token"] = self.id_to_piece(self._bos_id)
        if self._eos_id is not None:
            out["eos_token"] = self.id_to_piece(self._eos_id)
        return out

    # ----------------------------------------------------------------- encode/decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Tokenizes `text`; special-token markup (e.g. `<|im_start|>`) maps to its id."""
        return self._hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Tokenizes `text` and returns the ids and each token's (start, end) char span."""
        enc = self._hf.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Turns ids into text. Stop ids (`eos_ids`) are always dropped."""
        kept = [i for i in ids if i not in self._eos_ids]
        return self._hf.decode(kept, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` (byte-level form for BPE vocabularies)."""
        piece = self._hf.id_to_token(token_id)
        if piece is None:
            raise KeyError(f"token id {token_id} is outside the vocabulary")
        return piece

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text `token_id` stands for (a byte-level piece such as 'Ġsea' is
        b' sea'; a piece of a multi-byte character is part of its UTF-8 encoding)."""
        piece = self.id_to_piece(token_id)
        if token_id in self._added:
            return piece.encode("utf-8")
        if self._byte_level and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece's byte fallback
            return bytes([int(piece[3:5], 16)])
        if "▁" in piece:  # SentencePiece's word marker: decoding the token alone would drop its space
            return piece.replace("▁", " ").encode("utf-8")
        return self._hf.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """The token as OpenAI's logprobs show it: its decoded text, or `bytes:\\xe2\\x80` (the
        escaped bytes) for a token that is not whole UTF-8 on its own."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def save_hf_dir(self, path: str | Path) -> None:
        """Writes `tokenizer.json`, `tokenizer_config.json` (chat template, bos/eos) and the
        eos ids into `generation_config.json` (merged with what is there), so that
        `from_hf_dir(path)` reads this tokenizer back."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._hf.save(str(path / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": self._chat_template,
            **self.special_tokens_map,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text(encoding="utf-8")) if gen_file.is_file() else {}
        primary = [self._eos_id] if self._eos_id is not None else []
        gen["eos_token_id"] = primary + sorted(self._eos_ids - set(primary))
        if self._bos_id is not None:
            gen["bos_token_id"] = self._bos_id
        gen_file.write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one generated sequence."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Streams text deltas for generated ids, one id at a time.

    Concatenating every `feed` result and a final `flush()` gives exactly
    `tokenizer.decode(ids, skip_special_tokens)`. A delta never ends in half a UTF-8
    character: while the text decoded so far ends with U+FFFD the delta is held back.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        # All fed ids are kept so `flush` can emit what the stream still holds back (a
        # sequence that really ends in invalid UTF-8); ints are cheap next to the KV cache.
        self._ids: list[int] = []
        self._emitted = 0  # Characters returned so far.

    def feed(self, token_id: int) -> str:
        """Adds one generated id and returns the new text (possibly empty)."""
        if token_id in self._tok.eos_ids:
            return ""
        self._ids.append(token_id)
        delta = self._stream.step(self._tok.hf, token_id) or ""
        self._emitted += len(delta)
        return delta

    def flush(self) -> str:
        """Returns the text still held back; call once the sequence is finished."""
        rest = self._tok.decode(self._ids, skip_special_tokens=self._skip)[self._emitted :]
        self._emitted += len(rest)
        return rest
