"""A fault-injecting TCP proxy for the Kafka protocol: the lab's "network" between client and broker.

The broker advertises the proxy's address (`LocalKafka(advertised={node: proxy.address})`), so
every client connection, bootstrap and metadata-directed alike, runs through it. The proxy
forwards whole Kafka frames (4-byte length + payload) and understands just enough of the
protocol to fault Produce traffic precisely:

* `drop_produce_responses(n)`: the broker has written the batch and answered; the proxy swallows
  the answer and closes the client's connection, so the producer sees an in-flight request fail
  and retries it ("the broker received the message but the producer got no response").
* `fail_next_produce_request(after_responses=1)`: the next Produce request never reaches the
  broker; once `after_responses` later Produce responses have been passed back on the same
  connection, the connection is closed, so that request fails while later batches succeeded
  (the reordering fault of max.in.flight > 1 without idempotence).
* `refuse_next_produce_request(error_code, after_responses=1)`: the same request kept from the
  broker, but answered by the proxy itself with `error_code` for each of its partitions (e.g. 6,
  NOT_LEADER_OR_FOLLOWER, what a topic created moments before answers), the connection left up:
  a retriable refusal the client retries by itself, behind the later batches already written.
* `delay_produce_responses(ms, n)`: hold the next n Produce responses for `ms` before passing them on.

Every Produce exchange is recorded (`exchanges()`): the record batches of the request with each
record's audit headers (pid, seq) and the broker's answer per partition (error code, base
offset), and what the proxy did to it. That record of the wire is the lab's ground truth for the
producer-side faults: it is taken before the audit sees anything and uses none of its code.

This module must not import Spark, must listen on 127.0.0.1 only, and parses, never rewrites,
the bytes it forwards (the one answer it writes itself is a refused request's).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

log = logging.getLogger(__name__)

PRODUCE = 0
_PRODUCE_FIRST_FLEXIBLE = 9
_PRODUCE_FIRST_TOPIC_ID = 13
_COMPRESSION_MASK = 0x07
_MAX_FRAME = 256 << 20


# ------------------------------------------------------------------------------------------
# Wire parsing (read only)


class _Reader:
    """Big-endian Kafka primitive reader over one frame."""

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data = data
        self.pos = pos

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError("truncated Kafka frame")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def int8(self) -> int:
        return int(struct.unpack(">b", self.take(1))[0])

    def int16(self) -> int:
        return int(struct.unpack(">h", self.take(2))[0])

    def int32(self) -> int:
        return int(struct.unpack(">i", self.take(4))[0])

    def int64(self) -> int:
        return int(struct.unpack(">q", self.take(8))[0])

    def uvarint(self) -> int:
        shift = value = 0
        while True:
            b = self.take(1)[0]
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise ValueError("varint too long")

    def varint(self) -> int:
        v = self.uvarint()
        return (v >> 1) ^ -(v & 1)

    def string(self, compact: bool) -> str | None:
        n = self.uvarint() - 1 if compact else self.int16()
        return None if n < 0 else self.take(n).decode("utf-8", "replace")

    def bytes_(self, compact: bool) -> bytes | None:
        n = self.uvarint() - 1 if compact else self.int32()
        return None if n < 0 else self.take(n)

    def array_len(self, compact: bool) -> int:
        return self.uvarint() - 1 if compact else self.int32()

    def skip_tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.take(self.uvarint())


@dataclass(frozen=True)
class WireRecord:
    """One record of a produced batch as the proxy saw it: offset delta and audit identity."""

    offset_delta: int
    pid: str | None
    seq: int | None


@dataclass(frozen=True)
class WireBatch:
    topic: str  # topic name, or the topic id's hex for Produce v13+
    partition: int
    producer_id: int
    base_sequence: int
    records: tuple[WireRecord, ...] | None  # None: compressed, not parsed


@dataclass(frozen=True)
class WirePartitionResult:
    topic: str
    partition: int
    error_code: int
    base_offset: int


@dataclass
class ProduceExchange:
    """One Produce request on one client connection, its answer, and the proxy's verdict.

    fate: 'forwarded' (normal), 'response_dropped' (broker answered, client never saw it),
    'request_failed' (never reached the broker; the connection was closed under it),
    'refused' (never reached the broker; the proxy answered it with an error code),
    'delayed' (answer passed on late), 'open' (no answer yet / connection died first).
    """

    conn: int
    correlation_id: int
    api_version: int
    batches: tuple[WireBatch, ...]
    results: tuple[WirePartitionResult, ...] = ()
    fate: str = "open"
    at: float = field(default_factory=time.time)

    def messages(self) -> list[tuple[str, int, str | None, int | None]]:
        """(topic, partition, pid, seq) of every parsed record of the request."""
        return [(b.topic, b.partition, r.pid, r.seq) for b in self.batches for r in b.records or ()]

    @property
    def written(self) -> bool:
        """The broker answered without error for every partition (so it appended every batch)."""
        return bool(self.results) and all(r.error_code == 0 for r in self.results)


def request_header(frame: bytes) -> tuple[int, int, int]:
    """(api_key, api_version, correlation_id) of a request frame (payload after the length)."""
    r = _Reader(frame)
    return r.int16(), r.int16(), r.int32()


def _record_headers(r: _Reader) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for _ in range(r.varint()):
        name = r.take(r.varint()).decode("utf-8", "replace")
        n = r.varint()
        out[name] = None if n < 0 else r.take(n)
    return out


def _decode_int(raw: bytes | None) -> int | None:
    if raw is None:
        return None
    text = raw.decode("ascii", "replace")
    return int(text) if text.isdigit() else None


def parse_record_batches(topic: str, partition: int, data: bytes) -> list[WireBatch]:
    """The v2 record batches of one partition's `records` field."""
    out = []
    r = _Reader(data)
    while len(data) - r.pos >= 61:
        r.int64()  # base offset (0 in a request)
        length = r.int32()
        end = r.pos + length
        r.int32()  # partition leader epoch
        magic = r.int8()
        if magic != 2:
            raise ValueError(f"record batch magic {magic} is not supported")
        r.take(4)  # crc
        attributes = r.int16()
        r.int32()  # last offset delta
        r.int64()
        r.int64()  # base and max timestamp
        producer_id = r.int64()
        r.int16()  # producer epoch
        base_sequence = r.int32()
        count = r.int32()
        records: tuple[WireRecord, ...] | None = None
        if not attributes & _COMPRESSION_MASK:
            parsed = []
            for _ in range(count):
                rlen = r.varint()
                rend = r.pos + rlen
                r.int8()  # attributes
                r.varint()  # timestamp delta
                offset_delta = r.varint()
                klen = r.varint()
                if klen > 0:
                    r.take(klen)
                vlen = r.varint()
                if vlen > 0:
                    r.take(vlen)
                hdrs = _record_headers(r)
                pid_raw, seq_raw = hdrs.get("audit.pid"), hdrs.get("audit.seq")
                packed = hdrs.get("audit.id")  # the packed form <pid>/<seq>/<ts> (docs/design.md §3.1)
                if packed is not None and packed.count(b"/") >= 2:
                    pid_raw, seq_raw, _ = packed.rsplit(b"/", 2)
                parsed.append(WireRecord(offset_delta, pid_raw.decode("utf-8", "replace") if pid_raw else None,
                                         _decode_int(seq_raw)))
                r.pos = rend
            records = tuple(parsed)
        out.append(WireBatch(topic, partition, producer_id, base_sequence, records))
        r.pos = end
    return out


def parse_produce_request(frame: bytes) -> tuple[int, int, list[WireBatch]]:
    """(api_version, correlation_id, batches) of a Produce request frame."""
    r = _Reader(frame)
    api_key, version, corr = r.int16(), r.int16(), r.int32()
    if api_key != PRODUCE:
        raise ValueError(f"not a Produce request (api key {api_key})")
    flexible = version >= _PRODUCE_FIRST_FLEXIBLE
    r.string(False)  # client id: a classic nullable string even in header v2
    if flexible:
        r.skip_tags()
    if version >= 3:
        r.string(flexible)  # transactional id
    r.int16()  # acks
    r.int32()  # timeout
    batches: list[WireBatch] = []
    for _ in range(r.array_len(flexible)):
        topic = r.take(16).hex() if version >= _PRODUCE_FIRST_TOPIC_ID else r.string(flexible) or ""
        for _ in range(r.array_len(flexible)):
            partition = r.int32()
            data = r.bytes_(flexible)
            if data:
                batches.extend(parse_record_batches(topic, partition, data))
            if flexible:
                r.skip_tags()
        if flexible:
            r.skip_tags()
    return version, corr, batches


def parse_produce_response(frame: bytes, version: int) -> list[WirePartitionResult]:
    """Per-partition (error code, base offset) of a Produce response frame."""
    flexible = version >= _PRODUCE_FIRST_FLEXIBLE
    r = _Reader(frame)
    r.int32()  # correlation id
    if flexible:
        r.skip_tags()
    out = []
    for _ in range(r.array_len(flexible)):
        topic = r.take(16).hex() if version >= _PRODUCE_FIRST_TOPIC_ID else (r.string(flexible) or "")
        for _ in range(r.array_len(flexible)):
            partition = r.int32()
            error = r.int16()
            base_offset = r.int64()
            if version >= 2:
                r.int64()  # log append time
            if version >= 5:
                r.int64()  # log start offset
            if version >= 8:
                for _ in range(r.array_len(flexible)):
                    r.int32()
                    r.string(flexible)
                r.string(flexible)  # error message
            if flexible:
                r.skip_tags()
            out.append(WirePartitionResult(topic, partition, error, base_offset))
        if flexible:
            r.skip_tags()
    return out


def produce_error_response(correlation_id: int, version: int, batches: tuple[WireBatch, ...],
                           error_code: int) -> bytes:
    """A Produce response frame (payload after the length) answering every partition of a
    request's `batches` with `error_code` (offsets -1), as a broker does; Produce v3..v12."""
    if not 3 <= version < _PRODUCE_FIRST_TOPIC_ID:
        raise ValueError(f"cannot answer Produce v{version} (v3..v{_PRODUCE_FIRST_TOPIC_ID - 1} only)")
    flexible = version >= _PRODUCE_FIRST_FLEXIBLE

    def count(n: int) -> bytes:
        return _uvarint(n + 1) if flexible else struct.pack(">i", n)

    def name(text: str) -> bytes:
        raw = text.encode()
        return (_uvarint(len(raw) + 1) if flexible else struct.pack(">h", len(raw))) + raw

    tags = b"\x00" if flexible else b""
    by_topic: dict[str, list[int]] = {}
    for b in batches:
        by_topic.setdefault(b.topic, []).append(b.partition)
    out = struct.pack(">i", correlation_id) + tags + count(len(by_topic))
    for topic, partitions in by_topic.items():
        out += name(topic) + count(len(partitions))
        for partition in partitions:
            # base offset, log append time (v2+), log start offset (v5+)
            out += struct.pack(">ihqq", partition, error_code, -1, -1) + (struct.pack(">q", -1) if version >= 5 else b"")
            if version >= 8:  # no record errors, a null error message
                out += count(0) + (b"\x00" if flexible else struct.pack(">h", -1))
            out += tags
        out += tags
    return out + struct.pack(">i", 0) + tags  # throttle time


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# ------------------------------------------------------------------------------------------
# The proxy


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _read_frame(sock: socket.socket) -> bytes | None:
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">i", head)
    if n < 0 or n > _MAX_FRAME:
        raise ValueError(f"bad Kafka frame length {n}")
    return _recv_exact(sock, n)


def _send_frame(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(struct.pack(">i", len(frame)) + frame)


class _Connection:
    """One client connection and its upstream twin, pumped by two threads."""

    def __init__(self, proxy: FaultProxy, conn_id: int, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.id = conn_id
        self.client = client
        self.upstream = upstream
        self.inflight: dict[int, tuple[int, int, ProduceExchange | None]] = {}  # corr -> (api, ver, exch)
        # held request, produce responses still to pass, the error code to answer it with (None: close)
        self.failing: list[tuple[ProduceExchange, int, int | None]] = []
        self.lock = threading.Lock()
        self.closed = False

    def start(self) -> None:
        for target, name in ((self._requests, "req"), (self._responses, "resp")):
            threading.Thread(target=self._guard(target), name=f"fault-proxy-{self.id}-{name}", daemon=True).start()

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except (OSError, ValueError) as e:
                if not self.closed:
                    log.debug("fault proxy connection %d: %s", self.id, e)
            finally:
                self.close()
        return run

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for s in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.proxy._forget(self)

    def _requests(self) -> None:
        while True:
            frame = _read_frame(self.client)
            if frame is None:
                return
            api, version, corr = request_header(frame)
            exchange = None
            if api == PRODUCE:
                try:
                    _, _, batches = parse_produce_request(frame)
                except ValueError as e:
                    log.warning("fault proxy: unparsable Produce request v%d: %s", version, e)
                    batches = []
                exchange = ProduceExchange(self.id, corr, version, tuple(batches))
                self.proxy._record(exchange)
                held = self.proxy._take_request_fault()
                if held is not None:
                    exchange.fate = "request_failed" if held[1] is None else "refused"
                    with self.lock:
                        self.failing.append((exchange, *held))
                    continue
            with self.lock:
                self.inflight[corr] = (api, version, exchange)
            _send_frame(self.upstream, frame)

    def _responses(self) -> None:
        while True:
            frame = _read_frame(self.upstream)
            if frame is None:
                return
            (corr,) = struct.unpack(">i", frame[:4])
            with self.lock:
                api, version, exchange = self.inflight.pop(corr, (-1, -1, None))
            if api != PRODUCE or exchange is None:
                _send_frame(self.client, frame)
                continue
            try:
                exchange.results = tuple(parse_produce_response(frame, version))
            except ValueError as e:
                log.warning("fault proxy: unparsable Produce response v%d: %s", version, e)
            action, delay_s = self.proxy._take_response_fault()
            if action == "drop":
                exchange.fate = "response_dropped"
                self.proxy._notify()
                self.close()
                return
            if action == "delay":
                exchange.fate = "delayed"
                time.sleep(delay_s)
            else:
                exchange.fate = "forwarded"
            _send_frame(self.client, frame)
            self.proxy._notify()
            due = self._count_down_failing()
            for exchange, error_code in due:
                if error_code is not None:
                    exchange.results = tuple(WirePartitionResult(b.topic, b.partition, error_code, -1)
                                             for b in exchange.batches)
                    _send_frame(self.client, produce_error_response(
                        exchange.correlation_id, exchange.api_version, exchange.batches, error_code))
            if any(error_code is None for _, error_code in due):
                self.close()
                return

    def _count_down_failing(self) -> list[tuple[ProduceExchange, int | None]]:
        """Count one passed Produce response for every held request; the ones now due."""
        with self.lock:
            counted = [(e, n - 1, code) for e, n, code in self.failing]
            self.failing = [(e, n, code) for e, n, code in counted if n > 0]
            return [(e, code) for e, n, code in counted if n <= 0]


class FaultProxy:
    """A Kafka-aware TCP proxy on 127.0.0.1 in front of one broker listener (see the module docstring).

    Start it before the broker (the broker advertises `proxy.address`), or point it at a running
    broker whose advertised listener is the proxy's port.
    """

    def __init__(self, upstream: str, listen_port: int = 0) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host or "127.0.0.1", int(port))
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", listen_port))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Condition()
        self._conns: dict[int, _Connection] = {}
        self._next_id = 0
        self._exchanges: list[ProduceExchange] = []
        self._drop_responses = 0
        self._delay_responses = 0
        self._delay_s = 0.0
        self._fail_requests: list[tuple[int, int | None]] = []
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self._thread = threading.Thread(target=self._accept, name=f"fault-proxy-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped = True
        if self._thread is not None:
            self._thread.join(5)
        self._listener.close()
        self.disconnect_all()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
                upstream.settimeout(None)
            except OSError as e:
                log.debug("fault proxy: upstream %s unreachable: %s", self.upstream, e)
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._next_id += 1
                conn = _Connection(self, self._next_id, client, upstream)
                self._conns[conn.id] = conn
            conn.start()

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.pop(conn.id, None)
            self._lock.notify_all()

    def disconnect_all(self) -> None:
        """Close every client connection now (a network blip)."""
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            c.close()

    # -- faults ------------------------------------------------------------------------------
    def drop_produce_responses(self, n: int = 1) -> None:
        """Swallow the next `n` Produce responses, closing the connection each time."""
        with self._lock:
            self._drop_responses += n

    def delay_produce_responses(self, ms: int, n: int = 1) -> None:
        with self._lock:
            self._delay_responses += n
            self._delay_s = ms / 1000

    def fail_next_produce_request(self, after_responses: int = 1) -> None:
        """Keep the next Produce request from the broker; close its connection once
        `after_responses` later Produce responses on it have reached the client."""
        if after_responses < 1:
            raise ValueError("after_responses must be >= 1")
        with self._lock:
            self._fail_requests.append((after_responses, None))

    def refuse_next_produce_request(self, error_code: int, after_responses: int = 1) -> None:
        """Keep the next Produce request from the broker; once `after_responses` later Produce
        responses on its connection have reached the client, answer it with `error_code` for each
        of its partitions (e.g. 6, NOT_LEADER_OR_FOLLOWER), the connection left up."""
        if after_responses < 1:
            raise ValueError("after_responses must be >= 1")
        with self._lock:
            self._fail_requests.append((after_responses, error_code))

    def clear_faults(self) -> None:
        with self._lock:
            self._drop_responses = self._delay_responses = 0
            self._fail_requests.clear()

    @property
    def armed(self) -> int:
        """Faults armed but not yet applied."""
        with self._lock:
            return self._drop_responses + self._delay_responses + len(self._fail_requests)

    def _take_request_fault(self) -> tuple[int, int | None] | None:
        with self._lock:
            return self._fail_requests.pop(0) if self._fail_requests else None

    def _take_response_fault(self) -> tuple[str, float]:
        with self._lock:
            if self._drop_responses:
                self._drop_responses -= 1
                return "drop", 0.0
            if self._delay_responses:
                self._delay_responses -= 1
                return "delay", self._delay_s
            return "forward", 0.0

    # -- what happened -------------------------------------------------------------------------
    def _record(self, exchange: ProduceExchange) -> None:
        with self._lock:
            self._exchanges.append(exchange)

    def _notify(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def exchanges(self, topic: str | None = None) -> list[ProduceExchange]:
        """Every Produce exchange so far (only those with a batch for `topic`, if given)."""
        with self._lock:
            out = list(self._exchanges)
        if topic is None:
            return out
        return [e for e in out if any(b.topic == topic for b in e.batches)]

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.2))
        return True

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)


__all__ = ["FaultProxy", "ProduceExchange", "WireBatch", "WireRecord", "WirePartitionResult",
           "parse_produce_request", "parse_produce_response", "parse_record_batches", "request_header"]
