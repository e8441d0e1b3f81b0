/* The machine's read bandwidth as kvq bench compares against it, and `kvq membw`, which prints it alone (the demo
 * and bench/ scripts call it). A streaming read of a buffer far larger than the last-level cache: 8x the LLC that
 * sysfs reports (at least 256 MiB; 1 GiB when sysfs says nothing), split into one contiguous slice per thread,
 * each summed by a vectorised loop; the median of several passes. Bytes read per second of wall time, from the
 * first thread's start to the last thread's end (docs/bench.md, "Method").
 *
 * The loop must not be what limits the figure: it adds 64-bit words with GCC vector extensions, eight independent
 * 16-byte accumulators, so it issues one or two 16-byte loads per cycle (40-120 GB/s per core at 2.6-3.7 GHz)
 * with no dependency chain longer than one add; a DRAM stream gets 10-30 GB/s per core. The same loop is also
 * timed over a buffer that fits in L2 (loop_gbps): when that is not well above the DRAM figure, the loop is the
 * limit and the tool says so. */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvq_tool.h"
#include "tool_spec.h"

/* ------------------------------------------------------------------------------------------------ machine -- */

/* "32768K" / "1M" -> bytes; 0 when unreadable. */
static long long read_cache_size(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    long long v = 0;
    char unit = 0;
    int n = fscanf(f, "%lld%c", &v, &unit);
    fclose(f);
    if (n < 1 || v <= 0) return 0;
    if (unit == 'K') v <<= 10;
    if (unit == 'M') v <<= 20;
    if (unit == 'G') v <<= 30;
    return v;
}

static int read_int_file(const char *path)
{
    FILE *f = fopen(path, "r");
    int v = -1;
    if (f) {
        if (fscanf(f, "%d", &v) != 1) v = -1;
        fclose(f);
    }
    return v;
}

void kvq_machine_describe(kvq_machine *m)
{
    memset(m, 0, sizeof *m);
    snprintf(m->model, sizeof m->model, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        /* x86: "model name"; arm64 has no model name line, "CPU part" is not a name: keep "unknown CPU". */
        if (strncmp(line, "model name", 10)) continue;
        const char *c = strchr(line, ':');
        if (!c) continue;
        c++;
        while (*c == ' ' || *c == '\t') c++;
        snprintf(m->model, sizeof m->model, "%s", c);
        m->model[strcspn(m->model, "\n")] = '\0';
        break;
    }
    if (f) fclose(f);
    long on = sysconf(_SC_NPROCESSORS_ONLN);
    m->cpus = on > 0 ? (int)on : 1;
    cpu_set_t set;
    m->usable = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : m->cpus;
    /* cpu0's data/unified caches: the highest level is the LLC. */
    for (int i = 0; i < 16; i++) {
        char p[128];
        snprintf(p, sizeof p, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        int level = read_int_file(p);
        if (level < 0) break;
        snprintf(p, sizeof p, "/sys/devices/system/cpu/cpu0/cache/index%d/type", i);
        FILE *t = fopen(p, "r");
        char type[32] = "";
        if (t) {
            if (!fgets(type, sizeof type, t)) type[0] = '\0';
            fclose(t);
        }
        if (!strncmp(type, "Instruction", 11)) continue;
        snprintf(p, sizeof p, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        long long size = read_cache_size(p);
        if (level == 2 && size) m->l2_bytes = size;
        if (size && level >= m->llc_level) {
            m->llc_level = level;
            m->llc_bytes = size;
        }
    }
}

/* --------------------------------------------------------------------------------------------- the read -- */

/* 16-byte vectors: every x86-64 (SSE2) and arm64 (NEON) has them, so the accumulators stay in registers
 * without -mavx; eight of them, 128 bytes a turn, no add waiting on the previous one. */
typedef uint64_t u64x2 __attribute__((vector_size(16)));

volatile uint64_t kvq_membw_sink; /* keeps the sums alive */

/* Sums n bytes (a multiple of 128) at p (16-byte aligned). */
static uint64_t sum_bytes(const void *p, size_t n)
{
    const u64x2 *v = p;
    u64x2 a0 = {0, 0}, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (size_t i = 0, w = n / sizeof(u64x2); i < w; i += 8) {
        a0 += v[i];
        a1 += v[i + 1];
        a2 += v[i + 2];
        a3 += v[i + 3];
        a4 += v[i + 4];
        a5 += v[i + 5];
        a6 += v[i + 6];
        a7 += v[i + 7];
    }
    a0 += a1 + a2 + a3 + a4 + a5 + a6 + a7;
    return a0[0] + a0[1];
}

double kvq_tool_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static cpu_set_t original;
static int have_original;

int kvq_unpin(void)
{
    if (!have_original) return 0;
    return sched_setaffinity(0, sizeof original, &original) ? -1 : 0;
}

int kvq_pin_to_cpu(int index)
{
    if (!have_original) { /* the mask before anything here pinned the process's first thread */
        if (sched_getaffinity(0, sizeof original, &original)) return -1;
        have_original = 1;
    }
    int seen = 0, count = CPU_COUNT(&original);
    if (count <= 0) return -1;
    index %= count;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &original)) continue;
        if (seen++ != index) continue;
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(c, &one);
        return sched_setaffinity(0, sizeof one, &one) ? -1 : c;
    }
    return -1;
}

typedef struct {
    const unsigned char *buf;
    size_t slice, bytes; /* bytes > slice: the slice is read again (the in-cache loop test) */
    int index, pin;
    double t0, t1;
} reader;

static void *reader_main(void *arg)
{
    reader *r = arg;
    if (r->pin) kvq_pin_to_cpu(r->index);
    uint64_t s = 0;
    r->t0 = kvq_tool_now();
    for (size_t done = 0; done < r->bytes; done += r->slice) {
        s += sum_bytes(r->buf, r->slice);
        /* The buffer "may have changed": the compiler must not reuse the last sum for a repeated slice. */
        __asm__ volatile("" ::: "memory");
    }
    r->t1 = kvq_tool_now();
    kvq_membw_sink += s;
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Runs `passes` passes of `threads` readers (the caller is reader 0), each reading `per_thread` bytes from its
 * own slice of `slice` bytes; fills gbps[passes], sorted. The readers are started afresh for every pass (a pass
 * takes milliseconds, a thread start microseconds, and each reader times itself from its own start). Returns 0,
 * or -1 with err set. */
static int timed_read(const unsigned char *buf, size_t slice, size_t per_thread, int threads, int pin, int passes,
                      double *gbps, char *err, size_t errsz)
{
    reader *rs = calloc((size_t)threads, sizeof *rs);
    pthread_t *tid = calloc((size_t)threads, sizeof *tid);
    int rc = 0;
    if (!rs || !tid) {
        snprintf(err, errsz, "out of memory");
        rc = -1;
    }
    for (int p = 0; !rc && p < passes; p++) {
        int started = 1;
        for (int i = 0; i < threads; i++) rs[i] = (reader){buf + (size_t)i * slice, slice, per_thread, i, pin, 0, 0};
        for (; started < threads; started++)
            if (pthread_create(&tid[started], NULL, reader_main, &rs[started])) break;
        reader_main(&rs[0]);
        for (int i = 1; i < started; i++) pthread_join(tid[i], NULL);
        if (started < threads) {
            snprintf(err, errsz, "could not start %d reader threads", threads);
            rc = -1;
            break;
        }
        double a = rs[0].t0, b = rs[0].t1;
        for (int i = 1; i < threads; i++) {
            if (rs[i].t0 < a) a = rs[i].t0;
            if (rs[i].t1 > b) b = rs[i].t1;
        }
        gbps[p] = (double)per_thread * threads / (b - a) / 1e9;
    }
    if (pin) kvq_pin_to_cpu(0); /* reader 0 was the caller: it stays where --pin put it */
    if (!rc) qsort(gbps, (size_t)passes, sizeof *gbps, cmp_double);
    free(rs), free(tid);
    return rc;
}

struct kvq_membw {
    unsigned char *buf;
    size_t bytes;
    kvq_machine machine;
};

kvq_membw *kvq_membw_open(size_t bytes, char *err, size_t errsz)
{
    kvq_membw *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, errsz, "out of memory");
        return NULL;
    }
    kvq_machine_describe(&m->machine);
    if (!bytes) bytes = m->machine.llc_bytes ? (size_t)m->machine.llc_bytes * 8 : (size_t)1 << 30;
    if (bytes < (size_t)256 << 20) bytes = (size_t)256 << 20;
    bytes = (bytes + 4095) & ~(size_t)4095;
    m->bytes = bytes;
    m->buf = aligned_alloc(4096, bytes);
    if (!m->buf) {
        snprintf(err, errsz, "cannot allocate the %zu MiB read buffer", bytes >> 20);
        free(m);
        return NULL;
    }
    /* Touch every page (with data that is not zero: no shared zero page) before anything is timed. */
    for (size_t i = 0; i < bytes; i += 64) m->buf[i] = (unsigned char)(i >> 6);
    return m;
}

void kvq_membw_close(kvq_membw *m)
{
    if (!m) return;
    free(m->buf);
    free(m);
}

const kvq_machine *kvq_membw_machine(const kvq_membw *m) { return &m->machine; }

int kvq_membw_measure(kvq_membw *m, int threads, int pin, int passes, kvq_membw_result *r, char *err, size_t errsz)
{
    if (threads < 1 || passes < 1 || passes > 1000) {
        snprintf(err, errsz, "threads %d / passes %d out of range", threads, passes);
        return -1;
    }
    memset(r, 0, sizeof *r);
    r->threads = threads;
    r->passes = passes;
    r->buffer_bytes = m->bytes;
    size_t slice = m->bytes / (size_t)threads & ~(size_t)4095;
    double *g = calloc((size_t)(passes > 3 ? passes : 3), sizeof *g); /* the loop test takes 3 passes */
    if (!g) {
        snprintf(err, errsz, "out of memory");
        return -1;
    }
    /* One untimed pass first: the threads' first touch of their slices and any frequency ramp. */
    int rc = timed_read(m->buf, slice, slice, threads, pin, 1, g, err, errsz);
    if (!rc) rc = timed_read(m->buf, slice, slice, threads, pin, passes, g, err, errsz);
    if (!rc) {
        r->gbps = g[passes / 2];
        r->gbps_min = g[0];
        r->gbps_max = g[passes - 1];
    }
    /* The loop alone: each thread reads a slice that fits in half of its L2 over and over, as many bytes as a
     * DRAM pass; the best of three. */
    size_t small = m->machine.l2_bytes ? (size_t)m->machine.l2_bytes / 2 : (size_t)256 << 10;
    small &= ~(size_t)4095;
    if (!rc && small * (size_t)threads <= m->bytes) {
        size_t per = slice / small * small;
        rc = timed_read(m->buf, small, per ? per : small, threads, pin, 3, g, err, errsz);
        if (!rc) r->loop_gbps = g[2];
    }
    free(g);
    return rc;
}

void kvq_membw_evict(kvq_membw *m)
{
    /* Four times the LLC from a rotating offset, so the next reader finds nothing of its own there. */
    static size_t off;
    size_t n = m->machine.llc_bytes ? (size_t)m->machine.llc_bytes * 4 : m->bytes / 4;
    if (n > m->bytes) n = m->bytes;
    n &= ~(size_t)4095;
    if (off + n > m->bytes) off = 0;
    kvq_membw_sink += sum_bytes(m->buf + off, n);
    off += n;
}

/* ------------------------------------------------------------------------------------------- kvq membw -- */

static void usage(void)
{
    fprintf(stderr, "usage: kvq membw [--threads N[,N...]] [--passes P] [--mib M] [--pin] [--json]\n"
                    "  The machine's read bandwidth: a streaming read of a buffer of M MiB (default 8x the last-level\n"
                    "  cache, at least 256 MiB) by N threads (default 1), median of P passes (default 7). docs/bench.md.\n");
}

int kvq_membw_main(int argc, char **argv)
{
    int threads[16] = {1}, n_threads = 1, passes = 7, mib = 0, pin = 0, json = 0;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(o, "-h") || !strcmp(o, "--help")) {
            usage();
            return 0;
        }
        if (!strcmp(o, "--pin")) {
            pin = 1;
            continue;
        }
        if (!strcmp(o, "--json")) {
            json = 1;
            continue;
        }
        int bad;
        if (!strcmp(o, "--threads") && v)
            bad = kvq_tool_int_list("membw", o, v, 1, 1024, threads, 16, &n_threads);
        else if (!strcmp(o, "--passes") && v)
            bad = tool_int("kvq membw", o, v, 1, 1000, &passes);
        else if (!strcmp(o, "--mib") && v)
            bad = tool_int("kvq membw", o, v, 1, 1 << 20, &mib);
        else if (!strncmp(o, "--", 2) && !v && (!strcmp(o, "--threads") || !strcmp(o, "--passes") ||
                                                   !strcmp(o, "--mib")))
            bad = kvq_tool_error("membw", "%s needs a value", o);
        else
            bad = kvq_tool_error("membw", "unknown option '%s'", o);
        if (bad) {
            usage();
            return 2;
        }
        i++;
    }
    char err[256];
    kvq_membw *m = kvq_membw_open((size_t)mib << 20, err, sizeof err);
    if (!m) {
        kvq_tool_error("membw", "%s", err);
        return 1;
    }
    if (pin && kvq_pin_to_cpu(0) < 0) fprintf(stderr, "kvq membw: note: --pin: sched_setaffinity failed\n");
    const kvq_machine *mc = kvq_membw_machine(m);
    if (json)
    {
        printf("{\"machine\": {\"model\": ");
        kvq_tool_json_string(stdout, mc->model);
        printf(", \"cpus\": %d, \"usable_cpus\": %d, \"llc_bytes\": %lld}, \"bandwidth\": [", mc->cpus, mc->usable,
               mc->llc_bytes);
    }
    else
        printf("kvq membw: %s, %d cpus, LLC %lld MiB; read of %zu MiB%s\n", mc->model, mc->cpus, mc->llc_bytes >> 20,
               (size_t)mib ? (size_t)mib : m->bytes >> 20, pin ? ", pinned" : "");
    int rc = 0;
    for (int i = 0; i < n_threads; i++) {
        kvq_membw_result r;
        if (kvq_membw_measure(m, threads[i], pin, passes, &r, err, sizeof err)) {
            kvq_tool_error("membw", "%s", err);
            rc = 1;
            break;
        }
        if (json)
            printf("%s{\"threads\": %d, \"gbps\": %.3f, \"gbps_min\": %.3f, \"gbps_max\": %.3f, \"loop_gbps\": %.3f, "
                   "\"passes\": %d, \"buffer_bytes\": %zu}",
                   i ? ", " : "", r.threads, r.gbps, r.gbps_min, r.gbps_max, r.loop_gbps, r.passes, r.buffer_bytes);
        else
            printf("%2d thread%s: %.2f GB/s (median of %d passes, %.2f-%.2f); the loop alone in L2: %.1f GB/s\n",
                   r.threads, r.threads == 1 ? " " : "s", r.gbps, r.passes, r.gbps_min, r.gbps_max, r.loop_gbps);
        if (r.loop_gbps > 0 && r.loop_gbps < 2 * r.gbps)
            fprintf(stderr, "kvq membw: warning: the read loop itself runs at %.1f GB/s, under twice the %.1f GB/s "
                            "measured: the figure may be the loop's, not the memory's\n", r.loop_gbps, r.gbps);
    }
    if (json) printf("]}\n");
    kvq_membw_close(m);
    return rc;
}
