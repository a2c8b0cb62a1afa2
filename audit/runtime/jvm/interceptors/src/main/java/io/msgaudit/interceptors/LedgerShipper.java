package io.msgaudit.interceptors;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.DirectoryStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;

import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.config.ConfigException;
import org.apache.kafka.common.serialization.ByteArraySerializer;

/**
 * Ships an interceptor's sealed spool segments to the ledger topic (docs/design.md §4.2, "Ledger
 * transport"), with the keys and markers of audit/clients/ledger_ship.py: every line of a
 * segment is one record, key {@code <kind>/<segment stem>:<line from 0>}, value the line
 * unchanged; when the topic acknowledged every line, {@code <stem>.shipped} is written beside the
 * segment. A segment that was not fully acknowledged stays unmarked and is tried again (every
 * {@code retryMs}, longer while the topic stays down), by {@code msgaudit ship}, or by the next
 * client started on the same folder (it ships the folder's sealed unmarked segments first).
 *
 * <p>Everything runs on one daemon thread with its own KafkaProducer, built from fresh properties
 * (no {@code interceptor.classes}: it never loads an interceptor): acks=all, idempotence off (a
 * duplicate is harmless, the key names the row), lz4. The host's threads only hand over a sealed
 * segment's path; nothing here blocks them or throws into them. {@link #close} waits at most its
 * bound, then abandons what is in flight (those segments stay unmarked, counted and reported once).
 */
final class LedgerShipper implements AutoCloseable {
    static final String SHIPPED_SUFFIX = ".shipped";
    static final String SEALED_SUFFIX = ".jsonl";
    /** The shipper producer's linger.ms; msgaudit.ledger.delivery.timeout.ms must exceed it. */
    static final long LINGER_MS = 20;
    /** The shipper producer's buffer.memory: a segment is streamed line by line, and send()
     *  waits (on the shipper thread) while this much is unacknowledged, so a shipped segment
     *  never holds more than this in the host's heap. */
    static final long BUFFER_MEMORY = 4L << 20;
    /** The connection settings a host client passes on to the shipper's producer. */
    private static final List<String> PASSED_PREFIXES = Arrays.asList("security.", "sasl.", "ssl.",
            "client.dns.lookup");

    private final String topic;
    private final String kind;
    private final Path dir;
    private final Properties props;
    private final long retryMs;
    private final long closeMs;
    private final Object lock = new Object();
    private final ArrayDeque<Path> todo = new ArrayDeque<>(); // guarded by lock
    private final List<Path> failed = new ArrayList<>(); // shipper thread only
    private final Thread thread;
    private final AtomicReference<KafkaProducer<byte[], byte[]>> producer = new AtomicReference<>();
    /** Segments handed over and not marked yet (any thread). */
    private final java.util.Set<Path> unshipped = java.util.concurrent.ConcurrentHashMap.newKeySet();
    private final AtomicLong rowsShipped = new AtomicLong();
    private final AtomicLong segmentsMarked = new AtomicLong();
    private volatile boolean closing;
    private volatile boolean producerTaken; // close() took (and closed) the producer
    private volatile long deadlineNanos = Long.MAX_VALUE;
    private boolean reported; // shipper thread only: an outage is logged once

    /**
     * The shipper of {@code dir} (a spool folder of {@code kind} producer or consumer), or null
     * when {@code msgaudit.ledger.topic} is not set. Bad settings are a ConfigException.
     */
    static LedgerShipper fromConfig(Map<String, ?> configs, String kind, Path dir, String clientId) {
        String topic = AuditProducerInterceptor.string(configs, "msgaudit.ledger.topic", null);
        if (topic == null) {
            if (configs.containsKey("msgaudit.ledger.bootstrap.servers")) {
                throw new ConfigException("msgaudit.ledger.bootstrap.servers is set but msgaudit.ledger.topic is not");
            }
            return null;
        }
        if (topic.trim().isEmpty()) {
            throw new ConfigException("msgaudit.ledger.topic must not be empty");
        }
        Object servers = configs.get("msgaudit.ledger.bootstrap.servers");
        if (servers == null) {
            servers = configs.get("bootstrap.servers");
        }
        String bootstrap = servers instanceof List ? String.join(",", ((List<?>) servers).stream()
                .map(Object::toString).toArray(String[]::new)) : servers == null ? "" : servers.toString();
        if (bootstrap.trim().isEmpty()) {
            throw new ConfigException("msgaudit.ledger.topic: no bootstrap.servers for the ledger topic "
                    + "(set msgaudit.ledger.bootstrap.servers)");
        }
        Properties p = new Properties();
        if (!configs.containsKey("msgaudit.ledger.bootstrap.servers")) {
            // the ledger topic is on the client's own cluster: reach it the way the client does
            for (Map.Entry<String, ?> e : configs.entrySet()) {
                for (String prefix : PASSED_PREFIXES) {
                    if (e.getKey().startsWith(prefix) && e.getValue() != null) {
                        p.put(e.getKey(), e.getValue());
                    }
                }
            }
        }
        p.put("bootstrap.servers", bootstrap);
        p.put("acks", "all");
        p.put("enable.idempotence", "false");
        p.put("linger.ms", Long.toString(LINGER_MS));
        p.put("buffer.memory", Long.toString(BUFFER_MEMORY));
        p.put("compression.type", lz4Available() ? "lz4" : "none");
        long deliveryMs = AuditProducerInterceptor.positive(configs, "msgaudit.ledger.delivery.timeout.ms", 120_000);
        if (deliveryMs <= LINGER_MS || deliveryMs > Integer.MAX_VALUE) {
            // kafka-clients refuses delivery.timeout.ms < linger.ms + request.timeout.ms, and the
            // producer is built later on the shipper thread: refuse it here, where the user sees it
            throw new ConfigException("msgaudit.ledger.delivery.timeout.ms: expected " + (LINGER_MS + 1) + ".."
                    + Integer.MAX_VALUE + " (more than the shipper's linger.ms " + LINGER_MS + "), got \""
                    + configs.get("msgaudit.ledger.delivery.timeout.ms") + "\"");
        }
        p.put("delivery.timeout.ms", Long.toString(deliveryMs));
        p.put("request.timeout.ms", Long.toString(Math.min(30_000, deliveryMs - LINGER_MS)));
        p.put("max.block.ms", "10000"); // a metadata wait, on the shipper thread only
        p.put("client.id", "msgaudit-ledger-" + clientId);
        p.put("key.serializer", ByteArraySerializer.class.getName());
        p.put("value.serializer", ByteArraySerializer.class.getName());
        return new LedgerShipper(topic, kind, dir, p,
                AuditProducerInterceptor.positive(configs, "msgaudit.ledger.retry.ms", 5_000),
                AuditProducerInterceptor.positive(configs, "msgaudit.ledger.close.timeout.ms", 15_000));
    }

    private static boolean lz4Available() {
        try {
            Class.forName("net.jpountz.lz4.LZ4Factory", false, LedgerShipper.class.getClassLoader());
            return true;
        } catch (ClassNotFoundException | LinkageError e) {
            return false;
        }
    }

    private LedgerShipper(String topic, String kind, Path dir, Properties props, long retryMs, long closeMs) {
        this.topic = topic;
        this.kind = kind;
        this.dir = dir;
        this.props = props;
        this.retryMs = retryMs;
        this.closeMs = closeMs;
        this.thread = new Thread(this::run, "msgaudit-ledger-ship-" + kind);
        this.thread.setDaemon(true);
    }

    /** Start the shipper thread (once the interceptor's spool is set up: a configure() that
     *  fails before this leaves no thread behind). */
    void start() {
        thread.start();
    }

    /** The spool's seal hook: a sealed segment to ship (any thread; never blocks). */
    void sealed(Path segment) {
        synchronized (lock) {
            if (closing && thread.getState() == Thread.State.TERMINATED) {
                return; // too late: it stays unmarked for `msgaudit ship`
            }
            todo.add(segment);
            unshipped.add(segment);
            lock.notifyAll();
        }
    }

    static Path marker(Path segment) {
        return segment.resolveSibling(stem(segment) + SHIPPED_SUFFIX);
    }

    static String stem(Path segment) {
        String name = segment.getFileName().toString();
        return name.endsWith(SEALED_SUFFIX) ? name.substring(0, name.length() - SEALED_SUFFIX.length()) : name;
    }

    /** Sealed {@code <kind>-*.jsonl} segments of {@code dir} without a marker, oldest name first
     *  (a folder may be shared by a producer and a consumer interceptor: each ships its own). */
    static List<Path> unmarked(Path dir, String kind) {
        List<Path> out = new ArrayList<>();
        try (DirectoryStream<Path> ds = Files.newDirectoryStream(dir, kind + "-*" + SEALED_SUFFIX)) {
            for (Path p : ds) {
                if (!Files.exists(marker(p))) {
                    out.add(p);
                }
            }
        } catch (IOException | RuntimeException e) {
            // an unreadable folder: the spool reports its own errors
        }
        out.sort(null);
        return out;
    }

    long rowsShipped() { return rowsShipped.get(); }

    long segmentsMarked() { return segmentsMarked.get(); }

    private void run() {
        try {
            synchronized (lock) { // left by earlier clients on this folder (scanned here, not on the host's thread)
                List<Path> left = unmarked(dir, kind);
                for (int i = left.size() - 1; i >= 0; i--) { // oldest first, before what was sealed since
                    if (!todo.contains(left.get(i))) {
                        todo.addFirst(left.get(i));
                    }
                    unshipped.add(left.get(i));
                }
            }
            loop();
        } catch (Throwable t) { // an Error too: said in one line, never a silent death of the thread
            try {
                System.err.println("msgaudit: ledger topic " + topic + ": the " + kind + " shipper stopped: " + t
                        + "; unshipped segments stay in " + dir + " for `msgaudit ship` (or the next client on"
                        + " this folder)");
            } catch (Throwable ignored) {
                // nothing left to do
            }
        }
    }

    private void loop() {
        long backoff = retryMs;
        long nextRetry = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(retryMs);
        boolean retriedAtClose = false;
        while (true) {
            Path seg;
            synchronized (lock) {
                while (todo.isEmpty() && !closing && (failed.isEmpty() || System.nanoTime() < nextRetry)) {
                    try {
                        long waitMs = failed.isEmpty() ? 1_000
                                : Math.max(1, TimeUnit.NANOSECONDS.toMillis(nextRetry - System.nanoTime()));
                        lock.wait(Math.min(waitMs, 1_000));
                    } catch (InterruptedException e) {
                        return;
                    }
                }
                if (todo.isEmpty() && !failed.isEmpty() && (closing ? !retriedAtClose : System.nanoTime() >= nextRetry)) {
                    todo.addAll(failed); // try again (at close: once, within the close bound)
                    failed.clear();
                    retriedAtClose = closing;
                }
                seg = todo.poll();
                if (seg == null) {
                    if (closing) {
                        return;
                    }
                    continue;
                }
            }
            if (System.nanoTime() > deadlineNanos) {
                failed.add(seg);
                continue;
            }
            boolean ok;
            try {
                ok = ship(seg);
            } catch (RuntimeException | LinkageError e) {
                ok = false;
                Throwable cause = e.getCause() != null ? e.getCause() : e; // "Failed to construct..." says little
                reportOnce("ledger topic " + topic + ": " + e + (cause != e ? " (" + cause + ")" : ""));
            }
            if (ok) {
                backoff = retryMs;
                reported = false;
            } else {
                failed.add(seg);
                // the topic is not taking rows: the rest waits for the next try
                synchronized (lock) {
                    failed.addAll(todo);
                    todo.clear();
                }
                nextRetry = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(backoff);
                backoff = Math.min(backoff * 2, 120_000);
            }
        }
    }

    private KafkaProducer<byte[], byte[]> producer() {
        KafkaProducer<byte[], byte[]> p = producer.get();
        if (p == null) {
            if (closing && System.nanoTime() > deadlineNanos) {
                throw new IllegalStateException("closed"); // close() gave up: no new producer
            }
            ClassLoader saved = Thread.currentThread().getContextClassLoader();
            try { // kafka-clients loads its classes (serializers, compression) through this loader
                Thread.currentThread().setContextClassLoader(LedgerShipper.class.getClassLoader());
                p = new KafkaProducer<>(props);
            } finally {
                Thread.currentThread().setContextClassLoader(saved);
            }
            producer.set(p);
            if (producerTaken) { // close() gave up while this was being built: nobody else closes it
                producer.set(null);
                p.close(Duration.ZERO);
                throw new IllegalStateException("closed");
            }
        }
        return p;
    }

    /** Ship every line of one sealed segment and mark it when all are acknowledged. */
    private boolean ship(Path seg) {
        if (Files.exists(marker(seg))) {
            unshipped.remove(seg);
            return true;
        }
        if (!Files.exists(seg)) {
            unshipped.remove(seg);
            return true; // removed meanwhile (e.g. by retention): nothing left to ship
        }
        KafkaProducer<byte[], byte[]> p = producer();
        String keyHead = kind + "/" + stem(seg) + ":";
        Acks acks = new Acks();
        long sent = 0;
        try (InputStream in = Files.newInputStream(seg)) {
            byte[] buf = new byte[1 << 16];
            ByteArrayOutputStream line = new ByteArrayOutputStream(512);
            int n;
            while ((n = in.read(buf)) >= 0 || line.size() > 0) {
                // n < 0 with a partial line held: a last line without a newline still counts
                int from = 0;
                for (int i = 0; i <= Math.max(n, 0); i++) {
                    boolean eol = n < 0 ? i == 0 : i < n && buf[i] == '\n';
                    if (!eol) {
                        continue;
                    }
                    byte[] value;
                    if (line.size() == 0) {
                        value = Arrays.copyOfRange(buf, from, Math.max(from, i));
                    } else {
                        line.write(buf, from, Math.max(0, i - from));
                        value = line.toByteArray();
                        line.reset();
                    }
                    from = i + 1;
                    byte[] key = (keyHead + sent).getBytes(StandardCharsets.UTF_8);
                    try { // blocks (this thread only) while buffer.memory is taken: the memory bound
                        p.send(new ProducerRecord<>(topic, key, value), acks);
                    } catch (RuntimeException e) {
                        reportOnce("ledger topic " + topic + " did not take the rows of " + seg.getFileName()
                                + ": " + e);
                        return false; // what was sent may land: the keys make a second shipping harmless
                    }
                    sent++;
                    if (System.nanoTime() > deadlineNanos) {
                        return false;
                    }
                }
                if (n < 0) {
                    break;
                }
                if (from < n) {
                    line.write(buf, from, n - from);
                }
            }
        } catch (IOException e) {
            if (!Files.exists(seg)) {
                unshipped.remove(seg);
                return true; // removed meanwhile (e.g. by retention): nothing left to ship
            }
            reportOnce("cannot read " + seg + ": " + e);
            return false;
        }
        try {
            if (!acks.await(sent, () -> System.nanoTime() > deadlineNanos)) {
                return false;
            }
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            return false;
        }
        if (acks.errors > 0) {
            reportOnce("ledger topic " + topic + " did not take " + acks.errors + " rows of " + seg.getFileName()
                    + " (" + acks.firstError + ")");
            return false;
        }
        try {
            Files.newOutputStream(marker(seg)).close();
        } catch (IOException e) {
            reportOnce("cannot write the marker of " + seg + ": " + e);
            return false;
        }
        unshipped.remove(seg);
        rowsShipped.addAndGet(sent);
        segmentsMarked.incrementAndGet();
        return true;
    }

    /** The acknowledgements of one segment's sends (callbacks run on the producer's I/O thread). */
    private static final class Acks implements org.apache.kafka.clients.producer.Callback {
        private long done; // guarded by this
        volatile long errors;
        volatile Exception firstError;

        @Override
        public synchronized void onCompletion(org.apache.kafka.clients.producer.RecordMetadata md, Exception e) {
            if (e != null) {
                if (errors == 0) {
                    firstError = e;
                }
                errors++;
            }
            done++;
            notifyAll();
        }

        /** Wait until {@code n} sends completed; false when {@code giveUp} says so first. */
        synchronized boolean await(long n, java.util.function.BooleanSupplier giveUp) throws InterruptedException {
            while (done < n) {
                if (giveUp.getAsBoolean()) {
                    return false;
                }
                wait(100);
            }
            return true;
        }
    }

    private void reportOnce(String what) {
        if (!reported && !closing) { // at close, close() reports what is left
            System.err.println("msgaudit: " + what + "; unshipped segments stay in " + dir
                    + " for `msgaudit ship` (or the next client on this folder)");
            reported = true;
        }
    }

    /**
     * Ship what is left (the spool was closed and its last segment handed over first) and stop,
     * within the close bound; what is not acknowledged by then stays unmarked and is reported.
     */
    @Override
    public void close() {
        long start = System.nanoTime();
        long end = start + TimeUnit.MILLISECONDS.toNanos(closeMs); // the whole close: msgaudit.ledger.close.timeout.ms
        // shipping stops a little earlier, leaving the rest of the bound to close the producer
        deadlineNanos = end - TimeUnit.MILLISECONDS.toNanos(Math.min(1_000, closeMs / 4));
        synchronized (lock) {
            closing = true;
            lock.notifyAll();
        }
        if (thread.getState() != Thread.State.NEW) {
            try {
                thread.join(Math.max(1, TimeUnit.NANOSECONDS.toMillis(end - System.nanoTime())));
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            }
        }
        producerTaken = true;
        KafkaProducer<byte[], byte[]> p = producer.getAndSet(null);
        if (p != null) {
            try { // ZERO: what is still in flight is abandoned (it stays unmarked), without waiting
                long leftMs = TimeUnit.NANOSECONDS.toMillis(end - System.nanoTime());
                p.close(thread.isAlive() || leftMs <= 0 ? Duration.ZERO : Duration.ofMillis(leftMs));
            } catch (RuntimeException e) {
                // nothing left to do
            }
        }
        int left = unshipped.size();
        if (left > 0) {
            System.err.println("msgaudit: ledger topic " + topic + ": " + left + " " + kind
                    + " segments not shipped; `msgaudit ship` ships them from " + dir);
        }
    }
}
