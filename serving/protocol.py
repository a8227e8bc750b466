"""OpenAI request shapes: parsing, validation (400 with OpenAI error JSON), sampling params.

`parse_chat` / `parse_completion` turn a JSON body into a `Prepared` request: prompt ids
(rendered through the chat template), message boundaries for the prefix cache, one
`SamplingParams` per choice (n >= 1; seeds seed, seed+1, ...), stop strings, the tool
contract and the output options. Pure host code; runs off the device thread.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from jaxllm import samplers_extra
from jaxllm.chat_template import ChatTemplateError, tokenize_chat
from jaxllm.sampling import MAX_TOP_LOGPROBS, SamplingParams
from jaxllm.tokenizer import Tokenizer
from serving.errors import ApiError
from serving.settings import Settings
from serving.structured import StructuredOutputError, build_constraints, check_json_schema
from serving.tool_calls import (
    DEFAULT_TOOL_SYSTEM_PROMPT,
    ToolContract,
    pick_format,
    render_tool_calls_as_text,
    render_tool_result_as_text,
)
from serving.validation import check_chat, check_completion, check_sizes


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
    """A parsed, tokenized request ready for the scheduler."""

    kind: str  # "chat" | "completion"
    model: str
    prompt: list[int]
    boundaries: list[int]  # prefix-cache candidates (< len(prompt)), ascending
    params: list[SamplingParams]  # one per choice
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    echo_text: str = ""  # /v1/completions' echo: the prompt, put before each choice's text
    skip_special_tokens: bool = True
    tools: ToolContract | None = None
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # new messages (sessions)
    session: str | bool | None = None
    user: str | None = None
    constraints: tuple[Any, ...] = ()  # one grammar constraint per choice (structured output)

    @property
    def n(self) -> int:
        return len(self.params)

    @property
    def max_tokens(self) -> int:
        return self.params[0].max_tokens


def _get(body: Mapping[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise bad(f"'{name}' has the wrong type", name)
    if not isinstance(value, kinds):
        raise bad(f"'{name}' has the wrong type", name)
    return value


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    return float(_get(body, name, (int, float), default))


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, Mapping) or p.get("type") != "text":
                raise bad("only text content parts are supported", "messages")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise bad("message content must be a string or a list of text parts", "messages")


def template_has_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def normalize_messages(messages: Any, tools: list[dict] | None, native_tools: bool) -> list[dict[str, Any]]:
    """Validates messages; for templates without tool support renders calls/results as text."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad("each message needs a role of system, developer, user, assistant or tool", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text_of(m.get("content"))}
        calls = m.get("tool_calls")
        if calls:
            if native_tools:
                msg["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": _args_obj(c["function"].get("arguments"))}}
                    for c in calls
                ]
            else:
                text = render_tool_calls_as_text(calls)
                msg["content"] = (msg["content"] + "\n" + text) if msg["content"] else text
        if role == "tool":
            if native_tools:
                msg["tool_call_id"] = m.get("tool_call_id")
                if m.get("name"):
                    msg["name"] = m["name"]
            else:
                msg = {"role": "user", "content": render_tool_result_as_text(m.get("name"), msg["content"])}
        out.append(msg)
    if tools and not native_tools:
        block = DEFAULT_TOOL_SYSTEM_PROMPT(tools)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _args_obj(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw or {}


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise bad("'stop' must be a non-empty string or a list of up to 16 of them", "stop")
    return tuple(stop)


def _sampling(
    body: Mapping[str, Any],
    settings: Settings,
    prompt_len: int,
    max_context: int,
    vocab: int,
    logprobs: bool,
    top_logprobs: int,
    seed: int | None,
    completion: bool = False,
) -> SamplingParams:
    d, lim, sd = settings.defaults, settings.limits, settings.sampling_defaults
    max_tokens = _get(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = max(1, min(d.max_tokens, lim.max_output_tokens, max_context - prompt_len))
    if max_tokens < 1:
        raise bad("'max_tokens' must be at least 1", "max_tokens")
    if max_tokens > lim.max_output_tokens:
        raise bad(
            f"'max_tokens' {max_tokens} is over the server's max_output_tokens ({lim.max_output_tokens})", "max_tokens"
        )
    if prompt_len + max_tokens > max_context:
        raise bad(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) is over the context of {max_context} tokens",
            "max_tokens",
        )
    bias = _get(body, "logit_bias", dict, {})
    try:
        logit_bias = {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise bad("'logit_bias' maps token ids to numbers", "logit_bias") from None
    stop_ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise bad("'stop_token_ids' must be token ids", "stop_token_ids")
    top_k = _get(body, "top_k", int, sd["top_k"])
    drafts = _get(body, "drafts", int, None)
    if drafts is not None and not 0 <= drafts <= settings.engine.drafts:
        raise bad(f"'drafts' must be in [0, {settings.engine.drafts}] (the server's max_drafts)", "drafts")
    p = SamplingParams(
        temperature=_number(body, "temperature", sd["temperature"]),
        top_k=0 if top_k == -1 else min(top_k, vocab),  # past the vocabulary it keeps every token
        top_p=_number(body, "top_p", sd["top_p"]),
        min_p=_number(body, "min_p", sd["min_p"]),
        repetition_penalty=_number(body, "repetition_penalty", sd["repetition_penalty"]),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        logit_bias=logit_bias,
        stop_token_ids=tuple(stop_ids),
        max_tokens=max_tokens,
        min_tokens=_get(body, "min_tokens", int, 0),
        ignore_eos=bool(_get(body, "ignore_eos", bool, False)),
        seed=seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        drafts=drafts,
        **_extra_samplers(body, settings),
    )
    try:
        p.validate(vocab)
    except ValueError as e:
        raise bad(str(e), _sampler_param(str(e), body, completion)) from None
    return p


# The research samplers' request fields (llama.cpp server / vLLM names) -> SamplingParams
# fields; mirostat_mode picks mirostat (2) or not (0) as llama.cpp's `mirostat` does.
EXTRA_SAMPLER_FIELDS = {
    "typical_p": "typical_p",
    "epsilon_cutoff": "epsilon_cutoff",
    "eta_cutoff": "eta_cutoff",
    "top_n_sigma": "top_n_sigma",
    "dry_multiplier": "dry_multiplier",
    "dry_base": "dry_base",
    "dry_allowed_length": "dry_allowed_length",
    "xtc_probability": "xtc_probability",
    "xtc_threshold": "xtc_threshold",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
}


def _extra_samplers(body: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
    """SamplingParams fields of the research samplers a request sets (400 when the server
    runs without `[engine] extra_samplers`, whose state rows they need)."""
    given = {k: body[k] for k in (*EXTRA_SAMPLER_FIELDS, "mirostat_mode") if body.get(k) is not None}
    mode = given.pop("mirostat_mode", 0)
    if mode not in (0, 2):
        raise bad("'mirostat_mode' must be 0 (off) or 2 (mirostat v2; v1 is not supported)", "mirostat_mode")
    out = {EXTRA_SAMPLER_FIELDS[k]: v if k == "dry_allowed_length" else float(v) for k, v in given.items()}
    if mode == 2:
        out["mirostat_tau"] = out.get("mirostat_tau", 5.0)  # llama.cpp's default target surprise
        if out["mirostat_tau"] <= 0:
            raise bad("'mirostat_tau' must be > 0 with mirostat_mode 2", "mirostat_tau")
    else:
        out.pop("mirostat_tau", None)  # as in llama.cpp: tau and eta mean nothing without the mode
    if out and not settings.engine.extra_samplers:
        used = samplers_extra.uses_extra(SamplingParams(**out))
        if used:
            name = next(iter(given), "mirostat_mode")
            raise bad(
                f"'{name}' needs a server started with [engine] extra_samplers = true (this one runs without "
                "the research samplers)",
                name,
            )
    return out


# llama.cpp server's DRY sequence breakers when a request names none.
DRY_BREAKERS = ("\n", ":", '"', "*")


def _with_dry_breakers(
    params: list[SamplingParams], body: Mapping[str, Any], tokenizer: Tokenizer
) -> list[SamplingParams]:
    """With DRY on, each choice's sequence breakers: the tokens of the request's
    `dry_sequence_breakers` strings (llama.cpp's defaults without any). A match is broken
    at those tokens (llama.cpp also breaks inside longer tokens that contain a breaker)."""
    if not params or params[0].dry_multiplier <= 0:
        return params
    words = body.get("dry_sequence_breakers")
    ids = tuple(sorted({t for w in (DRY_BREAKERS if words is None else words) for t in tokenizer.encode(w)}))
    return [dataclasses.replace(p, dry_sequence_breakers=ids) for p in params]


# SamplingParams fields; a `validate` message starts with the one it is about.
_SAMPLER_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _sampler_param(message: str, body: Mapping[str, Any], completion: bool) -> str | None:
    """The request field a `SamplingParams.validate` message is about, by the request's name
    for it (a completion's `logprobs` is the sampler's top_logprobs; max_tokens may have
    come as max_completion_tokens)."""
    first = message.split(" ", 1)[0]
    if first not in _SAMPLER_FIELDS:
        return None
    if first == "top_logprobs" and completion:
        return "logprobs"
    if first == "max_tokens" and "max_tokens" not in body and "max_completion_tokens" in body:
        return "max_completion_tokens"
    return first


def _choices(
    body: Mapping[str, Any],
    settings: Settings,
    prompt_len: int,
    max_context: int,
    vocab: int,
    logprobs: bool,
    top_logprobs: int,
    seed: int | None,
    completion: bool = False,
) -> list[SamplingParams]:
    n = _get(body, "n", int, 1)
    if not 1 <= n <= 16:
        raise bad("'n' must be between 1 and 16", "n")
    base = _sampling(body, settings, prompt_len, max_context, vocab, logprobs, top_logprobs, seed, completion)
    if seed is None:
        return [base] * n
    return [dataclasses.replace(base, seed=(seed + i) & 0xFFFFFFFF) for i in range(n)]


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise bad("the request body must be a JSON object")
    stream = bool(_get(body, "stream", bool, False))
    opts = _get(body, "stream_options", dict, {})
    if opts and not stream:
        raise bad("'stream_options' is only allowed with stream", "stream_options")
    seed = _get(body, "seed", int, None)
    user = _get(body, "user", str, None)
    return dict(
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        seed=seed,
        user=user,
        skip_special_tokens=bool(_get(body, "skip_special_tokens", bool, True)),
        stop=_stop(body),
    )


def parse_chat(
    body: Mapping[str, Any],
    tokenizer: Tokenizer,
    settings: Settings,
    *,
    max_context: int,
    model_name: str,
    vocab: int,
    history: list[dict[str, Any]] | None = None,
    session_seed: int | None = None,
) -> Prepared:
    check_chat(body)
    common = _common(body)
    response_format = _get(body, "response_format", dict, {"type": "text"})
    tools = _get(body, "tools", list, None)
    tool_choice = body.get("tool_choice") or "auto"
    if tools is not None:
        if not all(
            isinstance(t, Mapping) and isinstance(t.get("function"), Mapping) and "name" in t["function"] for t in tools
        ):
            raise bad("each tool needs function.name", "tools")
        for t in tools:
            try:  # the same schema drives the grammar and the argument check: both must read it alike
                if t["function"].get("parameters") is not None:
                    check_json_schema(t["function"]["parameters"], "tools")
            except StructuredOutputError as e:
                raise bad(f"tool {t['function']['name']!r}: {e}", "tools") from None
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
        raise bad("'tool_choice' must be auto, none, required or a named function", "tool_choice")
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise bad("'tool_choice' names a function that is not in tools", "tool_choice")
    native = template_has_tools(tokenizer.chat_template)
    raw_messages = body.get("messages")
    new_messages = list(raw_messages) if isinstance(raw_messages, list) else raw_messages
    all_messages = (history or []) + (new_messages or []) if history is not None else new_messages
    lim = settings.limits
    check_sizes(
        all_messages,
        tools,
        response_format,
        max_messages=lim.max_messages,
        max_tools=lim.max_tools,
        max_schema_bytes=lim.max_schema_bytes,
    )
    use_tools = tools if tools and tool_choice != "none" else None
    messages = normalize_messages(all_messages, use_tools, native)
    try:
        chat = tokenize_chat(tokenizer, messages, tools=use_tools if native else None)
    except ChatTemplateError as e:
        raise bad(f"chat template: {e}", "messages") from None
    logprobs = bool(_get(body, "logprobs", bool, False))
    top = _get(body, "top_logprobs", int, 0)
    if top and not logprobs:
        raise bad("'top_logprobs' needs logprobs: true", "top_logprobs")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    seed = common["seed"] if common["seed"] is not None else session_seed
    params = _with_dry_breakers(
        _choices(body, settings, len(chat.ids), max_context, vocab, logprobs, top, seed), body, tokenizer
    )
    contract = None
    if use_tools:
        fmt = pick_format(model_name, settings.defaults.tool_call_format or None)
        contract = ToolContract.from_openai(use_tools, format=fmt, tool_choice=tool_choice)
    try:
        constraints = build_constraints(response_format, contract, tokenizer, vocab, len(params))
    except StructuredOutputError as e:
        raise bad(str(e), e.param) from None
    boundaries = sorted({b for b in chat.message_boundaries if 0 < b < len(chat.ids)})
    return Prepared(
        kind="chat",
        model=model_name,
        prompt=chat.ids,
        boundaries=boundaries,
        params=params,
        stop=common["stop"],
        stream=common["stream"],
        include_usage=common["include_usage"],
        logprobs=logprobs,
        skip_special_tokens=common["skip_special_tokens"],
        tools=contract,
        messages=list(new_messages),
        session=body.get("session"),
        user=common["user"],
        constraints=constraints,
    )


def parse_completion(
    body: Mapping[str, Any], tokenizer: Tokenizer, settings: Settings, *, max_context: int, model_name: str, vocab: int
) -> Prepared:
    check_completion(body)
    common = _common(body)
    if body.get("session") is not None:
        raise bad("'session' is only supported on /v1/chat/completions", "session")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        if any(not 0 <= t < vocab for t in ids):
            raise bad("prompt has a token id outside the vocabulary", "prompt")
    else:
        raise bad("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    if not ids:
        raise bad("the prompt is empty", "prompt")
    lp = _get(body, "logprobs", int, None)
    if lp is not None and not 0 <= lp <= MAX_TOP_LOGPROBS:
        raise bad(f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    logprobs = lp is not None
    echo = bool(_get(body, "echo", bool, False))
    if echo and logprobs:  # the prompt tokens' logprobs would need the prompt's logits, which prefill skips
        raise bad("'echo' with 'logprobs' is not supported (the prompt's logprobs are not computed)", "echo")
    params = _with_dry_breakers(
        _choices(body, settings, len(ids), max_context, vocab, logprobs, lp or 0, common["seed"], completion=True),
        body,
        tokenizer,
    )
    echo_text = (
        ""
        if not echo
        else prompt
        if isinstance(prompt, str)
        else tokenizer.decode(ids, skip_special_tokens=common["skip_special_tokens"])
    )
    return Prepared(
        kind="completion",
        model=model_name,
        prompt=ids,
        boundaries=[],
        params=params,
        stop=common["stop"],
        stream=common["stream"],
        include_usage=common["include_usage"],
        logprobs=logprobs,
        echo_text=echo_text,
        skip_special_tokens=common["skip_special_tokens"],
        user=common["user"],
    )
