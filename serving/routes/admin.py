"""Operator routes: health, Prometheus metrics, the worker's state snapshot, profiler traces
and settings reloads."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from sanic import Blueprint, Request, response

from serving.errors import ApiError
from serving.routes.common import caller_key, server_of
from serving.server_state import Server

log = logging.getLogger("jaxllm.serve")
bp = Blueprint("admin")


@bp.get("/health")
async def health(request: Request) -> Any:
    srv = server_of(request)
    if srv.draining:
        return response.json({"status": "draining"}, status=503)
    if srv.ready and srv.scheduler.stuck:
        return response.json({"status": "stuck", "reason": srv.scheduler.stuck}, status=503)
    if srv.ready:
        return response.json({"status": "ok"})
    dead = srv.load_error or (srv.scheduler.dead if srv.scheduler else None)
    if dead:
        return response.json({"status": "dead"}, status=503)
    body: dict[str, Any] = {"status": "loading" if srv.engine is None else "warming_up"}
    if srv.warmup_total:
        body["warmup"] = {"compiled": srv.warmup_done, "total": srv.warmup_total}
    return response.json(body, status=503)


@bp.get("/metrics")
async def metrics(request: Request) -> Any:
    return response.raw(server_of(request).metrics.text(), content_type="text/plain; version=0.0.4; charset=utf-8")


@bp.get("/v1/state")
async def state(request: Request) -> Any:
    srv = server_of(request)
    # The worker's snapshot plus what the model costs per token (for MBU / MFU figures). A
    # session id is a bearer secret: only the caller's own sessions are named.
    snapshot = srv.metrics.state
    key = caller_key(request)
    active = [
        {**a, "session": a["session"] if a.get("session") and srv.sessions.owned(a["session"], key) else None}
        for a in snapshot.get("active", [])
    ]
    return response.json({**snapshot, "active": active, "model": {"name": srv.model_name, "costs": srv.costs}})


@bp.post("/start_profile")
async def start_profile(request: Request) -> Any:
    """Starts a JAX profiler trace into the server's --profile-dir (vLLM's endpoint name); it
    stops by itself after profile_max_seconds, and none starts while the directory holds
    profile_max_mib or more."""
    srv = _check_profiling(request, running=False)
    lim = srv.settings.current.limits
    loop = asyncio.get_running_loop()
    used = await loop.run_in_executor(None, _dir_bytes, srv.profile_dir)
    if used >= lim.profile_max_mib << 20:
        raise ApiError(
            409,
            f"the profile directory holds {used >> 20} MiB, at profile_max_mib ({lim.profile_max_mib}); "
            "remove old traces first",
            type="invalid_request_error",
            code="profile_dir_full",
        )
    import jax

    srv.profiling = True  # before the await: a second start meanwhile is a 409
    try:
        await loop.run_in_executor(None, jax.profiler.start_trace, srv.profile_dir)
    except Exception as e:  # noqa: BLE001 - e.g. a trace started by other means
        srv.profiling = False
        raise ApiError(500, f"the profiler did not start: {e}") from None
    srv.profile_timer = loop.call_later(
        lim.profile_max_seconds, lambda: asyncio.ensure_future(_end_profile(srv, "timed out"))
    )
    log.info("profiler trace started into %s (stops after %gs)", srv.profile_dir, lim.profile_max_seconds)
    return response.json({"status": "profiling", "dir": srv.profile_dir, "max_seconds": lim.profile_max_seconds})


@bp.post("/stop_profile")
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
    srv = server_of(request)
    if srv.profile_dir is None:
        raise ApiError(400, "profiling is off: start the server with --profile-dir DIR")
    if not srv.api_keys:
        # A trace slows every request and writes to the server's disk: not for anonymous callers.
        raise ApiError(
            403,
            "profiling needs a server started with an API key (--api-key or --api-key-file)",
            type="permission_error",
            code="profiling_needs_api_key",
        )
    if srv.profiling != running:
        raise ApiError(
            409 if srv.profiling else 400,
            "a profile is already running" if srv.profiling else "no profile is running",
            type="invalid_request_error",
        )
    return srv


@bp.post("/v1/settings/reload")
async def reload_settings(request: Request) -> Any:
    srv = server_of(request)
    try:
        result = srv.settings.reload()
    except (OSError, ValueError) as e:
        raise ApiError(400, f"settings reload failed: {e}") from None
    log.info("settings reloaded: %s", result)
    return response.json(result)


def reload_on_signal(srv: Server) -> None:
    """SIGHUP: reload like /v1/settings/reload; a refused file keeps the settings in force."""
    try:
        log.info("SIGHUP: settings reloaded: %s", srv.settings.reload())
    except (OSError, ValueError) as e:
        log.error("SIGHUP: settings reload refused (the settings in force stay): %s", e)
