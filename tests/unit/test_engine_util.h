/* Helpers shared by the engine / reference backend tests (header-only: each test program includes it once). */
#ifndef KVQ_TEST_ENGINE_UTIL_H
#define KVQ_TEST_ENGINE_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "harness.h"
#include "kvq.h"
#include "synth.h"

/* Parses a spec from text; reports diagnostics as failures. */
static inline kvq_spec *tu_spec_text(const char *text)
{
    kvq_spec *s = NULL;
    kvq_status st = kvq_spec_parse_string("<test>", text, strlen(text), &s);
    if (st != KVQ_OK) {
        TH_CHECK(0, "spec does not check (%s):\n%s", kvq_status_str(st), text);
        for (int i = 0; s && i < kvq_spec_diag_count(s); i++) {
            char buf[512];
            kvq_diag_format(kvq_spec_diag(s, i), buf, sizeof buf);
            TH_CHECK(0, "%s", buf);
        }
        kvq_spec_free(s);
        return NULL;
    }
    return s;
}

static inline kvq_spec *tu_spec_file(const char *rel)
{
    kvq_spec *s = NULL;
    kvq_status st = kvq_spec_parse_file(th_path(rel), &s);
    if (st != KVQ_OK) {
        TH_CHECK(0, "%s does not check: %s", rel, kvq_status_str(st));
        kvq_spec_free(s);
        return NULL;
    }
    return s;
}

static inline kvq_engine *tu_engine(const kvq_scheme *sch, int layers, int heads, int kv_heads, int D, kvq_dtype dt)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){layers, heads, kv_heads, D};
    cfg.dtype = dt;
    kvq_engine *e = NULL;
    char err[256];
    kvq_status st = kvq_engine_create(sch, &cfg, &e, err, sizeof err);
    TH_CHECK(st == KVQ_OK, "engine create: %s: %s", kvq_status_str(st), err);
    return e;
}

/* Deterministic uniform values in [-1, 1) (xorshift), rounded to fp16. */
static uint64_t tu_rng = 0x2545f4914f6cdd1dull;
static inline float tu_uniform(void)
{
    tu_rng ^= tu_rng << 13;
    tu_rng ^= tu_rng >> 7;
    tu_rng ^= tu_rng << 17;
    return (float)((double)(tu_rng >> 11) / 4503599627370496.0 - 1.0);
}
static inline void tu_fill(float *x, size_t n, float amp)
{
    for (size_t i = 0; i < n; i++) x[i] = kvq_f16_round(amp * tu_uniform());
}

/* Tokens [t0, t0 + n) of one layer of a synth tensor [layers][heads][tokens][D] as [heads][n][D]. */
static inline void tu_slice(const float *src, int layer, int heads, int tokens, int D, int t0, int n, float *dst)
{
    for (int h = 0; h < heads; h++)
        memcpy(dst + (size_t)h * (size_t)n * (size_t)D,
               src + (((size_t)layer * (size_t)heads + (size_t)h) * (size_t)tokens + (size_t)t0) * (size_t)D,
               (size_t)n * (size_t)D * sizeof(float));
}

/* The plain definition of attention the tests measure against: softmax(q K^T * scale) V in double. */
static inline void tu_exact_attention(const float *q, const float *K, const float *V, int n, int D, double scale, float *out)
{
    double mx = -INFINITY;
    double *w = malloc((size_t)(n > 0 ? n : 1) * sizeof *w);
    for (int t = 0; t < n; t++) {
        double s = 0;
        for (int c = 0; c < D; c++) s += (double)q[c] * K[(size_t)t * D + c];
        w[t] = s * scale;
        if (w[t] > mx) mx = w[t];
    }
    double den = 0;
    for (int t = 0; t < n; t++) den += (w[t] = exp(w[t] - mx));
    for (int c = 0; c < D; c++) {
        double a = 0;
        for (int t = 0; t < n; t++) a += w[t] * V[(size_t)t * D + c];
        out[c] = (float)(a / den);
    }
    free(w);
}

static inline double tu_max_abs_diff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= m)) m = d; /* NaN wins */
    }
    return m;
}

/* How far `out` is from the reference `ref` (n values, one head's output): max |out - ref| over max |ref|, the
 * magnitude floored at `floor` so a near-zero output is not judged relatively. Backends are checked against the
 * reference with this at 1e-3 (NaN when a value is NaN). */
static inline double tu_rel_err(const float *out, const float *ref, size_t n, double floor)
{
    double err = 0, mag = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)out[i] - ref[i]);
        if (!(d <= err)) err = d; /* NaN propagates */
        if (fabs(ref[i]) > mag) mag = fabs(ref[i]);
    }
    return err / (mag > floor ? mag : floor);
}

static inline void tu_to_f16(const float *x, size_t n, uint16_t *out)
{
    for (size_t i = 0; i < n; i++) out[i] = kvq_f16_from_f32(x[i]);
}

/* One synth layer through an engine: a prompt of T tokens, then one decode step with token T (test_turboquant,
 * test_turboquant_split). The engine's memory must equal kvq_scheme_account's; afterwards k, v, q hold the layer
 * ([H][T+1][D], [Hq][T+1][D]), rk, rv what read_cache returns, and worst_self / worst_exact how far the step's
 * output is from attention over rk, rv / over k, v (tu_rel_err). */
typedef struct {
    int kv_heads, heads, tokens, dim; /* the prompt is `tokens` long; the step decodes token `tokens` */
    float *k, *v, *q, *rk, *rv;
    double worst_self, worst_exact;
} tu_prompt_step;

static inline void tu_prompt_step_run(kvq_engine *e, const kvq_scheme *s, const kvq_synth *syn, int layer,
                                      tu_prompt_step *r)
{
    const int H = r->kv_heads, Hq = r->heads, T = r->tokens, D = r->dim;
    size_t nkv = (size_t)H * (T + 1) * D;
    r->k = malloc(nkv * 4), r->v = malloc(nkv * 4), r->q = malloc((size_t)Hq * (T + 1) * D * 4);
    r->rk = malloc(nkv * 4), r->rv = malloc(nkv * 4);
    r->worst_self = r->worst_exact = INFINITY;
    float *pk = malloc((size_t)H * T * D * 4), *pv = malloc((size_t)H * T * D * 4);
    float *dk = malloc((size_t)H * D * 4), *dv = malloc((size_t)H * D * 4), *dq = malloc((size_t)Hq * D * 4);
    float *out = malloc((size_t)Hq * D * 4), *ex = malloc((size_t)D * 4);
    TH_CHECK(r->k && r->v && r->q && r->rk && r->rv && pk && pv && dk && dv && dq && out && ex, "out of memory");
    if (!th_failed()) {
        tu_slice(syn->k, layer, H, T + 1, D, 0, T + 1, r->k);
        tu_slice(syn->v, layer, H, T + 1, D, 0, T + 1, r->v);
        tu_slice(syn->q, layer, Hq, T + 1, D, 0, T + 1, r->q);
        for (int h = 0; h < H; h++) {
            memcpy(pk + (size_t)h * T * D, r->k + (size_t)h * (T + 1) * D, (size_t)T * D * 4);
            memcpy(pv + (size_t)h * T * D, r->v + (size_t)h * (T + 1) * D, (size_t)T * D * 4);
            memcpy(dk + (size_t)h * D, r->k + ((size_t)h * (T + 1) + T) * D, (size_t)D * 4);
            memcpy(dv + (size_t)h * D, r->v + ((size_t)h * (T + 1) + T) * D, (size_t)D * 4);
        }
        for (int h = 0; h < Hq; h++) memcpy(dq + (size_t)h * D, r->q + ((size_t)h * (T + 1) + T) * D, (size_t)D * 4);
    }
    kvq_seq *seq = NULL;
    TH_CHECK(!th_failed() && e && kvq_seq_create(e, &seq) == KVQ_OK, "engine");
    kvq_prefill_item it = {seq, T, pk, pv, NULL};
    TH_CHECK(!th_failed() && kvq_prefill(e, 0, &it, 1) == KVQ_OK, "prefill: %s", e ? kvq_engine_errmsg(e) : "");
    if (!th_failed()) {
        kvq_dims dims = {1, Hq, H, D};
        kvq_mem_stats acc, run;
        TH_CHECK(kvq_scheme_account(s, &dims, 1, T, NULL, &acc) == KVQ_OK && kvq_engine_stats(e, &run) == KVQ_OK,
                 "stats");
        TH_CHECK(acc.device_bytes == run.device_bytes && acc.bytes[KVQ_SEG_PARAMS] == run.bytes[KVQ_SEG_PARAMS],
                 "account %llu bytes (params %llu), engine %llu (params %llu)", (unsigned long long)acc.device_bytes,
                 (unsigned long long)acc.bytes[KVQ_SEG_PARAMS], (unsigned long long)run.device_bytes,
                 (unsigned long long)run.bytes[KVQ_SEG_PARAMS]);
    }
    kvq_decode_item d = {seq, dk, dv, dq, out};
    TH_CHECK(!th_failed() && kvq_decode(e, 0, &d, 1) == KVQ_OK, "decode: %s", e ? kvq_engine_errmsg(e) : "");
    int n = 0;
    TH_CHECK(!th_failed() && kvq_seq_read_cache(e, seq, 0, r->rk, r->rv, T + 1, &n) == KVQ_OK && n == T + 1,
             "read_cache");
    if (!th_failed()) {
        r->worst_self = r->worst_exact = 0;
        for (int h = 0; h < Hq; h++) {
            size_t g = (size_t)(h / (Hq / H)) * (T + 1) * D;
            tu_exact_attention(dq + (size_t)h * D, r->rk + g, r->rv + g, T + 1, D, 1 / sqrt((double)D), ex);
            r->worst_self = fmax(r->worst_self, tu_rel_err(out + (size_t)h * D, ex, D, 1e-3));
            tu_exact_attention(dq + (size_t)h * D, r->k + g, r->v + g, T + 1, D, 1 / sqrt((double)D), ex);
            r->worst_exact = fmax(r->worst_exact, tu_rel_err(out + (size_t)h * D, ex, D, 1e-3));
        }
    }
    free(pk), free(pv), free(dk), free(dv), free(dq), free(out), free(ex);
}

static inline void tu_prompt_step_free(tu_prompt_step *r)
{
    free(r->k), free(r->v), free(r->q), free(r->rk), free(r->rv);
    r->k = r->v = r->q = r->rk = r->rv = NULL;
}

#endif
