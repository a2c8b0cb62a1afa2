// A plain transactional Kafka producer that knows nothing of msgaudit (the test adds the producer
// interceptor through client properties only). Usage: TxnProducer <topic> <per-txn> <key=value>...
// (producer properties, transactional.id among them). Three transactions of <per-txn> records:
// 1. sent, flushed (every record acked) and then aborted; 2. committed; 3. aborted at once, before
// anything was sent (run it with a long linger.ms). Prints "DONE".
import java.util.Properties;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.StringSerializer;

public class TxnProducer {
    public static void main(String[] args) throws Exception {
        String topic = args[0];
        int perTxn = Integer.parseInt(args[1]);
        Properties props = new Properties();
        props.put("key.serializer", StringSerializer.class.getName());
        props.put("value.serializer", StringSerializer.class.getName());
        for (int i = 2; i < args.length; i++) {
            int eq = args[i].indexOf('=');
            props.put(args[i].substring(0, eq), args[i].substring(eq + 1));
        }
        try (KafkaProducer<String, String> producer = new KafkaProducer<>(props)) {
            producer.initTransactions();
            for (int txn = 1; txn <= 3; txn++) {
                producer.beginTransaction();
                for (int i = 0; i < perTxn; i++) {
                    producer.send(new ProducerRecord<>(topic, "k" + (i % 3), "txn" + txn + "-" + i));
                }
                if (txn == 1) {
                    producer.flush();
                    producer.abortTransaction();
                } else if (txn == 2) {
                    producer.commitTransaction();
                } else {
                    producer.abortTransaction();
                }
            }
        }
        System.out.println("DONE");
    }
}
