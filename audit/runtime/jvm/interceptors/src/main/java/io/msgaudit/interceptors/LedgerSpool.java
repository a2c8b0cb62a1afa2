package io.msgaudit.interceptors;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.channels.FileChannel;
import java.nio.channels.FileLock;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.nio.file.StandardOpenOption;
import java.security.SecureRandom;
import java.time.ZoneOffset;
import java.time.ZonedDateTime;
import java.time.format.DateTimeFormatter;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ArrayBlockingQueue;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;

/**
 * Crash-safe JSON-lines ledger segments, the file protocol of audit/clients/ledger.py:
 * {@code <prefix>-<utc stamp>-<os pid>-<random>.jsonl.new} is created and locked, renamed to
 * {@code .jsonl.open}, written, then fsynced and renamed to {@code .jsonl} (sealed). The lock is a
 * POSIX record lock (what FileChannel.lock takes on Linux); ingest treats a segment as live
 * while either that or a flock is held, and seals the segment of a killed writer itself.
 *
 * <p>{@link #append} never blocks: rows go into a bounded queue; a full queue or a failing disk
 * drops rows, counts them and reports on stderr. A background daemon thread does all file work.
 * A {@link Source} (the producer's acknowledged rows, kept unformatted) is drained by the same
 * thread at every turn, at least once per flush interval, and once more at close.
 */
final class LedgerSpool implements AutoCloseable {
    /** Rows held elsewhere, formatted by the writer thread. */
    interface Source {
        /** Append every held row (JSON lines, newline-terminated) to {@code out}; return how many
         *  are in {@code out} at the end. On the way, {@code flush} takes the rows in {@code out}
         *  (their count) whenever it holds enough of them, and clears it.
         *  {@code last}: the spool is closing, refuse rows from now on. */
        int drainInto(AckRows.Bytes out, boolean last, java.util.function.IntConsumer flush);
    }

    private static final DateTimeFormatter STAMP = DateTimeFormatter.ofPattern("yyyyMMdd'T'HHmmss");
    private static final SecureRandom RANDOM = new SecureRandom();

    private final Path dir;
    private final String prefix;
    private final long maxBytes;
    private final long maxAgeMs;
    private final long flushIntervalMs;
    private final BlockingQueue<String> queue;
    private final Thread thread;
    private final AtomicLong written = new AtomicLong();
    private final AtomicLong dropped = new AtomicLong();
    private final Object doneLock = new Object();
    private long accepted; // rows queued through enqueue (guarded by this spool's monitor)
    private long done; // rows taken from the queue and written or dropped (guarded by doneLock)
    private volatile boolean closing;
    private boolean reportedError;
    private volatile Source source;
    private volatile java.util.function.Consumer<Path> sealHook; // the ledger shipper, if any
    private final AckRows.Bytes out = new AckRows.Bytes(1 << 16); // writer thread only

    private FileChannel channel;
    private FileLock lock;
    private Path openPath;
    private Path sealedPath;
    private long segmentBytes;
    private long segmentOpened;

    LedgerSpool(Path dir, String prefix, long maxBytes, long maxAgeMs, long flushIntervalMs, int maxRows) {
        this.dir = dir;
        this.prefix = prefix;
        this.maxBytes = maxBytes;
        this.maxAgeMs = maxAgeMs;
        this.flushIntervalMs = flushIntervalMs;
        this.queue = new ArrayBlockingQueue<>(maxRows);
        this.thread = new Thread(this::run, "msgaudit-ledger-" + prefix);
        this.thread.setDaemon(true);
        this.thread.start();
    }

    /** Drain {@code s} too (set before the first row is added to it). */
    void setSource(Source s) { source = s; }

    /** Hand every segment sealed from now on to {@code hook} (set before the first row). */
    void onSealed(java.util.function.Consumer<Path> hook) { sealHook = hook; }

    /** Count rows that could not be recorded (e.g. refused by a full {@link Source}). */
    void countDropped(long rows) { dropped.addAndGet(rows); }

    /** Make the writer thread take its turn now (e.g. a {@link Source} holds a full chunk); never blocks. */
    void wake() {
        queue.offer(WAKE); // a full queue is awake anyway
    }

    /** Queue one row (a JSON object without newline); never blocks. */
    void append(String row) {
        if (closing || !queue.offer(row)) {
            dropped.incrementAndGet();
        }
    }

    /**
     * Queue rows (never blocks) and return a ticket for {@link #awaitWritten}; rows that do not
     * fit are dropped and counted. Callers are serialised, so the writer having taken "ticket"
     * rows from the queue means these have left it. A spool is used either through this method
     * (the consumer interceptor) or through {@link #append} (the producer), never both.
     */
    synchronized long enqueue(List<String> rows) {
        for (String row : rows) {
            if (closing || !queue.offer(row)) {
                dropped.incrementAndGet();
            } else {
                accepted++;
            }
        }
        return accepted;
    }

    /**
     * Wait, at most {@code maxWaitMs}, until the writer thread has handed every row up to
     * {@code ticket} to the operating system (written, not fsynced: they then survive a kill of
     * this process). False when the wait timed out (the rows stay queued).
     */
    boolean awaitWritten(long ticket, long maxWaitMs) {
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(maxWaitMs);
        synchronized (doneLock) {
            while (done < ticket) {
                long left = deadline - System.nanoTime();
                if (left <= 0) {
                    return false;
                }
                try {
                    TimeUnit.NANOSECONDS.timedWait(doneLock, left);
                } catch (InterruptedException e) {
                    Thread.currentThread().interrupt();
                    return false;
                }
            }
        }
        return true;
    }

    long written() { return written.get(); }

    long dropped() { return dropped.get(); }

    long pending() { return queue.size(); }

    private void run() {
        List<String> batch = new ArrayList<>();
        while (true) {
            boolean stop = closing;
            try {
                String first = stop ? queue.poll() : queue.poll(flushIntervalMs, TimeUnit.MILLISECONDS);
                if (first != null) {
                    batch.add(first);
                    queue.drainTo(batch);
                    batch.removeIf(r -> r == WAKE);
                }
            } catch (InterruptedException e) {
                stop = true;
            }
            if (!batch.isEmpty()) {
                out.clear();
                for (String r : batch) {
                    out.put(r.getBytes(StandardCharsets.UTF_8)).put(NEWLINE);
                }
                write(out, batch.size());
                synchronized (doneLock) {
                    done += batch.size();
                    doneLock.notifyAll();
                }
                batch.clear();
            }
            Source src = source;
            if (src != null) {
                out.clear();
                int rows = src.drainInto(out, stop, this::writeOut);
                if (rows > 0) {
                    write(out, rows);
                }
            }
            if (channel != null && (segmentBytes >= maxBytes || System.currentTimeMillis() - segmentOpened >= maxAgeMs)) {
                seal();
            }
            if (stop && queue.isEmpty()) {
                seal();
                return;
            }
        }
    }

    private static final byte[] NEWLINE = {'\n'};
    @SuppressWarnings("StringOperationCanBeSimplified")
    private static final String WAKE = new String("wake"); // compared by identity: never a row

    private void writeOut(int rows) {
        write(out, rows);
        out.clear();
    }

    private void write(AckRows.Bytes bytes, int rows) {
        ByteBuffer data = ByteBuffer.wrap(bytes.buf, 0, bytes.len);
        try {
            if (channel == null) {
                open();
            }
            long size = data.remaining();
            while (data.hasRemaining()) {
                channel.write(data);
            }
            segmentBytes += size;
            written.addAndGet(rows);
            reportedError = false;
        } catch (IOException | RuntimeException e) {
            dropped.addAndGet(rows);
            if (!reportedError) {
                System.err.println("msgaudit: ledger spool " + dir + ": " + e + "; ledger rows are being dropped (counted)");
                reportedError = true;
            }
            if (channel != null) {
                try {
                    channel.truncate(segmentBytes); // cut a partial line
                } catch (IOException ignored) {
                    // ingest cuts at the last complete line anyway
                }
                seal();
            }
        }
    }

    private void open() throws IOException {
        ZonedDateTime now = ZonedDateTime.now(ZoneOffset.UTC);
        String stem = String.format("%s-%s%06dZ-%d-%08x", prefix, STAMP.format(now), now.getNano() / 1000,
                ProcessHandle.current().pid(), RANDOM.nextInt());
        Path newPath = dir.resolve(stem + ".jsonl.new");
        openPath = dir.resolve(stem + ".jsonl.open");
        sealedPath = dir.resolve(stem + ".jsonl");
        FileChannel ch = FileChannel.open(newPath, StandardOpenOption.CREATE_NEW, StandardOpenOption.WRITE,
                StandardOpenOption.APPEND);
        try {
            lock = ch.lock();
            Files.move(newPath, openPath, StandardCopyOption.ATOMIC_MOVE);
        } catch (IOException | RuntimeException e) {
            ch.close();
            Files.deleteIfExists(newPath);
            throw e;
        }
        channel = ch;
        segmentBytes = 0;
        segmentOpened = System.currentTimeMillis();
    }

    private void seal() {
        if (channel == null) {
            return;
        }
        try {
            if (segmentBytes == 0) {
                Files.deleteIfExists(openPath);
            } else {
                channel.force(true);
                Files.move(openPath, sealedPath, StandardCopyOption.ATOMIC_MOVE);
                try (FileChannel d = FileChannel.open(dir, StandardOpenOption.READ)) {
                    d.force(true);
                }
                java.util.function.Consumer<Path> hook = sealHook;
                if (hook != null) {
                    hook.accept(sealedPath);
                }
            }
        } catch (IOException e) {
            System.err.println("msgaudit: cannot seal ledger segment " + openPath + ": " + e + " (ingest will seal it)");
        } finally {
            try {
                channel.close(); // releases the lock only after the rename
            } catch (IOException ignored) {
                // nothing left to do
            }
            channel = null;
            lock = null;
        }
    }

    /** Write everything queued, seal the open segment and stop (waits at most 30 s). */
    @Override
    public void close() {
        closing = true; // the writer notices within one flush interval (no interrupt: it would close the file)
        try {
            thread.join(30_000);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
    }
}
