"""Fetch the JVM jars msgaudit runs on into a user cache, once.

Two manifests (Maven poms, shipped inside the package as `audit/runtime/jvm/<manifest>/pom.xml`)
name what is needed: `spark-deps` (Delta, Spark's Kafka source, JDBC drivers, the S3A connector)
`kafka-broker` (the Kafka broker and its runtime dependencies), `kafka-mirror` (MirrorMaker 2:
connect-mirror and its Connect runtime, for the lab's cross-cluster scenarios) and `kafka-connect`
(a Kafka Connect worker with Iceberg's sink connector, `msgaudit connect`). One `msgaudit setup` copies
them into `<jars home>/<manifest>/`; a stamp file holding the pom's hash makes every later run
skip Maven entirely, so nothing at run time touches the network.

The jars home is `$MSGAUDIT_JARS`, else `$MSGAUDIT_HOME/jars`, else the user cache folder
(`$XDG_CACHE_HOME/msgaudit/jars`, default `~/.cache/msgaudit/jars`). Nothing here looks for a
checkout: an installed wheel works the same (`./dev` sets MSGAUDIT_HOME to the checkout's
`.msgaudit`).
Set-up also builds the Java interceptor jar from `jvm/interceptors` (the same folder) and the
librdkafka plugin (`native/libmsgaudit`, shipped in the wheel as `audit/clients/native`, see
`audit.clients.plugin`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# defined in audit.core.config (the librdkafka plugin's build folder is there too); kept here by name
from audit.core.config import msgaudit_home as msgaudit_home
from audit.core.errors import SetupError

MANIFESTS = ("spark-deps", "kafka-broker", "kafka-mirror", "kafka-connect")
_STAMP = ".manifest-sha256"


MANIFEST_DIR = Path(__file__).resolve().parent / "jvm"


def jars_home() -> Path:
    """Where cached jars live: $MSGAUDIT_JARS, else <msgaudit_home>/jars."""
    env = os.environ.get("MSGAUDIT_JARS")
    return Path(env) if env else msgaudit_home() / "jars"


def _pom(manifest: str) -> Path:
    pom = MANIFEST_DIR / manifest / "pom.xml"
    if not pom.exists():
        raise SetupError(f"JVM manifest {pom} is missing from the installed package; reinstall msgaudit")
    return pom


def _digest(manifest: str) -> str:
    return hashlib.sha256(_pom(manifest).read_bytes()).hexdigest()


def jar_dir(manifest: str) -> Path:
    """The cached jar folder of a manifest; a SetupError that says what to run if it is not there."""
    d = jars_home() / manifest
    stamp = d / _STAMP
    if not stamp.exists():
        raise SetupError(f"the {manifest} jars are not cached in {d}; run `msgaudit setup` once (needs Maven Central)")
    if stamp.read_text().strip() != _digest(manifest):
        raise SetupError(f"the {manifest} jars in {d} are stale ({_pom(manifest)} changed); run `msgaudit setup`")
    return d


def jars(manifest: str) -> list[Path]:
    return sorted(jar_dir(manifest).glob("*.jar"))


def _spark_provided() -> set[str]:
    """Artifact names pyspark already ships, so the cache adds only what is missing (no version clashes)."""
    import importlib.util

    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise SetupError("pyspark is not installed; install the project first (pip install -e .)")
    jar_folder = Path(next(iter(spec.submodule_search_locations))) / "jars"
    return {_artifact(p.name) for p in jar_folder.glob("*.jar")}


def _artifact(filename: str) -> str:
    """'kafka-clients-3.9.2.jar' -> 'kafka-clients'."""
    stem = filename.removesuffix(".jar")
    parts = stem.split("-")
    while len(parts) > 1 and parts[-1][:1].isdigit():
        parts.pop()
    return "-".join(parts)


def fetch(manifest: str, force: bool = False) -> Path:
    """Copy a manifest's jars into the cache with Maven; a no-op when the cache is current."""
    target = jars_home() / manifest
    digest = _digest(manifest)
    if not force and (target / _STAMP).exists() and (target / _STAMP).read_text().strip() == digest:
        return target
    mvn = shutil.which("mvn")
    if mvn is None:
        raise SetupError("Maven (mvn) is not on PATH; install it (apt-get install maven) and rerun `msgaudit setup`")
    with tempfile.TemporaryDirectory(prefix="msgaudit-jars-") as tmp:
        cmd = [mvn, "-q", "-B", "-s", str(MANIFEST_DIR / "settings.xml"), "-f", str(_pom(manifest)),
               "dependency:copy-dependencies", f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
            raise SetupError(f"Maven could not fetch the {manifest} jars:\n{tail}")
        skip = _spark_provided() if manifest == "spark-deps" else set()
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for jar in Path(tmp).glob("*.jar"):
            if _artifact(jar.name) not in skip:
                shutil.copy2(jar, target / jar.name)
    (target / _STAMP).write_text(digest + "\n")
    return target


INTERCEPTORS = "interceptors"
INTERCEPTORS_JAR = "msgaudit-interceptors.jar"


def _interceptors_digest() -> str:
    src = MANIFEST_DIR / INTERCEPTORS
    h = hashlib.sha256()
    for f in sorted([src / "pom.xml", *(src / "src").rglob("*.java")]):
        h.update(f.relative_to(src).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def interceptors_jar(build: bool = False) -> Path:
    """The msgaudit-interceptors jar (Java Producer/Consumer interceptors, `jvm/interceptors` beside
    this module), built with Maven into `<jar cache>/interceptors/` when `build` and its sources
    changed. The build runs in a scratch copy of the sources, so an installed package stays clean."""
    target = jars_home() / INTERCEPTORS
    jar = target / INTERCEPTORS_JAR
    stamp = target / _STAMP
    digest = _interceptors_digest()
    if jar.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return jar
    if not build:
        raise SetupError(f"the msgaudit-interceptors jar is not built in {target}; run `msgaudit setup`")
    mvn = shutil.which("mvn")
    if mvn is None:
        raise SetupError("Maven (mvn) is not on PATH; install it (apt-get install maven) and rerun `msgaudit setup`")
    with tempfile.TemporaryDirectory(prefix="msgaudit-interceptors-") as scratch:
        src = Path(scratch) / INTERCEPTORS
        shutil.copytree(MANIFEST_DIR / INTERCEPTORS, src, ignore=shutil.ignore_patterns("target"))
        cmd = [mvn, "-q", "-B", "-s", str(MANIFEST_DIR / "settings.xml"), "-f", str(src / "pom.xml"),
               "-DskipTests", "package"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        built = src / "target" / INTERCEPTORS_JAR
        if r.returncode != 0 or not built.exists():
            raise SetupError(f"building the msgaudit-interceptors jar failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, jar)
    stamp.write_text(digest + "\n")
    return jar
