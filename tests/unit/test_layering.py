"""The dependency rules of docs/architecture.md, enforced on the source."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

FORBIDDEN = {
    "controller": {"resilient_rl", "torch", "vllm", "ray", "transformers", "torchsnapshot"},
    "checkpoints": {"resilient_rl", "vllm", "ray"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_layers_do_not_import_upward_or_heavy() -> None:
    violations = []
    for package, banned in FORBIDDEN.items():
        files = sorted((REPO / package).rglob("*.py"))
        assert files, f"{package}/ has no modules"
        for f in files:
            bad = _imports(f) & banned
            if bad:
                violations.append(f"{f.relative_to(REPO)} imports {sorted(bad)}")
    assert violations == []


def test_checker_sees_a_violation(tmp_path: Path) -> None:
    """The scan itself works: a file importing the banned modules is caught."""
    f = tmp_path / "m.py"
    f.write_text("import torch.nn\nfrom resilient_rl.spec import JobSpec\nfrom . import keys\n")
    assert _imports(f) == {"torch", "resilient_rl"}


def _graph() -> dict[str, set[str]]:
    """Module -> product modules it imports (function-level imports included; TYPE_CHECKING ones not)."""
    mods: dict[str, Path] = {}
    for root in ("controller", "checkpoints", "resilient_rl"):
        for p in (REPO / root).rglob("*.py"):
            name = ".".join(p.relative_to(REPO).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = p
    graph: dict[str, set[str]] = {}
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        hidden = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n.test)
                  for x in ast.walk(n)}  # fmt: skip
        deps: set[str] = set()
        for n in ast.walk(tree):
            if id(n) in hidden or not isinstance(n, ast.Import | ast.ImportFrom):
                continue
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            else:
                base = m.split(".")
                if n.level:
                    base = base[: len(base) - n.level + (1 if p.name == "__init__.py" else 0)]
                    pre = ".".join(base + ([n.module] if n.module else []))
                else:
                    pre = n.module or ""
                names = [pre] + [f"{pre}.{a.name}" for a in n.names]
            for t in names:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m and not m.startswith(t + "."):
                    deps.add(t)
        graph[m] = deps
    return graph


def test_no_import_cycle_anywhere_in_the_product() -> None:
    graph = _graph()
    assert len(graph) > 40 and "controller.watch" in graph["controller.store"]  # the scan sees imports
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append([*path[path.index(d) :], d])
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_workers_and_algo_never_import_the_driver() -> None:
    """The driver (job/, in the controller) calls the workers; never the other way round."""
    graph = _graph()
    assert {"resilient_rl.job.runner", "resilient_rl.workers.trainer", "resilient_rl.algo.grpo"} <= set(graph)
    assert "resilient_rl.workers.trainer" in graph["resilient_rl.job.actors"]  # the scan sees the driver's own uses
    bad = sorted(
        f"{m} imports {d}"
        for m, deps in graph.items()
        if m.startswith(("resilient_rl.workers", "resilient_rl.algo"))
        for d in deps
        if d.startswith("resilient_rl.job")
    )
    assert bad == []


def test_the_driver_loads_no_torch_vllm_or_transformers() -> None:
    """Importing every module of job/ (as the controller does) must not load the heavy
    libraries: they are imported inside the worker actors. Checked in a fresh interpreter."""
    import subprocess
    import sys

    mods = sorted(
        ".".join(p.relative_to(REPO).with_suffix("").parts) for p in (REPO / "resilient_rl" / "job").glob("*.py")
    )
    assert "resilient_rl.job.runner" in mods
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "print(sorted(h for h in ('torch', 'vllm', 'transformers', 'ray') if h in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
