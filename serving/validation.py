"""Types and ranges of a request body, checked up front in one place (before any tokenizing).

Every malformed field is a 400 with the OpenAI error body naming the field (`param`), never
an exception deeper in the pipeline (a 500): strings must be valid Unicode (no lone UTF-16
surrogates), numbers finite and within what the sampler holds, and the nested shapes of
`messages`, `tools` and `tool_choice` what the rest of the server indexes into. What a value
means (a range that depends on the model or the settings) stays with the code that uses it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from serving.errors import ApiError

FLOAT32_MAX = 3.4028234e38  # sampler values are float32 on the device
INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # what an int field may hold (seed: OpenAI allows 64 bits)
MAX_DEPTH = 64  # JSON nesting: deeper bodies are refused before anything walks them recursively

FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    # the research samplers (a server with [engine] extra_samplers)
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "top_n_sigma",
    "dry_multiplier",
    "dry_base",
    "xtc_probability",
    "xtc_threshold",
    "mirostat_tau",
    "mirostat_eta",
)
INT_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "top_k",
    "top_logprobs",
    "seed",
    "dry_allowed_length",
    "mirostat_mode",
)
BOOL_FIELDS = (
    "stream",
    "echo",
    "ignore_eos",
    "skip_special_tokens",
    "add_generation_prompt",
    "add_special_tokens",
    "return_token_strs",
)
ROLES = ("system", "developer", "user", "assistant", "tool")


def bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param)


# ---- the body as JSON ------------------------------------------------------------------
class NonFinite:
    """Where the body had NaN, Infinity or a float that overflows: Python's JSON reader takes
    them, the standard does not; `check_text` turns the first one into a 400 naming its field."""

    def __init__(self, text: str):
        self.text = text[:40]


def _finite_float(text: str) -> float | NonFinite:
    value = float(text)
    return value if math.isfinite(value) else NonFinite(text)


def parse_json(raw: bytes | str | None) -> Any:
    """The body as JSON; NaN, Infinity and overflowing floats come back as `NonFinite`.

    Raises:
      ApiError: 400 with the reason.
    """
    try:
        return json.loads(raw or b"", parse_constant=NonFinite, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad(f"the body is not valid JSON: {e}"[:300], None) from None


def check_text(value: Any, param: str | None = None, depth: int = 0) -> None:
    """Every string (keys too) must encode as UTF-8: JSON's "\\ud800" escape gives a lone
    surrogate, which every tokenizer and encoder downstream raises on. Every number finite."""
    if depth > MAX_DEPTH:
        raise bad(f"the body nests deeper than {MAX_DEPTH} levels", param)
    if isinstance(value, str):
        _check_str(value, param)
    elif isinstance(value, NonFinite):
        raise bad(f"{value.text} is not a finite JSON number", param)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_str(k, param)
            check_text(v, k if param is None else f"{param}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_text(v, f"{param}[{i}]", depth + 1)


def _check_str(s: str, param: str | None) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad("a string holds a lone UTF-16 surrogate (not valid Unicode)", param) from None


# ---- scalar fields ---------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_number(v: Any, param: str) -> None:
    """A finite number a float32 holds (an int beyond float range included)."""
    if not (_is_int(v) or isinstance(v, float)):
        raise bad(f"'{param}' must be a number", param)
    if _is_int(v) and abs(v) > FLOAT32_MAX or isinstance(v, float) and not (math.isfinite(v) and abs(v) <= FLOAT32_MAX):
        raise bad(f"'{param}' must be a finite number", param)


def check_int(v: Any, param: str) -> None:
    if not _is_int(v):
        raise bad(f"'{param}' must be an integer", param)
    if not INT_MIN <= v <= INT_MAX:
        raise bad(f"'{param}' is out of range", param)


def _check_type(v: Any, kind: type | tuple[type, ...], param: str, what: str) -> None:
    if isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)) or not isinstance(v, kind):
        raise bad(f"'{param}' must be {what}", param)


def _optional(body: Mapping[str, Any], name: str, check: Callable[[Any, str], None]) -> None:
    if body.get(name) is not None:
        check(body[name], name)


def _optional_type(obj: Mapping[str, Any], name: str, kind: type, where: str, what: str) -> None:
    """`obj[name]`, when present, is of `kind`; the error names `where.name`."""
    if obj.get(name) is not None:
        _check_type(obj[name], kind, f"{where}.{name}", what)


def check_scalars(body: Mapping[str, Any]) -> None:
    for name in FLOAT_FIELDS:
        _optional(body, name, check_number)
    for name in INT_FIELDS:
        _optional(body, name, check_int)
    for name in BOOL_FIELDS:
        _optional(body, name, lambda v, p: _check_type(v, bool, p, "true or false"))
    for name in ("model", "user"):
        _optional(body, name, lambda v, p: _check_type(v, str, p, "a string"))
    bias = body.get("logit_bias")
    if bias is not None:
        _check_type(bias, dict, "logit_bias", "an object of token id -> number")
        for k, v in bias.items():
            if not k.lstrip("-").isdigit() or not INT_MIN <= int(k) <= INT_MAX:
                raise bad("'logit_bias' keys must be token ids", "logit_bias")
            check_number(v, "logit_bias")
    ids = body.get("stop_token_ids")
    if ids is not None:
        _check_type(ids, list, "stop_token_ids", "a list of token ids")
        for t in ids:
            check_int(t, "stop_token_ids")
    breakers = body.get("dry_sequence_breakers")
    if breakers is not None and not (
        isinstance(breakers, list) and len(breakers) <= 16 and all(isinstance(b, str) and b for b in breakers)
    ):
        raise bad("'dry_sequence_breakers' must be a list of up to 16 non-empty strings", "dry_sequence_breakers")
    opts = body.get("stream_options")
    if opts is not None:
        _check_type(opts, dict, "stream_options", "an object")
        _optional(
            opts, "include_usage", lambda v, p: _check_type(v, bool, "stream_options.include_usage", "true or false")
        )


# ---- chat structures ------------------------------------------------------------------
def _function_of(obj: Any, param: str) -> Mapping[str, Any]:
    _check_type(obj, dict, param, "an object")
    if obj.get("type") not in (None, "function"):
        raise bad(f"'{param}.type' must be \"function\"", f"{param}.type")
    fn = obj.get("function")
    _check_type(fn, dict, f"{param}.function", "an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"'{param}.function.name' must be a non-empty string", f"{param}.function.name")
    return fn


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        _check_type(m, dict, where, "an object")
        if m.get("role") not in ROLES:
            raise bad(f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(
                        'only text content parts ({"type": "text", "text": ...}) are supported', f"{where}.content[{j}]"
                    )
        elif content is not None and not isinstance(content, str):
            raise bad(f"'{where}.content' must be a string or a list of text parts", f"{where}.content")
        for name in ("name", "tool_call_id"):
            _optional_type(m, name, str, where, "a string")
        calls = m.get("tool_calls")
        if calls is not None:
            _check_type(calls, list, f"{where}.tool_calls", "a list")
            for j, c in enumerate(calls):
                fn = _function_of(c, f"{where}.tool_calls[{j}]")
                _optional_type(c, "id", str, f"{where}.tool_calls[{j}]", "a string")
                args = fn.get("arguments")
                if args is not None and not isinstance(args, (str, dict)):
                    raise bad(
                        "tool call arguments must be a JSON string or an object",
                        f"{where}.tool_calls[{j}].function.arguments",
                    )


def check_tools(tools: Any, tool_choice: Any) -> None:
    if tools is not None:
        _check_type(tools, list, "tools", "a list")
        for i, t in enumerate(tools):
            fn = _function_of(t, f"tools[{i}]")
            _optional_type(fn, "description", str, f"tools[{i}].function", "a string")
            _optional_type(fn, "parameters", dict, f"tools[{i}].function", "an object")
    if tool_choice is None or isinstance(tool_choice, str):
        return
    if not isinstance(tool_choice, dict):
        raise bad("'tool_choice' must be auto, none, required or a named function", "tool_choice")
    _function_of(tool_choice, "tool_choice")


def check_response_format(rf: Any) -> None:
    if rf is None:
        return
    _check_type(rf, dict, "response_format", "an object")
    if not isinstance(rf.get("type", "text"), str):
        raise bad("'response_format.type' must be a string", "response_format")


# ---- sizes (the work a request can cause before any limit on tokens applies) -------------
def check_sizes(
    messages: list[Any],
    tools: list[Any] | None,
    response_format: Any,
    *,
    max_messages: int,
    max_tools: int,
    max_schema_bytes: int,
) -> None:
    """Message count (a session's history included), tool count and schema size."""
    if len(messages) > max_messages:
        raise bad(
            f"the conversation has {len(messages)} messages, over the server's max_messages ({max_messages})",
            "messages",
        )
    if tools and len(tools) > max_tools:
        raise bad(f"{len(tools)} tools is over the server's max_tools ({max_tools})", "tools")
    for param, value in (("tools", tools), ("response_format", response_format)):
        size = len(json.dumps(value)) if value else 0
        if size > max_schema_bytes:
            raise bad(
                f"'{param}' is {size} bytes of JSON, over the server's max_schema_bytes ({max_schema_bytes})", param
            )


# ---- whole bodies ---------------------------------------------------------------------
def check_chat(body: Any) -> None:
    """A chat completion body: every type and range that does not depend on the model."""
    _check_object(body)
    check_text(body)
    check_scalars(body)
    check_messages(body.get("messages"))
    check_tools(body.get("tools"), body.get("tool_choice"))
    check_response_format(body.get("response_format"))
    _optional(body, "logprobs", lambda v, p: _check_type(v, bool, p, "true or false"))


def check_completion(body: Any) -> None:
    _check_object(body)
    check_text(body)
    check_scalars(body)
    _optional(body, "logprobs", check_int)


def check_tokenize(body: Any) -> None:
    _check_object(body)
    check_text(body)
    check_scalars(body)
    if "messages" in body:
        check_messages(body["messages"])


def _check_object(body: Any) -> None:
    if not isinstance(body, Mapping):
        raise bad("the request body must be a JSON object", None)
