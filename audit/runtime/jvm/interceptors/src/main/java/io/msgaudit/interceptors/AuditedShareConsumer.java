package io.msgaudit.interceptors;

import java.time.Duration;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.Collection;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.Properties;
import java.util.Set;
import java.util.TreeSet;

import org.apache.kafka.clients.consumer.AcknowledgeType;
import org.apache.kafka.clients.consumer.AcknowledgementCommitCallback;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.KafkaShareConsumer;
import org.apache.kafka.clients.consumer.ShareConsumer;
import org.apache.kafka.common.KafkaException;
import org.apache.kafka.common.Metric;
import org.apache.kafka.common.MetricName;
import org.apache.kafka.common.TopicIdPartition;
import org.apache.kafka.common.Uuid;
import org.apache.kafka.common.config.ConfigException;
import org.apache.kafka.common.errors.UnknownServerException;
import org.apache.kafka.common.metrics.KafkaMetric;
import org.apache.kafka.common.protocol.Errors;
import org.apache.kafka.common.serialization.Deserializer;

/**
 * A member of a Kafka share group (KIP-932) that writes the consumption ledger (docs/design.md
 * §4.2, §5.9): a {@link KafkaShareConsumer} (kafka-clients 4.1 or later) the application uses as
 * it would the plain one. {@code KafkaShareConsumer} refuses {@code interceptor.classes}
 * (ShareConsumerConfig lists it among the share group's unsupported settings), hence this wrapper.
 * It takes the consumer's properties plus the consumer interceptor's {@code msgaudit.*} ones
 * ({@code msgaudit.ledger.dir}, {@code msgaudit.consumer.name}, {@code msgaudit.ledger.topic}, ...),
 * runs in explicit acknowledgement mode and writes the rows of audit/clients/share_consumer.py:
 *
 * <ul>
 * <li>one {@code acquired} row per record {@code poll()} hands over: {@code attempt} = the broker's
 *     delivery count ({@link ConsumerRecord#deliveryCount()}), {@code consume_ts} = the time of the
 *     poll; poll() returns once they are written (a member killed while holding records leaves
 *     the evidence of those deliveries);</li>
 * <li>one {@code accepted} / {@code released} / {@code rejected} row per acknowledgement, written
 *     when the broker's answer arrives (the acknowledgement commit callback, which poll(),
 *     commitSync(), commitAsync() and close() serve): {@code error} null when the broker took it,
 *     else the Kafka error name ({@code INVALID_RECORD_STATE}: the lock had expired);
 *     {@code consume_ts} = when the member acknowledged it. An acknowledgement the broker had not
 *     answered by the end of close() gets {@code error} {@code unconfirmed}.</li>
 * </ul>
 *
 * <p>An application's own {@link #setAcknowledgementCommitCallback} callback still runs, after the
 * rows are queued. Acknowledgement types other than ACCEPT, RELEASE and REJECT (a later client's
 * lock renewal) are passed on and write no row: they do not end the delivery.
 */
public class AuditedShareConsumer<K, V> implements ShareConsumer<K, V> {
    static final String ACQUIRED = "acquired";
    static final String UNCONFIRMED = "unconfirmed";

    /** One ledger row of this member: a delivery ({@code acquired}) or an acknowledgement. */
    static final class Row {
        final String topic;
        final int partition;
        final long offset;
        final AuditId.Id id;
        final int attempt;
        final String outcome;
        final long ts;
        final String error;

        Row(String topic, int partition, long offset, AuditId.Id id, int attempt, String outcome, long ts,
            String error) {
            this.topic = topic;
            this.partition = partition;
            this.offset = offset;
            this.id = id;
            this.attempt = attempt;
            this.outcome = outcome;
            this.ts = ts;
            this.error = error;
        }

        Row answered(String err) { return new Row(topic, partition, offset, id, attempt, outcome, ts, err); }
    }

    private final KafkaShareConsumer<K, V> delegate;
    private final AuditConsumerInterceptor<K, V> audit;
    // acknowledgements the broker has not answered, by (topic, partition, offset); application thread only
    private final Map<List<Object>, ArrayDeque<Row>> awaiting = new HashMap<>();
    private AcknowledgementCommitCallback appCallback;
    private boolean closed;

    public AuditedShareConsumer(Properties properties) {
        this(toMap(properties), null, null);
    }

    public AuditedShareConsumer(Properties properties, Deserializer<K> keyDeserializer,
                                Deserializer<V> valueDeserializer) {
        this(toMap(properties), keyDeserializer, valueDeserializer);
    }

    public AuditedShareConsumer(Map<String, Object> configs) {
        this(configs, null, null);
    }

    public AuditedShareConsumer(Map<String, Object> configs, Deserializer<K> keyDeserializer,
                                Deserializer<V> valueDeserializer) {
        Object group = configs.get("group.id");
        if (group == null || group.toString().isEmpty()) {
            throw new ConfigException("AuditedShareConsumer: set group.id (the share group)");
        }
        Object mode = configs.get("share.acknowledgement.mode");
        if (mode != null && !"explicit".equals(mode.toString())) {
            throw new ConfigException("AuditedShareConsumer acknowledges explicitly: remove share.acknowledgement.mode="
                    + mode + " and acknowledge each record (acknowledge(record, AcknowledgeType))");
        }
        Map<String, Object> client = new HashMap<>();
        for (Map.Entry<String, Object> e : configs.entrySet()) {
            if (!e.getKey().startsWith("msgaudit.")) {
                client.put(e.getKey(), e.getValue());
            }
        }
        client.put("share.acknowledgement.mode", "explicit");
        audit = new AuditConsumerInterceptor<>();
        audit.configure(configs); // checks the msgaudit.* properties, opens the ledger spool
        try {
            delegate = new KafkaShareConsumer<>(client, keyDeserializer, valueDeserializer);
        } catch (RuntimeException e) {
            audit.close();
            throw e;
        }
        delegate.setAcknowledgementCommitCallback(this::answered);
    }

    private static Map<String, Object> toMap(Properties p) {
        Map<String, Object> m = new HashMap<>();
        for (String k : p.stringPropertyNames()) {
            m.put(k, p.getProperty(k));
        }
        for (Map.Entry<Object, Object> e : p.entrySet()) { // non-String values (e.g. a class) too
            m.put(e.getKey().toString(), e.getValue());
        }
        return m;
    }

    /** This member's id, the ledger column {@code consumer}. */
    public String instance() { return audit.instance(); }

    /** The wrapped consumer. Acknowledging through it bypasses the ledger. */
    public KafkaShareConsumer<K, V> delegate() { return delegate; }

    static String outcome(AcknowledgeType type) {
        switch (type.name()) {
            case "ACCEPT": return "accepted";
            case "RELEASE": return "released";
            case "REJECT": return "rejected";
            default: return null;
        }
    }

    /** The Kafka error name of a refused acknowledgement (as librdkafka names it for the Python client). */
    static String errorName(Exception e) {
        Errors err = Errors.forException(e);
        return err != Errors.UNKNOWN_SERVER_ERROR || e instanceof UnknownServerException ? err.name()
                : e.getClass().getSimpleName();
    }

    private void answered(Map<TopicIdPartition, Set<Long>> offsets, Exception exception) {
        String error = exception == null ? null : errorName(exception);
        List<Row> rows = new ArrayList<>();
        for (Map.Entry<TopicIdPartition, Set<Long>> e : offsets.entrySet()) {
            String topic = e.getKey().topic();
            int partition = e.getKey().partition();
            for (long off : new TreeSet<>(e.getValue())) {
                ArrayDeque<Row> waiting = awaiting.get(List.of(topic, partition, off));
                if (waiting == null) {
                    System.err.println("msgaudit: share consumer " + instance() + ": the broker answered an "
                            + "acknowledgement of " + topic + "[" + partition + "]@" + off + " this member did not send"
                            + " through AuditedShareConsumer (no ledger row)");
                    continue;
                }
                rows.add(waiting.removeFirst().answered(error));
                if (waiting.isEmpty()) {
                    awaiting.remove(List.of(topic, partition, off));
                }
            }
        }
        audit.shareRows(rows, false);
        if (appCallback != null) {
            appCallback.onComplete(offsets, exception);
        }
    }

    @Override
    public ConsumerRecords<K, V> poll(Duration timeout) {
        ConsumerRecords<K, V> records = delegate.poll(timeout);
        long now = System.currentTimeMillis();
        List<Row> rows = new ArrayList<>(records.count());
        for (ConsumerRecord<K, V> r : records) {
            int attempt = r.deliveryCount().map(Short::intValue).orElse(1);
            rows.add(new Row(r.topic(), r.partition(), r.offset(), AuditId.parse(r.headers()), attempt, ACQUIRED, now,
                    null));
        }
        audit.shareRows(rows, true); // durable before the application sees them
        return records;
    }

    @Override
    public void acknowledge(ConsumerRecord<K, V> record) {
        acknowledge(record, AcknowledgeType.ACCEPT);
    }

    @Override
    public void acknowledge(ConsumerRecord<K, V> record, AcknowledgeType type) {
        delegate.acknowledge(record, type); // throws for a record this member does not hold: no row then
        await(record.topic(), record.partition(), record.offset(), AuditId.parse(record.headers()),
                record.deliveryCount().map(Short::intValue).orElse(1), type);
    }

    /** kafka-clients 4.2 and later (ShareConsumer's form for a record poll() could not deserialize):
     *  acknowledged like the others; its row has pid/seq null and attempt 1, the delivery unseen. */
    public void acknowledge(String topic, int partition, long offset, AcknowledgeType type) {
        call("acknowledge", new Class<?>[] {String.class, int.class, long.class, AcknowledgeType.class},
                topic, partition, offset, type);
        await(topic, partition, offset, null, 1, type);
    }

    /** kafka-clients 4.2 and later: the acquisition lock's duration the broker gave this member. */
    @SuppressWarnings("unchecked")
    public Optional<Integer> acquisitionLockTimeoutMs() {
        return (Optional<Integer>) call("acquisitionLockTimeoutMs", new Class<?>[0]);
    }

    /** A method of the wrapped consumer that kafka-clients 4.1 lacks (this jar compiles against 4.1). */
    private Object call(String method, Class<?>[] types, Object... args) {
        java.lang.reflect.Method m;
        try {
            m = delegate.getClass().getMethod(method, types);
        } catch (NoSuchMethodException e) {
            throw new UnsupportedOperationException("ShareConsumer." + method + " needs kafka-clients 4.2 or later");
        }
        try {
            return m.invoke(delegate, args);
        } catch (IllegalAccessException e) {
            throw new IllegalStateException(e);
        } catch (java.lang.reflect.InvocationTargetException e) {
            Throwable t = e.getCause();
            if (t instanceof RuntimeException) {
                throw (RuntimeException) t;
            }
            if (t instanceof Error) {
                throw (Error) t;
            }
            throw new KafkaException(t);
        }
    }

    /** Hold an acknowledgement's row until the broker answers it (ACCEPT, RELEASE, REJECT; a lock
     *  renewal does not end the delivery and writes none). */
    private void await(String topic, int partition, long offset, AuditId.Id id, int attempt, AcknowledgeType type) {
        String outcome = outcome(type);
        if (outcome != null) {
            awaiting.computeIfAbsent(List.of(topic, partition, offset), k -> new ArrayDeque<>())
                    .addLast(new Row(topic, partition, offset, id, attempt, outcome, System.currentTimeMillis(), null));
        }
    }

    @Override
    public Map<TopicIdPartition, Optional<KafkaException>> commitSync() { return delegate.commitSync(); }

    @Override
    public Map<TopicIdPartition, Optional<KafkaException>> commitSync(Duration timeout) {
        return delegate.commitSync(timeout);
    }

    @Override
    public void commitAsync() { delegate.commitAsync(); }

    @Override
    public void setAcknowledgementCommitCallback(AcknowledgementCommitCallback callback) { appCallback = callback; }

    @Override
    public Set<String> subscription() { return delegate.subscription(); }

    @Override
    public void subscribe(Collection<String> topics) { delegate.subscribe(topics); }

    @Override
    public void unsubscribe() { delegate.unsubscribe(); }

    @Override
    public Uuid clientInstanceId(Duration timeout) { return delegate.clientInstanceId(timeout); }

    @Override
    public Map<MetricName, ? extends Metric> metrics() { return delegate.metrics(); }

    @Override
    public void registerMetricForSubscription(KafkaMetric metric) { delegate.registerMetricForSubscription(metric); }

    @Override
    public void unregisterMetricFromSubscription(KafkaMetric metric) { delegate.unregisterMetricFromSubscription(metric); }

    @Override
    public void wakeup() { delegate.wakeup(); }

    @Override
    public void close() { close(Duration.ofSeconds(30)); }

    /** Sends what is acknowledged, leaves the group, seals the ledger; an acknowledgement still
     *  unanswered gets a row with {@code error} {@code unconfirmed}. Idempotent. */
    @Override
    public void close(Duration timeout) {
        if (closed) {
            return;
        }
        closed = true;
        try {
            if (!awaiting.isEmpty()) {
                try {
                    delegate.commitSync(timeout);
                } catch (RuntimeException e) {
                    System.err.println("msgaudit: share consumer " + instance() + ": acknowledging at close failed: " + e);
                }
            }
            delegate.close(timeout);
        } finally {
            List<Row> rows = new ArrayList<>();
            for (ArrayDeque<Row> waiting : awaiting.values()) {
                for (Row r : waiting) {
                    rows.add(r.answered(UNCONFIRMED));
                }
            }
            awaiting.clear();
            audit.shareRows(rows, false);
            audit.close();
        }
    }
}
