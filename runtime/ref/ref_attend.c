/* Reference attention. The oracle first materialises the cache of one kv head as attention sees it (every token
 * exactly once, in token order: sinks, the quantized body dequantized with masked slots skipped, the outlier and
 * spill pools, the residual window), then computes exact softmax attention in double over it. Attention is
 * invariant to the order of keys (DESIGN §4), so this equals a walk over the segments under one online softmax;
 * doing it in token order also gives read_cache for free and lets the materialisation check the invariant that
 * each token is present exactly once. */
#include <math.h>
#include <string.h>

#include "half.h"
#include "policy.h"
#include "ref.h"

void ref_round_f16(float *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = kvq_f16_round(src[i]);
}

void ref_attend(const float *q, const float *K, const float *V, int n, int D, float scale, float *out, float *probs)
{
    /* Two passes in double: logits and their max, then weights; no overflow, no ordering effects worth the
     * name. The engine's input policy keeps every stored value finite and within fp16's range and bounds the
     * query's logits (rt_check.c), so the max is finite and exp(s - max) never meets inf - inf; were it not, the
     * output would be NaN, never a silent 0. An empty cache (never reached through the API: a decode holds at
     * least its own token) gives 0. */
    double mx = -INFINITY;
    for (int t = 0; t < n; t++) {
        double s = 0;
        const float *k = K + (size_t)t * (size_t)D;
        for (int c = 0; c < D; c++) s += (double)q[c] * (double)k[c];
        s *= (double)scale;
        if (s > mx) mx = s;
    }
    double acc[256], denom = 0;
    for (int c = 0; c < D; c++) acc[c] = 0;
    for (int t = 0; t < n; t++) {
        /* Recomputed in double rather than read back from a float copy: the weight comes from the exact logit. */
        double s = 0;
        const float *k = K + (size_t)t * (size_t)D;
        for (int c = 0; c < D; c++) s += (double)q[c] * (double)k[c];
        s *= (double)scale;
        double w = exp(s - mx);
        denom += w;
        const float *v = V + (size_t)t * (size_t)D;
        for (int c = 0; c < D; c++) acc[c] += w * (double)v[c];
    }
    for (int c = 0; c < D; c++) out[c] = n > 0 ? (float)(acc[c] / denom) : 0.0f;
    if (!probs || n <= 0) return;
    /* ZipCache's probe rows decide classes, so the device must compute them bit for bit (docs/cuda.md,
     * "Determinism"): e^x by kvq_exp_det, the normaliser an order-independent integer sum (kvq_prob_fixed), which
     * kvq_zip_norm and kvq_zip_row reproduce in whatever order their threads take the tokens. */
    uint64_t z = 0;
    for (int t = 0; t < n; t++) {
        double s = 0;
        const float *k = K + (size_t)t * (size_t)D;
        for (int c = 0; c < D; c++) s += (double)q[c] * (double)k[c];
        s *= (double)scale;
        double e = kvq_exp_det(s - mx);
        probs[t] = (float)e;
        z += kvq_prob_fixed(e);
    }
    double Z = (double)z * KVQ_PROB_FIXED_UNIT;
    for (int t = 0; t < n; t++) probs[t] = (float)((double)probs[t] / Z);
}

size_t ref_attend_scratch_bytes(int len, int D)
{
    /* K and V rows, probabilities of every query head are taken separately by the caller, coverage flags. */
    return ref_arena_need((size_t)len * (size_t)D * sizeof(float)) * 2 + ref_arena_need((size_t)len * 2);
}

/* Marks position p of tensor `which` as written; returns 0 when it was already (a token counted twice). */
static int mark(unsigned char *seen, int len, int which, int p)
{
    if (p < 0 || p >= len) return 0;
    unsigned char *s = &seen[(size_t)which * (size_t)len + (size_t)p];
    if (*s) return 0;
    *s = 1;
    return 1;
}

kvq_status ref_qlayer_materialize(const ref_qlayer *L, int h, float *K, float *V, unsigned char *seen)
{
    int len = L->length, D = L->D, ok = 1;
    memset(seen, 0, (size_t)len * 2);

    /* Pooled tokens first: their K and V come from the pool (fp16 copies), and their body slots are masked
     * (keys) or hold the group mean (values, which are never read for a pooled token: the flags say so). */
    const ref_pool *pools[2] = {&L->pool, &L->spill};
    for (int pi = 0; pi < 2; pi++) {
        const ref_pool *P = pools[pi];
        if (!P->cap) continue;
        for (int i = 0; i < P->count[h]; i++) {
            int p = P->pos[h * P->cap + i];
            ok &= mark(seen, len, 0, p) & mark(seen, len, 1, p);
            if (p >= 0 && p < len) {
                kvq_f32_from_f16_n(K + (size_t)p * (size_t)D, P->k + ((size_t)h * (size_t)P->cap + (size_t)i) * (size_t)D,
                                   (size_t)D);
                kvq_f32_from_f16_n(V + (size_t)p * (size_t)D, P->v + ((size_t)h * (size_t)P->cap + (size_t)i) * (size_t)D,
                                   (size_t)D);
            }
        }
    }
    for (int which = 0; which < 2; which++) {
        float *X = which ? V : K;
        const ref_win *ws[2] = {&L->sink[which], &L->win[which]};
        for (int wi = 0; wi < 2; wi++)
            for (int s = 0; s < ws[wi]->count; s++) {
                int p = ws[wi]->pos[s];
                if (!mark(seen, len, which, p)) {
                    ok = 0;
                    continue;
                }
                ref_win_read(ws[wi], h, s, X + (size_t)p * (size_t)D);
            }
        const ref_pages *pl = &L->pages[which];
        for (int j = 0; j < pl->n; j++) {
            const ref_page *pg = pl->v[j];
            for (int s = 0; s < pg->count; s++) {
                int p = pg->pos[h * pg->fmt.capacity + s];
                if (which == 0 && ref_page_masked(pg, h, s)) continue; /* the token lives in a pool */
                if (which == 1 && p >= 0 && p < len && seen[(size_t)len + (size_t)p] && L->pool.cap) {
                    /* A pooled token's value slot: it holds the group mean; the pool's copy was taken above.
                     * Its key slot must be masked, which the key pass checks by the same flags. */
                    continue;
                }
                if (!mark(seen, len, which, p)) {
                    ok = 0;
                    continue;
                }
                ref_page_read(pg, h, s, X + (size_t)p * (size_t)D);
            }
        }
    }
    for (int i = 0; i < 2 * len; i++) ok &= seen[i];
    return ok ? KVQ_OK : KVQ_ERR_INTERNAL;
}
