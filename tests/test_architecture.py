"""The house rules a newcomer relies on, checked: import levels, the linter and the type checker, no
imports through strings, and no reference that leaves the repository (docs/design.md §12)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("audit", "spark_jobs")


def _sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


@pytest.mark.unit
def test_import_contract_holds() -> None:
    """`lint-imports` with the contracts in pyproject.toml: each level imports only levels below it (the
    rules' kernel, `audit.rules`, above the oracle it runs; the Spark jobs above both)."""
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


@pytest.mark.unit
def test_every_python_folder_passes_the_linter_and_the_type_checker() -> None:
    """`ruff check` and `mypy`, with their settings in pyproject.toml, over every folder of Python: a
    slip in a test or a benchmark fails the suite, not only the product's code."""
    folders = ["audit", "spark_jobs", "dags", "tests", "benchmarks"]
    for tool, *args in (["ruff", "check"], ["mypy"]):
        proc = subprocess.run([str(Path(sys.executable).parent / tool), *args, *folders], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{tool}:\n" + proc.stdout[-3000:] + proc.stderr[-2000:]


def _string_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            arg = node.args[0] if node.args else None
            target = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ""
            if name in ("import_module", "__import__", "find_spec") and target.split(".")[0] in PACKAGES:
                found.append(f"{name}({target!r}) at line {node.lineno}")
    return found


@pytest.mark.unit
def test_no_module_is_imported_through_a_string() -> None:
    """A project module named in a string escapes the import contract; the CLI imports inside functions
    instead. (Locating an external package, e.g. pyspark's jars, is not an import of ours.)"""
    offenders = {str(p.relative_to(ROOT)): hits for p in _sources(*PACKAGES, "dags")
                 if (hits := _string_imports(ast.parse(p.read_text(encoding="utf-8"))))}
    assert offenders == {}


@pytest.mark.unit
def test_the_string_import_check_can_fail() -> None:
    tree = ast.parse("import importlib\nimportlib.import_module('spark_jobs.sla')\n")
    assert _string_imports(tree) == ["import_module('spark_jobs.sla') at line 2"]
    assert _string_imports(ast.parse("importlib.util.find_spec('pyspark')")) == []  # locating a dependency


OUTSIDE = re.compile(r"\.\./shared|DESIGN §|DESIGN\.md|\bseed 0\d\d\b")


@pytest.mark.unit
def test_no_reference_leaves_the_repository() -> None:
    """Users clone the repository: the contract is docs/design.md, nothing points outside."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".toml", ".sql", ".yaml", ".yml", ".xml", ".c", ".h", ".java", "") \
                or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) and path != Path(__file__):
                hits.append(f"{name}:{n}: {line.strip()[:100]}")
    assert hits == []
