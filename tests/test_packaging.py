"""The command line a newcomer meets: what `jaxllm` imports, prints and reads."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm.model.kernel_choice import debug_overrides
from serving import cli

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, cwd: Path) -> str:
    env = {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_serve_imports_no_benchmark_client(tmp_path):
    """`jaxllm serve`'s modules load neither the load-testing client nor its HTTP library."""
    out = _run(
        "import sys, serving.app, serving.cli\n"
        "serving.cli.build_parser().parse_args(['serve'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('httpx', 'httpx2', 'benchmarks', 'openai')))",
        tmp_path,
    )
    assert out.strip() == "[]"


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("jaxllm ")


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 8000)" in text and "(default: float32)" in text


def test_help_never_shows_the_api_key(capsys, monkeypatch):
    monkeypatch.setenv("JAXLLM_API_KEY", "secret-key")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    assert "secret-key" not in capsys.readouterr().out


def test_settings_found_outside_the_repository(tmp_path):
    """Started elsewhere, serve reads the source tree's configs/server.toml, not built-in settings."""
    out = _run("import serving.cli; print(serving.cli.default_settings_path())", tmp_path)
    assert Path(out.strip()) == ROOT / "configs" / "server.toml"


def test_debug_hook_for_kernel_choices():
    assert debug_overrides("") == {}
    assert debug_overrides("decode_attention=reference, decode_matmul=xla") == {
        "decode_attention": "reference",
        "decode_matmul": "xla",
    }
    with pytest.raises(ValueError, match="JAXLLM_DEBUG_KERNELS"):
        debug_overrides("page_size=8")
    # The same hook turns the test-only faults on (serving/faults.py); no kernel choice changes.
    assert debug_overrides("faults=on, decode_matmul=xla") == {"decode_matmul": "xla"}


def _imports() -> dict[str, set[str]]:
    """Module -> the project modules it imports, at the top or lazily inside functions."""
    files = {}
    for package in ("jaxllm", "serving", "benchmarks"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            files[name] = path
    edges = {}
    for name, path in files.items():
        edges[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def test_no_import_cycles_and_one_direction_between_packages():
    edges = _imports()
    assert not [(a, b) for a in edges for b in edges[a] if a.startswith("jaxllm") and b.split(".")[0] != "jaxllm"]
    assert not [(a, b) for a in edges for b in edges[a] if a.startswith("serving") and b.startswith("benchmarks")]

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges[todo.pop()] - seen:
                if nxt == goal:
                    return True
                seen.add(nxt)
                todo.append(nxt)
        return False

    # Importing a package's __init__ from its own modules is no cycle worth a name.
    cycles = [(a, b) for a in edges for b in edges[a] if "." in b and reaches(b, a) and "." in a]
    assert not cycles


def test_the_worker_modules_never_reach_back_into_the_scheduler():
    """The split hands data across: the modules the worker calls import nothing that imports
    `serving.scheduler`, so none of them can reach back for its classes or methods."""
    edges = _imports()

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    parts = ["admission", "choice_text", "partial_match", "reporting", "pacer", "output", "metrics", "faults"]
    assert not [p for p in parts if "serving.scheduler" in reach(f"serving.{p}")]
    assert "serving.scheduler" in reach("serving.server_state")  # the walk does see a real import


SWEEP_KNOB = re.compile(r"^(?!_)(block_\w+|\w+_per_block|num_warps|num_stages|n_splits|grid_order|config|layout)$")
KERNEL_ENTRY_POINTS = {
    "jaxllm.attention.paged_decode": ["paged_decode_attention", "paged_decode_attention_qkv"],
    "jaxllm.model.moe_kernels": ["moe_ffn"],
    "jaxllm.model.gated_delta_kernel": ["gated_delta_decode"],
    "jaxllm.model.rms_norm_kernel": ["add_rms_norm"],
}


def test_kernel_launch_knobs_are_private():
    """The Pallas kernels' entry points take no launch-sweep parameter by a public name (tile
    sizes, warps, stages, splits, grid order, layout): those are underscored, for tests and
    benchmarks, and the defaults are what users run."""
    import importlib
    import inspect

    public = []
    for module, names in KERNEL_ENTRY_POINTS.items():
        for name in names:
            params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
            public += [f"{module}.{name}({p})" for p in params if SWEEP_KNOB.match(p)]
    assert not public
    assert SWEEP_KNOB.match("num_warps") and SWEEP_KNOB.match("pages_per_block") and not SWEEP_KNOB.match("_num_warps")
