package io.msgaudit.interceptors;

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

/**
 * The acknowledged rows of one producer, kept as raw fields until the spool's writer thread
 * formats them. {@link #add} runs on the producer's network thread for every acknowledged record:
 * under a short lock it copies the seq and produce_ts digits of the record's audit header into the
 * chunk's byte arena and stores the numbers (no String, no JSON, no per-record object, and no
 * reference to the record's header: a held reference would keep it alive through young
 * collections, which then copy it); {@link #drainInto} (writer thread) turns every stored row
 * into one JSON line, in the row format of audit/clients/producer.py. The writer drains every
 * flush interval; a chunk that fills while a quarter of {@code maxRows} is held wakes it early
 * (waking it per chunk cost ~10 % of a producer's throughput on two cores: a context switch per
 * 1,024 rows beside the producer's own threads).
 *
 * <p>The rows held here are bounded ({@code maxRows}); beyond it, and after the spool closed,
 * {@link #add} refuses and the caller counts the row as dropped.
 */
final class AckRows implements LedgerSpool.Source {
    static final int CHUNK = 1024;
    // hand the rows to the file in pieces of about 64 KiB: a write of megabytes makes the kernel
    // allocate large page-cache folios, compacting memory inside the call on a fragmented machine
    private static final int FLUSH_BYTES = 64 << 10;
    private static final int MAX_FREE_CHUNKS = 64;

    /** One chunk of rows: parallel arrays and a byte arena, reused once written. */
    static final class Chunk {
        byte[] arena = new byte[CHUNK * 40]; // per row: its seq digits, then its produce_ts digits
        int used;
        final int[] seqLen = new int[CHUNK];
        final int[] tsLen = new int[CHUNK];
        final String[] topic = new String[CHUNK]; // the producer's topic names: shared, long-lived
        final int[] partition = new int[CHUNK];
        final long[] offset = new long[CHUNK];
        final long[] ackTs = new long[CHUNK];
        int n;

        void copy(byte[] src, int from, int len) {
            if (used + len > arena.length) {
                arena = java.util.Arrays.copyOf(arena, Math.max(arena.length * 2, used + len));
            }
            System.arraycopy(src, from, arena, used, len);
            used += len;
        }
    }

    private final byte[] head;      // {"producer":...,"pid":...,"seq":
    private final int seqFrom;      // packed: where the seq digits start in audit.id (pid length + 1)
    private final byte[] middle;    // ,"status":"acked","error":null,"txn_id":<txn>,"produce_ts":
    private final int maxRows;
    private final int wakeAt;       // rows held at which a filled chunk wakes the writer early

    private Chunk current = new Chunk();
    private final List<Chunk> full = new ArrayList<>();
    private final List<Chunk> free = new ArrayList<>();
    private int held;
    private boolean closed;
    private Runnable wake = () -> { };

    // writer thread only
    private final Map<String, byte[]> topicJson = new HashMap<>();

    AckRows(String head, int pidLength, String txnJson, int maxRows) {
        this.head = head.getBytes(StandardCharsets.UTF_8);
        this.seqFrom = pidLength + 1;
        this.middle = (",\"status\":\"acked\",\"error\":null,\"txn_id\":" + txnJson + ",\"produce_ts\":")
                .getBytes(StandardCharsets.UTF_8);
        this.maxRows = maxRows;
        this.wakeAt = Math.max(CHUNK, maxRows / 4);
    }

    /** Called (on the producer's network thread) when a chunk fills with {@code wakeAt} rows held. */
    void onChunkFull(Runnable r) { wake = r; }

    /**
     * Hold one acknowledged row; false when it cannot be held (full, or the spool closed).
     * Packed form ({@code b == null}): {@code a} is the audit.id value, {@code split} the index of
     * the '/' before its ts digits. Three headers: {@code a} is audit.seq's value, {@code b} audit.ts's.
     */
    boolean add(byte[] a, int split, byte[] b, String topic, int partition, long offset, long ackTs) {
        boolean wakeNow;
        synchronized (this) {
            if (closed || held >= maxRows) {
                return false;
            }
            Chunk c = current;
            boolean filled = c.n == CHUNK;
            wakeNow = filled && held >= wakeAt;
            if (filled) {
                full.add(c);
                c = free.isEmpty() ? new Chunk() : free.remove(free.size() - 1);
                current = c;
            }
            int i = c.n++;
            if (b == null) {
                c.copy(a, seqFrom, split - seqFrom);
                c.copy(a, split + 1, a.length - split - 1);
                c.seqLen[i] = split - seqFrom;
                c.tsLen[i] = a.length - split - 1;
            } else {
                c.copy(a, 0, a.length);
                c.copy(b, 0, b.length);
                c.seqLen[i] = a.length;
                c.tsLen[i] = b.length;
            }
            c.topic[i] = topic;
            c.partition[i] = partition;
            c.offset[i] = offset;
            c.ackTs[i] = ackTs;
            held++;
        }
        if (wakeNow) {
            wake.run();
        }
        return true;
    }

    private synchronized List<Chunk> take(boolean last) {
        if (last) {
            closed = true;
        }
        if (current.n == 0 && full.isEmpty()) {
            return null;
        }
        List<Chunk> out = new ArrayList<>(full);
        full.clear();
        if (current.n > 0) {
            out.add(current);
            current = free.isEmpty() ? new Chunk() : free.remove(free.size() - 1);
        }
        return out;
    }

    private synchronized void recycle(Chunk c, int rows) {
        held -= rows;
        if (free.size() < MAX_FREE_CHUNKS) {
            free.add(c);
        }
    }

    @Override
    public int drainInto(Bytes out, boolean last, java.util.function.IntConsumer flush) {
        List<Chunk> chunks = take(last);
        if (chunks == null) {
            return 0;
        }
        int rows = 0;
        long lastAck = -1;
        byte[] ackDigits = new byte[20];
        int ackLen = 0;
        for (Chunk c : chunks) {
            int at = 0;
            byte[] arena = c.arena;
            for (int i = 0; i < c.n; i++) {
                out.put(head);
                out.put(arena, at, c.seqLen[i]);
                at += c.seqLen[i];
                out.put(topicJson(c.topic[i]));
                out.putLong(c.partition[i]).put(OFFSET).putLong(c.offset[i]).put(middle);
                out.put(arena, at, c.tsLen[i]);
                at += c.tsLen[i];
                long ack = c.ackTs[i];
                if (ack != lastAck) { // the rows of one batch share their ack time
                    ackLen = Digits.length(Math.max(0, ack));
                    Digits.put(ackDigits, ackLen, Math.max(0, ack));
                    lastAck = ack;
                }
                out.put(ACK).put(ackDigits, 0, ackLen).put(END);
                c.topic[i] = null;
                rows++;
                if (out.len >= FLUSH_BYTES) {
                    flush.accept(rows);
                    rows = 0;
                }
            }
            int n = c.n;
            c.n = 0;
            c.used = 0;
            recycle(c, n);
        }
        return rows;
    }

    private static final byte[] OFFSET = ",\"offset\":".getBytes(StandardCharsets.US_ASCII);
    private static final byte[] ACK = ",\"ack_ts\":".getBytes(StandardCharsets.US_ASCII);
    private static final byte[] END = "}\n".getBytes(StandardCharsets.US_ASCII);

    /** ,"topic":"<name>","partition": -- per topic, built once. */
    private byte[] topicJson(String topic) {
        byte[] j = topicJson.get(topic);
        if (j == null) {
            j = (",\"topic\":" + AuditProducerInterceptor.Json.quote(topic) + ",\"partition\":")
                    .getBytes(StandardCharsets.UTF_8);
            topicJson.put(topic, j);
        }
        return j;
    }

    /** A growable byte buffer with digit writers (no String on the way). */
    static final class Bytes {
        byte[] buf;
        int len;

        Bytes(int cap) { buf = new byte[cap]; }

        private void room(int n) {
            if (len + n > buf.length) {
                buf = java.util.Arrays.copyOf(buf, Math.max(buf.length * 2, len + n));
            }
        }

        Bytes put(byte[] b) { return put(b, 0, b.length); }

        Bytes put(byte[] b, int off, int n) {
            room(n);
            System.arraycopy(b, off, buf, len, n);
            len += n;
            return this;
        }

        Bytes putLong(long v) {
            room(20);
            if (v < 0) {
                if (v == Long.MIN_VALUE) {
                    return put(Long.toString(v).getBytes(StandardCharsets.US_ASCII));
                }
                buf[len++] = '-';
                v = -v;
            }
            len += Digits.length(v);
            Digits.put(buf, len, v);
            return this;
        }

        void clear() { len = 0; }
    }
}
