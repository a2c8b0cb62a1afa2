package io.msgaudit.interceptors;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.security.SecureRandom;
import java.time.Instant;
import java.util.Map;

/**
 * The producer_settings row of one producer session (docs/design.md §4.2), written at start as a
 * sealed one-line segment {@code settings-<ns>-<random>.jsonl} (under {@code .tmp}, then renamed)
 * in {@code <ledger dir>/../producer_settings}: the row and file protocol of AuditedProducer's
 * {@code write_settings}, so {@code msgaudit ship} and ingest take it unchanged.
 *
 * <p>The values are kafka-clients' effective ones, from the properties the producer was given
 * and kafka-clients' defaults: {@code acks=all}, {@code retries=2147483647},
 * {@code max.in.flight.requests.per.connection=5}, {@code enable.idempotence=true} unless it is not
 * set and {@code acks} is not all or {@code retries} is 0 (kafka-clients 4.1 then turns idempotence
 * off; with more than 5 requests in flight an idempotent producer does not start at all).
 * A failure is reported on stderr, never fatal.
 */
final class ProducerSettings {
    private static final SecureRandom RANDOM = new SecureRandom();

    private ProducerSettings() {}

    static String row(Map<String, ?> configs, String name, String pid, long startMs) {
        String acks = text(configs, "acks", "all").trim().toLowerCase(java.util.Locale.ROOT);
        if (acks.equals("-1")) {
            acks = "all";
        }
        long retries = number(configs, "retries", Integer.MAX_VALUE);
        long inFlight = number(configs, "max.in.flight.requests.per.connection", 5);
        boolean idempotence;
        if (configs.get("enable.idempotence") != null) {
            idempotence = text(configs, "enable.idempotence", "true").trim().equalsIgnoreCase("true");
        } else {
            idempotence = acks.equals("all") && retries != 0;
        }
        String txn = configs.get("transactional.id") == null ? null : configs.get("transactional.id").toString();
        return "{\"producer\":" + AuditProducerInterceptor.Json.quote(name)
                + ",\"pid\":" + AuditProducerInterceptor.Json.quote(pid)
                + ",\"start_ts\":" + startMs
                + ",\"acks\":" + AuditProducerInterceptor.Json.quote(acks)
                + ",\"enable_idempotence\":" + idempotence
                + ",\"retries\":" + retries
                + ",\"max_in_flight\":" + inFlight
                + ",\"transactional_id\":" + (txn == null || txn.isEmpty() ? "null" : AuditProducerInterceptor.Json.quote(txn))
                + ",\"mode\":\"interceptor\"}\n";
    }

    static void write(Path ledgerDir, Map<String, ?> configs, String name, String pid) {
        Instant now = Instant.now();
        Path parent = ledgerDir.toAbsolutePath().normalize().getParent();
        Path dir = parent == null ? Path.of("producer_settings") : parent.resolve("producer_settings");
        String stem = String.format("settings-%d-%08x", now.getEpochSecond() * 1_000_000_000L + now.getNano(),
                RANDOM.nextInt());
        Path tmp = dir.resolve(stem + ".tmp");
        try {
            Files.createDirectories(dir);
            Files.write(tmp, row(configs, name, pid, now.toEpochMilli()).getBytes(StandardCharsets.UTF_8));
            Files.move(tmp, dir.resolve(stem + ".jsonl"), StandardCopyOption.ATOMIC_MOVE);
        } catch (IOException | RuntimeException e) {
            try {
                Files.deleteIfExists(tmp);
            } catch (IOException ignored) {
                // nothing left to do
            }
            System.err.println("msgaudit: producer " + pid + ": settings row not recorded in " + dir + ": " + e);
        }
    }

    private static String text(Map<String, ?> configs, String key, String dflt) {
        Object v = configs.get(key);
        return v == null ? dflt : v.toString();
    }

    private static long number(Map<String, ?> configs, String key, long dflt) {
        Object v = configs.get(key);
        if (v == null) {
            return dflt;
        }
        try {
            return Long.parseLong(v.toString().trim());
        } catch (NumberFormatException e) {
            return dflt; // kafka-clients itself rejects it at start
        }
    }
}
