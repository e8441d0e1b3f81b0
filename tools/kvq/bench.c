/* kvq bench: how fast a scheme's decode step runs, against the machine's read bandwidth and the fp16 scheme.
 * For every scheme x context length x thread count: prefill `tokens` random fp16 tokens into `layers` layers of
 * `batch` sequences, run warm-up steps, then time `steps` decode steps (one step = kvq_decode of every timed
 * layer for the whole batch), evicting the last-level cache before each so the cache comes from memory as it
 * does in a model with many layers. Reported: the median, min and max ms per step; the cache bytes a step reads
 * (the engine's device bytes after the step: every device byte of the layers' cache is read once per step);
 * GB/s; that as a percentage of the read bandwidth measured by membw.c with as many threads just before the
 * timed steps (and once for every thread count at the start, to check the read loop); and the step
 * time over the fp16 scheme's (specs/fp16.kvq's scheme, run the same way in the same run). docs/bench.md. */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "half.h"
#include "kvq.h"
#include "kvq_tool.h"
#include "scheme.h"
#include "tool_spec.h"

#define MAX_FILES 16
#define MAX_SCHEMES 32
#define MAX_LIST 16

/* Dims of a scheme without a model block and without options: Llama-3-8B's attention (and the issue's). */
enum { DEFAULT_HEADS = 32, DEFAULT_KV_HEADS = 8, DEFAULT_HEAD_DIM = 128 };

/* specs/fp16.kvq's scheme, used as the baseline when none of the given schemes is named fp16. */
static const char fp16_text[] = "scheme fp16 { bits 16; }\n";

typedef struct {
    const char *files[MAX_FILES];
    int n_files;
    const char *schemes[MAX_SCHEMES];
    int n_schemes;
    int layers, heads, kv_heads, head_dim; /* 0: not given; heads: the one being run, of heads_list */
    int heads_list[MAX_LIST], n_heads;
    int tokens[MAX_LIST], n_tokens;
    int threads[MAX_LIST], n_threads;
    int batch, steps, warmup, passes, seed;
    kvq_backend_kind backend;
    int backend_given, pin, json, markdown, warm, quiet;
} bench_args;

/* One scheme to time, with the dims its engine gets. */
typedef struct {
    const kvq_scheme *scheme;
    kvq_dims dims; /* dims.layers: the model block's count, else the timed layers */
    int timed;     /* layers prefilled and decoded: the first `timed` of dims.layers */
    int baseline;  /* this is the fp16 baseline of its dims */
} bench_scheme;

typedef struct {
    const bench_scheme *bs;
    int tokens, threads;
    int ok;
    char err[512];
    double ms_med, ms_min, ms_max;
    double bytes_per_step; /* mean over the timed steps of the device bytes after each */
    uint64_t cache_bytes;  /* device bytes after the prefill */
    double gbps, bw_pct, vs_fp16, membw_gbps;
} bench_row;

/* Random fp16 K/V/Q of one shape, kept across schemes. */
typedef struct {
    int hkv, h, t, d;
    uint16_t *k, *v, *q; /* [hkv][t][d], [hkv][t][d], [h][t][d] (q only when a scheme needs it) */
    uint64_t rng;
} bench_data;

static double start_time;

/* Progress goes to stderr once a run has lasted a couple of seconds (short runs stay quiet), never with -q. */
static void progress(const bench_args *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void progress(const bench_args *a, const char *fmt, ...)
{
    if (a->quiet || kvq_tool_now() - start_time < 2.0) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvq bench: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void usage(void)
{
    fprintf(stderr,
            "usage: kvq bench FILE... [--scheme NAME]... [--tokens T[,T...]] [--threads N[,N...]] [--batch B]\n"
            "                 [--layers L] [--heads H[,H...]] [--kv-heads HKV] [--head-dim D] [--steps N] [--warmup N]\n"
            "                 [--backend reference|cpu|emu|cuda] [--pin] [--warm] [--passes P] [--seed S]\n"
            "                 [--json | --markdown] [-q]\n"
            "  Prefills T random tokens (default 16384) into L layers (default 1) of B sequences (default 1), then\n"
            "  times N decode steps (default 20) of those layers: median/min/max ms per step, the cache bytes a step\n"
            "  reads, GB/s, the percentage of the read bandwidth measured in the same run with as many threads\n"
            "  (median of P passes, default 7), and the step time over the fp16 scheme's. Dims default to the\n"
            "  scheme's model block, else 32 heads, 8 kv heads, head_dim 128. --threads 0: every usable core\n"
            "  (default). --pin pins this thread and the bandwidth readers to CPUs; --warm skips the LLC eviction\n"
            "  before each step. Default backend: cpu when it runs here, else reference. Guide: docs/bench.md.\n");
}

static int parse_args(int argc, char **argv, bench_args *a)
{
    memset(a, 0, sizeof *a);
    a->tokens[0] = 16384, a->n_tokens = 1;
    a->threads[0] = 0, a->n_threads = 1;
    a->batch = 1, a->steps = 20, a->warmup = 1, a->passes = 7, a->layers = 0;
    static const char *const flags[] = {"--pin", "--warm", "--json", "--markdown", "-q", "--quiet"};
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(o, "-h") || !strcmp(o, "--help")) return 1;
        int flag = -1;
        for (int f = 0; f < 6; f++)
            if (!strcmp(o, flags[f])) flag = f;
        if (flag >= 0) {
            int *dst[] = {&a->pin, &a->warm, &a->json, &a->markdown, &a->quiet, &a->quiet};
            *dst[flag] = 1;
            continue;
        }
        if (o[0] != '-') {
            if (a->n_files == MAX_FILES) return kvq_tool_error("bench", "at most %d spec files", MAX_FILES);
            a->files[a->n_files++] = o;
            continue;
        }
        if (!v) return kvq_tool_error("bench", "%s needs a value", o);
        i++;
        int bad = 0;
        if (!strcmp(o, "--scheme")) {
            if (a->n_schemes == MAX_SCHEMES) return kvq_tool_error("bench", "at most %d schemes", MAX_SCHEMES);
            a->schemes[a->n_schemes++] = v;
        } else if (!strcmp(o, "--tokens"))
            bad = kvq_tool_int_list("bench", o, v, 1, 1 << 24, a->tokens, MAX_LIST, &a->n_tokens);
        else if (!strcmp(o, "--threads"))
            bad = kvq_tool_int_list("bench", o, v, 0, 1024, a->threads, MAX_LIST, &a->n_threads);
        else if (!strcmp(o, "--layers"))
            bad = tool_int("kvq bench", o, v, 1, 4096, &a->layers);
        else if (!strcmp(o, "--heads"))
            bad = kvq_tool_int_list("bench", o, v, 1, 4096, a->heads_list, MAX_LIST, &a->n_heads);
        else if (!strcmp(o, "--kv-heads"))
            bad = tool_int("kvq bench", o, v, 1, 4096, &a->kv_heads);
        else if (!strcmp(o, "--head-dim"))
            bad = tool_int("kvq bench", o, v, 1, 4096, &a->head_dim);
        else if (!strcmp(o, "--batch"))
            bad = tool_int("kvq bench", o, v, 1, 4096, &a->batch);
        else if (!strcmp(o, "--steps"))
            bad = tool_int("kvq bench", o, v, 1, 1000000, &a->steps);
        else if (!strcmp(o, "--warmup"))
            bad = tool_int("kvq bench", o, v, 0, 1000000, &a->warmup);
        else if (!strcmp(o, "--passes"))
            bad = tool_int("kvq bench", o, v, 1, 1000, &a->passes);
        else if (!strcmp(o, "--seed"))
            bad = tool_int("kvq bench", o, v, 0, 0x7fffffff, &a->seed);
        else if (!strcmp(o, "--backend")) {
            bad = kvq_tool_backend("bench", v, &a->backend);
            a->backend_given = 1;
        } else
            return kvq_tool_error("bench", "unknown option '%s'", o);
        if (bad) return -1;
    }
    if (!a->n_files) return kvq_tool_error("bench", "no spec file given");
    if (a->json && a->markdown) return kvq_tool_error("bench", "--json and --markdown exclude each other");
    if (!a->n_heads) a->n_heads = 1; /* heads_list[0] = 0: from the model block or the default */
    return 0;
}

/* ------------------------------------------------------------------------------------------------ schemes -- */

/* An option's value, else the model block's, else the default. */
static int dim_of(int given, int model, int fallback) { return given ? given : model ? model : fallback; }

static void scheme_dims(const bench_args *a, const kvq_scheme *s, bench_scheme *bs)
{
    const kvq_model_dims *m = &s->model;
    int h = dim_of(a->heads, m->heads, DEFAULT_HEADS), hkv = dim_of(a->kv_heads, m->kv_heads, DEFAULT_KV_HEADS);
    int d = dim_of(a->head_dim, m->head_dim, DEFAULT_HEAD_DIM);
    bs->scheme = s;
    bs->timed = a->layers ? a->layers : 1;
    /* A model block's layer count is the engine's (the engine checks it); only the first layers are timed. */
    bs->dims = (kvq_dims){m->layers ? m->layers : bs->timed, h, hkv, d};
}

static int same_dims(const kvq_dims *x, const kvq_dims *y)
{
    return x->heads == y->heads && x->kv_heads == y->kv_heads && x->head_dim == y->head_dim;
}

/* The schemes to time, each dims group led by its fp16 baseline: a given scheme named fp16 of those dims, else
 * the built-in copy of specs/fp16.kvq. Returns the count, or -1 after printing why. */
static int list_schemes(const bench_args *a, kvq_spec **specs, const kvq_scheme *builtin, bench_scheme *out,
                        int max)
{
    bench_scheme given[MAX_SCHEMES];
    int ng = 0, n = 0;
    for (int f = 0; f < a->n_files; f++)
        for (int i = 0; i < kvq_spec_scheme_count(specs[f]); i++) {
            const kvq_scheme *s = kvq_spec_scheme_at(specs[f], i);
            int wanted = !a->n_schemes;
            for (int k = 0; k < a->n_schemes; k++) wanted |= !strcmp(a->schemes[k], kvq_scheme_name(s));
            int dup = 0;
            for (int j = 0; j < ng; j++) dup |= !strcmp(kvq_scheme_name(given[j].scheme), kvq_scheme_name(s));
            if (!wanted || dup) continue; /* a name seen twice: the first file's (an include lists it again) */
            if (ng == MAX_SCHEMES) return kvq_tool_error("bench", "at most %d schemes", MAX_SCHEMES);
            if (s->model.layers && a->layers > s->model.layers)
                return kvq_tool_error("bench", "--layers %d: scheme '%s' has %d layers (its model block)", a->layers,
                                      kvq_scheme_name(s), s->model.layers);
            memset(&given[ng], 0, sizeof given[ng]);
            scheme_dims(a, s, &given[ng++]);
        }
    for (int k = 0; k < a->n_schemes; k++) {
        int found = 0;
        for (int j = 0; j < ng; j++) found |= !strcmp(a->schemes[k], kvq_scheme_name(given[j].scheme));
        if (!found) return kvq_tool_error("bench", "no scheme '%s' in the given files", a->schemes[k]);
    }
    for (int j = 0; j < ng; j++) {
        int seen = 0;
        for (int i = 0; i < j; i++) seen |= same_dims(&given[i].dims, &given[j].dims);
        if (seen) continue;
        /* A new dims group: its baseline first, then its schemes. */
        int base = -1;
        for (int i = j; i < ng; i++)
            if (same_dims(&given[i].dims, &given[j].dims) && !strcmp(kvq_scheme_name(given[i].scheme), "fp16"))
                base = i;
        if (n + 1 + ng > max) return kvq_tool_error("bench", "too many schemes");
        if (base >= 0) {
            out[n] = given[base];
        } else {
            /* The built-in scheme has no model block: an engine of just the timed layers. */
            memset(&out[n], 0, sizeof out[n]);
            out[n].scheme = builtin;
            out[n].dims = given[j].dims;
            out[n].timed = given[j].timed;
            out[n].dims.layers = given[j].timed;
        }
        out[n++].baseline = 1;
        for (int i = j; i < ng; i++)
            if (i != base && same_dims(&given[i].dims, &given[j].dims)) out[n++] = given[i];
    }
    return n;
}

/* Saliency (probe queries) and calibration need the prompt's queries; nothing else does. */
static int needs_queries(const bench_scheme *bs)
{
    if (bs->scheme->classify.enabled) return 1;
    for (int l = 0; l < bs->timed; l++) {
        const kvq_layer_cfg *c = kvq_scheme_layer(bs->scheme, l);
        if (c->mode != KVQ_MODE_SPARSE && c->quant.saliency.metric != KVQ_SAL_NONE) return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ data -- */

static float next_uniform(uint64_t *s)
{
    /* xorshift64*: only the values' spread matters here, uniform in [-1, 1). */
    *s ^= *s >> 12, *s ^= *s << 25, *s ^= *s >> 27;
    return (float)((double)((*s * 0x2545F4914F6CDD1Dull) >> 40) / (double)(1u << 23) - 1.0);
}

static int fill_random(uint16_t *dst, size_t n, uint64_t *rng)
{
    float chunk[4096];
    for (size_t i = 0; i < n; i += 4096) {
        size_t m = n - i < 4096 ? n - i : 4096;
        for (size_t j = 0; j < m; j++) chunk[j] = next_uniform(rng);
        kvq_f16_from_f32_n(dst + i, chunk, m);
    }
    return 0;
}

static void data_free(bench_data *d)
{
    free(d->k), free(d->v), free(d->q);
    d->k = d->v = d->q = NULL;
}

/* Makes d hold K/V (and Q when want_q) of the given shape. Returns 0, or -1 when out of memory. */
static int data_make(bench_data *d, const kvq_dims *dims, int t, int want_q, uint64_t seed)
{
    size_t kvn = (size_t)dims->kv_heads * t * dims->head_dim, qn = (size_t)dims->heads * t * dims->head_dim;
    if (!d->k || d->hkv != dims->kv_heads || d->t != t || d->d != dims->head_dim) {
        data_free(d);
        d->rng = seed * 0x9E3779B97F4A7C15ull + 0x853c49e6748fea9bull;
        d->k = malloc(kvn * 2), d->v = malloc(kvn * 2);
        if (!d->k || !d->v) return data_free(d), -1;
        fill_random(d->k, kvn, &d->rng);
        fill_random(d->v, kvn, &d->rng);
        d->hkv = dims->kv_heads, d->t = t, d->d = dims->head_dim, d->h = 0;
    }
    if (want_q && (!d->q || d->h != dims->heads)) {
        free(d->q);
        d->q = malloc(qn * 2);
        if (!d->q) return data_free(d), -1;
        fill_random(d->q, qn, &d->rng);
        d->h = dims->heads;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ a run -- */

static int cmp_double(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

enum { STEP_SETS = 4 }; /* rotating sets of new tokens' K/V/Q */

/* Times one scheme at one length and thread count into r (r->ok, or r->err). */
static void run_one(const bench_args *a, bench_data *data, kvq_membw *mb, bench_row *r)
{
    const bench_scheme *bs = r->bs;
    const kvq_dims *dm = &bs->dims;
    int B = a->batch, T = r->tokens, L = bs->timed, H = dm->heads, HKV = dm->kv_heads, D = dm->head_dim;
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = *dm;
    cfg.backend = a->backend;
    cfg.dtype = KVQ_F16;
    cfg.seed = (uint64_t)a->seed;
    cfg.threads = r->threads;
    kvq_engine *e = NULL;
    kvq_seq **seqs = calloc((size_t)B, sizeof *seqs);
    kvq_prefill_item *pit = calloc((size_t)B, sizeof *pit);
    kvq_decode_item *dit = calloc((size_t)B, sizeof *dit);
    size_t step_kv = (size_t)B * HKV * D, step_q = (size_t)B * H * D;
    uint16_t *sk = malloc(STEP_SETS * step_kv * 2), *sv = malloc(STEP_SETS * step_kv * 2);
    uint16_t *sq = malloc(STEP_SETS * step_q * 2);
    float *out = malloc(step_q * sizeof(float));
    double *ms = malloc((size_t)a->steps * sizeof *ms);
    const char *name = kvq_scheme_name(bs->scheme);
    if (!seqs || !pit || !dit || !sk || !sv || !sq || !out || !ms ||
        data_make(data, dm, T, needs_queries(bs), (uint64_t)a->seed)) {
        snprintf(r->err, sizeof r->err, "out of memory");
        goto done;
    }
    fill_random(sk, STEP_SETS * step_kv, &data->rng);
    fill_random(sv, STEP_SETS * step_kv, &data->rng);
    fill_random(sq, STEP_SETS * step_q, &data->rng);
    /* The engine's worker threads (the cpu backend's pool) start here: not on this thread's one pinned CPU */
    if (a->pin) kvq_unpin();
    kvq_status cst = kvq_engine_create(bs->scheme, &cfg, &e, r->err, sizeof r->err);
    if (a->pin) kvq_pin_to_cpu(0);
    if (cst != KVQ_OK) goto done;
    for (int b = 0; b < B; b++)
        if (kvq_seq_create(e, &seqs[b]) != KVQ_OK) goto engine_error;
    progress(a, "%s, %d tokens, batch %d, %d thread%s: prefill", name, T, B, r->threads, r->threads == 1 ? "" : "s");
    for (int l = 0; l < L; l++) {
        for (int b = 0; b < B; b++) pit[b] = (kvq_prefill_item){seqs[b], T, data->k, data->v, data->q};
        if (kvq_prefill(e, l, pit, B) != KVQ_OK) goto engine_error;
    }
    kvq_mem_stats st;
    if (kvq_engine_stats(e, &st) != KVQ_OK) goto engine_error;
    r->cache_bytes = st.device_bytes;
    progress(a, "%s, %d tokens: %d warm-up and %d timed decode steps", name, T, a->warmup, a->steps);
    double bytes = 0, last = kvq_tool_now();
    for (int s = 0; s < a->warmup + a->steps; s++) {
        if (s == a->warmup) {
            /* The bandwidth this row is compared with, measured now: on a shared machine it moves with what the
             * other tenants do, so a figure from minutes earlier would not do. */
            kvq_membw_result bw;
            char err[256];
            if (kvq_membw_measure(mb, r->threads, a->pin, a->passes, &bw, err, sizeof err)) {
                snprintf(r->err, sizeof r->err, "bandwidth measurement: %s", err);
                goto done;
            }
            r->membw_gbps = bw.gbps;
        }
        size_t set = (size_t)(s % STEP_SETS);
        for (int b = 0; b < B; b++)
            dit[b] = (kvq_decode_item){seqs[b], sk + set * step_kv + (size_t)b * HKV * D,
                                       sv + set * step_kv + (size_t)b * HKV * D,
                                       sq + set * step_q + (size_t)b * H * D, out + (size_t)b * H * D};
        if (!a->warm) kvq_membw_evict(mb);
        double t0 = kvq_tool_now();
        for (int l = 0; l < L; l++)
            if (kvq_decode(e, l, dit, B) != KVQ_OK) goto engine_error;
        double t1 = kvq_tool_now();
        if (s < a->warmup) continue;
        ms[s - a->warmup] = 1e3 * (t1 - t0);
        /* What this step read: the cache as it attended, the new token appended (docs/bench.md). */
        if (kvq_engine_stats(e, &st) != KVQ_OK) goto engine_error;
        bytes += (double)st.device_bytes;
        if (t1 - last > 5.0) {
            progress(a, "%s, %d tokens: step %d of %d (%.0f ms)", name, T, s - a->warmup + 1, a->steps,
                     ms[s - a->warmup]);
            last = t1;
        }
    }
    qsort(ms, (size_t)a->steps, sizeof *ms, cmp_double);
    r->ms_min = ms[0];
    r->ms_max = ms[a->steps - 1];
    r->ms_med = a->steps % 2 ? ms[a->steps / 2] : 0.5 * (ms[a->steps / 2 - 1] + ms[a->steps / 2]);
    r->bytes_per_step = bytes / a->steps;
    r->gbps = r->bytes_per_step / (r->ms_med * 1e-3) / 1e9;
    r->ok = 1;
    goto done;
engine_error:
    snprintf(r->err, sizeof r->err, "%s", kvq_engine_errmsg(e));
done:
    for (int b = 0; seqs && b < B; b++)
        if (seqs[b]) kvq_seq_free(e, seqs[b]);
    kvq_engine_free(e);
    free(seqs), free(pit), free(dit), free(sk), free(sv), free(sq), free(out), free(ms);
}

/* ------------------------------------------------------------------------------------------------ output -- */

static void print_header(const bench_args *a, const kvq_machine *m, const char *date, const kvq_membw_result *bw,
                         int nbw)
{
    printf("kvq bench: %s, %d cpus (%d usable), LLC %lld MiB (L%d); %s UTC; backend %s\n", m->model, m->cpus,
           m->usable, m->llc_bytes >> 20, m->llc_level, date, kvq_backend_name(a->backend));
    printf("read bandwidth at the start (%zu MiB streamed, median of %d passes%s; each row's own, measured just "
           "before its timed steps, is its 'bw GB/s'):", bw[0].buffer_bytes >> 20, a->passes, a->pin ? ", pinned" : "");
    for (int i = 0; i < nbw; i++)
        printf("%s %d thread%s %.2f GB/s", i ? "," : "", bw[i].threads, bw[i].threads == 1 ? "" : "s", bw[i].gbps);
    printf("\n");
    printf("decode: batch %d, median of %d steps after %d warm-up, %s; step time x fp16: this scheme's over fp16's\n",
           a->batch, a->steps, a->warmup, a->warm ? "LLC not evicted" : "LLC evicted before each step");
    printf("%-14s %6s %4s %4s %4s %8s %7s %10s %9s %9s %9s %8s %8s %6s %7s\n", "scheme", "layers", "H", "HKV", "D",
           "tokens", "threads", "ms/step", "min", "max", "MiB/step", "GB/s", "bw GB/s", "% bw", "x fp16");
    fflush(stdout);
}

static void print_row(const bench_row *r)
{
    const bench_scheme *bs = r->bs;
    printf("%-14s %6d %4d %4d %4d %8d %7d", kvq_scheme_name(bs->scheme), bs->timed, bs->dims.heads,
           bs->dims.kv_heads, bs->dims.head_dim, r->tokens, r->threads);
    if (r->ok)
        printf(" %10.3f %9.3f %9.3f %9.2f %8.2f %8.2f %6.1f %7.3f\n", r->ms_med, r->ms_min, r->ms_max,
               r->bytes_per_step / 1048576.0, r->gbps, r->membw_gbps, r->bw_pct, r->vs_fp16);
    else
        printf(" error: %s\n", r->err);
    fflush(stdout);
}

/* The same as a markdown table (bench/cpu.sh puts these into docs/bench.md). */
static void print_markdown_header(const bench_args *a, const kvq_machine *m, const char *date,
                                  const kvq_membw_result *bw, int nbw)
{
    printf("kvq bench, backend **%s**, %s UTC, on %s (%d cpus, LLC %lld MiB). Batch %d, median of %d decode steps "
           "after %d warm-up, %s.\n\n",
           kvq_backend_name(a->backend), date, m->model, m->cpus, m->llc_bytes >> 20, a->batch, a->steps, a->warmup,
           a->warm ? "LLC not evicted" : "LLC evicted before each step");
    printf("Read bandwidth at the start of the run (%zu MiB streamed, median of %d passes%s):",
           bw[0].buffer_bytes >> 20, a->passes, a->pin ? ", pinned" : "");
    for (int i = 0; i < nbw; i++)
        printf("%s %d thread%s %.2f GB/s", i ? "," : "", bw[i].threads, bw[i].threads == 1 ? "" : "s", bw[i].gbps);
    printf("; each row's *bandwidth* is measured again just before its timed steps, and its %% is of that.\n\n");
    printf("| scheme | heads | kv heads | head_dim | tokens | threads | ms/step | min | max | MiB/step | GB/s | "
           "bandwidth GB/s | %% of bandwidth | time / fp16 |\n");
    printf("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n");
    fflush(stdout);
}

static void print_markdown_row(const bench_row *r)
{
    const bench_scheme *bs = r->bs;
    printf("| %s | %d | %d | %d | %d | %d |", kvq_scheme_name(bs->scheme), bs->dims.heads, bs->dims.kv_heads,
           bs->dims.head_dim, r->tokens, r->threads);
    if (r->ok)
        printf(" %.3f | %.3f | %.3f | %.2f | %.2f | %.2f | %.1f | %.3f |\n", r->ms_med, r->ms_min, r->ms_max,
               r->bytes_per_step / 1048576.0, r->gbps, r->membw_gbps, r->bw_pct, r->vs_fp16);
    else
        printf(" error: %s | | | | | | | |\n", r->err);
    fflush(stdout);
}

static void print_json(const bench_args *a, const kvq_machine *m, const char *date, const kvq_membw_result *bw,
                       int nbw, const bench_row *rows, int n)
{
    printf("{\"machine\": {\"model\": ");
    kvq_tool_json_string(stdout, m->model);
    printf(", \"cpus\": %d, \"usable_cpus\": %d, \"llc_bytes\": %lld, \"llc_level\": %d},\n", m->cpus, m->usable,
           m->llc_bytes, m->llc_level);
    printf(" \"date\": \"%s\", \"backend\": \"%s\", \"batch\": %d, \"steps\": %d, \"warmup\": %d, \"pinned\": %s, "
           "\"llc_evicted\": %s,\n",
           date, kvq_backend_name(a->backend), a->batch, a->steps, a->warmup, a->pin ? "true" : "false",
           a->warm ? "false" : "true");
    printf(" \"bandwidth\": [");
    for (int i = 0; i < nbw; i++)
        printf("%s\n  {\"threads\": %d, \"gbps\": %.4f, \"gbps_min\": %.4f, \"gbps_max\": %.4f, \"loop_gbps\": %.4f, "
               "\"passes\": %d, \"buffer_bytes\": %zu}",
               i ? "," : "", bw[i].threads, bw[i].gbps, bw[i].gbps_min, bw[i].gbps_max, bw[i].loop_gbps,
               bw[i].passes, bw[i].buffer_bytes);
    printf("],\n \"results\": [");
    for (int i = 0; i < n; i++) {
        const bench_row *r = &rows[i];
        const bench_scheme *bs = r->bs;
        printf("%s\n  {\"scheme\": ", i ? "," : "");
        kvq_tool_json_string(stdout, kvq_scheme_name(bs->scheme));
        printf(", \"file\": ");
        kvq_tool_json_string(stdout, bs->scheme->file);
        printf(", \"baseline\": %s, \"layers\": %d, \"heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, "
               "\"tokens\": %d, \"batch\": %d, \"threads\": %d, ",
               bs->baseline ? "true" : "false", bs->timed, bs->dims.heads, bs->dims.kv_heads, bs->dims.head_dim,
               r->tokens, a->batch, r->threads);
        if (r->ok) {
            printf("\"ms_median\": %.6f, \"ms_min\": %.6f, \"ms_max\": %.6f, \"bytes_per_step\": %.0f, "
                   "\"cache_bytes\": %llu, \"gbps\": %.4f, \"membw_gbps\": %.4f, \"bw_percent\": %.3f, ",
                   r->ms_med, r->ms_min, r->ms_max, r->bytes_per_step, (unsigned long long)r->cache_bytes, r->gbps,
                   r->membw_gbps, r->bw_pct);
            if (isnan(r->vs_fp16)) /* the baseline failed */
                printf("\"time_vs_fp16\": null, \"error\": null}");
            else
                printf("\"time_vs_fp16\": %.4f, \"error\": null}", r->vs_fp16);
        }
        else {
            printf("\"error\": ");
            kvq_tool_json_string(stdout, r->err);
            printf("}");
        }
    }
    printf("\n ]}\n");
}

/* ------------------------------------------------------------------------------------------------ main -- */

/* Exit status: 0 when everything ran, 1 when a spec, the bandwidth measurement or a run failed, 2 for a usage
 * error. */
int kvq_bench_main(int argc, char **argv)
{
    bench_args a;
    int r = parse_args(argc, argv, &a);
    if (r) {
        usage();
        return r < 0 ? 2 : 0;
    }
    start_time = kvq_tool_now();
    kvq_spec *specs[MAX_FILES] = {0}, *builtin = NULL;
    static bench_scheme list[MAX_LIST][2 * MAX_SCHEMES]; /* per --heads value */
    int n_list[MAX_LIST] = {0};
    bench_row *rows = NULL;
    bench_data data;
    memset(&data, 0, sizeof data);
    kvq_membw *mb = NULL;
    kvq_membw_result bw[MAX_LIST];
    int nbw = 0, nrows = 0, rc = 0;
    char err[512];
    for (int f = 0; f < a.n_files; f++)
        if (!(specs[f] = tool_load_spec("kvq bench", a.files[f]))) {
            rc = 1;
            goto out;
        }
    if (kvq_spec_parse_string("specs/fp16.kvq (built in)", fp16_text, strlen(fp16_text), &builtin) != KVQ_OK) {
        kvq_tool_error("bench", "the built-in fp16 scheme does not parse");
        rc = 1;
        goto out;
    }
    size_t max_rows = 0;
    for (int hi = 0; hi < a.n_heads; hi++) {
        a.heads = a.heads_list[hi];
        if ((n_list[hi] = list_schemes(&a, specs, kvq_spec_scheme(builtin, NULL), list[hi], 2 * MAX_SCHEMES)) < 0) {
            rc = 1;
            goto out;
        }
        max_rows += (size_t)n_list[hi] * a.n_tokens * a.n_threads;
    }
    if (!a.backend_given) a.backend = kvq_tool_default_backend("bench");
    if (!(mb = kvq_membw_open(0, err, sizeof err))) {
        kvq_tool_error("bench", "%s", err);
        rc = 1;
        goto out;
    }
    if (a.pin && kvq_pin_to_cpu(0) < 0) fprintf(stderr, "kvq bench: note: --pin: sched_setaffinity failed\n");
    const kvq_machine *m = kvq_membw_machine(mb);
    /* --threads 0: every usable core, for the engine and the bandwidth readers alike. */
    for (int i = 0; i < a.n_threads; i++)
        if (!a.threads[i]) a.threads[i] = m->usable;
    for (int i = 0; i < a.n_threads; i++) {
        int seen = 0;
        for (int j = 0; j < nbw; j++) seen |= bw[j].threads == a.threads[i];
        if (seen) continue;
        progress(&a, "read bandwidth with %d thread%s", a.threads[i], a.threads[i] == 1 ? "" : "s");
        if (kvq_membw_measure(mb, a.threads[i], a.pin, a.passes, &bw[nbw], err, sizeof err)) {
            kvq_tool_error("bench", "bandwidth measurement: %s", err);
            rc = 1;
            goto out;
        }
        if (bw[nbw].loop_gbps > 0 && bw[nbw].loop_gbps < 2 * bw[nbw].gbps)
            fprintf(stderr, "kvq bench: warning: the bandwidth read loop runs at %.1f GB/s in L2, under twice the %.1f "
                            "GB/s it measured: the bandwidth figure may be the loop's\n",
                    bw[nbw].loop_gbps, bw[nbw].gbps);
        nbw++;
    }
    time_t now = time(NULL);
    char date[32];
    strftime(date, sizeof date, "%Y-%m-%d %H:%M", gmtime(&now));
    if (a.markdown)
        print_markdown_header(&a, m, date, bw, nbw);
    else if (!a.json)
        print_header(&a, m, date, bw, nbw);
    if (!(rows = calloc(max_rows, sizeof *rows))) {
        kvq_tool_error("bench", "out of memory");
        rc = 1;
        goto out;
    }
    for (int ti = 0; ti < a.n_tokens; ti++)
        for (int hd = 0; hd < a.n_heads; hd++)
            for (int th = 0; th < a.n_threads; th++) {
                const bench_row *base = NULL;
                for (int i = 0; i < n_list[hd]; i++) {
                    bench_row *row = &rows[nrows++];
                    row->bs = &list[hd][i];
                    row->tokens = a.tokens[ti];
                    row->threads = a.threads[th];
                    run_one(&a, &data, mb, row);
                    if (row->bs->baseline) base = row;
                    if (row->ok) {
                        row->bw_pct = row->membw_gbps > 0 ? 100.0 * row->gbps / row->membw_gbps : 0;
                        row->vs_fp16 = base && base->ok ? row->ms_med / base->ms_med : NAN;
                    } else
                        rc = 1;
                    if (a.markdown)
                        print_markdown_row(row);
                    else if (!a.json)
                        print_row(row);
                    if (!row->ok) fprintf(stderr, "kvq bench: %s: %s\n", kvq_scheme_name(row->bs->scheme), row->err);
                }
            }
    if (a.json) print_json(&a, m, date, bw, nbw, rows, nrows);
out:
    free(rows);
    data_free(&data);
    kvq_membw_close(mb);
    kvq_spec_free(builtin);
    for (int f = 0; f < a.n_files; f++) kvq_spec_free(specs[f]);
    return rc;
}
