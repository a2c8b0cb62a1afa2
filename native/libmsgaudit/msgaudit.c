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
 * audit/clients/ledger.py, so `msgaudit ingest` lands them unchanged.
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
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
    X(rd_kafka_topic_name)                           \
    X(rd_kafka_conf_get)                             \
    X(rd_kafka_err2name)

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
static char *put_u64(char *p, uint64_t v) {
    char tmp[20];
    int i = 0;
    do {
        tmp[i++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (i)
        *p++ = tmp[--i];
    return p;
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
};

static const char *KNOWN_KEYS =
    "msgaudit.ledger.dir, msgaudit.producer.name, msgaudit.pid, msgaudit.segment.max.bytes, "
    "msgaudit.segment.max.age.ms, msgaudit.flush.interval.ms, msgaudit.buffer.max.bytes, msgaudit.header.form";

#define DEFAULT_LEDGER_DIR ".msgaudit/ledger/producer"

static void settings_defaults(struct settings *s) {
    memset(s, 0, sizeof(*s));
    s->segment_max_bytes = 64LL << 20;
    s->segment_max_age_ms = 60000;
    s->flush_interval_ms = 200;
    s->buffer_max_bytes = 64LL << 20;
}

static void settings_copy(struct settings *dst, const struct settings *src) {
    *dst = *src;
    dst->ledger_dir = xstrdup(src->ledger_dir);
    dst->producer_name = xstrdup(src->producer_name);
    dst->pid = xstrdup(src->pid);
}

static void settings_free(struct settings *s) {
    free(s->ledger_dir);
    free(s->producer_name);
    free(s->pid);
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
    } else {
        snprintf(errstr, errstr_size, "unknown msgaudit property \"%s\" (known: %s)", name, KNOWN_KEYS);
        return RD_KAFKA_CONF_INVALID;
    }
    return RD_KAFKA_CONF_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* one audited client instance                                                               */

struct topic_seq {
    char *name;
    uint64_t next;
};

struct instance {
    struct settings cfg;
    char pid[MAX_PID_CHARS + 1];
    size_t pid_len;
    char head[1024]; /* {"producer":...,"pid":...,"seq": */
    char txn_json[600]; /* the transactional.id as JSON (column txn_id), or null */
    int transactional;
    struct instance *next_instance;

    /* per-topic seq, on the produce path */
    pthread_mutex_t seq_mu;
    struct topic_seq *topics;
    size_t ntopics, cap_topics;
    char last_ts_text[24];

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
        if (rename(in->open_path, in->sealed_path) == 0)
            fsync_dir(in->cfg.ledger_dir);
        else
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
        ssize_t n = write(in->fd, data + off, len - off);
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

/* -- seq per topic ------------------------------------------------------------------------ */

static int64_t next_seq(struct instance *in, const char *topic) {
    int64_t seq = -1;
    pthread_mutex_lock(&in->seq_mu);
    for (size_t i = 0; i < in->ntopics; i++) {
        if (!strcmp(in->topics[i].name, topic)) {
            seq = (int64_t)in->topics[i].next++;
            goto done;
        }
    }
    if (in->ntopics == in->cap_topics) {
        size_t cap = in->cap_topics ? in->cap_topics * 2 : 8;
        struct topic_seq *t = realloc(in->topics, cap * sizeof(*t));
        if (!t)
            goto done;
        in->topics = t;
        in->cap_topics = cap;
    }
    in->topics[in->ntopics].name = strdup(topic);
    if (!in->topics[in->ntopics].name)
        goto done;
    in->topics[in->ntopics].next = 1;
    in->ntopics++;
    seq = 0;
done:
    pthread_mutex_unlock(&in->seq_mu);
    return seq;
}

/* -- rows --------------------------------------------------------------------------------- */

/* error NULL: an acked row; else a row of `status` (failed, or aborted) with that error. */
static void write_row(struct instance *in, int64_t seq, const char *topic, int32_t partition, int64_t offset,
                      const char *status, const char *error, int64_t produce_ts, int64_t ack_ts) {
    char line[ROW_MAX], topic_json[600];
    int n;
    if (json_escape(topic, topic_json, sizeof(topic_json)) < 0) {
        __atomic_add_fetch(&in->dropped, 1, __ATOMIC_RELAXED);
        return;
    }
    if (!error) {
        /* The row of every acknowledged message, on the broker thread: built with memcpy and
         * digit loops, not snprintf (a third of this plugin's own CPU). Bounded by construction:
         * head < 1024, topic_json < 600, txn_json < 600, the rest < 250 bytes; ROW_MAX is 4096. */
        char *w = line;
        w = put_str(w, in->head, strlen(in->head));
        w = put_i64(w, seq);
        w = PUT_LIT(w, ",\"topic\":\"");
        w = put_str(w, topic_json, strlen(topic_json));
        w = PUT_LIT(w, "\",\"partition\":");
        w = put_i64(w, partition);
        w = PUT_LIT(w, ",\"offset\":");
        w = put_i64(w, offset);
        w = PUT_LIT(w, ",\"status\":\"acked\",\"error\":null,\"txn_id\":");
        w = put_str(w, in->txn_json, strlen(in->txn_json));
        w = PUT_LIT(w, ",\"produce_ts\":");
        w = put_i64(w, produce_ts);
        w = PUT_LIT(w, ",\"ack_ts\":");
        w = put_i64(w, ack_ts);
        w = PUT_LIT(w, "}\n");
        n = (int)(w - line);
    } else
        n = snprintf(line, sizeof(line),
                     "%s%" PRId64 ",\"topic\":\"%s\",\"partition\":%" PRId32
                     ",\"offset\":null,\"status\":\"%s\",\"error\":\"%s\",\"txn_id\":%s,\"produce_ts\":%" PRId64
                     ",\"ack_ts\":null}\n",
                     in->head, seq, topic_json, partition < 0 ? -1 : partition, status, error, in->txn_json,
                     produce_ts);
    if (n <= 0 || n >= (int)sizeof(line)) {
        __atomic_add_fetch(&in->dropped, 1, __ATOMIC_RELAXED);
        return;
    }
    spool_append(in, line, (size_t)n);
}

static int header_text(rd_kafka_headers_t *hdrs, const char *name, char *out, size_t cap) {
    const void *val = NULL;
    size_t size = 0;
    if (p_rd_kafka_header_get_last(hdrs, name, &val, &size) != RD_KAFKA_RESP_ERR_NO_ERROR || !val ||
        size >= cap)
        return 0;
    memcpy(out, val, size);
    out[size] = '\0';
    return 1;
}

static int has_header(rd_kafka_headers_t *hdrs, const char *name) {
    const void *val = NULL;
    size_t size = 0;
    return p_rd_kafka_header_get_last(hdrs, name, &val, &size) == RD_KAFKA_RESP_ERR_NO_ERROR;
}

/* The last message this thread stamped, and whether its failure was already recorded by an
 * on_acknowledgement inside the same produce() call (librdkafka does that when the partitioner
 * fails): msgaudit_failed_call must then not write a second row. */
static __thread struct instance *tls_in;
static __thread int64_t tls_seq = -1;
static __thread int tls_acked_inline;

static rd_kafka_resp_err_t on_send(rd_kafka_t *rk, rd_kafka_message_t *msg, void *ic_opaque) {
    struct instance *in = ic_opaque;
    tls_acked_inline = 0;
    rd_kafka_headers_t *hdrs = NULL;
    char seq_text[24], ts_text[24];
    (void)rk;
    if (p_rd_kafka_message_headers(msg, &hdrs) == RD_KAFKA_RESP_ERR_NO_ERROR && hdrs) {
        if (has_header(hdrs, "audit.id") || has_header(hdrs, "audit.pid") || has_header(hdrs, "audit.seq") ||
            has_header(hdrs, "audit.ts")) {
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
    int64_t ts = now_ms();
    if (in->cfg.header_three) {
        int sn = snprintf(seq_text, sizeof(seq_text), "%" PRId64, seq);
        int tn = snprintf(ts_text, sizeof(ts_text), "%" PRId64, ts);
        p_rd_kafka_header_add(hdrs, "audit.pid", 9, in->pid, (ssize_t)in->pid_len);
        p_rd_kafka_header_add(hdrs, "audit.seq", 9, seq_text, sn);
        p_rd_kafka_header_add(hdrs, "audit.ts", 8, ts_text, tn);
    } else { /* the packed form (§3.1): one header, <pid>/<seq>/<ts> */
        char id[MAX_PID_CHARS * 4 + 48], *w = id; /* pid <= MAX_PID_CHARS, two int64s <= 40 */
        w = put_str(w, in->pid, in->pid_len);
        *w++ = '/';
        w = put_i64(w, seq);
        *w++ = '/';
        w = put_i64(w, ts);
        p_rd_kafka_header_add(hdrs, "audit.id", 8, id, (ssize_t)(w - id));
    }
    __atomic_add_fetch(&in->stamped, 1, __ATOMIC_RELAXED);
    tls_in = in;
    tls_seq = seq;
    return RD_KAFKA_RESP_ERR_NO_ERROR;
}

static rd_kafka_resp_err_t on_ack(rd_kafka_t *rk, rd_kafka_message_t *msg, void *ic_opaque) {
    struct instance *in = ic_opaque;
    rd_kafka_headers_t *hdrs = NULL;
    char pid[MAX_PID_CHARS + 2], seq_text[24], ts_text[24], id[MAX_PID_CHARS * 4 + 48];
    (void)rk;
    if (p_rd_kafka_message_headers(msg, &hdrs) != RD_KAFKA_RESP_ERR_NO_ERROR || !hdrs)
        return RD_KAFKA_RESP_ERR_NO_ERROR;
    if (header_text(hdrs, "audit.id", id, sizeof(id))) {
        /* packed: <our pid>/<seq>/<ts> */
        if (strncmp(id, in->pid, in->pid_len) != 0 || id[in->pid_len] != '/')
            return RD_KAFKA_RESP_ERR_NO_ERROR; /* not stamped by this instance */
        const char *seq_at = id + in->pid_len + 1, *slash = strchr(seq_at, '/');
        if (!slash || (size_t)(slash - seq_at) >= sizeof(seq_text) || strlen(slash + 1) >= sizeof(ts_text))
            return RD_KAFKA_RESP_ERR_NO_ERROR;
        memcpy(seq_text, seq_at, (size_t)(slash - seq_at));
        seq_text[slash - seq_at] = '\0';
        memcpy(ts_text, slash + 1, strlen(slash + 1) + 1); /* length checked above */
    } else {
        if (!header_text(hdrs, "audit.pid", pid, sizeof(pid)) || strcmp(pid, in->pid) != 0)
            return RD_KAFKA_RESP_ERR_NO_ERROR; /* not stamped by this instance */
        if (!header_text(hdrs, "audit.seq", seq_text, sizeof(seq_text)) ||
            !header_text(hdrs, "audit.ts", ts_text, sizeof(ts_text)))
            return RD_KAFKA_RESP_ERR_NO_ERROR;
    }
    int64_t seq = strtoll(seq_text, NULL, 10), ts = strtoll(ts_text, NULL, 10);
    const char *topic = p_rd_kafka_topic_name(msg->rkt);
    if (msg->err == RD_KAFKA_RESP_ERR_NO_ERROR) {
        __atomic_add_fetch(&in->acked, 1, __ATOMIC_RELAXED);
        write_row(in, seq, topic, msg->partition, msg->offset, "acked", NULL, ts, now_ms());
    } else {
        __atomic_add_fetch(&in->failed, 1, __ATOMIC_RELAXED);
        /* abort_transaction() purges the transaction's unsent messages: they end aborted */
        int aborted = in->transactional && (msg->err == RD_KAFKA_RESP_ERR__PURGE_QUEUE ||
                                            msg->err == RD_KAFKA_RESP_ERR__PURGE_INFLIGHT);
        write_row(in, seq, topic, msg->partition, -1, aborted ? "aborted" : "failed", p_rd_kafka_err2name(msg->err),
                  ts, 0);
        if (tls_in == in && tls_seq == seq)
            tls_acked_inline = 1;
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
    uint64_t dropped = __atomic_load_n(&in->dropped, __ATOMIC_RELAXED);
    if (dropped)
        report("producer %s: %" PRIu64 " ledger rows could not be recorded in %s", in->pid, dropped,
               in->cfg.ledger_dir);
    /* The instance stays allocated (and registered, for msgaudit_stats): a late on_ack after
     * on_destroy must find valid memory; it is counted as dropped. */
    return RD_KAFKA_RESP_ERR_NO_ERROR;
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
    in->fd = -1;
    pthread_mutex_init(&in->seq_mu, NULL);
    pthread_mutex_init(&in->mu, NULL);
    pthread_cond_init(&in->cond, NULL);
    char why[512];
    if (!check_dir(in->cfg.ledger_dir, why, sizeof(why)))
        report("%s; this client's ledger rows will be dropped (counted)", why);
    if (pthread_create(&in->thread, NULL, writer_main, in) != 0) {
        snprintf(errstr, errstr_size, "msgaudit: cannot start the ledger writer thread");
        report("%s", errstr);
        return RD_KAFKA_RESP_ERR__CRIT_SYS_RESOURCE;
    }
    in->thread_started = 1;
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
 * failed row, write nothing. Returns the seq, or -1. */
EXPORT int64_t msgaudit_failed_call(const char *pid, const char *topic, int32_t partition, const char *error) {
    struct instance *in = find(pid);
    char err[128];
    if (!in || !topic || !error || json_escape(error, err, sizeof(err)) < 0)
        return -1;
    if (tls_acked_inline && tls_in == in) {
        tls_acked_inline = 0; /* on_acknowledgement already wrote this call's failed row */
        return tls_seq;
    }
    int64_t seq = next_seq(in, topic);
    if (seq < 0)
        return -1;
    __atomic_add_fetch(&in->failed, 1, __ATOMIC_RELAXED);
    write_row(in, seq, topic, partition, -1, "failed", err, now_ms(), 0);
    return seq;
}
