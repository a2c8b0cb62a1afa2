// A share group member (KIP-932) that audits itself with io.msgaudit.interceptors.AuditedShareConsumer
// in place of KafkaShareConsumer; everything else is plain client code and properties.
// Usage: ShareMember <topic> <records> <reject-offset> <release-offset> <slow-offset> <slow-ms> <key=value>...
// (consumer and msgaudit.* properties, group.id among them). Rejects the record at reject-offset,
// releases the one at release-offset on its first delivery, and accepts everything else; the record
// at slow-offset it accepts on its first delivery only after the rest of the batch is committed and
// slow-ms have passed (past its acquisition lock, so the broker refuses that accept and delivers the
// record again). Commits each batch with commitSync(). Prints "GOT <partition> <offset> <delivery
// count> <ACK>" per acknowledgement, and "LOCK <ms>" (the broker's acquisition lock, through the
// ShareConsumer interface of kafka-clients 4.2+) after the first records; stops once <records>
// records are accepted at their last delivery or rejected (or after 30 s), prints "DONE", closes.
import java.time.Duration;
import java.util.Collections;
import java.util.Properties;
import io.msgaudit.interceptors.AuditedShareConsumer;
import org.apache.kafka.clients.consumer.AcknowledgeType;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.ShareConsumer;
import org.apache.kafka.common.serialization.StringDeserializer;

public class ShareMember {
    public static void main(String[] args) throws InterruptedException {
        String topic = args[0];
        int records = Integer.parseInt(args[1]);
        long reject = Long.parseLong(args[2]);
        long release = Long.parseLong(args[3]);
        long slow = Long.parseLong(args[4]);
        long slowMs = Long.parseLong(args[5]);
        Properties props = new Properties();
        props.put("key.deserializer", StringDeserializer.class.getName());
        props.put("value.deserializer", StringDeserializer.class.getName());
        for (int i = 6; i < args.length; i++) {
            int eq = args[i].indexOf('=');
            props.put(args[i].substring(0, eq), args[i].substring(eq + 1));
        }
        int done = 0;
        long deadline = System.currentTimeMillis() + 30_000;
        boolean lockPrinted = false;
        try (ShareConsumer<String, String> consumer = new AuditedShareConsumer<>(props)) {
            consumer.subscribe(Collections.singletonList(topic));
            while (done < records && System.currentTimeMillis() < deadline) {
                ConsumerRecord<String, String> held = null;
                ConsumerRecords<String, String> batch = consumer.poll(Duration.ofMillis(500));
                if (!batch.isEmpty() && !lockPrinted) {
                    System.out.println("LOCK " + consumer.acquisitionLockTimeoutMs().orElse(-1));
                    lockPrinted = true;
                }
                for (ConsumerRecord<String, String> r : batch) {
                    int count = r.deliveryCount().map(Short::intValue).orElse(0);
                    if (r.offset() == slow && count == 1) {
                        held = r;
                        continue;
                    }
                    AcknowledgeType ack = r.offset() == reject ? AcknowledgeType.REJECT
                            : r.offset() == release && count == 1 ? AcknowledgeType.RELEASE : AcknowledgeType.ACCEPT;
                    consumer.acknowledge(r, ack);
                    if (ack != AcknowledgeType.RELEASE) {
                        done++;
                    }
                    print(r, count, ack);
                }
                if (held != null) {
                    consumer.commitSync();
                    Thread.sleep(slowMs);
                    consumer.acknowledge(held, AcknowledgeType.ACCEPT);
                    print(held, 1, AcknowledgeType.ACCEPT);
                }
                consumer.commitSync();
            }
        }
        System.out.println("DONE");
    }

    private static void print(ConsumerRecord<String, String> r, int count, AcknowledgeType ack) {
        System.out.println("GOT " + r.partition() + " " + r.offset() + " " + count + " " + ack.name());
        System.out.flush();
    }
}
