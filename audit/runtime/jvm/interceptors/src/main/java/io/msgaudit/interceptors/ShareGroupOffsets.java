package io.msgaudit.interceptors;

import java.io.Reader;
import java.lang.reflect.Method;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.HashMap;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;

import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.ListShareGroupOffsetsSpec;
import org.apache.kafka.common.TopicPartition;

/**
 * The share-partition start offsets (SPSO) of share groups (KIP-932), for capture
 * (docs/design.md §4.2, {@code share_offsets}), and the lab's way to move them. The Python
 * AdminClient has no share group calls; this runs once per capture with kafka-clients 4.1+ on
 * its classpath.
 *
 * <pre>
 *   ShareGroupOffsets SETTINGS list GROUP...
 *     one JSON line per (group, topic, partition) the group has state for:
 *       {"group": g, "topic": t, "partition": p, "start_offset": n}   (n null: no start offset yet)
 *     or, when the broker refused the group (unknown group, no share groups on the broker, ...):
 *       {"group": g, "error": "ExceptionClass: message"}
 *   ShareGroupOffsets SETTINGS alter GROUP TOPIC PARTITION=OFFSET...
 *     sets the group's start offsets (the group must have no member); prints {"altered": n}
 * </pre>
 *
 * SETTINGS is a Java client properties file (bootstrap.servers and the security settings).
 * kafka-clients 4.1 answers {@code OffsetAndMetadata}, 4.2+ {@code SharePartitionOffsetInfo}:
 * the start offset is read by name ({@code startOffset()}, else {@code offset()}), so one build
 * serves both. Exit code 0 unless the arguments or the settings file are wrong (2) or an
 * {@code alter} fails (1).
 */
public final class ShareGroupOffsets {
    private static final long TIMEOUT_S = 30;

    private ShareGroupOffsets() {
    }

    public static void main(String[] args) throws Exception {
        if (args.length < 3 || !("list".equals(args[1]) || "alter".equals(args[1]))) {
            System.err.println("usage: ShareGroupOffsets SETTINGS list GROUP... | SETTINGS alter GROUP TOPIC P=OFFSET...");
            System.exit(2);
        }
        Properties props = new Properties();
        try (Reader r = Files.newBufferedReader(Paths.get(args[0]), StandardCharsets.UTF_8)) {
            props.load(r);
        }
        int rc;
        try (Admin admin = Admin.create(props)) {
            rc = "list".equals(args[1]) ? list(admin, args) : alter(admin, args);
        }
        System.out.flush();
        System.exit(rc);
    }

    private static int list(Admin admin, String[] args) throws InterruptedException {
        for (int i = 2; i < args.length; i++) {
            String group = args[i];
            Map<String, ListShareGroupOffsetsSpec> spec = new HashMap<>();
            spec.put(group, new ListShareGroupOffsetsSpec());
            try {
                Map<String, ? extends Map<TopicPartition, ?>> all =
                    admin.listShareGroupOffsets(spec).all().get(TIMEOUT_S, TimeUnit.SECONDS);
                Map<TopicPartition, ?> parts = all.get(group);
                if (parts == null) {
                    continue;
                }
                for (Map.Entry<TopicPartition, ?> e : parts.entrySet()) {
                    Long start = startOffset(e.getValue());
                    System.out.println("{\"group\": " + quote(group) + ", \"topic\": " + quote(e.getKey().topic())
                        + ", \"partition\": " + e.getKey().partition() + ", \"start_offset\": "
                        + (start == null || start < 0 ? "null" : start.toString()) + "}");
                }
            } catch (ExecutionException e) {
                System.out.println("{\"group\": " + quote(group) + ", \"error\": " + quote(describe(e.getCause())) + "}");
            } catch (java.util.concurrent.TimeoutException e) {
                System.out.println("{\"group\": " + quote(group) + ", \"error\": "
                    + quote("no answer within " + TIMEOUT_S + "s") + "}");
            }
        }
        return 0;
    }

    private static int alter(Admin admin, String[] args) throws InterruptedException {
        if (args.length < 5) {
            System.err.println("usage: ShareGroupOffsets SETTINGS alter GROUP TOPIC P=OFFSET...");
            return 2;
        }
        Map<TopicPartition, Long> offsets = new HashMap<>();
        for (int i = 4; i < args.length; i++) {
            String[] po = args[i].split("=", 2);
            offsets.put(new TopicPartition(args[3], Integer.parseInt(po[0])), Long.parseLong(po[1]));
        }
        try {
            admin.alterShareGroupOffsets(args[2], offsets).all().get(TIMEOUT_S, TimeUnit.SECONDS);
        } catch (ExecutionException | java.util.concurrent.TimeoutException e) {
            System.err.println(describe(e instanceof ExecutionException ? e.getCause() : e));
            return 1;
        }
        System.out.println("{\"altered\": " + offsets.size() + "}");
        return 0;
    }

    /** The start offset of one answer: SharePartitionOffsetInfo.startOffset() (4.2+), else
     * OffsetAndMetadata.offset() (4.1); null for no answer. */
    static Long startOffset(Object info) {
        if (info == null) {
            return null;
        }
        for (String name : new String[] {"startOffset", "offset"}) {
            try {
                Method m = info.getClass().getMethod(name);
                return ((Number) m.invoke(info)).longValue();
            } catch (NoSuchMethodException e) {
                // the other client version's name
            } catch (ReflectiveOperationException e) {
                throw new IllegalStateException(e);
            }
        }
        throw new IllegalStateException("no start offset in " + info.getClass().getName());
    }

    private static String quote(String s) {
        return AuditProducerInterceptor.Json.quote(s);
    }

    private static String describe(Throwable t) {
        return t.getClass().getSimpleName() + ": " + t.getMessage();
    }
}
