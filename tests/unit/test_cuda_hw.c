/* What a GPU would refuse or get wrong although the emulator used to accept it (issue 9, "what would break on
 * hardware"), through the public API on the emu backend against the reference backend:
 *   - OTT pools longer than a decode tile (cu_ott_tiles cuts them into tiles of the plan's size);
 *   - a prefill of more than 65,535 tokens (gridDim.y's limit: the store and quantize kernels loop over tokens);
 *   - prefill, decode, read_cache and freeing from a thread other than the one that created the engine (every
 *     entry point makes the device's context current on the calling thread);
 * and through the emulated driver (cu_dev.h): its per-thread contexts, and the limits the driver enforces with
 * the kernels' resources from ptxas (static shared memory, the dynamic shared memory attribute and the opt-in
 * maximum, registers a block). Without the emulator: "skipped: <reason>", exit 0. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cuda/cu.h"
#include "cuda/cu_dev.h"
#include "emit_cuda.h"
#include "harness.h"
#include "kvq.h"
#include "kvq_params.cuh"
#include "plan.h"
#include "scheme.h"
#include "test_engine_util.h"

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
        double rel = tu_rel_err(a + (size_t)h * D, b + (size_t)h * D, (size_t)D, 1e-3);
        if (!(rel <= *worst)) *worst = rel;
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

/* ---- entry points called from another thread ---- */

typedef struct {
    kvq_engine *emu;
    kvq_seq *seq;
    const kvq_prefill_item *pre;
    kvq_decode_item *dec;
    int steps;
    float *k, *v; /* read_cache */
    int cap, n;
    kvq_status st;
    char msg[512];
} thread_job;

static void *run_job(void *arg)
{
    thread_job *j = arg;
    kvq_prefill_item it = *j->pre;
    it.seq = j->seq;
    j->st = kvq_prefill(j->emu, 0, &it, 1);
    for (int s = 0; s < j->steps && j->st == KVQ_OK; s++) {
        kvq_decode_item d = j->dec[s];
        d.seq = j->seq;
        j->st = kvq_decode(j->emu, 0, &d, 1);
    }
    if (j->st == KVQ_OK) j->st = kvq_seq_read_cache(j->emu, j->seq, 0, j->k, j->v, j->cap, &j->n);
    if (j->st != KVQ_OK) snprintf(j->msg, sizeof j->msg, "%s", kvq_engine_errmsg(j->emu));
    kvq_seq_free(j->emu, j->seq); /* device memory freed on this thread too */
    j->seq = NULL;
    return NULL;
}

static void test_other_thread(void)
{
    th_begin("emu backend: an engine created on one thread, prefilled, decoded, read and freed on another: the "
             "reference's outputs and cache");
    enum { H = 2, HQ = 4, D = 64, T = 40, STEPS = 5 };
    static const char kivi[] = "scheme k { key { bits 2; per channel; group 32; } value { bits 2; per token; group 32; } "
                               "residual 32; }\n";
    const kvq_dims dims = {1, HQ, H, D};
    kvq_spec *spec = NULL;
    char err[1024] = "";
    kvq_engine *ref = engine_for(kivi, &spec, KVQ_BACKEND_REFERENCE, dims, err, sizeof err);
    kvq_engine *emu = ref ? engine_for(kivi, &spec, KVQ_BACKEND_EMU, dims, err, sizeof err) : NULL;
    TH_CHECK(ref && emu, "engines: %s", err);
    int total = T + STEPS;
    float *K = kvq_malloc((size_t)H * T * D * 4), *V = kvq_malloc((size_t)H * T * D * 4);
    float *Q = kvq_malloc((size_t)HQ * T * D * 4), *step = kvq_malloc((size_t)STEPS * (2 * H + 3 * HQ) * D * 4);
    float *k1 = kvq_malloc((size_t)H * total * D * 4), *v1 = kvq_malloc((size_t)H * total * D * 4);
    float *k2 = kvq_malloc((size_t)H * total * D * 4), *v2 = kvq_malloc((size_t)H * total * D * 4);
    TH_CHECK(K && V && Q && step && k1 && v1 && k2 && v2, "out of memory");
    rng_state = 5;
    for (size_t i = 0; i < (size_t)H * T * D; i++) K[i] = urand(), V[i] = urand();
    for (size_t i = 0; i < (size_t)HQ * T * D; i++) Q[i] = 0.3f * urand();
    kvq_decode_item rd[STEPS], ed[STEPS];
    for (int s = 0; s < STEPS; s++) {
        float *b = step + (size_t)s * (2 * H + 3 * HQ) * D;
        for (int i = 0; i < (2 * H + HQ) * D; i++) b[i] = urand();
        rd[s] = (kvq_decode_item){NULL, b, b + H * D, b + 2 * H * D, b + (2 * H + HQ) * D};
        ed[s] = (kvq_decode_item){NULL, b, b + H * D, b + 2 * H * D, b + (2 * H + 2 * HQ) * D};
    }
    kvq_seq *rs = NULL, *es = NULL;
    TH_CHECK(kvq_seq_create(ref, &rs) == KVQ_OK && kvq_seq_create(emu, &es) == KVQ_OK, "sequences");
    kvq_prefill_item pre = {rs, T, K, V, Q};
    TH_CHECK(kvq_prefill(ref, 0, &pre, 1) == KVQ_OK, "ref prefill");
    for (int s = 0; s < STEPS; s++) {
        rd[s].seq = rs;
        TH_CHECK(kvq_decode(ref, 0, &rd[s], 1) == KVQ_OK, "ref decode");
    }
    int n1 = 0;
    TH_CHECK(kvq_seq_read_cache(ref, rs, 0, k1, v1, total, &n1) == KVQ_OK, "ref read");
    thread_job j = {emu, es, &pre, ed, STEPS, k2, v2, total, 0, KVQ_OK, ""};
    pthread_t th;
    TH_CHECK(pthread_create(&th, NULL, run_job, &j) == 0, "pthread_create");
    pthread_join(th, NULL);
    TH_CHECK(j.st == KVQ_OK, "on the other thread: %s", j.msg);
    double worst = 0;
    for (int s = 0; s < STEPS; s++)
        TH_CHECK(close_out(ed[s].out, rd[s].out, HQ, D, &worst), "step %d: error %.3g of the magnitude", s, worst);
    TH_CHECK(j.n == n1 && memcmp(k1, k2, (size_t)H * n1 * D * 4) == 0 && memcmp(v1, v2, (size_t)H * n1 * D * 4) == 0,
             "read_cache differs from the reference's");
    /* and back on the creating thread */
    kvq_seq *es2 = NULL;
    TH_CHECK(kvq_seq_create(emu, &es2) == KVQ_OK, "sequence");
    pre.seq = es2;
    TH_CHECK(kvq_prefill(emu, 0, &pre, 1) == KVQ_OK, "prefill on the creating thread: %s", kvq_engine_errmsg(emu));
    kvq_seq_free(emu, es2);
    kvq_free(K), kvq_free(V), kvq_free(Q), kvq_free(step), kvq_free(k1), kvq_free(v1), kvq_free(k2), kvq_free(v2);
    kvq_engine_free(ref);
    kvq_engine_free(emu);
    kvq_spec_free(spec);
    th_end();
}

/* ---- ZipCache's classes on near-ties ---- */

/* Every decode token's key is the same vector but for 16 "quiet" channels (where every query is about 1e-4), each
 * moved by one fp16 ulp up or down, so the tokens' saliencies differ in their last bits and which are salient is
 * decided by rounding: the device must compute the probe rows exactly as the reference does (docs/cuda.md
 * "Determinism"). With the decode kernel's fp32 lse and exp2 (before), a class differed at step 54. */
static const char zip_ties[] = "scheme zt {\n"
                               "  key   { per channel; group all; }\n"
                               "  value { per token; channel_separable; group hidden; }\n"
                               "  residual 2;\n"
                               "  saliency normalized { probes recent 50% random 50%; salient 50% bits 4; rest bits 2; "
                               "every 6; }\n"
                               "}\n";

static void test_zip_near_ties(void)
{
    th_begin("emu backend: ZipCache classes on constructed near-ties (keys one fp16 ulp apart in channels the "
             "queries barely see): decode and read_cache as the reference's over 10 compressions");
    enum { H = 1, HQ = 2, D = 64, PROMPT = 16, STEPS = 60, QUIET = 16 };
    const kvq_dims dims = {1, HQ, H, D};
    kvq_spec *spec = NULL;
    char err[1024] = "";
    kvq_engine *ref = engine_for(zip_ties, &spec, KVQ_BACKEND_REFERENCE, dims, err, sizeof err);
    kvq_engine *emu = ref ? engine_for(zip_ties, &spec, KVQ_BACKEND_EMU, dims, err, sizeof err) : NULL;
    TH_CHECK(ref && emu, "engines: %s", err);
    const int T = PROMPT + STEPS;
    float *K = kvq_malloc((size_t)T * D * 4), *V = kvq_malloc((size_t)T * D * 4), *Q = kvq_malloc((size_t)HQ * T * D * 4);
    TH_CHECK(K && V && Q, "out of memory");
    rng_state = 17;
    float base[D];
    for (int c = 0; c < D; c++) /* fp16 values in [1, 2): one ulp is 2^-10 */
        base[c] = copysignf(1.0f + (float)(int)((urand() + 1.0f) * 511.0f) / 1024.0f, urand());
    for (int t = 0; t < T; t++) {
        for (int c = 0; c < D; c++) K[(size_t)t * D + c] = t < PROMPT ? urand() : base[c], V[(size_t)t * D + c] = urand();
        if (t >= PROMPT)
            for (int c = 0; c < QUIET; c++) K[(size_t)t * D + c] += (urand() < 0 ? -1.0f : 1.0f) / 1024.0f;
    }
    for (int h = 0; h < HQ; h++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < D; c++) Q[((size_t)h * T + t) * D + c] = c < QUIET ? 1e-4f * urand() : 0.5f * urand();
    kvq_seq *rs = NULL, *es = NULL;
    TH_CHECK(kvq_seq_create(ref, &rs) == KVQ_OK && kvq_seq_create(emu, &es) == KVQ_OK, "sequences");
    float *pq = kvq_malloc((size_t)HQ * PROMPT * D * 4);
    TH_CHECK(pq != NULL, "out of memory");
    for (int h = 0; h < HQ; h++) memcpy(pq + (size_t)h * PROMPT * D, Q + (size_t)h * T * D, (size_t)PROMPT * D * 4);
    kvq_prefill_item ri = {rs, PROMPT, K, V, pq}, ei = {es, PROMPT, K, V, pq};
    TH_CHECK(kvq_prefill(ref, 0, &ri, 1) == KVQ_OK, "ref prefill: %s", kvq_engine_errmsg(ref));
    TH_CHECK(kvq_prefill(emu, 0, &ei, 1) == KVQ_OK, "emu prefill: %s", kvq_engine_errmsg(emu));
    float q[HQ * D], o1[HQ * D], o2[HQ * D];
    double worst = 0;
    for (int s = 0; s < STEPS && !th_failed(); s++) {
        int t = PROMPT + s;
        for (int h = 0; h < HQ; h++) memcpy(q + h * D, Q + ((size_t)h * T + t) * D, D * 4);
        kvq_decode_item rd = {rs, K + (size_t)t * D, V + (size_t)t * D, q, o1}, ed = {es, K + (size_t)t * D,
                                                                                    V + (size_t)t * D, q, o2};
        TH_CHECK(kvq_decode(ref, 0, &rd, 1) == KVQ_OK, "ref decode: %s", kvq_engine_errmsg(ref));
        TH_CHECK(kvq_decode(emu, 0, &ed, 1) == KVQ_OK, "emu decode: %s", kvq_engine_errmsg(emu));
        TH_CHECK(close_out(o2, o1, HQ, D, &worst), "step %d: error %.3g of the magnitude", s, worst);
    }
    long long bad = th_failed() ? -1 : cache_diff(ref, rs, emu, es, 0, H, D, T);
    TH_CHECK(bad == -1, "read_cache differs at token %lld channel %lld: a class differs from the reference's", bad / D,
             bad % D);
    kvq_free(K), kvq_free(V), kvq_free(Q), kvq_free(pq);
    kvq_engine_free(ref);
    kvq_engine_free(emu);
    kvq_spec_free(spec);
    th_end();
}

/* ---- the emulated driver ---- */

static void *alloc_on_thread(void *arg)
{
    cu_dev *d = arg;
    static char msg[512];
    uint64_t a = 0;
    kvq_status st = cu_dev_alloc(d, 64, &a, msg, sizeof msg);
    if (st == KVQ_OK) cu_dev_free(d, a);
    return st == KVQ_OK ? NULL : msg;
}

static void *alloc_entered(void *arg)
{
    cu_dev *d = arg;
    cu_ctx_scope s;
    cu_dev_enter(d, &s);
    void *r = alloc_on_thread(d);
    cu_dev_leave(d, &s);
    void *after = alloc_on_thread(d); /* the thread's previous (no) context is back */
    return r ? r : after ? NULL : (void *)"allocated after cu_dev_leave";
}

static void test_contexts(cu_dev *d)
{
    th_begin("emulated driver: the device's context is current on the opening thread only; cu_dev_enter makes it "
             "current on another, cu_dev_leave takes it back");
    pthread_t th;
    void *r = NULL;
    TH_CHECK(pthread_create(&th, NULL, alloc_on_thread, d) == 0, "pthread_create");
    pthread_join(th, &r);
    TH_CHECK(r && strstr((const char *)r, "CUDA_ERROR_INVALID_CONTEXT"), "allocation on another thread: %s",
             r ? (const char *)r : "succeeded");
    r = (void *)"?";
    TH_CHECK(pthread_create(&th, NULL, alloc_entered, d) == 0, "pthread_create");
    pthread_join(th, &r);
    TH_CHECK(r == NULL, "with cu_dev_enter: %s", (const char *)r);
    TH_CHECK(alloc_on_thread(d) == NULL, "the opening thread lost its context");
    th_end();
}

/* A unit that compiles as CUDA (NVRTC) and for the emulator, without include paths under NVRTC. */
static const char small_src[] =
    "#ifdef __CUDACC_RTC__\n"
    "#define EXPORT(n) static_assert(true, #n)\n"
    "#define DYN(t, n) extern __shared__ t n[]\n"
    "#else\n"
    "#include \"kvq_intrin.cuh\"\n"
    "#define EXPORT(n) KVQ_KERNEL_EXPORT(n)\n"
    "#define DYN(t, n) KVQ_DYNAMIC_SHARED(t, n)\n"
    "#endif\n"
    "struct hw_params { unsigned long long out; int n, pad; };\n"
    "extern \"C\" __global__ void hw_static(const struct hw_params p)\n"
    "{\n"
    "    __shared__ float s[STATIC_FLOATS];\n"
    "    for (int i = threadIdx.x; i < STATIC_FLOATS; i += blockDim.x) s[i] = (float)i;\n"
    "    __syncthreads();\n"
    "    if (threadIdx.x == 0) ((float *)p.out)[0] = s[STATIC_FLOATS - 1];\n"
    "}\n"
    "EXPORT(hw_static);\n"
    "extern \"C\" __global__ void hw_dyn(const struct hw_params p)\n"
    "{\n"
    "    DYN(float, d);\n"
    "    for (int i = threadIdx.x; i < p.n; i += blockDim.x) d[i] = (float)i;\n"
    "    __syncthreads();\n"
    "    if (threadIdx.x == 0) ((float *)p.out)[1] = d[p.n - 1];\n"
    "}\n"
    "EXPORT(hw_dyn);\n";

typedef struct {
    unsigned long long out;
    int n, pad;
} hw_params;

static kvq_status load_small(cu_dev *d, int static_floats, cu_module **m, char *msg, size_t n)
{
    char src[4096];
    snprintf(src, sizeof src, "#define STATIC_FLOATS %d\n%s", static_floats, small_src);
    return cu_dev_load(d, src, NULL, m, msg, n);
}

static void test_shared_memory(cu_dev *d)
{
    char why[256];
    if (cu_nvrtc_load(why, sizeof why) != KVQ_OK) {
        printf("SKIP emulated driver shared memory limits: %s\n", why);
        return;
    }
    th_begin("emulated driver: static shared memory (48 KiB), dynamic shared memory (48 KiB, the attribute, sm_90's "
             "227 KiB) as the driver checks them, with ptxas's figures");
    char msg[2048] = "";
    cu_module *m = NULL;
    /* 48 KiB + 4 bytes of static shared memory: ptxas refuses the kernel, so the emulated GPU does too */
    kvq_status st = load_small(d, 12289, &m, msg, sizeof msg);
    TH_CHECK(st != KVQ_OK && strstr(msg, "sm_90") && strstr(msg, "hw_static") && strstr(msg, "static shared memory"),
             "a kernel with 49156 bytes of static shared memory loaded (%s)", msg);
    cu_module_free(m);
    m = NULL;
    TH_CHECK(load_small(d, 12288, &m, msg, sizeof msg) == KVQ_OK, "48 KiB of static shared memory: %s", msg);
    float out[2] = {0, 0};
    hw_params p = {(unsigned long long)(uintptr_t)out, 0, 0};
    const unsigned one[3] = {1, 1, 1}, blk[3] = {128, 1, 1};
    TH_CHECK(m && cu_dev_launch(d, m, "hw_static", one, blk, &p, sizeof p, msg, sizeof msg) == KVQ_OK, "%s", msg);
    TH_CHECK(out[0] == 12287.0f, "static: %g", out[0]);
    /* dynamic: 48 KiB by default, up to the attribute, the attribute up to the device's 227 KiB */
    p.n = 12288;
    TH_CHECK(m && cu_dev_launch_smem(d, m, "hw_dyn", one, blk, 48 * 1024, &p, sizeof p, msg, sizeof msg) == KVQ_OK,
             "48 KiB dynamic: %s", msg);
    TH_CHECK(out[1] == 12287.0f, "dynamic: %g", out[1]);
    st = m ? cu_dev_launch_smem(d, m, "hw_dyn", one, blk, 48 * 1024 + 4, &p, sizeof p, msg, sizeof msg)
           : KVQ_ERR_INTERNAL;
    TH_CHECK(st == KVQ_ERR_INTERNAL && strstr(msg, "hw_dyn") && strstr(msg, "49156") &&
                 strstr(msg, "CUDA_ERROR_INVALID_VALUE"),
             "48 KiB + 4 dynamic without the attribute: %s", st == KVQ_OK ? "launched" : msg);
    TH_CHECK(m && cu_dev_func_max_dyn_smem(d, m, "hw_dyn", 200 * 1024, msg, sizeof msg) == KVQ_OK, "attribute: %s",
             msg);
    p.n = 50000;
    TH_CHECK(m && cu_dev_launch_smem(d, m, "hw_dyn", one, blk, 200000, &p, sizeof p, msg, sizeof msg) == KVQ_OK,
             "200,000 bytes dynamic with the attribute: %s", msg);
    TH_CHECK(out[1] == 49999.0f, "dynamic: %g", out[1]);
    st = m ? cu_dev_launch_smem(d, m, "hw_dyn", one, blk, 200 * 1024 + 4, &p, sizeof p, msg, sizeof msg)
           : KVQ_ERR_INTERNAL;
    TH_CHECK(st == KVQ_ERR_INTERNAL && strstr(msg, "MAX_DYNAMIC_SHARED_SIZE_BYTES"), "past the attribute: %s",
             st == KVQ_OK ? "launched" : msg);
    st = m ? cu_dev_func_max_dyn_smem(d, m, "hw_dyn", 227 * 1024 + 4, msg, sizeof msg) : KVQ_ERR_INTERNAL;
    TH_CHECK(st == KVQ_ERR_INTERNAL && strstr(msg, "CUDA_ERROR_INVALID_VALUE"), "attribute past 227 KiB: %s",
             st == KVQ_OK ? "accepted" : msg);
    /* the static kernel's 48 KiB count against the opt-in maximum */
    st = m ? cu_dev_func_max_dyn_smem(d, m, "hw_static", 180 * 1024, msg, sizeof msg) : KVQ_ERR_INTERNAL;
    TH_CHECK(st == KVQ_ERR_INTERNAL && strstr(msg, "49152 bytes of static"), "48 KiB static + 180 KiB: %s",
             st == KVQ_OK ? "accepted" : msg);
    cu_module_free(m);
    th_end();
}

/* Registers: a decode kernel's ptxas count times the threads of the block. */
static void test_registers(cu_dev *d)
{
    char why[256];
    if (cu_nvrtc_load(why, sizeof why) != KVQ_OK) {
        printf("SKIP emulated driver register limit: %s\n", why);
        return;
    }
    th_begin("emulated driver: a block needing more than 65536 registers (ptxas's count x threads) is refused with "
             "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES");
    static const char kivi[] = "scheme k { key { bits 2; per channel; group 32; } value { bits 2; per token; group 32; } "
                               "residual 32; }\n";
    kvq_spec *spec = NULL;
    char msg[2048] = "";
    kvq_plan *plan = kvq_malloc(sizeof *plan);
    char *src = NULL;
    cu_module *m = NULL;
    kvq_dims dims = {1, 32, 8, 128};
    TH_CHECK(plan && kvq_spec_parse_string("<test>", kivi, strlen(kivi), &spec) == KVQ_OK, "spec");
    TH_CHECK(plan_build(kvq_spec_scheme(spec, NULL), &dims, KVQ_F32, plan, msg, sizeof msg) == KVQ_OK, "%s", msg);
    TH_CHECK(emit_cuda_source(plan, &src, NULL) == KVQ_OK, "emit");
    TH_CHECK(cu_dev_load(d, src, NULL, &m, msg, sizeof msg) == KVQ_OK, "load: %s", msg);
    cu_compiled c;
    memset(&c, 0, sizeof c);
    TH_CHECK(cu_nvrtc_compile(src, "sm_90", 1, &c, NULL, msg, sizeof msg) == KVQ_OK, "%s", msg);
    int regs = 0;
    for (int i = 0; i < c.n_res; i++)
        if (!strcmp(c.res[i].name, "kvq_decode_c0")) regs = c.res[i].regs;
    cu_compiled_free(&c);
    /* the smallest block of whole warps whose registers exceed 65536 */
    unsigned per_warp = ((unsigned)regs * 32 + 255) / 256 * 256, warps = 65536 / (per_warp ? per_warp : 1) + 1;
    TH_CHECK(regs > 0 && warps * 32 <= 1024, "kvq_decode_c0 has %d registers", regs);
    kvq_decode_params dp;
    memset(&dp, 0, sizeof dp);
    const unsigned one[3] = {1, 1, 1}, blk[3] = {warps * 32, 1, 1};
    kvq_status st = m ? cu_dev_launch(d, m, "kvq_decode_c0", one, blk, &dp, sizeof dp, msg, sizeof msg) : KVQ_OK;
    TH_CHECK(st == KVQ_ERR_INTERNAL && strstr(msg, "kvq_decode_c0") && strstr(msg, "registers") &&
                 strstr(msg, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"),
             "%d registers x %u threads: %s", regs, warps * 32, st == KVQ_OK ? "launched" : msg);
    printf("  kvq_decode_c0: %d registers a thread on sm_90: %u threads refused\n", regs, warps * 32);
    cu_module_free(m);
    kvq_free(src);
    kvq_free(plan);
    kvq_spec_free(spec);
    th_end();
}

/* KVQ_EMU_RESOURCES=0 (tests/test-times `res=0`): no NVRTC figures, so the static kernel's 48 KiB no longer count
 * against the opt-in maximum (test_shared_memory refuses 48 KiB static + 180 KiB with them); the kernel still runs. */
static void test_resources_off(void)
{
    th_begin("emulated driver: KVQ_EMU_RESOURCES=0 loads a unit without ptxas's figures (the static shared memory "
             "unknown to the launch checks)");
    setenv("KVQ_EMU_RESOURCES", "0", 1);
    cu_dev *d = NULL;
    char msg[2048] = "";
    cu_module *m = NULL;
    TH_CHECK(cu_dev_open(CU_DEV_EMU, &d, msg, sizeof msg) == KVQ_OK, "open: %s", msg);
    TH_CHECK(d && load_small(d, 12288, &m, msg, sizeof msg) == KVQ_OK, "load: %s", msg);
    TH_CHECK(m && cu_dev_func_max_dyn_smem(d, m, "hw_static", 180 * 1024, msg, sizeof msg) == KVQ_OK,
             "48 KiB static + 180 KiB refused without the figures: %s", msg);
    float out[2] = {0, 0};
    hw_params p = {(unsigned long long)(uintptr_t)out, 0, 0};
    const unsigned one[3] = {1, 1, 1}, blk[3] = {128, 1, 1};
    TH_CHECK(m && cu_dev_launch(d, m, "hw_static", one, blk, &p, sizeof p, msg, sizeof msg) == KVQ_OK, "%s", msg);
    TH_CHECK(out[0] == 12287.0f, "static: %g", out[0]);
    cu_module_free(m);
    if (d) cu_dev_close(d);
    unsetenv("KVQ_EMU_RESOURCES");
    th_end();
}

static void test_driver(void)
{
    cu_dev *d = NULL;
    char msg[512];
    if (cu_dev_open(CU_DEV_EMU, &d, msg, sizeof msg) != KVQ_OK) {
        printf("SKIP emulated driver: %s\n", msg);
        return;
    }
    test_contexts(d);
    test_shared_memory(d);
    test_registers(d);
    cu_dev_close(d);
    test_resources_off();
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
    test_other_thread();
    test_zip_near_ties();
    test_driver();
    return th_summary();
}
