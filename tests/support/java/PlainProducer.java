// A plain Kafka producer that knows nothing of msgaudit: the test adds the interceptor through
// client properties only. Usage: PlainProducer <topic> <count> <key=value>...  (producer properties)
// Every odd record carries the application header trace=<i>. Prints "SENT <n>" after flush/close.
import java.util.Properties;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.StringSerializer;

public class PlainProducer {
    public static void main(String[] args) throws Exception {
        String topic = args[0];
        int count = Integer.parseInt(args[1]);
        Properties props = new Properties();
        props.put("key.serializer", StringSerializer.class.getName());
        props.put("value.serializer", StringSerializer.class.getName());
        for (int i = 2; i < args.length; i++) {
            int eq = args[i].indexOf('=');
            props.put(args[i].substring(0, eq), args[i].substring(eq + 1));
        }
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(props)) {
            for (int i = 0; i < count; i++) {
                ProducerRecord<String, String> r = new ProducerRecord<>(topic, "k" + (i % 7), "java-" + i);
                if (i % 2 == 1) {
                    r.headers().add("trace", ("t" + i).getBytes("UTF-8"));
                }
                producer.send(r);
            }
            producer.flush();
        }
        System.out.println("SENT " + count);
    }
}
