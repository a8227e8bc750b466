"""docs/architecture.md names what exists: each file it mentions, and each `file:function` hop
of the request-path table (a bare `name` after `→` is in the same file and class as the hop
before it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
# Paths are written from the repository root or from inside a package.
BASES = [ROOT, ROOT / "jaxllm", ROOT / "serving", ROOT / "serving" / "routes", ROOT / "docs"]


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start : end if end != -1 else None]


def _find(tree: ast.AST, path: list[str]) -> bool:
    """`path` (e.g. Scheduler, _start or create_app, authenticate) names a def or class, each
    part inside the one before it (nested functions included)."""
    nodes: list[ast.AST] = [tree]
    for name in path:
        found = []
        for scope in nodes:
            body = (
                ast.walk(scope)
                if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef)
                else ast.iter_child_nodes(scope)
            )
            found += [
                n
                for n in body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == name
            ]
        if not found:
            return False
        nodes = found
    return True


def hops() -> list[tuple[str, list[str]]]:
    """(file, qualified name) of every hop in the table."""
    table = _section(DOC.read_text(), "### A request's way, hop by hop")
    out = []
    for row in table.splitlines():
        if not re.match(r"\| \d+\w? \|", row):
            continue
        where = row.split("|")[2]
        file, parent = None, []
        for token in re.findall(r"`([^`]+)`", where):
            if ":" in token:
                file, qual = token.split(":", 1)
                parts = qual.split(".")
            else:
                assert file is not None, f"a bare name before any file: {row}"
                parts = [*parent, token]
            out.append((file, parts))
            parent = parts[:-1]
    return out


def test_the_table_is_found():
    names = [f"{f}:{'.'.join(p)}" for f, p in hops()]
    assert len(names) >= 18 and "serving/scheduler.py:Scheduler._add_sequence" in names
    assert "serving/admission.py:never_fits" in names and "serving/app.py:create_app.authenticate" in names


def test_every_hop_exists():
    missing = []
    for file, parts in hops():
        path = ROOT / file
        if not path.is_file() or not _find(ast.parse(path.read_text()), parts):
            missing.append(f"{file}:{'.'.join(parts)}")
    assert not missing


def test_a_missing_hop_is_caught():
    tree = ast.parse((ROOT / "serving/scheduler.py").read_text())
    assert _find(tree, ["Scheduler", "_start"]) and not _find(tree, ["Scheduler", "_no_such_hop"])
    assert not _find(tree, ["_start"])  # a method is not a module-level function


def test_every_file_named_exists():
    text = DOC.read_text()
    named = set(re.findall(r"`([\w./-]+\.(?:py|cc|h|md|toml|sh))(?::[\w.]+)?`", text))
    named |= set(re.findall(r"\]\(([\w./-]+\.md)\)", text))
    assert named, "the pattern no longer finds file names"
    missing = [n for n in sorted(named) if not any((base / n.removeprefix("../")).exists() for base in BASES)]
    missing = [n for n in missing if not n.startswith("../shared/")]  # outside the repository
    assert not missing
