"""Chat templates: render a conversation with Jinja2 exactly as transformers does.

Templates come from model files and are untrusted, so they run in Jinja's immutable
sandbox with the same environment options and helpers as
`transformers.PreTrainedTokenizerBase.apply_chat_template`.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The template rejected the conversation (`raise_exception`) or failed to render."""


class _ChatTokenizer(Protocol):
    """What `tokenize_chat` needs from `jaxllm.tokenizer.Tokenizer`."""

    @property
    def chat_template(self) -> str | None: ...

    @property
    def special_tokens_map(self) -> dict[str, str]: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...


@dataclasses.dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation.

    Attributes:
      text: the full prompt text.
      message_ends: for each message whose truncated render is a prefix of `text`, the
        character offset where it ends (ascending; templates that rewrite earlier turns,
        e.g. dropping old reasoning, have fewer entries than messages).
    """

    text: str
    message_ends: list[int]


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A tokenized conversation.

    Attributes:
      ids: token ids of the whole rendered prompt (tokenized once).
      text: the rendered prompt.
      message_boundaries: token offsets `b` such that `ids[:b]` is exactly the render of
        the conversation up to some message; only ends on token boundaries are kept.
    """

    ids: list[int]
    text: str
    message_boundaries: list[int]


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes; templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Bounds on one render of an untrusted template: lines of template code run (nested loops
# otherwise spin for hours) and characters produced. A real template over a long conversation
# runs a few thousand lines; its output is the conversation plus markup.
MAX_TEMPLATE_STEPS = 2_000_000
MAX_TEMPLATE_OUTPUT = 16 << 20
_MAX_REPEAT = 1 << 20  # items of `"x" * n` / `[x] * n` in a template
_MAX_EXPONENT = 256  # `a ** b`: Python computes huge powers for as long as it takes


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with sequence repetition and powers bounded."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _MAX_REPEAT:
                    raise ChatTemplateError(f"the chat template repeats a sequence past {_MAX_REPEAT} items")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > _MAX_EXPONENT:
            raise ChatTemplateError(f"the chat template raises to a power past {_MAX_EXPONENT}")
        return super().call_binop(context, operator, left, right)


class _StepBudget:
    """A trace function counting the lines run in template code (Jinja compiles templates to
    Python functions of the file "<template>"); past the budget the line raises."""

    def __init__(self, steps: int):
        self.left = steps

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        # Global tracer: only template frames get the line counter (other code runs untraced).
        return self._line if frame.f_code.co_filename == "<template>" else None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.left -= 1
            if self.left < 0:
                raise ChatTemplateError(f"the chat template ran more than {MAX_TEMPLATE_STEPS} steps")
        return self._line


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Cached: a server renders the same template for every request.
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from e


def _normalize(messages: Sequence[Message]) -> list[dict[str, Any]]:
    # Like transformers: drop None-valued keys (OpenAI clients send content=None with
    # tool calls), which many templates would otherwise render as the text "None".
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"chat messages must be mappings, got {type(m).__name__}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _render_text(
    template: jinja2.Template,
    messages: list[dict[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    special: dict[str, Any],
) -> str:
    previous = sys.gettrace()
    sys.settrace(_StepBudget(MAX_TEMPLATE_STEPS))
    try:
        parts, size = [], 0
        for part in template.generate(
            messages=messages,
            tools=None if tools is None else list(tools),
            add_generation_prompt=add_generation_prompt,
            **special,
        ):
            size += len(part)
            if size > MAX_TEMPLATE_OUTPUT:
                raise ChatTemplateError(f"the chat template wrote more than {MAX_TEMPLATE_OUTPUT} characters")
            parts.append(part)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(str(e)) from e
    except Exception as e:  # the template is untrusted: 1/0, recursion, ... are its failures
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    finally:
        sys.settrace(previous)


def render_chat(
    template: str,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **special: Any,
) -> RenderedChat:
    """Renders `messages` with the Jinja chat `template`.

    Args:
      template: the chat template source.
      messages: the conversation, e.g. `[{"role": "user", "content": "hi"}]`.
      tools: JSON schemas of callable tools, passed to the template as `tools`.
      add_generation_prompt: append the header that starts the assistant's reply.
      **special: further template variables: `bos_token`, `eos_token`, and extras such
        as `enable_thinking`.

    Returns:
      The text and the character offset where each message ends (at most
      MAX_PREFIX_RENDERS of them: the first and last messages of a long conversation).

    Raises:
      ChatTemplateError: the template called `raise_exception` or failed to render.
    """
    compiled = _compile(template)
    msgs = _normalize(messages)
    text = _render_text(compiled, msgs, tools, add_generation_prompt, special)
    ends: list[int] = []
    # Render some prefixes of the conversation (no generation prompt) and keep each length
    # that is a string prefix of the full render: that is where the message ends. Only
    # MAX_PREFIX_RENDERS of them: every prefix would cost the square of the conversation.
    for i in _prefixes_to_render(len(msgs)):
        try:
            partial = _render_text(compiled, msgs[:i], tools, False, special)
        except ChatTemplateError:
            continue  # E.g. templates requiring a user turn after the system message.
        end = len(partial)
        if text.startswith(partial) and (not ends or end > ends[-1]):
            ends.append(end)
    return RenderedChat(text=text, message_ends=ends)


# Prefix renders per conversation: the first few messages (a shared system prompt) and the
# last few (the previous turns of this conversation) are where prefix-cache hits come from.
MAX_PREFIX_RENDERS = 8


def _prefixes_to_render(n: int) -> list[int]:
    """Prefix lengths (in messages) whose ends `render_chat` finds, ascending."""
    if n <= MAX_PREFIX_RENDERS:
        return list(range(1, n + 1))
    head = MAX_PREFIX_RENDERS // 2
    return list(range(1, head + 1)) + list(range(n - (MAX_PREFIX_RENDERS - head) + 1, n + 1))


def _char_to_token_boundary(offsets: Sequence[tuple[int, int]], char: int) -> int | None:
    """Token index `b` such that tokens before `b` end at or before `char` and tokens from
    `b` on start at or after it; None when `char` falls inside a token.

    Offsets are non-decreasing (several byte-level tokens of one character share a span).
    """
    b = bisect.bisect_right([end for _, end in offsets], char)
    if b < len(offsets) and offsets[b][0] < char:
        return None
    return b


def tokenize_chat(
    tokenizer: _ChatTokenizer,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **special: Any,
) -> ChatPrompt:
    """Renders and tokenizes a conversation, recording where each message ends.

    The whole prompt is tokenized at once: tokenizing messages separately can change
    the ids at their seams.

    Args:
      tokenizer: supplies the chat template, bos/eos strings and the tokenization.
      messages: the conversation.
      tools: JSON schemas of callable tools.
      add_generation_prompt: append the assistant header.
      chat_template: overrides the tokenizer's template.
      **special: extra template variables; they override the tokenizer's bos/eos tokens.

    Raises:
      ChatTemplateError: no chat template, or the template rejected the conversation.
    """
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template is None:
        raise ChatTemplateError("the tokenizer has no chat template and none was given")
    rendered = render_chat(
        template,
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        **{**tokenizer.special_tokens_map, **special},
    )
    ids, offsets = tokenizer.encode_with_offsets(rendered.text)
    boundaries: list[int] = []
    for end in rendered.message_ends:
        b = _char_to_token_boundary(offsets, end)
        if b is not None and b > 0 and (not boundaries or b > boundaries[-1]):
            boundaries.append(b)
    return ChatPrompt(ids=list(ids), text=rendered.text, message_boundaries=boundaries)
