/* The engine's contract (kvq.h RUNTIME API): every bad call returns a status with a message and changes
 * nothing; allocation failures at every point of create / prefill / decode / read_cache / stats return a status,
 * leak nothing (ASan) and leave the state as it was; batched calls equal one sequence at a time; inputs in fp32,
 * fp16 and bf16 holding the same values give the same results. */
#include "alloc.h"
#include "backend.h"
#include "rt_internal.h"
#include "test_engine_util.h"

/* A backend that cannot run here, and one that refuses every scheme: the engine passes their reasons on. */
static kvq_status probe_no(char *msg, size_t n)
{
    snprintf(msg, n, "no device in this test");
    return KVQ_ERR_UNAVAILABLE;
}
static kvq_status supports_no(const kvq_be_engine *e, char *msg, size_t n)
{
    snprintf(msg, n, "refuses '%s'", kvq_scheme_name(e->scheme));
    return KVQ_ERR_UNSUPPORTED;
}

enum { D = 64 };

static const char *kivi = "scheme k { key { bits 2; per channel; group 4; } value { bits 2; per token; group 32; } "
                          "residual 8; flush kivi; }";

#define EXPECT(call, status, words)                                                                                \
    do {                                                                                                           \
        kvq_status st_ = (call);                                                                                   \
        TH_CHECK(st_ == (status), "%s: %s, expected %s", #call, kvq_status_str(st_), kvq_status_str(status));      \
        TH_CHECK(strstr(kvq_engine_errmsg(e), (words)) != NULL, "%s: message '%s' lacks '%s'", #call,            \
                 kvq_engine_errmsg(e), (words));                                                                   \
    } while (0)

static void test_create_errors(void)
{
    th_begin("engine: create rejects NULLs, bad dims, unknown dtype, unlinked backends, dims the spec contradicts");
    kvq_spec *spec = tu_spec_text(kivi);
    const kvq_scheme *sch = spec ? kvq_spec_scheme(spec, NULL) : NULL;
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    TH_CHECK(cfg.backend == KVQ_BACKEND_REFERENCE && cfg.dtype == KVQ_F16 && cfg.seed == 0, "defaults");
    cfg.dims = (kvq_dims){2, 4, 2, D};
    kvq_engine *e = (kvq_engine *)1;
    char err[256];
    TH_CHECK(kvq_engine_create(NULL, &cfg, &e, err, sizeof err) == KVQ_ERR_INVALID && !e && strstr(err, "scheme"),
             "NULL scheme: %s", err);
    TH_CHECK(kvq_engine_create(sch, NULL, &e, err, sizeof err) == KVQ_ERR_INVALID, "NULL cfg");
    TH_CHECK(kvq_engine_create(sch, &cfg, NULL, err, sizeof err) == KVQ_ERR_INVALID, "NULL out");
    struct {
        kvq_dims d;
        kvq_status st;
        const char *word;
    } bad[] = {
        {{0, 4, 2, D}, KVQ_ERR_SHAPE, "positive"},   {{2, 4, 3, D}, KVQ_ERR_SHAPE, "multiple"},
        {{2, 4, 2, 80}, KVQ_ERR_SHAPE, "head_dim"},  {{2, 2, 4, D}, KVQ_ERR_SHAPE, "multiple"},
        {{2, 4, 0, D}, KVQ_ERR_SHAPE, "positive"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvq_engine_config c = cfg;
        c.dims = bad[i].d;
        kvq_status st = kvq_engine_create(sch, &c, &e, err, sizeof err);
        TH_CHECK(st == bad[i].st && strstr(err, bad[i].word) && !e, "dims %d/%d/%d/%d: %s '%s'", bad[i].d.layers,
                 bad[i].d.heads, bad[i].d.kv_heads, bad[i].d.head_dim, kvq_status_str(st), err);
    }
    kvq_engine_config c = cfg;
    c.dtype = (kvq_dtype)7;
    TH_CHECK(kvq_engine_create(sch, &c, &e, err, sizeof err) == KVQ_ERR_INVALID && strstr(err, "dtype"), "dtype");
    c = cfg;
    c.softmax_scale = -1;
    TH_CHECK(kvq_engine_create(sch, &c, &e, err, sizeof err) == KVQ_ERR_INVALID, "negative softmax scale");
    c = cfg;
    c.backend = KVQ_BACKEND_CUDA;
    kvq_status st = kvq_engine_create(sch, &c, &e, err, sizeof err);
    if (st != KVQ_OK) /* a build with the CUDA backend may run it, or say it cannot here */
        TH_CHECK((st == KVQ_ERR_UNSUPPORTED || st == KVQ_ERR_UNAVAILABLE) && strstr(err, "cuda"), "cuda: %s %s",
                 kvq_status_str(st), err);
    kvq_engine_free(st == KVQ_OK ? e : NULL);
    /* Registered backends (rt_backend_register, for backends outside libkvq such as the emulator's). */
    kvq_backend unavailable = kvq_backend_reference, refusing = kvq_backend_reference;
    unavailable.probe = probe_no;
    refusing.supports = supports_no;
    c = cfg;
    c.backend = KVQ_BACKEND_EMU;
    TH_CHECK(rt_backend_register(KVQ_BACKEND_EMU, &unavailable) == KVQ_OK, "register");
    st = kvq_engine_create(sch, &c, &e, err, sizeof err);
    TH_CHECK(st == KVQ_ERR_UNAVAILABLE && strstr(err, "no device in this test"), "probe: %s %s", kvq_status_str(st),
             err);
    TH_CHECK(rt_backend_register(KVQ_BACKEND_EMU, &refusing) == KVQ_OK, "register again");
    st = kvq_engine_create(sch, &c, &e, err, sizeof err);
    TH_CHECK(st == KVQ_ERR_UNSUPPORTED && strstr(err, "refuses 'k'"), "supports: %s %s", kvq_status_str(st), err);
    TH_CHECK(rt_backend_register(KVQ_BACKEND_EMU, &kvq_backend_reference) == KVQ_OK, "register the reference");
    st = kvq_engine_create(sch, &c, &e, err, sizeof err);
    TH_CHECK(st == KVQ_OK, "a registered backend runs: %s", err);
    kvq_engine_free(st == KVQ_OK ? e : NULL);
    /* What no backend could run does not check: outliers under flush kivi are a spec error, not a runtime one. */
    kvq_spec *s3 = NULL;
    static const char kivi_pool[] = "scheme p { key { bits 2; per channel; group 4; } value { bits 2; per token; "
                              "group 32; } residual 8; flush kivi; outliers { keep 2; spill 2; } }";
    st = kvq_spec_parse_string("<test>", kivi_pool, sizeof kivi_pool - 1, &s3);
    TH_CHECK(st == KVQ_ERR_SPEC && s3 && kvq_spec_error_count(s3) == 1 &&
                 strstr(kvq_spec_diag(s3, 0)->message, "flush group"),
             "outliers under flush kivi: %s", kvq_status_str(st));
    kvq_spec_free(s3);
    TH_CHECK(strcmp(kvq_backend_name(KVQ_BACKEND_REFERENCE), "reference") == 0 &&
                 strcmp(kvq_backend_name(KVQ_BACKEND_EMU), "emu") == 0,
             "backend names");
    /* A spec that fixes head_dim 128 on an engine of 64; a value group that does not divide head_dim 96. */
    kvq_spec *s2 = tu_spec_text("scheme m { model { head_dim 128; } bits 4; }");
    TH_CHECK(s2 && kvq_engine_create(kvq_spec_scheme(s2, NULL), &cfg, &e, err, sizeof err) == KVQ_ERR_SHAPE &&
                 strstr(err, "head_dim"),
             "model dims: %s", err);
    kvq_spec_free(s2);
    s2 = tu_spec_text("scheme g { key { bits 2; per channel; group 4; } value { bits 2; per token; group 64; } }");
    c = cfg;
    c.dims.head_dim = 96;
    TH_CHECK(s2 && kvq_engine_create(kvq_spec_scheme(s2, NULL), &c, &e, err, sizeof err) == KVQ_ERR_SHAPE &&
                 strstr(err, "group 64"),
             "group vs head_dim: %s", err);
    kvq_spec_free(s2);
    kvq_spec_free(spec);
    th_end();
}

static void test_call_errors(void)
{
    th_begin("engine: prefill/decode/read_cache/stats reject bad calls with a status and a message");
    kvq_spec *spec = tu_spec_text(kivi);
    kvq_spec *zs = tu_spec_file("specs/zipcache.kvq");
    kvq_engine *e = spec ? tu_engine(kvq_spec_scheme(spec, NULL), 2, 4, 2, D, KVQ_F32) : NULL;
    kvq_engine *other = spec ? tu_engine(kvq_spec_scheme(spec, NULL), 2, 4, 2, D, KVQ_F32) : NULL;
    if (!e || !other) goto out;
    kvq_seq *s = NULL, *s2 = NULL, *so = NULL;
    TH_CHECK(kvq_seq_create(e, &s) == KVQ_OK && kvq_seq_create(e, &s2) == KVQ_OK && kvq_seq_create(other, &so) == KVQ_OK,
             "seqs");
    TH_CHECK(kvq_seq_create(NULL, &s) == KVQ_ERR_INVALID, "seq_create NULL engine");
    float k[2 * 10 * D], v[2 * 10 * D], q[4 * D], out[4 * D], rk[2 * 10 * D], rv[2 * 10 * D];
    tu_fill(k, sizeof k / 4, 1), tu_fill(v, sizeof v / 4, 1), tu_fill(q, sizeof q / 4, 1);
    kvq_prefill_item it = {s, 10, k, v, NULL};
    TH_CHECK(kvq_prefill(NULL, 0, &it, 1) == KVQ_ERR_INVALID, "NULL engine");
    EXPECT(kvq_prefill(e, 0, NULL, 1), KVQ_ERR_INVALID, "no items");
    EXPECT(kvq_prefill(e, 0, &it, 0), KVQ_ERR_INVALID, "no items");
    EXPECT(kvq_prefill(e, -1, &it, 1), KVQ_ERR_INVALID, "layer -1");
    EXPECT(kvq_prefill(e, 2, &it, 1), KVQ_ERR_INVALID, "layer 2 is out of range");
    kvq_prefill_item bad = it;
    bad.seq = NULL;
    EXPECT(kvq_prefill(e, 0, &bad, 1), KVQ_ERR_INVALID, "seq is NULL");
    bad = it;
    bad.n_tokens = 0;
    EXPECT(kvq_prefill(e, 0, &bad, 1), KVQ_ERR_SHAPE, "n_tokens");
    bad = it;
    bad.v = NULL;
    EXPECT(kvq_prefill(e, 0, &bad, 1), KVQ_ERR_INVALID, "v is NULL");
    bad = it;
    bad.seq = so;
    EXPECT(kvq_prefill(e, 0, &bad, 1), KVQ_ERR_INVALID, "another engine");
    kvq_prefill_item two[2] = {it, it};
    EXPECT(kvq_prefill(e, 0, two, 2), KVQ_ERR_INVALID, "same sequence");
    TH_CHECK(kvq_seq_length(s, 0) == 0 && kvq_seq_length(s, 5) == -1 && kvq_seq_length(NULL, 0) == -1, "lengths");

    kvq_decode_item d = {s, k, v, q, out};
    EXPECT(kvq_decode(e, 0, &d, 1), KVQ_ERR_STATE, "not been prefilled");
    TH_CHECK(kvq_prefill(e, 0, &it, 1) == KVQ_OK, "prefill: %s", kvq_engine_errmsg(e));
    TH_CHECK(kvq_seq_length(s, 0) == 10 && kvq_seq_length(s, 1) == 0, "lengths after prefill");
    EXPECT(kvq_prefill(e, 0, &it, 1), KVQ_ERR_STATE, "already prefilled");
    /* A failed batch changes nothing: s2 is not prefilled by a batch whose other item fails. */
    two[1].seq = s2;
    EXPECT(kvq_prefill(e, 0, two, 2), KVQ_ERR_STATE, "already prefilled");
    TH_CHECK(kvq_seq_length(s2, 0) == 0, "s2 prefilled by a failed batch");
    EXPECT(kvq_decode(e, 3, &d, 1), KVQ_ERR_INVALID, "out of range");
    kvq_decode_item db = d;
    db.out = NULL;
    EXPECT(kvq_decode(e, 0, &db, 1), KVQ_ERR_INVALID, "out is NULL");
    db = d;
    db.q = NULL;
    EXPECT(kvq_decode(e, 0, &db, 1), KVQ_ERR_INVALID, "q is NULL");
    kvq_decode_item dd[2] = {d, d};
    EXPECT(kvq_decode(e, 0, dd, 2), KVQ_ERR_INVALID, "same sequence");
    dd[1].seq = s2;
    EXPECT(kvq_decode(e, 0, dd, 2), KVQ_ERR_STATE, "not been prefilled");
    TH_CHECK(kvq_seq_length(s, 0) == 10, "a failed decode batch changed the first sequence");
    TH_CHECK(kvq_decode(e, 0, &d, 1) == KVQ_OK, "decode: %s", kvq_engine_errmsg(e));

    int n = -1;
    EXPECT(kvq_seq_read_cache(e, s, 0, rk, rv, 5, &n), KVQ_ERR_INVALID, "capacity 5");
    TH_CHECK(n == 11, "read_cache reports the length it needs: %d", n);
    EXPECT(kvq_seq_read_cache(e, s, 0, NULL, rv, 20, &n), KVQ_ERR_INVALID, "k is NULL");
    EXPECT(kvq_seq_read_cache(e, s, 9, rk, rv, 20, &n), KVQ_ERR_INVALID, "out of range");
    EXPECT(kvq_seq_read_cache(e, so, 0, rk, rv, 20, &n), KVQ_ERR_INVALID, "another engine");
    TH_CHECK(kvq_seq_read_cache(e, s, 1, rk, rv, 0, &n) == KVQ_OK && n == 0, "an empty layer reads as 0 tokens");
    kvq_mem_stats ms;
    TH_CHECK(kvq_engine_stats(NULL, &ms) == KVQ_ERR_INVALID && kvq_engine_stats(e, NULL) == KVQ_ERR_INVALID &&
                 kvq_seq_stats(e, so, &ms) == KVQ_ERR_INVALID,
             "stats arguments");
    EXPECT(kvq_calibrate_layer(e, 0, 4, k, q, NULL), KVQ_ERR_INVALID, "fixed");
    TH_CHECK(kvq_engine_layer_state(e, 0) == KVQ_LAYER_QUANTIZED && kvq_engine_layer_state(e, 7) == KVQ_LAYER_UNDECIDED,
             "layer states");
    /* KIVI's layers are decided and have no saliency: q may be NULL; TailorKV's layers calibrate from their first
     * prefill's queries */
    kvq_spec *ts = tu_spec_file("specs/tailorkv2.kvq");
    kvq_engine *fresh = ts ? tu_engine(kvq_spec_scheme(ts, NULL), 2, 4, 2, D, KVQ_F32) : NULL;
    TH_CHECK(kvq_prefill_needs_queries(e, 0) == 0 && kvq_prefill_needs_queries(fresh, 1) == 1 &&
                 kvq_prefill_needs_queries(e, 2) == -1 && kvq_prefill_needs_queries(e, -1) == -1 &&
                 kvq_prefill_needs_queries(NULL, 0) == -1,
             "kvq_prefill_needs_queries: %d %d %d", kvq_prefill_needs_queries(e, 0),
             kvq_prefill_needs_queries(fresh, 1), kvq_prefill_needs_queries(e, 2));
    kvq_engine_free(fresh);
    kvq_spec_free(ts);
    kvq_seq_free(e, s2);
    kvq_seq_free(e, NULL);
    kvq_seq_free(other, s); /* not its sequence: ignored */
    TH_CHECK(kvq_seq_length(s, 0) == 11, "a sequence survives kvq_seq_free by another engine");

    /* ZipCache needs the prompt's queries for its probes. */
    kvq_engine *z = zs ? tu_engine(kvq_spec_scheme(zs, NULL), 1, 4, 2, D, KVQ_F32) : NULL;
    kvq_seq *zq = NULL;
    if (z && kvq_seq_create(z, &zq) == KVQ_OK) {
        kvq_prefill_item zi = {zq, 10, k, v, NULL};
        TH_CHECK(kvq_prefill(z, 0, &zi, 1) == KVQ_ERR_INVALID && strstr(kvq_engine_errmsg(z), "probes"),
                 "zipcache without q: %s", kvq_engine_errmsg(z));
        TH_CHECK(kvq_prefill_needs_queries(z, 0) == 1, "zipcache's probes need q");
    }
    kvq_engine_free(z);
out:
    kvq_engine_free(e);
    kvq_engine_free(other);
    kvq_spec_free(spec);
    kvq_spec_free(zs);
    th_end();
}

/* One scenario: engine, two sequences (lengths 37 and 22), prefill every layer as one batch, `steps` batched
 * decode steps, read_cache, stats. Returns the status of the first failing call (KVQ_OK if none); on success,
 * out receives the last decode outputs of both sequences and *cache the first sequence's layer-0 keys. */
enum { L = 2, H = 4, HKV = 2, T0 = 29, T1 = 13, STEPS = 12, MAXT = T0 + STEPS };
static float sk[L][HKV * MAXT * D], sv[L][HKV * MAXT * D], sq[L][H * MAXT * D];

static kvq_status scenario(const kvq_scheme *sch, int steps, float *outs, float *cache, int fail_decode_at,
                           long fail_n)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){L, H, HKV, D};
    cfg.dtype = KVQ_F32;
    cfg.seed = 5;
    kvq_engine *e = NULL;
    kvq_seq *s[2] = {NULL, NULL};
    kvq_status st = kvq_engine_create(sch, &cfg, &e, NULL, 0);
    static const int lens[2] = {T0, T1};
    float *buf = malloc(sizeof(float) * (size_t)(2 * HKV * MAXT * D + H * MAXT * D) * 2);
    float *rk = malloc(sizeof(float) * HKV * MAXT * D), *rv = malloc(sizeof(float) * HKV * MAXT * D);
    for (int b = 0; b < 2 && st == KVQ_OK; b++) st = kvq_seq_create(e, &s[b]);
    for (int l = 0; l < L && st == KVQ_OK; l++) {
        kvq_prefill_item it[2];
        for (int b = 0; b < 2; b++) {
            float *base = buf + (size_t)b * (2 * HKV * MAXT * D + H * MAXT * D);
            tu_slice(sk[l], 0, HKV, MAXT, D, 0, lens[b], base);
            tu_slice(sv[l], 0, HKV, MAXT, D, 0, lens[b], base + HKV * MAXT * D);
            tu_slice(sq[l], 0, H, MAXT, D, 0, lens[b], base + 2 * HKV * MAXT * D);
            it[b] = (kvq_prefill_item){s[b], lens[b], base, base + HKV * MAXT * D, base + 2 * HKV * MAXT * D};
        }
        st = kvq_prefill(e, l, it, 2);
    }
    for (int step = 0; step < steps && st == KVQ_OK; step++)
        for (int l = 0; l < L && st == KVQ_OK; l++) {
            kvq_decode_item d[2];
            for (int b = 0; b < 2; b++) {
                float *base = buf + (size_t)b * (2 * HKV * D + H * D);
                int t = lens[b] + step;
                tu_slice(sk[l], 0, HKV, MAXT, D, t, 1, base);
                tu_slice(sv[l], 0, HKV, MAXT, D, t, 1, base + HKV * D);
                tu_slice(sq[l], 0, H, MAXT, D, t, 1, base + 2 * HKV * D);
                d[b] = (kvq_decode_item){s[b], base, base + HKV * D, base + 2 * HKV * D, outs + (size_t)b * H * D};
            }
            if (step == fail_decode_at && l == 0) {
                /* A decode that fails part-way must leave both sequences as they were: retry it. */
                kvq_alloc_fail_after(fail_n);
                kvq_status f = kvq_decode(e, l, d, 2);
                kvq_alloc_fail_after(0);
                if (f != KVQ_OK && f != KVQ_ERR_NOMEM) st = f;
                if (f == KVQ_ERR_NOMEM && kvq_seq_length(s[0], l) != lens[0] + step) st = KVQ_ERR_INTERNAL;
                if (f == KVQ_OK) continue;
            }
            if (st == KVQ_OK) st = kvq_decode(e, l, d, 2);
        }
    int n;
    if (st == KVQ_OK) st = kvq_seq_read_cache(e, s[0], 0, rk, rv, MAXT, &n);
    if (st == KVQ_OK && cache) memcpy(cache, rk, sizeof(float) * HKV * MAXT * D);
    kvq_mem_stats ms;
    if (st == KVQ_OK) st = kvq_engine_stats(e, &ms);
    kvq_engine_free(e);
    free(buf), free(rk), free(rv);
    return st;
}

static void test_alloc_failures(const char *label, kvq_spec *spec)
{
    th_begin("engine: allocation failure n = 1, 2, ... through create/prefill/decode/read_cache: %s", label);
    const kvq_scheme *sch = spec ? kvq_spec_scheme(spec, NULL) : NULL;
    float want[2 * H * D], got[2 * H * D];
    int steps = 8; /* past a flush of every scheme below */
    TH_CHECK(sch && scenario(sch, steps, want, NULL, -1, 0) == KVQ_OK, "the scenario fails without injection");
    long n;
    int completed = 0;
    for (n = 1; n < 5000 && sch && !th_failed(); n++) {
        kvq_alloc_fail_after(n);
        kvq_status st = scenario(sch, steps, got, NULL, -1, 0);
        long injected = kvq_alloc_failures();
        kvq_alloc_fail_after(0);
        if (injected == 0) {
            TH_CHECK(st == KVQ_OK, "n=%ld: no failure injected but %s", n, kvq_status_str(st));
            TH_CHECK(memcmp(got, want, sizeof got) == 0, "n=%ld: completed run differs", n);
            completed = 1;
            break;
        }
        TH_CHECK(st == KVQ_ERR_NOMEM, "n=%ld: an allocation failure gave %s", n, kvq_status_str(st));
    }
    TH_CHECK(completed, "no run completed (n up to %ld)", n);
    if (getenv("KVQ_TEST_VERBOSE")) printf("  %s: %ld allocations\n", label, n - 1);
    th_end();

    /* Failure inside a decode batch, then the same decode again: the result equals an undisturbed run. */
    th_begin("engine: a decode that runs out of memory changes nothing (retry equals a clean run): %s", label);
    float wcache[HKV * MAXT * D], gcache[HKV * MAXT * D];
    TH_CHECK(sch && scenario(sch, STEPS, want, wcache, -1, 0) == KVQ_OK, "clean run");
    static const int ats[] = {1, 7};
    static const long fs[] = {1, 2, 3, 5, 8, 13, 21};
    for (size_t ai = 0; ai < 2 && sch && !th_failed(); ai++)
        for (size_t fi = 0; fi < sizeof fs / sizeof fs[0] && !th_failed(); fi++) {
            int at = ats[ai];
            long f = fs[fi];
            kvq_status st = scenario(sch, STEPS, got, gcache, at, f);
            TH_CHECK(st == KVQ_OK, "fail at step %d alloc %ld: %s", at, f, kvq_status_str(st));
            TH_CHECK(memcmp(got, want, sizeof got) == 0 && memcmp(gcache, wcache, sizeof gcache) == 0,
                     "fail at step %d alloc %ld: results differ from a clean run", at, f);
        }
    kvq_spec_free(spec);
    th_end();
}

/* A batched decode equals each sequence on its own engine; fp16, bf16 and fp32 inputs holding the same values
 * give the same outputs. */
static void test_batch_and_dtypes(void)
{
    th_begin("engine: batch == one sequence at a time; fp32/fp16/bf16 inputs of equal values agree");
    kvq_spec *spec = tu_spec_file("specs/kivi2-r32.kvq");
    const kvq_scheme *sch = spec ? kvq_spec_scheme(spec, NULL) : NULL;
    enum { T = 50 };
    /* Values exact in bf16 and fp16: multiples of 1/16 in [-4, 4). */
    float k[HKV * T * D], v[HKV * T * D], q[H * T * D];
    for (size_t i = 0; i < sizeof k / 4; i++) k[i] = floorf(tu_uniform() * 64) / 16, v[i] = floorf(tu_uniform() * 64) / 16;
    for (size_t i = 0; i < sizeof q / 4; i++) q[i] = floorf(tu_uniform() * 64) / 16;
    float out[3][H * D];
    for (int dt = 0; dt < 3 && sch; dt++) {
        kvq_engine *e = tu_engine(sch, 1, H, HKV, D, (kvq_dtype)dt);
        kvq_seq *s = NULL;
        if (!e || kvq_seq_create(e, &s) != KVQ_OK) break;
        void *bk = malloc(sizeof k), *bv = malloc(sizeof v), *bq = malloc(sizeof q);
        for (size_t i = 0; i < sizeof k / 4; i++) {
            if (dt == KVQ_F32) ((float *)bk)[i] = k[i], ((float *)bv)[i] = v[i];
            if (dt == KVQ_F16) ((uint16_t *)bk)[i] = kvq_f16_from_f32(k[i]), ((uint16_t *)bv)[i] = kvq_f16_from_f32(v[i]);
            if (dt == KVQ_BF16) ((uint16_t *)bk)[i] = kvq_bf16_from_f32(k[i]), ((uint16_t *)bv)[i] = kvq_bf16_from_f32(v[i]);
        }
        for (size_t i = 0; i < sizeof q / 4; i++) {
            if (dt == KVQ_F32) ((float *)bq)[i] = q[i];
            if (dt == KVQ_F16) ((uint16_t *)bq)[i] = kvq_f16_from_f32(q[i]);
            if (dt == KVQ_BF16) ((uint16_t *)bq)[i] = kvq_bf16_from_f32(q[i]);
        }
        kvq_prefill_item it = {s, T - 1, NULL, NULL, NULL};
        /* prefill T-1 tokens: the head-major layout needs the first T-1 of each head contiguous */
        size_t es = dt == KVQ_F32 ? 4 : 2;
        char *pk = malloc((size_t)HKV * (T - 1) * D * es), *pv = malloc((size_t)HKV * (T - 1) * D * es);
        char *nk = malloc((size_t)HKV * D * es), *nv = malloc((size_t)HKV * D * es), *nq = malloc((size_t)H * D * es);
        for (int h = 0; h < HKV; h++) {
            memcpy(pk + (size_t)h * (T - 1) * D * es, (char *)bk + (size_t)h * T * D * es, (size_t)(T - 1) * D * es);
            memcpy(pv + (size_t)h * (T - 1) * D * es, (char *)bv + (size_t)h * T * D * es, (size_t)(T - 1) * D * es);
            memcpy(nk + (size_t)h * D * es, (char *)bk + ((size_t)h * T + T - 1) * D * es, D * es);
            memcpy(nv + (size_t)h * D * es, (char *)bv + ((size_t)h * T + T - 1) * D * es, D * es);
        }
        for (int h = 0; h < H; h++) memcpy(nq + (size_t)h * D * es, (char *)bq + ((size_t)h * T + T - 1) * D * es, D * es);
        it.k = pk, it.v = pv;
        TH_CHECK(kvq_prefill(e, 0, &it, 1) == KVQ_OK, "prefill %d: %s", dt, kvq_engine_errmsg(e));
        kvq_decode_item d = {s, nk, nv, nq, out[dt]};
        TH_CHECK(kvq_decode(e, 0, &d, 1) == KVQ_OK, "decode %d: %s", dt, kvq_engine_errmsg(e));
        free(bk), free(bv), free(bq), free(pk), free(pv), free(nk), free(nv), free(nq);
        kvq_engine_free(e);
    }
    TH_CHECK(memcmp(out[0], out[1], sizeof out[0]) == 0 && memcmp(out[0], out[2], sizeof out[0]) == 0,
             "dtypes disagree: %g %g %g", out[0][0], out[1][0], out[2][0]);

    /* Batch vs alone, on the scenario's data (kivi2-r32 keeps K and V partly quantized). */
    float both[2 * H * D], alone[2 * H * D];
    TH_CHECK(sch && scenario(sch, 3, both, NULL, -1, 0) == KVQ_OK, "batched scenario");
    for (int b = 0; b < 2 && sch; b++) {
        kvq_engine *e = tu_engine(sch, L, H, HKV, D, KVQ_F32);
        kvq_seq *s = NULL;
        if (!e || kvq_seq_create(e, &s) != KVQ_OK) break;
        int len = b ? T1 : T0;
        float pk[HKV * MAXT * D], pv[HKV * MAXT * D], pq[H * MAXT * D];
        for (int l = 0; l < L; l++) {
            tu_slice(sk[l], 0, HKV, MAXT, D, 0, len, pk);
            tu_slice(sv[l], 0, HKV, MAXT, D, 0, len, pv);
            tu_slice(sq[l], 0, H, MAXT, D, 0, len, pq);
            kvq_prefill_item it = {s, len, pk, pv, pq};
            TH_CHECK(kvq_prefill(e, l, &it, 1) == KVQ_OK, "prefill");
        }
        for (int step = 0; step < 3; step++)
            for (int l = 0; l < L; l++) {
                tu_slice(sk[l], 0, HKV, MAXT, D, len + step, 1, pk);
                tu_slice(sv[l], 0, HKV, MAXT, D, len + step, 1, pv);
                tu_slice(sq[l], 0, H, MAXT, D, len + step, 1, pq);
                kvq_decode_item d = {s, pk, pv, pq, alone + (size_t)b * H * D};
                TH_CHECK(kvq_decode(e, l, &d, 1) == KVQ_OK, "decode");
            }
        kvq_engine_free(e);
    }
    TH_CHECK(memcmp(both, alone, sizeof both) == 0, "a batched decode differs from decoding alone");
    kvq_spec_free(spec);
    th_end();
}

int main(void)
{
    kvq_synth_params p = kvq_synth_params_default();
    p.layers = L, p.heads = H, p.kv_heads = HKV, p.head_dim = D, p.tokens = MAXT;
    kvq_synth syn;
    char err[256];
    if (kvq_synth_generate(&p, &syn, err, sizeof err) != KVQ_OK) {
        th_begin("engine: synthetic data");
        TH_CHECK(0, "%s", err);
        th_end();
        return th_summary();
    }
    for (int l = 0; l < L; l++) {
        tu_slice(syn.k, l, HKV, MAXT, D, 0, MAXT, sk[l]);
        tu_slice(syn.v, l, HKV, MAXT, D, 0, MAXT, sv[l]);
        tu_slice(syn.q, l, H, MAXT, D, 0, MAXT, sq[l]);
    }
    kvq_synth_free(&syn);
    test_create_errors();
    test_call_errors();
    test_alloc_failures("specs/kivi2-r32.kvq", tu_spec_file("specs/kivi2-r32.kvq"));
    /* OTT at this head_dim (the spec's value group is 128): G = 8, R = 4, so decode flushes compete. */
    test_alloc_failures("ott, G 8", tu_spec_text("scheme o { key { bits 2; per channel; group 8; } value { bits 2; "
                                                 "per token; group 32; } residual 4; flush group; sinks 1; "
                                                 "outliers { keep 3; spill 2; } layers 0..0 { outliers { keep 0; } } }"));
    test_alloc_failures("specs/zipcache.kvq", tu_spec_file("specs/zipcache.kvq"));
    /* ZipCache with a decode cycle inside the scenario (every 5). */
    test_alloc_failures("zipcache, every 5", tu_spec_text("scheme z { key { per channel; group all; } value { per token; "
                                                          "channel_separable; } saliency accumulated { probes recent "
                                                          "10% random 20%; salient 40% bits 4; rest bits 2; every 5; } "
                                                          "residual 2; }"));
    test_alloc_failures("specs/tailorkv2.kvq", tu_spec_file("specs/tailorkv2.kvq"));
    /* TailorKV with layer 1 sparse for sure (host offload, retrieval each step). */
    test_alloc_failures("tailorkv, layer 1 sparse",
                        tu_spec_text("scheme t { classify dense_preference { queries 4; top 10%; tau 0.2; } "
                                     "when quantize { key { bits 1; per channel; group 8; } value { bits 1; per token; "
                                     "group 32; } residual 8; } when sparse { host_offload; sinks 2; recent 4; topk 5; "
                                     "critical_channels 4; } layers 1..1 { mode sparse; } }"));
    test_batch_and_dtypes();
    return th_summary();
}
