"""The Sanic app: OpenAI-compatible routes over the scheduler.

`create_app(settings, ...)` builds the app; the model loads and every shape bucket compiles
on the worker thread started after the server starts, and `/health` answers 503 until then.
Handlers never touch the engine: they parse and tokenize (in an executor, off the event
loop), hand a `Job` to the scheduler and relay its frames.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sanic import Blueprint, Request, Sanic, response
from sanic.exceptions import NotFound, PayloadTooLarge, SanicException
from sanic.http import Stage
from sanic.server.protocols.http_protocol import HttpProtocol

from serving.metrics import Metrics
from serving.openapi import docs
from serving.output import Done, Error, Finish, Formatter, Output, sse
from serving.protocol import ApiError, Prepared, parse_chat, parse_completion
from serving.scheduler import Job, Scheduler, reservation_bytes, warmup_engine
from serving.sessions import SessionBusy, SessionStore
from serving.settings import SettingsStore
from serving.validation import check_sizes, check_tokenize, parse_json

log = logging.getLogger("jaxllm.serve")
_app_ids = itertools.count()


class CappedHttpProtocol(HttpProtocol):
    """Sanic's protocol with a cap on open connections (limits.max_connections): one more is
    answered 503 and closed at once, before it can hold a buffer or a task."""

    _REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"x-should-retry: true\r\ncontent-length: %d\r\n\r\n%s")

    __slots__ = ("_refused",)  # Sanic's protocols use slots

    def connection_made(self, transport: Any) -> None:
        cap = self.app.ctx.server.settings.current.limits.max_connections
        self._refused = False
        if self.connections is not None and len(self.connections) >= cap:
            body = json.dumps(ApiError(503, f"the server has max_connections ({cap}) open connections",
                                       code="too_many_connections").body()).encode()
            self._refused = True
            transport.write(self._REFUSAL % (len(body), body))
            transport.close()
            self.app.ctx.server.metrics.count_http_error(503)
            return
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if getattr(self, "_refused", False):  # a refused connection has no buffer: its data is dropped
            return
        started = self._time
        super().data_received(data)
        # Sanic restarts its request clock at every packet, so headers sent a byte at a time
        # never time out: while they arrive, the clock keeps their first byte's time and
        # REQUEST_TIMEOUT bounds the whole head.
        http = getattr(self, "_http", None)  # set once the connection task runs
        if http is not None and http.stage is Stage.REQUEST:
            self._time = started

    def connection_lost(self, exc: BaseException | None) -> None:
        if not getattr(self, "_refused", False):
            super().connection_lost(exc)


class Server:
    """What the routes share (on `app.ctx.server`): model, scheduler, stores, settings."""

    def __init__(self, settings: SettingsStore, loader: Callable[[], Any], model_name: str, api_keys: frozenset[str],
                 warmup: bool, on_death: Callable[[BaseException], None] | None, profile_dir: str | None = None):
        self.settings = settings
        self.profile_dir = profile_dir
        self.profiling = False
        self.profile_timer: asyncio.TimerHandle | None = None  # stops a trace at profile_max_seconds
        self.costs: dict[str, int] | None = None  # jaxllm.costs.ModelCosts of the loaded model
        self.loader = loader
        self.model_name = model_name
        self.api_keys = api_keys  # empty: no authentication
        self.warmup = warmup
        self.on_death = on_death
        self.metrics = Metrics()
        self.sessions = SessionStore(settings.current.limits.session_ttl_seconds)
        self.model: Any = None
        self.engine: Any = None
        self.scheduler: Scheduler | None = None
        self.load_error: BaseException | None = None
        self.draining = False  # stopping: in-flight requests finish, new ones get 503
        self.in_flight = 0  # generation requests whose response is not fully sent
        self._ids = itertools.count()

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and self.scheduler.ready and self.scheduler.dead is None

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        """Loads the model and starts the worker (which warms up); runs on its own thread."""
        from jaxllm.costs import model_costs
        from jaxllm.state import kv_bytes_per_page, recurrent_bytes_per_sequence

        try:
            started = time.perf_counter()
            self.model = self.loader()
            self.costs = dataclasses.asdict(model_costs(self.model.cfg, self.model.params))
            e = self.settings.current.engine
            self.engine = self.model.engine(e.engine_config())
            cfg = self.model.cfg
            engine = self.engine

            def warm() -> None:
                t = time.perf_counter()
                rounds = warmup_engine(engine, vocab=cfg.vocab_size) if self.warmup else 0
                log.info("warm-up: %d rounds in %.1fs (model loaded in %.1fs)", rounds, time.perf_counter() - t, t - started)

            self.scheduler = Scheduler(
                engine, self.model.tokenizer, self.settings, self.metrics, self.sessions,
                bytes_per_page=int(kv_bytes_per_page(cfg, engine.layout.page_size)), vocab=cfg.vocab_size,
                recurrent_bytes=recurrent_bytes_per_sequence(cfg),
                cache_options=f"{self.model_name}:{cfg.dtype}:{cfg.kv_dtype}".encode(), on_death=self.on_death, warmup=warm)
            self.scheduler.start()
        except BaseException as e:  # noqa: BLE001
            self.load_error = e
            log.critical("model load failed: %s", e, exc_info=True)
            if self.on_death is not None:
                self.on_death(e)

    def key_of(self, authorization: str) -> str | None:
        """The API key an Authorization header carries, if it is one of ours (constant time)."""
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given:
            return None
        found = None
        for k in self.api_keys:  # every key is compared, so the time says nothing about which matched
            if secrets.compare_digest(given.encode(), k.encode()):
                found = k
        return found

    def next_id(self, kind: str) -> str:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return f"{prefix}-{secrets.token_hex(12)}"


def error_response(e: ApiError) -> response.HTTPResponse:
    return response.json(e.body(), status=e.status, headers=e.headers)


def _server(request: Request) -> Server:
    return request.app.ctx.server


def _check_ready(srv: Server) -> None:
    if srv.draining:
        raise ApiError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
    if not srv.ready:
        raise ApiError(503, "the model is loading" if srv.scheduler is None or srv.scheduler.dead is None
                       else "the worker thread died", type="service_unavailable")


def _check_model(srv: Server, body: Any) -> None:
    name = body.get("model") if isinstance(body, dict) else None
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if name is not None and name != srv.model_name:
        raise ApiError(404, f"the model '{name}' does not exist", code="model_not_found", param="model")


async def _read_body(request: Request) -> bytes:
    """Reads the body of a streaming route, after the API key was checked on the headers,
    within request_bytes (413) and body_seconds (408): a client that trickles its body holds
    neither memory nor a connection for long."""
    lim = _server(request).settings.current.limits
    if request.stream is not None and request.stream.request_body:
        request.stream.request_max_size = lim.request_bytes  # Sanic lifts it for streaming routes
        try:
            await asyncio.wait_for(request.receive_body(), lim.body_seconds)
        except TimeoutError:
            # Close instead of draining the rest of the body: that drain has no deadline.
            request.stream.keep_alive = False
            request.stream.request_body = None
            raise ApiError(408, f"the request body did not arrive within body_seconds ({lim.body_seconds:g})",
                           type="invalid_request_error", code="request_timeout") from None
    return request.body or b""


async def _json_object(request: Request) -> dict[str, Any]:
    """The body as strict JSON (no NaN / Infinity), which must be an object; 400 otherwise."""
    body = parse_json(await _read_body(request))
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


api = Blueprint("openai")


@api.post("/v1/chat/completions", stream=True)
async def chat_completions(request: Request) -> Any:
    return await _generate(request, "chat")


@api.post("/v1/completions", stream=True)
async def completions(request: Request) -> Any:
    return await _generate(request, "completion")


async def _generate(request: Request, kind: str) -> Any:
    srv = _server(request)
    _check_ready(srv)
    body = await _json_object(request)
    _check_model(srv, body)
    key = _caller_key(request)
    turn = _SessionTurn.open(srv, key, body.get("session") if kind == "chat" else None)
    srv.in_flight += 1
    try:
        return await _run_generation(request, srv, kind, body, turn)
    finally:
        srv.in_flight -= 1
        turn.close()


class _SessionTurn:
    """One request's hold on a session: an existing session is claimed (one turn at a time,
    409 otherwise) and released when the response ends; a new one is created only once the
    request is accepted, and deleted again if it fails before its first turn."""

    def __init__(self, srv: Server, key: str | None, session_id: str | None, history: list | None, seed: int | None,
                 new: bool):
        self.srv, self.key, self.id, self.history, self.seed, self.new = srv, key, session_id, history, seed, new
        self.completed = False

    @classmethod
    def open(cls, srv: Server, key: str | None, sess: Any) -> _SessionTurn:
        if sess in (None, False):
            return cls(srv, key, None, None, None, False)
        if sess is True or sess == "new":
            return cls(srv, key, None, [], secrets.randbits(32), True)
        if not isinstance(sess, str):
            raise ApiError(400, "'session' must be true, \"new\" or a session id", param="session")
        try:
            snap = srv.sessions.claim(sess, key)
        except SessionBusy:
            raise ApiError(409, f"session '{sess}' has a turn in progress; send the next turn after it ends",
                           type="invalid_request_error", param="session", code="session_busy") from None
        if snap is None:
            raise ApiError(404, f"session '{sess}' does not exist (or expired)", param="session", code="session_not_found")
        history, seed = snap
        return cls(srv, key, sess, history, seed, False)

    def accepted(self) -> None:
        """The request passed validation and admission checks: a new session exists from now."""
        if self.new:
            self.id = self.srv.sessions.create(self.key, rng=self.seed, claimed=True).id

    def close(self) -> None:
        if self.id is None:
            return
        if self.new and not self.completed:
            self.srv.sessions.delete(self.id, self.key)
        else:
            self.srv.sessions.release(self.id)


async def _run_generation(request: Request, srv: Server, kind: str, body: dict[str, Any], turn: _SessionTurn) -> Any:
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
    reservation = reservation_bytes(prepared, srv.scheduler.bytes_per_page, pages, cfg.vocab_size, settings,
                                    len(request.body or b""), srv.scheduler.recurrent_bytes)
    never = None
    param = "max_tokens"
    if prepared.n > engine.layout.max_slots:  # the client's to change, whatever the load: 400, not 503
        raise ApiError(400, f"'n' is {prepared.n}, over the {engine.layout.max_slots} choices this server runs at once "
                            f"(its sequence slots); ask for n <= {engine.layout.max_slots}", param="n")
    if pages * prepared.n > engine.layout.n_pages - 1:
        never = "the request needs more KV pages than the pool holds"
    elif reservation > settings.budget_bytes:
        never = "the request exceeds active_state_mib; reduce max_tokens or n, or raise the state budget"
    if never:
        srv.scheduler.totals["rejected"] += 1
        srv.metrics.count_outcome("rejected")
        raise ApiError(503, never, code="never_fits", param=param, headers={"x-should-retry": "false"})
    turn.accepted()
    session_id = turn.id
    output = Output(loop)
    job = Job(id=srv.next_id(kind), prepared=prepared, settings=settings, output=output, reservation=reservation,
              pages=pages, arrived=srv.scheduler.clock(), session_id=session_id,
              session_messages=prepared.messages if session_id else [])
    fmt = Formatter(kind, job.id, srv.model_name, include_usage=prepared.include_usage, logprobs=prepared.logprobs)
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
            if isinstance(f, Done):
                await resp.send(sse("[DONE]"))
                await resp.eof()
                return
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


@api.get("/v1/models")
async def models(request: Request) -> Any:
    srv = _server(request)
    drafts = srv.engine.config.max_drafts if srv.engine is not None else 0
    data = [{"id": srv.model_name, "object": "model", "created": 0, "owned_by": "jaxllm",
             "max_model_len": srv.engine.max_context if srv.engine is not None else None,
             "speculative": {"draft_source": _draft_source(srv.engine), "max_drafts": drafts}}]
    return response.json({"object": "list", "data": data})


@api.get("/health")
async def health(request: Request) -> Any:
    srv = _server(request)
    if srv.draining:
        return response.json({"status": "draining"}, status=503)
    if srv.ready and srv.scheduler.stuck:
        return response.json({"status": "stuck", "reason": srv.scheduler.stuck}, status=503)
    if srv.ready:
        return response.json({"status": "ok"})
    dead = srv.load_error or (srv.scheduler.dead if srv.scheduler else None)
    return response.json({"status": "dead" if dead else "loading"}, status=503)


@api.post("/tokenize", stream=True)
async def tokenize(request: Request) -> Any:
    srv = _server(request)
    _check_ready(srv)
    body = await _json_object(request)
    _check_model(srv, body)
    # Rendering and tokenizing are request work: off the event loop, which serves everyone.
    return response.json(await asyncio.get_running_loop().run_in_executor(None, _tokenize, srv, body))


def _tokenize(srv: Server, body: dict[str, Any]) -> dict[str, Any]:
    check_tokenize(body)
    tok = srv.model.tokenizer
    if "messages" in body:
        from jaxllm.chat_template import ChatTemplateError, tokenize_chat

        lim = srv.settings.current.limits
        check_sizes(body["messages"], None, None, max_messages=lim.max_messages,
                    max_tools=lim.max_tools, max_schema_bytes=lim.max_schema_bytes)
        try:
            ids = tokenize_chat(tok, body["messages"],
                                add_generation_prompt=bool(body.get("add_generation_prompt", True))).ids
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


@api.post("/detokenize", stream=True)
async def detokenize(request: Request) -> Any:
    srv = _server(request)
    _check_ready(srv)
    body = await _json_object(request)
    _check_model(srv, body)
    ids = body.get("tokens")
    vocab = srv.model.cfg.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
    text = await asyncio.get_running_loop().run_in_executor(
        None, lambda: srv.model.tokenizer.decode(ids, skip_special_tokens=False))
    return response.json({"prompt": text})


@api.get("/metrics")
async def metrics(request: Request) -> Any:
    return response.raw(_server(request).metrics.text(), content_type="text/plain; version=0.0.4; charset=utf-8")


@api.get("/v1/state")
async def state(request: Request) -> Any:
    srv = _server(request)
    # The worker's snapshot plus what the model costs per token (for MBU / MFU figures). A
    # session id is a bearer secret: only the caller's own sessions are named.
    snapshot = srv.metrics.state
    key = _caller_key(request)
    active = [{**a, "session": a["session"] if a.get("session") and srv.sessions.owned(a["session"], key) else None}
              for a in snapshot.get("active", [])]
    return response.json({**snapshot, "active": active, "model": {"name": srv.model_name, "costs": srv.costs}})


@api.post("/start_profile")
async def start_profile(request: Request) -> Any:
    """Starts a JAX profiler trace into the server's --profile-dir (vLLM's endpoint name); it
    stops by itself after profile_max_seconds, and none starts while the directory holds
    profile_max_mib or more."""
    srv = _check_profiling(request, running=False)
    lim = srv.settings.current.limits
    loop = asyncio.get_running_loop()
    used = await loop.run_in_executor(None, _dir_bytes, srv.profile_dir)
    if used >= lim.profile_max_mib << 20:
        raise ApiError(409, f"the profile directory holds {used >> 20} MiB, at profile_max_mib ({lim.profile_max_mib}); "
                            "remove old traces first", type="invalid_request_error", code="profile_dir_full")
    import jax

    srv.profiling = True  # before the await: a second start meanwhile is a 409
    try:
        await loop.run_in_executor(None, jax.profiler.start_trace, srv.profile_dir)
    except Exception as e:  # noqa: BLE001 - e.g. a trace started by other means
        srv.profiling = False
        raise ApiError(500, f"the profiler did not start: {e}") from None
    srv.profile_timer = loop.call_later(lim.profile_max_seconds, lambda: asyncio.ensure_future(_end_profile(srv, "timed out")))
    log.info("profiler trace started into %s (stops after %gs)", srv.profile_dir, lim.profile_max_seconds)
    return response.json({"status": "profiling", "dir": srv.profile_dir, "max_seconds": lim.profile_max_seconds})


@api.post("/stop_profile")
async def stop_profile(request: Request) -> Any:
    """Stops the trace and writes it (TensorBoard / Perfetto readable) under --profile-dir."""
    srv = _check_profiling(request, running=True)
    try:
        await _end_profile(srv, "stopped")
    except Exception as e:  # noqa: BLE001
        raise ApiError(500, f"the profiler trace was not written: {e}") from None
    return response.json({"status": "written", "dir": srv.profile_dir})


async def _end_profile(srv: Server, why: str) -> None:
    """Stops a running trace (by request or by its time limit) and writes it."""
    if not srv.profiling:
        return
    import jax

    srv.profiling = False
    if srv.profile_timer is not None:
        srv.profile_timer.cancel()
        srv.profile_timer = None
    await asyncio.get_running_loop().run_in_executor(None, jax.profiler.stop_trace)
    log.info("profiler trace %s, written under %s", why, srv.profile_dir)


def _dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).exists() else 0


def _check_profiling(request: Request, *, running: bool) -> Server:
    srv = _server(request)
    if srv.profile_dir is None:
        raise ApiError(400, "profiling is off: start the server with --profile-dir DIR")
    if not srv.api_keys:
        # A trace slows every request and writes to the server's disk: not for anonymous callers.
        raise ApiError(403, "profiling needs a server started with an API key (--api-key or --api-key-file)",
                       type="permission_error", code="profiling_needs_api_key")
    if srv.profiling != running:
        raise ApiError(409 if srv.profiling else 400,
                       "a profile is already running" if srv.profiling else "no profile is running",
                       type="invalid_request_error")
    return srv


@api.post("/v1/settings/reload")
async def reload_settings(request: Request) -> Any:
    srv = _server(request)
    try:
        result = srv.settings.reload()
    except (OSError, ValueError) as e:
        raise ApiError(400, f"settings reload failed: {e}") from None
    log.info("settings reloaded: %s", result)
    return response.json(result)


def _reload_on_signal(srv: Server) -> None:
    """SIGHUP: reload like /v1/settings/reload; a refused file keeps the settings in force."""
    try:
        log.info("SIGHUP: settings reloaded: %s", srv.settings.reload())
    except (OSError, ValueError) as e:
        log.error("SIGHUP: settings reload refused (the settings in force stay): %s", e)


@api.get("/v1/sessions/<session_id:str>")
async def get_session(request: Request, session_id: str) -> Any:
    srv = _server(request)
    s = srv.sessions.get(session_id, _caller_key(request))
    if s is None:
        raise ApiError(404, f"session '{session_id}' does not exist", code="session_not_found")
    return response.json(s.public())


@api.delete("/v1/sessions/<session_id:str>")
async def delete_session(request: Request, session_id: str) -> Any:
    srv = _server(request)
    if not srv.sessions.delete(session_id, _caller_key(request)):
        raise ApiError(404, f"session '{session_id}' does not exist", code="session_not_found")
    return response.json({"id": session_id, "object": "session.deleted", "deleted": True})


_OPEN_PATHS = {"/health", "/metrics", "/openapi.json"}


async def _drain(srv: Server, seconds: float) -> None:
    """Waits until no generation request is in flight, or `seconds` passed."""
    deadline = time.monotonic() + seconds
    if srv.in_flight:
        log.info("draining %d in-flight request(s) for up to %gs", srv.in_flight, seconds)
    while srv.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if srv.in_flight:
        log.warning("drain timed out with %d request(s) in flight; they get 503", srv.in_flight)


def _caller_key(request: Request) -> str | None:
    """The API key the request authenticated with (None when the server has none): sessions
    belong to it."""
    return getattr(request.ctx, "api_key", None)


def create_app(settings: SettingsStore, *, loader: Callable[[], Any], model_name: str, api_key: str | None = None,
               api_keys: Iterable[str] = (),
               warmup: bool = True, on_death: Callable[[BaseException], None] | None = None,
               profile_dir: str | None = None) -> Sanic:
    """Builds the Sanic app; `loader()` returns a `jaxllm.api.Model` (called off the loop)."""
    app = Sanic(f"jaxllm_{next(_app_ids)}")
    lim = settings.current.limits
    app.config.REQUEST_MAX_SIZE = lim.request_bytes
    app.config.RESPONSE_TIMEOUT = 7 * 24 * 3600  # long generations are not cut
    # Headers and bodies each get body_seconds in all (see CappedHttpProtocol and _read_body).
    app.config.REQUEST_TIMEOUT = lim.body_seconds
    app.config.KEEP_ALIVE_TIMEOUT = 75
    app.config.NOISY_EXCEPTIONS = False
    app.config.GRACEFUL_SHUTDOWN_TIMEOUT = 5.0  # after the drain: responses are sent by then
    keys = frozenset(k for k in (api_key, *api_keys) if k)
    srv = Server(settings, loader, model_name, keys, warmup, on_death, profile_dir)
    app.ctx.server = srv
    app.blueprint(api)
    app.blueprint(docs)

    @app.on_request
    async def authenticate(request: Request) -> Any:
        # Runs on the headers: the body routes stream, so nothing of the body is read before this.
        request.ctx.api_key = None
        if not srv.api_keys:
            return None
        key = srv.key_of(request.headers.get("authorization", ""))
        if key is None and request.path not in _OPEN_PATHS:
            srv.metrics.count_http_error(401)
            return error_response(ApiError(401, "missing or wrong API key", code="invalid_api_key"))
        request.ctx.api_key = key
        return None

    @app.exception(ApiError)
    async def api_error(request: Request, e: ApiError) -> Any:
        srv.metrics.count_http_error(e.status)
        return error_response(e)

    @app.exception(PayloadTooLarge)
    async def too_large(request: Request, e: Exception) -> Any:
        srv.metrics.count_http_error(413)
        return error_response(ApiError(413, f"the request body is over request_bytes ({srv.settings.current.limits.request_bytes})"))

    @app.exception(NotFound)
    async def not_found(request: Request, e: Exception) -> Any:
        return error_response(ApiError(404, f"no route {request.method} {request.path}"))

    @app.exception(SanicException)
    async def sanic_error(request: Request, e: SanicException) -> Any:
        status = getattr(e, "status_code", 500) or 500
        return error_response(ApiError(status, str(e)))

    @app.exception(Exception)
    async def unexpected(request: Request, e: Exception) -> Any:
        # A bug, not the client's fault; still the OpenAI error shape, and the trace in the log.
        log.error("%s %s: unexpected %s: %s", request.method, request.path, type(e).__name__, e, exc_info=e)
        srv.metrics.count_http_error(500)
        return error_response(ApiError(500, f"internal error ({type(e).__name__})"))

    @app.after_server_start
    async def start(app: Sanic) -> None:
        loop = asyncio.get_running_loop()
        threading.Thread(target=srv.load, args=(loop,), name="jaxllm-load", daemon=True).start()
        try:
            loop.add_signal_handler(signal.SIGHUP, lambda: _reload_on_signal(srv))
        except (NotImplementedError, RuntimeError, ValueError):
            pass

    @app.before_server_stop
    async def stop(app: Sanic) -> None:
        # SIGTERM / SIGINT: refuse new work, let what runs finish (bounded), then stop the worker,
        # which fails whatever is left with 503.
        srv.draining = True
        await _drain(srv, srv.settings.current.limits.drain_seconds)
        if srv.scheduler is not None:
            await asyncio.get_running_loop().run_in_executor(None, srv.scheduler.stop)

    return app
