"""LedgerWriter and recover_orphans: buffering, rotation, sealing, crash recovery. No broker, no JVM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from audit.clients.ledger import LedgerWriter, recover_orphans, sealed_segments
from audit.core.errors import LedgerError

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
NAME_RE = re.compile(r"^ledg-\d{8}T\d{12}Z-(\d+)-[0-9a-f]{8}\.jsonl$")


def rows_of(paths: list[Path]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for p in paths:
        out.extend(json.loads(line) for line in p.read_text().splitlines())
    return out


def test_close_seals_one_segment_with_every_row_in_order(tmp_path: Path) -> None:
    rows = [{"seq": i, "topic": "t", "produce_ts": 1700000000000 + i, "error": None} for i in range(5)]
    with LedgerWriter(tmp_path, "ledg") as w:
        for r in rows:
            w.append(r)
    files = sorted(tmp_path.iterdir())
    assert len(files) == 1
    m = NAME_RE.match(files[0].name)
    assert m and int(m.group(1)) == os.getpid()
    assert rows_of(files) == rows
    assert w.sealed_segments == files
    assert w.rows_written == 5


def test_flush_makes_rows_durable_in_the_open_segment_readers_see_nothing_yet(tmp_path: Path) -> None:
    w = LedgerWriter(tmp_path, "ledg")
    try:
        w.append({"a": 1})
        w.append({"a": 2})
        w.flush()
        assert sealed_segments(tmp_path) == []
        open_seg = w.open_segment
        assert open_seg is not None and open_seg.name.endswith(".jsonl.open")
        assert [json.loads(x) for x in open_seg.read_text().splitlines()] == [{"a": 1}, {"a": 2}]
    finally:
        w.close()
    assert rows_of(sealed_segments(tmp_path)) == [{"a": 1}, {"a": 2}]
    assert not list(tmp_path.glob("*.open"))


def test_empty_writer_leaves_no_file(tmp_path: Path) -> None:
    LedgerWriter(tmp_path, "ledg").close()
    assert list(tmp_path.iterdir()) == []


def test_rotation_by_size_keeps_order_across_segments(tmp_path: Path) -> None:
    with LedgerWriter(tmp_path, "ledg", max_bytes=200) as w:
        for i in range(30):
            w.append({"seq": i, "pad": "p" * 20})
            if i % 5 == 4:
                w.flush()  # several writes, so the size check runs between them
    segs = sealed_segments(tmp_path)
    assert segs == w.sealed_segments  # names sort in creation order
    assert len(segs) >= 3
    assert all(p.stat().st_size >= 200 for p in segs[:-1])  # sealed only once full
    assert [r["seq"] for r in rows_of(segs)] == list(range(30))


def test_rotation_by_age_seals_without_close(tmp_path: Path) -> None:
    w = LedgerWriter(tmp_path, "ledg", max_age_s=0.2, flush_interval_s=0.05)
    try:
        w.append({"seq": 0})
        deadline = time.monotonic() + 10
        # The writer renames the segment, then forgets it: wait for both, not just the file.
        while not (sealed_segments(tmp_path) and w.open_segment is None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rows_of(sealed_segments(tmp_path)) == [{"seq": 0}]
        assert w.open_segment is None
    finally:
        w.close()


def test_row_that_is_not_json_fails_at_append(tmp_path: Path) -> None:
    with LedgerWriter(tmp_path, "ledg") as w, pytest.raises(LedgerError, match="not JSON-serialisable"):
        w.append({"ts": object()})


def test_append_after_close_is_an_error(tmp_path: Path) -> None:
    w = LedgerWriter(tmp_path, "ledg")
    w.close()
    w.close()  # idempotent
    with pytest.raises(LedgerError, match="closed"):
        w.append({"a": 1})


def test_bad_prefix_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="prefix"):
        LedgerWriter(tmp_path, "a/b")


def test_recover_leaves_a_live_writers_segment_alone(tmp_path: Path) -> None:
    w = LedgerWriter(tmp_path, "ledg")
    try:
        w.append({"a": 1})
        w.flush()
        assert recover_orphans(tmp_path) == 0
        assert w.open_segment is not None and w.open_segment.exists()
    finally:
        w.close()
    assert rows_of(sealed_segments(tmp_path)) == [{"a": 1}]


def test_recover_cuts_an_unfinished_last_line_and_seals(tmp_path: Path) -> None:
    orphan = tmp_path / "ledg-20260101T000000000000Z-999999-0badf00d.jsonl.open"
    orphan.write_bytes(b'{"a":1}\n{"a":2}\n{"a":')
    empty = tmp_path / "ledg-20260101T000000000000Z-999999-00000000.jsonl.open"
    empty.write_bytes(b'{"half')
    assert recover_orphans(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ledg-20260101T000000000000Z-999999-0badf00d.jsonl"]
    assert rows_of(sealed_segments(tmp_path)) == [{"a": 1}, {"a": 2}]
    assert recover_orphans(tmp_path) == 0


def test_recover_on_missing_directory_is_zero(tmp_path: Path) -> None:
    assert recover_orphans(tmp_path / "nope") == 0


def test_sigkilled_writer_loses_at_most_its_unflushed_tail(tmp_path: Path) -> None:
    n = 500
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.producer_kill_target", "ledger", str(tmp_path), str(n)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"READY {n}"
        time.sleep(0.3)  # let it write more, unflushed, so the kill lands mid-stream
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert sealed_segments(tmp_path) == []
    assert len(list(tmp_path.glob("*.jsonl.open"))) == 1
    assert recover_orphans(tmp_path) == 1
    segs = sealed_segments(tmp_path)
    assert len(segs) == 1 and not list(tmp_path.glob("*.open"))
    seen = [r["i"] for r in rows_of(segs)]  # every line parses: no partial line survived
    assert seen == list(range(len(seen)))
    assert len(seen) >= n


def test_formatted_rows_are_written_in_batches_and_a_bad_row_costs_only_itself(tmp_path: Path) -> None:
    acked = '%.0s{"seq":%d,"status":"acked","offset":%d}'
    failed = '%.0s{"seq":%d,"status":"failed","error":%s}'
    items: list[tuple[object, ...]] = []
    for i in range(5000):  # more than one formatting batch, two formats interleaved
        items.append((acked, i, 10 * i) if i % 3 else (failed, i, json.dumps(f"E{i}")))
    items[4321] = (acked, "not-a-number", 1)  # a bad row in the second batch
    mirrored: list[str] = []
    with LedgerWriter(tmp_path, "ledg", mirror=mirrored.extend) as w:
        for item in items:
            w.append_formatted(item)
    rows = rows_of(sealed_segments(tmp_path))
    assert len(rows) == 5000 and len(mirrored) == 5000
    assert [json.loads(line) for line in mirrored] == rows
    bad = rows.pop(4321)
    assert set(bad) == {"ledger_format_error", "item"} and "not-a-number" in str(bad["item"])
    expected = [{"seq": i, "status": "acked", "offset": 10 * i} if i % 3 else
                {"seq": i, "status": "failed", "error": f"E{i}"} for i in range(5000) if i != 4321]
    assert rows == expected
