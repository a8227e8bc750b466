"""The Sanic app: the routes (`serving/routes/`) over the server state, with authentication,
error answers, a connection cap and the start / drain lifecycle.

`create_app(settings, ...)` builds the app; the model loads and every shape bucket compiles
on the worker thread started after the server starts, and `/health` answers 503 until then.
Handlers never touch the engine: they parse and tokenize (in an executor, off the event
loop), hand a `Job` to the scheduler and relay its frames.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from sanic import Request, Sanic
from sanic.exceptions import NotFound, PayloadTooLarge, SanicException
from sanic.http import Stage
from sanic.server.protocols.http_protocol import HttpProtocol

from serving.errors import ApiError
from serving.openapi import docs
from serving.routes import admin, openai_api, sessions
from serving.routes.common import error_response
from serving.server_state import Server
from serving.settings import SettingsStore

log = logging.getLogger("jaxllm.serve")
_app_ids = itertools.count()


class CappedHttpProtocol(HttpProtocol):
    """Sanic's protocol with a cap on open connections (limits.max_connections): one more is
    answered 503 and closed at once, before it can hold a buffer or a task."""

    _REFUSAL = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"x-should-retry: true\r\ncontent-length: %d\r\n\r\n%s"
    )

    __slots__ = ("_refused",)  # Sanic's protocols use slots

    def connection_made(self, transport: Any) -> None:
        cap = self.app.ctx.server.settings.current.limits.max_connections
        self._refused = False
        if self.connections is not None and len(self.connections) >= cap:
            body = json.dumps(
                ApiError(
                    503, f"the server has max_connections ({cap}) open connections", code="too_many_connections"
                ).body()
            ).encode()
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


def create_app(
    settings: SettingsStore,
    *,
    loader: Callable[[], Any],
    model_name: str,
    api_key: str | None = None,
    api_keys: Iterable[str] = (),
    warmup: bool = True,
    on_death: Callable[[BaseException], None] | None = None,
    profile_dir: str | None = None,
) -> Sanic:
    """Builds the Sanic app; `loader()` returns a `jaxllm.api.Model` (called off the loop)."""
    # Sanic's own handlers would print each of its lines a second time beside the root logger's.
    app = Sanic(f"jaxllm_{next(_app_ids)}", configure_logging=False)
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
    for routes in (openai_api.bp, admin.bp, sessions.bp, docs):
        app.blueprint(routes)

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
        return error_response(
            ApiError(413, f"the request body is over request_bytes ({srv.settings.current.limits.request_bytes})")
        )

    @app.exception(NotFound)
    async def not_found(request: Request, e: Exception) -> Any:
        srv.metrics.count_http_error(404)
        return error_response(ApiError(404, f"no route {request.method} {request.path}"))

    @app.exception(SanicException)
    async def sanic_error(request: Request, e: SanicException) -> Any:
        status = getattr(e, "status_code", 500) or 500
        srv.metrics.count_http_error(status)  # 405 (a known path, another method) among them
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
            loop.add_signal_handler(signal.SIGHUP, lambda: admin.reload_on_signal(srv))
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
        log.info("sessions: %d saved", srv.sessions.persist())  # no-op without [limits] session_dir

    return app
