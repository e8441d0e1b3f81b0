/* TurboQuant on the emu backend (the cuda backend's kernels, templates/kvq_turboquant.cuh, on the emulator device)
 * against the reference backend through the public API: every scheme of specs/rotate/turboquant*.kvq (mse keys and
 * values, prod keys with their QJL term, without and with the outlier channel split), on
 * fresh random inputs in lockstep (each sequence its own outlier channels, so its own split): every decode step's
 * attention within 1e-3 (relative to the head's magnitude), the cache read back bit-identical (the device's codes
 * and norms are the reference's bits), the same statistics. Shapes: GQA 1, 4 and 8, head_dim 64, 96, 128 and 256,
 * batches of 1-3 sequences, decodes across the appendable pages' 128-token boundary; one case again under
 * KVQ_EMU_SHUFFLE with three seeds (the emulator's threads in other orders). The data's seed is printed
 * (KVQ_TEST_SEED=N reruns it). Prod values (Algorithm 2's reconstruction, which the kernels do not apply in p.V)
 * are refused with KVQ_ERR_UNSUPPORTED, naming them. Without the emulator: "skipped: <reason>", exit 0. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"
#include "test_engine_util.h"

#define KVH 2
/* tests/gpu/test_gpu_turboquant.c builds this file for the cuda backend (a real GPU) */
#ifndef CU_TEST_BACKEND
#define CU_TEST_BACKEND KVQ_BACKEND_EMU
#endif
#define BE (CU_TEST_BACKEND == KVQ_BACKEND_EMU ? "emu" : "cuda")

typedef struct {
    int len, batch, gqa, D, steps;
} shape;

static const shape shapes[] = {
    {97, 1, 1, 128, 36}, {150, 2, 4, 128, 4}, {17, 3, 8, 96, 4}, {60, 1, 4, 64, 4}, {40, 1, 1, 256, 3},
};
#define N_SHAPES ((int)(sizeof shapes / sizeof shapes[0]))

static const struct {
    const char *file, *name;
} schemes[] = {
    {"specs/rotate/turboquant.kvq", "turboquant-mse3"},          {"specs/rotate/turboquant.kvq", "turboquant-k3v2"},
    {"specs/rotate/turboquant.kvq", "turboquant-k4v3"},          {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-2p5"},
    {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-32x3-96x2"}, {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-2p5-mse"},
    {"specs/rotate/turboquant-3.5bit.kvq", "turboquant-3p5"},    {"specs/rotate/turboquant-3.5bit.kvq", "turboquant-3p5-mse"},
};
#define N_SCHEMES ((int)(sizeof schemes / sizeof schemes[0]))

static kvq_status make_engine(const kvq_scheme *sch, kvq_backend_kind be, const shape *s, kvq_engine **e, char *err,
                              size_t n)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.backend = be;
    cfg.dims = (kvq_dims){1, KVH * s->gqa, KVH, s->D};
    cfg.dtype = KVQ_F32;
    return kvq_engine_create(sch, &cfg, e, err, n);
}

/* Both backends in lockstep; the worst relative error of a decode output, -3 when both refuse the shape (a split
 * with no regular channels), or -1 when a check failed. */
static double compare_run(const kvq_scheme *sch, const shape *s)
{
    int H = KVH * s->gqa, D = s->D, B = s->batch, maxlen = s->len + s->steps;
    char err[512] = "";
    kvq_engine *eng[2] = {NULL, NULL};
    kvq_status sr = make_engine(sch, KVQ_BACKEND_REFERENCE, s, &eng[0], err, sizeof err);
    kvq_status se = make_engine(sch, CU_TEST_BACKEND, s, &eng[1], err, sizeof err);
    if (sr == KVQ_ERR_SHAPE) {
        TH_CHECK(se == sr, "reference %s, %s %s (%s)", kvq_status_str(sr), BE, kvq_status_str(se), err);
        kvq_engine_free(eng[1]);
        return th_failed() ? -1 : -3;
    }
    TH_CHECK(sr == KVQ_OK, "reference: %s: %s", kvq_status_str(sr), err);
    TH_CHECK(se == KVQ_OK, "%s: %s: %s", BE, kvq_status_str(se), err);
    size_t kvn = (size_t)KVH * s->len * D, qn = (size_t)H * s->len * D, one = (size_t)B * KVH * D;
    size_t oneq = (size_t)B * H * D, cn = (size_t)KVH * maxlen * D;
    float *k = malloc(kvn * 4), *v = malloc(kvn * 4), *q = malloc(qn * 4), *dk = malloc(one * 4), *dv = malloc(one * 4);
    float *dq = malloc(oneq * 4), *out[2] = {malloc(oneq * 4), malloc(oneq * 4)};
    float *ck[2] = {malloc(cn * 4), malloc(cn * 4)}, *cv[2] = {malloc(cn * 4), malloc(cn * 4)};
    kvq_seq *seq[2][4] = {{NULL}};
    kvq_decode_item items[4];
    double worst = 0;
    for (int w = 0; w < 2 && !th_failed(); w++)
        for (int b = 0; b < B; b++) TH_CHECK(kvq_seq_create(eng[w], &seq[w][b]) == KVQ_OK, "seq_create");
    for (int b = 0; b < B && !th_failed(); b++) {
        /* each sequence its own prompt and outlier channels (channel c scaled where c mod 5 = b) */
        tu_fill(k, kvn, 1.5f);
        tu_fill(v, kvn, 1.0f);
        tu_fill(q, qn, 3.0f);
        for (size_t i = 0; i < kvn; i++)
            if ((int)(i % (size_t)D) % 5 == b) k[i] *= 4.0f, v[i] *= 3.0f;
        for (int w = 0; w < 2 && !th_failed(); w++) {
            kvq_prefill_item it = {seq[w][b], s->len, k, v, q};
            TH_CHECK(kvq_prefill(eng[w], 0, &it, 1) == KVQ_OK, "%s prefill: %s", w ? BE : "ref",
                     kvq_engine_errmsg(eng[w]));
        }
    }
    for (int step = 0; step < s->steps && !th_failed(); step++) {
        tu_fill(dk, one, 1.5f);
        tu_fill(dv, one, 1.0f);
        tu_fill(dq, oneq, 3.0f);
        for (int w = 0; w < 2 && !th_failed(); w++) {
            for (int b = 0; b < B; b++)
                items[b] = (kvq_decode_item){seq[w][b], dk + (size_t)b * KVH * D, dv + (size_t)b * KVH * D,
                                             dq + (size_t)b * H * D, out[w] + (size_t)b * H * D};
            TH_CHECK(kvq_decode(eng[w], 0, items, B) == KVQ_OK, "%s decode step %d: %s", w ? BE : "ref", step,
                     kvq_engine_errmsg(eng[w]));
        }
        for (int r = 0; r < B * H && !th_failed(); r++) {
            double rel = tu_rel_err(out[1] + (size_t)r * D, out[0] + (size_t)r * D, (size_t)D, 1e-6);
            if (!(rel <= worst)) worst = rel;
            TH_CHECK(rel <= 1e-3, "step %d item %d head %d: relative error %.3g", step, r / H, r % H, rel);
        }
    }
    for (int b = 0; b < B && !th_failed(); b++) {
        int n[2] = {0, 0};
        for (int w = 0; w < 2; w++) {
            memset(ck[w], 0, cn * 4);
            memset(cv[w], 0, cn * 4);
            TH_CHECK(kvq_seq_read_cache(eng[w], seq[w][b], 0, ck[w], cv[w], maxlen, &n[w]) == KVQ_OK, "read_cache: %s",
                     kvq_engine_errmsg(eng[w]));
        }
        size_t bad = (size_t)-1;
        for (size_t i = 0; i < cn && bad == (size_t)-1; i++)
            if (memcmp(&ck[0][i], &ck[1][i], 4) || memcmp(&cv[0][i], &cv[1][i], 4)) bad = i;
        TH_CHECK(n[0] == n[1] && n[0] == maxlen && bad == (size_t)-1,
                 "item %d: read_cache differs (lengths %d %d; kv head %zu token %zu channel %zu)", b, n[0], n[1],
                 bad / ((size_t)maxlen * D), bad / D % (size_t)maxlen, bad % D);
    }
    kvq_mem_stats ms[2];
    memset(ms, 0, sizeof ms);
    TH_CHECK(th_failed() || (kvq_engine_stats(eng[0], &ms[0]) == KVQ_OK && kvq_engine_stats(eng[1], &ms[1]) == KVQ_OK &&
                             !memcmp(&ms[0], &ms[1], sizeof ms[0])),
             "statistics differ");
    kvq_engine_free(eng[0]);
    kvq_engine_free(eng[1]);
    free(k), free(v), free(q), free(dk), free(dv), free(dq), free(out[0]), free(out[1]);
    free(ck[0]), free(ck[1]), free(cv[0]), free(cv[1]);
    return th_failed() ? -1 : worst;
}

/* Scheme si on `n` shapes from shape `first` (the eight schemes take one each, every shape twice or more: each
 * scheme and shape is an emulator unit of its own, the program's time); shuffle: a KVQ_EMU_SHUFFLE seed (NULL: the emulator's own order). */
static void test_scheme(int si, int first, int n, const char *shuffle, unsigned long long seed)
{
    th_begin("%s vs reference: %s (%s)%s%s, data seed %llu: every decode step within 1e-3, same cache and "
             "statistics",
             BE, schemes[si].name, schemes[si].file, shuffle ? ", KVQ_EMU_SHUFFLE=" : "", shuffle ? shuffle : "", seed);
    if (shuffle) setenv("KVQ_EMU_SHUFFLE", shuffle, 1);
    tu_rng = seed * 0x9e3779b97f4a7c15ull + 1;
    kvq_spec *f = tu_spec_file(schemes[si].file);
    const kvq_scheme *s = f ? kvq_spec_scheme(f, schemes[si].name) : NULL;
    TH_CHECK(s, "scheme");
    for (int r = 0; r < n && !th_failed(); r++) {
        const shape *sh = &shapes[(first + r) % N_SHAPES];
        double w = compare_run(s, sh);
        if (w == -3)
            printf("  %s at head_dim %d: refused by both (no regular channels)\n", schemes[si].name, sh->D);
        else if (w >= 0)
            printf("  %s len %d batch %d gqa %d D %d steps %d: worst relative error %.2e\n", schemes[si].name, sh->len,
                   sh->batch, sh->gqa, sh->D, sh->steps, w);
        else
            printf("  failed at len %d batch %d gqa %d D %d\n", sh->len, sh->batch, sh->gqa, sh->D);
    }
    kvq_spec_free(f);
    unsetenv("KVQ_EMU_SHUFFLE");
    th_end();
}

/* Prod values (Algorithm 2's reconstruction in p.V) are refused by the cuda kernels, naming them. */
static void test_prod_refused(void)
{
    th_begin("%s: turboquant prod values are refused with KVQ_ERR_UNSUPPORTED, naming them", BE);
    kvq_spec *f = tu_spec_text("scheme pv { value { bits 3; turboquant prod seed 2; } }\n");
    const kvq_scheme *s = f ? kvq_spec_scheme(f, "pv") : NULL;
    TH_CHECK(s, "scheme");
    kvq_engine *e = NULL;
    char err[512] = "";
    kvq_status st = s ? make_engine(s, CU_TEST_BACKEND, &shapes[1], &e, err, sizeof err) : KVQ_ERR_INVALID;
    TH_CHECK(st == KVQ_ERR_UNSUPPORTED && strstr(err, "TurboQuant prod values"), "%s: %s", kvq_status_str(st), err);
    kvq_engine_free(e);
    kvq_spec_free(f);
    th_end();
}

int main(void)
{
    kvq_spec *fp = tu_spec_text("scheme f { }");
    char err[512] = "";
    kvq_engine *probe = NULL;
    if (fp) make_engine(kvq_spec_scheme(fp, NULL), CU_TEST_BACKEND, &shapes[3], &probe, err, sizeof err);
    kvq_engine_free(probe);
    kvq_spec_free(fp);
    if (!probe) {
        printf("skipped: %s\n", err);
        return 0;
    }
    const char *env = getenv("KVQ_TEST_SEED");
    unsigned long long seed = env && *env ? strtoull(env, NULL, 10) : (unsigned long long)time(NULL);
    const char *only = getenv("KVQ_TEST_ONLY"); /* a scheme name, to rerun one case */
    for (int i = 0; i < N_SCHEMES; i++)
        if (!only || !strcmp(only, schemes[i].name))
            test_scheme(i, i, only ? N_SHAPES : 1, NULL, seed + (unsigned long long)i);
    if (only) return th_summary();
    /* the outlier split with prod keys at head_dim 64, the emulator's threads in three other orders */
    static const char *const shuffles[] = {"1", "2", "3"};
    for (int i = 0; CU_TEST_BACKEND == KVQ_BACKEND_EMU && i < 3; i++)
        test_scheme(3, 3, 1, shuffles[i], seed + 10 + (unsigned long long)i);
    test_prod_refused();
    return th_summary();
}
