// A plain Kafka consumer-group member that knows nothing of msgaudit: the test adds the consumer
// interceptor through client properties only.
// Usage: PlainConsumer <topic> <pause-after> <key=value>...   (consumer properties, group.id among them)
// Prints "GOT <partition> <offset>" for every record poll() hands it, then commits the batch with
// commitSync(). With pause-after >= 0, once it has been handed that many records it prints "PAUSE"
// before committing the batch and waits to be killed. Otherwise it stops after 3 s without records
// (once it has had some), prints "DONE <n>" and closes.
import java.time.Duration;
import java.util.Collections;
import java.util.Properties;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.serialization.StringDeserializer;

public class PlainConsumer {
    public static void main(String[] args) throws Exception {
        String topic = args[0];
        long pauseAfter = Long.parseLong(args[1]);
        Properties props = new Properties();
        props.put("key.deserializer", StringDeserializer.class.getName());
        props.put("value.deserializer", StringDeserializer.class.getName());
        props.put("enable.auto.commit", "false");
        props.put("auto.offset.reset", "earliest");
        for (int i = 2; i < args.length; i++) {
            int eq = args[i].indexOf('=');
            props.put(args[i].substring(0, eq), args[i].substring(eq + 1));
        }
        long handed = 0;
        long idleSince = System.currentTimeMillis();
        try (KafkaConsumer<String, String> consumer = new KafkaConsumer<>(props)) {
            consumer.subscribe(Collections.singletonList(topic));
            while (true) {
                ConsumerRecords<String, String> records = consumer.poll(Duration.ofMillis(200));
                if (records.isEmpty()) {
                    if (handed > 0 && System.currentTimeMillis() - idleSince > 3000) {
                        break;
                    }
                    continue;
                }
                idleSince = System.currentTimeMillis();
                StringBuilder out = new StringBuilder();
                for (ConsumerRecord<String, String> r : records) {
                    out.append("GOT ").append(r.partition()).append(' ').append(r.offset()).append('\n');
                    handed++;
                }
                System.out.print(out);
                System.out.flush();
                if (pauseAfter >= 0 && handed >= pauseAfter) {
                    System.out.println("PAUSE");
                    System.out.flush();
                    Thread.sleep(600_000);
                }
                consumer.commitSync();
            }
        }
        System.out.println("DONE " + handed);
    }
}
