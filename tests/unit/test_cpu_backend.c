/* The cpu backend against the reference through the public API (kvq.h): every spec of specs/ and specs/compare/
 * on awkward shapes (lengths 1, 17, 97, 1000; batch 1, 3, 17 of different lengths; GQA 1, 4, 8; head_dim 64,
 * 96, 128, 256; threads 1 and 2), decode outputs within 1e-3 relative of the reference's at every step,
 * read_cache bit-identical and stats identical at the end; a scheme it cannot run refused with
 * KVQ_ERR_UNSUPPORTED and a reason; allocation failures through create, prefill and decode; every element format
 * of specs/formats/ (test_formats) and their answer to non-finite input (test_format_edges). Without LLVM the
 * backend is unavailable and every case prints SKIP. */
#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <unistd.h>

#include "alloc.h"
#include "emit_llvm.h"
#include "test_engine_util.h"

#define KVH 2

typedef struct {
    int len, batch, gqa, D, threads, steps;
} shape;

/* A sample of the cross product: every value of every axis appears, each spec runs three rows. */
static const shape shapes[] = {
    {1, 1, 1, 64, 1, 12},     {17, 3, 4, 96, 2, 12},   {97, 1, 8, 128, 1, 110}, {1000, 1, 4, 256, 2, 12},
    {17, 17, 1, 128, 2, 12},  {97, 3, 4, 64, 2, 110},  {1000, 1, 8, 96, 1, 12}, {1, 3, 8, 256, 1, 12},
    {97, 3, 1, 256, 2, 110},  {1000, 3, 1, 128, 2, 12}, {17, 1, 4, 128, 1, 12}, {1, 17, 4, 96, 2, 12},
};
#define N_SHAPES ((int)(sizeof shapes / sizeof shapes[0]))

static char unavailable[256];

/* Adversarial data (test_adversarial): keys with outlier channels (x40) and large offsets, so that q (.) s spans
 * a wide range across channels; values whose token scales run from 1e-2 to 1e2 around offsets of +-50, so that
 * the P.V weights p_t s_t span eight orders of magnitude within a tile; queries that make the softmax peaky. The
 * int16 paths quantise q (.) s and the weights against their tile maxima: this is their worst case. */
static int adversarial;
static void adversarial_fill(float *x, size_t n, int D, int kind)
{
    if (!adversarial) return;
    for (size_t i = 0; i < n; i++) {
        int c = (int)(i % (size_t)D);
        size_t r = i / (size_t)D;
        if (kind == 0) x[i] = x[i] * (c % 13 == 0 ? 40.0f : 1.0f) + (c % 7 == 0 ? 25.0f : 0.0f);
        else if (kind == 1) x[i] = x[i] * (float)pow(10.0, (double)(r % 5) - 2.0) + (c % 2 ? 50.0f : -50.0f);
        else x[i] *= c % 13 == 0 ? 4.0f : 1.0f;
    }
}

static kvq_status make_engine(const kvq_scheme *sch, kvq_backend_kind be, const shape *s, int layers, kvq_engine **e,
                              char *err, size_t err_size)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.backend = be;
    cfg.dims = (kvq_dims){layers, KVH * s->gqa, KVH, s->D};
    cfg.dtype = KVQ_F32;
    cfg.threads = s->threads;
    cfg.seed = 7;
    return kvq_engine_create(sch, &cfg, e, err, err_size);
}

/* One run of a scheme on both backends in lockstep. Returns 0 when a check failed. */
static int compare_run(const char *name, const kvq_scheme *sch, const shape *s)
{
    /* OTT's pool is off in layers 0..1; TailorKV's calibration may decide two layers differently. */
    const int layers = sch->n_ranges > 0 ? 3 : sch->classify.enabled ? 2 : 1, H = KVH * s->gqa, D = s->D, B = s->batch;
    char err[512];
    kvq_engine *er = NULL, *ec = NULL;
    kvq_status sr = make_engine(sch, KVQ_BACKEND_REFERENCE, s, layers, &er, err, sizeof err);
    kvq_status sc = make_engine(sch, KVQ_BACKEND_CPU, s, layers, &ec, err, sizeof err);
    int ok = 1;
    char where[200];
    snprintf(where, sizeof where, "%s len %d batch %d gqa %d head_dim %d threads %d", name, s->len, B, s->gqa, D,
             s->threads);
#define CASE_CHECK(cond, fmt, ...)                                                                                 \
    do {                                                                                                       \
        if (!(cond)) {                                                                                         \
            TH_CHECK(0, "%s: " fmt, where, __VA_ARGS__);                                                            \
            ok = 0;                                                                                            \
        }                                                                                                      \
    } while (0)
    if (sr != KVQ_OK) {
        /* A shape the scheme does not fit (a value group wider than head_dim): both refuse it alike. */
        TH_CHECK(sc == sr, "%s head_dim %d: reference %s, cpu %s", name, D, kvq_status_str(sr), kvq_status_str(sc));
        kvq_engine_free(ec);
        return sc == sr;
    }
    TH_CHECK(sc == KVQ_OK, "%s head_dim %d gqa %d: cpu engine: %s: %s", name, D, s->gqa, kvq_status_str(sc), err);
    if (sc != KVQ_OK) {
        kvq_engine_free(er);
        return 0;
    }
    int maxlen = s->len + s->steps;
    size_t kvn = (size_t)KVH * (size_t)s->len * (size_t)D, qn = (size_t)H * (size_t)s->len * (size_t)D;
    float *k = malloc(kvn * sizeof *k), *v = malloc(kvn * sizeof *v), *q = malloc(qn * sizeof *q);
    float *dk = malloc((size_t)B * KVH * (size_t)D * sizeof *dk), *dv = malloc((size_t)B * KVH * (size_t)D * sizeof *dv);
    float *dq = malloc((size_t)B * (size_t)H * (size_t)D * sizeof *dq);
    float *outr = malloc((size_t)B * (size_t)H * (size_t)D * sizeof *outr);
    float *outc = malloc((size_t)B * (size_t)H * (size_t)D * sizeof *outc);
    size_t cn = (size_t)KVH * (size_t)maxlen * (size_t)D;
    float *ck[2] = {malloc(cn * sizeof(float)), malloc(cn * sizeof(float))};
    float *cv[2] = {malloc(cn * sizeof(float)), malloc(cn * sizeof(float))};
    kvq_seq **seq[2] = {calloc((size_t)B, sizeof(kvq_seq *)), calloc((size_t)B, sizeof(kvq_seq *))};
    kvq_engine *eng[2] = {er, ec};
    int *lens = malloc((size_t)B * sizeof *lens);
    for (int b = 0; b < B; b++) lens[b] = s->len - (b * 7) % s->len; /* different lengths, the first s->len */
    for (int w = 0; w < 2; w++)
        for (int b = 0; b < B; b++) CASE_CHECK(kvq_seq_create(eng[w], &seq[w][b]) == KVQ_OK, "%s", "seq_create");
    for (int l = 0; l < layers && ok; l++)
        for (int b = 0; b < B && ok; b++) {
            /* Each item its own prompt (the synthetic data's queries lean on the keys' outlier channels). */
            tu_fill(k, kvn, 1.5f);
            tu_fill(v, kvn, 1.0f);
            tu_fill(q, qn, 3.0f);
            adversarial_fill(k, kvn, D, 0);
            adversarial_fill(v, kvn, D, 1);
            adversarial_fill(q, qn, D, 2);
            for (int w = 0; w < 2; w++) {
                kvq_prefill_item it = {seq[w][b], lens[b], k, v, q};
                /* Every prompt is laid out for s->len tokens; a shorter item reads its first lens[b] (C order
                 * [heads][n][D] is a prefix only for one head, so give it the full-length layout's rows). */
                float *kk = malloc((size_t)KVH * (size_t)lens[b] * (size_t)D * sizeof(float));
                float *vv = malloc((size_t)KVH * (size_t)lens[b] * (size_t)D * sizeof(float));
                float *qq = malloc((size_t)H * (size_t)lens[b] * (size_t)D * sizeof(float));
                for (int h = 0; h < KVH; h++) {
                    memcpy(kk + (size_t)h * lens[b] * D, k + (size_t)h * s->len * D, (size_t)lens[b] * D * sizeof(float));
                    memcpy(vv + (size_t)h * lens[b] * D, v + (size_t)h * s->len * D, (size_t)lens[b] * D * sizeof(float));
                }
                for (int h = 0; h < H; h++)
                    memcpy(qq + (size_t)h * lens[b] * D, q + (size_t)h * s->len * D, (size_t)lens[b] * D * sizeof(float));
                it.k = kk, it.v = vv, it.q = qq;
                kvq_status st = kvq_prefill(eng[w], l, &it, 1);
                CASE_CHECK(st == KVQ_OK, "%s prefill layer %d: %s", w ? "cpu" : "ref",
                           l, kvq_engine_errmsg(eng[w]));
                free(kk), free(vv), free(qq);
            }
        }
    kvq_decode_item *items = malloc((size_t)B * sizeof *items);
    double worst = 0;
    for (int step = 0; step < s->steps && ok; step++)
        for (int l = 0; l < layers && ok; l++) {
            tu_fill(dk, (size_t)B * KVH * (size_t)D, 1.5f);
            tu_fill(dv, (size_t)B * KVH * (size_t)D, 1.0f);
            tu_fill(dq, (size_t)B * (size_t)H * (size_t)D, 3.0f);
            adversarial_fill(dk, (size_t)B * KVH * (size_t)D, D, 0);
            adversarial_fill(dv, (size_t)B * KVH * (size_t)D, D, 1);
            adversarial_fill(dq, (size_t)B * (size_t)H * (size_t)D, D, 2);
            for (int w = 0; w < 2 && ok; w++) {
                for (int b = 0; b < B; b++)
                    items[b] = (kvq_decode_item){seq[w][b], dk + (size_t)b * KVH * D, dv + (size_t)b * KVH * D,
                                                 dq + (size_t)b * H * D, (w ? outc : outr) + (size_t)b * H * D};
                kvq_status st = kvq_decode(eng[w], l, items, B);
                CASE_CHECK(st == KVQ_OK, "%s decode step %d layer %d: %s",
                           w ? "cpu" : "ref", step, l, kvq_engine_errmsg(eng[w]));
            }
            for (int b = 0; b < B && ok; b++)
                for (int h = 0; h < H && ok; h++) {
                    const float *r = outr + ((size_t)b * H + h) * D, *c = outc + ((size_t)b * H + h) * D;
                    double rel = tu_rel_err(c, r, (size_t)D, 1e-6);
                    if (!(rel <= worst)) worst = rel;
                    CASE_CHECK(rel <= 1e-3, "step %d layer %d item %d head %d: relative error %.3g", step, l, b, h, rel);
                }
        }
    for (int l = 0; l < layers && ok; l++)
        for (int b = 0; b < B && ok; b++) {
            int n[2] = {0, 0};
            for (int w = 0; w < 2; w++) {
                memset(ck[w], 0, cn * sizeof(float));
                memset(cv[w], 0, cn * sizeof(float));
                kvq_status st = kvq_seq_read_cache(eng[w], seq[w][b], l, ck[w], cv[w], maxlen, &n[w]);
                CASE_CHECK(st == KVQ_OK, "read_cache: %s%s", "",
                           kvq_engine_errmsg(eng[w]));
            }
            CASE_CHECK(n[0] == n[1] && !memcmp(ck[0], ck[1], cn * sizeof(float)) && !memcmp(cv[0], cv[1], cn * sizeof(float)),
                       "read_cache layer %d item %d differs (lengths %d, %d)", l, b, n[0], n[1]);
        }
    kvq_mem_stats ms[2];
    memset(ms, 0, sizeof ms);
    if (ok) {
        CASE_CHECK(kvq_engine_stats(er, &ms[0]) == KVQ_OK && kvq_engine_stats(ec, &ms[1]) == KVQ_OK, "%s", "stats");
        CASE_CHECK(!memcmp(&ms[0], &ms[1], sizeof ms[0]), "%s", "stats differ");
    }
    if (getenv("KVQ_TEST_VERBOSE"))
        printf("  %-22s len %4d batch %2d gqa %d D %3d threads %d: worst relative error %.2e\n", name, s->len, B,
               s->gqa, D, s->threads, worst);
    kvq_engine_free(er);
    kvq_engine_free(ec);
    free(k), free(v), free(q), free(dk), free(dv), free(dq), free(outr), free(outc), free(items), free(lens);
    for (int w = 0; w < 2; w++) free(ck[w]), free(cv[w]), free(seq[w]);
    return ok;
#undef CASE_CHECK
}

static const char *spec_files[] = {"specs/fp16.kvq",     "specs/kivi2.kvq",     "specs/kivi2-r32.kvq",
                                   "specs/kivi4.kvq",    "specs/ott.kvq",       "specs/zipcache.kvq",
                                   "specs/tailorkv1.kvq", "specs/tailorkv2.kvq", "specs/compare/kivi2-g128.kvq",
                                   "specs/compare/ott-baseline.kvq", "specs/compare/zipcache-accumulated.kvq"};
#define N_SPECS ((int)(sizeof spec_files / sizeof spec_files[0]))

/* Every spec of specs/ and specs/compare/ is in the list above (a new spec must join it). */
static void test_list_complete(void)
{
    th_begin("cpu: the spec list covers specs/ and specs/compare/");
    const char *dirs[] = {"specs", "specs/compare"};
    for (int d = 0; d < 2; d++) {
        DIR *dir = opendir(th_path(dirs[d]));
        TH_CHECK(dir, "cannot open %s", dirs[d]);
        struct dirent *de;
        while (dir && (de = readdir(dir))) {
            size_t n = strlen(de->d_name);
            if (n < 5 || strcmp(de->d_name + n - 4, ".kvq")) continue;
            char rel[300];
            snprintf(rel, sizeof rel, "%s/%s", dirs[d], de->d_name);
            int found = 0;
            for (int i = 0; i < N_SPECS; i++) found |= !strcmp(spec_files[i], rel);
            TH_CHECK(found, "%s is not tested on the cpu backend", rel);
        }
        if (dir) closedir(dir);
    }
    th_end();
}

static void test_specs(void)
{
    for (int i = 0; i < N_SPECS; i++) {
        if (unavailable[0]) {
            printf("SKIP cpu vs reference: %s: %s\n", spec_files[i], unavailable);
            continue;
        }
        th_begin("cpu vs reference: %s (3 shapes, outputs 1e-3, read_cache and stats identical)", spec_files[i]);
        kvq_spec *sp = tu_spec_file(spec_files[i]);
        int ns = sp ? kvq_spec_scheme_count(sp) : 0;
        const kvq_scheme *sch = ns ? kvq_spec_scheme_at(sp, ns - 1) : NULL; /* the file's own (last) scheme */
        for (int j = 0; j < 3 && sch; j++) {
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            compare_run(spec_files[i], sch, &shapes[(i * 3 + j) % N_SHAPES]);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            if (getenv("KVQ_TEST_VERBOSE"))
                printf("    %.2f s\n", (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
        }
        kvq_spec_free(sp);
        th_end();
    }
}

static void test_unsupported(void)
{
    if (unavailable[0]) {
        printf("SKIP cpu: a scheme it cannot run: %s\n", unavailable);
        return;
    }
    th_begin("cpu: a scheme beyond the plan (17 layer classes) is refused with KVQ_ERR_UNSUPPORTED and the reason");
    char text[4096];
    int n = snprintf(text, sizeof text, "scheme many { key { bits 2; per channel; group 32; } value { bits 2; per token; "
                                        "group 32; } residual 32;");
    for (int l = 0; l < 17; l++) n += snprintf(text + n, sizeof text - (size_t)n, " layers %d..%d { residual %d; }", l, l, 32 * (l + 1));
    snprintf(text + n, sizeof text - (size_t)n, " }");
    kvq_spec *sp = tu_spec_text(text);
    const kvq_scheme *sch = sp ? kvq_spec_scheme(sp, "many") : NULL;
    shape s = {1, 1, 1, 64, 1, 1};
    kvq_engine *e = NULL;
    char err[512] = "";
    kvq_status st = sch ? make_engine(sch, KVQ_BACKEND_REFERENCE, &s, 17, &e, err, sizeof err) : KVQ_ERR_INVALID;
    TH_CHECK(st == KVQ_OK, "the reference runs it: %s", err);
    kvq_engine_free(e);
    e = NULL;
    st = sch ? make_engine(sch, KVQ_BACKEND_CPU, &s, 17, &e, err, sizeof err) : KVQ_ERR_INVALID;
    TH_CHECK(st == KVQ_ERR_UNSUPPORTED && !e, "cpu: %s (%s)", kvq_status_str(st), err);
    TH_CHECK(strstr(err, "layer configurations") != NULL, "the reason is given: '%s'", err);
    kvq_engine_free(e);
    kvq_spec_free(sp);
    th_end();
}

/* create + prefill + decode of a KIVI-2 and an OTT batch; the outputs of the last step. The inputs are the same
 * every call: drawn once (scenario_inputs, in the order the calls use them), because test_alloc_failures runs the
 * scenario once per allocation and drawing them (an fp16 rounding per element) was about 40 % of its time. */
#define SC_LAYERS 2
static const shape sc_shape = {170, 2, 2, 128, 2, 3}; /* OTT's prefill quantizes 128 of them (G = 128, R = 32) */
static float *sc_prefill[SC_LAYERS][2], *sc_decode[3][SC_LAYERS];

static void scenario_inputs_free(void)
{
    for (int l = 0; l < SC_LAYERS; l++) {
        for (int b = 0; b < 2; b++) free(sc_prefill[l][b]), sc_prefill[l][b] = NULL;
        for (int t = 0; t < sc_shape.steps; t++) free(sc_decode[t][l]), sc_decode[t][l] = NULL;
    }
}

static int scenario_inputs(void)
{
    if (sc_prefill[0][0]) return 1;
    const shape s = sc_shape;
    const size_t row = (size_t)(2 * KVH + KVH * s.gqa) * (size_t)s.D;
    uint64_t rng = tu_rng;
    int ok = 1;
    for (int l = 0; l < SC_LAYERS; l++)
        for (int b = 0; b < 2; b++) {
            size_t n = row * (size_t)(s.len - 9 * b);
            if (!(sc_prefill[l][b] = malloc(n * sizeof(float)))) ok = 0;
            else tu_fill(sc_prefill[l][b], n, 1.0f);
        }
    for (int t = 0; t < s.steps; t++)
        for (int l = 0; l < SC_LAYERS; l++) {
            if (!(sc_decode[t][l] = malloc(2 * row * sizeof(float)))) ok = 0;
            else tu_fill(sc_decode[t][l], 2 * row, 1.0f);
        }
    tu_rng = rng;
    if (!ok) scenario_inputs_free();
    return ok;
}

static kvq_status scenario(const kvq_scheme *sch, float *out_last)
{
    shape s = sc_shape;
    int H = KVH * s.gqa, D = s.D;
    if (!scenario_inputs()) return KVQ_ERR_NOMEM;
    kvq_engine *e = NULL;
    char err[256];
    kvq_status st = make_engine(sch, KVQ_BACKEND_CPU, &s, SC_LAYERS, &e, err, sizeof err);
    kvq_seq *sq[2] = {NULL, NULL};
    for (int b = 0; b < 2 && st == KVQ_OK; b++) st = kvq_seq_create(e, &sq[b]);
    for (int l = 0; l < SC_LAYERS && st == KVQ_OK; l++)
        for (int b = 0; b < 2 && st == KVQ_OK; b++) {
            int n = s.len - 9 * b;
            float *buf = sc_prefill[l][b];
            kvq_prefill_item it = {sq[b], n, buf, buf + (size_t)KVH * n * D, buf + (size_t)2 * KVH * n * D};
            st = kvq_prefill(e, l, &it, 1);
        }
    for (int step = 0; step < s.steps && st == KVQ_OK; step++)
        for (int l = 0; l < SC_LAYERS && st == KVQ_OK; l++) {
            float *buf = sc_decode[step][l];
            kvq_decode_item it[2];
            for (int b = 0; b < 2; b++) {
                float *x = buf + (size_t)b * (2 * KVH + H) * D;
                it[b] = (kvq_decode_item){sq[b], x, x + KVH * D, x + 2 * KVH * D, out_last + (size_t)b * H * D};
            }
            st = kvq_decode(e, l, it, 2);
        }
    kvq_engine_free(e);
    return st;
}

static void test_alloc_failures(const char *file)
{
    if (unavailable[0]) {
        printf("SKIP cpu: allocation failures (%s): %s\n", file, unavailable);
        return;
    }
    th_begin("cpu: allocation failure n = 1, 2, ... through create/prefill/decode: %s", file);
    kvq_spec *sp = tu_spec_file(file);
    int ns = sp ? kvq_spec_scheme_count(sp) : 0;
    const kvq_scheme *sch = ns ? kvq_spec_scheme_at(sp, ns - 1) : NULL;
    float want[2 * KVH * 2 * 128], got[2 * KVH * 2 * 128];
    TH_CHECK(sch && scenario(sch, want) == KVQ_OK, "the scenario fails without injection");
    int completed = 0;
    long n;
    /* Every allocation fails in turn. */
    for (n = 1; n < 20000 && sch && !th_failed(); n++) {
        kvq_alloc_fail_after(n);
        kvq_status st = scenario(sch, got);
        long injected = kvq_alloc_failures();
        kvq_alloc_fail_after(0);
        if (injected == 0) {
            TH_CHECK(st == KVQ_OK, "n=%ld: no failure injected but %s", n, kvq_status_str(st));
            TH_CHECK(!memcmp(got, want, sizeof got), "n=%ld: the completed run differs", n);
            completed = 1;
            break;
        }
        TH_CHECK(st == KVQ_ERR_NOMEM, "n=%ld: an allocation failure gave %s", n, kvq_status_str(st));
    }
    TH_CHECK(completed, "no run completed (n up to %ld)", n);
    scenario_inputs_free();
    kvq_spec_free(sp);
    th_end();
}

/* The other vector paths on this host: AVX2's 8 lanes and 4 lanes (KVQ_CPU_VECTOR_WIDTH), and the fp32 16-lane
 * path of an AVX-512 host without VNNI (KVQ_CPU_VNNI=0; on a VNNI host the default takes the int16 paths). */
static void test_widths(void)
{
    static const char *files[] = {"specs/kivi2.kvq", "specs/zipcache.kvq", "specs/ott.kvq"};
    static const shape sh[] = {{97, 2, 4, 128, 2, 110}, {40, 1, 1, 128, 1, 12}, {200, 1, 4, 128, 2, 12}};
    for (int w = 4; w <= 16; w *= 2) {
        const char *what = w == 16 ? "16-lane fp32 vectors (KVQ_CPU_VNNI=0)" : w == 8 ? "8-lane vectors" : "4-lane vectors";
        if (unavailable[0]) {
            printf("SKIP cpu: %s: %s\n", what, unavailable);
            continue;
        }
        th_begin("cpu: %s vs reference: kivi2, zipcache, ott", what);
        char val[8];
        snprintf(val, sizeof val, "%d", w);
        setenv("KVQ_CPU_VECTOR_WIDTH", val, 1);
        if (w == 16) setenv("KVQ_CPU_VNNI", "0", 1);
        for (int i = 0; i < 3; i++) {
            kvq_spec *sp = tu_spec_file(files[i]);
            const kvq_scheme *sch = sp ? kvq_spec_scheme_at(sp, kvq_spec_scheme_count(sp) - 1) : NULL;
            if (sch) compare_run(files[i], sch, &sh[i]);
            kvq_spec_free(sp);
        }
        unsetenv("KVQ_CPU_VECTOR_WIDTH");
        unsetenv("KVQ_CPU_VNNI");
        th_end();
    }
}

/* The int16 paths' accuracy argument (docs/cpu.md "Accuracy") on adversarial data, against the reference, and the
 * fp32 path on the same data (KVQ_CPU_VNNI=0): per-channel keys (the int16 key path), per-token values in
 * groups of 32 and 128 (the int16 P.V), odd tile lengths, GQA 1 (where the int16 paths run); and at GQA 4 and 8
 * the GQA paths (keys with tokens in the lanes, value scales folded into the weights; "GQA > 1"). */
static void test_adversarial(void)
{
    static const char *files[] = {"specs/kivi2.kvq", "specs/kivi4.kvq", "specs/compare/kivi2-g128.kvq",
                                  "specs/kivi2.kvq", "specs/kivi4.kvq"};
    static const shape sh[] = {{97, 2, 1, 128, 1, 45}, {201, 1, 1, 128, 2, 37}, {1000, 1, 1, 128, 1, 12},
                               {301, 2, 4, 128, 1, 37}, {201, 1, 8, 64, 2, 37}};
    static const char *paths[] = {"host path (int8 2-bit keys and values, int16 with VNNI)",
                                  "int16 keys (KVQ_CPU_INT8=0)", "fp32 path (KVQ_CPU_VNNI=0)"};
    for (int path = 0; path < 3; path++) {
        if (unavailable[0]) {
            printf("SKIP cpu: adversarial data: %s\n", unavailable);
            return;
        }
        th_begin("cpu: adversarial data (outlier channels, token scales 1e-2..1e2, peaky softmax), %s, vs reference",
                 paths[path]);
        if (path == 1) setenv("KVQ_CPU_INT8", "0", 1);
        if (path == 2) setenv("KVQ_CPU_VNNI", "0", 1);
        adversarial = 1;
        for (int i = 0; i < (int)(sizeof sh / sizeof sh[0]); i++) {
            kvq_spec *sp = tu_spec_file(files[i]);
            const kvq_scheme *sch = sp ? kvq_spec_scheme_at(sp, kvq_spec_scheme_count(sp) - 1) : NULL;
            if (sch) compare_run(files[i], sch, &sh[i]);
            kvq_spec_free(sp);
        }
        adversarial = 0;
        unsetenv("KVQ_CPU_VNNI");
        unsetenv("KVQ_CPU_INT8");
        th_end();
    }
}

/* Every scheme of specs/formats/ (element formats, compiler/emit_llvm_format.c) against the reference: outputs
 * within 1e-3 and read_cache bit-identical (the cpu backend stores with the reference's one quantizer, so the codes
 * are the reference's), on the host's widest path, on adversarial data at GQA 1 (large offsets and scales:
 * tensor scales from the prompt saturate later tokens, as docs/language.md says), and at 8 and 4 lanes. */
static void test_formats(void)
{
    char *names[64];
    int n = th_list_files("specs/formats", ".kvq", names, 64), schemes = 0;
    static const shape sh[] = {{97, 3, 4, 128, 2, 12}, {200, 1, 1, 64, 1, 20}, {40, 2, 2, 96, 1, 6}};
    for (int i = 0; i < n; i++) {
        char rel[256];
        snprintf(rel, sizeof rel, "specs/formats/%s", names[i]);
        free(names[i]);
        if (unavailable[0]) {
            printf("SKIP cpu vs reference: %s: %s\n", rel, unavailable);
            continue;
        }
        kvq_spec *sp = tu_spec_file(rel);
        for (int j = 0; sp && j < kvq_spec_scheme_count(sp); j++, schemes++) {
            const kvq_scheme *sch = kvq_spec_scheme_at(sp, j);
            th_begin("cpu vs reference: %s scheme %s (host path, adversarial GQA 1, 8 and 4 lanes)", rel, sch->name);
            compare_run(sch->name, sch, &sh[0]);
            adversarial = 1;
            compare_run(sch->name, sch, &sh[1]);
            adversarial = 0;
            for (int w = 8; w >= 4; w /= 2) {
                char val[8];
                snprintf(val, sizeof val, "%d", w);
                setenv("KVQ_CPU_VECTOR_WIDTH", val, 1);
                compare_run(sch->name, sch, &sh[2]);
            }
            unsetenv("KVQ_CPU_VECTOR_WIDTH");
            th_end();
        }
        kvq_spec_free(sp);
    }
    if (!unavailable[0]) {
        th_begin("cpu: specs/formats covered");
        TH_CHECK(schemes >= 13, "only %d schemes under specs/formats", schemes);
        th_end();
    }
}

/* Non-finite and out-of-range K/V (NaN, inf, beyond fp16's 65504) on an element format: the cpu backend answers
 * as the reference does (the same status; the engine's input policy runs before any backend), and a refused step
 * changes nothing: the next good step agrees with the reference. */
static void test_format_edges(void)
{
    static const char *files[] = {"specs/formats/fp8-e4m3.kvq", "specs/formats/nvfp4.kvq", "specs/formats/q4_0.kvq",
                                  "specs/formats/mxfp4.kvq"};
    static const float bad[] = {NAN, INFINITY, -INFINITY, 1e6f};
    if (unavailable[0]) {
        printf("SKIP cpu: element formats on non-finite input: %s\n", unavailable);
        return;
    }
    th_begin("cpu: element formats on NaN / inf / out-of-range K and V: the reference's answer, nothing changed");
    shape s = {40, 1, 2, 64, 1, 1};
    int H = KVH * s.gqa, D = s.D;
    for (int f = 0; f < 4; f++) {
        kvq_spec *sp = tu_spec_file(files[f]);
        const kvq_scheme *sch = sp ? kvq_spec_scheme_at(sp, 0) : NULL;
        kvq_engine *eng[2] = {NULL, NULL};
        kvq_seq *sq[2] = {NULL, NULL};
        char err[512];
        float *buf = malloc((size_t)(2 * KVH + H) * (size_t)s.len * (size_t)D * sizeof(float));
        float dk[KVH * 64], dv[KVH * 64], dq[8 * 64], out[2][8 * 64];
        tu_fill(buf, (size_t)(2 * KVH + H) * (size_t)s.len * (size_t)D, 2.0f);
        for (int w = 0; w < 2 && sch; w++) {
            kvq_status st = make_engine(sch, w ? KVQ_BACKEND_CPU : KVQ_BACKEND_REFERENCE, &s, 1, &eng[w], err, sizeof err);
            TH_CHECK(st == KVQ_OK, "%s: engine %d: %s", files[f], w, err);
            if (st == KVQ_OK) st = kvq_seq_create(eng[w], &sq[w]);
            kvq_prefill_item it = {sq[w], s.len, buf, buf + (size_t)KVH * s.len * D, buf + (size_t)2 * KVH * s.len * D};
            if (st == KVQ_OK) st = kvq_prefill(eng[w], 0, &it, 1);
            TH_CHECK(st == KVQ_OK, "%s: prefill %d: %s", files[f], w, eng[w] ? kvq_engine_errmsg(eng[w]) : "");
        }
        for (int b = 0; b < 5 && eng[0] && eng[1] && sq[0] && sq[1]; b++) {
            tu_fill(dk, sizeof dk / sizeof *dk, 2.0f);
            tu_fill(dv, sizeof dv / sizeof *dv, 2.0f);
            tu_fill(dq, (size_t)H * D, 2.0f);
            if (b < 4) (b % 2 ? dv : dk)[17] = bad[b]; /* the last round is a good step */
            kvq_status st[2];
            for (int w = 0; w < 2; w++) {
                kvq_decode_item d = {sq[w], dk, dv, dq, out[w]};
                st[w] = kvq_decode(eng[w], 0, &d, 1);
            }
            TH_CHECK(st[0] == st[1], "%s: input %g: reference %s, cpu %s (%s)", files[f], b < 4 ? bad[b] : 0.0,
                     kvq_status_str(st[0]), kvq_status_str(st[1]), kvq_engine_errmsg(eng[1]));
            if (st[0] == KVQ_OK && st[1] == KVQ_OK) {
                double rel = 0;
                for (int h = 0; h < H; h++) {
                    double r = tu_rel_err(out[1] + h * D, out[0] + h * D, (size_t)D, 1e-6);
                    if (!(r <= rel)) rel = r;
                }
                TH_CHECK(rel <= 1e-3, "%s: step %d: relative error %.3g", files[f], b, rel);
            }
        }
        for (int w = 0; w < 2; w++) {
            if (sq[w]) kvq_seq_free(eng[w], sq[w]);
            kvq_engine_free(eng[w]);
        }
        free(buf);
        kvq_spec_free(sp);
    }
    th_end();
}

/* The JIT cache: a miss compiles and writes the object, a hit loads it, a corrupt entry is a miss. */
static void test_cache(void)
{
    if (unavailable[0]) {
        printf("SKIP cpu: JIT cache: %s\n", unavailable);
        return;
    }
    th_begin("cpu: JIT cache: miss, hit, corrupt entry (a miss again), kernels equal");
    char dir[] = "/tmp/kvq-cpu-cache-XXXXXX";
    const char *old = getenv("KVQ_CACHE_DIR");
    char *saved = old ? strdup(old) : NULL;
    TH_CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    setenv("KVQ_CACHE_DIR", dir, 1);
    emit_llvm_kernel k;
    memset(&k, 0, sizeof k);
    k.head_dim = 64;
    k.gqa = 2;
    k.k.fp16 = 1;
    k.v.fp16 = 1;
    int hit[3];
    float res[3][2 * 64];
    for (int r = 0; r < 3; r++) {
        emit_llvm_jit *j = NULL;
        emit_llvm_tile_fn fn = NULL;
        char msg[256];
        kvq_status st = emit_llvm_compile(&k, 1, 0, NULL, NULL, &j, &fn, &hit[r], msg, sizeof msg);
        TH_CHECK(st == KVQ_OK, "compile %d: %s", r, msg);
        if (st == KVQ_OK) {
            uint16_t K[3 * 64], V[3 * 64];
            float q[2 * 64], ml[4] = {-3e38f, 0, -3e38f, 0}, p[2 * EMIT_LLVM_TILE];
            for (int i = 0; i < 3 * 64; i++) K[i] = kvq_f16_from_f32(0.01f * (float)(i % 17)), V[i] = kvq_f16_from_f32(0.02f * (float)(i % 5));
            for (int i = 0; i < 2 * 64; i++) q[i] = 0.1f * (float)(i % 7);
            memset(res[r], 0, sizeof res[r]);
            emit_llvm_tile_args a = {q, res[r], ml, p, (const uint8_t *)K, NULL, NULL, NULL, NULL, (const uint8_t *)V,
                                     NULL, NULL, NULL, 3, 0, NULL, 0, NULL, NULL, NULL, NULL};
            fn(&a);
        }
        emit_llvm_free(j);
        if (r == 1) {
            /* Corrupt every entry: flip a byte in the middle. */
            DIR *d = opendir(dir);
            struct dirent *de;
            while (d && (de = readdir(d))) {
                if (de->d_name[0] == '.') continue;
                char path[512];
                snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
                FILE *f = fopen(path, "r+b");
                if (f) {
                    fseek(f, 100, SEEK_SET);
                    int c = fgetc(f);
                    fseek(f, 100, SEEK_SET);
                    fputc(c ^ 0xff, f);
                    fclose(f);
                }
            }
            if (d) closedir(d);
        }
    }
    TH_CHECK(hit[0] == 0 && hit[1] == 1 && hit[2] == 0, "cache hits %d %d %d, expected 0 1 0", hit[0], hit[1], hit[2]);
    TH_CHECK(!memcmp(res[0], res[1], sizeof res[0]) && !memcmp(res[0], res[2], sizeof res[0]),
             "the cached kernel computes something else");
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        unlink(path);
    }
    if (d) closedir(d);
    rmdir(dir);
    if (saved) setenv("KVQ_CACHE_DIR", saved, 1);
    else unsetenv("KVQ_CACHE_DIR");
    free(saved);
    th_end();
}

/* The IR is a function of the kernel description only (the JIT cache relies on it) and sized to the width. */
static void test_ir(void)
{
    if (unavailable[0]) {
        printf("SKIP cpu: IR text: %s\n", unavailable);
        return;
    }
    th_begin("cpu: emitted IR is deterministic, uses the requested vector width, flags only the sums");
    emit_llvm_kernel k;
    memset(&k, 0, sizeof k);
    k.head_dim = 128;
    k.gqa = 4;
    kvq_tensor_cfg kc = {.bits = 2, .gran = KVQ_GRAN_CHANNEL, .channel_separable = 0, .group = 32,
                         .scale_dtype = KVQ_DT_FP16, .zero_dtype = KVQ_DT_FP16};
    kvq_tensor_cfg vc = {.bits = 2, .gran = KVQ_GRAN_TOKEN, .channel_separable = 0, .group = 32,
                         .scale_dtype = KVQ_DT_FP16, .zero_dtype = KVQ_DT_FP16};
    kvq_page_format_init(&k.k.fmt, &kc, 2, 0, 8, 128, 32);
    kvq_page_format_init(&k.v.fmt, &vc, 2, 0, 8, 128, 64);
    char *a = emit_llvm_ir_text(&k, 8), *b = emit_llvm_ir_text(&k, 8), *c = emit_llvm_ir_text(&k, 16);
    TH_CHECK(a && b && c, "no IR");
    if (a && b && c) {
        TH_CHECK(!strcmp(a, b), "two emissions of one kernel differ");
        TH_CHECK(strstr(a, "<8 x float>") && !strstr(a, "<16 x float>"), "width 8 emits other vectors");
        TH_CHECK(strstr(c, "<16 x float>") != NULL, "width 16 emits no <16 x float>");
        /* The dequantization z + s * code keeps IEEE semantics: no flagged fadd/fmul feeds from a uitofp alone. */
        TH_CHECK(strstr(a, "fadd reassoc contract") != NULL, "the sums are not flagged");
        TH_CHECK(strstr(a, "fmul fast") == NULL && strstr(a, "nnan") == NULL && strstr(a, "ninf") == NULL,
                 "flags beyond reassoc/contract");
        /* The int16 paths: on a 16-lane VNNI host only, never on request otherwise. */
        int vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512f");
        char *d = emit_llvm_ir_text(&k, 16 | EMIT_LLVM_NO_VNNI);
        TH_CHECK(d && strstr(d, "<16 x float>") && !strstr(d, "vpdpwssd"), "16 lanes without VNNI emit vpdpwssd");
        TH_CHECK(!strstr(a, "vpdpwssd"), "8 lanes emit vpdpwssd");
        /* ...at GQA 1 (k is GQA 4: fp32 there). */
        emit_llvm_kernel k1 = k;
        k1.gqa = 1;
        char *c1 = emit_llvm_ir_text(&k1, 16);
        TH_CHECK(!strstr(c, "vpdpwssd"), "a GQA-4 kernel emits vpdpwssd");
        /* GQA > 1 at 16 lanes: keys with the tokens in the lanes (q'' read through the laundering asm), the value
         * scales folded into a weight scratch (wf); neither at GQA 1; at 8 lanes the weight scratch only */
        TH_CHECK(c && strstr(c, "asm sideeffect") && strstr(c, "%wf = alloca"), "GQA 4, 16 lanes: no GQA paths");
        TH_CHECK(c1 && !strstr(c1, "asm sideeffect") && !strstr(c1, "%wf = alloca"), "GQA 1 takes a GQA path");
        TH_CHECK(!strstr(a, "asm sideeffect") && strstr(a, "%wf = alloca"), "8 lanes: tokens in the lanes, or no wf");
        /* The int8 paths: 2-bit per-channel keys at GQA 1 on a VNNI host, and 2- or 4-bit per-token values there
         * with VBMI too (vpdpbusd); with EMIT_LLVM_NO_INT8 the int16 paths (vpdpwssd); never at GQA 4, nor for
         * 4-bit keys or 3-bit values. */
        int vbmi = vnni && __builtin_cpu_supports("avx512vbmi");
        char *c8 = emit_llvm_ir_text(&k1, 16 | EMIT_LLVM_NO_INT8);
        emit_llvm_kernel k4 = k1, k44 = k1;
        kvq_tensor_cfg kc4 = {.bits = 4, .gran = KVQ_GRAN_CHANNEL, .channel_separable = 0, .group = 32,
                              .scale_dtype = KVQ_DT_FP16, .zero_dtype = KVQ_DT_FP16};
        kvq_tensor_cfg vc4 = {.bits = 4, .gran = KVQ_GRAN_TOKEN, .channel_separable = 0, .group = 32,
                              .scale_dtype = KVQ_DT_FP16, .zero_dtype = KVQ_DT_FP16};
        kvq_page_format_init(&k4.k.fmt, &kc4, 4, 0, 8, 128, 32);
        kvq_page_format_init(&k44.k.fmt, &kc4, 4, 0, 8, 128, 32);
        kvq_page_format_init(&k44.v.fmt, &vc4, 4, 0, 8, 128, 64);
        char *c4 = emit_llvm_ir_text(&k4, 16), *c44 = emit_llvm_ir_text(&k44, 16);
        TH_CHECK(c1 && (!vnni || strstr(c1, "llvm.x86.avx512.vpdpbusd.512")),
                 "a VNNI host's 16-lane GQA-1 2-bit kernel has no vpdpbusd");
        TH_CHECK(c1 && (!vnni || vbmi || strstr(c1, "llvm.x86.avx512.vpdpwssd.512")),
                 "a VNNI host without VBMI: the 2-bit values' P.V is not int16");
        TH_CHECK(c1 && (!vbmi || !strstr(c1, "vpdpwssd")), "a VBMI host's 2-bit kernel keeps an int16 path");
        TH_CHECK(c8 && !strstr(c8, "vpdpbusd") && (!vnni || strstr(c8, "vpdpwssd")),
                 "EMIT_LLVM_NO_INT8: vpdpbusd, or no int16 paths");
        TH_CHECK(!strstr(c, "vpdpbusd") && !strstr(a, "vpdpbusd") && d && !strstr(d, "vpdpbusd"),
                 "vpdpbusd at GQA 4, at 8 lanes or without VNNI");
        /* 4-bit keys, 2- or 4-bit values: int16 keys, the values' P.V int8 on a VBMI host */
        TH_CHECK(c4 && (!vnni || strstr(c4, "vpdpwssd")) && (vbmi ? strstr(c4, "vpdpbusd") != NULL : !strstr(c4, "vpdpbusd")),
                 "4-bit keys with 2-bit values: not int16 keys with an int8 P.V (VBMI)");
        TH_CHECK(c44 && (!vnni || strstr(c44, "vpdpwssd")) && (vbmi ? strstr(c44, "vpdpbusd") != NULL : !strstr(c44, "vpdpbusd")),
                 "4-bit keys and values: not int16 keys with an int8 P.V (VBMI)");
        /* 3-bit values (two planes) keep the int16 P.V */
        emit_llvm_kernel k3 = k44;
        kvq_tensor_cfg vc3 = {.bits = 3, .gran = KVQ_GRAN_TOKEN, .channel_separable = 0, .group = 32,
                              .scale_dtype = KVQ_DT_FP16, .zero_dtype = KVQ_DT_FP16};
        kvq_page_format_init(&k3.v.fmt, &vc3, 3, 0, 8, 128, 64);
        char *c3 = emit_llvm_ir_text(&k3, 16);
        TH_CHECK(c3 && !strstr(c3, "vpdpbusd"), "3-bit values take an int8 P.V");
        free(c3);
        free(c1), free(c8), free(c4), free(c44);
        free(d);
    }
    free(a), free(b), free(c);
    th_end();
}

int main(void)
{
    shape s = {1, 1, 1, 64, 1, 1};
    kvq_spec *sp = tu_spec_file("specs/kivi2.kvq");
    kvq_engine *e = NULL;
    kvq_status st = sp ? make_engine(kvq_spec_scheme(sp, NULL), KVQ_BACKEND_CPU, &s, 1, &e, unavailable,
                                     sizeof unavailable)
                       : KVQ_ERR_INVALID;
    if (st == KVQ_OK) unavailable[0] = '\0';
    else if (st != KVQ_ERR_UNAVAILABLE) printf("FAIL cpu: engine on kivi2: %s: %s\n", kvq_status_str(st), unavailable);
    kvq_engine_free(e);
    kvq_spec_free(sp);
    if (st != KVQ_OK && st != KVQ_ERR_UNAVAILABLE) return 1;
    test_list_complete();
    test_specs();
    test_unsupported();
    test_widths();
    test_adversarial();
    test_formats();
    test_format_edges();
    test_cache();
    test_ir();
    test_alloc_failures("specs/kivi2.kvq");
    test_alloc_failures("specs/ott.kvq");
    return th_summary();
}
