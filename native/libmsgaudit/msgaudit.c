/*
 * libmsgaudit: a librdkafka interceptor plugin that audits any librdkafka producer without a
 * code change (docs/design.md §3.3).
 *
 *   plugin.library.paths=/full/path/libmsgaudit.so     (set it BEFORE the msgaudit.* properties)
 *   msgaudit.ledger.dir=/var/lib/msgaudit/ledger/producer
 *   msgaudit.producer.name=orders-svc
 *
 * on_send appends audit.pid / audit.seq (per pid and topic) / audit.ts to the application's
 * header list (a record that already carries one of them is left alone and gets no ledger row).
 * on_acknowledgement formats one producer-ledger row (acked with partition and offset, failed
 * with the librdkafka error name) into an in-memory buffer; a background thread writes the
 * buffer to crash-safe JSON-lines segments, in exactly the format and file protocol of
 * audit/clients/ledger.py, so `msgaudit ingest` lands them unchanged. At a producer's start
 * (on_new) it writes the session's producer_settings row beside the ledger folder, from
 * librdkafka's effective configuration (msgaudit.settings.row=false: a wrapper writes its own).
 *
 * Per message: one precise clock read (the stamp; the ack row copies the stamp's digits and
 * takes ack_ts from the coarse clock), no snprintf, no lock on the stamping path (the topic's
 * counter is cached per thread), one short mutex per acknowledged row.
 *
 * Rules this file keeps:
 *  - it never blocks the produce path or a broker thread on disk: rows are copied into memory
 *    under a short mutex; a full buffer or a failing disk drops rows, counts them and reports
 *    them on stderr (and through msgaudit_stats), never aborts the host process;
 *  - it never links librdkafka: the host may have loaded librdkafka under another file name
 *    and without global symbols (the confluent-kafka wheel does), and a second copy in the
 *    process would crash it. Every librdkafka function is resolved from the library whose code
 *    called conf_init() (dladdr on the caller, then dlsym on that library). A statically linked
 *    client must export its symbols (link it with -rdynamic).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <librdkafka/rdkafka.h>

#define EXPORT __attribute__((visibility("default")))

#define MAX_PID_CHARS 64
#define ROW_MAX 4096
#define WRITE_PIECE (64 << 10)

/* ---------------------------------------------------------------------------------------- */
/* librdkafka, resolved at run time                                                          */

#define RK_FUNCS(X)                                  \
    X(rd_kafka_conf_interceptor_add_on_new)          \
    X(rd_kafka_conf_interceptor_add_on_conf_set)     \
    X(rd_kafka_conf_interceptor_add_on_conf_dup)     \
    X(rd_kafka_conf_interceptor_add_on_conf_destroy) \
    X(rd_kafka_interceptor_add_on_send)              \
    X(rd_kafka_interceptor_add_on_acknowledgement)   \
    X(rd_kafka_interceptor_add_on_destroy)           \
    X(rd_kafka_message_headers)                      \
    X(rd_kafka_message_set_headers)                  \
    X(rd_kafka_headers_new)                          \
    X(rd_kafka_header_add)                           \
    X(rd_kafka_header_get_last)                      \
    X(rd_kafka_header_get_all)                       \
    X(rd_kafka_header_cnt)                           \
    X(rd_kafka_type)                                 \
    X(rd_kafka_topic_name)                           \
    X(rd_kafka_conf_get)                             \
    X(rd_kafka_conf_dump)                            \
    X(rd_kafka_conf_dump_free)                       \
    X(rd_kafka_err2name)                             \
    X(rd_kafka_err2str)                              \
    X(rd_kafka_conf_new)                             \
    X(rd_kafka_conf_set)                             \
    X(rd_kafka_conf_destroy)                         \
    X(rd_kafka_conf_set_dr_msg_cb)                   \
    X(rd_kafka_new)                                  \
    X(rd_kafka_producev)                             \
    X(rd_kafka_poll)                                 \
    X(rd_kafka_purge)                                \
    X(rd_kafka_destroy)

#define DECL(f) static __typeof__(f) *p_##f;
RK_FUNCS(DECL)
#undef DECL

static pthread_mutex_t resolve_mu = PTHREAD_MUTEX_INITIALIZER;
static int resolved;

static int resolve_rdkafka(void *caller, char *errstr, size_t errstr_size) {
    int ok = 1;
    pthread_mutex_lock(&resolve_mu);
    if (!resolved) {
        Dl_info info;
        void *h = NULL;
        const char *from = "the calling program";
        if (caller && dladdr(caller, &info) && info.dli_fname) {
            from = info.dli_fname;
            h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        }
        if (!h)
            h = dlopen(NULL, RTLD_LAZY); /* a statically linked client (needs -rdynamic) */
#define RESOLVE(f)                                                                          \
    if (ok) {                                                                               \
        p_##f = (__typeof__(f) *)dlsym(h, #f);                                              \
        if (!p_##f) {                                                                       \
            snprintf(errstr, errstr_size,                                                   \
                     "msgaudit: cannot find %s in %s (a statically linked librdkafka client " \
                     "must be linked with -rdynamic)", #f, from);                           \
            ok = 0;                                                                         \
        }                                                                                   \
    }
        RK_FUNCS(RESOLVE)
#undef RESOLVE
        resolved = ok;
    }
    pthread_mutex_unlock(&resolve_mu);
    return ok;
}

/* ---------------------------------------------------------------------------------------- */
/* small helpers                                                                             */

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void report(const char *fmt, ...) {
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    fprintf(stderr, "msgaudit: %s\n", line);
    fflush(stderr);
}

/* JSON string body (no quotes) of s into out; returns the length or -1 if it does not fit. */
/* Digit and byte writers for the per-message paths (snprintf's format parsing costs more than
 * the row itself): each writes at p and returns the end; the caller sizes the buffer. */
static const char DIGIT_PAIRS[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

static char *put_u64(char *p, uint64_t v) {
    char tmp[20];
    int i = 20;
    while (v >= 100) { /* two digits a division */
        unsigned r = (unsigned)(v % 100);
        v /= 100;
        tmp[--i] = DIGIT_PAIRS[2 * r + 1];
        tmp[--i] = DIGIT_PAIRS[2 * r];
    }
    if (v >= 10) {
        tmp[--i] = DIGIT_PAIRS[2 * v + 1];
        tmp[--i] = DIGIT_PAIRS[2 * v];
    } else
        tmp[--i] = (char)('0' + v);
    memcpy(p, tmp + i, (size_t)(20 - i));
    return p + (20 - i);
}

static char *put_i64(char *p, int64_t v) {
    if (v < 0) {
        *p++ = '-';
        return put_u64(p, (uint64_t)(-(v + 1)) + 1);
    }
    return put_u64(p, (uint64_t)v);
}

static char *put_str(char *p, const char *s, size_t n) {
    memcpy(p, s, n);
    return p + n;
}

#define PUT_LIT(p, lit) put_str((p), (lit), sizeof(lit) - 1)

static int json_escape(const char *s, char *out, size_t cap) {
    size_t n = 0;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        char esc[8];
        const char *put = esc;
        size_t k;
        if (c == '"' || c == '\\') {
            esc[0] = '\\'; esc[1] = (char)c; k = 2;
        } else if (c < 0x20) {
            snprintf(esc, sizeof(esc), "\\u%04x", c); k = 6;
        } else {
            esc[0] = (char)c; k = 1;
        }
        if (n + k >= cap)
            return -1;
        memcpy(out + n, put, k);
        n += k;
    }
    out[n] = '\0';
    return (int)n;
}

static char *xstrdup(const char *s) { return s ? strdup(s) : NULL; }

/* ---------------------------------------------------------------------------------------- */
/* configuration (one per rd_kafka_conf_t)                                                   */

struct settings {
    char *ledger_dir;      /* msgaudit.ledger.dir */
    char *producer_name;   /* msgaudit.producer.name */
    char *pid;             /* msgaudit.pid: a fixed session id (for wrappers); default random */
    long long segment_max_bytes;  /* msgaudit.segment.max.bytes */
    long long segment_max_age_ms; /* msgaudit.segment.max.age.ms */
    long long flush_interval_ms;  /* msgaudit.flush.interval.ms */
    long long buffer_max_bytes;   /* msgaudit.buffer.max.bytes */
    int header_three;             /* msgaudit.header.form=three: audit.pid/seq/ts, not one audit.id */
    int no_settings_row;          /* msgaudit.settings.row=false: a wrapper records the settings itself */
    char *ledger_topic;           /* msgaudit.ledger.topic: ship sealed segments there (off when unset) */
    char *ledger_bootstrap;       /* msgaudit.ledger.bootstrap.servers: default the client's */
    long long ledger_close_timeout_ms;    /* msgaudit.ledger.close.timeout.ms */
    long long ledger_retry_ms;            /* msgaudit.ledger.retry.ms */
    long long ledger_delivery_timeout_ms; /* msgaudit.ledger.delivery.timeout.ms */
};

static const char *KNOWN_KEYS =
    "msgaudit.ledger.dir, msgaudit.producer.name, msgaudit.pid, msgaudit.segment.max.bytes, "
    "msgaudit.segment.max.age.ms, msgaudit.flush.interval.ms, msgaudit.buffer.max.bytes, msgaudit.header.form, "
    "msgaudit.settings.row, msgaudit.ledger.topic, msgaudit.ledger.bootstrap.servers, "
    "msgaudit.ledger.close.timeout.ms, msgaudit.ledger.retry.ms, msgaudit.ledger.delivery.timeout.ms";

#define DEFAULT_LEDGER_DIR ".msgaudit/ledger/producer"

static void settings_defaults(struct settings *s) {
    memset(s, 0, sizeof(*s));
    s->segment_max_bytes = 64LL << 20;
    s->segment_max_age_ms = 60000;
    s->flush_interval_ms = 200;
    s->buffer_max_bytes = 64LL << 20;
    s->ledger_close_timeout_ms = 15000;
    s->ledger_retry_ms = 5000;
    s->ledger_delivery_timeout_ms = 120000;
}

static void settings_copy(struct settings *dst, const struct settings *src) {
    *dst = *src;
    dst->ledger_dir = xstrdup(src->ledger_dir);
    dst->producer_name = xstrdup(src->producer_name);
    dst->pid = xstrdup(src->pid);
    dst->ledger_topic = xstrdup(src->ledger_topic);
    dst->ledger_bootstrap = xstrdup(src->ledger_bootstrap);
}

static void settings_free(struct settings *s) {
    free(s->ledger_dir);
    free(s->producer_name);
    free(s->pid);
    free(s->ledger_topic);
    free(s->ledger_bootstrap);
}

/* A folder the spool can use: exists, is a folder, and a file can be created in it. */
static int check_dir(const char *dir, char *errstr, size_t errstr_size) {
    struct stat st;
    if (stat(dir, &st) != 0) {
        snprintf(errstr, errstr_size, "msgaudit.ledger.dir: %s: %s (create the ledger folder first)", dir,
                 strerror(errno));
        return 0;
    }
    if (!S_ISDIR(st.st_mode)) {
        snprintf(errstr, errstr_size, "msgaudit.ledger.dir: %s is not a folder", dir);
        return 0;
    }
    char probe[4096];
    snprintf(probe, sizeof(probe), "%s/.msgaudit-probe-%d-%08x", dir, (int)getpid(), (unsigned)rand());
    int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        snprintf(errstr, errstr_size, "msgaudit.ledger.dir: cannot write in %s: %s", dir, strerror(errno));
        return 0;
    }
    close(fd);
    unlink(probe);
    return 1;
}

/* the ledger shipper producer's linger.ms; msgaudit.ledger.delivery.timeout.ms must exceed it */
#define SHIP_LINGER_MS 20

static int parse_positive(const char *name, const char *val, long long *out, char *errstr, size_t errstr_size) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(val, &end, 10);
    if (errno || !end || *end || end == val || v <= 0) {
        snprintf(errstr, errstr_size, "%s: expected a positive integer, got \"%s\"", name, val);
        return 0;
    }
    *out = v;
    return 1;
}

static rd_kafka_conf_res_t on_conf_set(rd_kafka_conf_t *conf, const char *name, const char *val, char *errstr,
                                       size_t errstr_size, void *ic_opaque) {
    struct settings *s = ic_opaque;
    struct settings d;
    (void)conf;
    if (strncmp(name, "msgaudit.", 9) != 0)
        return RD_KAFKA_CONF_UNKNOWN;
    settings_defaults(&d);
    if (!strcmp(name, "msgaudit.ledger.dir")) {
        if (val && !check_dir(val, errstr, errstr_size))
            return RD_KAFKA_CONF_INVALID;
        free(s->ledger_dir);
        s->ledger_dir = xstrdup(val);
    } else if (!strcmp(name, "msgaudit.producer.name")) {
        if (val && !*val) {
            snprintf(errstr, errstr_size, "msgaudit.producer.name must not be empty");
            return RD_KAFKA_CONF_INVALID;
        }
        free(s->producer_name);
        s->producer_name = xstrdup(val);
    } else if (!strcmp(name, "msgaudit.pid")) {
        if (val && (!*val || strlen(val) > MAX_PID_CHARS)) {
            snprintf(errstr, errstr_size, "msgaudit.pid must be 1 to %d characters", MAX_PID_CHARS);
            return RD_KAFKA_CONF_INVALID;
        }
        free(s->pid);
        s->pid = xstrdup(val);
    } else if (!strcmp(name, "msgaudit.segment.max.bytes")) {
        if (!val) s->segment_max_bytes = d.segment_max_bytes;
        else if (!parse_positive(name, val, &s->segment_max_bytes, errstr, errstr_size)) return RD_KAFKA_CONF_INVALID;
    } else if (!strcmp(name, "msgaudit.segment.max.age.ms")) {
        if (!val) s->segment_max_age_ms = d.segment_max_age_ms;
        else if (!parse_positive(name, val, &s->segment_max_age_ms, errstr, errstr_size)) return RD_KAFKA_CONF_INVALID;
    } else if (!strcmp(name, "msgaudit.flush.interval.ms")) {
        if (!val) s->flush_interval_ms = d.flush_interval_ms;
        else if (!parse_positive(name, val, &s->flush_interval_ms, errstr, errstr_size)) return RD_KAFKA_CONF_INVALID;
    } else if (!strcmp(name, "msgaudit.buffer.max.bytes")) {
        if (!val) s->buffer_max_bytes = d.buffer_max_bytes;
        else if (!parse_positive(name, val, &s->buffer_max_bytes, errstr, errstr_size)) return RD_KAFKA_CONF_INVALID;
    } else if (!strcmp(name, "msgaudit.header.form")) {
        if (!val || !strcmp(val, "packed")) s->header_three = 0;
        else if (!strcmp(val, "three")) s->header_three = 1;
        else {
            snprintf(errstr, errstr_size, "msgaudit.header.form: expected packed or three, got \"%s\"", val);
            return RD_KAFKA_CONF_INVALID;
        }
    } else if (!strcmp(name, "msgaudit.settings.row")) {
        if (!val || !strcmp(val, "true")) s->no_settings_row = 0;
        else if (!strcmp(val, "false")) s->no_settings_row = 1;
        else {
            snprintf(errstr, errstr_size, "msgaudit.settings.row: expected true or false, got \"%s\"", val);
            return RD_KAFKA_CONF_INVALID;
        }
    } else if (!strcmp(name, "msgaudit.ledger.topic")) {
        if (val && !*val) {
            snprintf(errstr, errstr_size, "msgaudit.ledger.topic must not be empty");
            return RD_KAFKA_CONF_INVALID;
        }
        free(s->ledger_topic);
        s->ledger_topic = xstrdup(val);
    } else if (!strcmp(name, "msgaudit.ledger.bootstrap.servers")) {
        free(s->ledger_bootstrap);
        s->ledger_bootstrap = val && *val ? xstrdup(val) : NULL;
    } else if (!strcmp(name, "msgaudit.ledger.close.timeout.ms")) {
        if (!val) s->ledger_close_timeout_ms = d.ledger_close_timeout_ms;
        else if (!parse_positive(name, val, &s->ledger_close_timeout_ms, errstr, errstr_size)) return RD_KAFKA_CONF_INVALID;
    } else if (!strcmp(name, "msgaudit.ledger.retry.ms")) {
        if (!val) s->ledger_retry_ms = d.ledger_retry_ms;
        else if (!parse_positive(name, val, &s->ledger_retry_ms, errstr, errstr_size)) return RD_KAFKA_CONF_INVALID;
    } else if (!strcmp(name, "msgaudit.ledger.delivery.timeout.ms")) {
        if (!val) s->ledger_delivery_timeout_ms = d.ledger_delivery_timeout_ms;
        else if (!parse_positive(name, val, &s->ledger_delivery_timeout_ms, errstr, errstr_size)) return RD_KAFKA_CONF_INVALID;
        else if (s->ledger_delivery_timeout_ms <= SHIP_LINGER_MS || s->ledger_delivery_timeout_ms > INT_MAX) {
            /* librdkafka refuses message.timeout.ms <= linger.ms, and the shipper's producer is made
             * later on its own thread: refused here, where the user sees it */
            snprintf(errstr, errstr_size, "%s: expected %d..%d (more than the shipper's linger.ms %d), got \"%s\"",
                     name, SHIP_LINGER_MS + 1, INT_MAX, SHIP_LINGER_MS, val);
            return RD_KAFKA_CONF_INVALID;
        }
    } else {
        snprintf(errstr, errstr_size, "unknown msgaudit property \"%s\" (known: %s)", name, KNOWN_KEYS);
        return RD_KAFKA_CONF_INVALID;
    }
    return RD_KAFKA_CONF_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* one audited client instance                                                               */

struct shipper; /* the ledger topic shipper, below */
static void ship_enqueue(struct shipper *sh, const char *path);
static void shipper_close(struct shipper *sh);

struct topic_seq {
    char *name;
    uint64_t next; /* atomic: the next seq of this topic */
};

struct instance {
    struct settings cfg;
    char pid[MAX_PID_CHARS + 1];
    size_t pid_len;
    char head[1024]; /* {"producer":...,"pid":...,"seq": */
    size_t head_len;
    char txn_json[600]; /* the transactional.id as JSON (column txn_id), or null */
    size_t txn_json_len;
    int transactional;
    struct instance *next_instance;
    struct shipper *ship; /* msgaudit.ledger.topic set: hands sealed segments to it */

    /* per-topic seq, on the produce path: the table only grows, under seq_mu; each entry is
     * allocated once and never moves, so a thread's cached entry stays valid */
    pthread_mutex_t seq_mu;
    struct topic_seq **topics;
    size_t ntopics, cap_topics;

    /* counters (atomic) */
    uint64_t stamped, passed, acked, failed, dropped, late;

    /* the spool: rows in memory, a writer thread */
    pthread_mutex_t mu;
    pthread_cond_t cond;
    char *buf;
    size_t len, cap;
    uint64_t buf_rows;
    uint64_t flush_req, flush_done;
    uint64_t written;
    int closing, closed, thread_started;
    pthread_t thread;
    int reported_error;

    /* writer-thread only */
    int fd;
    char open_path[4200], sealed_path[4200];
    long long seg_size;
    double seg_opened;
};

static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static struct instance *registry;

static void new_pid(const char *name, char *out) {
    unsigned char rnd[6];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) {
        uint64_t x = (uint64_t)now_ms() ^ ((uint64_t)getpid() << 20) ^ (uint64_t)(uintptr_t)out;
        memcpy(rnd, &x, sizeof(rnd));
    }
    int room = MAX_PID_CHARS - 12 - 1;
    snprintf(out, MAX_PID_CHARS + 1, "%.*s:%02x%02x%02x%02x%02x%02x", room, name, rnd[0], rnd[1], rnd[2], rnd[3],
             rnd[4], rnd[5]);
}

/* -- segments (the file protocol of audit/clients/ledger.py) ------------------------------ */

static void fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

static int segment_open(struct instance *in) {
    struct timespec ts;
    struct tm tm;
    char stamp[32], stem[4096], new_path[4200];
    unsigned rnd = 0;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    strftime(stamp, sizeof(stamp), "%Y%m%dT%H%M%S", &tm);
    if (getrandom(&rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd))
        rnd = (unsigned)rand();
    snprintf(stem, sizeof(stem), "%s/producer-%s%06ldZ-%d-%08x", in->cfg.ledger_dir, stamp, ts.tv_nsec / 1000,
             (int)getpid(), rnd);
    snprintf(new_path, sizeof(new_path), "%s.jsonl.new", stem);
    snprintf(in->open_path, sizeof(in->open_path), "%s.jsonl.open", stem);
    snprintf(in->sealed_path, sizeof(in->sealed_path), "%s.jsonl", stem);
    int fd = open(new_path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    /* Locked before it is visible as .open: ingest seals only unlocked (dead) segments. */
    if (flock(fd, LOCK_EX | LOCK_NB) != 0 || rename(new_path, in->open_path) != 0) {
        int e = errno;
        close(fd);
        unlink(new_path);
        errno = e;
        return -1;
    }
    in->fd = fd;
    in->seg_size = 0;
    in->seg_opened = mono_s();
    return 0;
}

static void segment_seal(struct instance *in) {
    if (in->fd < 0)
        return;
    if (in->seg_size == 0) {
        unlink(in->open_path); /* nothing written: leave no empty segment */
    } else {
        fsync(in->fd);
        if (rename(in->open_path, in->sealed_path) == 0) {
            fsync_dir(in->cfg.ledger_dir);
            if (in->ship)
                ship_enqueue(in->ship, in->sealed_path);
        } else
            report("cannot seal ledger segment %s: %s (ingest will seal it)", in->open_path, strerror(errno));
    }
    close(in->fd); /* releases the lock only after the rename */
    in->fd = -1;
}

/* Write one chunk of complete lines; on failure the rows are counted as dropped. */
static void spool_write(struct instance *in, const char *data, size_t len, uint64_t rows) {
    if (in->fd < 0 && segment_open(in) != 0) {
        __atomic_add_fetch(&in->dropped, rows, __ATOMIC_RELAXED);
        if (!in->reported_error) {
            report("ledger spool %s: cannot create a segment: %s; ledger rows are being dropped (counted)",
                   in->cfg.ledger_dir, strerror(errno));
            in->reported_error = 1;
        }
        return;
    }
    size_t off = 0;
    while (off < len) {
        /* At most WRITE_PIECE bytes a call: the page cache then takes small folios; one write of
         * megabytes makes the kernel allocate large folios and, on a fragmented machine, compact
         * memory inside this call (most of the ledger's kernel time in a profile). */
        size_t piece = len - off < WRITE_PIECE ? len - off : WRITE_PIECE;
        ssize_t n = write(in->fd, data + off, piece);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            int e = errno;
            /* Cut the partial line, keep what was complete, and start a new segment next time. */
            if (ftruncate(in->fd, in->seg_size) != 0) { /* ingest cuts it at the last newline anyway */ }
            segment_seal(in);
            __atomic_add_fetch(&in->dropped, rows, __ATOMIC_RELAXED);
            if (!in->reported_error) {
                report("ledger spool %s: write failed: %s; ledger rows are being dropped (counted)",
                       in->cfg.ledger_dir, strerror(e));
                in->reported_error = 1;
            }
            return;
        }
        off += (size_t)n;
    }
    /* Start the write-back of what was just written now, on the writer thread, so that the
     * fsync of a flush() or a seal waits only for the last rows (no wait here: WRITE only). */
    sync_file_range(in->fd, (off_t)in->seg_size, (off_t)len, SYNC_FILE_RANGE_WRITE);
    in->seg_size += (long long)len;
    in->reported_error = 0;
    __atomic_add_fetch(&in->written, rows, __ATOMIC_RELAXED);
}

static void *writer_main(void *arg) {
    struct instance *in = arg;
    char *wbuf = NULL;
    size_t wcap = 0;
    for (;;) {
        pthread_mutex_lock(&in->mu);
        if (!in->closing && in->flush_req == in->flush_done) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            long long ns = until.tv_nsec + in->cfg.flush_interval_ms * 1000000LL;
            until.tv_sec += ns / 1000000000LL;
            until.tv_nsec = ns % 1000000000LL;
            pthread_cond_timedwait(&in->cond, &in->mu, &until);
        }
        int closing = in->closing;
        uint64_t want = in->flush_req;
        char *data = in->buf;
        size_t dcap = in->cap;
        size_t len = in->len;
        uint64_t rows = in->buf_rows;
        in->buf = wbuf;
        in->cap = wcap;
        in->len = 0;
        in->buf_rows = 0;
        pthread_mutex_unlock(&in->mu);

        if (len > 0)
            spool_write(in, data, len, rows);
        wbuf = data; /* the written buffer keeps its capacity for the next swap */
        wcap = dcap;
        if (in->fd >= 0 && (in->seg_size >= in->cfg.segment_max_bytes ||
                            (mono_s() - in->seg_opened) * 1000.0 >= (double)in->cfg.segment_max_age_ms))
            segment_seal(in);
        if (closing) {
            segment_seal(in);
            pthread_mutex_lock(&in->mu);
            in->flush_done = in->flush_req;
            in->closed = 1;
            free(in->buf);
            in->buf = NULL;
            in->cap = in->len = 0;
            pthread_cond_broadcast(&in->cond);
            pthread_mutex_unlock(&in->mu);
            free(wbuf);
            return NULL;
        }
        if (want > in->flush_done) {
            if (in->fd >= 0)
                fsync(in->fd);
            pthread_mutex_lock(&in->mu);
            in->flush_done = want;
            pthread_cond_broadcast(&in->cond);
            pthread_mutex_unlock(&in->mu);
        }
    }
}

/* Queue one complete line (ending in '\n'); called from any thread, never blocks on disk. */
static void spool_append(struct instance *in, const char *line, size_t n) {
    pthread_mutex_lock(&in->mu);
    if (in->closed || in->closing) {
        pthread_mutex_unlock(&in->mu);
        __atomic_add_fetch(&in->late, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&in->dropped, 1, __ATOMIC_RELAXED);
        return;
    }
    if (in->len + n > (size_t)in->cfg.buffer_max_bytes) {
        pthread_mutex_unlock(&in->mu);
        __atomic_add_fetch(&in->dropped, 1, __ATOMIC_RELAXED);
        return;
    }
    if (in->len + n > in->cap) {
        size_t cap = in->cap ? in->cap : 1 << 16;
        while (cap < in->len + n)
            cap *= 2;
        char *nb = realloc(in->buf, cap);
        if (!nb) {
            pthread_mutex_unlock(&in->mu);
            __atomic_add_fetch(&in->dropped, 1, __ATOMIC_RELAXED);
            return;
        }
        in->buf = nb;
        in->cap = cap;
    }
    memcpy(in->buf + in->len, line, n);
    in->len += n;
    in->buf_rows++;
    pthread_mutex_unlock(&in->mu);
}

/* -- per-thread caches ------------------------------------------------------------------- */

/* What the hot paths look up once and reuse while it stays the same: the topic entry the
 * thread last stamped for, the topic it last acknowledged (its JSON form), the millisecond it
 * last formatted. One TLS block, so each callback pays one TLS address lookup. */
struct tls_cache {
    struct instance *seq_in;     /* next_seq: (instance, topic name pointer) -> entry */
    const char *seq_name;
    struct topic_seq *seq_entry;
    const char *topic_name;      /* on_ack: topic name pointer -> its JSON body */
    char topic_raw[256];
    char topic_json[600];
    size_t topic_json_len;
    int64_t stamp_ms;            /* on_send: the last stamp time and its digits */
    char stamp_text[24];
    size_t stamp_len;
    int64_t ack_ms;              /* on_ack: the last ack time and its digits */
    char ack_text[24];
    size_t ack_len;
    /* The last message this thread stamped, and whether its failure was already recorded by an
     * on_acknowledgement inside the same produce() call (librdkafka does that when the
     * partitioner fails): msgaudit_failed_call must then not write a second row. */
    struct instance *last_in;
    int64_t last_seq;
    int acked_inline;
};
static __thread struct tls_cache tls_cache = {.stamp_ms = -1, .ack_ms = -1, .last_seq = -1};

/* -- seq per topic ------------------------------------------------------------------------ */

static int64_t next_seq(struct instance *in, const char *topic) {
    struct tls_cache *c = &tls_cache;
    struct topic_seq *e = NULL;
    /* fast path: the same instance and topic handle as this thread's last message (the name is
     * compared too: a pointer alone could be a freed topic's memory reused) */
    if (c->seq_in == in && c->seq_name == topic && !strcmp(c->seq_entry->name, topic))
        return (int64_t)__atomic_fetch_add(&c->seq_entry->next, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&in->seq_mu);
    for (size_t i = 0; i < in->ntopics; i++) {
        if (!strcmp(in->topics[i]->name, topic)) {
            e = in->topics[i];
            goto found;
        }
    }
    if (in->ntopics == in->cap_topics) {
        size_t cap = in->cap_topics ? in->cap_topics * 2 : 8;
        struct topic_seq **t = realloc(in->topics, cap * sizeof(*t));
        if (!t)
            goto fail;
        in->topics = t;
        in->cap_topics = cap;
    }
    e = calloc(1, sizeof(*e));
    if (!e)
        goto fail;
    e->name = strdup(topic);
    if (!e->name) {
        free(e);
        goto fail;
    }
    in->topics[in->ntopics++] = e;
found:
    pthread_mutex_unlock(&in->seq_mu);
    c->seq_in = in;
    c->seq_name = topic;
    c->seq_entry = e;
    return (int64_t)__atomic_fetch_add(&e->next, 1, __ATOMIC_RELAXED);
fail:
    pthread_mutex_unlock(&in->seq_mu);
    return -1;
}

/* -- rows --------------------------------------------------------------------------------- */

/* SHA-256 (FIPS 180-4), for a failed send's content fingerprint: only failed sends pay for it. */
struct sha256 {
    uint32_t h[8];
    uint64_t len;
    unsigned char buf[64];
    size_t used;
};

static const uint32_t SHA_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(struct sha256 *s, const unsigned char *p) {
    uint32_t w[64], a, b, c, d, e, f, g, h;
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = s->h[0]; b = s->h[1]; c = s->h[2]; d = s->h[3]; e = s->h[4]; f = s->h[5]; g = s->h[6]; h = s->h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + SHA_K[i] + w[i];
        uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    s->h[0] += a; s->h[1] += b; s->h[2] += c; s->h[3] += d; s->h[4] += e; s->h[5] += f; s->h[6] += g; s->h[7] += h;
}

static void sha256_init(struct sha256 *s) {
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, h0, sizeof(h0));
    s->len = 0;
    s->used = 0;
}

static void sha256_update(struct sha256 *s, const void *data, size_t n) {
    const unsigned char *p = data;
    s->len += n;
    while (n) {
        size_t k = 64 - s->used < n ? 64 - s->used : n;
        memcpy(s->buf + s->used, p, k);
        s->used += k; p += k; n -= k;
        if (s->used == 64) {
            sha256_block(s, s->buf);
            s->used = 0;
        }
    }
}

static void sha256_hex(struct sha256 *s, char out[65]) {
    uint64_t bits = s->len * 8;
    unsigned char pad = 0x80, len[8];
    sha256_update(s, &pad, 1);
    pad = 0;
    while (s->used != 56)
        sha256_update(s, &pad, 1);
    for (int i = 0; i < 8; i++)
        len[i] = (unsigned char)(bits >> (56 - 8 * i));
    sha256_update(s, len, 8);
    for (int i = 0; i < 8; i++)
        snprintf(out + 8 * i, 9, "%08x", s->h[i]);
}

/* A failed send's content fingerprint as capture computes it (docs/design.md §3), as a JSON string
 * into `out`: its audit.key header when present, else the SHA-256 hex of (key, 0x00, value).
 * NULL when it cannot be said (an audit.key too long for `cap`). */
static const char *fingerprint_json(const rd_kafka_message_t *msg, rd_kafka_headers_t *hdrs, char *out, size_t cap) {
    const void *v = NULL;
    size_t size = 0;
    if (hdrs && p_rd_kafka_header_get_last(hdrs, "audit.key", &v, &size) == RD_KAFKA_RESP_ERR_NO_ERROR && v) {
        char raw[512];
        if (size >= sizeof(raw) || cap < 3)
            return NULL;
        memcpy(raw, v, size);
        raw[size] = '\0';
        out[0] = '"';
        int n = json_escape(raw, out + 1, cap - 2);
        if (n < 0 || (size_t)n + 2 >= cap)
            return NULL;
        out[n + 1] = '"';
        out[n + 2] = '\0';
        return out;
    }
    struct sha256 s;
    char hex[65];
    unsigned char zero = 0;
    sha256_init(&s);
    if (msg->key)
        sha256_update(&s, msg->key, msg->key_len);
    sha256_update(&s, &zero, 1);
    if (msg->payload)
        sha256_update(&s, msg->payload, msg->len);
    sha256_hex(&s, hex);
    snprintf(out, cap, "\"%s\"", hex);
    return out;
}

/* A failed or aborted row (rare: snprintf is fine here); `fingerprint` (a JSON string) on a failed
 * send outside a transaction, else NULL. */
static void write_failed_row(struct instance *in, int64_t seq, const char *topic, int32_t partition,
                             const char *status, const char *error, int64_t produce_ts, const char *fingerprint) {
    char line[ROW_MAX], topic_json[600];
    int n;
    if (json_escape(topic, topic_json, sizeof(topic_json)) < 0) {
        __atomic_add_fetch(&in->dropped, 1, __ATOMIC_RELAXED);
        return;
    }
    n = snprintf(line, sizeof(line),
                 "%s%" PRId64 ",\"topic\":\"%s\",\"partition\":%" PRId32
                 ",\"offset\":null,\"status\":\"%s\",\"error\":\"%s\",\"txn_id\":%s,\"produce_ts\":%" PRId64
                 ",\"ack_ts\":null%s%s}\n",
                 in->head, seq, topic_json, partition < 0 ? -1 : partition, status, error, in->txn_json,
                 produce_ts, fingerprint ? ",\"fingerprint\":" : "", fingerprint ? fingerprint : "");
    if (n <= 0 || n >= (int)sizeof(line)) {
        __atomic_add_fetch(&in->dropped, 1, __ATOMIC_RELAXED);
        return;
    }
    spool_append(in, line, (size_t)n);
}

/* The JSON body of the topic name, cached per thread by the name's pointer (and content). */
static const char *topic_json_cached(const char *topic, size_t *len, char *scratch, size_t scratch_cap) {
    struct tls_cache *c = &tls_cache;
    if (c->topic_name == topic && !strcmp(c->topic_raw, topic)) {
        *len = c->topic_json_len;
        return c->topic_json;
    }
    size_t raw = strlen(topic);
    if (raw < sizeof(c->topic_raw)) {
        int n = json_escape(topic, c->topic_json, sizeof(c->topic_json));
        if (n < 0) {
            c->topic_name = NULL;
            return NULL;
        }
        memcpy(c->topic_raw, topic, raw + 1);
        c->topic_name = topic;
        c->topic_json_len = (size_t)n;
        *len = (size_t)n;
        return c->topic_json;
    }
    int n = json_escape(topic, scratch, scratch_cap);
    if (n < 0)
        return NULL;
    *len = (size_t)n;
    return scratch;
}

/* The row of every acknowledged message, on the broker thread: the seq and produce_ts digits
 * are copied from the audit header as they are, the rest written with memcpy and digit loops
 * (no snprintf, no parsing back). Bounded by construction: head < 1024, topic JSON < 600,
 * txn_json < 600, digits and literals < 250 bytes; ROW_MAX is 4096. */
static void write_acked_row(struct instance *in, const char *seq, size_t seq_len, const char *topic,
                            int32_t partition, int64_t offset, const char *ts, size_t ts_len, const char *ack,
                            size_t ack_len) {
    char line[ROW_MAX], scratch[600];
    size_t topic_len;
    const char *topic_json = topic_json_cached(topic, &topic_len, scratch, sizeof(scratch));
    if (!topic_json) {
        __atomic_add_fetch(&in->dropped, 1, __ATOMIC_RELAXED);
        return;
    }
    char *w = line;
    w = put_str(w, in->head, in->head_len);
    w = put_str(w, seq, seq_len);
    w = PUT_LIT(w, ",\"topic\":\"");
    w = put_str(w, topic_json, topic_len);
    w = PUT_LIT(w, "\",\"partition\":");
    w = put_i64(w, partition);
    w = PUT_LIT(w, ",\"offset\":");
    w = put_i64(w, offset);
    w = PUT_LIT(w, ",\"status\":\"acked\",\"error\":null,\"txn_id\":");
    w = put_str(w, in->txn_json, in->txn_json_len);
    w = PUT_LIT(w, ",\"produce_ts\":");
    w = put_str(w, ts, ts_len);
    w = PUT_LIT(w, ",\"ack_ts\":");
    w = put_str(w, ack, ack_len);
    w = PUT_LIT(w, "}\n");
    spool_append(in, line, (size_t)(w - line));
}

/* Does the application's header list already carry an audit header? One pass over the list,
 * and only names starting with "audit." are compared further. */
static int has_audit_header(rd_kafka_headers_t *hdrs) {
    size_t cnt = p_rd_kafka_header_cnt(hdrs);
    for (size_t i = 0; i < cnt; i++) {
        const char *name = NULL;
        const void *val = NULL;
        size_t size = 0;
        if (p_rd_kafka_header_get_all(hdrs, i, &name, &val, &size) != RD_KAFKA_RESP_ERR_NO_ERROR || !name)
            continue;
        if (strncmp(name, "audit.", 6) != 0)
            continue;
        name += 6;
        if (!strcmp(name, "id") || !strcmp(name, "pid") || !strcmp(name, "seq") || !strcmp(name, "ts"))
            return 1;
    }
    return 0;
}

/* Only decimal digits, 1 to 19 of them. */
static int all_digits(const char *s, size_t n) {
    if (n == 0 || n > 19)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (s[i] < '0' || s[i] > '9')
            return 0;
    return 1;
}

static int64_t parse_digits(const char *s, size_t n) {
    int64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v = v * 10 + (s[i] - '0');
    return v;
}

/* A header's value by name: the last header first (where on_send put it), else a search. */
static int header_value(rd_kafka_headers_t *hdrs, size_t cnt, size_t back, const char *name, const char **val,
                        size_t *size) {
    const char *got = NULL;
    const void *v = NULL;
    if (cnt >= back && p_rd_kafka_header_get_all(hdrs, cnt - back, &got, &v, size) == RD_KAFKA_RESP_ERR_NO_ERROR &&
        got && !strcmp(got, name) && v) {
        *val = v;
        return 1;
    }
    if (p_rd_kafka_header_get_last(hdrs, name, &v, size) == RD_KAFKA_RESP_ERR_NO_ERROR && v) {
        *val = v;
        return 1;
    }
    return 0;
}

/* The seq and produce_ts digits this instance stamped on the message, found in its audit
 * header(s); 0 when the message is not ours (left alone in on_send, or another producer's). */
static int stamped_id(struct instance *in, rd_kafka_headers_t *hdrs, const char **seq, size_t *seq_len,
                      const char **ts, size_t *ts_len) {
    size_t cnt = p_rd_kafka_header_cnt(hdrs);
    const char *v;
    size_t size;
    if (!in->cfg.header_three) {
        if (!header_value(hdrs, cnt, 1, "audit.id", &v, &size))
            return 0;
        /* packed: <our pid>/<seq>/<ts> */
        if (size <= in->pid_len + 1 || memcmp(v, in->pid, in->pid_len) != 0 || v[in->pid_len] != '/')
            return 0;
        const char *at = v + in->pid_len + 1, *end = v + size;
        const char *slash = memchr(at, '/', (size_t)(end - at));
        if (!slash)
            return 0;
        *seq = at;
        *seq_len = (size_t)(slash - at);
        *ts = slash + 1;
        *ts_len = (size_t)(end - slash - 1);
    } else {
        if (!header_value(hdrs, cnt, 3, "audit.pid", &v, &size) || size != in->pid_len ||
            memcmp(v, in->pid, size) != 0)
            return 0;
        if (!header_value(hdrs, cnt, 2, "audit.seq", seq, seq_len) ||
            !header_value(hdrs, cnt, 1, "audit.ts", ts, ts_len))
            return 0;
    }
    return all_digits(*seq, *seq_len) && all_digits(*ts, *ts_len);
}

static rd_kafka_resp_err_t on_send(rd_kafka_t *rk, rd_kafka_message_t *msg, void *ic_opaque) {
    struct instance *in = ic_opaque;
    struct tls_cache *c = &tls_cache;
    c->acked_inline = 0;
    rd_kafka_headers_t *hdrs = NULL;
    (void)rk;
    if (p_rd_kafka_message_headers(msg, &hdrs) == RD_KAFKA_RESP_ERR_NO_ERROR && hdrs) {
        if (has_audit_header(hdrs)) {
            /* already stamped (e.g. a retry copy that keeps its original identity): left alone */
            __atomic_add_fetch(&in->passed, 1, __ATOMIC_RELAXED);
            return RD_KAFKA_RESP_ERR_NO_ERROR;
        }
    } else {
        hdrs = p_rd_kafka_headers_new(3);
        if (!hdrs)
            return RD_KAFKA_RESP_ERR_NO_ERROR;
        p_rd_kafka_message_set_headers(msg, hdrs); /* the message owns them */
    }
    int64_t seq = next_seq(in, p_rd_kafka_topic_name(msg->rkt));
    if (seq < 0)
        return RD_KAFKA_RESP_ERR_NO_ERROR; /* out of memory: the record goes unaudited */
    /* The message's one clock read: the stamp time, whose digits the ack row reuses. */
    int64_t ts = now_ms();
    if (ts != c->stamp_ms) {
        c->stamp_len = (size_t)(put_i64(c->stamp_text, ts) - c->stamp_text);
        c->stamp_ms = ts;
    }
    if (in->cfg.header_three) {
        char seq_text[24];
        size_t sn = (size_t)(put_i64(seq_text, seq) - seq_text);
        p_rd_kafka_header_add(hdrs, "audit.pid", 9, in->pid, (ssize_t)in->pid_len);
        p_rd_kafka_header_add(hdrs, "audit.seq", 9, seq_text, (ssize_t)sn);
        p_rd_kafka_header_add(hdrs, "audit.ts", 8, c->stamp_text, (ssize_t)c->stamp_len);
    } else { /* the packed form (§3.1): one header, <pid>/<seq>/<ts> */
        char id[MAX_PID_CHARS * 4 + 48], *w = id; /* pid <= MAX_PID_CHARS, two int64s <= 40 */
        w = put_str(w, in->pid, in->pid_len);
        *w++ = '/';
        w = put_i64(w, seq);
        *w++ = '/';
        w = put_str(w, c->stamp_text, c->stamp_len);
        p_rd_kafka_header_add(hdrs, "audit.id", 8, id, (ssize_t)(w - id));
    }
    __atomic_add_fetch(&in->stamped, 1, __ATOMIC_RELAXED);
    c->last_in = in;
    c->last_seq = seq;
    return RD_KAFKA_RESP_ERR_NO_ERROR;
}

/* The acknowledgement time: the kernel's coarse clock (no hardware clock read; it advances
 * once per scheduler tick, 1-4 ms), never before the stamp time, its digits cached per thread. */
static const char *ack_text(int64_t produce_ts, size_t *len) {
    struct tls_cache *c = &tls_cache;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME_COARSE, &now);
    int64_t ms = (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
    if (ms < produce_ts)
        ms = produce_ts;
    if (ms != c->ack_ms) {
        c->ack_len = (size_t)(put_i64(c->ack_text, ms) - c->ack_text);
        c->ack_ms = ms;
    }
    *len = c->ack_len;
    return c->ack_text;
}

static rd_kafka_resp_err_t on_ack(rd_kafka_t *rk, rd_kafka_message_t *msg, void *ic_opaque) {
    struct instance *in = ic_opaque;
    rd_kafka_headers_t *hdrs = NULL;
    const char *seq, *ts;
    size_t seq_len, ts_len;
    (void)rk;
    /* The application owns the message's opaque (_private) and librdkafka gives an interceptor
     * no per-message slot, so the identity travels in the audit header stamped by on_send. */
    if (p_rd_kafka_message_headers(msg, &hdrs) != RD_KAFKA_RESP_ERR_NO_ERROR || !hdrs ||
        !stamped_id(in, hdrs, &seq, &seq_len, &ts, &ts_len))
        return RD_KAFKA_RESP_ERR_NO_ERROR;
    const char *topic = p_rd_kafka_topic_name(msg->rkt);
    int64_t produce_ts = parse_digits(ts, ts_len);
    if (msg->err == RD_KAFKA_RESP_ERR_NO_ERROR) {
        size_t ack_len;
        const char *ack = ack_text(produce_ts, &ack_len);
        __atomic_add_fetch(&in->acked, 1, __ATOMIC_RELAXED);
        write_acked_row(in, seq, seq_len, topic, msg->partition, msg->offset, ts, ts_len, ack, ack_len);
    } else {
        int64_t seqv = parse_digits(seq, seq_len);
        __atomic_add_fetch(&in->failed, 1, __ATOMIC_RELAXED);
        /* abort_transaction() purges the transaction's unsent messages: they end aborted */
        int aborted = in->transactional && (msg->err == RD_KAFKA_RESP_ERR__PURGE_QUEUE ||
                                            msg->err == RD_KAFKA_RESP_ERR__PURGE_INFLIGHT);
        char fp[1100];
        write_failed_row(in, seqv, topic, msg->partition, aborted ? "aborted" : "failed",
                         p_rd_kafka_err2name(msg->err), produce_ts,
                         in->transactional ? NULL : fingerprint_json(msg, hdrs, fp, sizeof(fp)));
        struct tls_cache *c = &tls_cache;
        if (c->last_in == in && c->last_seq == seqv)
            c->acked_inline = 1;
    }
    return RD_KAFKA_RESP_ERR_NO_ERROR;
}

static int wait_flushed(struct instance *in, int timeout_ms, int closing) {
    struct timespec until;
    int rc = 0;
    clock_gettime(CLOCK_REALTIME, &until);
    long long ns = until.tv_nsec + (long long)timeout_ms * 1000000LL;
    until.tv_sec += ns / 1000000000LL;
    until.tv_nsec = ns % 1000000000LL;
    pthread_mutex_lock(&in->mu);
    if (in->closed) {
        pthread_mutex_unlock(&in->mu);
        return closing ? 0 : 3;
    }
    uint64_t target = ++in->flush_req;
    if (closing)
        in->closing = 1;
    pthread_cond_broadcast(&in->cond);
    while (in->flush_done < target && !(closing && in->closed)) {
        if (pthread_cond_timedwait(&in->cond, &in->mu, &until) == ETIMEDOUT) {
            rc = 2;
            break;
        }
    }
    pthread_mutex_unlock(&in->mu);
    return rc;
}

static rd_kafka_resp_err_t on_destroy(rd_kafka_t *rk, void *ic_opaque) {
    struct instance *in = ic_opaque;
    (void)rk;
    if (!in->thread_started)
        return RD_KAFKA_RESP_ERR_NO_ERROR;
    if (wait_flushed(in, 30000, 1) == 0)
        pthread_join(in->thread, NULL);
    else
        pthread_detach(in->thread);
    in->thread_started = 0;
    if (in->ship) /* the writer handed over its last segment when it sealed it */
        shipper_close(in->ship);
    uint64_t dropped = __atomic_load_n(&in->dropped, __ATOMIC_RELAXED);
    if (dropped)
        report("producer %s: %" PRIu64 " ledger rows could not be recorded in %s", in->pid, dropped,
               in->cfg.ledger_dir);
    /* The instance stays allocated (and registered, for msgaudit_stats): a late on_ack after
     * on_destroy must find valid memory; it is counted as dropped. */
    return RD_KAFKA_RESP_ERR_NO_ERROR;
}

/* -- the producer_settings row (docs/design.md §4.2) ------------------------------------ */

/* A librdkafka property's effective value (after librdkafka's own adjustments, e.g. an
 * idempotent producer's max.in.flight of 5), or "" when it cannot be read. */
static const char *conf_text(const rd_kafka_conf_t *conf, const char *name, char *out, size_t cap) {
    size_t size = cap;
    if (!conf || p_rd_kafka_conf_get(conf, name, out, &size) != RD_KAFKA_CONF_OK)
        out[0] = '\0';
    return out;
}

static long long conf_long(const rd_kafka_conf_t *conf, const char *name, long long dflt) {
    char v[64], *end = NULL;
    conf_text(conf, name, v, sizeof(v));
    long long x = strtoll(v, &end, 10);
    return (v[0] && end && !*end) ? x : dflt;
}

/* One sealed one-line segment settings-<ns>-<random>.jsonl in <ledger dir>/../producer_settings
 * (written under .tmp, then renamed), the same row and file protocol as AuditedProducer's
 * write_settings. A failure is reported on stderr, never fatal. */
static void write_settings_row(struct instance *in, const rd_kafka_conf_t *conf, const char *name_json,
                               const char *pid_json) {
    char dir[4096], tmp[4300], path[4300], row[2048], acks[32], idem[16], txn[512], txn_json[600];
    struct timespec ts;
    unsigned rnd = 0;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t start_ms = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    /* acks: librdkafka's request.required.acks, "all" for -1 */
    conf_text(conf, "acks", acks, sizeof(acks));
    if (!acks[0] || !strcmp(acks, "-1"))
        snprintf(acks, sizeof(acks), "all");
    conf_text(conf, "enable.idempotence", idem, sizeof(idem));
    long long retries = conf_long(conf, "retries", 2147483647LL);
    long long in_flight = conf_long(conf, "max.in.flight.requests.per.connection", 1000000LL);
    conf_text(conf, "transactional.id", txn, sizeof(txn));
    snprintf(txn_json, sizeof(txn_json), "null");
    if (txn[0]) {
        char esc[sizeof(txn_json) - 2];
        if (json_escape(txn, esc, sizeof(esc)) >= 0)
            snprintf(txn_json, sizeof(txn_json), "\"%s\"", esc);
    }
    int n = snprintf(row, sizeof(row),
                     "{\"producer\":\"%s\",\"pid\":\"%s\",\"start_ts\":%" PRId64 ",\"acks\":\"%s\","
                     "\"enable_idempotence\":%s,\"retries\":%lld,\"max_in_flight\":%lld,\"transactional_id\":%s,"
                     "\"mode\":\"plugin\"}\n",
                     name_json, pid_json, start_ms, acks, !strcmp(idem, "true") ? "true" : "false", retries,
                     in_flight, txn_json);
    /* <ledger dir>/.. : the ledger folder's parent (a trailing slash is ignored) */
    snprintf(dir, sizeof(dir), "%s", in->cfg.ledger_dir);
    size_t len = strlen(dir);
    while (len > 1 && dir[len - 1] == '/')
        dir[--len] = '\0';
    char *slash = strrchr(dir, '/');
    if (!slash)
        snprintf(dir, sizeof(dir), "producer_settings");
    else
        snprintf(slash + 1, sizeof(dir) - (size_t)(slash + 1 - dir), "producer_settings");
    if (getrandom(&rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd))
        rnd = (unsigned)rand();
    long long ns = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    snprintf(tmp, sizeof(tmp), "%s/settings-%lld-%08x.tmp", dir, ns, rnd);
    snprintf(path, sizeof(path), "%s/settings-%lld-%08x.jsonl", dir, ns, rnd);
    const char *failed = NULL;
    int fd = -1;
    if (n <= 0 || n >= (int)sizeof(row))
        failed = "row too long";
    else if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        failed = "mkdir";
    else if ((fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)) < 0)
        failed = "open";
    else if (write(fd, row, (size_t)n) != n) /* no fsync: a client's start must not wait for a disk */
        failed = "write";
    if (fd >= 0)
        close(fd);
    if (!failed && rename(tmp, path) != 0)
        failed = "rename";
    if (failed) {
        int e = errno;
        unlink(tmp);
        report("producer %s: settings row not recorded in %s (%s: %s)", in->pid, dir, failed, strerror(e));
    }
}

/* ---------------------------------------------------------------------------------------- */
/* the ledger topic shipper (docs/design.md §4.2 "Ledger transport")                        */
/*
 * With msgaudit.ledger.topic set, every segment the writer seals is handed (its path only) to a
 * shipper thread with its own rd_kafka_t, made from a fresh configuration through the functions
 * resolved from the host's librdkafka (no plugin.library.paths: it does not load this plugin).
 * It ships every line of the segment with the keys of audit/clients/ledger_ship.py,
 * <kind>/<segment stem>:<line from 0>, the value the line unchanged, and writes <stem>.shipped
 * once the topic acknowledged all of them. A segment that was not fully acknowledged stays
 * unmarked: tried again every msgaudit.ledger.retry.ms (doubling while the topic stays down,
 * up to 2 min), by `msgaudit ship`, or by the next client started on the same folder (it ships
 * the folder's sealed unmarked segments first). on_destroy waits at most
 * msgaudit.ledger.close.timeout.ms, then abandons what is in flight (counted and reported).
 */

struct seg_item {
    char *path;
    struct seg_item *next;
};

struct ship_ctx { /* one segment's deliveries; shipper thread only (delivery reports come from poll) */
    uint64_t remaining, errors;
    rd_kafka_resp_err_t first_err;
};

struct shipper {
    char *topic, *dir, *owner;
    char **kv; /* the shipper producer's properties, name/value pairs */
    size_t nkv;
    long long retry_ms, close_ms;
    pthread_mutex_t mu;
    pthread_cond_t cond;
    struct seg_item *todo, *todo_tail; /* under mu */
    int closing, done;                  /* under mu */
    double deadline;                    /* monotonic seconds, set with closing: shipping stops */
    double end;                         /* monotonic seconds: the close bound (close.timeout.ms) */
    uint64_t unshipped;                 /* atomic: segments handed over and not marked */
    pthread_t thread;
    /* shipper thread only */
    struct seg_item *failed;
    rd_kafka_t *rk;
    int reported;
};

static void ship_report_once(struct shipper *sh, const char *what, const char *detail) {
    int closing;
    pthread_mutex_lock(&sh->mu);
    closing = sh->closing;
    pthread_mutex_unlock(&sh->mu);
    if (sh->reported || closing) /* at close, on_destroy reports what is left */
        return;
    sh->reported = 1;
    report("ledger topic %s: %s (%s); unshipped segments stay in %s for `msgaudit ship` (or the next client on "
           "this folder)", sh->topic, what, detail, sh->dir);
}

static void ship_enqueue(struct shipper *sh, const char *path) {
    struct seg_item *it = calloc(1, sizeof(*it));
    if (!it || !(it->path = strdup(path))) {
        free(it);
        return; /* out of memory: the segment stays unmarked for `msgaudit ship` */
    }
    __atomic_add_fetch(&sh->unshipped, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&sh->mu);
    if (sh->todo_tail)
        sh->todo_tail->next = it;
    else
        sh->todo = it;
    sh->todo_tail = it;
    pthread_cond_broadcast(&sh->cond);
    pthread_mutex_unlock(&sh->mu);
}

static void ship_dr(rd_kafka_t *rk, const rd_kafka_message_t *msg, void *opaque) {
    struct ship_ctx *ctx = msg->_private;
    (void)rk;
    (void)opaque;
    if (!ctx)
        return;
    if (msg->err) {
        if (!ctx->errors)
            ctx->first_err = msg->err;
        ctx->errors++;
    }
    ctx->remaining--;
}

static int ship_past_deadline(struct shipper *sh) {
    int past;
    pthread_mutex_lock(&sh->mu);
    past = sh->closing && mono_s() > sh->deadline;
    pthread_mutex_unlock(&sh->mu);
    return past;
}

static rd_kafka_t *ship_producer(struct shipper *sh) {
    char err[512];
    if (sh->rk)
        return sh->rk;
    rd_kafka_conf_t *conf = p_rd_kafka_conf_new();
    if (!conf)
        return NULL;
    for (size_t i = 0; i + 1 < sh->nkv; i += 2) {
        if (p_rd_kafka_conf_set(conf, sh->kv[i], sh->kv[i + 1], err, sizeof(err)) != RD_KAFKA_CONF_OK) {
            ship_report_once(sh, "cannot configure the shipper", err);
            p_rd_kafka_conf_destroy(conf);
            return NULL;
        }
    }
    p_rd_kafka_conf_set_dr_msg_cb(conf, ship_dr);
    sh->rk = p_rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof(err));
    if (!sh->rk) {
        p_rd_kafka_conf_destroy(conf);
        ship_report_once(sh, "cannot start the shipper", err);
    }
    return sh->rk;
}

static int has_marker(const char *path, char *marker, size_t cap) {
    size_t n = strlen(path);
    struct stat st;
    if (n < 6 || strcmp(path + n - 6, ".jsonl") != 0 || n - 6 + sizeof(".shipped") > cap)
        return -1;
    memcpy(marker, path, n - 6);
    memcpy(marker + n - 6, ".shipped", sizeof(".shipped"));
    return stat(marker, &st) == 0;
}

/* Ship one sealed segment; 1 when every line is acknowledged and the marker written. */
static int ship_segment(struct shipper *sh, const char *path) {
    char marker[4300], key[4400];
    int m = has_marker(path, marker, sizeof(marker));
    if (m != 0)
        return 1; /* already shipped (or not a segment name: nothing to ship) */
    FILE *f = fopen(path, "re");
    if (!f) {
        if (errno == ENOENT)
            return 1; /* removed meanwhile: nothing left to ship */
        ship_report_once(sh, "cannot read a segment", strerror(errno));
        return 0;
    }
    rd_kafka_t *rk = ship_producer(sh);
    if (!rk) {
        fclose(f);
        return 0;
    }
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    int stem_len = (int)(strlen(base) - 6);
    struct ship_ctx *ctx = calloc(1, sizeof(*ctx));
    if (!ctx) {
        fclose(f);
        return 0;
    }
    /* line by line (never the whole segment in the host's memory): a copy of each line is queued,
     * at most queue.buffering.max.kbytes of them; a full queue is polled until it has room */
    char *line = NULL;
    size_t cap = 0;
    ssize_t got;
    uint64_t line_no = 0;
    int ok = 1;
    while (ok && (got = getline(&line, &cap, f)) >= 0) {
        size_t vlen = (size_t)got;
        if (vlen > 0 && line[vlen - 1] == '\n')
            vlen--; /* a last line without a newline still counts */
        int klen = snprintf(key, sizeof(key), "%s/%.*s:%" PRIu64, "producer", stem_len, base, line_no);
        for (;;) {
            rd_kafka_resp_err_t err = p_rd_kafka_producev(
                rk, RD_KAFKA_V_TOPIC(sh->topic), RD_KAFKA_V_KEY(key, (size_t)klen),
                RD_KAFKA_V_VALUE(line, vlen), RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY),
                RD_KAFKA_V_OPAQUE(ctx), RD_KAFKA_V_END);
            if (!err) {
                ctx->remaining++;
                break;
            }
            if (err != RD_KAFKA_RESP_ERR__QUEUE_FULL || ship_past_deadline(sh)) {
                if (err != RD_KAFKA_RESP_ERR__QUEUE_FULL)
                    ship_report_once(sh, "the shipper could not queue a row", p_rd_kafka_err2str(err));
                ok = 0;
                break;
            }
            p_rd_kafka_poll(rk, 100);
        }
        line_no++;
    }
    if (ok && ferror(f)) {
        ship_report_once(sh, "cannot read a segment", strerror(errno));
        ok = 0;
    }
    free(line);
    fclose(f);
    /* wait for every acknowledgement (message.timeout.ms bounds it; at close, the close bound) */
    while (ctx->remaining > 0) {
        p_rd_kafka_poll(rk, 100);
        if (ctx->remaining > 0 && ship_past_deadline(sh)) {
            p_rd_kafka_purge(rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
            double until = sh->end; /* the purged rows' reports come at once: wait at most to the close bound */
            while (ctx->remaining > 0 && mono_s() < until)
                p_rd_kafka_poll(rk, 100);
            if (ctx->remaining > 0)
                return 0; /* ctx stays allocated: a late delivery report may still use it */
            ok = 0;
        }
    }
    if (ctx->errors) {
        char what[128];
        snprintf(what, sizeof(what), "%" PRIu64 " rows not acknowledged", ctx->errors);
        ship_report_once(sh, what, p_rd_kafka_err2str(ctx->first_err));
        ok = 0;
    }
    free(ctx);
    if (!ok)
        return 0;
    int fd = open(marker, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        ship_report_once(sh, "cannot write a marker", strerror(errno));
        return 0;
    }
    close(fd);
    return 1;
}

/* Sealed segments of the folder without a marker (left by earlier clients), into the queue: at the
 * client's start, on the host's thread (a listing of a local folder), before its writer starts. */
static void ship_scan(struct shipper *sh) {
    DIR *d = opendir(sh->dir);
    struct dirent *e;
    char path[4300], marker[4400];
    if (!d)
        return;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (strncmp(e->d_name, "producer-", 9) != 0 || n < 7 || strcmp(e->d_name + n - 6, ".jsonl") != 0)
            continue;
        snprintf(path, sizeof(path), "%s/%s", sh->dir, e->d_name);
        if (has_marker(path, marker, sizeof(marker)) == 0)
            ship_enqueue(sh, path);
    }
    closedir(d);
}

static void *shipper_main(void *arg) {
    struct shipper *sh = arg;
    double backoff = (double)sh->retry_ms / 1000.0, next_retry = 0;
    int retried_at_close = 0;
    for (;;) {
        pthread_mutex_lock(&sh->mu);
        while (!sh->todo && !sh->closing && (!sh->failed || mono_s() < next_retry)) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += 1;
            pthread_cond_timedwait(&sh->cond, &sh->mu, &until);
        }
        if (!sh->todo && sh->failed && (sh->closing ? !retried_at_close : mono_s() >= next_retry)) {
            sh->todo = sh->failed; /* try again (at close: once, within the close bound) */
            sh->todo_tail = sh->failed;
            while (sh->todo_tail->next)
                sh->todo_tail = sh->todo_tail->next;
            sh->failed = NULL;
            retried_at_close = sh->closing;
        }
        struct seg_item *it = sh->todo;
        if (it) {
            sh->todo = it->next;
            if (!sh->todo)
                sh->todo_tail = NULL;
            it->next = NULL;
        }
        int closing = sh->closing;
        pthread_mutex_unlock(&sh->mu);
        if (!it) {
            if (closing)
                break;
            continue;
        }
        if (sh->rk)
            p_rd_kafka_poll(sh->rk, 0);
        if (!ship_past_deadline(sh) && ship_segment(sh, it->path)) {
            __atomic_sub_fetch(&sh->unshipped, 1, __ATOMIC_RELAXED);
            free(it->path);
            free(it);
            backoff = (double)sh->retry_ms / 1000.0;
            sh->reported = 0;
            continue;
        }
        /* the topic is not taking rows: this and the rest wait for the next try */
        pthread_mutex_lock(&sh->mu);
        if (sh->todo) {
            sh->todo_tail->next = sh->failed;
            it->next = sh->todo;
        } else {
            it->next = sh->failed;
        }
        sh->failed = it;
        sh->todo = sh->todo_tail = NULL;
        pthread_mutex_unlock(&sh->mu);
        next_retry = mono_s() + backoff;
        backoff = backoff * 2 > 120 ? 120 : backoff * 2;
    }
    if (sh->rk) {
        p_rd_kafka_purge(sh->rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
        p_rd_kafka_poll(sh->rk, 0);
        p_rd_kafka_destroy(sh->rk);
        sh->rk = NULL;
    }
    pthread_mutex_lock(&sh->mu);
    sh->done = 1;
    pthread_cond_broadcast(&sh->cond);
    pthread_mutex_unlock(&sh->mu);
    return NULL;
}

static void kv_add(struct shipper *sh, const char *name, const char *value) {
    char **kv = realloc(sh->kv, (sh->nkv + 2) * sizeof(*kv));
    if (!kv)
        return;
    sh->kv = kv;
    sh->kv[sh->nkv++] = strdup(name);
    sh->kv[sh->nkv++] = strdup(value);
}

/* The connection settings a host client passes on when the ledger topic is on its own cluster
 * (as audit/clients/ledger_ship.py): every key with one of these prefixes whose value differs from
 * a fresh configuration's (defaults only draw warnings), and that a fresh configuration takes (a
 * callback or pointer setting does not travel as text). Values have no size limit (PEM keys). */
static const char *PASSED_PREFIXES[] = {"security.", "sasl.", "ssl.", "socket.", "broker.", "client.dns.", NULL};

static void pass_settings(struct shipper *sh, const rd_kafka_conf_t *conf) {
    size_t n = 0, nd = 0;
    char err[256];
    rd_kafka_conf_t *fresh = p_rd_kafka_conf_new(), *probe = p_rd_kafka_conf_new();
    const char **mine = conf ? p_rd_kafka_conf_dump((rd_kafka_conf_t *)conf, &n) : NULL;
    const char **dflt = fresh ? p_rd_kafka_conf_dump(fresh, &nd) : NULL;
    if (mine && dflt && probe) {
        for (size_t i = 0; i + 1 < n; i += 2) {
            const char *name = mine[i], *val = mine[i + 1];
            int passed = 0;
            for (const char **p = PASSED_PREFIXES; *p && !passed; p++)
                passed = !strncmp(name, *p, strlen(*p));
            if (!passed || !val)
                continue;
            const char *was = NULL;
            for (size_t j = 0; j + 1 < nd && !was; j += 2)
                if (!strcmp(dflt[j], name))
                    was = dflt[j + 1] ? dflt[j + 1] : "";
            if (was && !strcmp(was, val))
                continue; /* the default */
            if (p_rd_kafka_conf_set(probe, name, val, err, sizeof(err)) != RD_KAFKA_CONF_OK)
                continue;
            kv_add(sh, name, val);
        }
    }
    if (mine)
        p_rd_kafka_conf_dump_free(mine, n);
    if (dflt)
        p_rd_kafka_conf_dump_free(dflt, nd);
    if (fresh)
        p_rd_kafka_conf_destroy(fresh);
    if (probe)
        p_rd_kafka_conf_destroy(probe);
}

/* A shipper for an instance (not started), or NULL with errstr set; only with a ledger topic. */
static struct shipper *shipper_new(struct instance *in, const rd_kafka_conf_t *conf, char *errstr,
                                   size_t errstr_size) {
    char bootstrap[2048], v[1024], num[32];
    struct shipper *sh;
    if (in->cfg.ledger_bootstrap)
        snprintf(bootstrap, sizeof(bootstrap), "%s", in->cfg.ledger_bootstrap);
    else
        conf_text(conf, "bootstrap.servers", bootstrap, sizeof(bootstrap));
    if (!bootstrap[0]) {
        snprintf(errstr, errstr_size, "msgaudit.ledger.topic: no bootstrap.servers for the ledger topic (set "
                                      "msgaudit.ledger.bootstrap.servers)");
        return NULL;
    }
    if (!(sh = calloc(1, sizeof(*sh)))) {
        snprintf(errstr, errstr_size, "msgaudit: out of memory");
        return NULL;
    }
    sh->topic = strdup(in->cfg.ledger_topic);
    sh->dir = strdup(in->cfg.ledger_dir);
    sh->retry_ms = in->cfg.ledger_retry_ms;
    sh->close_ms = in->cfg.ledger_close_timeout_ms;
    if (!in->cfg.ledger_bootstrap)
        pass_settings(sh, conf);
    kv_add(sh, "bootstrap.servers", bootstrap);
    kv_add(sh, "acks", "all");
    kv_add(sh, "enable.idempotence", "false");
    snprintf(num, sizeof(num), "%d", SHIP_LINGER_MS);
    kv_add(sh, "linger.ms", num);
    kv_add(sh, "queue.buffering.max.kbytes", "4096"); /* a segment is streamed: at most this queued */
    kv_add(sh, "compression.type", "lz4");
    snprintf(num, sizeof(num), "%lld", in->cfg.ledger_delivery_timeout_ms);
    kv_add(sh, "message.timeout.ms", num);
    snprintf(v, sizeof(v), "msgaudit-ledger-%s", in->pid);
    kv_add(sh, "client.id", v);
    pthread_mutex_init(&sh->mu, NULL);
    pthread_cond_init(&sh->cond, NULL);
    return sh;
}

/* Free a shipper whose thread is not running (never started, or joined). */
static void shipper_free(struct shipper *sh) {
    for (struct seg_item *lists[2] = {sh->todo, sh->failed}, **l = lists; l < lists + 2; l++)
        for (struct seg_item *it = *l, *next; it; it = next) {
            next = it->next;
            free(it->path);
            free(it);
        }
    for (size_t i = 0; i < sh->nkv; i++)
        free(sh->kv[i]);
    free(sh->kv);
    free(sh->topic);
    free(sh->dir);
    pthread_mutex_destroy(&sh->mu);
    pthread_cond_destroy(&sh->cond);
    free(sh);
}

/* A started shipper whose client fails to start: stop it at once (nothing is shipped) and free it. */
static void shipper_abort(struct shipper *sh) {
    pthread_mutex_lock(&sh->mu);
    sh->closing = 1;
    sh->end = sh->deadline = mono_s();
    pthread_cond_broadcast(&sh->cond);
    pthread_mutex_unlock(&sh->mu);
    pthread_join(sh->thread, NULL);
    shipper_free(sh);
}

/* After the writer sealed its last segment: ship what is left within the close bound. */
static void shipper_close(struct shipper *sh) {
    struct timespec until;
    int done;
    pthread_mutex_lock(&sh->mu);
    sh->closing = 1;
    /* on_destroy waits at most msgaudit.ledger.close.timeout.ms in total: shipping stops a little
     * earlier, leaving the rest of the bound to purge and destroy the shipper's producer */
    long long reserve_ms = sh->close_ms / 4 < 1000 ? sh->close_ms / 4 : 1000;
    sh->end = mono_s() + (double)sh->close_ms / 1000.0;
    sh->deadline = sh->end - (double)reserve_ms / 1000.0;
    pthread_cond_broadcast(&sh->cond);
    clock_gettime(CLOCK_REALTIME, &until);
    long long ns = until.tv_nsec + sh->close_ms * 1000000LL;
    until.tv_sec += ns / 1000000000LL;
    until.tv_nsec = ns % 1000000000LL;
    while (!sh->done)
        if (pthread_cond_timedwait(&sh->cond, &sh->mu, &until) == ETIMEDOUT)
            break;
    done = sh->done;
    pthread_mutex_unlock(&sh->mu);
    if (done)
        pthread_join(sh->thread, NULL);
    else
        pthread_detach(sh->thread); /* the library is never unloaded (RTLD_NODELETE): it may finish */
    uint64_t left = __atomic_load_n(&sh->unshipped, __ATOMIC_RELAXED);
    if (left)
        report("ledger topic %s: %" PRIu64 " producer segments not shipped; `msgaudit ship` ships them from %s",
               sh->topic, left, sh->dir);
}

static rd_kafka_resp_err_t on_new(rd_kafka_t *rk, const rd_kafka_conf_t *conf, void *ic_opaque, char *errstr,
                                  size_t errstr_size) {
    struct settings *s = ic_opaque;
    struct instance *in = calloc(1, sizeof(*in));
    char name_json[300], pid_json[200];
    if (!in) {
        snprintf(errstr, errstr_size, "msgaudit: out of memory");
        report("%s", errstr);
        return RD_KAFKA_RESP_ERR__CRIT_SYS_RESOURCE;
    }
    settings_copy(&in->cfg, s);
    if (!in->cfg.producer_name)
        in->cfg.producer_name = strdup("producer");
    if (!in->cfg.ledger_dir) {
        in->cfg.ledger_dir = strdup(DEFAULT_LEDGER_DIR);
        char path[4096];
        snprintf(path, sizeof(path), "%s", in->cfg.ledger_dir);
        for (char *p = path + 1; *p; p++)
            if (*p == '/') { *p = '\0'; mkdir(path, 0755); *p = '/'; }
        mkdir(path, 0755);
    }
    if (in->cfg.pid)
        snprintf(in->pid, sizeof(in->pid), "%s", in->cfg.pid);
    else
        new_pid(in->cfg.producer_name, in->pid);
    in->pid_len = strlen(in->pid);
    if (json_escape(in->cfg.producer_name, name_json, sizeof(name_json)) < 0 ||
        json_escape(in->pid, pid_json, sizeof(pid_json)) < 0) {
        snprintf(errstr, errstr_size, "msgaudit.producer.name is too long");
        report("%s", errstr);
        return RD_KAFKA_RESP_ERR__INVALID_ARG;
    }
    snprintf(in->head, sizeof(in->head), "{\"producer\":\"%s\",\"pid\":\"%s\",\"seq\":", name_json, pid_json);
    {
        char txn[512], txn_esc[sizeof(in->txn_json) - 2];
        size_t txn_size = sizeof(txn);
        snprintf(in->txn_json, sizeof(in->txn_json), "null");
        if (conf && p_rd_kafka_conf_get(conf, "transactional.id", txn, &txn_size) == RD_KAFKA_CONF_OK && txn[0] &&
            json_escape(txn, txn_esc, sizeof(txn_esc)) >= 0) {
            snprintf(in->txn_json, sizeof(in->txn_json), "\"%s\"", txn_esc);
            in->transactional = 1;
        }
    }
    in->head_len = strlen(in->head);
    in->txn_json_len = strlen(in->txn_json);
    in->fd = -1;
    pthread_mutex_init(&in->seq_mu, NULL);
    pthread_mutex_init(&in->mu, NULL);
    pthread_cond_init(&in->cond, NULL);
    /* Settings that only conflict with each other are known here, where librdkafka only logs a
     * failure (the client would run unaudited): the spool keeps every row and shipping is off,
     * said in one line, so `msgaudit ship` ships the segments. */
    if (in->cfg.ledger_bootstrap && !in->cfg.ledger_topic) {
        report("msgaudit.ledger.bootstrap.servers is set but msgaudit.ledger.topic is not; ledger rows stay in %s",
               in->cfg.ledger_dir);
    } else if (in->cfg.ledger_topic && p_rd_kafka_type(rk) == RD_KAFKA_PRODUCER) {
        char why[512];
        in->ship = shipper_new(in, conf, why, sizeof(why));
        if (!in->ship) {
            report("%s; ledger rows stay in %s for `msgaudit ship`", why, in->cfg.ledger_dir);
        } else {
            /* here, before this client's writer starts: a segment it seals is queued (and counted)
             * once, by the seal, even when the shipper thread first runs after it (a loaded host) */
            ship_scan(in->ship);
            if (pthread_create(&in->ship->thread, NULL, shipper_main, in->ship) != 0) {
                report("cannot start the ledger shipper thread; ledger rows stay in %s for `msgaudit ship`",
                       in->cfg.ledger_dir);
                shipper_free(in->ship);
                in->ship = NULL;
            }
        }
    }
    char why[512];
    if (!check_dir(in->cfg.ledger_dir, why, sizeof(why)))
        report("%s; this client's ledger rows will be dropped (counted)", why);
    if (pthread_create(&in->thread, NULL, writer_main, in) != 0) {
        snprintf(errstr, errstr_size, "msgaudit: cannot start the ledger writer thread");
        report("%s", errstr);
        if (in->ship) { /* the client does not start: its shipper must not outlive it */
            shipper_abort(in->ship);
            in->ship = NULL;
        }
        return RD_KAFKA_RESP_ERR__CRIT_SYS_RESOURCE;
    }
    in->thread_started = 1;
    if (!in->cfg.no_settings_row && p_rd_kafka_type(rk) == RD_KAFKA_PRODUCER)
        write_settings_row(in, conf, name_json, pid_json);
    pthread_mutex_lock(&registry_mu);
    in->next_instance = registry;
    registry = in;
    pthread_mutex_unlock(&registry_mu);

    p_rd_kafka_interceptor_add_on_send(rk, "msgaudit", on_send, in);
    p_rd_kafka_interceptor_add_on_acknowledgement(rk, "msgaudit", on_ack, in);
    p_rd_kafka_interceptor_add_on_destroy(rk, "msgaudit", on_destroy, in);
    return RD_KAFKA_RESP_ERR_NO_ERROR;
}

/* ---------------------------------------------------------------------------------------- */
/* configuration objects                                                                     */

static rd_kafka_resp_err_t on_conf_destroy(void *ic_opaque) {
    struct settings *s = ic_opaque;
    settings_free(s);
    free(s);
    return RD_KAFKA_RESP_ERR_NO_ERROR;
}

static rd_kafka_resp_err_t on_conf_dup(rd_kafka_conf_t *new_conf, const rd_kafka_conf_t *old_conf,
                                       size_t filter_cnt, const char **filter, void *ic_opaque);

static void register_conf(rd_kafka_conf_t *conf, struct settings *s) {
    p_rd_kafka_conf_interceptor_add_on_new(conf, "msgaudit", on_new, s);
    p_rd_kafka_conf_interceptor_add_on_conf_set(conf, "msgaudit", on_conf_set, s);
    p_rd_kafka_conf_interceptor_add_on_conf_dup(conf, "msgaudit", on_conf_dup, s);
    p_rd_kafka_conf_interceptor_add_on_conf_destroy(conf, "msgaudit", on_conf_destroy, s);
}

static rd_kafka_resp_err_t on_conf_dup(rd_kafka_conf_t *new_conf, const rd_kafka_conf_t *old_conf,
                                       size_t filter_cnt, const char **filter, void *ic_opaque) {
    struct settings *old = ic_opaque;
    struct settings *s = calloc(1, sizeof(*s));
    (void)old_conf;
    (void)filter_cnt;
    (void)filter;
    if (!s)
        return RD_KAFKA_RESP_ERR__CRIT_SYS_RESOURCE;
    settings_copy(s, old);
    register_conf(new_conf, s);
    return RD_KAFKA_RESP_ERR_NO_ERROR;
}

EXPORT rd_kafka_resp_err_t conf_init(rd_kafka_conf_t *conf, void **plug_opaquep, char *errstr,
                                     size_t errstr_size) {
    (void)plug_opaquep;
    if (!resolve_rdkafka(__builtin_return_address(0), errstr, errstr_size))
        return RD_KAFKA_RESP_ERR__FAIL;
    {
        /* Never unloaded: librdkafka closes a plugin with its configuration, and a writer or
         * shipper thread that outlived its close bound must still find its code. */
        Dl_info self;
        if (dladdr((void *)conf_init, &self) && self.dli_fname)
            dlopen(self.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
    }
    struct settings *s = calloc(1, sizeof(*s));
    if (!s) {
        snprintf(errstr, errstr_size, "msgaudit: out of memory");
        return RD_KAFKA_RESP_ERR__FAIL;
    }
    settings_defaults(s);
    register_conf(conf, s);
    return RD_KAFKA_RESP_ERR_NO_ERROR;
}

/* ---------------------------------------------------------------------------------------- */
/* functions for wrappers (AuditedProducer calls them through ctypes)                        */

static struct instance *find(const char *pid) {
    struct instance *in;
    pthread_mutex_lock(&registry_mu);
    for (in = registry; in; in = in->next_instance)
        if (!strcmp(in->pid, pid))
            break;
    pthread_mutex_unlock(&registry_mu);
    return in;
}

EXPORT const char *msgaudit_version(void) { return "1"; }

/* Make every row reported so far durable in the open segment. 0 ok, 1 unknown pid, 2 timeout,
 * 3 already closed. */
EXPORT int msgaudit_flush(const char *pid, int timeout_ms) {
    struct instance *in = find(pid);
    if (!in)
        return 1;
    return wait_flushed(in, timeout_ms, 0);
}

/* Counters: stamped, passed (left alone), acked, failed, rows written, rows dropped,
 * rows queued in memory, rows that arrived after close. Returns 0, or 1 for an unknown pid. */
EXPORT int msgaudit_stats(const char *pid, int64_t out[8]) {
    struct instance *in = find(pid);
    if (!in)
        return 1;
    out[0] = (int64_t)__atomic_load_n(&in->stamped, __ATOMIC_RELAXED);
    out[1] = (int64_t)__atomic_load_n(&in->passed, __ATOMIC_RELAXED);
    out[2] = (int64_t)__atomic_load_n(&in->acked, __ATOMIC_RELAXED);
    out[3] = (int64_t)__atomic_load_n(&in->failed, __ATOMIC_RELAXED);
    out[4] = (int64_t)__atomic_load_n(&in->written, __ATOMIC_RELAXED);
    out[5] = (int64_t)__atomic_load_n(&in->dropped, __ATOMIC_RELAXED);
    pthread_mutex_lock(&in->mu);
    out[6] = (int64_t)in->buf_rows;
    pthread_mutex_unlock(&in->mu);
    out[7] = (int64_t)__atomic_load_n(&in->late, __ATOMIC_RELAXED);
    return 0;
}

/* A produce() call that raised in the calling thread. If librdkafka refused it before on_send
 * (message too large, queue full) take the next seq of the topic and write a failed row, as the
 * Python ledger does; if on_send stamped it and an inline on_acknowledgement already wrote its
 * failed row, write nothing. `fingerprint`: the message's content fingerprint (NULL: unknown).
 * Returns the seq, or -1. */
EXPORT int64_t msgaudit_failed_call(const char *pid, const char *topic, int32_t partition, const char *error,
                                    const char *fingerprint) {
    struct instance *in = find(pid);
    char err[128], fp[1100];
    if (!in || !topic || !error || json_escape(error, err, sizeof(err)) < 0)
        return -1;
    struct tls_cache *c = &tls_cache;
    if (c->acked_inline && c->last_in == in) {
        c->acked_inline = 0; /* on_acknowledgement already wrote this call's failed row */
        return c->last_seq;
    }
    int64_t seq = next_seq(in, topic);
    if (seq < 0)
        return -1;
    __atomic_add_fetch(&in->failed, 1, __ATOMIC_RELAXED);
    int fp_ok = fingerprint && !in->transactional && json_escape(fingerprint, fp + 1, sizeof(fp) - 2) >= 0;
    if (fp_ok) {
        size_t n = strlen(fp + 1);
        fp[0] = '"';
        fp[n + 1] = '"';
        fp[n + 2] = '\0';
    }
    write_failed_row(in, seq, topic, partition, "failed", err, now_ms(), fp_ok ? fp : NULL);
    return seq;
}
