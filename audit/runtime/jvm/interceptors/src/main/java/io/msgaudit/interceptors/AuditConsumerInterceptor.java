package io.msgaudit.interceptors;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.security.SecureRandom;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicLong;

import org.apache.kafka.clients.consumer.ConsumerInterceptor;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.OffsetAndMetadata;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.config.ConfigException;

/**
 * Audits an unchanged JVM consumer group (docs/design.md §3.4, §5.3):
 * {@code interceptor.classes=io.msgaudit.interceptors.AuditConsumerInterceptor} plus
 * {@code msgaudit.ledger.dir} (the consumer/ folder ingest reads) and optionally
 * {@code msgaudit.consumer.name}. A group member that reads a MirrorMaker 2 copy after failing
 * over sets {@code msgaudit.cluster} to the mirror's name: its rows carry it in {@code cluster} and
 * name the audited topic ({@code msgaudit.source.topics}, else the copy's name after its first '.').
 *
 * <p>Writes consumption-ledger rows in the row format of audit/clients/consumer.py: one
 * {@code handed} row per record {@code poll()} hands to the application (from onConsume), and one
 * {@code committed} row per partition whose committed offset changed (from onCommit; its offset is
 * the committed offset, the next one to read; pid and seq null). {@code consume_seq} counts this
 * instance's rows from 0. onConsume returns only once its rows are written to the segment file (at
 * most {@code msgaudit.handover.wait.ms}; a longer wait is counted, never an error), so every
 * record the application was handed is on disk before its offset can be committed, even when the
 * process is killed. Records are returned unchanged; nothing here throws into the consumer after
 * configure.
 */
public class AuditConsumerInterceptor<K, V> implements ConsumerInterceptor<K, V> {
    static final String HANDED = "handed";
    static final String COMMITTED = "committed";
    private static final String[] KEYS = {"msgaudit.ledger.dir", "msgaudit.consumer.name",
        "msgaudit.segment.max.bytes", "msgaudit.segment.max.age.ms", "msgaudit.flush.interval.ms",
        "msgaudit.buffer.max.rows", "msgaudit.handover.wait.ms", "msgaudit.ledger.topic",
        "msgaudit.ledger.bootstrap.servers", "msgaudit.ledger.close.timeout.ms", "msgaudit.ledger.retry.ms",
        "msgaudit.ledger.delivery.timeout.ms", "msgaudit.cluster", "msgaudit.source.topics"};

    private String instance;
    private String clusterJson; // null: the audited cluster; else the mirror's name as JSON (column cluster)
    private final Map<String, String> sourceTopics = new ConcurrentHashMap<>(); // copy name -> audited topic
    private String head;
    private long waitMs;
    private LedgerSpool spool;
    private LedgerShipper shipper; // null: no ledger topic
    private final AtomicLong consumeSeq = new AtomicLong();
    private final ConcurrentHashMap<TopicPartition, Long> lastCommitted = new ConcurrentHashMap<>();
    private final AtomicLong late = new AtomicLong();
    private final AtomicLong errors = new AtomicLong();

    @Override
    public void configure(Map<String, ?> configs) {
        for (String key : configs.keySet()) {
            if (key.startsWith("msgaudit.") && !Arrays.asList(KEYS).contains(key)) {
                throw new ConfigException("unknown msgaudit property \"" + key + "\" (known: "
                        + String.join(", ", KEYS) + ")");
            }
        }
        Object group = configs.get("group.id");
        if (group == null || group.toString().isEmpty()) {
            throw new ConfigException("AuditConsumerInterceptor audits consumer groups: set group.id");
        }
        Path dir = Paths.get(AuditProducerInterceptor.string(configs, "msgaudit.ledger.dir", ".msgaudit/ledger/consumer"));
        if (!configs.containsKey("msgaudit.ledger.dir")) {
            try {
                Files.createDirectories(dir);
            } catch (IOException e) {
                throw new ConfigException("msgaudit.ledger.dir: cannot create " + dir + ": " + e.getMessage());
            }
        }
        AuditProducerInterceptor.checkDir(dir);
        String name = AuditProducerInterceptor.string(configs, "msgaudit.consumer.name", null);
        if (name == null) {
            name = hostname() + "-" + ProcessHandle.current().pid();
        } else if (name.isEmpty()) {
            throw new ConfigException("msgaudit.consumer.name must not be empty");
        }
        byte[] rnd = new byte[6];
        new SecureRandom().nextBytes(rnd);
        StringBuilder hex = new StringBuilder();
        for (byte b : rnd) {
            hex.append(String.format("%02x", b));
        }
        int room = AuditProducerInterceptor.MAX_PID_CHARS - 12 - 1;
        instance = (name.length() > room ? name.substring(0, room) : name) + ":" + hex;
        head = "{\"group\":" + AuditProducerInterceptor.Json.quote(group.toString()) + ",\"consumer\":"
                + AuditProducerInterceptor.Json.quote(instance) + ",\"consume_seq\":";
        waitMs = AuditProducerInterceptor.positive(configs, "msgaudit.handover.wait.ms", 5_000);
        String cluster = AuditProducerInterceptor.string(configs, "msgaudit.cluster", null);
        if (cluster != null) {
            if (cluster.isEmpty()) {
                throw new ConfigException("msgaudit.cluster must not be empty (the mirror's name, mirrors[].name)");
            }
            clusterJson = AuditProducerInterceptor.Json.quote(cluster);
        }
        String mapping = AuditProducerInterceptor.string(configs, "msgaudit.source.topics", null);
        if (mapping != null) {
            if (cluster == null) {
                throw new ConfigException("msgaudit.source.topics needs msgaudit.cluster (it names a mirror's copies)");
            }
            for (String pair : mapping.split(",")) {
                int eq = pair.indexOf('=');
                if (eq <= 0 || eq == pair.length() - 1) {
                    throw new ConfigException("msgaudit.source.topics: expected copy=topic[,copy=topic...], got \""
                            + mapping + "\" (e.g. src.orders=orders)");
                }
                sourceTopics.put(pair.substring(0, eq).trim(), pair.substring(eq + 1).trim());
            }
        }
        shipper = LedgerShipper.fromConfig(configs, "consumer", dir, instance); // may refuse the settings
        spool = new LedgerSpool(dir, "consumer",
                AuditProducerInterceptor.positive(configs, "msgaudit.segment.max.bytes", 64L << 20),
                AuditProducerInterceptor.positive(configs, "msgaudit.segment.max.age.ms", 60_000),
                AuditProducerInterceptor.positive(configs, "msgaudit.flush.interval.ms", 200),
                (int) Math.min(Integer.MAX_VALUE,
                        AuditProducerInterceptor.positive(configs, "msgaudit.buffer.max.rows", 1_000_000)));
        if (shipper != null) {
            spool.onSealed(shipper::sealed);
            shipper.start(); // last: a configure() that failed above leaves no shipper thread running
        }
    }

    private static String hostname() {
        String h = System.getenv("HOSTNAME");
        if (h != null && !h.isEmpty()) {
            return h;
        }
        try {
            h = new String(Files.readAllBytes(Paths.get("/proc/sys/kernel/hostname")), StandardCharsets.UTF_8).trim();
            return h.isEmpty() ? "jvm" : h;
        } catch (IOException | RuntimeException e) {
            return "jvm";
        }
    }

    /** The audited topic of a record read from `topic`: itself on the audited cluster; on a mirror's
     *  target, from msgaudit.source.topics, else the copy's name after its first '.' (MM2's default
     *  replication policy, {@code <source-alias>.<topic>}). */
    String auditedTopic(String topic) {
        if (clusterJson == null) {
            return topic;
        }
        return sourceTopics.computeIfAbsent(topic, t -> t.substring(t.indexOf('.') + 1));
    }

    private String row(String copy, int partition, long offset, AuditId.Id id, String outcome, int attempt, long ts) {
        return row(copy, partition, offset, id, outcome, attempt, ts, false, null);
    }

    /** One row; {@code withError}: with the {@code error} column ({@code error}, null when none),
     *  as a share group member's rows carry it (AuditedShareConsumer). */
    private String row(String copy, int partition, long offset, AuditId.Id id, String outcome, int attempt, long ts,
                       boolean withError, String error) {
        String topic = auditedTopic(copy);
        StringBuilder b = new StringBuilder(256).append(head).append(consumeSeq.getAndIncrement())
                .append(",\"topic\":").append(AuditProducerInterceptor.Json.quote(topic))
                .append(",\"partition\":").append(partition).append(",\"offset\":").append(offset);
        if (id == null) {
            b.append(",\"pid\":null,\"seq\":null");
        } else {
            b.append(",\"pid\":").append(AuditProducerInterceptor.Json.quote(id.pid)).append(",\"seq\":").append(id.seq);
        }
        b.append(",\"outcome\":\"").append(outcome).append("\",\"attempt\":").append(attempt)
                .append(",\"consume_ts\":").append(ts);
        if (withError) {
            b.append(",\"error\":").append(error == null ? "null" : AuditProducerInterceptor.Json.quote(error));
        }
        if (clusterJson != null) { // optional: a row without it is from the audited cluster
            b.append(",\"cluster\":").append(clusterJson);
        }
        if (id != null) { // optional: the message's produce time (audit.ts), so latency needs no join
            b.append(",\"produce_ts\":").append(id.tsMs);
        }
        return b.append('}').toString();
    }

    @Override
    public ConsumerRecords<K, V> onConsume(ConsumerRecords<K, V> records) {
        try {
            if (records == null || records.isEmpty()) {
                return records;
            }
            long now = System.currentTimeMillis();
            List<String> rows = new ArrayList<>(records.count());
            long ticket;
            synchronized (this) { // consume_seq follows the rows' order in the file
                for (ConsumerRecord<K, V> r : records) {
                    rows.add(row(r.topic(), r.partition(), r.offset(), AuditId.parse(r.headers()), HANDED, 1, now));
                }
                ticket = spool.enqueue(rows);
            }
            if (!spool.awaitWritten(ticket, waitMs)) {
                late.incrementAndGet();
            }
        } catch (RuntimeException e) {
            errors.incrementAndGet(); // never fail the application's poll()
        }
        return records;
    }

    @Override
    public void onCommit(Map<TopicPartition, OffsetAndMetadata> offsets) {
        try {
            long now = System.currentTimeMillis();
            List<String> rows = new ArrayList<>();
            synchronized (this) {
                for (Map.Entry<TopicPartition, OffsetAndMetadata> e : offsets.entrySet()) {
                    if (e.getValue() == null) {
                        continue;
                    }
                    long off = e.getValue().offset();
                    Long prev = lastCommitted.put(e.getKey(), off);
                    if (prev == null || prev != off) {
                        rows.add(row(e.getKey().topic(), e.getKey().partition(), off, null, COMMITTED, 1, now));
                    }
                }
                if (!rows.isEmpty()) {
                    spool.enqueue(rows); // the writer thread writes it shortly; never waited for
                }
            }
        } catch (RuntimeException e) {
            errors.incrementAndGet();
        }
    }

    /**
     * Queue share group rows (AuditedShareConsumer, docs/design.md §5.9), in this order with the
     * next consume_seq values. With {@code await} it returns once they are written (at most
     * {@code msgaudit.handover.wait.ms}; a longer wait is counted).
     */
    void shareRows(List<AuditedShareConsumer.Row> rows, boolean await) {
        if (rows.isEmpty()) {
            return;
        }
        List<String> lines = new ArrayList<>(rows.size());
        long ticket;
        synchronized (this) {
            for (AuditedShareConsumer.Row r : rows) {
                lines.add(row(r.topic, r.partition, r.offset, r.id, r.outcome, r.attempt, r.ts, true, r.error));
            }
            ticket = spool.enqueue(lines);
        }
        if (await && !spool.awaitWritten(ticket, waitMs)) {
            late.incrementAndGet();
        }
    }

    /** This instance's id, the ledger column {@code consumer}. */
    public String instance() { return instance; }

    @Override
    public void close() {
        if (spool != null) {
            spool.close();
            long dropped = spool.dropped();
            if (dropped > 0 || late.get() > 0 || errors.get() > 0) {
                System.err.println("msgaudit: consumer " + instance + ": " + dropped
                        + " ledger rows could not be recorded, " + late.get() + " polls returned before their rows"
                        + " were written, " + errors.get() + " unexpected errors");
            }
        }
        if (shipper != null) {
            shipper.close();
        }
    }
}
