/* TurboQuant on the cpu backend (compiler/emit_llvm_turboquant.c) against the reference backend, through the
 * public API: every scheme of specs/rotate/turboquant.kvq, turboquant-2.5bit.kvq and turboquant-3.5bit.kvq (Q_mse
 * values and keys, Q_prod keys with their QJL term, the outlier channel split), on the same inputs in lockstep:
 * every decode step's attention within 1e-3 (relative), the same cache read back (the storage is the
 * reference's), the same statistics. Shapes cover GQA 1, 4 and 8, head_dim 64, 96, 128 and 256, batches whose
 * sequences choose their own outlier channels, decodes that cross the appendable pages' 128-token boundary, and
 * one and two threads; each scheme runs three of them at the host's vector width, and two schemes (prod keys,
 * without and with the split) two of them at 4 lanes. The cuda (emulator) backend's TurboQuant is checked by
 * test_cuda_turboquant. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "test_engine_util.h"

#define KVH 2

typedef struct {
    int len, batch, gqa, D, threads, steps;
} shape;

static const shape shapes[] = {
    {97, 1, 1, 128, 1, 40}, {200, 2, 4, 128, 2, 60}, {17, 3, 8, 96, 2, 6}, {60, 1, 4, 64, 1, 6}, {300, 1, 1, 256, 2, 4},
};
#define N_SHAPES ((int)(sizeof shapes / sizeof shapes[0]))

static const struct {
    const char *file, *name;
} schemes[] = {
    {"specs/rotate/turboquant.kvq", "turboquant-k3v2"},         {"specs/rotate/turboquant.kvq", "turboquant-k4v3"},
    {"specs/rotate/turboquant.kvq", "turboquant-mse3"},         {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-2p5"},
    {"specs/rotate/turboquant-2.5bit.kvq", "turboquant-32x3-96x2"}, {"specs/rotate/turboquant-3.5bit.kvq", "turboquant-3p5"},
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
    cfg.threads = s->threads;
    return kvq_engine_create(sch, &cfg, e, err, n);
}

/* Both backends in lockstep; the worst relative error of a decode output, or -1 when a check failed. */
static double compare_run(const kvq_scheme *sch, const shape *s)
{
    int H = KVH * s->gqa, D = s->D, B = s->batch, maxlen = s->len + s->steps;
    char err[512];
    kvq_engine *eng[2] = {NULL, NULL};
    kvq_status sr = make_engine(sch, KVQ_BACKEND_REFERENCE, s, &eng[0], err, sizeof err);
    kvq_status sc = make_engine(sch, KVQ_BACKEND_CPU, s, &eng[1], err, sizeof err);
    if (sr == KVQ_ERR_SHAPE) { /* a split that leaves no regular channels at this head_dim: both refuse it */
        TH_CHECK(sc == sr, "reference %s, cpu %s (%s)", kvq_status_str(sr), kvq_status_str(sc), err);
        kvq_engine_free(eng[1]);
        return th_failed() ? -1 : -3;
    }
    TH_CHECK(sr == KVQ_OK, "reference: %s: %s", kvq_status_str(sr), err);
    TH_CHECK(sc == KVQ_OK, "cpu: %s: %s", kvq_status_str(sc), err);
    size_t kvn = (size_t)KVH * s->len * D, qn = (size_t)H * s->len * D, one = (size_t)B * KVH * D, oneq = (size_t)B * H * D;
    float *k = malloc(kvn * 4), *v = malloc(kvn * 4), *q = malloc(qn * 4), *dk = malloc(one * 4), *dv = malloc(one * 4);
    float *dq = malloc(oneq * 4), *out[2] = {malloc(oneq * 4), malloc(oneq * 4)};
    size_t cn = (size_t)KVH * maxlen * D;
    float *ck[2] = {malloc(cn * 4), malloc(cn * 4)}, *cv[2] = {malloc(cn * 4), malloc(cn * 4)};
    kvq_seq *seq[2][4] = {{NULL}};
    kvq_decode_item items[4];
    double worst = 0;
    for (int w = 0; w < 2 && !th_failed(); w++)
        for (int b = 0; b < B; b++) TH_CHECK(kvq_seq_create(eng[w], &seq[w][b]) == KVQ_OK, "seq_create");
    for (int b = 0; b < B && !th_failed(); b++) {
        /* each sequence its own prompt: its own outlier channels (channel c scaled by 1 + 3 (c mod 5 = b)) */
        tu_fill(k, kvn, 1.5f);
        tu_fill(v, kvn, 1.0f);
        tu_fill(q, qn, 3.0f);
        for (size_t i = 0; i < kvn; i++)
            if ((int)(i % (size_t)D) % 5 == b) k[i] *= 4.0f, v[i] *= 3.0f;
        for (int w = 0; w < 2 && !th_failed(); w++) {
            kvq_prefill_item it = {seq[w][b], s->len, k, v, q};
            TH_CHECK(kvq_prefill(eng[w], 0, &it, 1) == KVQ_OK, "%s prefill: %s", w ? "cpu" : "ref",
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
            TH_CHECK(kvq_decode(eng[w], 0, items, B) == KVQ_OK, "%s decode step %d: %s", w ? "cpu" : "ref", step,
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
            TH_CHECK(kvq_seq_read_cache(eng[w], seq[w][b], 0, ck[w], cv[w], maxlen, &n[w]) == KVQ_OK, "read_cache");
        }
        TH_CHECK(n[0] == n[1] && !memcmp(ck[0], ck[1], cn * 4) && !memcmp(cv[0], cv[1], cn * 4),
                 "item %d: read_cache differs", b);
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

/* Scheme si on `n` of the shapes, starting at shape `first` (every shape meets several schemes; the TurboQuant
 * code paths are few: mse rows, prod's QJL term, one or two parts). */
static void test_scheme(int si, const char *width, int first, int n)
{
    th_begin("cpu vs reference: %s (%s)%s%s: every decode step within 1e-3, same cache and statistics",
             schemes[si].name, schemes[si].file, width ? " at vector width " : "", width ? width : "");
    kvq_spec *f = tu_spec_file(schemes[si].file);
    const kvq_scheme *s = f ? kvq_spec_scheme(f, schemes[si].name) : NULL;
    TH_CHECK(s, "scheme");
    for (int r = 0; r < n && !th_failed(); r++) {
        const shape *sh = &shapes[(first + r) % N_SHAPES];
        double w = compare_run(s, sh);
        if (w == -3)
            printf("  %s at head_dim %d: refused by both (%s)\n", schemes[si].name, sh->D, "no regular channels");
        else if (w >= 0)
            printf("  %s len %d batch %d gqa %d D %d threads %d steps %d: worst relative error %.2e\n", schemes[si].name,
                   sh->len, sh->batch, sh->gqa, sh->D, sh->threads, sh->steps, w);
        else
            printf("  failed at len %d batch %d gqa %d D %d threads %d\n", sh->len, sh->batch, sh->gqa, sh->D,
                   sh->threads);
    }
    kvq_spec_free(f);
    th_end();
}

/* Whether this build has the cpu backend (LLVM); else every case is a SKIP with the reason. */
static int cpu_available(char *why, size_t n)
{
    kvq_spec *f = tu_spec_text("scheme p { bits 4; }\n");
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){1, 2, 2, 64};
    cfg.backend = KVQ_BACKEND_CPU;
    kvq_engine *e = NULL;
    kvq_status st = f ? kvq_engine_create(kvq_spec_scheme(f, "p"), &cfg, &e, why, n) : KVQ_ERR_INVALID;
    kvq_engine_free(e);
    kvq_spec_free(f);
    return st != KVQ_ERR_UNAVAILABLE;
}

int main(void)
{
    char why[256] = "";
    if (!cpu_available(why, sizeof why)) {
        for (int i = 0; i < N_SCHEMES; i++) printf("SKIP cpu vs reference: %s: %s\n", schemes[i].name, why);
        return th_summary();
    }
    for (int i = 0; i < N_SCHEMES; i++) test_scheme(i, NULL, i, 3);
    /* the 4-lane vectors (SSE) on a wider host: the other lane layout of the codes and the QJL signs (prod keys
     * without and with the split) */
    if (setenv("KVQ_CPU_VECTOR_WIDTH", "4", 1) == 0) {
        test_scheme(0, "4", 0, 2);
        test_scheme(5, "4", 2, 2); /* head_dim 96, and 64: no regular channels, refused by both */
    }
    unsetenv("KVQ_CPU_VECTOR_WIDTH");
    return th_summary();
}
