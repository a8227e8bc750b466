"""The OpenAI routes: chat and text completions (streamed or whole), models, tokenize and
detokenize. A generation is parsed and tokenized off the event loop, checked by admission,
handed to the worker as a `Job`, and its frames relayed as they come."""

from __future__ import annotations

import asyncio
from typing import Any

from sanic import Blueprint, Request, response

from serving.admission import Job, never_fits, reserve
from serving.errors import ApiError
from serving.output import Done, Error, Finish, Formatter, Output, sse
from serving.protocol import Prepared, parse_chat, parse_completion
from serving.routes.common import caller_key, check_ready, model_request, server_of
from serving.server_state import Server
from serving.sessions import SessionTurn
from serving.validation import check_sizes, check_tokenize

bp = Blueprint("openai")


@bp.post("/v1/chat/completions", stream=True)
async def chat_completions(request: Request) -> Any:
    return await _generate(request, "chat")


@bp.post("/v1/completions", stream=True)
async def completions(request: Request) -> Any:
    return await _generate(request, "completion")


async def _generate(request: Request, kind: str) -> Any:
    srv = server_of(request)
    check_ready(srv)  # 503 while the model loads: there is no scheduler (whose clock times requests) yet
    received = srv.scheduler.clock()
    srv, body = await model_request(request)
    key = caller_key(request)
    turn = SessionTurn.open(srv.sessions, key, body.get("session") if kind == "chat" else None)
    srv.in_flight += 1
    try:
        return await _run_generation(request, srv, kind, body, turn, received)
    finally:
        srv.in_flight -= 1
        turn.close()


async def _run_generation(
    request: Request, srv: Server, kind: str, body: dict[str, Any], turn: SessionTurn, received: float
) -> Any:
    settings = srv.settings.current
    engine, tok, cfg = srv.engine, srv.model.tokenizer, srv.model.cfg
    history, session_seed = turn.history, turn.seed
    loop = asyncio.get_running_loop()

    def prepare() -> Prepared:
        common = dict(max_context=engine.max_context, model_name=srv.model_name, vocab=cfg.vocab_size)
        if kind == "chat":
            return parse_chat(body, tok, settings, history=history, session_seed=session_seed, **common)
        return parse_completion(body, tok, settings, **common)

    prepared = await loop.run_in_executor(None, prepare)
    pages = engine.pages_needed(len(prepared.prompt) + prepared.max_tokens)
    pool = srv.scheduler.pool
    if prepared.n > pool.max_slots:  # the client's to change, whatever the load: 400, not 503
        raise ApiError(
            400,
            f"'n' is {prepared.n}, over the {pool.max_slots} choices this server runs at once "
            f"(its sequence slots); ask for n <= {pool.max_slots}",
            param="n",
        )
    reservation = reserve(prepared, pages, pool, settings, len(request.body or b"")).total
    never = never_fits(prepared.n, pages, reservation, pool, settings)
    if never is not None:
        srv.metrics.count_outcome("rejected")
        raise ApiError(503, never.message, code="never_fits", param=never.param, headers={"x-should-retry": "false"})
    turn.accepted()
    session_id = turn.id
    output = Output(loop, clock=srv.scheduler.clock)
    job = Job(
        id=srv.next_id(kind),
        prepared=prepared,
        settings=settings,
        output=output,
        reservation=reservation,
        pages=pages,
        arrived=srv.scheduler.clock(),
        received=received,
        session_id=session_id,
        session_messages=prepared.messages if session_id else [],
    )
    fmt = Formatter(
        kind,
        job.id,
        srv.model_name,
        include_usage=prepared.include_usage,
        logprobs=prepared.logprobs,
        echo=prepared.echo_text,
    )
    headers = {"x-session-id": session_id} if session_id else {}
    srv.scheduler.submit(job)
    try:
        frames = await output.next_frames()
        first_error = next((f for f in frames if isinstance(f, Error)), None)
        if first_error is not None and not any(isinstance(f, Finish) for f in frames):
            raise ApiError(first_error.status, first_error.message)
        turn.completed = True  # the turn produced output: the session stays even if the stream breaks later
        if prepared.stream:
            return await _stream(request, output, fmt, frames, headers)
        return await _collect(output, fmt, frames, headers)
    finally:
        output.handler_gone()
        if not output.closed:
            output.cancel()


async def _stream(request: Request, output: Output, fmt: Formatter, frames: list, headers: dict) -> None:
    resp = await request.respond(content_type="text/event-stream", headers={"cache-control": "no-cache", **headers})
    while True:
        for f in frames:
            if isinstance(f, Error):
                await resp.send(sse({"error": ApiError(f.status, f.message).body()["error"]}))
                await resp.eof()
                return
            for chunk in fmt.chunks(f):
                await resp.send(sse(chunk))
                output.wrote_text()
            if isinstance(f, Done):
                await resp.send(sse("[DONE]"))
                await resp.eof()
                return
        output.sent()
        frames = await output.next_frames()


async def _collect(output: Output, fmt: Formatter, frames: list, headers: dict) -> response.HTTPResponse:
    finishes: list[Finish] = []
    while True:
        for f in frames:
            if isinstance(f, Error):
                raise ApiError(f.status, f.message)
            if isinstance(f, Finish):
                finishes.append(f)
            if isinstance(f, Done):
                return response.json(fmt.response(finishes, f), headers=headers)
        frames = await output.next_frames()


def _draft_source(engine: Any) -> str | None:
    if engine is None or not engine.config.max_drafts:
        return None
    return "mtp" if engine.mtp_drafts else "prompt_lookup"


@bp.get("/v1/models")
async def models(request: Request) -> Any:
    srv = server_of(request)
    drafts = srv.engine.config.max_drafts if srv.engine is not None else 0
    data = [
        {
            "id": srv.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "jaxllm",
            "max_model_len": srv.engine.max_context if srv.engine is not None else None,
            "speculative": {"draft_source": _draft_source(srv.engine), "max_drafts": drafts},
        }
    ]
    return response.json({"object": "list", "data": data})


@bp.post("/tokenize", stream=True)
async def tokenize(request: Request) -> Any:
    srv, body = await model_request(request)
    # Rendering and tokenizing are request work: off the event loop, which serves everyone.
    return response.json(await asyncio.get_running_loop().run_in_executor(None, _tokenize, srv, body))


def _tokenize(srv: Server, body: dict[str, Any]) -> dict[str, Any]:
    check_tokenize(body)
    tok = srv.model.tokenizer
    if "messages" in body:
        from jaxllm.chat_template import ChatTemplateError, tokenize_chat

        lim = srv.settings.current.limits
        check_sizes(
            body["messages"],
            None,
            None,
            max_messages=lim.max_messages,
            max_tools=lim.max_tools,
            max_schema_bytes=lim.max_schema_bytes,
        )
        try:
            ids = tokenize_chat(
                tok, body["messages"], add_generation_prompt=bool(body.get("add_generation_prompt", True))
            ).ids
        except ChatTemplateError as e:
            raise ApiError(400, f"chat template: {e}", param="messages") from None
    elif isinstance(body.get("prompt"), str):
        ids = tok.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", False)))
    else:
        raise ApiError(400, "'prompt' (a string) or 'messages' is required", param="prompt")
    out: dict[str, Any] = {"count": len(ids), "max_model_len": srv.engine.max_context, "tokens": ids}
    if body.get("return_token_strs"):
        out["token_strs"] = [tok.id_to_piece(i) for i in ids]
    return out


@bp.post("/detokenize", stream=True)
async def detokenize(request: Request) -> Any:
    srv, body = await model_request(request)
    ids = body.get("tokens")
    vocab = srv.model.cfg.vocab_size
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
    ):
        raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
    text = await asyncio.get_running_loop().run_in_executor(
        None, lambda: srv.model.tokenizer.decode(ids, skip_special_tokens=False)
    )
    return response.json({"prompt": text})
