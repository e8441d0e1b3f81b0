/* GPU decode benchmark (DESIGN §9): one decode step of one layer through the cuda backend's device-tensor path
 * (kvq_decode_device: append, flushes, policy kernels, the fused decode kernel, merge) for a batch of sequences,
 * each scheme against the fp16 scheme built the same way (specs/fp16.kvq through the same generator and kernel).
 *
 * Timed on the GPU, not the host: every step is queued on one stream as
 *   cuMemsetD8Async(scratch)  -> cuEventRecord(start) -> the step's device work -> cuEventRecord(end)
 * so the cold-L2 write (a scratch buffer larger than any L2 so far) is ordered before the step and outside its
 * events, and cuEventElapsedTime gives the step's device time; the host waits for the end event before the next
 * step. The memset (about 0.1 ms on an H100) also gives the host a head start on queuing the step; the host's
 * queuing time is reported beside the device time ("host us"): where it comes near the device time the GPU waited
 * for the host inside the step, and a CUDA graph (kvq_decode_run) is the remedy. Warm-up steps (the pool's first
 * growth, the module's first launches) are not timed.
 *
 * Each scheme is timed twice: eager steps (kvq_decode_device: the host queues every kernel of the step) and planned
 * steps replayed as a CUDA graph (kvq_decode_plan, then one launch of the captured kvq_decode_run: what a serving
 * loop does; "graph us"), the second where the driver has the graph API and the scheme can be planned.
 *
 * Reported per (scheme, batch, context): median and minimum step time, the layer's cache bytes on the device (what
 * the decode kernel reads), the bytes read per second against the HBM bandwidth measured in the same run (a
 * device-to-device copy of --hbm-mib MiB, 1 GiB by default, read + write bytes over its event time) and against the card's nominal peak
 * (memory clock x bus width), and the speed-up over fp16. Prints the machine and the date; the table is markdown
 * (docs/gpu-results.md). Without a CUDA driver or a GPU: "skipped: <reason>", exit 0. Run with `make bench-gpu`.
 *
 * A step includes the policy kernels its scheme runs: OTT's competition every G steps, ZipCache's probe rows and
 * its compression every W steps, TailorKV's retrieval every step. ZipCache's prefill computes its probe attention
 * in double (the reference's decisions, bit for bit): about probes x context x head_dim FP64 multiply-adds per
 * query head, minutes at 128k; name it with contexts that fit (docs/gpu.md).
 *
 *   bench_gpu_decode [--heads 32] [--kv-heads 8] [--head-dim 128] [--batch 1] [--steps 20] [--warmup 3]
 *                    [--ctx 4k,32k | --max-k 32] [--hbm-mib 1024 (0: not measured)] [--bandwidth-only]
 *                    [--compile-only (engines created and freed: their kernels compiled into the cache)]
 *                    [--no-graph (eager steps only: a profiler then sees one decode launch a scheme and step)]
 *                    [--profile-steps (each timed eager step inside cuProfilerStart / cuProfilerStop: `ncu
 *                     --profile-from-start off` then sees the steps' kernels, not the prompts' prefill)]
 *                    [--layers 1 (layers a step, each its own cache, queued back to back after one cold-L2 write,
 *                     as a model's decode runs them: the kernels' code stays in L2 from one layer to the next;
 *                     rows report a layer's share, the step over the layers)]
 *                    [--tune M/W[/T],... (each scheme but fp16 once per item, its engine made with
 *                     KVQ_DECODE_MINB=M KVQ_DECODE_WAVES=W [KVQ_DECODE_TILE=T]: docs/cuda.md "Tuning knobs";
 *                     0/0 the defaults)]
 *                    [SPEC[:SCHEME]... | tailorkv2-sparse]
 *   default schemes: fp16 (always, the baseline), specs/kivi2.kvq, specs/kivi4.kvq; contexts 4k to --max-k k,
 *   doubling. Paths are relative to the working directory (the repository or the bundle's share/kvq). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "alloc.h"
#include "cuda/cu_dev.h"
#include "half.h"
#include "kvq.h"

/* The driver calls the benchmark makes itself, beside the engine's (the library loads libcuda; these come from
 * the same library): timing events and a device-to-device copy. */
typedef int CUres;
static struct {
    CUres (*event_create)(void **, unsigned);
    CUres (*event_record)(void *, void *);
    CUres (*event_sync)(void *);
    CUres (*event_elapsed)(float *, void *, void *);
    CUres (*event_destroy)(void *);
    CUres (*copy_d2d)(unsigned long long, unsigned long long, size_t, void *);
    /* the planned step's graph (optional: without them the graph column stays empty) */
    CUres (*capture_begin)(void *, int);
    CUres (*capture_end)(void *, void **);
    CUres (*graph_inst)(void **, void *, unsigned long long);
    CUres (*graph_launch)(void *, void *);
    CUres (*graph_exec_destroy)(void *);
    CUres (*graph_destroy)(void *);
    /* --profile-steps: a profiler's collection range (optional) */
    CUres (*profiler_start)(void);
    CUres (*profiler_stop)(void);
} drv;

static int load_driver_calls(char *why, size_t n)
{
    const char *lib = getenv("KVQ_LIBCUDA"); /* as the library loads it (a fake driver in tests) */
    if (!lib || !*lib) lib = "libcuda.so.1";
    void *h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
    if (!h) h = dlopen(lib, RTLD_NOW);
    if (!h) {
        snprintf(why, n, "%s not loadable", lib);
        return -1;
    }
    struct {
        void *slot;
        const char *name;
    } syms[] = {{&drv.event_create, "cuEventCreate"},         {&drv.event_record, "cuEventRecord"},
                {&drv.event_sync, "cuEventSynchronize"},      {&drv.event_elapsed, "cuEventElapsedTime"},
                {&drv.event_destroy, "cuEventDestroy_v2"},    {&drv.copy_d2d, "cuMemcpyDtoDAsync_v2"}};
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *f = dlsym(h, syms[i].name);
        if (!f) {
            snprintf(why, n, "libcuda lacks %s", syms[i].name);
            return -1;
        }
        memcpy(syms[i].slot, &f, sizeof f);
    }
    *(void **)&drv.capture_begin = dlsym(h, "cuStreamBeginCapture_v2");
    *(void **)&drv.capture_end = dlsym(h, "cuStreamEndCapture");
    *(void **)&drv.graph_inst = dlsym(h, "cuGraphInstantiateWithFlags");
    *(void **)&drv.graph_launch = dlsym(h, "cuGraphLaunch");
    *(void **)&drv.graph_exec_destroy = dlsym(h, "cuGraphExecDestroy");
    *(void **)&drv.graph_destroy = dlsym(h, "cuGraphDestroy");
    *(void **)&drv.profiler_start = dlsym(h, "cuProfilerStart");
    *(void **)&drv.profiler_stop = dlsym(h, "cuProfilerStop");
    return 0;
}

static uint64_t rng = 0x853c49e6748fea9bull;
static float frand(void)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(rng >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

/* fp16 uniform in [-1, 1): the prompt rows, drawn once per context length and shared by every scheme */
static uint16_t hrand(void) { return kvq_f16_from_f32(frand()); }

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

typedef struct {
    int heads, kv_heads, head_dim, batch, steps, warmup, no_graph;
    int layers; /* layers a step (--layers): each its own cache, run back to back after one cold-L2 write */
    int profile_steps; /* --profile-steps */
} bench_cfg;

/* One scheme at one context: eager steps (kvq_decode_device; device and host ms) and planned steps replayed as a
 * CUDA graph (kvq_decode_plan + the captured kvq_decode_run; 0 when not measured), the layer's device bytes. */
typedef struct {
    float t_med, t_min, h_med, g_med, g_min;
    double bytes;
} bench_row;

/* The prompt of one context length in the engines' dtype (fp16): k, v [kv_heads][ctx][D]; q [heads][ctx][D],
 * drawn only when a scheme needs the prompt's queries (kvq_prefill_needs_queries). */
typedef struct {
    int ctx;
    uint16_t *k, *v, *q;
} bench_input;

static int input_for(bench_input *in, const bench_cfg *b, int ctx, int need_q)
{
    size_t kvn = (size_t)b->kv_heads * ctx * b->head_dim, qn = (size_t)b->heads * ctx * b->head_dim;
    if (in->ctx != ctx) {
        kvq_free(in->k), kvq_free(in->v), kvq_free(in->q);
        memset(in, 0, sizeof *in);
        in->k = kvq_malloc(kvn * 2), in->v = kvq_malloc(kvn * 2);
        if (!in->k || !in->v) return -1;
        for (size_t i = 0; i < kvn; i++) in->k[i] = hrand(), in->v[i] = hrand();
        in->ctx = ctx;
    }
    if (need_q && !in->q) {
        if (!(in->q = kvq_malloc(qn * 2))) return -1;
        for (size_t i = 0; i < qn; i++) in->q[i] = hrand();
    }
    return 0;
}

typedef struct {
    cu_dev *dev;
    uint64_t scratch;
    size_t scratch_bytes;
    void *ev[2];
} bench_gpu;

/* specs/tailorkv2.kvq with every layer sparse: the retrieval path (random data calibrates as quantized). */
static const char tk2_sparse[] =
    "scheme tailorkv2-sparse {\n"
    "  classify dense_preference { queries 32; top 5%; tau 0.2; }\n"
    "  when quantize { key { bits 2; per channel; group 64; } value { bits 2; per token; group 64; } residual 128; }\n"
    "  when sparse { host_offload; sinks 8; recent 56; topk 128; critical_channels 8; }\n"
    "  mode sparse;\n"
    "}\n";

/* Device time of `what` queued by fn between the two events, after the cold-L2 write; ms. */
static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static float host_ms; /* the host's time in fn of the last timed() */

static int timed(bench_gpu *g, int cold, int (*fn)(void *), void *arg, float *ms)
{
    char err[512];
    void *s = cu_dev_stream(g->dev);
    static int salt;
    if (cold && cu_dev_memset(g->dev, g->scratch, ++salt & 0xff, g->scratch_bytes, err, sizeof err) != KVQ_OK) {
        fprintf(stderr, "cold L2 memset: %s\n", err);
        return -1;
    }
    if (drv.event_record(g->ev[0], s)) return -1;
    double t0 = now();
    int rc = fn(arg);
    host_ms = (float)(1e3 * (now() - t0));
    if (rc || drv.event_record(g->ev[1], s) || drv.event_sync(g->ev[1]) || drv.event_elapsed(ms, g->ev[0], g->ev[1]))
        return -1;
    return 0;
}

typedef struct {
    kvq_engine *e;
    kvq_dev_decode *dd;
    int layers;
    int profile; /* --profile-steps: the step inside the profiler's collection range (ncu --profile-from-start off) */
} step_arg;
static int one_step(void *a)
{
    step_arg *sa = a;
    if (sa->profile && drv.profiler_start) drv.profiler_start();
    int rc = 0;
    for (int l = 0; !rc && l < sa->layers; l++)
        if (kvq_decode_device(sa->e, l, sa->dd) != KVQ_OK) {
            fprintf(stderr, "decode: %s\n", kvq_engine_errmsg(sa->e));
            rc = -1;
        }
    if (sa->profile && drv.profiler_stop) drv.profiler_stop();
    return rc;
}

typedef struct {
    kvq_engine *e;
    kvq_dev_decode *dd;
    void *exec; /* the captured graph of one planned step */
} plan_arg;
static int one_planned(void *a)
{
    plan_arg *pa = a;
    if (kvq_decode_plan(pa->e, pa->dd->seqs, pa->dd->n_seqs, pa->dd->stream) != KVQ_OK) {
        fprintf(stderr, "plan: %s\n", kvq_engine_errmsg(pa->e));
        return -1;
    }
    return drv.graph_launch(pa->exec, pa->dd->stream) ? -1 : 0;
}

/* Planned steps replayed as a CUDA graph (kvq.h "Planned decode steps"): the step tables reserved, one step run
 * eagerly (warm-up), one captured and launched, then `steps` timed steps of plan + graph launch. The graph holds
 * the step's runs of every layer, in order. 0 with *g_med = 0 when the driver has no graph API or the scheme
 * refuses planning. */
static int time_graph(kvq_engine *e, kvq_dev_decode *dd, const bench_cfg *b, int ctx, bench_gpu *g, float *ts,
                      bench_row *r)
{
    if (!drv.capture_begin || !drv.capture_end || !drv.graph_inst || !drv.graph_launch || !drv.graph_exec_destroy ||
        !drv.graph_destroy)
        return 0;
    if (kvq_engine_reserve_step(e, b->batch, ctx + b->warmup + 2 * b->steps + 8) != KVQ_OK) {
        fprintf(stderr, "planned steps: %s\n", kvq_engine_errmsg(e)); /* e.g. ZipCache without a window */
        return 0;
    }
    char err[512];
    void *graph = NULL, *exec = NULL;
    int rc = kvq_decode_plan(e, dd->seqs, dd->n_seqs, dd->stream) != KVQ_OK;
    for (int l = 0; !rc && l < b->layers; l++) rc = kvq_decode_run(e, l, dd) != KVQ_OK;
    if (!rc) rc = kvq_decode_plan(e, dd->seqs, dd->n_seqs, dd->stream) != KVQ_OK;
    if (!rc) rc = drv.capture_begin(dd->stream, 0 /* CU_STREAM_CAPTURE_MODE_GLOBAL */) != 0;
    if (!rc) {
        int run = 0;
        for (int l = 0; !run && l < b->layers; l++) run = kvq_decode_run(e, l, dd) != KVQ_OK;
        rc = drv.capture_end(dd->stream, &graph) != 0 || run;
    }
    if (!rc) rc = drv.graph_inst(&exec, graph, 0) != 0 || drv.graph_launch(exec, dd->stream) != 0;
    if (!rc) rc = cu_dev_sync(g->dev, err, sizeof err) != KVQ_OK;
    if (rc) fprintf(stderr, "planned steps: capture failed: %s\n", kvq_engine_errmsg(e));
    plan_arg pa = {e, dd, exec};
    for (int st = 0; !rc && st < b->steps; st++) rc = timed(g, 1, one_planned, &pa, &ts[st]);
    if (!rc) {
        qsort(ts, (size_t)b->steps, sizeof *ts, cmp_float);
        r->g_med = ts[b->steps / 2];
        r->g_min = ts[0];
    }
    if (exec) drv.graph_exec_destroy(exec);
    if (graph) drv.graph_destroy(graph);
    return rc ? -1 : 0;
}

/* One scheme at one context length: eager steps, then planned steps as a graph, and the layer's device bytes. */
static int run_one(const kvq_scheme *s, const bench_cfg *b, int ctx, bench_gpu *g, bench_input *in, bench_row *r)
{
    memset(r, 0, sizeof *r);
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){b->layers, b->heads, b->kv_heads, b->head_dim};
    cfg.backend = KVQ_BACKEND_CUDA;
    cfg.dtype = KVQ_F16; /* the prompt as a serving host holds it: no conversion on the host */
    kvq_engine *e = NULL;
    char err[1024];
    if (kvq_engine_create(s, &cfg, &e, err, sizeof err) != KVQ_OK) {
        fprintf(stderr, "%s: %s\n", kvq_scheme_name(s), err);
        return -1;
    }
    int H = b->kv_heads, Hq = b->heads, D = b->head_dim, B = b->batch;
    kvq_seq **seq = kvq_calloc((size_t)B, sizeof *seq);
    float *ts = kvq_malloc((size_t)b->steps * sizeof *ts), *hs = kvq_malloc((size_t)b->steps * sizeof *hs);
    /* the step's device tensors: q [B][Hq][D], k and v [B][H][D] fp16, out [B][Hq][D] fp32 */
    size_t in_elems = (size_t)B * (Hq + 2 * H) * D, out_bytes = (size_t)B * Hq * D * 4;
    uint16_t *hin = kvq_malloc(in_elems * 2);
    uint64_t din = 0, dout = 0;
    int rc = 0;
    if (!seq || !ts || !hs || !hin || input_for(in, b, ctx, kvq_prefill_needs_queries(e, 0) == 1) != 0) rc = -1;
    if (!rc && (cu_dev_alloc(g->dev, in_elems * 2, &din, err, sizeof err) != KVQ_OK ||
                cu_dev_alloc(g->dev, out_bytes, &dout, err, sizeof err) != KVQ_OK)) {
        fprintf(stderr, "device tensors: %s\n", err);
        rc = -1;
    }
    for (size_t i = 0; !rc && i < in_elems; i++) hin[i] = hrand();
    if (!rc && cu_dev_h2d(g->dev, din, hin, in_elems * 2, err, sizeof err) != KVQ_OK) rc = -1;
    for (int i = 0; !rc && i < B; i++) {
        kvq_prefill_item it = {NULL, ctx, in->k, in->v, kvq_prefill_needs_queries(e, 0) == 1 ? in->q : NULL};
        if (kvq_seq_create(e, &seq[i]) != KVQ_OK) rc = -1;
        it.seq = seq[i];
        for (int l = 0; !rc && l < b->layers; l++) /* every layer the same prompt: the timing does not read it */
            if (kvq_prefill(e, l, &it, 1) != KVQ_OK) {
                fprintf(stderr, "prefill: %s\n", kvq_engine_errmsg(e));
                rc = -1;
            }
    }
    uint16_t *base = (uint16_t *)(uintptr_t)din;
    kvq_dev_decode dd;
    memset(&dd, 0, sizeof dd);
    dd.seqs = seq, dd.n_seqs = B;
    dd.q = (kvq_dev_tensor){base, KVQ_F16, (long long)Hq * D, D};
    dd.k = (kvq_dev_tensor){base + (size_t)B * Hq * D, KVQ_F16, (long long)H * D, D};
    dd.v = (kvq_dev_tensor){base + (size_t)B * (Hq + H) * D, KVQ_F16, (long long)H * D, D};
    dd.out = (kvq_dev_tensor){(void *)(uintptr_t)dout, KVQ_F32, (long long)Hq * D, D};
    dd.stream = cu_dev_stream(g->dev);
    step_arg sa = {e, &dd, b->layers, 0};
    for (int st = 0; !rc && st < b->warmup; st++) rc = one_step(&sa);
    if (!rc && cu_dev_sync(g->dev, err, sizeof err) != KVQ_OK) rc = -1;
    sa.profile = b->profile_steps; /* the timed eager steps only */
    for (int st = 0; !rc && st < b->steps; st++) {
        rc = timed(g, 1, one_step, &sa, &ts[st]);
        hs[st] = host_ms;
    }
    if (!rc) {
        qsort(ts, (size_t)b->steps, sizeof *ts, cmp_float);
        qsort(hs, (size_t)b->steps, sizeof *hs, cmp_float);
        r->h_med = hs[b->steps / 2];
        r->t_med = ts[b->steps / 2];
        r->t_min = ts[0];
        kvq_mem_stats ms;
        kvq_engine_stats(e, &ms);
        r->bytes = (double)ms.device_bytes;
        if (!b->no_graph && time_graph(e, &dd, b, ctx, g, ts, r) != 0) r->g_med = r->g_min = 0; /* eager stands */
        /* a layer's share of the step: times and bytes over the layers (every layer the same scheme and tokens) */
        r->t_med /= b->layers, r->t_min /= b->layers, r->h_med /= b->layers;
        r->g_med /= b->layers, r->g_min /= b->layers, r->bytes /= b->layers;
    }
    for (int i = 0; i < B && seq; i++)
        if (seq[i]) kvq_seq_free(e, seq[i]);
    kvq_engine_free(e);
    if (din) cu_dev_free(g->dev, din);
    if (dout) cu_dev_free(g->dev, dout);
    kvq_free(seq), kvq_free(ts), kvq_free(hs), kvq_free(hin);
    return rc;
}

typedef struct {
    bench_gpu *g;
    uint64_t dst, src;
    size_t n;
} copy_arg;
static int one_copy(void *a)
{
    copy_arg *c = a;
    return drv.copy_d2d(c->dst, c->src, c->n, cu_dev_stream(c->g->dev)) ? -1 : 0;
}

/* HBM bandwidth measured now: a device-to-device copy of `n` bytes, (read + written bytes) / median event time. */
static double measure_hbm(bench_gpu *g, size_t n)
{
    char err[512];
    uint64_t a = 0, b = 0;
    double gbps = 0;
    if (cu_dev_alloc(g->dev, n, &a, err, sizeof err) == KVQ_OK && cu_dev_alloc(g->dev, n, &b, err, sizeof err) == KVQ_OK) {
        copy_arg c = {g, b, a, n};
        float t[7];
        int ok = one_copy(&c) == 0; /* warm-up */
        for (int i = 0; ok && i < 7; i++) ok = timed(g, 0, one_copy, &c, &t[i]) == 0;
        if (ok) {
            qsort(t, 7, sizeof *t, cmp_float);
            gbps = 2.0 * (double)n / (t[3] * 1e-3) / 1e9;
        }
    } else {
        fprintf(stderr, "bandwidth buffers: %s\n", err);
    }
    if (a) cu_dev_free(g->dev, a);
    if (b) cu_dev_free(g->dev, b);
    return gbps;
}

/* Parses SPEC[:SCHEME] (or the built-in tailorkv2-sparse) into *sp; *want: the scheme asked for, or NULL. */
static int parse_spec(const char *arg, kvq_spec **sp, char *path, size_t n, char **want)
{
    snprintf(path, n, "%s", arg);
    char *colon = strrchr(path, ':');
    *want = NULL;
    if (colon) *colon = 0, *want = colon + 1;
    kvq_status st = !strcmp(path, "tailorkv2-sparse")
                        ? kvq_spec_parse_string("<built-in>", tk2_sparse, strlen(tk2_sparse), sp)
                        : kvq_spec_parse_file(path, sp);
    if (st != KVQ_OK) {
        fprintf(stderr, "%s does not parse\n", path);
        kvq_spec_free(*sp);
        *sp = NULL;
        return -1;
    }
    return 0;
}

/* --compile-only: an engine of every scheme (fp16 too) created and freed, so that its unit is compiled (or
 * found in generated/ or the cache) before any timing; the bundle fills its cache this way through the fake
 * driver (tools/gpu-bundle.sh). */
static int compile_all(const bench_cfg *b, const char *const *specs, int n_specs)
{
    int bad = 0;
    for (int i = -1; i < n_specs; i++) {
        kvq_spec *sp = NULL;
        char path[512], *want;
        if (parse_spec(i < 0 ? "specs/fp16.kvq" : specs[i], &sp, path, sizeof path, &want) != 0) {
            bad = 1;
            continue;
        }
        for (int j = 0; j < kvq_spec_scheme_count(sp); j++) {
            const kvq_scheme *s = kvq_spec_scheme_at(sp, j);
            if (want && strcmp(want, kvq_scheme_name(s))) continue;
            kvq_engine_config cfg;
            kvq_engine_config_init(&cfg);
            cfg.dims = (kvq_dims){1, b->heads, b->kv_heads, b->head_dim};
            cfg.backend = KVQ_BACKEND_CUDA;
            cfg.dtype = KVQ_F32;
            kvq_engine *e = NULL;
            char err[1024];
            if (kvq_engine_create(s, &cfg, &e, err, sizeof err) != KVQ_OK) {
                fprintf(stderr, "%s: %s\n", kvq_scheme_name(s), err);
                bad = 1;
                continue;
            }
            printf("compiled %s\n", kvq_scheme_name(s));
            kvq_engine_free(e);
        }
        kvq_spec_free(sp);
    }
    return bad;
}

/* "4k,32k,1000" -> token counts; returns how many. */
static int parse_ctx(const char *s, int *out, int max)
{
    int n = 0;
    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v <= 0) return -1;
        if (*end == 'k' || *end == 'K') v *= 1024, end++;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

static void print_row(const char *name, const bench_cfg *b, int ctx, const bench_row *r, double hbm, double peak,
                      const bench_row *f16)
{
    double gbps = r->bytes / (r->t_med * 1e-3) / 1e9, ggbps = r->g_med > 0 ? r->bytes / (r->g_med * 1e-3) / 1e9 : 0;
    char vs[16], gvs[16], gus[16], ghbm[16];
    snprintf(vs, sizeof vs, f16 ? "%.2fx" : "-", f16 ? f16->t_med / r->t_med : 0.0);
    snprintf(gus, sizeof gus, r->g_med > 0 ? "%.1f" : "-", 1e3 * r->g_med);
    snprintf(ghbm, sizeof ghbm, r->g_med > 0 && hbm > 0 ? "%.1f" : "-", hbm > 0 ? 100.0 * ggbps / hbm : 0.0);
    snprintf(gvs, sizeof gvs, f16 && f16->g_med > 0 && r->g_med > 0 ? "%.2fx" : "-",
             f16 && r->g_med > 0 ? f16->g_med / r->g_med : 0.0);
    printf("| %-16s | %5d | %6dk | %9.1f | %9.1f | %8.1f | %8s | %10.1f | %8.1f | %8.1f | %8.1f | %7s | %8s | %8s |\n",
           name, b->batch, ctx / 1024, 1e3 * r->t_med, 1e3 * r->t_min, 1e3 * r->h_med, gus, r->bytes / 1048576.0,
           gbps, hbm > 0 ? 100.0 * gbps / hbm : 0.0, peak > 0 ? 100.0 * gbps / peak : 0.0, vs, ghbm, gvs);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    bench_cfg b = {32, 8, 128, 1, 20, 3, 0, 1, 0};
    int max_k = 32, ctxs[32], n_ctx = 0, bw_only = 0, hbm_mib = 1024, compile_only = 0;
    const char *specs[32];
    int n_specs = 0, n_tune = 0, tune_m[16], tune_w[16], tune_t[16];
    for (int i = 1; i < argc; i++) {
        int *dst = !strcmp(argv[i], "--heads")      ? &b.heads
                   : !strcmp(argv[i], "--kv-heads") ? &b.kv_heads
                   : !strcmp(argv[i], "--head-dim") ? &b.head_dim
                   : !strcmp(argv[i], "--batch")    ? &b.batch
                   : !strcmp(argv[i], "--steps")    ? &b.steps
                   : !strcmp(argv[i], "--warmup")   ? &b.warmup
                   : !strcmp(argv[i], "--max-k")    ? &max_k
                   : !strcmp(argv[i], "--hbm-mib")  ? &hbm_mib
                   : !strcmp(argv[i], "--layers")   ? &b.layers
                                                    : NULL;
        if (dst && i + 1 < argc) {
            *dst = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--ctx") && i + 1 < argc) {
            n_ctx = parse_ctx(argv[++i], ctxs, 32);
            if (n_ctx <= 0) {
                fprintf(stderr, "--ctx: a list of token counts such as 4k,32k\n");
                return 2;
            }
        } else if (!strcmp(argv[i], "--bandwidth-only")) {
            bw_only = 1;
        } else if (!strcmp(argv[i], "--tune") && i + 1 < argc) {
            for (const char *q = argv[++i]; *q && n_tune < 16;) {
                char *e;
                tune_m[n_tune] = (int)strtol(q, &e, 10);
                if (*e != '/') {
                    fprintf(stderr, "--tune: MINB/WAVES[/TILE] items such as 4/0,5/0,4/2,2/0/256\n");
                    return 2;
                }
                tune_w[n_tune] = (int)strtol(e + 1, &e, 10);
                tune_t[n_tune] = *e == '/' ? (int)strtol(e + 1, &e, 10) : 0;
                n_tune++;
                q = *e == ',' ? e + 1 : e;
                if (*e && *e != ',') {
                    fprintf(stderr, "--tune: MINB/WAVES[/TILE] items such as 4/0,5/0,4/2,2/0/256\n");
                    return 2;
                }
            }
        } else if (!strcmp(argv[i], "--no-graph")) {
            b.no_graph = 1;
        } else if (!strcmp(argv[i], "--profile-steps")) {
            b.profile_steps = 1;
        } else if (!strcmp(argv[i], "--compile-only")) {
            compile_only = 1;
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "unknown option %s (see the comment at the top of bench/gpu/bench_decode.c)\n", argv[i]);
            return 2;
        } else if (n_specs < 32) {
            specs[n_specs++] = argv[i];
        }
    }
    if (!n_specs) {
        specs[n_specs++] = "specs/kivi2.kvq";
        specs[n_specs++] = "specs/kivi4.kvq";
    }
    if (!n_ctx)
        for (int c = 4096; c <= max_k * 1024 && n_ctx < 32; c *= 2) ctxs[n_ctx++] = c;
    if (b.steps < 1) b.steps = 1;
    if (b.batch < 1) b.batch = 1;
    if (b.warmup < 0) b.warmup = 0;
    if (b.layers < 1 || b.layers > 256) {
        fprintf(stderr, "--layers: 1 to 256\n");
        return 2;
    }
    char why[1024];
    bench_gpu g;
    memset(&g, 0, sizeof g);
    if (cu_dev_open(CU_DEV_GPU, &g.dev, why, sizeof why) != KVQ_OK) {
        printf("skipped: %s\n", why);
        return 0;
    }
    if (compile_only) { /* the engines' kernels into the NVRTC cache (or from generated/), nothing timed */
        int rc = compile_all(&b, specs, n_specs);
        cu_dev_close(g.dev);
        return rc;
    }
    /* The benchmark's own driver calls (events, the bandwidth copy) need the device's context current on this
     * thread; the library makes it current only inside its own entry points and puts the thread's back after. */
    cu_ctx_scope scope;
    cu_dev_enter(g.dev, &scope);
    why[0] = 0;
    if (load_driver_calls(why, sizeof why) != 0 || drv.event_create(&g.ev[0], 0) || drv.event_create(&g.ev[1], 0)) {
        printf("skipped: %s\n", why[0] ? why : "cuEventCreate failed");
        if (g.ev[0]) drv.event_destroy(g.ev[0]);
        cu_dev_leave(g.dev, &scope);
        cu_dev_close(g.dev);
        return 0;
    }
    g.scratch_bytes = (size_t)256 << 20; /* larger than any L2 so far (H100: 50 MiB, B200: 126 MiB) */
    if (cu_dev_alloc(g.dev, g.scratch_bytes, &g.scratch, why, sizeof why) != KVQ_OK) {
        printf("skipped: %s\n", why);
        drv.event_destroy(g.ev[0]);
        drv.event_destroy(g.ev[1]);
        cu_dev_leave(g.dev, &scope);
        cu_dev_close(g.dev);
        return 0;
    }
    double hbm = hbm_mib > 0 ? measure_hbm(&g, (size_t)hbm_mib << 20) : 0.0, peak = cu_dev_peak_gbps(g.dev);
    time_t t = time(NULL);
    char date[64];
    strftime(date, sizeof date, "%Y-%m-%d %H:%M", gmtime(&t));
    printf("kvq GPU decode benchmark, %s UTC: %s, %d SMs; HBM measured %.0f GB/s (device-to-device copy of %d MiB, "
           "read + write), nominal peak %.0f GB/s\n",
           date, cu_dev_arch(g.dev), cu_dev_sm_count(g.dev), hbm, hbm_mib, peak);
    if (bw_only) goto done;
    if (b.layers == 1)
        printf("%d heads / %d kv heads, head_dim %d, batch %d, one layer; step time by CUDA events, median and minimum "
               "of %d steps after %d warm-up, L2 cold (256 MiB written on the stream before each step)\n\n",
               b.heads, b.kv_heads, b.head_dim, b.batch, b.steps, b.warmup);
    else
        printf("%d heads / %d kv heads, head_dim %d, batch %d, %d layers a step, each its own cache, run back to back; "
               "a layer's share of the step (times and cache bytes over %d) by CUDA events, median and minimum of %d "
               "steps after %d warm-up, L2 cold before each step, not between its layers\n\n",
               b.heads, b.kv_heads, b.head_dim, b.batch, b.layers, b.layers, b.steps, b.warmup);
    printf("| scheme           | batch | context | median us | min us    | host us  | graph us | cache MiB  | GB/s     "
           "| %% HBM    | %% peak   | vs fp16 | graph %% HBM | graph vs fp16 |\n");
    printf("|------------------|-------|---------|-----------|-----------|----------|----------|------------|----------"
           "|----------|----------|---------|----------|----------|\n");
    kvq_spec *f16spec = NULL;
    if (kvq_spec_parse_file("specs/fp16.kvq", &f16spec) != KVQ_OK) {
        printf("skipped: specs/fp16.kvq not found (run from the repository root or the bundle's share/kvq)\n");
        kvq_spec_free(f16spec);
        goto done;
    }
    bench_input in;
    memset(&in, 0, sizeof in);
    for (int ci = 0; ci < n_ctx; ci++) {
        int ctx = ctxs[ci];
        bench_row r16;
        unsetenv("KVQ_DECODE_MINB"), unsetenv("KVQ_DECODE_WAVES");
        int have16 = run_one(kvq_spec_scheme(f16spec, NULL), &b, ctx, &g, &in, &r16) == 0;
        if (have16) print_row("fp16", &b, ctx, &r16, hbm, peak, NULL);
        for (int i = 0; i < n_specs; i++) {
            kvq_spec *sp = NULL;
            char path[512], *want;
            if (parse_spec(specs[i], &sp, path, sizeof path, &want) != 0) continue;
            for (int j = 0; j < kvq_spec_scheme_count(sp); j++) {
                const kvq_scheme *s = kvq_spec_scheme_at(sp, j);
                if (want && strcmp(want, kvq_scheme_name(s))) continue;
                for (int k = 0; k < (n_tune ? n_tune : 1); k++) {
                    char name[64], v[16];
                    snprintf(name, sizeof name, "%s", kvq_scheme_name(s));
                    if (n_tune) { /* read when the engine is made (plan_build, the cuda backend's creation) */
                        snprintf(v, sizeof v, "%d", tune_m[k]), setenv("KVQ_DECODE_MINB", v, 1);
                        snprintf(v, sizeof v, "%d", tune_w[k]), setenv("KVQ_DECODE_WAVES", v, 1);
                        snprintf(v, sizeof v, "%d", tune_t[k]), setenv("KVQ_DECODE_TILE", v, 1);
                        if (tune_t[k])
                            snprintf(name, sizeof name, "%.9s m%d w%d t%d", kvq_scheme_name(s), tune_m[k], tune_w[k],
                                     tune_t[k]);
                        else
                            snprintf(name, sizeof name, "%.9s m%d w%d", kvq_scheme_name(s), tune_m[k], tune_w[k]);
                    }
                    bench_row r;
                    if (run_one(s, &b, ctx, &g, &in, &r) != 0) continue;
                    print_row(name, &b, ctx, &r, hbm, peak, have16 ? &r16 : NULL);
                }
                unsetenv("KVQ_DECODE_MINB"), unsetenv("KVQ_DECODE_WAVES"), unsetenv("KVQ_DECODE_TILE");
            }
            kvq_spec_free(sp);
        }
    }
    kvq_free(in.k), kvq_free(in.v), kvq_free(in.q);
    kvq_spec_free(f16spec);
done:
    drv.event_destroy(g.ev[0]);
    drv.event_destroy(g.ev[1]);
    cu_dev_free(g.dev, g.scratch);
    cu_dev_leave(g.dev, &scope);
    cu_dev_close(g.dev);
    return 0;
}
