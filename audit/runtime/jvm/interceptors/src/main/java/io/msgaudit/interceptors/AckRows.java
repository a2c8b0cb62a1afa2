package io.msgaudit.interceptors;

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

/**
 * The acknowledged rows of one producer, kept as numbers until the spool's writer thread formats
 * them. {@link #add} runs on the producer's network thread for every acknowledged record: under a
 * short lock it stores the record's seq, produce time, topic, partition, offset and ack time (no
 * String, no JSON, no per-record object, and no reference to the record's header: a held
 * reference would keep it alive through young collections, which then copy it). A record that
 * continues the last held one (same topic, partition, produce and ack millisecond; seq and offset
 * one further) only lengthens it: the records of one produce batch usually make one <em>run</em>,
 * written as one ledger line with {@code "run":<k>} (docs/design.md §4.2), which ingest expands
 * into k rows. {@link #drainInto} (writer thread) turns every held run into one JSON line, in the
 * row format of audit/clients/producer.py. The writer drains every flush interval; a chunk that
 * fills while a quarter of {@code maxRows} is held wakes it early (waking it per chunk cost ~10 %
 * of a producer's throughput on two cores: a context switch per 1,024 lines beside the producer's
 * own threads).
 *
 * <p>The lines held here are bounded ({@code maxRows}); beyond it, and after the spool closed,
 * {@link #add} refuses and the caller counts the row as dropped.
 */
final class AckRows implements LedgerSpool.Source {
    static final int CHUNK = 1024;
    /** The longest run one line may carry (ingest quarantines longer ones). */
    static final int MAX_RUN = 65_536;
    // hand the rows to the file in pieces of about 64 KiB: a write of megabytes makes the kernel
    // allocate large page-cache folios, compacting memory inside the call on a fragmented machine
    private static final int FLUSH_BYTES = 64 << 10;
    private static final int MAX_FREE_CHUNKS = 64;

    /** One chunk of runs: parallel arrays, reused once written. */
    static final class Chunk {
        final long[] seq = new long[CHUNK];
        final long[] ts = new long[CHUNK];
        final String[] topic = new String[CHUNK]; // the producer's topic names: shared, long-lived
        final int[] partition = new int[CHUNK];
        final long[] offset = new long[CHUNK];
        final long[] ackTs = new long[CHUNK];
        final int[] run = new int[CHUNK];
        int n;
    }

    private final byte[] head;      // {"producer":...,"pid":...,"seq":
    private final byte[] middle;    // ,"status":"acked","error":null,"txn_id":<txn>,"produce_ts":
    private final int maxRows;
    private final int wakeAt;       // lines held at which a filled chunk wakes the writer early

    private Chunk current = new Chunk();
    private final List<Chunk> full = new ArrayList<>();
    private final List<Chunk> free = new ArrayList<>();
    private int held; // lines (runs), not records
    private boolean closed;
    private Runnable wake = () -> { };

    // writer thread only
    private final Map<String, byte[]> topicJson = new HashMap<>();

    AckRows(String head, String txnJson, int maxRows) {
        this.head = head.getBytes(StandardCharsets.UTF_8);
        this.middle = (",\"status\":\"acked\",\"error\":null,\"txn_id\":" + txnJson + ",\"produce_ts\":")
                .getBytes(StandardCharsets.UTF_8);
        this.maxRows = maxRows;
        this.wakeAt = Math.max(CHUNK, maxRows / 4);
    }

    /** Called (on the producer's network thread) when a chunk fills with {@code wakeAt} lines held. */
    void onChunkFull(Runnable r) { wake = r; }

    /** Hold one acknowledged record; false when it cannot be held (full, or the spool closed). */
    boolean add(long seq, long ts, String topic, int partition, long offset, long ackTs) {
        boolean wakeNow;
        synchronized (this) {
            if (closed) {
                return false;
            }
            Chunk c = current;
            int last = c.n - 1;
            if (last >= 0) {
                int k = c.run[last];
                if (seq == c.seq[last] + k && offset == c.offset[last] + k && ts == c.ts[last]
                        && ackTs == c.ackTs[last] && partition == c.partition[last] && k < MAX_RUN
                        && (topic == c.topic[last] || topic.equals(c.topic[last]))) {
                    c.run[last] = k + 1; // the same line, one record longer
                    return true;
                }
            }
            if (held >= maxRows) {
                return false;
            }
            boolean filled = c.n == CHUNK;
            wakeNow = filled && held >= wakeAt;
            if (filled) {
                full.add(c);
                c = free.isEmpty() ? new Chunk() : free.remove(free.size() - 1);
                current = c;
            }
            int i = c.n++;
            c.seq[i] = seq;
            c.ts[i] = ts;
            c.topic[i] = topic;
            c.partition[i] = partition;
            c.offset[i] = offset;
            c.ackTs[i] = ackTs;
            c.run[i] = 1;
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

    private synchronized void recycle(Chunk c, int lines) {
        held -= lines;
        if (free.size() < MAX_FREE_CHUNKS) {
            free.add(c);
        }
    }

    /** Writes the held runs as lines; the counts handed to {@code flush} and returned are records
     *  (table rows), so the spool's written and dropped counts stay in rows. */
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
            for (int i = 0; i < c.n; i++) {
                out.put(head).putLong(c.seq[i]);
                out.put(topicJson(c.topic[i]));
                out.putLong(c.partition[i]).put(OFFSET).putLong(c.offset[i]).put(middle).putLong(c.ts[i]);
                long ack = c.ackTs[i];
                if (ack != lastAck) { // the rows of one batch share their ack time
                    ackLen = Digits.length(Math.max(0, ack));
                    Digits.put(ackDigits, ackLen, Math.max(0, ack));
                    lastAck = ack;
                }
                out.put(ACK).put(ackDigits, 0, ackLen);
                int k = c.run[i];
                if (k > 1) {
                    out.put(RUN).putLong(k);
                }
                out.put(END);
                c.topic[i] = null;
                rows += k;
                if (out.len >= FLUSH_BYTES) {
                    flush.accept(rows);
                    rows = 0;
                }
            }
            int n = c.n;
            c.n = 0;
            recycle(c, n);
        }
        return rows;
    }

    private static final byte[] OFFSET = ",\"offset\":".getBytes(StandardCharsets.US_ASCII);
    private static final byte[] ACK = ",\"ack_ts\":".getBytes(StandardCharsets.US_ASCII);
    private static final byte[] RUN = ",\"run\":".getBytes(StandardCharsets.US_ASCII);
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
