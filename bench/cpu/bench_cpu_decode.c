/* A private timing program of the cpu backend (the official benchmark is `kvq bench`): one layer, head_dim D,
 * kv_heads H, GQA g, a prefill of T tokens, then the median of N decode steps. Prints ms per step, the cache
 * bytes a step reads (every segment the step attends over: the engine's stats less host memory) and GB/s, and a
 * streaming-read bandwidth of a 1 GiB buffer on the same threads for comparison.
 *   bench_cpu_decode SPEC [T=16384] [g=1] [threads=1] [steps=20] [backend=cpu|reference] [D=128] [H=8] */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "half.h"
#include "kvq.h"
#include "scheme.h"

/* BENCH_CPU_TIME=1: the process's CPU time instead of wall time (one thread on a shared machine: the time the
 * step ran, not the time other processes held its core). */
static clockid_t bench_clock = CLOCK_MONOTONIC;

static double now(void)
{
    struct timespec t;
    clock_gettime(bench_clock, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static uint64_t rng = 88172645463325252ull;
static float uni(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 4503599627370496.0 - 1.0);
}
static void fill16(uint16_t *x, size_t n, float a)
{
    for (size_t i = 0; i < n; i++) x[i] = kvq_f16_from_f32(a * uni());
}

/* Streaming read bandwidth: every thread sums its share of a buffer much larger than the last-level cache. */
typedef struct {
    const uint64_t *p;
    size_t n;
    uint64_t sum;
} rd_arg;
static void *rd(void *a)
{
    rd_arg *r = a;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 4 <= r->n; i += 4) s0 += r->p[i], s1 += r->p[i + 1], s2 += r->p[i + 2], s3 += r->p[i + 3];
    r->sum = s0 + s1 + s2 + s3;
    return NULL;
}
static double read_bw(int threads)
{
    size_t bytes = (size_t)1 << 30, n = bytes / 8;
    uint64_t *buf = malloc(bytes);
    for (size_t i = 0; i < n; i++) buf[i] = i;
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        pthread_t t[64];
        rd_arg a[64];
        double t0 = now();
        for (int i = 0; i < threads; i++) {
            a[i] = (rd_arg){buf + n / (size_t)threads * (size_t)i, n / (size_t)threads, 0};
            pthread_create(&t[i], NULL, rd, &a[i]);
        }
        for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
        double bw = (double)bytes / (now() - t0) / 1e9;
        if (bw > best) best = bw;
    }
    free(buf);
    return best;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s SPEC [T] [g] [threads] [steps] [cpu|reference] [D] [H]\n", argv[0]);
        return 2;
    }
    int T = argc > 2 ? atoi(argv[2]) : 16384, g = argc > 3 ? atoi(argv[3]) : 1, threads = argc > 4 ? atoi(argv[4]) : 1;
    int steps = argc > 5 ? atoi(argv[5]) : 20;
    int ref = argc > 6 && !strcmp(argv[6], "reference");
    int D = argc > 7 ? atoi(argv[7]) : 128, H = argc > 8 ? atoi(argv[8]) : 8, Hq = H * g;
    kvq_spec *sp = NULL;
    if (kvq_spec_parse_file(argv[1], &sp) != KVQ_OK) {
        fprintf(stderr, "%s does not check\n", argv[1]);
        return 1;
    }
    const kvq_scheme *sch = kvq_spec_scheme_at(sp, kvq_spec_scheme_count(sp) - 1);
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.backend = ref ? KVQ_BACKEND_REFERENCE : KVQ_BACKEND_CPU;
    cfg.dims = (kvq_dims){1, Hq, H, D};
    cfg.dtype = KVQ_F16;
    cfg.threads = threads;
    kvq_engine *e = NULL;
    char err[512];
    double tc = now();
    if (kvq_engine_create(sch, &cfg, &e, err, sizeof err) != KVQ_OK) {
        fprintf(stderr, "engine: %s\n", err);
        return 1;
    }
    tc = now() - tc;
    kvq_seq *s = NULL;
    kvq_seq_create(e, &s);
    size_t kvn = (size_t)H * (size_t)T * (size_t)D, qn = (size_t)Hq * (size_t)T * (size_t)D;
    uint16_t *k = malloc(kvn * 2), *v = malloc(kvn * 2), *q = malloc(qn * 2);
    fill16(k, kvn, 2.0f), fill16(v, kvn, 1.0f), fill16(q, qn, 1.0f);
    kvq_prefill_item it = {s, T, k, v, q};
    if (kvq_prefill(e, 0, &it, 1) != KVQ_OK) {
        fprintf(stderr, "prefill: %s\n", kvq_engine_errmsg(e));
        return 1;
    }
    free(k), free(v), free(q);
    uint16_t dk[8192], dv[8192], dq[65536];
    float *out = malloc((size_t)Hq * (size_t)D * sizeof(float));
    double *ms = malloc((size_t)steps * sizeof *ms);
    const char *cpu_time = getenv("BENCH_CPU_TIME");
    if (cpu_time && atoi(cpu_time)) bench_clock = CLOCK_PROCESS_CPUTIME_ID;
    for (int i = 0; i < steps; i++) {
        fill16(dk, (size_t)H * D, 2.0f), fill16(dv, (size_t)H * D, 1.0f), fill16(dq, (size_t)Hq * D, 1.0f);
        kvq_decode_item d = {s, dk, dv, dq, out};
        double t0 = now();
        if (kvq_decode(e, 0, &d, 1) != KVQ_OK) {
            fprintf(stderr, "decode: %s\n", kvq_engine_errmsg(e));
            return 1;
        }
        ms[i] = 1e3 * (now() - t0);
    }
    qsort(ms, (size_t)steps, sizeof *ms, cmp_d);
    kvq_mem_stats st;
    kvq_engine_stats(e, &st);
    uint64_t bytes = 0;
    for (int i = 0; i < KVQ_SEG_COUNT; i++)
        if (i != KVQ_SEG_HOST) bytes += st.bytes[i];
    double med = ms[steps / 2];
    printf("%-10s %-9s T %6d g %d threads %d: %8.3f ms/step  %7.1f MB  %6.2f GB/s  (compile %.0f ms)  min %.3f\n",
           sch->name, ref ? "reference" : "cpu", T, g, threads, med, (double)bytes / 1e6,
           (double)bytes / (med * 1e-3) / 1e9, tc * 1e3, ms[0]);
    if (getenv("BENCH_READ_BW")) printf("streaming read, %d threads: %.2f GB/s\n", threads, read_bw(threads));
    free(out), free(ms);
    kvq_engine_free(e);
    kvq_spec_free(sp);
    return 0;
}
