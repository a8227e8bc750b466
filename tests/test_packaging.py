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
        "import sys, serving.app, serving.cli, serving.server_state\n"
        "serving.cli.build_parser().parse_args(['serve'])\n"
        "clients = ('httpx', 'httpx2', 'requests', 'benchmarks', 'openai')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in clients))",
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
    "jaxllm.model.gated_delta_chunk_kernel": ["chunk_state_pass"],
    "jaxllm.model.route_kernel": ["route_and_count"],
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


def test_serve_logs_no_tpu_probe_at_info():
    """JAX logs its failed TPU probe at INFO ("Unable to initialize backend 'tpu'"), which
    reads like an error: `jaxllm serve` keeps that logger to warnings, its own at INFO."""
    import logging

    import jax._src.xla_bridge as xla_bridge

    probe = logging.getLogger(xla_bridge.logger.name)  # the logger JAX's probe really uses
    ours = logging.getLogger("jaxllm")
    before = probe.level, ours.level
    try:
        cli.configure_logging()
        assert not probe.isEnabledFor(logging.INFO) and probe.isEnabledFor(logging.WARNING)
        assert logging.getLogger("jaxllm.serve").isEnabledFor(logging.INFO)
    finally:
        probe.setLevel(before[0])
        ours.setLevel(before[1])


def test_user_output_names_no_project_targets():
    """What users run prints measurements, not the project's goals ("MET / NOT MET")."""
    hits = [
        f"{path.relative_to(ROOT)}:{i}"
        for package in ("jaxllm", "serving", "benchmarks")
        for path in (ROOT / package).rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bNOT MET\b|\bMET\b|\btarget (met|missed)\b", line)
    ]
    assert not hits


def test_no_test_only_switch_on_the_command_line(capsys):
    """Kernel choices and injected faults ride the debug hook (JAXLLM_DEBUG_KERNELS), not flags."""
    texts = []
    for command in ("serve", "generate"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([command, "--help"])
        texts.append(capsys.readouterr().out)
    flags = set(re.findall(r"--[a-z][a-z0-9-]+", " ".join(texts)))
    assert "--port" in flags and "--max-tokens" in flags  # the parse found the options
    assert not [f for f in flags if re.search(r"kernel|fault|debug|interpret|matmul|attention|test", f)]


def _top_imports(package: str) -> set[str]:
    """Third-party top-level modules a package imports (anywhere in its files)."""
    names: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        if package == "tests" and path.parent.name == "fixtures":
            continue  # fixture generators, run by hand against other runtimes (llama-cpp-python)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    local = {"jaxllm", "serving", "tests", "benchmarks"} | {p.stem for p in (ROOT / package).rglob("*.py")}
    return {n for n in names if n not in sys.stdlib_module_names and n not in local}


def test_direct_dependencies_are_declared():
    """Every third-party module the packages import comes from a distribution pyproject.toml
    names: the runtime and server in `dependencies` (jaxllm.research's plotting and frames in
    the research extra), the tests in the test extra, the benchmark clients in the bench extra."""
    import importlib.metadata
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(specs: list[str]) -> set[str]:
        return {re.split(r"[<>=!\[; ]", spec, maxsplit=1)[0].lower().replace("_", "-") for spec in specs}

    deps, extras = names(project["dependencies"]), {k: names(v) for k, v in project["optional-dependencies"].items()}
    dists = importlib.metadata.packages_distributions()
    optional = {"tokamax", "llama_cpp"}  # benchmarks' comparisons, skipped when they do not import
    allowed = {
        "jaxllm": deps | extras["research"],
        "serving": deps,
        "tests": deps | extras["test"],
        "benchmarks": deps | extras["bench"] | extras["test"],
    }
    missing = []
    for package, declared in allowed.items():
        for module in sorted(_top_imports(package) - optional):
            dist = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
            if not dist & declared:
                missing.append(f"{package}: {module} ({', '.join(sorted(dist))})")
    assert not missing
