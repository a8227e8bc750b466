"""The OpenAPI document (serving/openapi.py) covers what the app serves and what the
parsers read, so it cannot drift from them unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import schemathesis

from serving.app import create_app
from serving.openapi import document
from serving.settings import Settings, SettingsStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def app():
    app = create_app(SettingsStore(Settings()), loader=lambda: None, model_name="tiny")
    app.router.finalize()
    return app


def _openapi_path(sanic_path: str) -> str:
    return "/" + re.sub(r"<(\w+)(:\w+)?>", r"{\1}", sanic_path.lstrip("/"))


def test_every_registered_route_is_documented(app):
    doc = document()
    registered = {(m.lower(), _openapi_path(r.path)) for r in app.router.routes for m in r.methods}
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert registered - documented == set(), "routes the app serves without documenting them"
    assert documented - registered == set(), "documented routes the app does not serve"


def _fields_read(source: str) -> set[str]:
    """Body fields the parsers read: body.get("x"), body["x"], _get(body, "x" ...), _number(body, "x" ...)."""
    pattern = r'(?:body\.get\(|body\[|_get\(body, |_number\(body, |_optional\(body, )"(\w+)"'
    return set(re.findall(pattern, source))


def test_every_body_field_the_parsers_read_is_in_the_schemas():
    schemas = document()["components"]["schemas"]
    chat = set(schemas["ChatCompletionRequest"]["properties"])
    completion = set(schemas["CompletionRequest"]["properties"])
    tokenize = set(schemas["TokenizeRequest"]["properties"])
    read = set()
    for name in ("protocol.py", "validation.py", "app.py"):
        read |= _fields_read((ROOT / "serving" / name).read_text())
    assert read, "the pattern no longer finds the parsers' reads"
    assert read - (chat | completion | tokenize | {"tokens"}) == set()
    # Fields only one endpoint has stay in its schema alone.
    assert "messages" in chat and "prompt" in completion and "echo" in completion and "tools" in chat


def test_the_document_loads_as_openapi():
    schema = schemathesis.openapi.from_dict(document())
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) == sum(len(ops) for ops in document()["paths"].values())
