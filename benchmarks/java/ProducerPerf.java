// Throughput of one Kafka producer, for benchmarks/java_interceptor_overhead.py.
// Usage: ProducerPerf <topic> <records> <value-bytes> <mode> <key=value>...  (producer properties)
// mode "interceptor": the properties carry interceptor.classes (the msgaudit interceptor stamps
// and ledgers); mode "headers": no interceptor, the program adds the same packed audit.id header
// the interceptor would (<pid>/<seq>/<ts>); mode "plain": no header. Prints
// "RESULT <records/s> <process CPU us per record>" after flush.
import java.lang.management.ManagementFactory;
import java.nio.charset.StandardCharsets;
import java.util.Properties;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public class ProducerPerf {
    public static void main(String[] args) throws Exception {
        String topic = args[0];
        int n = Integer.parseInt(args[1]);
        byte[] value = new byte[Integer.parseInt(args[2])];
        java.util.Arrays.fill(value, (byte) 'x');
        String mode = args[3];
        Properties props = new Properties();
        props.put("key.serializer", ByteArraySerializer.class.getName());
        props.put("value.serializer", ByteArraySerializer.class.getName());
        for (int i = 4; i < args.length; i++) {
            int eq = args[i].indexOf('=');
            props.put(args[i].substring(0, eq), args[i].substring(eq + 1));
        }
        com.sun.management.OperatingSystemMXBean os =
                (com.sun.management.OperatingSystemMXBean) ManagementFactory.getOperatingSystemMXBean();
        String pid = "bench:0123456789ab/";
        try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(props)) {
            producer.partitionsFor(topic); // metadata before the clock starts
            long cpu0 = os.getProcessCpuTime();
            long t0 = System.nanoTime();
            for (int i = 0; i < n; i++) {
                ProducerRecord<byte[], byte[]> r = new ProducerRecord<>(topic, null, value);
                if (mode.equals("headers")) {
                    r.headers().add("audit.id",
                            (pid + i + "/" + System.currentTimeMillis()).getBytes(StandardCharsets.UTF_8));
                }
                producer.send(r);
            }
            producer.flush();
            long t1 = System.nanoTime();
            long cpu1 = os.getProcessCpuTime();
            System.out.printf("RESULT %.1f %.3f%n", n / ((t1 - t0) / 1e9), (cpu1 - cpu0) / 1e3 / n);
        }
    }
}
