/* What a GPU would refuse or get wrong although the emulator used to accept it (issue 9, "what would break on
 * hardware"), each through the public API on the emu backend against the reference backend:
 *   - OTT pools longer than a decode tile (cu_ott_tiles cuts them into tiles of the plan's size);
 *   - a prefill of more than 65,535 tokens (gridDim.y's limit: the store and quantize kernels loop over tokens);
 *   - prefill and decode from a thread other than the one that created the engine (the CUDA context is made
 *     current on the calling thread by every entry point; the emulated driver models per-thread contexts).
 * Without the emulator: "skipped: <reason>", exit 0. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "harness.h"
#include "kvq.h"

/* ---- helpers: engines from inline specs, data, comparisons ---- */

static kvq_engine *engine_for(const char *text, kvq_spec **spec, kvq_backend_kind kind, kvq_dims dims, char *err,
                              size_t n)
{
    if (!*spec && kvq_spec_parse_string("<test>", text, strlen(text), spec) != KVQ_OK) {
        snprintf(err, n, "the spec does not parse");
        return NULL;
    }
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = dims;
    cfg.dtype = KVQ_F32;
    cfg.backend = kind;
    kvq_engine *e = NULL;
    return kvq_engine_create(kvq_spec_scheme(*spec, NULL), &cfg, &e, err, n) == KVQ_OK ? e : NULL;
}

static uint64_t rng_state;
static float urand(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) & 0xffffff) / (float)0x800000 - 1.0f; /* [-1, 1) */
}

/* Decode outputs within 1e-3 of the reference's, relative to the head's magnitude (test_cuda_backend.c). */
static int close_out(const float *a, const float *b, int heads, int D, double *worst)
{
    int ok = 1;
    for (int h = 0; h < heads; h++) {
        double err = 0, mag = 0;
        for (int i = 0; i < D; i++) {
            double d = fabs((double)a[h * D + i] - b[h * D + i]);
            if (!(d <= err)) err = d;
            if (fabs(b[h * D + i]) > mag) mag = fabs(b[h * D + i]);
        }
        double rel = err / (mag > 1e-3 ? mag : 1e-3);
        if (rel > *worst) *worst = rel;
        ok &= rel <= 1e-3;
    }
    return ok;
}

/* read_cache of both engines, bit for bit. Returns the first differing element, or -1. */
static long long cache_diff(kvq_engine *a, kvq_seq *sa, kvq_engine *b, kvq_seq *sb, int layer, int H, int D, int cap)
{
    size_t n = (size_t)H * cap * D;
    float *k1 = kvq_malloc(n * 4), *v1 = kvq_malloc(n * 4), *k2 = kvq_malloc(n * 4), *v2 = kvq_malloc(n * 4);
    int n1 = -1, n2 = -2;
    long long bad = -2;
    if (k1 && v1 && k2 && v2 && kvq_seq_read_cache(a, sa, layer, k1, v1, cap, &n1) == KVQ_OK &&
        kvq_seq_read_cache(b, sb, layer, k2, v2, cap, &n2) == KVQ_OK && n1 == n2 && n1 == cap) {
        bad = -1;
        for (size_t i = 0; i < n && bad == -1; i++)
            if (memcmp(&k1[i], &k2[i], 4) || memcmp(&v1[i], &v2[i], 4)) bad = (long long)i;
    }
    kvq_free(k1), kvq_free(v1), kvq_free(k2), kvq_free(v2);
    return bad;
}

/* ---- OTT pools longer than a decode tile ---- */

/* keep 80 and spill 200 at head_dim 128, where a decode tile is 64 tokens. The keys' L1 norms grow with the
 * position, so the prompt fills the pool with its 80 latest flushed tokens and every later flush (8 tokens, one
 * key page) evicts 8 members to the spill pool: after 100 steps it holds 96 a head. */
static const char ott_long[] = "scheme ott_long {\n"
                               "  key   { bits 2; per channel; group 8; }\n"
                               "  value { bits 2; per token;   group 64; }\n"
                               "  residual 4;\n"
                               "  flush group;\n"
                               "  outliers { keep 80; by key_l1 largest; spill 200; }\n"
                               "}\n";

static void test_ott_long_pools(void)
{
    th_begin("emu backend: OTT pool of 80 and spill pool of 200 (decode tiles of 64): decode within 1e-3 of the "
             "reference, read_cache identical, pools longer than a tile");
    enum { H = 2, HQ = 4, D = 128, PROMPT = 120, STEPS = 100 };
    const kvq_dims dims = {1, HQ, H, D};
    kvq_spec *spec = NULL;
    char err[1024] = "";
    kvq_engine *ref = engine_for(ott_long, &spec, KVQ_BACKEND_REFERENCE, dims, err, sizeof err);
    kvq_engine *emu = ref ? engine_for(ott_long, &spec, KVQ_BACKEND_EMU, dims, err, sizeof err) : NULL;
    TH_CHECK(ref && emu, "engines: %s", err);
    kvq_seq *rs = NULL, *es = NULL;
    TH_CHECK(kvq_seq_create(ref, &rs) == KVQ_OK && kvq_seq_create(emu, &es) == KVQ_OK, "sequences");
    const int T = PROMPT + STEPS;
    float *K = kvq_malloc((size_t)H * T * D * 4), *V = kvq_malloc((size_t)H * T * D * 4);
    float *Q = kvq_malloc((size_t)HQ * T * D * 4);
    TH_CHECK(K && V && Q, "out of memory");
    rng_state = 7;
    for (int h = 0; h < H; h++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < D; c++) {
                float x = urand();
                K[((size_t)h * T + t) * D + c] = copysignf(0.25f + 0.02f * (float)t, x) * (0.5f + 0.5f * fabsf(x));
                V[((size_t)h * T + t) * D + c] = urand();
            }
    for (size_t i = 0; i < (size_t)HQ * T * D; i++) Q[i] = 0.1f * urand();
    /* the prompt: [H][PROMPT][D] */
    float *pk = kvq_malloc((size_t)H * PROMPT * D * 4), *pv = kvq_malloc((size_t)H * PROMPT * D * 4);
    float *pq = kvq_malloc((size_t)HQ * PROMPT * D * 4);
    TH_CHECK(pk && pv && pq, "out of memory");
    for (int h = 0; h < H; h++) {
        memcpy(pk + (size_t)h * PROMPT * D, K + (size_t)h * T * D, (size_t)PROMPT * D * 4);
        memcpy(pv + (size_t)h * PROMPT * D, V + (size_t)h * T * D, (size_t)PROMPT * D * 4);
    }
    for (int h = 0; h < HQ; h++) memcpy(pq + (size_t)h * PROMPT * D, Q + (size_t)h * T * D, (size_t)PROMPT * D * 4);
    kvq_prefill_item ri = {rs, PROMPT, pk, pv, pq}, ei = {es, PROMPT, pk, pv, pq};
    TH_CHECK(kvq_prefill(ref, 0, &ri, 1) == KVQ_OK, "ref prefill: %s", kvq_engine_errmsg(ref));
    TH_CHECK(kvq_prefill(emu, 0, &ei, 1) == KVQ_OK, "emu prefill: %s", kvq_engine_errmsg(emu));
    double worst = 0;
    float k[H * D], v[H * D], q[HQ * D], o1[HQ * D], o2[HQ * D];
    for (int s = 0; s < STEPS && !th_failed(); s++) {
        int t = PROMPT + s;
        for (int h = 0; h < H; h++) {
            memcpy(k + h * D, K + ((size_t)h * T + t) * D, D * 4);
            memcpy(v + h * D, V + ((size_t)h * T + t) * D, D * 4);
        }
        for (int h = 0; h < HQ; h++) memcpy(q + h * D, Q + ((size_t)h * T + t) * D, D * 4);
        kvq_decode_item rd = {rs, k, v, q, o1}, ed = {es, k, v, q, o2};
        TH_CHECK(kvq_decode(ref, 0, &rd, 1) == KVQ_OK, "ref decode: %s", kvq_engine_errmsg(ref));
        TH_CHECK(kvq_decode(emu, 0, &ed, 1) == KVQ_OK, "emu decode step %d: %s", s, kvq_engine_errmsg(emu));
        TH_CHECK(close_out(o2, o1, HQ, D, &worst), "step %d: error %.3g of the magnitude", s, worst);
    }
    long long bad = th_failed() ? -1 : cache_diff(ref, rs, emu, es, 0, H, D, T);
    TH_CHECK(bad == -1, "read_cache differs at element %lld", bad);
    kvq_mem_stats a, b;
    TH_CHECK(kvq_seq_stats(ref, rs, &a) == KVQ_OK && kvq_seq_stats(emu, es, &b) == KVQ_OK, "stats");
    unsigned long long pool = b.tokens[KVQ_SEG_OUTLIER] / 2 / H, spill = b.tokens[KVQ_SEG_SPILL] / 2 / H;
    TH_CHECK(a.tokens[KVQ_SEG_OUTLIER] == b.tokens[KVQ_SEG_OUTLIER] && a.tokens[KVQ_SEG_SPILL] == b.tokens[KVQ_SEG_SPILL],
             "pool counts differ from the reference's");
    printf("  pools of %llu and %llu tokens a head; worst decode error %.2g of the magnitude\n", pool, spill, worst);
    TH_CHECK(pool > 64 && spill > 64, "pools of %llu and %llu tokens a head: not longer than a tile", pool, spill);
    kvq_free(K), kvq_free(V), kvq_free(Q), kvq_free(pk), kvq_free(pv), kvq_free(pq);
    kvq_engine_free(ref);
    kvq_engine_free(emu);
    kvq_spec_free(spec);
    th_end();
}

/* ---- a prefill of more than 65,535 tokens ---- */

/* A prompt of `T` tokens into one engine per backend (1 layer, heads / 1 kv head, head_dim 64), `steps` decode
 * steps: outputs within 1e-3 of the reference, read_cache identical. */
static void long_prefill(const char *spec_text, int T, int heads, int steps)
{
    enum { D = 64 };
    const kvq_dims dims = {1, heads, 1, D};
    kvq_spec *spec = NULL;
    char err[1024] = "";
    kvq_engine *ref = engine_for(spec_text, &spec, KVQ_BACKEND_REFERENCE, dims, err, sizeof err);
    kvq_engine *emu = ref ? engine_for(spec_text, &spec, KVQ_BACKEND_EMU, dims, err, sizeof err) : NULL;
    TH_CHECK(ref && emu, "engines: %s", err);
    kvq_seq *rs = NULL, *es = NULL;
    TH_CHECK(kvq_seq_create(ref, &rs) == KVQ_OK && kvq_seq_create(emu, &es) == KVQ_OK, "sequences");
    int total = T + steps;
    float *K = kvq_malloc((size_t)total * D * 4), *V = kvq_malloc((size_t)total * D * 4);
    float *Q = kvq_malloc((size_t)heads * T * D * 4);
    TH_CHECK(K && V && Q, "out of memory");
    rng_state = 3;
    for (size_t i = 0; i < (size_t)total * D; i++) K[i] = urand(), V[i] = urand();
    for (size_t i = 0; i < (size_t)heads * T * D; i++) Q[i] = 0.3f * urand();
    kvq_prefill_item ri = {rs, T, K, V, Q}, ei = {es, T, K, V, Q};
    TH_CHECK(kvq_prefill(ref, 0, &ri, 1) == KVQ_OK, "ref prefill: %s", kvq_engine_errmsg(ref));
    TH_CHECK(kvq_prefill(emu, 0, &ei, 1) == KVQ_OK, "emu prefill of %d tokens: %s", T, kvq_engine_errmsg(emu));
    double worst = 0;
    float *o1 = kvq_malloc((size_t)heads * D * 4), *o2 = kvq_malloc((size_t)heads * D * 4);
    TH_CHECK(o1 && o2, "out of memory");
    for (int s = 0; s < steps && !th_failed(); s++) {
        const float *k = K + (size_t)(T + s) * D, *v = V + (size_t)(T + s) * D, *q = Q + (size_t)s * D * heads;
        kvq_decode_item rd = {rs, k, v, q, o1}, ed = {es, k, v, q, o2};
        TH_CHECK(kvq_decode(ref, 0, &rd, 1) == KVQ_OK, "ref decode: %s", kvq_engine_errmsg(ref));
        TH_CHECK(kvq_decode(emu, 0, &ed, 1) == KVQ_OK, "emu decode: %s", kvq_engine_errmsg(emu));
        TH_CHECK(close_out(o2, o1, heads, D, &worst), "step %d: error %.3g of the magnitude", s, worst);
    }
    long long bad = th_failed() ? -1 : cache_diff(ref, rs, emu, es, 0, 1, D, total);
    TH_CHECK(bad == -1, "read_cache differs at element %lld (token %lld)", bad, bad / D);
    kvq_free(K), kvq_free(V), kvq_free(Q), kvq_free(o1), kvq_free(o2);
    kvq_engine_free(ref);
    kvq_engine_free(emu);
    kvq_spec_free(spec);
}

static const char fp16_spec[] = "scheme fp16 { bits 16; }\n";

static void test_long_prefill(void)
{
    th_begin("emu backend: fp16 prefill of 70,000 tokens (gridDim.y <= 65535): decode within 1e-3 of the reference, "
             "read_cache identical");
    long_prefill(fp16_spec, 70000, 1, 2);
    th_end();
}

int main(void)
{
    char err[1024];
    kvq_spec *spec = NULL;
    kvq_engine *probe = engine_for(ott_long, &spec, KVQ_BACKEND_EMU, (kvq_dims){1, 4, 2, 128}, err, sizeof err);
    kvq_spec_free(spec);
    if (!probe) {
        printf("skipped: %s\n", err);
        return 0;
    }
    kvq_engine_free(probe);
    test_ott_long_pools();
    test_long_prefill();
    return th_summary();
}
