"""Code of another git revision, loaded beside this checkout's for the benchmarks' `--against REV`:
`package_at` (a package, its imports of itself renamed), `ship` (that package to the Python workers)
and `module_at` (one module)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _git(rev: str, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"--against {rev}: git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _name(prefix: str, rev: str) -> str:
    return f"{prefix}_at_" + re.sub(r"\W", "_", rev)


# The rules the reconcile package runs (docs/design.md §5): the oracle and the kernel's modules,
# copied with the package so that `--against REV` compares REV's rules too. A module REV lacks is
# left out (its package then imports this checkout's, if any).
RULES = ("audit/oracle.py", "audit/rules/kernel.py", "audit/rules/neighbours.py", "audit/rules/columns.py")
# A reconcile package without this module predates `reconcile.engine` (commit 018fe3b): it reads
# config keys (`reconcile.driver_rows`, `columnar_rows`) this checkout's Config no longer has.
ENGINE_MODULE = "spark_jobs/reconcile/settle.py"


def package_at(rev: str, into: Path, package: str = "spark_jobs/reconcile",
               modules: tuple[str, ...] = RULES) -> str:
    """`package` as of git revision `rev`, written under `into` as a package of its own (its imports
    of itself renamed) and importable; returns its module name. Each of `modules` that `rev` has (by
    default the rules: the oracle and `audit/rules/`) is taken from `rev` too, into the package, and
    the imports of it, the package's and the modules' own, point there."""
    files = _git(rev, "ls-tree", "--name-only", rev, f"{package}/").split()
    if not files:
        raise SystemExit(f"--against {rev}: that revision has no {package} package")
    if package == "spark_jobs/reconcile" and ENGINE_MODULE not in files:
        raise SystemExit(f"--against {rev}: its {package} predates reconcile.engine (commit 018fe3b) and "
                         "reads config keys this checkout no longer has; name a later revision")
    present = set(_git(rev, "ls-tree", "-r", "--name-only", rev, "--", *modules).split())
    modules = tuple(m for m in modules if m in present)
    name = _name(Path(package).name, rev)
    renames = [(rf"\b{re.escape(package.replace('/', '.'))}\b", name)]
    for m in modules:  # `from audit import oracle`, `audit.oracle`, `from audit.rules import kernel, ...`,
        # `audit.rules.columns` -> the copy inside the package
        parent, stem = str(Path(m).parent).replace("/", "."), Path(m).stem
        renames += [(rf"\bfrom {re.escape(parent)} import {stem}\b", f"from {name} import {stem}"),
                    (rf"\b{re.escape(parent)}\.{stem}\b", f"{name}.{stem}")]
    (into / name).mkdir(parents=True)
    sources = [(Path(f).name, _git(rev, "show", f"{rev}:{f}")) for f in files]
    sources += [(Path(m).name, _git(rev, "show", f"{rev}:{m}")) for m in modules]
    for file, text in sources:
        for pattern, replacement in renames:
            text = re.sub(pattern, replacement, text)
        (into / name / file).write_text(text)
    sys.path.insert(0, str(into))
    return name


def ship(spark: Any, into: Path, name: str) -> None:
    """Hand the package `package_at` wrote (`into / name`) to the session's Python workers, as a zip
    they put on their path: a Spark task that settles a chunk with it imports its modules there."""
    archive = shutil.make_archive(str(into / name), "zip", root_dir=into, base_dir=name)
    spark.sparkContext.addPyFile(archive)


def module_at(rev: str, path: str, into: Path) -> Any:
    """The module at `path` as of git revision `rev`, loaded under a name of its own."""
    name = _name(Path(path).stem, rev)
    into.mkdir(parents=True, exist_ok=True)
    (into / f"{name}.py").write_text(_git(rev, "show", f"{rev}:{path}"))
    spec = importlib.util.spec_from_file_location(name, into / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
