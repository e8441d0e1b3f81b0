/* The real cuda backend (cu_driver.c, NVRTC from the toolkit, the whole host protocol) on the recording fake
 * driver (tests/fakecuda): for every spec in specs/, two engines, prefill, host-pointer decode, device-tensor
 * decode on the caller's stream, planned steps run eagerly and captured; the fake's rules must hold (no
 * violation) and the driver-call sequence must be the protocol's (docs/cuda.md "The host protocol"): no
 * allocation, free or synchronisation inside a device step, one synchronisation per host-pointer step, every
 * object released at the end. Numbers are not checked (the fake runs no kernels; the emulator checks them).
 * Then the defects a first GPU run would hit (issue 18), each a case: the primary context's references across
 * the probe and a second engine, fork before the driver is initialised, pool blocks freed after a caller's
 * stream used them, no allocation or free in a captured step, the PTX fallback for an older driver. */
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cu_warm.h"
#include "fakecuda/fakecuda.h"
#include "kvq_params.cuh"
#include "test_engine_util.h"

#define LAYERS 2
#define HEADS 4
#define KV_HEADS 2
static int D = 64; /* 128 for the specs whose groups need it */
#define PROMPT 40

static fakecuda_api fk;
/* the schemes run here: every scheme of every spec file, once by name (collect_specs) */
#define MAX_SCHEMES 64
static struct {
    char file[512];
    kvq_spec *spec;
    const kvq_scheme *s;
} schemes[MAX_SCHEMES];
static int n_schemes;
static kvq_spec *specs_kept[MAX_SCHEMES];
static int n_specs_kept;

/* the driver calls a test makes as the caller (an inference engine's own context, stream and tensors) */
static struct {
    int (*retain)(void **, int);
    int (*release)(int);
    int (*set_current)(void *);
    int (*get_current)(void **);
    int (*ctx_create)(void **, unsigned, int);
    int (*ctx_destroy)(void *);
    int (*stream_create)(void **, unsigned);
    int (*stream_destroy)(void *);
    int (*stream_sync)(void *);
    int (*mem_alloc)(unsigned long long *, size_t);
    int (*mem_free)(unsigned long long);
    int (*begin_capture)(void *, int);
    int (*end_capture)(void *, void **);
    int (*graph_destroy)(void *);
} drv;

static int setup(void)
{
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 64);
    if (n <= 0) return 0;
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    if (!slash) return 0;
    strcpy(slash + 1, "fakecuda/libcuda.so.1");
    if (!getenv("KVQ_LIBCUDA")) setenv("KVQ_LIBCUDA", exe, 1);
    if (!fakecuda_api_open(&fk)) return 0;
    void *h = dlopen(getenv("KVQ_LIBCUDA"), RTLD_NOW | RTLD_LOCAL);
    struct {
        void *slot;
        const char *name;
    } syms[] = {{&drv.retain, "cuDevicePrimaryCtxRetain"}, {&drv.release, "cuDevicePrimaryCtxRelease_v2"},
                {&drv.set_current, "cuCtxSetCurrent"}, {&drv.get_current, "cuCtxGetCurrent"},
                {&drv.ctx_create, "cuCtxCreate_v2"}, {&drv.ctx_destroy, "cuCtxDestroy_v2"},
                {&drv.stream_create, "cuStreamCreate"},
                {&drv.stream_destroy, "cuStreamDestroy_v2"}, {&drv.stream_sync, "cuStreamSynchronize"},
                {&drv.mem_alloc, "cuMemAlloc_v2"},         {&drv.mem_free, "cuMemFree_v2"},
                {&drv.begin_capture, "cuStreamBeginCapture_v2"}, {&drv.end_capture, "cuStreamEndCapture"},
                {&drv.graph_destroy, "cuGraphDestroy"}};
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *f = h ? dlsym(h, syms[i].name) : NULL;
        if (!f) return 0;
        memcpy(syms[i].slot, &f, sizeof f);
    }
    return 1;
}

/* Every violation the fake recorded since the last reset, as failures. */
static void check_rules(const char *when)
{
    int n = fk.n_violations();
    for (int i = 0; i < n && i < 5; i++) TH_CHECK(0, "%s: the driver's rules: %s", when, fk.violation(i));
    TH_CHECK(n <= 5, "%s: %d more violations", when, n - 5);
}

static kvq_engine *engine(const kvq_scheme *s, char *err, size_t n)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){LAYERS, HEADS, KV_HEADS, D};
    cfg.dtype = KVQ_F32;
    cfg.backend = KVQ_BACKEND_CUDA;
    kvq_engine *e = NULL;
    return kvq_engine_create(s, &cfg, &e, err, n) == KVQ_OK ? e : NULL;
}

static kvq_status prefill(kvq_engine *e, kvq_seq **seqs, int n, int T)
{
    size_t kv = (size_t)KV_HEADS * T * D, qn = (size_t)HEADS * T * D;
    float *k = malloc(kv * sizeof *k), *v = malloc(kv * sizeof *v), *q = malloc(qn * sizeof *q);
    tu_fill(k, kv, 1), tu_fill(v, kv, 1), tu_fill(q, qn, 1);
    kvq_prefill_item it[8];
    for (int i = 0; i < n; i++) it[i] = (kvq_prefill_item){seqs[i], T, k, v, q};
    kvq_status st = KVQ_OK;
    for (int l = 0; l < LAYERS && st == KVQ_OK; l++) st = kvq_prefill(e, l, it, n);
    free(k), free(v), free(q);
    return st;
}

static kvq_status decode_host(kvq_engine *e, kvq_seq **seqs, int n)
{
    float k[KV_HEADS * 256], v[KV_HEADS * 256], q[HEADS * 256], out[8][HEADS * 256];
    tu_fill(k, sizeof k / sizeof *k, 1), tu_fill(v, sizeof v / sizeof *v, 1), tu_fill(q, sizeof q / sizeof *q, 1);
    kvq_decode_item it[8];
    for (int i = 0; i < n; i++) it[i] = (kvq_decode_item){seqs[i], k, v, q, out[i]};
    kvq_status st = KVQ_OK;
    for (int l = 0; l < LAYERS && st == KVQ_OK; l++) st = kvq_decode(e, l, it, n);
    return st;
}

/* A caller's device tensors for batches of up to 8: q, k, v fp16, out fp32, lse. */
typedef struct {
    unsigned long long q, k, v, out, lse;
} dev_bufs;

static int bufs_alloc(dev_bufs *b)
{
    memset(b, 0, sizeof *b);
    return !drv.mem_alloc(&b->q, 8 * HEADS * D * 2) && !drv.mem_alloc(&b->k, 8 * KV_HEADS * D * 2) &&
           !drv.mem_alloc(&b->v, 8 * KV_HEADS * D * 2) && !drv.mem_alloc(&b->out, 8 * HEADS * D * 4) &&
           !drv.mem_alloc(&b->lse, 8 * HEADS * 4);
}
static void bufs_free(dev_bufs *b)
{
    unsigned long long *p[] = {&b->q, &b->k, &b->v, &b->out, &b->lse};
    for (int i = 0; i < 5; i++)
        if (*p[i]) drv.mem_free(*p[i]);
}

static kvq_dev_decode dev_batch(const dev_bufs *b, kvq_seq *const *seqs, int n, void *stream)
{
    kvq_dev_decode d;
    memset(&d, 0, sizeof d);
    d.seqs = seqs, d.n_seqs = n, d.stream = stream;
    d.q = (kvq_dev_tensor){(void *)(uintptr_t)b->q, KVQ_F16, HEADS * D, D};
    d.k = (kvq_dev_tensor){(void *)(uintptr_t)b->k, KVQ_F16, KV_HEADS * D, D};
    d.v = (kvq_dev_tensor){(void *)(uintptr_t)b->v, KVQ_F16, KV_HEADS * D, D};
    d.out = (kvq_dev_tensor){(void *)(uintptr_t)b->out, KVQ_F32, HEADS * D, D};
    d.lse = (float *)(uintptr_t)b->lse;
    return d;
}

static kvq_status decode_dev(kvq_engine *e, const dev_bufs *b, kvq_seq *const *seqs, int n, void *stream)
{
    kvq_dev_decode d = dev_batch(b, seqs, n, stream);
    kvq_status st = KVQ_OK;
    for (int l = 0; l < LAYERS && st == KVQ_OK; l++) st = kvq_decode_device(e, l, &d);
    return st;
}

/* A caller as a serving host is one: its own retained primary context made current, a stream of its own and its
 * tensors (caller_end releases them, after the test freed its engines: they live in that context). */
static int caller_begin(void **ctx, void **x, dev_bufs *b)
{
    memset(b, 0, sizeof *b);
    return !drv.retain(ctx, 0) && !drv.set_current(*ctx) && !drv.stream_create(x, 1) && bufs_alloc(b);
}
static void caller_end(void *x, dev_bufs *b)
{
    bufs_free(b);
    if (x) drv.stream_destroy(x);
    drv.release(0);
    drv.set_current(NULL);
}

/* The calls of a step, since the last reset, that a device step must not make. */
static void check_quiet(const char *what)
{
    static const char *const banned[] = {"cuMemAlloc_v2", "cuMemFree_v2", "cuMemHostAlloc", "cuMemFreeHost",
                                         "cuStreamSynchronize", "cuEventSynchronize", "cuMemcpyDtoHAsync_v2"};
    for (size_t i = 0; i < sizeof banned / sizeof *banned; i++)
        TH_CHECK(fk.calls(banned[i]) == 0, "%s: %ld calls of %s", what, fk.calls(banned[i]), banned[i]);
}


/* ---- the defects a first GPU run would hit (issue 18), each on fp16 or KIVI-2 ---- */
static kvq_spec *fp16_spec, *kivi_spec;

static void *current_ctx(void)
{
    void *c = NULL;
    drv.get_current(&c);
    return c;
}

/* 1. Each engine retains the primary context; the probe does not create and reset it before prepare creates it
 *    again; a second engine survives the first; no engine leaves its context current on the caller's thread. */
static void test_contexts(void)
{
    th_begin("defect 1: engines retain the primary context (the probe keeps it alive, a second engine outlives the "
             "first, the caller's thread keeps its own current context)");
    char err[1024] = "";
    drv.set_current(NULL);
    fk.reset();
    const kvq_scheme *s = kvq_spec_scheme(fp16_spec, NULL);
    kvq_engine *a = engine(s, err, sizeof err);
    TH_CHECK(a, "engine A: %s", err);
    TH_CHECK(current_ctx() == NULL, "creating an engine left a context current on the caller's thread");
    kvq_engine *b = a ? engine(s, err, sizeof err) : NULL;
    TH_CHECK(b, "engine B: %s", err);
    TH_CHECK(fk.counter("ctx_activations") <= 1 && fk.counter("ctx_resets") == 0,
             "the primary context was activated %ld times and reset %ld times while two engines were created "
             "(the probe's open and close must not reset it)",
             fk.counter("ctx_activations"), fk.counter("ctx_resets"));
    TH_CHECK(fk.counter("primary_refs") >= 2, "%ld references to the primary context with two engines alive",
             fk.counter("primary_refs"));
    kvq_seq *sb[1] = {NULL};
    if (b) {
        TH_CHECK(kvq_seq_create(b, &sb[0]) == KVQ_OK && prefill(b, sb, 1, PROMPT) == KVQ_OK, "prefill B: %s",
                 kvq_engine_errmsg(b));
        kvq_engine_free(a);
        a = NULL;
        TH_CHECK(fk.counter("ctx_resets") == 0, "freeing engine A reset the context engine B runs in");
        TH_CHECK(decode_host(b, sb, 1) == KVQ_OK, "engine B after A was freed: %s", kvq_engine_errmsg(b));
    }
    kvq_engine_free(a);
    kvq_engine_free(b);
    TH_CHECK(current_ctx() == NULL, "the caller's thread has a context current after the engines were freed");
    check_rules("two engines");
    th_end();
}

/* 2. The cache is filled by children forked before this process initialised the driver, waited for with a
 *    timeout (cu_warm.h, as test_cuda_backend does). */
static int scheme_dims(const kvq_scheme *s); /* the head_dim a scheme runs at here */
static int warm_job(int i)
{
    char err[1024];
    const kvq_scheme *s = i < n_schemes ? schemes[i].s : kvq_spec_scheme(kivi_spec, NULL);
    D = scheme_dims(s);
    kvq_engine *e = engine(s, err, sizeof err);
    kvq_engine_free(e);
    return e ? 0 : 1;
}
static int probe_job(char *err, size_t n)
{
    kvq_engine *e = engine(kvq_spec_scheme(fp16_spec, NULL), err, n);
    kvq_engine_free(e);
    return e ? 0 : -1;
}
static void test_fork(void)
{
    th_begin("defect 2: a GPU test forks its cache-filling children before the driver is initialised, with a timeout");
    char why[512] = "";
    int warm_rc = 0;
    /* the children compile every scheme's kernels into the cache (two NVRTCs at once) */
    int probe = cu_warm_then_probe(n_schemes + 1, 2, warm_job, probe_job, 900, &warm_rc, why, sizeof why);
    D = 64;
    TH_CHECK(warm_rc == 0, "the children could not use the driver: %s", why);
    TH_CHECK(probe == 0, "the probe after the children: %s", why);
    check_rules("fork");
    th_end();
}

/* 3. Work on a caller's stream and the engine's own is ordered: a prefill's work on the engine's stream before a
 *    device step on the caller's, and the step's stores before the engine zeroes the blocks it frees. */
static void test_streams(void)
{
    th_begin("defect 3: pool blocks are zeroed after the caller's stream used them, and written there after the "
             "engine's stream zeroed them (events, no synchronisation)");
    char err[1024] = "";
    void *ctx = NULL, *x = NULL;
    dev_bufs bufs;
    fk.reset();
    TH_CHECK(caller_begin(&ctx, &x, &bufs), "the caller's context, stream and buffers");
    kvq_engine *e = engine(kvq_spec_scheme(kivi_spec, NULL), err, sizeof err);
    TH_CHECK(e, "engine: %s", err);
    for (int round = 0; e && round < 2 && !th_failed(); round++) {
        kvq_seq *s[2] = {NULL, NULL};
        TH_CHECK(kvq_seq_create(e, &s[0]) == KVQ_OK && kvq_seq_create(e, &s[1]) == KVQ_OK, "seq_create");
        TH_CHECK(prefill(e, s, 2, PROMPT) == KVQ_OK, "prefill: %s", kvq_engine_errmsg(e));
        fk.reset();
        long syncs = fk.counter("host_syncs");
        TH_CHECK(decode_dev(e, &bufs, s, 2, x) == KVQ_OK, "decode_device: %s", kvq_engine_errmsg(e));
        TH_CHECK(fk.counter("host_syncs") == syncs, "a device step synchronised");
        kvq_seq_free(e, s[0]); /* its blocks go back to the pool, zeroed on the engine's stream */
        kvq_seq_free(e, s[1]);
        check_rules(round ? "a second round on the zeroed blocks" : "free after a step on the caller's stream");
    }
    drv.stream_sync(x);
    kvq_engine_free(e);
    caller_end(x, &bufs);
    th_end();
}

/* 4. After kvq_engine_reserve_step, a step of up to max_batch allocates and frees nothing (it may be captured);
 *    without a reservation a bigger batch allocates what it needs and frees nothing (cuMemFree synchronises). */
static void test_scratch(void)
{
    th_begin("defect 4: scratch is sized at reservation; a step never calls cuMemAlloc or cuMemFree after it, and "
             "a growing step without one never frees");
    char err[1024] = "";
    void *ctx = NULL, *x = NULL;
    dev_bufs bufs;
    fk.reset();
    TH_CHECK(caller_begin(&ctx, &x, &bufs), "the caller's context, stream and buffers");
    const kvq_scheme *sch = kvq_spec_scheme(kivi_spec, NULL);
    kvq_engine *e = engine(sch, err, sizeof err), *g = e ? engine(sch, err, sizeof err) : NULL;
    TH_CHECK(e && g, "engine: %s", err);
    kvq_seq *s[4] = {NULL, NULL, NULL, NULL}, *t[4] = {NULL, NULL, NULL, NULL};
    for (int i = 0; e && g && i < 4; i++)
        TH_CHECK(kvq_seq_create(e, &s[i]) == KVQ_OK && kvq_seq_create(g, &t[i]) == KVQ_OK, "seq_create");
    if (e && g && !th_failed()) {
        TH_CHECK(prefill(e, s, 4, PROMPT) == KVQ_OK && prefill(g, t, 4, PROMPT) == KVQ_OK, "prefill");
        TH_CHECK(kvq_engine_reserve_step(e, 4, 256) == KVQ_OK, "reserve_step: %s", kvq_engine_errmsg(e));
        drv.stream_sync(x);
        /* the first device step, of the reserved batch, captured */
        fk.reset();
        void *graph = NULL;
        TH_CHECK(!drv.begin_capture(x, 0), "begin capture");
        TH_CHECK(decode_dev(e, &bufs, s, 4, x) == KVQ_OK, "captured decode_device: %s", kvq_engine_errmsg(e));
        TH_CHECK(!drv.end_capture(x, &graph) && graph, "the capture ends with a graph");
        if (graph) drv.graph_destroy(graph);
        check_quiet("the first step after kvq_engine_reserve_step, captured");
        check_rules("a captured step after the reservation");
        /* no reservation: batches of 1, then 4 */
        TH_CHECK(decode_dev(g, &bufs, t, 1, x) == KVQ_OK, "decode_device: %s", kvq_engine_errmsg(g));
        fk.reset();
        TH_CHECK(decode_dev(g, &bufs, t, 4, x) == KVQ_OK, "decode_device: %s", kvq_engine_errmsg(g));
        TH_CHECK(fk.calls("cuMemFree_v2") == 0 && fk.counter("implicit_syncs") == 0,
                 "a step that grew its scratch called cuMemFree %ld times (%ld implicit synchronisations)",
                 fk.calls("cuMemFree_v2"), fk.counter("implicit_syncs"));
        check_rules("a growing step");
    }
    drv.stream_sync(x);
    kvq_engine_free(e);
    kvq_engine_free(g);
    caller_end(x, &bufs);
    th_end();
}

/* The caller's fp32 output rows, [n][Hq][D] and 16-byte aligned, are written by the decode kernel and the merge
 * themselves (cu_out_rows): a layer step converts its inputs (one kvq_step_in) and lse but not the output, one
 * launch fewer (at batch 1 a layer step was nine launches, seven of them a few blocks: docs/gpu-results.md run 8).
 * An output they cannot write in place (4 bytes off alignment, fp16) is converted as before. */
static long launches_of(const char *kernel)
{
    char pre[96];
    snprintf(pre, sizeof pre, "cuLaunchKernel %s ", kernel);
    long n = 0;
    const char *l;
    for (long i = 0; (l = fk.log_line(i)) != NULL; i++) n += !strncmp(l, pre, strlen(pre));
    return n;
}
static long conversions(void) { return launches_of("kvq_convert_rows"); }

static void test_out_direct(void)
{
    th_begin("a device step writes the caller's fp32 output rows in place (no conversion launch); misaligned or "
             "fp16 rows are converted");
    char err[1024] = "";
    void *ctx = NULL, *x = NULL;
    dev_bufs bufs;
    TH_CHECK(caller_begin(&ctx, &x, &bufs), "the caller's context, stream and buffers");
    kvq_engine *e = engine(kvq_spec_scheme(kivi_spec, NULL), err, sizeof err);
    TH_CHECK(e != NULL, "engine: %s", err);
    kvq_seq *s[2] = {NULL, NULL};
    for (int i = 0; e && i < 2; i++) TH_CHECK(kvq_seq_create(e, &s[i]) == KVQ_OK, "seq_create");
    if (e && !th_failed() && prefill(e, s, 2, PROMPT) == KVQ_OK) {
        static const char *const what[3] = {"fp32 rows, aligned", "fp32 rows 4 bytes off", "fp16 rows"};
        const long want[3] = {1, 2, 2}; /* lse (+ the output); q, k, v in the step's kvq_step_in */
        for (int k = 0; k < 3; k++) {
            kvq_dev_decode d = dev_batch(&bufs, s, 2, x);
            if (k == 1) d.out.data = (char *)d.out.data + 4;
            if (k == 2) d.out.dtype = KVQ_F16;
            fk.reset();
            TH_CHECK(kvq_decode_device(e, 0, &d) == KVQ_OK, "%s: decode_device: %s", what[k], kvq_engine_errmsg(e));
            TH_CHECK(conversions() == want[k], "%s: %ld conversion launches, expected %ld", what[k], conversions(),
                     want[k]);
            TH_CHECK(launches_of("kvq_step_in") == 1, "%s: %ld kvq_step_in launches, expected 1", what[k],
                     launches_of("kvq_step_in"));
            check_rules(what[k]);
        }
    }
    drv.stream_sync(x);
    kvq_engine_free(e);
    caller_end(x, &bufs);
    th_end();
}

/* The kernels a planned layer step launches, in order, at batch 1 (the serving loop's graph): its inputs in one
 * kvq_step_in (q, k, v converted, the new tokens' window stores, the tile patches: they were five launches before,
 * docs/gpu-results.md run 8), KIVI's flush and value quantization lists in one kvq_quant_lists (two before), the
 * decode kernel and the merge of its chunks. The output is the caller's fp32 rows, written in place; no lse asked
 * (one kvq_convert_rows more). */
static void step_kernels(char *out, size_t cap)
{
    const char *l;
    size_t at = 0;
    out[0] = 0;
    for (long i = 0; (l = fk.log_line(i)) != NULL; i++) {
        if (strncmp(l, "cuLaunchKernel ", 15)) continue;
        int len = (int)strcspn(l + 15, " ");
        if (at + (size_t)len + 2 < cap)
            at += (size_t)snprintf(out + at, cap - at, "%s%.*s", at ? " " : "", len, l + 15);
    }
}

static void test_step_launches(void)
{
    th_begin("a planned layer step at batch 1 launches kvq_step_in, the quantization lists (one launch), the decode "
             "kernel and the merge: fp16 3 kernels, KIVI-2 4");
    static const char *const want[2] = {"kvq_step_in kvq_decode_c0 kvq_merge",
                                        "kvq_step_in kvq_quant_lists_c0 kvq_decode_c0 kvq_merge"};
    char err[1024] = "";
    void *ctx = NULL, *x = NULL;
    dev_bufs bufs;
    TH_CHECK(caller_begin(&ctx, &x, &bufs), "the caller's context, stream and buffers");
    for (int k = 0; k < 2 && !th_failed(); k++) {
        kvq_engine *e = engine(kvq_spec_scheme(k ? kivi_spec : fp16_spec, NULL), err, sizeof err);
        TH_CHECK(e != NULL, "engine: %s", err);
        kvq_seq *s = NULL;
        if (e) TH_CHECK(kvq_seq_create(e, &s) == KVQ_OK, "seq_create");
        if (e && !th_failed() && prefill(e, &s, 1, PROMPT) == KVQ_OK) {
            TH_CHECK(kvq_engine_reserve_step(e, 1, 256) == KVQ_OK, "reserve_step: %s", kvq_engine_errmsg(e));
            kvq_dev_decode d = dev_batch(&bufs, &s, 1, x);
            d.lse = NULL;
            char got[512];
            for (int step = 0; step < 2 && !th_failed(); step++) { /* the first plan sends the lists whole */
                TH_CHECK(kvq_decode_plan(e, &s, 1, x) == KVQ_OK, "plan: %s", kvq_engine_errmsg(e));
                fk.reset();
                TH_CHECK(kvq_decode_run(e, 0, &d) == KVQ_OK, "run: %s", kvq_engine_errmsg(e));
                step_kernels(got, sizeof got);
                TH_CHECK(!strcmp(got, want[k]), "%s, step %d: launched \"%s\", expected \"%s\"", k ? "KIVI-2" : "fp16",
                         step, got, want[k]);
                for (int l = 1; l < LAYERS; l++)
                    TH_CHECK(kvq_decode_run(e, l, &d) == KVQ_OK, "run %d: %s", l, kvq_engine_errmsg(e));
            }
        }
        drv.stream_sync(x);
        kvq_engine_free(e);
    }
    caller_end(x, &bufs);
    th_end();
}

/* An eager step (kvq_decode_device, and kvq_decode's host rows) at batch 4: the sequences' appends go out as list
 * launches (cu_batch.c), not a store per new row and a quantization per value token and flush (3 launches a
 * sequence for KIVI-2, 99 at batch 32): each kernel at most once whatever the batch, in the planned run's order;
 * device rows' kvq_step_in runs the new rows' stores as a planned step's does.
 * Which of KIVI's lists run depends on the step (a value leaving its window, a key flush), the merge on the split. */
static int in_order(const char *got, const char *allowed)
{
    char g[512];
    snprintf(g, sizeof g, "%s", got);
    const char *at = allowed;
    for (char *save = NULL, *w = strtok_r(g, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
        const char *f = strstr(at, w);
        if (!f || (f[strlen(w)] != ' ' && f[strlen(w)] != 0)) return 0;
        at = f + strlen(w);
    }
    return 1;
}

static void test_eager_launches(void)
{
    th_begin("an eager step at batch 4 launches each kernel at most once, in order: kvq_step_in (device rows, with "
             "the new rows' stores) or the stores' list (host rows), KIVI's quantizations, decode, merge");
    static const char *const allowed[2] = {
        "kvq_step_in kvq_store_f16_list kvq_decode_c0 kvq_merge",
        "kvq_step_in kvq_store_f16_list kvq_quant_lists_c0 kvq_decode_c0 kvq_merge"};
    char err[1024] = "";
    void *ctx = NULL, *x = NULL;
    dev_bufs bufs;
    TH_CHECK(caller_begin(&ctx, &x, &bufs), "the caller's context, stream and buffers");
    for (int k = 0; k < 2 && !th_failed(); k++) {
        kvq_engine *e = engine(kvq_spec_scheme(k ? kivi_spec : fp16_spec, NULL), err, sizeof err);
        TH_CHECK(e != NULL, "engine: %s", err);
        kvq_seq *s[4] = {NULL, NULL, NULL, NULL};
        for (int i = 0; e && i < 4; i++) TH_CHECK(kvq_seq_create(e, &s[i]) == KVQ_OK, "seq_create");
        if (e && !th_failed() && prefill(e, s, 4, PROMPT) == KVQ_OK) {
            kvq_dev_decode d = dev_batch(&bufs, s, 4, x);
            d.lse = NULL;
            static float k_[KV_HEADS * 256], v_[KV_HEADS * 256], q_[HEADS * 256], out[4][HEADS * 256];
            tu_fill(k_, KV_HEADS * 256, 3), tu_fill(v_, KV_HEADS * 256, 4), tu_fill(q_, HEADS * 256, 5);
            kvq_decode_item it[4];
            for (int i = 0; i < 4; i++) it[i] = (kvq_decode_item){s[i], k_, v_, q_, out[i]};
            char got[512];
            for (int step = 0; step < 4 && !th_failed(); step++) {
                const int host = step % 2; /* kvq_decode's host rows on odd steps */
                for (int l = 0; l < LAYERS && !th_failed(); l++) {
                    fk.reset();
                    TH_CHECK((host ? kvq_decode(e, l, it, 4) : kvq_decode_device(e, l, &d)) == KVQ_OK, "step: %s",
                             kvq_engine_errmsg(e));
                    step_kernels(got, sizeof got);
                    /* device rows: kvq_step_in converts them and runs the new rows' stores (a flush's fp16 page
                     * writes are a store list after it); host rows: uploaded, then the stores' list */
                    const int need = !!strstr(got, "kvq_decode_c0") &&
                                     (host ? !strstr(got, "kvq_step_in") && strstr(got, "kvq_store_f16_list")
                                           : !!strstr(got, "kvq_step_in"));
                    TH_CHECK(need && in_order(got, allowed[k]), "%s, %s step %d, layer %d: launched \"%s\"",
                             k ? "KIVI-2" : "fp16", host ? "host-row" : "device", step, l, got);
                }
            }
        }
        drv.stream_sync(x);
        kvq_engine_free(e);
    }
    caller_end(x, &bufs);
    th_end();
}

/* 5. A driver older than NVRTC refuses its cubin: the engine loads the PTX retargeted to the driver's ISA; a
 *    driver too old for the device's PTX is an error naming the driver's version. */
static void test_ptx_fallback(void)
{
    th_begin("defect 5: an older driver (CUDA 12.4) gets the PTX; one too old for the device's PTX gets an error "
             "naming its version");
    char err[1024] = "";
    const kvq_scheme *s = kvq_spec_scheme(fp16_spec, NULL);
    fk.set_driver_version(12040);
    fk.reset();
    kvq_engine *e = engine(s, err, sizeof err);
    TH_CHECK(e, "engine on driver 12.4: %s", err);
    int ptx = 0;
    for (long i = 0; fk.log_line(i); i++) ptx |= !strcmp(fk.log_line(i), "cuModuleLoadData ptx -> 0");
    TH_CHECK(ptx, "no PTX module was loaded on driver 12.4");
    kvq_seq *q[1] = {NULL};
    if (e) TH_CHECK(kvq_seq_create(e, &q[0]) == KVQ_OK && prefill(e, q, 1, PROMPT) == KVQ_OK &&
                        decode_host(e, q, 1) == KVQ_OK,
                    "prefill and decode on the PTX module: %s", kvq_engine_errmsg(e));
    kvq_engine_free(e);
    check_rules("driver 12.4");
    /* too old for the device's PTX: sm_90 needs ISA 7.8 (CUDA 11.8), sm_80 7.0 (CUDA 11.0) */
    const char *arch = getenv("FAKECUDA_ARCH");
    int sm80 = arch && strlen(arch) > 3 && atoi(arch + 3) < 89;
    fk.set_driver_version(sm80 ? 10020 : 11070);
    e = engine(s, err, sizeof err);
    TH_CHECK(!e, "an engine on a driver older than the device's PTX ISA");
    TH_CHECK(strstr(err, sm80 ? "10.2" : "11.7") && strstr(err, "driver"),
             "the error does not name the driver's version: %s", err);
    kvq_engine_free(e);
    fk.set_driver_version(13000);
    th_end();
}

/* A GPU whose tensor cores flush fp16 subnormal inputs (kvq_params_sig's probe answers 0): the hook rewrites the
 * answer the fake models, as such a device would give it. */
static void flush_subnormals(const char *kernel, const void *params, size_t size,
                             void *(*host)(unsigned long long dptr, size_t bytes))
{
    if (strcmp(kernel, "kvq_params_sig") || size < sizeof(kvq_sig_params)) return;
    kvq_sig_params sp;
    memcpy(&sp, params, sizeof sp);
    long long *out = sp.out ? host(sp.out, (KVQ_PARAMS_SIG_N + 1) * sizeof(long long)) : NULL;
    if (out) out[KVQ_PARAMS_SIG_N] = 0;
}

static void test_subnormal_probe(void)
{
    th_begin("tensor cores that flush fp16 subnormal inputs: a scheme decoding on them is refused with the reason, "
             "nothing leaked; the fp16 scheme (no tensor-core class) still runs");
    char err[1024] = "";
    fk.reset();
    fk.set_launch_hook(flush_subnormals);
    kvq_engine *e = engine(kvq_spec_scheme(kivi_spec, NULL), err, sizeof err);
    TH_CHECK(!e, "a KIVI-2 engine on tensor cores that flush subnormals");
    TH_CHECK(strstr(err, "subnormal") && strstr(err, "tensor cores"), "the error does not say why: %s", err);
    kvq_engine_free(e);
    e = engine(kvq_spec_scheme(fp16_spec, NULL), err, sizeof err);
    TH_CHECK(e, "an fp16 engine (its decode takes no tensor cores): %s", err);
    kvq_seq *q[1] = {NULL};
    if (e) TH_CHECK(kvq_seq_create(e, &q[0]) == KVQ_OK && prefill(e, q, 1, PROMPT) == KVQ_OK &&
                        decode_host(e, q, 1) == KVQ_OK,
                    "prefill and decode: %s", kvq_engine_errmsg(e));
    kvq_engine_free(e);
    fk.set_launch_hook(NULL);
    TH_CHECK(fk.counter("live_allocs") == 0, "%ld allocations live after both engines", fk.counter("live_allocs"));
    check_rules("subnormal probe");
    th_end();
}

/* An engine created while the caller's own context (cuCtxCreate, not a primary one) is current runs in it and
 * takes no primary reference; its device tensors and stream are the caller's, in that context. */
static void test_borrowed(void)
{
    th_begin("contexts: an engine borrows the caller's own context (no primary reference), its work stays there");
    char err[1024] = "";
    void *own = NULL, *x = NULL;
    dev_bufs bufs;
    memset(&bufs, 0, sizeof bufs);
    fk.reset();
    long refs = fk.counter("primary_refs");
    TH_CHECK(!drv.ctx_create(&own, 0, 0) && !drv.stream_create(&x, 1) && bufs_alloc(&bufs),
             "the caller's context, stream and buffers");
    kvq_engine *e = own ? engine(kvq_spec_scheme(fp16_spec, NULL), err, sizeof err) : NULL;
    TH_CHECK(e, "engine: %s", err);
    TH_CHECK(fk.counter("primary_refs") == refs, "the engine took a primary reference in the caller's context");
    TH_CHECK(current_ctx() == own, "the caller's context is no longer current after the engine was created");
    kvq_seq *s[1] = {NULL};
    if (e) {
        TH_CHECK(kvq_seq_create(e, &s[0]) == KVQ_OK && prefill(e, s, 1, PROMPT) == KVQ_OK &&
                     decode_host(e, s, 1) == KVQ_OK,
                 "prefill and decode: %s", kvq_engine_errmsg(e));
        TH_CHECK(decode_dev(e, &bufs, s, 1, x) == KVQ_OK, "decode_device: %s", kvq_engine_errmsg(e));
        drv.stream_sync(x);
    }
    kvq_engine_free(e);
    bufs_free(&bufs);
    if (x) drv.stream_destroy(x);
    check_rules("a borrowed context");
    if (own) drv.ctx_destroy(own);
    drv.set_current(NULL);
    th_end();
}

/* ---- every spec: the whole protocol ---- */
static int scheme_dims(const kvq_scheme *s)
{
    char err[512];
    kvq_dims dims = {LAYERS, HEADS, KV_HEADS, 64};
    return kvq_scheme_check_dims(s, &dims, err, sizeof err) == KVQ_OK ? 64 : 128;
}

static void run_scheme(const char *file, const kvq_scheme *s)
{
    char err[1024] = "";
    D = scheme_dims(s);
    kvq_dims dims = {LAYERS, HEADS, KV_HEADS, D};
    th_begin("cuda backend on the fake driver: %s, scheme %s, head_dim %d: two engines, prefill, decode, device "
             "tensors, planned and captured steps keep the driver's rules",
             file, kvq_scheme_name(s), D);
    if (kvq_scheme_check_dims(s, &dims, err, sizeof err) != KVQ_OK) {
        TH_CHECK(0, "dims: %s", err);
        th_end();
        return;
    }
    drv.set_current(NULL);
    fk.reset();
    /* two engines of the process's primary context, no context of the caller's */
    kvq_engine *a = s ? engine(s, err, sizeof err) : NULL, *b = a ? engine(s, err, sizeof err) : NULL;
    TH_CHECK(a && b, "engine: %s", err);
    kvq_seq *sa[2] = {NULL, NULL}, *sb[1] = {NULL};
    if (a && b) {
        TH_CHECK(kvq_seq_create(a, &sa[0]) == KVQ_OK && kvq_seq_create(a, &sa[1]) == KVQ_OK &&
                     kvq_seq_create(b, &sb[0]) == KVQ_OK,
                 "seq_create");
        TH_CHECK(prefill(a, sa, 2, PROMPT) == KVQ_OK, "prefill A: %s", kvq_engine_errmsg(a));
        TH_CHECK(prefill(b, sb, 1, PROMPT + 7) == KVQ_OK, "prefill B: %s", kvq_engine_errmsg(b));
        for (int t = 0; t < 2 && !th_failed(); t++) {
            TH_CHECK(decode_host(a, sa, 2) == KVQ_OK, "decode A: %s", kvq_engine_errmsg(a));
            TH_CHECK(decode_host(b, sb, 1) == KVQ_OK, "decode B: %s", kvq_engine_errmsg(b));
        }
        /* a warm host-pointer step: one synchronisation and one D2H per layer, no allocation */
        fk.reset();
        TH_CHECK(decode_host(a, sa, 2) == KVQ_OK, "decode A: %s", kvq_engine_errmsg(a));
        TH_CHECK(fk.calls("cuStreamSynchronize") == LAYERS && fk.calls("cuMemcpyDtoHAsync_v2") == LAYERS,
                 "a host-pointer step: %ld synchronisations and %ld D2H copies for %d layers",
                 fk.calls("cuStreamSynchronize"), fk.calls("cuMemcpyDtoHAsync_v2"), LAYERS);
        TH_CHECK(fk.calls("cuMemAlloc_v2") == 0 && fk.calls("cuMemFree_v2") == 0, "a warm host-pointer step allocates");
        check_rules("two engines");
        kvq_engine_free(a);
        a = NULL;
        TH_CHECK(decode_host(b, sb, 1) == KVQ_OK, "decode B after A was freed: %s", kvq_engine_errmsg(b));
        check_rules("the second engine after the first was freed");
    }
    kvq_engine_free(a);
    /* the caller's primary context current (as an inference engine's), its stream and tensors */
    void *ctx = NULL, *x = NULL;
    dev_bufs bufs;
    TH_CHECK(caller_begin(&ctx, &x, &bufs), "the caller's context, stream and buffers");
    if (b && !th_failed()) {
        TH_CHECK(decode_dev(b, &bufs, sb, 1, x) == KVQ_OK, "decode_device: %s", kvq_engine_errmsg(b));
        fk.reset();
        TH_CHECK(decode_dev(b, &bufs, sb, 1, x) == KVQ_OK, "decode_device: %s", kvq_engine_errmsg(b));
        check_quiet("a warm kvq_decode_device step");
        check_rules("kvq_decode_device on the caller's stream");
        /* planned steps: eager, then captured (ZipCache without a window is refused: captured one at a time) */
        TH_CHECK(kvq_engine_reserve_step(b, 2, 256) == KVQ_OK, "reserve_step: %s", kvq_engine_errmsg(b));
        kvq_dev_decode d = dev_batch(&bufs, sb, 1, x);
        kvq_status st = kvq_decode_plan(b, sb, 1, x);
        TH_CHECK(st == KVQ_OK || st == KVQ_ERR_UNSUPPORTED, "plan: %s", kvq_engine_errmsg(b));
        for (int l = 0; st == KVQ_OK && l < LAYERS; l++)
            TH_CHECK(kvq_decode_run(b, l, &d) == KVQ_OK, "run %d: %s", l, kvq_engine_errmsg(b));
        if (st == KVQ_OK && !th_failed()) {
            TH_CHECK(kvq_decode_plan(b, sb, 1, x) == KVQ_OK, "plan: %s", kvq_engine_errmsg(b));
            fk.reset();
            void *g = NULL;
            TH_CHECK(!drv.begin_capture(x, 0), "begin capture");
            for (int l = 0; l < LAYERS; l++)
                TH_CHECK(kvq_decode_run(b, l, &d) == KVQ_OK, "captured run %d: %s", l, kvq_engine_errmsg(b));
            TH_CHECK(!drv.end_capture(x, &g) && g, "the capture ends with a graph");
            if (g) drv.graph_destroy(g);
            check_quiet("captured kvq_decode_run");
            check_rules("planned steps, captured");
        } else if (st == KVQ_ERR_UNSUPPORTED) {
            /* one kvq_decode_device step captured instead */
            fk.reset();
            void *g = NULL;
            TH_CHECK(!drv.begin_capture(x, 0), "begin capture");
            TH_CHECK(decode_dev(b, &bufs, sb, 1, x) == KVQ_OK, "captured decode_device: %s", kvq_engine_errmsg(b));
            TH_CHECK(!drv.end_capture(x, &g) && g, "the capture ends with a graph");
            if (g) drv.graph_destroy(g);
            check_rules("a kvq_decode_device step captured");
        }
        drv.stream_sync(x);
        fk.reset();
        int n_tok = 0;
        size_t cap = PROMPT + 32;
        float *kc = malloc(cap * KV_HEADS * D * sizeof *kc), *vc = malloc(cap * KV_HEADS * D * sizeof *vc);
        TH_CHECK(kvq_seq_read_cache(b, sb[0], 0, kc, vc, (int)cap, &n_tok) == KVQ_OK, "read_cache: %s",
                 kvq_engine_errmsg(b));
        free(kc), free(vc);
        kvq_mem_stats ms;
        TH_CHECK(kvq_engine_stats(b, &ms) == KVQ_OK, "stats");
        check_rules("read_cache and statistics");
    }
    kvq_engine_free(b);
    /* a fresh engine's first device step after kvq_engine_reserve_step, captured: nothing allocated in it */
    kvq_engine *c = !th_failed() ? engine(s, err, sizeof err) : NULL;
    kvq_seq *sc[2] = {NULL, NULL};
    if (c) {
        TH_CHECK(kvq_seq_create(c, &sc[0]) == KVQ_OK && kvq_seq_create(c, &sc[1]) == KVQ_OK &&
                     prefill(c, sc, 2, PROMPT) == KVQ_OK && kvq_engine_reserve_step(c, 2, 256) == KVQ_OK,
                 "engine C: %s", kvq_engine_errmsg(c));
        drv.stream_sync(x);
        fk.reset();
        void *g = NULL;
        TH_CHECK(!drv.begin_capture(x, 0), "begin capture");
        TH_CHECK(decode_dev(c, &bufs, sc, 2, x) == KVQ_OK, "engine C's first step, captured: %s",
                 kvq_engine_errmsg(c));
        TH_CHECK(!drv.end_capture(x, &g) && g, "the capture ends with a graph");
        if (g) drv.graph_destroy(g);
        check_quiet("the first kvq_decode_device step after kvq_engine_reserve_step, captured");
        check_rules("the first step after the reservation, captured");
        drv.stream_sync(x);
    }
    kvq_engine_free(c);
    bufs_free(&bufs);
    if (x) drv.stream_destroy(x);
    drv.release(0);
    drv.set_current(NULL);
    check_rules("freeing the engines");
    TH_CHECK(fk.counter("live_allocs") == 0, "%ld allocations left after every engine was freed",
             fk.counter("live_allocs"));
    TH_CHECK(fk.counter("live_streams") == 0, "%ld streams left", fk.counter("live_streams"));
    th_end();
}

/* Every scheme of every spec file, once by name (a file that includes another runs only its own): collected
 * before anything touches the driver, so the children that compile their kernels can be forked first. */
static void collect_specs(void)
{
    char *names[64];
    const char *dirs[] = {"specs", "specs/compare", "specs/paper"};
    const char *only = getenv("KVQ_TEST_ONLY"); /* a scheme name, for a quick run by hand */
    for (int di = 0; di < 3; di++) {
        int n = th_list_files(dirs[di], ".kvq", names, 64);
        for (int i = 0; i < n; i++) {
            char rel[512];
            snprintf(rel, sizeof rel, "%s/%s", dirs[di], names[i]);
            free(names[i]);
            kvq_spec *spec = tu_spec_file(rel);
            if (!spec) continue;
            specs_kept[n_specs_kept++] = spec;
            for (int j = 0; j < kvq_spec_scheme_count(spec) && n_schemes < MAX_SCHEMES; j++) {
                const kvq_scheme *s = kvq_spec_scheme_at(spec, j);
                int seen = only && strcmp(only, kvq_scheme_name(s));
                for (int k = 0; k < n_schemes; k++) seen |= !strcmp(kvq_scheme_name(schemes[k].s), kvq_scheme_name(s));
                if (seen) continue;
                snprintf(schemes[n_schemes].file, sizeof schemes[0].file, "%s", rel);
                schemes[n_schemes].spec = spec, schemes[n_schemes++].s = s;
            }
            if (n_specs_kept == MAX_SCHEMES) return;
        }
    }
}

int main(void)
{
    if (!setup()) {
        th_begin("fake driver");
        TH_CHECK(0, "the fake driver (%s) cannot be loaded", getenv("KVQ_LIBCUDA"));
        th_end();
        return th_summary();
    }
    fp16_spec = tu_spec_file("specs/fp16.kvq");
    kivi_spec = tu_spec_file("specs/kivi2.kvq");
    collect_specs();
    if (fp16_spec && kivi_spec) {
        test_fork(); /* first: before this process initialises the driver */
        test_contexts();
        test_borrowed();
        test_streams();
        test_scratch();
        test_out_direct();
        test_step_launches();
        test_eager_launches();
        test_ptx_fallback();
        test_subnormal_probe();
    }
    for (int i = 0; i < n_schemes; i++) run_scheme(schemes[i].file, schemes[i].s);
    for (int i = 0; i < n_specs_kept; i++) kvq_spec_free(specs_kept[i]);
    kvq_spec_free(fp16_spec);
    kvq_spec_free(kivi_spec);
    return th_summary();
}
