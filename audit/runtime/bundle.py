"""The project's Python code as one zip for Spark executors (`spark-submit --py-files`).

A cluster's executors run on other hosts (or, on one machine, in other JVMs started by a Spark
worker) and import nothing from the driver's environment: spark-submit ships this zip to each of
them and puts it on their Python path. It holds the `audit` and `spark_jobs` packages exactly as
this interpreter imports them (an installed wheel or a checkout), without byte code. The file is
named by its content's hash under `<msgaudit home>/bundles/`, so a rebuild with unchanged sources
reuses it and two versions never overwrite each other.

This module only builds the zip; it starts nothing and imports no Spark.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import zipfile
from pathlib import Path

from audit.core.errors import SetupError
from audit.runtime.jars import msgaudit_home

PACKAGES = ("audit", "spark_jobs")
_SKIP_DIRS = {"__pycache__", "target"}
# A fixed timestamp for every entry: the same sources give the same bytes, hence the same name.
_EPOCH = (2020, 1, 1, 0, 0, 0)


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SetupError(f"package {name!r} is not importable; install msgaudit (pip install msgaudit-<ver>.whl)")
    return Path(next(iter(spec.submodule_search_locations)))


def _files(root: Path) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if not f.endswith((".pyc", ".pyo")))
    return out


def _zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in PACKAGES:
            root = package_dir(name)
            for f in _files(root):
                info = zipfile.ZipInfo(f"{name}/{f.relative_to(root).as_posix()}", _EPOCH)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = 0o644 << 16
                zf.writestr(info, f.read_bytes())
    return buf.getvalue()


def python_bundle(folder: Path | None = None) -> Path:
    """The zip of `audit` + `spark_jobs` for `--py-files`, built when its content changed."""
    data = _zip_bytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    target_dir = folder if folder is not None else msgaudit_home() / "bundles"
    target = target_dir / f"msgaudit-py-{digest}.zip"
    if not target.exists():
        target_dir.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        tmp.replace(target)
    return target
