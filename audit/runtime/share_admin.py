"""Share groups' (KIP-932) share-partition start offsets, through the Java Admin client.

confluent-kafka's AdminClient has no share group calls and Spark's kafka-clients is 3.9 (none either),
so one small Java program, `io.msgaudit.interceptors.ShareGroupOffsets` in the msgaudit-interceptors jar
(`msgaudit setup` builds it), runs as one subprocess per call with the kafka-clients 4.x jar of the
`kafka-broker` manifest on its classpath: `Admin.listShareGroupOffsets` for every group asked at once
(capture, docs/design.md §4.2 `share_offsets`), `Admin.alterShareGroupOffsets` for the lab. The
connection settings go to it in a file readable by its owner only (they may hold a password), mapped
from librdkafka's names as for Spark's Kafka source (`java_client_settings`).

`start_offsets` never raises for what the broker answers: a group the broker refused (no share groups
on the broker, not authorised, ...) or a program that cannot run is a line in `ShareOffsets.notes`, and
no rows.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from audit.core.errors import BrokerError, SetupError
from audit.core.kafka_conf import java_client_settings
from audit.runtime import jars
from audit.runtime.jvm_service import java, properties_text, write_private

MAIN = "io.msgaudit.interceptors.ShareGroupOffsets"
TIMEOUT_S = 120.0  # the program's own calls time out after 30 s each


@dataclass
class ShareOffsets:
    """(group, topic, partition) -> start offset (None: the broker holds no start offset yet); the
    groups that could not be read, and a line saying why."""

    offsets: dict[tuple[str, str, int], int | None] = field(default_factory=dict)
    unread: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)


def _classpath() -> str:
    clients = [j for j in jars.jars("kafka-broker") if j.name.startswith(("kafka-clients-", "slf4j-api-"))]
    return ":".join(str(j) for j in [*clients, jars.interceptors_jar()])


def _stderr(r: subprocess.CompletedProcess[str]) -> str:
    """The program's error output without the logging library's notice that it has no backend."""
    return "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith("SLF4J:")).strip()[-500:]


def _run(kafka: Mapping[str, str], args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    settings = java_client_settings(kafka, "the share group admin client")
    with tempfile.TemporaryDirectory(prefix="msgaudit-share-") as tmp:
        props = write_private(Path(tmp) / "admin.properties", properties_text(settings))
        return subprocess.run([java(), "-cp", _classpath(), MAIN, str(props), *args], capture_output=True,
                              text=True, timeout=TIMEOUT_S)


def start_offsets(kafka: Mapping[str, str], groups: Sequence[str]) -> ShareOffsets:
    """The share-partition start offset of every partition each of `groups` holds state for (one run
    for all of them). A group with no state (it does not exist yet) has no rows and no note."""
    out = ShareOffsets()
    groups = list(dict.fromkeys(groups))
    if not groups:
        return out
    where = kafka.get("bootstrap.servers", "?")
    try:
        r = _run(kafka, ["list", *groups])
    except (SetupError, OSError, subprocess.TimeoutExpired) as e:
        out.unread.update(groups)
        out.notes.append(f"share group start offsets not read ({', '.join(groups)}): {e}")
        return out
    if r.returncode != 0:
        out.unread.update(groups)
        out.notes.append(f"share group start offsets not read ({', '.join(groups)}) from Kafka at {where}: "
                         f"{MAIN} exited {r.returncode}: {_stderr(r)}")
        return out
    for line in r.stdout.splitlines():
        row = json.loads(line)
        if "error" in row:
            out.unread.add(row["group"])
            out.notes.append(f"share group {row['group']!r}: start offsets not read from Kafka at {where}: "
                             f"{row['error']} (share groups need a Kafka 4.1+ broker with share.version=1)")
        else:
            out.offsets[(row["group"], row["topic"], int(row["partition"]))] = row["start_offset"]
    return out


def alter_start_offsets(kafka: Mapping[str, str], group: str, topic: str, offsets: Mapping[int, int]) -> None:
    """Set `group`'s start offsets on `topic` (partition -> offset); the group must have no member."""
    r = _run(kafka, ["alter", group, topic, *(f"{p}={o}" for p, o in sorted(offsets.items()))])
    if r.returncode != 0:
        raise BrokerError(f"share group {group!r}: start offsets of {topic!r} not altered: "
                          f"{_stderr(r)}")
