"""Chat template tests: rendering against transformers, token boundaries, errors."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from jaxllm.chat_template import ChatTemplateError, render_chat, tokenize_chat
from jaxllm.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 12  + 30?"},
        {"role": "assistant", "content": "42."},
        {"role": "user", "content": "And in words? 😀"},
    ],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !\n\nÇa va ?"},
        {"role": "user", "content": "  spaced   out  "},
        {"role": "assistant", "content": "D'accord."},
    ],
]

# Exercises tools, tojson, namespace, loop controls, bos_token and extra kwargs.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(n=0) %}
{%- if tools %}
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
{% endif %}
{%- for m in messages %}
  {%- if m.role == 'tool' %}{% continue %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
[{{ ns.n }}:{{ m.role }}]{{ m.content if m.content is defined else '<no content>' }}
  {%- if m.tool_calls is defined %}{{ m.tool_calls | tojson(indent=2) }}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}[assistant]{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a < b & c",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tok(smollm2_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path)


@pytest.fixture(scope="module")
def hf_tok(tok: Tokenizer) -> Any:
    """transformers' tokenizer over the same vocabulary: the rendering reference."""
    t = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf, bos_token="<|im_start|>", eos_token="<|im_end|>")
    t.chat_template = tok.chat_template
    return t


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_smollm2_template_matches_transformers(tok: Tokenizer, hf_tok: Any, conv: int, gen: bool) -> None:
    messages = CONVERSATIONS[conv]
    prompt = tokenize_chat(tok, messages, add_generation_prompt=gen)
    ref = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert prompt.text == ref
    assert prompt.ids == tok.encode(ref)
    if messages[0]["role"] != "system":  # The template injects SmolLM's default system turn.
        assert "named SmolLM" in prompt.text


def test_rich_template_matches_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    messages = [
        {"role": "user", "content": "add 1"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "add", "arguments": {"x": 1}}]},
        {"role": "tool", "content": "2"},
        {"role": "user", "content": "thanks"},
    ]
    kwargs = {"tools": TOOLS, "add_generation_prompt": True, "enable_thinking": False}
    ours = tokenize_chat(tok, messages, chat_template=RICH_TEMPLATE, **kwargs)
    ref = hf_tok.apply_chat_template(messages, chat_template=RICH_TEMPLATE, tokenize=False, **kwargs)
    assert ours.text == ref
    assert ours.text.startswith("<|im_start|>")
    assert '"a < b & c"' in ours.text  # tojson does not HTML-escape.
    assert "<no content>" in ours.text and ours.text.endswith("[assistant]<nothink>")


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_message_boundaries(tok: Tokenizer, hf_tok: Any, conv: int) -> None:
    messages = CONVERSATIONS[conv]
    prompt = tokenize_chat(tok, messages, add_generation_prompt=True)
    assert len(prompt.message_boundaries) == len(messages)
    assert prompt.message_boundaries == sorted(set(prompt.message_boundaries))
    assert prompt.message_boundaries[-1] < len(prompt.ids)  # The generation prompt follows.
    for k, b in enumerate(prompt.message_boundaries, start=1):
        expected = hf_tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=False)
        assert tok.hf.decode(prompt.ids[:b], skip_special_tokens=False) == expected
        assert prompt.ids[:b] == tok.encode(expected)


def test_boundary_inside_a_token_is_dropped(tok: Tokenizer) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "Hi Hel"}, {"role": "user", "content": "lo"}]
    prompt = tokenize_chat(tok, messages, chat_template=template)
    assert prompt.text == "Hi Hello" and prompt.ids == tok.encode("Hi") + tok.encode(" Hello")
    assert len(prompt.ids) == 2
    assert prompt.message_boundaries == [2]  # "Hi Hel" ends inside " Hello": dropped.
    assert render_chat(template, messages).message_ends == [6, 8]


def test_a_long_conversation_renders_a_bounded_number_of_prefixes() -> None:
    # Rendering every prefix costs the square of the conversation: a few hundred messages took
    # the server's event loop for tens of seconds. Ends come from the first and last messages.
    renders: list[int] = []
    template = "{% set _ = tick() %}{% for m in messages %}{{ m.content }};{% endfor %}"
    messages = [{"role": "user", "content": str(i)} for i in range(100)]
    rendered = render_chat(template, messages, tick=lambda: renders.append(1) or "")
    assert len(renders) == 1 + 8
    lengths = [sum(len(str(i)) + 1 for i in range(k)) for k in range(1, 101)]
    assert rendered.message_ends == lengths[:4] + lengths[-4:]


def test_rewritten_history_has_no_boundary() -> None:
    # Earlier turns render differently once a later turn exists (like templates that
    # drop old reasoning), so those prefixes are not boundaries.
    template = "{% for m in messages %}{{ m.content if loop.last else 'x' }};{% endfor %}"
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    rendered = render_chat(template, messages)
    assert rendered.text == "x;b;" and rendered.message_ends == [4]


def test_raise_exception_becomes_chat_template_error() -> None:
    template = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Unknown role: ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="Unknown role: robot") as info:
        render_chat(template, [{"role": "robot", "content": "beep"}])
    assert isinstance(info.value, ValueError)
    assert render_chat(template, [{"role": "user", "content": "ok"}]).text == "ok"


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}",  # Syntax error.
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # Sandbox escape attempt.
        "{{ messages[5].content }}",  # Undefined attribute access on undefined.
        "{{ messages[0].content + 1 }}",  # Type error: str + int.
    ],
)
def test_broken_templates_raise_chat_template_error(template: str) -> None:
    with pytest.raises(ChatTemplateError):
        render_chat(template, [{"role": "user", "content": "x"}])


def test_whitespace_control_and_helpers() -> None:
    template = "{% for m in messages %}\n  {% if true %}\n{{ m.content }}|\n  {% endif %}\n{% endfor %}{{ strftime_now('%Y') | length }}"
    # trim_blocks drops the newline after a block tag; lstrip_blocks its indentation.
    assert render_chat(template, [{"role": "user", "content": "a"}]).text == "a|\n4"


def test_generation_tag_is_accepted() -> None:
    template = "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    assert render_chat(template, [{"role": "assistant", "content": "a"}]).text == "<a>"


def test_no_template_is_an_error() -> None:
    class NoTemplate:
        chat_template = None
        special_tokens_map: dict[str, str] = {}

    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenize_chat(NoTemplate(), [{"role": "user", "content": "x"}])  # type: ignore[arg-type]


def test_synthetic_tokenizer_template() -> None:
    syn = Tokenizer.synthetic(100)
    prompt = tokenize_chat(syn, [{"role": "user", "content": "t5 t6"}])
    assert prompt.text.endswith("assistant ")
    assert prompt.ids[-2:] != [] and len(prompt.message_boundaries) == 1


@pytest.mark.parametrize(
    "template,why",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
        ("{{ 1/0 }}", "ZeroDivisionError"),
        ("{{ 'x' * 100000000 }}", "repeats"),
        ("{{ 7 ** 100000000 > 5 }}", "power"),
        ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "characters"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ],
)
def test_a_runaway_template_is_a_chat_template_error(template: str, why: str) -> None:
    tracer = sys.gettrace()
    with pytest.raises(ChatTemplateError, match=why):
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert sys.gettrace() is tracer  # the step counter is gone
