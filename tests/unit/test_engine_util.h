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

#endif
