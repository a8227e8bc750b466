"""Streaming tool-call decoder with recovery and diagnostics.

One `ToolCallDecoder` is created per request that carries tools. The worker
feeds it each detokenized text delta; `feed` returns what may be published now:
visible content plus tool-call deltas in the OpenAI streaming shape. `finish`
closes the parse and returns the content still held back, every parsed call and
diagnostics. Recovery is always on: complete calls stand, and the raw text of a
call that is cut off or malformed is returned as visible content, never dropped.

Three output formats are understood:

* ``hermes`` (Qwen, Hermes, SmolLM): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` blocks anywhere in the output.
* ``llama3``: the whole output is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``; several calls may follow each other,
  separated by whitespace or ``;``.
* ``pythonic``: the whole output is ``[get_weather(city="Paris"), f(a=1)]``.

Streaming rules (all decisions depend only on text already seen, so any split
of the same output into deltas publishes the same content and the same calls):

* Content is published at once, except for a trailing run that could still be
  the start of a call marker, together with the whitespace right before it:
  whitespace that separates content from a call is a separator, not content.
  Whitespace after an accepted call is held too: dropped if the output ends or
  another call follows, published if more content follows. Without accepted
  calls, the published content is exactly the generated text.
* A call is emitted when it is complete, as two deltas: a header (``id``,
  ``type``, ``function.name``, empty arguments) and one ``function.arguments``
  piece holding the whole arguments JSON. Emitting arguments only once the call
  is known to be valid means a call that later turns out broken was never
  streamed as a call; its raw text goes out as content instead.
* The whole-output formats decide from the first non-whitespace characters
  whether the output is a call, withholding while it is ambiguous.

Pure Python; nothing here touches JAX or the event loop.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jsonschema
import jsonschema.validators

from serving.partial_match import partial_suffix

FORMATS = ("hermes", "llama3", "pythonic")

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_ID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
# Keys a llama3-style call object may start with; any other first key means
# the output is ordinary JSON content, so it can be released early.
_CALL_KEYS = frozenset({"name", "type", "function", "parameters", "arguments", "id"})
_KEY = re.compile(r'"(?:[^"\\]|\\.)*"')
_PY_CALL_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_PY_HEAD_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")
# Characters legal in JSON outside strings. Anything else (`<` above all)
# proves the text is not JSON without waiting for the end.
_JSON_BARE = frozenset(",:-+.0123456789eEtrufalsn \t\r\n")


class FallbackReason(enum.Enum):
    """Why some output did not become tool calls (the first problem seen)."""

    NONE = "none"
    TRUNCATED_CALL = "truncated_call"  # a call was still open when output ended
    MALFORMED_JSON = "malformed_json"  # call text does not parse (JSON / Python)
    MALFORMED_CALL = "malformed_call"  # parses, but is not {name, arguments-object}
    UNKNOWN_TOOL = "unknown_tool"  # name not among the offered (or chosen) tools
    UNCLOSED_CALL = "unclosed_call"  # complete call without `</tool_call>`; kept
    MISSING_REQUIRED_CALL = "missing_required_call"  # tool_choice required, none found


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolContract:
    """What the request allows the model to call.

    Attributes:
        tools: Function name -> JSON schema of its parameters.
        format: One of `FORMATS`; see the module docstring.
        tool_choice: "auto", "none", "required", or the OpenAI named form
            ``{"type": "function", "function": {"name": ...}}``.
    """

    tools: Mapping[str, Mapping[str, Any]]
    format: str = "hermes"
    tool_choice: str | Mapping[str, Any] = "auto"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown tool-call format {self.format!r}")

    @classmethod
    def from_openai(
        cls,
        tools: Sequence[Mapping[str, Any]],
        *,
        format: str = "hermes",
        tool_choice: str | Mapping[str, Any] = "auto",
    ) -> ToolContract:
        """Builds a contract from a request's ``tools`` list (OpenAI shape)."""
        table = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        return cls(tools=table, format=format, tool_choice=tool_choice)

    def allowed_names(self) -> frozenset[str]:
        """Names a call may use: all tools, or only the one tool_choice names."""
        if isinstance(self.tool_choice, Mapping):
            return frozenset({self.tool_choice["function"]["name"]}) & frozenset(self.tools)
        return frozenset(self.tools)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolCallDelta:
    """One streamed tool-call fragment; `to_openai` gives the wire shape.

    A header delta has `id` and `name` and empty `arguments`; later deltas of
    the same `index` carry only an `arguments` piece.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """Returns the ``choices[].delta.tool_calls[]`` entry."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamEvents:
    """What one `feed` lets the server publish now."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParsedCall:
    """A complete tool call; `arguments_json` is a JSON object as text."""

    name: str
    arguments_json: str
    id: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Diagnostics:
    """How the tool-call parse went, for logs and metrics."""

    fallback_reason: FallbackReason = FallbackReason.NONE
    fallback_calls: int = 0  # broken calls returned as content
    schema_mismatch_arguments: int = 0  # calls kept although args fail the schema
    empty_arguments_omitted: int = 0  # calls with missing/null/"" args, given {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Terminal:
    """The close of a decode.

    Attributes:
        content_tail: Content held back until now; publish it like any delta.
        tool_calls: Every accepted call, in order (streamed ones included).
        diagnostics: Fallback reason and counters.
        tool_call_deltas: Deltas for calls only decided at the end (not yet
            streamed), to send before the finish chunk.
    """

    content_tail: str
    tool_calls: tuple[ParsedCall, ...]
    diagnostics: Diagnostics
    tool_call_deltas: tuple[ToolCallDelta, ...] = ()


def tool_call_id() -> str:
    """Returns a fresh OpenAI-style call id: ``call_`` + 24 alphanumerics."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def finish_reason_for(model_reason: str, has_calls: bool) -> str:
    """The finish reason to report for a request that may have made calls.

    Calls turn "stop" into "tool_calls"; a generation cut off by its token
    budget keeps "length" so the client learns the output was truncated.
    """
    return "tool_calls" if has_calls and model_reason == "stop" else model_reason


def pick_format(hint: str, override: str | None = None) -> str:
    """Chooses the tool-call format from a model family or template hint.

    Args:
        hint: Model family or chat-template name, e.g. "qwen3", "llama3.1".
        override: A format set explicitly in settings; wins when given.

    Returns:
        One of `FORMATS`; "hermes" when the hint says nothing.
    """
    if override:
        if override not in FORMATS:
            raise ValueError(f"unknown tool-call format {override!r}")
        return override
    h = hint.lower().replace("-", "").replace("_", "")
    if "pythonic" in h or "llama4" in h:
        return "pythonic"
    if "llama3" in h:
        return "llama3"
    return "hermes"


class _Scan(enum.Enum):
    INCOMPLETE = 0
    COMPLETE = 1
    INVALID = 2


class _BracketScanner:
    """Finds where one JSON (or Python literal) value ends, resumably.

    It tracks nesting and strings with escapes, so braces, `<`, `>` and
    `</tool_call>` inside strings do not confuse it. The scan resumes where the
    last call stopped, so a long call costs linear time over many deltas.
    """

    def __init__(self, *, python: bool) -> None:
        self._python = python
        self._pos = 0
        self._stack: list[str] = []
        self._quote: str | None = None
        self._escape = False
        self._verdict: tuple[_Scan, int] | None = None

    def scan(self, text: str) -> tuple[_Scan, int]:
        """Scans `text` (the same segment, grown) and returns (verdict, end)."""
        if self._verdict is not None:
            return self._verdict
        closers = {"}": "{", "]": "[", ")": "("}
        i = self._pos
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._quote is not None:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == self._quote:
                    self._quote = None
            elif not self._stack:
                if c in "{[":
                    self._stack.append(c)
                elif not c.isspace():
                    return self._decide(_Scan.INVALID, i)
            elif c == '"' or (self._python and c == "'"):
                self._quote = c
            elif c in "{[" or (self._python and c == "("):
                self._stack.append(c)
            elif c in closers:
                if self._stack[-1] != closers[c]:
                    return self._decide(_Scan.INVALID, i)
                self._stack.pop()
                if not self._stack:
                    return self._decide(_Scan.COMPLETE, i + 1)
            elif not self._python and c not in _JSON_BARE:
                return self._decide(_Scan.INVALID, i)
        self._pos = len(text)
        return _Scan.INCOMPLETE, len(text)

    def _decide(self, verdict: _Scan, at: int) -> tuple[_Scan, int]:
        self._verdict = (verdict, at)
        return self._verdict


class _Mode(enum.Enum):
    TEXT = 0  # hermes: content, watching for <tool_call>
    IN_CALL = 1  # inside a call, buffering until it is complete
    SKIP = 2  # hermes: inside a broken call, looking for </tool_call>
    START = 3  # whole-output formats: deciding whether this is a call
    AFTER_CALL = 4  # whole-output formats: after a call; more calls or suffix
    PASSTHROUGH = 5  # everything from here on is content


class ToolCallDecoder:
    """Turns generated text deltas into visible content and tool calls.

    A state machine over `_buf`, the text not yet decided: each step either
    decides a prefix of it (publish as content, accept a call, return a broken
    call as content) or waits for more text. Steps only decide what no
    continuation could change, which is why splits do not matter.

    Example:
        decoder = ToolCallDecoder(contract)
        for delta in deltas:
            events = decoder.feed(delta)   # publish events.content / .tool_calls
        terminal = decoder.finish()        # publish content_tail, tool_call_deltas
    """

    def __init__(self, contract: ToolContract, *, new_id: Callable[[], str] = tool_call_id) -> None:
        """Creates a decoder for one request.

        Args:
            contract: The request's tools, format and tool_choice.
            new_id: Call-id factory; tests pass a deterministic one.
        """
        self._contract = contract
        self._new_id = new_id
        self._allowed = contract.allowed_names()
        self._validators = {n: _validator(s) for n, s in contract.tools.items()}
        self._buf = ""  # text received but not yet decided
        self._pending = ""  # raw text of the open call before `_buf`, for fallback
        self._after_call = False  # whitespace now may only trail a call
        self._tagged = False  # llama3 call announced by <|python_tag|>
        self._confirmed = False  # the open call's head proved it is a call
        self._scanner = _BracketScanner(python=False)
        self._skip_from = 0
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._calls: list[ParsedCall] = []
        self._reason = FallbackReason.NONE
        self._fallback_calls = 0
        self._schema_mismatch = 0
        self._empty_args = 0
        self._finished = False
        if contract.tool_choice == "none":
            self._mode = _Mode.PASSTHROUGH
        elif contract.format == "hermes":
            self._mode = _Mode.TEXT
        else:
            self._mode = _Mode.START

    def feed(self, delta: str) -> StreamEvents:
        """Consumes a text delta; returns what is safe to publish now."""
        if self._finished:
            raise RuntimeError("feed after finish")
        self._buf += delta
        self._advance(final=False)
        return self._take()

    def finish(self) -> Terminal:
        """Ends the output: releases held text and reports the calls."""
        if self._finished:
            raise RuntimeError("finish called twice")
        self._advance(final=True)
        self._finished = True
        events = self._take()
        if self._contract.tool_choice == "required" and not self._calls and self._reason is FallbackReason.NONE:
            self._reason = FallbackReason.MISSING_REQUIRED_CALL
        return Terminal(
            content_tail=events.content,
            tool_calls=tuple(self._calls),
            diagnostics=Diagnostics(
                fallback_reason=self._reason,
                fallback_calls=self._fallback_calls,
                schema_mismatch_arguments=self._schema_mismatch,
                empty_arguments_omitted=self._empty_args,
            ),
            tool_call_deltas=events.tool_calls,
        )

    # -- the state machine: each step decides a prefix of `_buf` or waits --

    def _advance(self, *, final: bool) -> None:
        steps = {
            _Mode.TEXT: self._step_text,
            _Mode.IN_CALL: self._step_in_call,
            _Mode.SKIP: self._step_skip,
            _Mode.START: self._step_start,
            _Mode.AFTER_CALL: self._step_start,
            _Mode.PASSTHROUGH: self._step_passthrough,
        }
        while steps[self._mode](final):
            pass

    def _hold_after_call(self, final: bool) -> bool:
        """Whether whitespace after an accepted call must still be held.

        Whitespace that only trails a call (or separates it from the next) is
        dropped; whitespace before further content is published with it.
        """
        if not self._after_call:
            return False
        if self._buf.strip():
            self._after_call = False
            return False
        if final:
            self._buf = ""
        return True

    def _step_passthrough(self, final: bool) -> bool:
        if self._hold_after_call(final):
            return False
        self._emit_content(self._buf)
        self._buf = ""
        return False

    def _step_text(self, final: bool) -> bool:
        if self._hold_after_call(final):
            return False
        buf = self._buf
        i = buf.find(_OPEN)
        if i >= 0:
            kept = buf[:i].rstrip()
            self._emit_content(kept)
            self._open_call(pending=buf[len(kept) : i + len(_OPEN)], rest=buf[i + len(_OPEN) :])
            return True
        if final:
            return self._step_passthrough(final)
        j = len(buf) - partial_suffix(buf, _OPEN)
        while j > 0 and buf[j - 1].isspace():
            j -= 1
        self._emit_content(buf[:j])
        self._buf = buf[j:]
        return False

    def _step_skip(self, final: bool) -> bool:
        c = self._buf.find(_CLOSE, self._skip_from)
        if c >= 0:
            self._fail(FallbackReason.MALFORMED_JSON, c + len(_CLOSE))
            return True
        if final:
            self._fail(FallbackReason.MALFORMED_JSON, len(self._buf))
        else:
            self._skip_from = max(self._skip_from, len(self._buf) - len(_CLOSE) + 1)
        return False

    def _step_start(self, final: bool) -> bool:
        buf = self._buf
        start = self._mode is _Mode.START
        lead = len(buf) - len(buf.lstrip() if start else buf.lstrip(" \t\r\n;"))
        head = buf[lead:]
        if not start:
            # Separators after an accepted call are dropped, not content.
            buf = self._buf = head
            lead = 0
        if not head or (_PYTHON_TAG.startswith(head) and self._contract.format == "llama3"):
            if final:
                return self._to_passthrough()
            return False
        if self._contract.format == "llama3" and head.startswith(_PYTHON_TAG):
            self._tagged = True
            self._open_call(pending=buf[: lead + len(_PYTHON_TAG)], rest=head[len(_PYTHON_TAG) :])
            return True
        opener = "{" if self._contract.format == "llama3" else "["
        if head[0] == opener:
            self._tagged = False
            self._open_call(pending=buf[:lead], rest=head)
            return True
        return self._to_passthrough()

    def _step_in_call(self, final: bool) -> bool:
        fmt = self._contract.format
        buf = self._buf
        if not self._confirmed:
            verdict = _looks_like_call(buf, fmt)
            if verdict is None and not final:
                return False
            if not verdict:  # not a call, or still ambiguous when output ended
                self._emit_content(self._pending)
                self._pending = ""
                return self._to_passthrough()
            self._confirmed = True
        state, at = self._scanner.scan(buf)
        if state is _Scan.INCOMPLETE:
            if final:
                closed = fmt == "hermes" and _CLOSE in buf
                reason = FallbackReason.MALFORMED_JSON if closed else FallbackReason.TRUNCATED_CALL
                self._fail(reason, len(buf))
            return False
        if fmt != "hermes":
            consumed = len(buf) if state is _Scan.INVALID else at
            if state is _Scan.INVALID:
                self._fail(FallbackReason.MALFORMED_JSON, consumed)
            else:
                self._decide_block(buf[:at], consumed, unclosed=False)
            return True
        if state is _Scan.INVALID:
            self._mode, self._skip_from = _Mode.SKIP, at
            return True
        rest = buf[at:].lstrip()
        if rest.startswith(_CLOSE):
            self._decide_block(buf[:at], len(buf) - len(rest) + len(_CLOSE), unclosed=False)
            return True
        if _CLOSE.startswith(rest):
            if final:
                self._decide_block(buf[:at], len(buf), unclosed=True)
                return True
            return False
        self._mode, self._skip_from = _Mode.SKIP, at
        return True

    # -- transitions --

    def _open_call(self, *, pending: str, rest: str) -> None:
        self._pending = pending
        self._buf = rest
        self._mode = _Mode.IN_CALL
        # Hermes markers and the llama3 tag announce a call; bare "{" or "["
        # must first show a call-like head.
        self._confirmed = self._contract.format == "hermes" or self._tagged
        self._scanner = _BracketScanner(python=self._contract.format == "pythonic")

    def _to_passthrough(self) -> bool:
        self._mode = _Mode.PASSTHROUGH
        return True

    def _after_block(self) -> None:
        if self._contract.format == "hermes":
            self._mode = _Mode.TEXT
        elif self._contract.format == "llama3":
            self._mode = _Mode.AFTER_CALL
        else:
            # A pythonic list holds all calls; what follows is content.
            self._mode = _Mode.PASSTHROUGH

    def _fail(self, reason: FallbackReason, consumed: int) -> None:
        """Returns a broken call's raw text as content and records why."""
        self._emit_content(self._pending + self._buf[:consumed])
        self._pending = ""
        self._buf = self._buf[consumed:]
        self._after_call = False
        self._fallback_calls += 1
        self._note(reason)
        if self._contract.format == "hermes":
            self._mode = _Mode.TEXT
        else:
            self._mode = _Mode.PASSTHROUGH

    def _decide_block(self, text: str, consumed: int, *, unclosed: bool) -> None:
        fmt = self._contract.format
        if fmt == "pythonic":
            parsed = _parse_pythonic(text)
        else:
            try:
                parsed = _calls_in(json.loads(text, strict=False))
            except ValueError:
                parsed = FallbackReason.MALFORMED_JSON
        if isinstance(parsed, list):
            parsed = self._check_calls(parsed)
        if fmt == "llama3" and not self._tagged and parsed is FallbackReason.MALFORMED_CALL:
            # Untagged JSON that is not call-shaped is ordinary content.
            self._emit_content(self._pending + self._buf[:consumed])
            self._pending, self._buf = "", self._buf[consumed:]
            self._to_passthrough()
            return
        if isinstance(parsed, FallbackReason):
            self._fail(parsed, consumed)
            return
        for name, args in parsed:
            self._emit_call(name, args)
        if unclosed:
            self._note(FallbackReason.UNCLOSED_CALL)
        self._pending = ""
        self._buf = self._buf[consumed:]
        self._after_call = True
        self._after_block()

    def _check_calls(self, calls: list[tuple[str, Any]]) -> list[tuple[str, Any]] | FallbackReason:
        """Checks names and normalizes arguments; all calls of a block or none."""
        out = []
        for name, args in calls:
            if name not in self._allowed:
                return FallbackReason.UNKNOWN_TOOL
            if isinstance(args, str) and args.strip():
                try:
                    args = json.loads(args, strict=False)
                except ValueError:
                    return FallbackReason.MALFORMED_CALL
            elif args is None or isinstance(args, str):
                args = _EMPTY
            if args is not _EMPTY and not isinstance(args, dict):
                return FallbackReason.MALFORMED_CALL
            out.append((name, args))
        return out

    def _emit_call(self, name: str, args: Any) -> None:
        if args is _EMPTY:
            self._empty_args += 1
            args = {}
        validator = self._validators.get(name)
        if validator is not None and not _is_valid(validator, args):
            self._schema_mismatch += 1
        call = ParsedCall(name=name, arguments_json=json.dumps(args, ensure_ascii=False), id=self._new_id())
        index = len(self._calls)
        self._calls.append(call)
        self._deltas.append(ToolCallDelta(index=index, id=call.id, name=name))
        self._deltas.append(ToolCallDelta(index=index, arguments=call.arguments_json))

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)

    def _note(self, reason: FallbackReason) -> None:
        if self._reason is FallbackReason.NONE:
            self._reason = reason

    def _take(self) -> StreamEvents:
        events = StreamEvents(content="".join(self._content), tool_calls=tuple(self._deltas))
        self._content.clear()
        self._deltas.clear()
        return events


_EMPTY = object()  # sentinel: the model omitted arguments


def _validator(schema: Mapping[str, Any]) -> Any:
    """A jsonschema validator, or None when the client's schema is itself invalid."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError:
        return None
    return cls(schema)


def _is_valid(validator: Any, args: Any) -> bool:
    """The argument check; a schema it cannot evaluate (an unresolvable $ref) counts as a mismatch."""
    try:
        return bool(validator.is_valid(args))
    except Exception:  # noqa: BLE001 - an unresolvable $ref raises from the referencing library
        return False


def _looks_like_call(buf: str, fmt: str) -> bool | None:
    """Whether untagged whole output can still be a call (None: undecided).

    `buf` starts at the opener ("{" or "["). Every answer but None is final:
    no continuation of `buf` can change it, which keeps streaming split-proof.
    """
    if fmt == "pythonic":
        if _PY_CALL_HEAD.match(buf):
            return True
        return None if _PY_HEAD_PREFIX.fullmatch(buf) else False
    rest = buf[1:].lstrip()
    if not rest:
        return None
    if rest[0] != '"':
        return False
    m = _KEY.match(rest)
    if m is None:
        return None
    try:
        return json.loads(m.group(0), strict=False) in _CALL_KEYS
    except ValueError:
        return False


def _calls_in(obj: Any) -> list[tuple[str, Any]] | FallbackReason:
    """Extracts (name, raw arguments) from a parsed JSON call or list of calls."""
    items = obj if isinstance(obj, list) and obj else [obj]
    calls = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("function"), dict):
            item = item["function"]  # OpenAI-shaped {"type", "function": {...}}
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return FallbackReason.MALFORMED_CALL
        if not set(item) <= _CALL_KEYS:
            return FallbackReason.MALFORMED_CALL
        args = item["arguments"] if "arguments" in item else item.get("parameters")
        calls.append((item["name"], args))
    return calls


def _parse_pythonic(text: str) -> list[tuple[str, Any]] | FallbackReason:
    """Parses ``[f(a=1), g(b="x")]`` into (name, arguments) without evaluating it."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return FallbackReason.MALFORMED_JSON
    if not isinstance(tree, ast.List) or not tree.elts:
        return FallbackReason.MALFORMED_CALL
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return FallbackReason.MALFORMED_CALL
        try:
            name = _dotted(node.func)
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return FallbackReason.MALFORMED_CALL
        if len(args) != len(node.keywords):
            return FallbackReason.MALFORMED_CALL  # **kwargs
        calls.append((name, args))
    return calls


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ValueError("not a function name")


_NAMED_CONSTANTS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.expr) -> Any:
    """A literal argument value; models mix Python and JSON spellings."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_CONSTANTS:
        return _NAMED_CONSTANTS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _literal(k)
            if not isinstance(key, str):
                raise ValueError("non-string key")
            out[key] = _literal(v)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not a literal")


def DEFAULT_TOOL_SYSTEM_PROMPT(tools: Sequence[Mapping[str, Any]]) -> str:  # noqa: N802
    """A Hermes-style system block for chat templates that know nothing of tools.

    Lists each tool (OpenAI ``tools`` entries) as one JSON line inside
    ``<tools></tools>`` and asks for calls in ``<tool_call>`` tags, which the
    "hermes" format of `ToolCallDecoder` parses.

    Args:
        tools: The request's ``tools`` list, ``{"type": "function", "function": {...}}``.

    Returns:
        Text to put in (or append to) the system message.
    """
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        "<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call>"
    )


def render_tool_calls_as_text(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """Renders an assistant message's ``tool_calls`` as ``<tool_call>`` blocks.

    Args:
        tool_calls: OpenAI message entries, ``{"id", "type", "function":
            {"name", "arguments": <JSON string>}}``.

    Returns:
        The text the model would have generated, for templates without tools.
    """
    blocks = []
    for call in tool_calls:
        fn = call["function"]
        raw = fn.get("arguments") or "{}"
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            args = raw  # keep what the client sent rather than drop it
        body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
        blocks.append(f"{_OPEN}\n{body}\n{_CLOSE}")
    return "\n".join(blocks)


def render_tool_result_as_text(name: str | None, content: str) -> str:
    """Renders a tool-role message as a Hermes ``<tool_response>`` block."""
    body = content if name is None else json.dumps({"name": name, "content": content}, ensure_ascii=False)
    return f"<tool_response>\n{body}\n</tool_response>"
