"""Frames from the worker thread to a request's handler, and their OpenAI wire shapes.

The worker appends frames to a request's `Output` during a round and `flush`es once per
round: one `loop.call_soon_threadsafe` per request per round, not one per token (the GIL is
shared). The handler awaits `next_frames()`, writes them and marks them `sent()`; if its client
goes away it calls `cancel()`, which the worker sees at its next round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from typing import Any

TokenLogprob = tuple[str, float, list[tuple[str, float]]]  # token text, logprob, top alternatives


@dataclasses.dataclass(frozen=True)
class Delta:
    index: int
    text: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(frozen=True)
class Finish:
    index: int
    reason: str
    text: str  # the whole published content of this choice
    tool_calls: tuple[dict[str, Any], ...] = ()  # complete calls, message shape
    logprobs: tuple[TokenLogprob, ...] = ()  # all of them (non-streaming responses)


@dataclasses.dataclass(frozen=True)
class Done:
    usage: dict[str, Any]
    session: str | None = None


@dataclasses.dataclass(frozen=True)
class Error:
    status: int
    message: str
    headers: tuple[tuple[str, str], ...] = ()


Frame = Delta | Finish | Done | Error


class Output:
    """One request's frame channel (worker thread -> event loop) and cancel flag."""

    def __init__(self, loop: asyncio.AbstractEventLoop, clock: Callable[[], float] = time.perf_counter):
        """`clock`: the scheduler's, so the report line can put the first write on its timeline."""
        self._loop = loop
        self._clock = clock
        self.first_written: float | None = None  # when the handler wrote the first text
        self._queue: asyncio.Queue[list[Frame]] = asyncio.Queue()
        self._buffer: list[Frame] = []
        self.cancelled = False
        self.closed = False  # the worker sent its last frame
        self._sent = threading.Event()  # the handler has written every flushed frame
        self._sent.set()
        self._handler_gone = False

    # worker side
    def add(self, frame: Frame) -> None:
        self._buffer.append(frame)
        if isinstance(frame, (Done, Error)):
            self.closed = True

    def flush(self) -> None:
        if self._buffer:
            frames, self._buffer = self._buffer, []
            if not self._handler_gone:
                self._sent.clear()
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, frames)
            except RuntimeError:  # the loop is closed: the server is stopping
                self._sent.set()

    def wait_sent(self, timeout: float) -> bool:
        """Blocks (without the GIL) until the handler has written what was flushed."""
        return self._sent.wait(timeout)

    # handler side
    async def next_frames(self) -> list[Frame]:
        return await self._queue.get()

    def wrote_text(self) -> None:
        """The handler wrote a chunk with content (the client's first token, if the first)."""
        if self.first_written is None:
            self.first_written = self._clock()

    def sent(self) -> None:
        """The handler wrote the frames it took (to the socket, or into its response)."""
        if self._queue.empty():
            self._sent.set()

    def handler_gone(self) -> None:
        """The handler returned: nothing flushed from now on is waited for."""
        self._handler_gone = True
        self._sent.set()

    def cancel(self) -> None:
        self.cancelled = True


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def _token_bytes(token: str) -> list[int]:
    """A logprob token's UTF-8 bytes; `bytes:\\xe6\\x97` (part of a character) spells them out."""
    if token.startswith("bytes:\\x"):
        return list(bytes.fromhex(token[len("bytes:") :].replace("\\x", "")))
    return list(token.encode())


def _chat_logprobs(items: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t,
                "logprob": lp,
                "bytes": _token_bytes(t),
                "top_logprobs": [{"token": a, "logprob": b, "bytes": _token_bytes(a)} for a, b in top],
            }
            for t, lp, top in items
        ]
    }


def _completion_logprobs(items: tuple[TokenLogprob, ...], offset: int = 0) -> dict[str, Any]:
    offsets, pos = [], offset
    for t, _, _ in items:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": [t for t, _, _ in items],
        "token_logprobs": [lp for _, lp, _ in items],
        "top_logprobs": [dict(top) for _, _, top in items],
        "text_offset": offsets,
    }


class Formatter:
    """Builds chunks and whole responses in the OpenAI shapes for one request."""

    def __init__(self, kind: str, request_id: str, model: str, *, include_usage: bool, logprobs: bool, echo: str = ""):
        """`echo`: text put before each choice's (a completion's `echo`: the prompt)."""
        self.kind = kind
        self.echo = echo
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.logprobs = logprobs
        self._started: set[int] = set()

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = usage
        return out

    def chunks(self, frame: Frame) -> list[dict[str, Any]]:
        """SSE payloads for one frame (possibly none)."""
        if isinstance(frame, Delta):
            if self.kind == "chat":
                delta: dict[str, Any] = {}
                if frame.index not in self._started:
                    self._started.add(frame.index)
                    delta["role"] = "assistant"
                if frame.text:
                    delta["content"] = frame.text
                if frame.tool_calls:
                    delta["tool_calls"] = list(frame.tool_calls)
                if not frame.text and not frame.tool_calls and "role" not in delta and not frame.logprobs:
                    return []
                lp = _chat_logprobs(frame.logprobs) if self.logprobs and frame.logprobs else None
                return [self._chunk([{"index": frame.index, "delta": delta, "logprobs": lp, "finish_reason": None}])]
            text = self._echo(frame.index) + frame.text
            if not text and not frame.logprobs:
                return []
            lp = _completion_logprobs(frame.logprobs) if self.logprobs and frame.logprobs else None
            return [self._chunk([{"index": frame.index, "text": text, "logprobs": lp, "finish_reason": None}])]
        if isinstance(frame, Finish):
            if self.kind == "chat":
                delta = {} if frame.index in self._started else {"role": "assistant", "content": ""}
                self._started.add(frame.index)
                return [
                    self._chunk(
                        [{"index": frame.index, "delta": delta, "logprobs": None, "finish_reason": frame.reason}]
                    )
                ]
            text = self._echo(frame.index)
            return [
                self._chunk([{"index": frame.index, "text": text, "logprobs": None, "finish_reason": frame.reason}])
            ]
        if isinstance(frame, Done) and self.include_usage:
            return [self._chunk([], frame.usage)]
        return []

    def _echo(self, index: int) -> str:
        """The echo text, once per choice (before its first streamed text)."""
        if not self.echo or index in self._started:
            return ""
        self._started.add(index)
        return self.echo

    def response(self, finishes: list[Finish], done: Done) -> dict[str, Any]:
        """The non-streaming response body."""
        choices = []
        for f in sorted(finishes, key=lambda f: f.index):
            if self.kind == "chat":
                msg: dict[str, Any] = {"role": "assistant", "content": f.text if (f.text or not f.tool_calls) else None}
                if f.tool_calls:
                    msg["tool_calls"] = list(f.tool_calls)
                lp = _chat_logprobs(f.logprobs) if self.logprobs else None
                choices.append({"index": f.index, "message": msg, "logprobs": lp, "finish_reason": f.reason})
            else:
                lp = _completion_logprobs(f.logprobs) if self.logprobs else None
                choices.append(
                    {"index": f.index, "text": self.echo + f.text, "logprobs": lp, "finish_reason": f.reason}
                )
        body = {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": done.usage,
        }
        if done.session:
            body["session"] = done.session
        return body
