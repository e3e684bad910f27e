/* skload: a small AMQP 0-9-1 load generator in C for benchmarks/workers.py (issue 27).

   Theory of operation
   -------------------
   Workload (2) of benchmarks/run.py, with a client cheap enough that the broker, not the client,
   is the bottleneck: for every vhost named on the command line, PAIRS producer threads and PAIRS
   consumer threads, each on its own connection, producer i publishing to queue "skload-i" (via
   the default exchange) and consumer i consuming it with no-ack. Every message is different:
   a body of 200 B to 2 KiB, a message-id, a timestamp and three string headers, as workloads.py's
   "varied" messages are. Producers write flat out with blocking sockets: when the broker holds a
   publisher (its queues backlogged) the write blocks, which is the flow control. Consumers only
   count Basic.Deliver method frames. After a warm-up second, the main thread samples the
   delivered count over SECONDS and prints one JSON line: {"consume_rate": ..., "consumed": ...}.

   Only the methods this needs are encoded (Start-Ok, Tune-Ok, Open, Channel.Open, Queue.Declare,
   Basic.Consume, Basic.Publish and its content); any frame the broker sends that is not awaited
   is skipped. Heartbeats are off (Tune-Ok with 0). Bounded: the process exits after
   1 + SECONDS seconds; a connection failure ends the process with status 1.

   Issue 31's throughput workloads (benchmarks/throughput.py) are further modes, chosen with
   -w before the host; every message is varied as above and every loop ends with the process:
     varied  the above (the default).
     queues  PAIRS queues (e.g. 1,000) per vhost, a producer channel and a consumer channel each,
             unthrottled; the channels are spread over QUEUE_THREADS producer connections and as many
             consumer connections (threads); a producer writes one message to each of its channels
             in turn.
     ack     as varied, but every consumer takes Basic.Qos prefetch 100 and acks each delivery with
             its own Basic.Ack (multiple=0); the acks a read brought are written together before
             the next read (one send per read, as a client library's write buffer does).
     topic   a topic exchange "skload-topic" and TOPIC_QUEUES queues bound to it with the patterns
             "*.r<j % 10>.k<j / 10>" (benchmarks/callgrind.py's topic-50), each consumed with no-ack
             from TOPIC_THREADS consumer connections; PAIRS producers publish with routing keys
             drawn at random from the 50 keys "x.r<a>.k<b>" that match one pattern each, so every
             message is one delivery.
   A consumer counts Basic.Deliver frames: the rate printed is deliveries per second.

   Build: cc -O2 -pthread -o skload skload.c
   Use:   skload [-w varied|queues|ack|topic] HOST PORT SECONDS PAIRS VHOST [VHOST...]   (guest/guest) */

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define FRAME_MAX 131072
#define BUF 262144

static const char *host;
static int port;
static atomic_ullong delivered;
static atomic_int stop_all;
static atomic_int ready;   /* threads done with set-up */
static atomic_int consumers_ready;
static int consumers_total;

typedef struct {
    int fd;
    unsigned char in[BUF];
    size_t off;   /* the unread bytes are in[off, have) */
    size_t have;
} conn_t;

typedef struct {
    const char *vhost;
    int index;     /* the first queue this thread serves */
    int count;     /* how many queues (channels 1..count) */
    int producer;
} job_t;

enum { VARIED, QUEUES, ACK, TOPIC };
static int mode = VARIED;
#define QUEUE_THREADS 4
#define TOPIC_QUEUES 50
#define TOPIC_THREADS 2
#define TOPIC_EXCHANGE "skload-topic"
#define PREFETCH 100

static void die(const char *what) {
    fprintf(stderr, "skload: %s\n", what);
    exit(1);
}

static unsigned char *put8(unsigned char *p, unsigned v) { *p++ = (unsigned char)v; return p; }
static unsigned char *put16(unsigned char *p, unsigned v) { p[0] = v >> 8; p[1] = v; return p + 2; }
static unsigned char *put32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v; return p + 4;
}
static unsigned char *put64(unsigned char *p, uint64_t v) { p = put32(p, v >> 32); return put32(p, (uint32_t)v); }
static unsigned char *shortstr(unsigned char *p, const char *s) {
    size_t n = strlen(s);
    p = put8(p, (unsigned)n);
    memcpy(p, s, n);
    return p + n;
}
static unsigned char *longstr(unsigned char *p, const void *s, size_t n) {
    p = put32(p, (uint32_t)n);
    memcpy(p, s, n);
    return p + n;
}

static void send_all(int fd, const unsigned char *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) die("send failed");
        p += w;
        n -= (size_t)w;
    }
}

/* A method frame on channel ch: payload [start, end) already holds class and method ids. */
static void send_method(int fd, unsigned ch, const unsigned char *payload, size_t n) {
    unsigned char frame[4096], *p = frame;
    p = put8(p, 1);
    p = put16(p, ch);
    p = put32(p, (uint32_t)n);
    memcpy(p, payload, n);
    p += n;
    p = put8(p, 0xCE);
    send_all(fd, frame, (size_t)(p - frame));
}

/* The next frame: its type, channel and payload (pointer into c->in, valid until the next call). */
static int next_frame(conn_t *c, unsigned *type, unsigned *ch, unsigned char **payload, uint32_t *size,
                      size_t *consumed) {
    for (;;) {
        size_t have = c->have - c->off;
        const unsigned char *in = c->in + c->off;
        if (have >= 7) {
            uint32_t n = ((uint32_t)in[3] << 24) | ((uint32_t)in[4] << 16) | ((uint32_t)in[5] << 8) | in[6];
            if (n + 8 > BUF) die("frame larger than the buffer");
            if (have >= n + 8) {
                *type = in[0];
                *ch = ((unsigned)in[1] << 8) | in[2];
                *payload = c->in + c->off + 7;
                *size = n;
                *consumed = n + 8;
                return 1;
            }
        }
        /* Move the partial frame to the front only when more must be read: one copy per read,
           not one per frame (a copy of the whole buffer per frame cost more CPU than the broker). */
        if (c->off > 0) {
            memmove(c->in, c->in + c->off, have);
            c->off = 0;
            c->have = have;
        }
        ssize_t r = recv(c->fd, c->in + c->have, BUF - c->have, 0);
        if (r <= 0) return 0;
        c->have += (size_t)r;
    }
}

static void drop(conn_t *c, size_t n) {
    c->off += n;
}

/* Wait for method (cls, mth), skipping anything else; a Close of either kind ends the process. */
static void expect(conn_t *c, unsigned cls, unsigned mth) {
    unsigned type, ch;
    unsigned char *p;
    uint32_t n;
    size_t used;
    for (;;) {
        if (!next_frame(c, &type, &ch, &p, &n, &used)) die("connection closed during setup");
        if (type == 1 && n >= 4) {
            unsigned gc = ((unsigned)p[0] << 8) | p[1], gm = ((unsigned)p[2] << 8) | p[3];
            if ((gc == 10 && gm == 50) || (gc == 20 && gm == 40)) {
                fprintf(stderr, "skload: closed by the broker: %.*s\n", (int)p[6], (const char *)p + 7);
                exit(1);
            }
            if (gc == cls && gm == mth) {
                drop(c, used);
                return;
            }
        }
        drop(c, used);
    }
}

static void open_conn(conn_t *c, const char *vhost) {
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) die("HOST must be an IPv4 address");
    c->fd = socket(AF_INET, SOCK_STREAM, 0);
    c->off = c->have = 0;
    if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&sa, sizeof sa) != 0) die("cannot connect");
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    send_all(c->fd, (const unsigned char *)"AMQP\0\0\x09\x01", 8);
    expect(c, 10, 10);
    unsigned char m[512], *p = m;
    p = put16(p, 10); p = put16(p, 11);
    p = put32(p, 0);                                  /* client properties: none */
    p = shortstr(p, "PLAIN");
    p = longstr(p, "\0guest\0guest", 12);
    p = shortstr(p, "en_US");
    send_method(c->fd, 0, m, (size_t)(p - m));
    expect(c, 10, 30);
    p = m;
    p = put16(p, 10); p = put16(p, 31);
    p = put16(p, 2047); p = put32(p, FRAME_MAX); p = put16(p, 0);   /* RabbitMQ refuses channel-max 0; no heartbeats */
    send_method(c->fd, 0, m, (size_t)(p - m));
    p = m;
    p = put16(p, 10); p = put16(p, 40);
    p = shortstr(p, vhost); p = shortstr(p, ""); p = put8(p, 0);
    send_method(c->fd, 0, m, (size_t)(p - m));
    expect(c, 10, 41);
}

/* Set-up methods are synchronous: each waits for its -Ok before the next is sent. */
static void open_channel(conn_t *c, unsigned ch) {
    unsigned char m[64], *p = m;
    p = put16(p, 20); p = put16(p, 10); p = shortstr(p, "");
    send_method(c->fd, ch, m, (size_t)(p - m));
    expect(c, 20, 11);
}

static void declare(conn_t *c, unsigned ch, const char *queue) {
    unsigned char m[512], *p = m;
    p = put16(p, 50); p = put16(p, 10);
    p = put16(p, 0); p = shortstr(p, queue); p = put8(p, 0x08); p = put32(p, 0);  /* auto-delete */
    send_method(c->fd, ch, m, (size_t)(p - m));
    expect(c, 50, 11);
}

static void declare_topic(conn_t *c, unsigned ch) {
    unsigned char m[512], *p = m;
    p = put16(p, 40); p = put16(p, 10);
    p = put16(p, 0); p = shortstr(p, TOPIC_EXCHANGE); p = shortstr(p, "topic"); p = put8(p, 0); p = put32(p, 0);
    send_method(c->fd, ch, m, (size_t)(p - m));
    expect(c, 40, 11);
}

static void bind_topic(conn_t *c, unsigned ch, const char *queue, const char *pattern) {
    unsigned char m[512], *p = m;
    p = put16(p, 50); p = put16(p, 20);
    p = put16(p, 0); p = shortstr(p, queue); p = shortstr(p, TOPIC_EXCHANGE); p = shortstr(p, pattern);
    p = put8(p, 0); p = put32(p, 0);
    send_method(c->fd, ch, m, (size_t)(p - m));
    expect(c, 50, 21);
}

static void qos(conn_t *c, unsigned ch, unsigned prefetch) {
    unsigned char m[64], *p = m;
    p = put16(p, 60); p = put16(p, 10); p = put32(p, 0); p = put16(p, prefetch); p = put8(p, 0);
    send_method(c->fd, ch, m, (size_t)(p - m));
    expect(c, 60, 11);
}

static void queue_name(char *out, size_t n, int index) {
    static const char *prefix[] = {"skload", "skq", "skack", "sktopic"};
    snprintf(out, n, "%s-%d", prefix[mode], index);
}

/* One varied message (publish + header + body frames) into out; its length. */
static size_t encode_message(unsigned char *out, unsigned ch, const char *exchange, const char *key,
                             uint64_t seq, unsigned *rnd, const unsigned char *pool) {
    unsigned char *p = out, *size_at;
    size_t body = 200 + (size_t)(rand_r(rnd) % 1849);  /* 200 B .. 2 KiB */
    /* Basic.Publish */
    p = put8(p, 1); p = put16(p, ch); size_at = p; p += 4;
    unsigned char *start = p;
    p = put16(p, 60); p = put16(p, 40); p = put16(p, 0); p = shortstr(p, exchange); p = shortstr(p, key);
    p = put8(p, 0);
    put32(size_at, (uint32_t)(p - start));
    p = put8(p, 0xCE);
    /* content header: headers, message-id, timestamp */
    p = put8(p, 2); p = put16(p, ch); size_at = p; p += 4;
    start = p;
    p = put16(p, 60); p = put16(p, 0); p = put64(p, body);
    p = put16(p, 0x2000 | 0x0080 | 0x0040);
    unsigned char *table_at = p;
    p += 4;
    unsigned char *table = p;
    char value[32];
    static const char *keys[3] = {"source", "kind", "trace"};
    for (int i = 0; i < 3; i++) {
        int n = snprintf(value, sizeof value, "v%u-%llu", rand_r(rnd) % 1000, (unsigned long long)seq);
        p = shortstr(p, keys[i]);
        p = put8(p, 'S');
        p = longstr(p, value, (size_t)n);
    }
    put32(table_at, (uint32_t)(p - table));
    char id[40];
    snprintf(id, sizeof id, "%.20s-%016llx", key, (unsigned long long)seq);
    p = shortstr(p, id);
    p = put64(p, (uint64_t)time(NULL));
    put32(size_at, (uint32_t)(p - start));
    p = put8(p, 0xCE);
    /* body */
    p = put8(p, 3); p = put16(p, ch); p = put32(p, (uint32_t)body);
    memcpy(p, pool + (seq * 131) % 4096, body);
    p += body;
    p = put8(p, 0xCE);
    return (size_t)(p - out);
}

static void *producer(job_t *job) {
    static unsigned char pool[4096 + 2048];
    for (size_t i = 0; i < sizeof pool; i++) pool[i] = (unsigned char)('a' + i % 26);
    conn_t *c = calloc(1, sizeof *c);
    open_conn(c, job->vhost);
    int channels = mode == TOPIC ? 1 : job->count;
    char (*keys)[64] = calloc((size_t)(mode == TOPIC ? TOPIC_QUEUES : channels), sizeof *keys);
    for (int k = 0; k < channels; k++) {
        open_channel(c, (unsigned)k + 1);
        if (mode != TOPIC) {
            queue_name(keys[k], sizeof keys[k], job->index + k);
            declare(c, (unsigned)k + 1, keys[k]);
        }
    }
    if (mode == TOPIC) {
        declare_topic(c, 1);
        for (int j = 0; j < TOPIC_QUEUES; j++) snprintf(keys[j], sizeof keys[j], "x.r%d.k%d", j % 10, j / 10);
    }
    const char *exchange = mode == TOPIC ? TOPIC_EXCHANGE : "";
    unsigned rnd = (unsigned)job->index * 7919u + 1;
    unsigned char *batch = malloc(64 * 4096);
    uint64_t seq = 0;
    int next = 0;
    /* publish only once every consumer is set up: a broker busy with a flood from the producers
       would take minutes to set up the rest of 1,000 consumers */
    struct timespec tick = {0, 10000000};
    while (atomic_load(&consumers_ready) < consumers_total && !atomic_load(&stop_all)) nanosleep(&tick, NULL);
    atomic_fetch_add(&ready, 1);
    while (!atomic_load(&stop_all)) {
        size_t n = 0;
        for (int i = 0; i < 32; i++) {
            int k = mode == TOPIC ? (int)(rand_r(&rnd) % TOPIC_QUEUES) : next;
            unsigned ch = mode == TOPIC ? 1u : (unsigned)next + 1;
            n += encode_message(batch + n, ch, exchange, keys[k], seq++, &rnd, pool);
            if (++next == channels) next = 0;
        }
        send_all(c->fd, batch, n);
        /* skip whatever the broker sent us (nothing is expected; never let it pile up) */
        ssize_t r;
        while ((r = recv(c->fd, c->in, BUF, MSG_DONTWAIT)) > 0) {}
    }
    return NULL;
}

/* Whether a whole frame is already buffered (so the next read would not block). */
static int frame_buffered(const conn_t *c) {
    size_t have = c->have - c->off;
    const unsigned char *in = c->in + c->off;
    if (have < 7) return 0;
    uint32_t n = ((uint32_t)in[3] << 24) | ((uint32_t)in[4] << 16) | ((uint32_t)in[5] << 8) | in[6];
    return have >= n + 8;
}

static void *consumer(job_t *job) {
    conn_t *c = calloc(1, sizeof *c);
    open_conn(c, job->vhost);
    for (int k = 0; k < job->count; k++) {
        unsigned ch = (unsigned)k + 1;
        char queue[64];
        queue_name(queue, sizeof queue, job->index + k);
        open_channel(c, ch);
        declare(c, ch, queue);
        if (mode == TOPIC) {
            char pattern[64];
            int j = job->index + k;
            if (k == 0) declare_topic(c, ch);
            snprintf(pattern, sizeof pattern, "*.r%d.k%d", j % 10, j / 10);
            bind_topic(c, ch, queue, pattern);
        }
        if (mode == ACK) qos(c, ch, PREFETCH);
        unsigned char m[256], *p = m;
        p = put16(p, 60); p = put16(p, 20); p = put16(p, 0); p = shortstr(p, queue); p = shortstr(p, "");
        p = put8(p, mode == ACK ? 0x00 : 0x02); p = put32(p, 0);   /* no-ack unless acking */
        send_method(c->fd, ch, m, (size_t)(p - m));
        expect(c, 60, 21);
    }
    unsigned type, ch;
    unsigned char *payload;
    uint32_t n;
    size_t used;
    unsigned long long mine = 0;
    unsigned char *acks = malloc(BUF);
    size_t pending = 0;
    atomic_fetch_add(&consumers_ready, 1);
    atomic_fetch_add(&ready, 1);
    for (;;) {
        if (pending && (pending > BUF - 64 || !frame_buffered(c))) {
            send_all(c->fd, acks, pending);
            pending = 0;
        }
        if (atomic_load(&stop_all) || !next_frame(c, &type, &ch, &payload, &n, &used)) break;
        if (type == 1 && n >= 4 && payload[0] == 0 && payload[1] == 60 && payload[2] == 0 && payload[3] == 60) {
            if (mode == ACK && n >= 5u + payload[4] + 8u) {
                const unsigned char *tag = payload + 5 + payload[4];  /* after the consumer tag */
                unsigned char *p = acks + pending;
                p = put8(p, 1); p = put16(p, ch); p = put32(p, 13);
                p = put16(p, 60); p = put16(p, 80);
                memcpy(p, tag, 8); p += 8;
                p = put8(p, 0);                                       /* multiple = 0 */
                p = put8(p, 0xCE);
                pending = (size_t)(p - acks);
            }
            if (++mine == 64) {
                atomic_fetch_add(&delivered, mine);
                mine = 0;
            }
        }
        drop(c, used);
    }
    return NULL;
}

static void *run_job(void *arg) {
    job_t *job = arg;
    return job->producer ? producer(job) : consumer(job);
}

static double cpu_now(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}


int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[1], "-w") == 0) {
        static const char *names[] = {"varied", "queues", "ack", "topic"};
        mode = -1;
        for (int i = 0; i < 4; i++)
            if (strcmp(argv[2], names[i]) == 0) mode = i;
        if (mode < 0) die("-w varied|queues|ack|topic");
        argv += 2;
        argc -= 2;
    }
    if (argc < 6) {
        fprintf(stderr, "usage: skload [-w varied|queues|ack|topic] HOST PORT SECONDS PAIRS VHOST [VHOST...]\n");
        return 2;
    }
    host = argv[1];
    port = atoi(argv[2]);
    double seconds = atof(argv[3]);
    int pairs = atoi(argv[4]);
    int vhosts = argc - 5;
    int most = mode == QUEUES ? 2000 : 64;
    if (seconds <= 0 || seconds > 600 || pairs < 1 || pairs > most) die("SECONDS in (0, 600], PAIRS in [1, 64] (queues: 2000)");
    job_t *job = calloc((size_t)(vhosts * (pairs + QUEUE_THREADS + TOPIC_THREADS) * 2), sizeof *job);
    int k = 0;
    for (int v = 0; v < vhosts; v++) {
        const char *vh = argv[5 + v];
        /* consumers first: nothing published is dropped */
        if (mode == QUEUES) {
            int threads = pairs < QUEUE_THREADS ? pairs : QUEUE_THREADS;
            for (int prod = 0; prod < 2; prod++)
                for (int t = 0; t < threads; t++) {
                    int lo = t * pairs / threads, hi = (t + 1) * pairs / threads;
                    job[k++] = (job_t){vh, lo, hi - lo, prod};
                }
        } else if (mode == TOPIC) {
            for (int t = 0; t < TOPIC_THREADS; t++) {
                int lo = t * TOPIC_QUEUES / TOPIC_THREADS, hi = (t + 1) * TOPIC_QUEUES / TOPIC_THREADS;
                job[k++] = (job_t){vh, lo, hi - lo, 0};
            }
            for (int i = 0; i < pairs; i++) {
                job[k++] = (job_t){vh, i, 1, 1};
            }
        } else {
            for (int i = 0; i < pairs; i++)
                for (int prod = 0; prod < 2; prod++) {
                    job[k++] = (job_t){vh, i, 1, prod};
                }
        }
    }
    for (int i = 0; i < k; i++) consumers_total += !job[i].producer;   /* before any thread reads it */
    for (int i = 0; i < k; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, run_job, &job[i]) != 0) die("pthread_create");
        pthread_detach(t);
    }
    /* set-up (1,000 queues take a while) is not measured: wait for it (120 s at most), then warm up */
    struct timespec tick = {0, 10000000}, warm = {1, 0};
    for (int i = 0; i < 12000 && atomic_load(&ready) < k; i++) nanosleep(&tick, NULL);
    if (atomic_load(&ready) < k) die("set-up took over 120 s");
    nanosleep(&warm, NULL);
    unsigned long long first = atomic_load(&delivered);
    double t0 = now(), cpu0 = cpu_now();
    printf("{\"window\": \"start\"}\n");   /* a caller samples the broker's CPU over the same window */
    fflush(stdout);
    struct timespec span = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    nanosleep(&span, NULL);
    unsigned long long last = atomic_load(&delivered);
    double elapsed = now() - t0, cpu = cpu_now() - cpu0;
    atomic_store(&stop_all, 1);
    printf("{\"consume_rate\": %.1f, \"consumed\": %llu, \"seconds\": %.3f, \"cpu_seconds\": %.3f}\n",
           (double)(last - first) / elapsed, last - first, elapsed, cpu);
    fflush(stdout);
    _exit(0);  /* threads blocked in send/recv end with the process */
}
