package io.msgaudit.interceptors;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.security.SecureRandom;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicLong;

import org.apache.kafka.clients.producer.ProducerInterceptor;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.config.ConfigException;
import org.apache.kafka.common.errors.TransactionAbortedException;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.header.Headers;

/**
 * Audits an unchanged JVM producer (docs/design.md §3.4):
 * {@code interceptor.classes=io.msgaudit.interceptors.AuditProducerInterceptor} plus
 * {@code msgaudit.ledger.dir} and {@code msgaudit.producer.name}.
 *
 * <p>onSend appends audit.pid / audit.seq (per pid and topic) / audit.ts after the application's
 * headers; a record that already carries one of them is left alone. onAcknowledgement (the
 * kafka-clients 4.1+ form that receives the record's headers, KIP-512) writes one producer-ledger
 * row per stamped record, in the row format of audit/clients/producer.py, through
 * {@link LedgerSpool}. Older clients call the form without headers: the ack cannot be matched to
 * its seq, so it is counted ({@link #unmatchedAcks()}) and those messages show as unledgered.
 */
public class AuditProducerInterceptor<K, V> implements ProducerInterceptor<K, V> {
    static final String PID = "audit.pid";
    static final String SEQ = "audit.seq";
    static final String TS = "audit.ts";
    static final String ID = "audit.id"; // the packed form: <pid>/<seq>/<ts>
    static final int MAX_PID_CHARS = 64;
    private static final String[] KEYS = {"msgaudit.ledger.dir", "msgaudit.producer.name", "msgaudit.pid",
        "msgaudit.segment.max.bytes", "msgaudit.segment.max.age.ms", "msgaudit.flush.interval.ms",
        "msgaudit.buffer.max.rows", "msgaudit.header.form", "msgaudit.ledger.topic",
        "msgaudit.ledger.bootstrap.servers", "msgaudit.ledger.close.timeout.ms", "msgaudit.ledger.retry.ms",
        "msgaudit.ledger.delivery.timeout.ms"};

    private String pid;
    private byte[] pidBytes;
    private boolean packed = true; // msgaudit.header.form: packed (one audit.id header) or three
    private String head;
    private String txnJson = "null"; // the transactional.id as JSON, for the txn_id column
    private LedgerSpool spool;
    private AckRows acks;
    private LedgerShipper shipper; // null: no ledger topic
    private final ConcurrentHashMap<String, AtomicLong> seqs = new ConcurrentHashMap<>();
    /** The topic of the last stamped record and its counter (one immutable pair, so a racing
     *  thread sees either the old or the new pair, never half of each). */
    private static final class TopicSeq {
        final String topic;
        final AtomicLong next;
        TopicSeq(String topic, AtomicLong next) { this.topic = topic; this.next = next; }
    }
    private volatile TopicSeq lastTopic = new TopicSeq("", new AtomicLong());
    /** The last stamp time and its digits (immutable, shared by the records of one millisecond). */
    private static final class Stamp {
        final long ms;
        final byte[] digits;
        Stamp(long ms) {
            this.ms = ms;
            long v = Math.max(0, ms);
            this.digits = new byte[Digits.length(v)];
            Digits.put(digits, digits.length, v);
        }
    }
    private volatile Stamp lastStamp = new Stamp(0);
    private final AtomicLong unmatched = new AtomicLong();

    @Override
    public void configure(Map<String, ?> configs) {
        for (String key : configs.keySet()) {
            if (key.startsWith("msgaudit.") && !java.util.Arrays.asList(KEYS).contains(key)) {
                throw new ConfigException("unknown msgaudit property \"" + key + "\" (known: "
                        + String.join(", ", KEYS) + ")");
            }
        }
        String dirText = string(configs, "msgaudit.ledger.dir", ".msgaudit/ledger/producer");
        Path dir = Paths.get(dirText);
        if (!configs.containsKey("msgaudit.ledger.dir")) {
            try {
                Files.createDirectories(dir);
            } catch (IOException e) {
                throw new ConfigException("msgaudit.ledger.dir: cannot create " + dir + ": " + e.getMessage());
            }
        }
        checkDir(dir);
        String name = string(configs, "msgaudit.producer.name", "producer");
        if (name.isEmpty()) {
            throw new ConfigException("msgaudit.producer.name must not be empty");
        }
        pid = string(configs, "msgaudit.pid", null);
        if (pid == null) {
            byte[] rnd = new byte[6];
            new SecureRandom().nextBytes(rnd);
            StringBuilder hex = new StringBuilder();
            for (byte b : rnd) {
                hex.append(String.format("%02x", b));
            }
            int room = MAX_PID_CHARS - 12 - 1;
            pid = (name.length() > room ? name.substring(0, room) : name) + ":" + hex;
        } else if (pid.isEmpty() || pid.length() > MAX_PID_CHARS) {
            throw new ConfigException("msgaudit.pid must be 1 to " + MAX_PID_CHARS + " characters");
        }
        pidBytes = pid.getBytes(StandardCharsets.UTF_8);
        String form = string(configs, "msgaudit.header.form", "packed");
        if (!form.equals("packed") && !form.equals("three")) {
            throw new ConfigException("msgaudit.header.form: expected packed or three, got \"" + form + "\"");
        }
        packed = form.equals("packed");
        Object txn = configs.get("transactional.id");
        if (txn != null && !txn.toString().isEmpty()) {
            txnJson = Json.quote(txn.toString());
        }
        head = "{\"producer\":" + Json.quote(name) + ",\"pid\":" + Json.quote(pid) + ",\"seq\":";
        int maxRows = (int) Math.min(Integer.MAX_VALUE, positive(configs, "msgaudit.buffer.max.rows", 1_000_000));
        shipper = LedgerShipper.fromConfig(configs, "producer", dir, pid); // before the spool: may refuse the settings; started last
        acks = new AckRows(head, txnJson, maxRows);
        spool = new LedgerSpool(dir, "producer",
                positive(configs, "msgaudit.segment.max.bytes", 64L << 20),
                positive(configs, "msgaudit.segment.max.age.ms", 60_000),
                positive(configs, "msgaudit.flush.interval.ms", 200),
                maxRows);
        spool.setSource(acks);
        acks.onChunkFull(spool::wake);
        if (shipper != null) {
            spool.onSealed(shipper::sealed);
        }
        ProducerSettings.write(dir, configs, name, pid);
        if (shipper != null) {
            shipper.start(); // last: a configure() that failed above leaves no shipper thread running
        }
    }

    static String string(Map<String, ?> configs, String key, String dflt) {
        Object v = configs.get(key);
        return v == null ? dflt : v.toString();
    }

    static long positive(Map<String, ?> configs, String key, long dflt) {
        Object v = configs.get(key);
        if (v == null) {
            return dflt;
        }
        try {
            long x = Long.parseLong(v.toString().trim());
            if (x > 0) {
                return x;
            }
        } catch (NumberFormatException ignored) {
            // reported below
        }
        throw new ConfigException(key + ": expected a positive integer, got \"" + v + "\"");
    }

    static void checkDir(Path dir) {
        if (!Files.exists(dir)) {
            throw new ConfigException("msgaudit.ledger.dir: " + dir + ": No such file or directory (create the ledger folder first)");
        }
        if (!Files.isDirectory(dir)) {
            throw new ConfigException("msgaudit.ledger.dir: " + dir + " is not a folder");
        }
        try {
            Path probe = Files.createTempFile(dir, ".msgaudit-probe-", "");
            Files.delete(probe);
        } catch (IOException | SecurityException e) {
            throw new ConfigException("msgaudit.ledger.dir: cannot write in " + dir + ": " + e);
        }
    }

    @Override
    public ProducerRecord<K, V> onSend(ProducerRecord<K, V> record) {
        try {
            Headers headers = record.headers();
            if (headers.lastHeader(ID) != null || headers.lastHeader(PID) != null || headers.lastHeader(SEQ) != null
                    || headers.lastHeader(TS) != null) {
                return record; // already stamped (a copy keeping its identity): left alone
            }
            String topic = record.topic();
            TopicSeq last = lastTopic;
            if (!last.topic.equals(topic)) {
                last = new TopicSeq(topic, seqs.computeIfAbsent(topic, t -> new AtomicLong()));
                lastTopic = last;
            }
            long seq = last.next.getAndIncrement();
            long now = System.currentTimeMillis();
            if (packed) { // one array: <pid>/<seq>/<ts>
                Stamp stamp = lastStamp;
                if (stamp.ms != now) { // records of the same millisecond share the digits
                    stamp = new Stamp(now);
                    lastStamp = stamp;
                }
                int n = pidBytes.length;
                int sl = Digits.length(seq);
                byte[] v = new byte[n + 2 + sl + stamp.digits.length];
                System.arraycopy(pidBytes, 0, v, 0, n);
                v[n] = '/';
                Digits.put(v, n + 1 + sl, seq);
                v[n + 1 + sl] = '/';
                System.arraycopy(stamp.digits, 0, v, n + 2 + sl, stamp.digits.length);
                headers.add(new Stamped(this, v, seq, now));
            } else {
                headers.add(PID, pidBytes);
                headers.add(SEQ, Long.toString(seq).getBytes(StandardCharsets.US_ASCII));
                headers.add(TS, Long.toString(now).getBytes(StandardCharsets.US_ASCII));
            }
        } catch (RuntimeException e) {
            // read-only headers or anything unexpected: the record goes out unaudited, never fails
        }
        return record;
    }

    @Override
    public void onAcknowledgement(RecordMetadata metadata, Exception exception) {
        unmatched.incrementAndGet(); // kafka-clients before 4.1: no headers, no seq to match
    }

    @Override
    public void onAcknowledgement(RecordMetadata metadata, Exception exception, Headers headers) {
        if (headers == null) {
            unmatched.incrementAndGet();
            return;
        }
        Header id = headers.lastHeader(ID);
        byte[] a;
        byte[] b = null;
        int split = -1;
        long seq;
        long ts;
        if (id instanceof Stamped && ((Stamped) id).owner == this) { // stamped here: no parsing
            Stamped st = (Stamped) id;
            a = st.value;
            seq = st.seq;
            ts = st.ts;
        } else if (id != null) {
            byte[] v = id.value();
            int n = pidBytes.length;
            if (v == null || v.length < n + 4 || v[n] != '/'
                    || !java.util.Arrays.equals(v, 0, n, pidBytes, 0, n)) {
                return; // not stamped by this instance
            }
            for (int i = n + 1; i < v.length; i++) {
                if (v[i] == '/') {
                    split = i;
                    break;
                }
            }
            if (split < n + 2 || split == v.length - 1) {
                return;
            }
            a = v;
            seq = Digits.parse(v, n + 1, split);
            ts = Digits.parse(v, split + 1, v.length);
        } else {
            Header p = headers.lastHeader(PID);
            Header s = headers.lastHeader(SEQ);
            Header t = headers.lastHeader(TS);
            if (p == null || s == null || t == null || !java.util.Arrays.equals(p.value(), pidBytes)
                    || s.value() == null || t.value() == null) {
                return; // not stamped by this instance
            }
            a = s.value();
            b = t.value();
            seq = Digits.parse(a, 0, a.length);
            ts = Digits.parse(b, 0, b.length);
        }
        String topic = metadata != null ? metadata.topic() : null;
        if (topic == null) {
            unmatched.incrementAndGet();
            return;
        }
        if (exception == null && seq >= 0 && ts >= 0) {
            // on the producer's network thread: hold the numbers, the spool's thread formats the row
            if (!acks.add(seq, ts, topic, metadata.partition(), metadata.offset(), System.currentTimeMillis())) {
                spool.countDropped(1);
            }
            return;
        }
        // a failure, or digits that are not a plain number (a header of this pid not stamped
        // here): the row is formatted here, with the header's digits as they are
        String seqText;
        String tsText;
        if (b != null) {
            seqText = new String(a, StandardCharsets.US_ASCII);
            tsText = new String(b, StandardCharsets.US_ASCII);
        } else if (split > 0) {
            seqText = new String(a, pidBytes.length + 1, split - pidBytes.length - 1, StandardCharsets.US_ASCII);
            tsText = new String(a, split + 1, a.length - split - 1, StandardCharsets.US_ASCII);
        } else { // stamped here
            seqText = Long.toString(seq);
            tsText = Long.toString(ts);
        }
        int partition = metadata.partition() < 0 ? -1 : metadata.partition();
        StringBuilder row = new StringBuilder(256).append(head).append(seqText).append(",\"topic\":")
                .append(Json.quote(topic)).append(",\"partition\":").append(partition);
        if (exception == null) {
            row.append(",\"offset\":").append(metadata.offset()).append(",\"status\":\"acked\",\"error\":null");
        } else {
            // records still unsent when the application aborted its transaction
            String status = exception instanceof TransactionAbortedException ? "aborted" : "failed";
            row.append(",\"offset\":null,\"status\":\"").append(status).append("\",\"error\":")
                    .append(Json.quote(exception.getClass().getSimpleName()));
        }
        row.append(",\"txn_id\":").append(txnJson).append(",\"produce_ts\":").append(tsText).append(",\"ack_ts\":")
                .append(exception == null ? Long.toString(System.currentTimeMillis()) : "null").append('}');
        spool.append(row.toString());
    }

    /** The producer session id this instance stamps. */
    public String pid() { return pid; }

    /** Acks that could not be matched to a seq (kafka-clients before 4.1). */
    public long unmatchedAcks() { return unmatched.get(); }

    @Override
    public void close() {
        if (spool != null) {
            spool.close();
            long dropped = spool.dropped();
            if (dropped > 0 || unmatched.get() > 0) {
                System.err.println("msgaudit: producer " + pid + ": " + dropped + " ledger rows could not be recorded, "
                        + unmatched.get() + " acks without headers could not be matched");
            }
        }
        if (shipper != null) {
            shipper.close(); // the spool handed over its last segment when it sealed it
        }
    }

    /** The packed audit.id header as this instance adds it: the ack finds its own stamp by
     *  identity and its seq and produce time as numbers, without parsing. On the wire it is an
     *  ordinary header (key and value). */
    static final class Stamped implements Header {
        final Object owner;
        final byte[] value;
        final long seq;
        final long ts;

        Stamped(Object owner, byte[] value, long seq, long ts) {
            this.owner = owner;
            this.value = value;
            this.seq = seq;
            this.ts = ts;
        }

        @Override
        public String key() { return ID; }

        @Override
        public byte[] value() { return value; }

        @Override
        public String toString() {
            return "Stamped(key=" + ID + ", value=" + new String(value, StandardCharsets.UTF_8) + ")";
        }
    }

    static final class Json {
        static String quote(String s) {
            StringBuilder b = new StringBuilder(s.length() + 2).append('"');
            for (int i = 0; i < s.length(); i++) {
                char c = s.charAt(i);
                if (c == '"' || c == '\\') {
                    b.append('\\').append(c);
                } else if (c < 0x20) {
                    b.append(String.format("\\u%04x", (int) c));
                } else {
                    b.append(c);
                }
            }
            return b.append('"').toString();
        }
    }
}
