"""Session routes: read or delete a session the caller's key owns."""

from __future__ import annotations

from typing import Any

from sanic import Blueprint, Request, response

from serving.errors import ApiError
from serving.routes.common import caller_key, server_of

bp = Blueprint("sessions")


@bp.get("/v1/sessions/<session_id:str>")
async def get_session(request: Request, session_id: str) -> Any:
    srv = server_of(request)
    s = srv.sessions.get(session_id, caller_key(request))
    if s is None:
        raise ApiError(404, f"session '{session_id}' does not exist", code="session_not_found")
    return response.json(s.public())


@bp.delete("/v1/sessions/<session_id:str>")
async def delete_session(request: Request, session_id: str) -> Any:
    srv = server_of(request)
    if not srv.sessions.delete(session_id, caller_key(request)):
        raise ApiError(404, f"session '{session_id}' does not exist", code="session_not_found")
    return response.json({"id": session_id, "object": "session.deleted", "deleted": True})
