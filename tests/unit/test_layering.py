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
