"""Installed, not checked out: the JVM manifests ship in the wheel, the jar cache is a user cache
(or $MSGAUDIT_HOME), and an installed msgaudit in a clean venv, in an empty folder, runs
`msgaudit setup` and its commands without a checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from audit.runtime import jars

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.unit
def test_manifests_are_package_data_and_the_cache_is_a_user_folder(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import audit

    package = Path(audit.__file__).resolve().parent
    for manifest in jars.MANIFESTS:
        assert (jars.MANIFEST_DIR / manifest / "pom.xml").is_file()
    assert jars.MANIFEST_DIR.is_relative_to(package)
    for var in ("MSGAUDIT_JARS", "MSGAUDIT_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert jars.jars_home() == tmp_path / "user" / ".cache" / "msgaudit" / "jars"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jars.jars_home() == tmp_path / "xdg" / "msgaudit" / "jars"
    monkeypatch.setenv("MSGAUDIT_HOME", str(tmp_path / "home"))
    assert jars.jars_home() == tmp_path / "home" / "jars"
    assert jars.msgaudit_home() == tmp_path / "home"
    monkeypatch.setenv("MSGAUDIT_JARS", str(tmp_path / "j"))
    assert jars.jars_home() == tmp_path / "j"


@pytest.mark.e2e
def test_wheel_installs_into_a_clean_venv_and_sets_up_without_a_checkout(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)],
                   check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = dist.glob("msgaudit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"audit/runtime/jvm/settings.xml", "audit/runtime/jvm/spark-deps/pom.xml",
            "audit/runtime/jvm/kafka-broker/pom.xml",
            "audit/clients/native/Makefile", "audit/clients/native/msgaudit.c"} <= names
    assert not any(n.startswith(("tests/", "jvm/")) for n in names)
    # A venv of its own (no system site packages). Its dependencies are the already installed ones,
    # reached through a plain path in a .pth file (so CI does not download pyspark again); the
    # msgaudit it imports is the wheel's, not this checkout's.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MSGAUDIT_JARS", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, text=True, timeout=300, env=clean)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after: pip would see msgaudit there
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**clean, "MSGAUDIT_HOME": str(tmp_path / "msgaudit-home")}
    msgaudit = str(venv / "bin" / "msgaudit")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, cwd=empty, env=env, capture_output=True, text=True, timeout=600)

    where = run(str(py), "-c", "import audit; print(audit.__file__)")
    assert where.stdout.strip().startswith(str(site)), where
    setup = run(msgaudit, "setup")
    assert setup.returncode == 0, setup.stderr
    home = tmp_path / "msgaudit-home" / "jars"
    assert setup.stdout.splitlines() == [
        f"spark-deps: {len(list((home / 'spark-deps').glob('*.jar')))} jars in {home / 'spark-deps'}",
        f"kafka-broker: {len(list((home / 'kafka-broker').glob('*.jar')))} jars in {home / 'kafka-broker'}",
        f"kafka-mirror: {len(list((home / 'kafka-mirror').glob('*.jar')))} jars in {home / 'kafka-mirror'}",
        f"kafka-connect: {len(list((home / 'kafka-connect').glob('*.jar')))} jars in {home / 'kafka-connect'}",
        # the C plugin's source and the Java interceptor's ship in the wheel; both are built under the home
        f"libmsgaudit: librdkafka plugin in {home.parent / 'plugin' / 'libmsgaudit.so'}",
        f"interceptors: Java interceptor jar in {home / 'interceptors' / 'msgaudit-interceptors.jar'}"]
    assert any((home / "spark-deps").glob("hadoop-aws-*.jar"))
    # AuditedProducer finds the plugin the installation built
    found = run(str(py), "-c", "from audit.clients.plugin import Plugin, plugin_path; p = plugin_path(); "
                "Plugin.load(p); print(p)")
    assert (found.returncode, found.stdout) == (0, f"{home.parent / 'plugin' / 'libmsgaudit.so'}\n"), found.stderr
    helped = run(msgaudit, "--help")
    assert helped.returncode == 0 and "ingest" in helped.stdout
    status = run(msgaudit, "kafka", "status")  # reads the broker's state under MSGAUDIT_HOME
    assert (status.returncode, status.stdout, status.stderr) == (1, "kafka: not running\n", ""), status
    assert os.listdir(empty) == []


@pytest.mark.unit
@pytest.mark.parametrize(("missing", "line"), [
    ("gcc", "libmsgaudit: building the librdkafka plugin needs gcc (Debian: apt-get install -y build-essential); "
            "AuditedProducer uses its pure-Python path"),
    ("rdkafka.h", "libmsgaudit: building the librdkafka plugin needs librdkafka's header (Debian: apt-get install "
                  "-y librdkafka-dev); AuditedProducer uses its pure-Python path"),
])
def test_setup_says_in_one_line_what_the_plugins_build_lacks_and_sets_up_the_rest(
        missing: str, line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    from audit import cli
    from audit.clients import plugin

    monkeypatch.setattr(jars, "MANIFESTS", ())
    monkeypatch.setattr(jars, "interceptors_jar", lambda build: tmp_path / "i.jar")
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == missing else which(tool))
    exists = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda p: False if p.name == missing else exists(p))
    monkeypatch.setattr(plugin, "built", lambda: tmp_path / "plugin" / "libmsgaudit.so")
    assert cli.main(["setup"]) == 0
    assert capsys.readouterr().out.splitlines() == [line, f"interceptors: Java interceptor jar in {tmp_path / 'i.jar'}"]
