"""The OpenAPI 3.1 document of the server, served at `/openapi.json`.

The request bodies are built from the field lists `serving/validation.py` checks
(`FLOAT_FIELDS`, `INT_FIELDS`, `BOOL_FIELDS`, `ROLES`, the integer range), so a field added
there appears here; tests check that every route the app registers and every body field the
parsers read is documented. The schemas say the types and the ranges that do not depend on
the model or the settings; a value the loaded model or the limits refuse is a 400 with the
OpenAI error body, which every operation documents as its error response.
"""

from __future__ import annotations

from typing import Any

from sanic import Blueprint, Request, response

from serving.validation import BOOL_FIELDS, FLOAT_FIELDS, INT_FIELDS, INT_MAX, INT_MIN, ROLES

OPENAPI_VERSION = "3.1.0"

# Fields that mean the same in both completion bodies, beyond the scalar lists of validation.py.
_STOP = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16},
        {"type": "null"},
    ]
}
_NULLABLE_STRING = {"type": ["string", "null"]}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _scalars() -> dict[str, Any]:
    """The sampling and output fields validation.check_scalars checks, by their lists there."""
    props: dict[str, Any] = {}
    for name in FLOAT_FIELDS:
        props[name] = _nullable({"type": "number"})
    for name in INT_FIELDS:
        props[name] = _nullable({"type": "integer", "minimum": INT_MIN, "maximum": INT_MAX})
    for name in BOOL_FIELDS:
        props[name] = _nullable({"type": "boolean"})
    props["model"] = _NULLABLE_STRING
    props["user"] = _NULLABLE_STRING
    props["logit_bias"] = _nullable(
        {"type": "object", "propertyNames": {"pattern": "^-?[0-9]+$"}, "additionalProperties": {"type": "number"}}
    )
    props["stop_token_ids"] = _nullable({"type": "array", "items": {"type": "integer"}})
    props["stream_options"] = _nullable({"type": "object", "properties": {"include_usage": {"type": "boolean"}}})
    props["stop"] = _STOP
    # DRY's sequence breakers (the research samplers), strings as llama.cpp's server takes them.
    props["dry_sequence_breakers"] = _nullable({"type": "array", "items": {"type": "string"}, "maxItems": 32})
    props["drafts"] = _nullable(
        {"type": "integer", "minimum": 0, "description": "speculative drafts per step (up to the server's max_drafts)"}
    )
    return props


_FUNCTION = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "parameters": {"type": "object"},
    },
}
_TOOL = {
    "type": "object",
    "required": ["function"],
    "properties": {"type": {"const": "function"}, "function": _FUNCTION},
}
_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "arguments": {"anyOf": [{"type": "string"}, {"type": "object"}]},
            },
        },
    },
}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": _TOOL_CALL},
    },
}
_RESPONSE_FORMAT = {
    "type": "object",
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}},
        },
    },
}


def chat_request() -> dict[str, Any]:
    props = _scalars()
    props.update(
        messages={"type": "array", "items": _MESSAGE, "minItems": 1},
        tools=_nullable({"type": "array", "items": _TOOL}),
        tool_choice={
            "anyOf": [
                {"enum": ["auto", "none", "required"]},
                {
                    "type": "object",
                    "required": ["function"],
                    "properties": {
                        "type": {"const": "function"},
                        "function": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"name": {"type": "string"}},
                        },
                    },
                },
                {"type": "null"},
            ]
        },
        response_format=_nullable(_RESPONSE_FORMAT),
        logprobs=_nullable({"type": "boolean"}),
        session={
            "anyOf": [{"type": "boolean"}, {"type": "string"}, {"type": "null"}],
            "description": 'true or "new" opens a server-side session; a session id continues it',
        },
    )
    return {"type": "object", "required": ["messages"], "properties": props}


def completion_request() -> dict[str, Any]:
    props = _scalars()
    props.update(
        prompt={
            "anyOf": [
                {"type": "string"},
                {**_TOKEN_IDS, "minItems": 1},
                {"type": "array", "items": {"anyOf": [{"type": "string"}, _TOKEN_IDS]}, "minItems": 1, "maxItems": 1},
            ]
        },
        logprobs=_nullable({"type": "integer", "minimum": 0}),
    )
    return {"type": "object", "required": ["prompt"], "properties": props}


def tokenize_request() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "model": _NULLABLE_STRING,
            "prompt": {"type": "string"},
            "messages": {"type": "array", "items": _MESSAGE},
            "add_generation_prompt": {"type": "boolean"},
            "add_special_tokens": {"type": "boolean"},
            "return_token_strs": {"type": "boolean"},
        },
    }


_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _NULLABLE_STRING,
                "code": _NULLABLE_STRING,
            },
        }
    },
}
_OBJECT = {"type": "object"}
_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
    },
}
_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": _OBJECT},
        "usage": _USAGE,
    },
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _operation(
    summary: str,
    ok: dict[str, Any],
    body: dict[str, Any] | None = None,
    *,
    stream: bool = False,
    ok_type: str = "application/json",
) -> dict[str, Any]:
    content = {ok_type: {"schema": ok}}
    if stream:  # "stream": true answers server-sent events
        content["text/event-stream"] = {"schema": {"type": "string"}}
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": content},
            "default": {
                "description": "an error, in OpenAI's shape",
                "content": _json({"$ref": "#/components/schemas/Error"}),
            },
        },
    }
    if body is not None:
        op["requestBody"] = {"required": True, "content": _json(body)}
    return op


def document(*, model_name: str | None = None) -> dict[str, Any]:
    """The OpenAPI document (a fresh dict each call)."""
    session_param = [{"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    paths: dict[str, dict[str, Any]] = {
        "/v1/chat/completions": {
            "post": _operation(
                "Chat completion (OpenAI)",
                _COMPLETION,
                {"$ref": "#/components/schemas/ChatCompletionRequest"},
                stream=True,
            )
        },
        "/v1/completions": {
            "post": _operation(
                "Text completion (OpenAI)", _COMPLETION, {"$ref": "#/components/schemas/CompletionRequest"}, stream=True
            )
        },
        "/v1/models": {"get": _operation("The served model", {"type": "object", "required": ["object", "data"]})},
        "/health": {
            "get": _operation(
                "200 once the model is loaded and warm; 503 while loading, draining or stuck",
                {"type": "object", "required": ["status"]},
            )
        },
        "/tokenize": {
            "post": _operation(
                "Token ids of a prompt or of rendered messages",
                {"type": "object", "required": ["count", "tokens"]},
                {"$ref": "#/components/schemas/TokenizeRequest"},
            )
        },
        "/detokenize": {
            "post": _operation(
                "Text of token ids",
                {"type": "object", "required": ["prompt"]},
                {
                    "type": "object",
                    "required": ["tokens"],
                    "properties": {"model": _NULLABLE_STRING, "tokens": _TOKEN_IDS},
                },
            )
        },
        "/metrics": {"get": _operation("Prometheus metrics", {"type": "string"}, ok_type="text/plain")},
        "/v1/state": {"get": _operation("The worker's snapshot: requests, reservations, pages, caches", _OBJECT)},
        "/start_profile": {
            "post": _operation("Starts a JAX profiler trace (needs --profile-dir and an API key)", _OBJECT)
        },
        "/stop_profile": {"post": _operation("Stops and writes the profiler trace", _OBJECT)},
        "/v1/settings/reload": {"post": _operation("Reloads the settings file", _OBJECT)},
        "/v1/sessions/{session_id}": {
            "get": {**_operation("A session of the caller", _OBJECT), "parameters": session_param},
            "delete": {**_operation("Deletes a session of the caller", _OBJECT), "parameters": session_param},
        },
        "/openapi.json": {"get": _operation("This document", _OBJECT)},
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "jaxllm",
            "version": "0.1.0",
            "description": "OpenAI-compatible server" + (f" for model '{model_name}'" if model_name else ""),
        },
        "paths": paths,
        "components": {
            "schemas": {
                "ChatCompletionRequest": chat_request(),
                "CompletionRequest": completion_request(),
                "TokenizeRequest": tokenize_request(),
                "Error": _ERROR,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        # Needed only when the server has API keys; /health, /metrics and this document are open.
        "security": [{"bearer": []}, {}],
    }


docs = Blueprint("openapi")


@docs.get("/openapi.json")
async def openapi_json(request: Request) -> response.HTTPResponse:
    return response.json(document(model_name=request.app.ctx.server.model_name))
