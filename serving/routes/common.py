"""What every route does with a request: find the server state, check readiness and the
model name, read the body within its limits, name the caller's key, and answer errors."""

from __future__ import annotations

import asyncio
from typing import Any

from sanic import Request, response

from serving.errors import ApiError
from serving.server_state import Server
from serving.validation import parse_json


def error_response(e: ApiError) -> response.HTTPResponse:
    return response.json(e.body(), status=e.status, headers=e.headers)


def server_of(request: Request) -> Server:
    return request.app.ctx.server


def check_ready(srv: Server) -> None:
    if srv.draining:
        raise ApiError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
    if not srv.ready:
        raise ApiError(
            503,
            "the model is loading" if srv.scheduler is None or srv.scheduler.dead is None else "the worker thread died",
            type="service_unavailable",
        )


def check_model(srv: Server, body: Any) -> None:
    name = body.get("model") if isinstance(body, dict) else None
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if name is not None and name != srv.model_name:
        raise ApiError(404, f"the model '{name}' does not exist", code="model_not_found", param="model")


async def read_body(request: Request) -> bytes:
    """Reads the body of a streaming route, after the API key was checked on the headers,
    within request_bytes (413) and body_seconds (408): a client that trickles its body holds
    neither memory nor a connection for long."""
    lim = server_of(request).settings.current.limits
    if request.stream is not None and request.stream.request_body:
        request.stream.request_max_size = lim.request_bytes  # Sanic lifts it for streaming routes
        try:
            await asyncio.wait_for(request.receive_body(), lim.body_seconds)
        except TimeoutError:
            # Close instead of draining the rest of the body: that drain has no deadline.
            request.stream.keep_alive = False
            request.stream.request_body = None
            raise ApiError(
                408,
                f"the request body did not arrive within body_seconds ({lim.body_seconds:g})",
                type="invalid_request_error",
                code="request_timeout",
            ) from None
    return request.body or b""


async def json_object(request: Request) -> dict[str, Any]:
    """The body as strict JSON (no NaN / Infinity), which must be an object; 400 otherwise."""
    body = parse_json(await read_body(request))
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def caller_key(request: Request) -> str | None:
    """The API key the request authenticated with (None when the server has none): sessions
    belong to it."""
    return getattr(request.ctx, "api_key", None)


async def model_request(request: Request) -> tuple[Server, dict[str, Any]]:
    """The server and the body of a request to the model: 503 before the model is ready, then
    the body as a JSON object naming our model (or none)."""
    srv = server_of(request)
    check_ready(srv)
    body = await json_object(request)
    check_model(srv, body)
    return srv, body
