"""Grammar-constrained decoding: token masks from llguidance for the engine's sampler.

A `Grammar` is an llguidance grammar definition, compiled and validated once per request
for one tokenizer (JSON schema, any JSON object, or a forced Hermes `<tool_call>`). A
`GrammarConstraint` is the per-sequence matcher state behind `jaxllm.engine_records.TokenConstraint`:
the engine asks it for the allowed-token bitmask of each round in which the sequence draws a
token, and feeds every drawn token back with `advance`.

End of sequence: llguidance sets the eos bits only where the grammar accepts, and once the
grammar can take nothing more the mask holds the eos tokens alone, so the sequence stops
exactly when its output is complete (or at max_tokens, cut).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping
from typing import Any

import llguidance
import numpy as np

from jaxllm.tokenizer import Tokenizer

# Compact JSON with the separators models see in their training data; no free whitespace,
# which small models otherwise fill with endless newlines.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar llguidance rejects (the server answers 400)."""


@dataclasses.dataclass(frozen=True)
class TokenizerAdapter:
    """An llguidance tokenizer plus the mask width of the model it serves.

    Attributes:
      ll: the llguidance tokenizer (its vocabulary is the text tokenizer's).
      n_words: u32 words of the model's mask, ceil(model_vocab / 32); the model's vocabulary
        can be larger than the tokenizer's (padding rows), and those ids are never allowed.
      eos_ids: tokens that end a sequence; allowed only where the grammar accepts.
    """

    ll: llguidance.LLTokenizer
    n_words: int
    eos_ids: tuple[int, ...]


@functools.lru_cache(maxsize=8)
def tokenizer_adapter(tokenizer: Tokenizer, model_vocab: int) -> TokenizerAdapter:
    """The (cached) adapter of a tokenizer; building one takes ~0.2-1 s for 50-150k tokens."""
    eos = tuple(sorted(tokenizer.eos_ids))
    ll = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=tokenizer.vocab_size, eos_token=list(eos) or None)
    return TokenizerAdapter(ll=ll, n_words=-(-max(model_vocab, tokenizer.vocab_size) // 32), eos_ids=eos)


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A validated llguidance grammar definition; `kind` names what it enforces."""

    source: str
    kind: str


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """Grammar text of a JSON document matching `schema`."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(dict(schema), defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def json_object_grammar() -> str:
    """Grammar text of any JSON object (OpenAI `response_format: json_object`)."""
    return json_schema_grammar({"type": "object"})


def tool_call_grammar(tools: Mapping[str, Mapping[str, Any]], names: Iterable[str]) -> str:
    """Grammar text of one Hermes call `<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`.

    Args:
      tools: function name -> JSON schema of its parameters (empty: any object).
      names: the names a call may use (all tools for `required`, one for a named choice).
    """
    names = sorted(names)
    if not names:
        raise GrammarError("no tool to call")
    rules = []
    for i, name in enumerate(names):
        # The schema sits at /properties/arguments of the call object: its local $refs
        # ("#/$defs/X", "#") are written against its own root, so they are rebased there.
        params = _rebase_refs(dict(tools[name]), "#/properties/arguments") if tools.get(name) else {"type": "object"}
        call = {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": _JSON_OPTIONS,
        }
        rules.append(f"call{i}: %json {json.dumps(call)}")
    alternatives = " | ".join(f"call{i}" for i in range(len(names)))
    lark = "\n".join(['start: "<tool_call>\\n" call "\\n</tool_call>"', f"call: {alternatives}", *rules])
    return llguidance.LLMatcher.grammar_from_lark(lark)


# Keywords whose values are JSON data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of a schema with each local `$ref` ("#..." ) moved under the pointer `base`."""
    if isinstance(node, Mapping):
        return {
            k: base + v[1:]
            if k == "$ref" and isinstance(v, str) and v.startswith("#")
            else v
            if k in _DATA_KEYWORDS
            else _rebase_refs(v, base)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def compile_grammar(adapter: TokenizerAdapter, source: str, kind: str) -> Grammar:
    """Validates `source` for this tokenizer.

    Raises:
      GrammarError: with llguidance's message (unsupported keyword, bad type, ...).
    """
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, adapter.ll)
    if is_error:
        raise GrammarError(f"{kind}: {messages[0] if messages else 'invalid grammar'}")
    return Grammar(source=source, kind=kind)


class GrammarConstraint:
    """One sequence's grammar state; implements `jaxllm.engine_records.TokenConstraint`.

    Not thread-safe: built on a request thread, then used by the engine's thread only.
    """

    def __init__(self, adapter: TokenizerAdapter, grammar: Grammar, *, matcher: llguidance.LLMatcher | None = None):
        self.adapter = adapter
        self.grammar = grammar
        self.matcher = matcher if matcher is not None else llguidance.LLMatcher(adapter.ll, grammar.source, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"{grammar.kind}: {self.matcher.get_error()}")
        # Reused each round: the engine copies the row out before the next call.
        self._mask = np.zeros((adapter.n_words,), np.uint32)
        self._ll_words = -(-adapter.ll.vocab_size // 32)
        self._eos_only = np.zeros((adapter.n_words,), np.uint32)
        for t in adapter.eos_ids:
            self._eos_only[t // 32] |= np.uint32(1 << (t % 32))
        self.tokens = 0

    def copy(self) -> GrammarConstraint:
        """A fresh constraint in the same state (one per choice when n > 1); cheap."""
        return GrammarConstraint(self.adapter, self.grammar, matcher=self.matcher.deep_copy())

    @property
    def error(self) -> str:
        """Why the matcher failed (a token outside the mask was forced), '' when fine."""
        return self.matcher.get_error() if self.matcher.is_error() else ""

    def is_accepting(self) -> bool:
        """Whether the output so far is complete for the grammar."""
        return self.matcher.is_accepting()

    def allowed_bitmask(self) -> np.ndarray:
        """[n_words] u32: tokens that keep the output valid (eos only where it is complete)."""
        if self.matcher.is_error() or self.matcher.is_stopped():
            return self._eos_only
        # Written in place by the library; words past the tokenizer's vocabulary stay zero.
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._ll_words * 4)
        return self._mask

    def advance(self, token: int) -> None:
        """Consumes a drawn token; an eos after the grammar stopped is simply the end."""
        self.tokens += 1
        if token in self.adapter.eos_ids and self.matcher.is_stopped():
            return
        self.matcher.consume_token(int(token))


def constraint_for(tokenizer: Tokenizer, model_vocab: int, source: str, kind: str) -> GrammarConstraint:
    """Adapter (cached) + validation + matcher in one call."""
    adapter = tokenizer_adapter(tokenizer, model_vocab)
    return GrammarConstraint(adapter, compile_grammar(adapter, source, kind))
