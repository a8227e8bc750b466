"""The text of one choice, as one pipeline with no engine, thread or metrics in it.

token events -> detokenizer -> stop strings -> tool-call decoder -> `Delta` frames;
at the end, reconcile the streamed text against one decode of every generated id, then the
finish reason and the `Finish` frame. The scheduler feeds it the events of one sequence and
sends on the frames it returns; tests drive it with token ids alone.

Held back while streaming: the suffix that could still begin a stop string (`holdback`),
and inside the tool-call decoder what could still begin a call. A stop string ends the
choice where it begins; tokens past it are dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from serving.output import Delta, Finish, Frame, TokenLogprob
from serving.partial_match import find_first, holdback
from serving.tool_calls import Diagnostics, ToolCallDecoder, ToolContract, finish_reason_for


class TokenizerLike(Protocol):
    eos_ids: frozenset[int]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def detokenizer(self, skip_special_tokens: bool = True) -> Any: ...
    def token_text(self, token_id: int) -> str: ...


class ChoiceTextError(Exception):
    """The choice cannot go on: its request fails with `status` (the others go on)."""

    def __init__(self, status: int, message: str, *, reconcile: str | None = None):
        super().__init__(message)
        self.status = status
        self.reconcile = reconcile  # the streamed text differed from the final decode: both ends, for the log


@dataclasses.dataclass(frozen=True)
class ChoiceEnd:
    """How a choice ended: its last frames (a tool-call tail, then `Finish`) and its record."""

    frames: tuple[Frame, ...]
    reason: str
    content: str
    tool_calls: tuple[dict[str, Any], ...]  # complete calls, message shape
    diagnostics: Diagnostics | None  # None without tools


class ChoiceText:
    """One choice's text from its tokens (see the module docstring)."""

    def __init__(
        self,
        index: int,
        tok: TokenizerLike,
        *,
        stop: tuple[str, ...] = (),
        tools: ToolContract | None = None,
        skip_special_tokens: bool = True,
        logprobs: bool = False,
        response_bytes: int = 1 << 20,
    ):
        self.index = index
        self.tok = tok
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.want_logprobs = logprobs
        self.response_bytes = response_bytes
        self.detok = tok.detokenizer(skip_special_tokens)
        self.tools = ToolCallDecoder(tools) if tools is not None else None
        self.raw = ""  # decoded text (stop strings not yet cut)
        self.published = 0  # chars of `raw` passed on (to the tool decoder / client)
        self.content = ""  # visible content published
        self.generated: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.stop_at: int | None = None  # stop-string match position in `raw`
        self.model_reason: str | None = None  # the engine's finish reason ("stop": eos or a stop token)

    @property
    def ended(self) -> bool:
        """A stop string matched or the engine finished the sequence: `finish` comes next."""
        return self.stop_at is not None or self.model_reason is not None

    def feed(
        self,
        tokens: Sequence[int],
        logprobs: Sequence[float] = (),
        top_logprobs: Sequence[Sequence[tuple[int, float]]] = (),
        finish_reason: str | None = None,
    ) -> list[Frame]:
        """One event's tokens; returns the frames to send (none while text is held back).

        Raises:
          ChoiceTextError: the text passed limits.response_bytes (400).
        """
        tokens = list(tokens)
        self.generated.extend(tokens)
        if finish_reason is not None:
            self.model_reason = finish_reason
        items: list[TokenLogprob] = []
        if self.want_logprobs:
            for i, t in enumerate(tokens):
                tops = [
                    (self.tok.token_text(tid), lp) for tid, lp in (top_logprobs[i] if i < len(top_logprobs) else [])
                ]
                items.append((self.tok.token_text(t), logprobs[i], tops))
            self.logprobs.extend(items)
        # A "stop" finish ends on the stop token itself, which is not text.
        for t in tokens[:-1] if finish_reason == "stop" else tokens:
            if self.stop_at is not None:
                break
            self.raw += self.detok.feed(t)
        if finish_reason is not None and self.stop_at is None:
            self.raw += self.detok.flush()
        return self._advance(final=finish_reason is not None, logprobs=tuple(items))

    def _advance(self, *, final: bool, logprobs: tuple[TokenLogprob, ...]) -> list[Frame]:
        if len(self.raw.encode()) > self.response_bytes:
            raise ChoiceTextError(400, "the response exceeds response_bytes; lower max_tokens")
        if self.stop and self.stop_at is None:
            longest = max(len(s) for s in self.stop)
            self.stop_at = find_first(self.raw, self.stop, max(0, self.published - longest))
        if self.stop_at is not None:
            end = self.stop_at
        elif final:
            end = len(self.raw)
        else:
            end = len(self.raw) - holdback(self.raw, self.stop)
        piece = self.raw[self.published : end] if end > self.published else ""
        self.published = max(self.published, end)
        calls: list[dict[str, Any]] = []
        if self.tools is not None and piece:
            ev = self.tools.feed(piece)
            piece = ev.content
            calls = [d.to_openai() for d in ev.tool_calls]
        self.content += piece
        if piece or calls or logprobs:
            return [Delta(self.index, piece, tuple(calls), logprobs)]
        return []

    def finish(self) -> ChoiceEnd:
        """Reconciles the streamed text and closes the choice.

        Raises:
          ChoiceTextError: the streamed text differs from one decode of the ids (500).
        """
        reason = "stop" if self.stop_at is not None else (self.model_reason or "length")
        ids = self.generated[:-1] if self.model_reason == "stop" and self.stop_at is None else self.generated
        expected = self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens)
        cut = find_first(expected, self.stop) if self.stop else None
        expected = expected if cut is None else expected[:cut]
        streamed = self.raw if self.stop_at is None else self.raw[: self.stop_at]
        # After a stop string the ids may run past it: the decode need only begin with the text.
        agrees = expected.startswith(streamed) if self.stop_at is not None else streamed == expected
        if not agrees:
            raise ChoiceTextError(
                500,
                "streamed text differs from the final decode",
                reconcile=f"{streamed[-40:]!r} vs {expected[-40:]!r}",
            )
        if self.tools is None:
            frames: list[Frame] = [Finish(self.index, reason, self.content, (), tuple(self.logprobs))]
            return ChoiceEnd(tuple(frames), reason, self.content, (), None)
        term = self.tools.finish()
        self.content += term.content_tail
        frames = []
        if term.content_tail or term.tool_call_deltas:
            frames.append(Delta(self.index, term.content_tail, tuple(d.to_openai() for d in term.tool_call_deltas)))
        calls = tuple(
            {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments_json}}
            for tc in term.tool_calls
        )
        reason = finish_reason_for(reason, bool(calls))
        frames.append(Finish(self.index, reason, self.content, calls, tuple(self.logprobs)))
        return ChoiceEnd(tuple(frames), reason, self.content, calls, term.diagnostics)


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, drafts: tuple[int, int] | None = None
) -> dict[str, Any]:
    """A request's OpenAI usage; `drafts` = (proposed, accepted) when drafts were verified."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if drafts is not None:  # OpenAI's names for verified drafts (predicted outputs)
        proposed, accepted = drafts
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": proposed - accepted,
        }
    return out
