/* One backend against the reference backend in lockstep through the public API (header-only, for the test
 * programs that check a backend on one scheme: test_cpu_turboquant, test_cuda_turboquant): both engines prefill the
 * same fresh random prompts (each sequence its own outlier channels), decode the same random steps, and must give
 * every decode output within 1e-3 of the reference's (relative to the head's magnitude), the cache read back
 * bit-identical and the same statistics. */
#ifndef KVQ_TEST_LOCKSTEP_H
#define KVQ_TEST_LOCKSTEP_H

#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "test_engine_util.h"

/* A case: prompt length, sequences (at most 4), GQA ratio, head_dim, engine threads (0: the default), steps. */
typedef struct {
    int len, batch, gqa, D, threads, steps;
} tu_shape;

/* An engine of one layer with kv_heads kv heads and kv_heads * gqa query heads, fp32 tensors. */
static inline kvq_status tu_lockstep_engine(const kvq_scheme *sch, kvq_backend_kind be, const tu_shape *s,
                                            int kv_heads, kvq_engine **e, char *err, size_t n)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.backend = be;
    cfg.dims = (kvq_dims){1, kv_heads * s->gqa, kv_heads, s->D};
    cfg.dtype = KVQ_F32;
    if (s->threads > 0) cfg.threads = s->threads;
    return kvq_engine_create(sch, &cfg, e, err, n);
}

/* The worst relative error of a decode output, -3 when both backends refuse the shape (a split that leaves no
 * regular channels at this head_dim), or -1 when a check failed. */
static inline double tu_lockstep_compare(const kvq_scheme *sch, kvq_backend_kind be, const tu_shape *s, int kv_heads)
{
    const int kvh = kv_heads;
    const char *BE = kvq_backend_name(be);
    int H = kvh * s->gqa, D = s->D, B = s->batch, maxlen = s->len + s->steps;
    char err[512] = "";
    kvq_engine *eng[2] = {NULL, NULL};
    kvq_status sr = tu_lockstep_engine(sch, KVQ_BACKEND_REFERENCE, s, kv_heads, &eng[0], err, sizeof err);
    kvq_status se = tu_lockstep_engine(sch, be, s, kv_heads, &eng[1], err, sizeof err);
    if (sr == KVQ_ERR_SHAPE) { /* both must refuse it */
        TH_CHECK(se == sr, "reference %s, %s %s (%s)", kvq_status_str(sr), BE, kvq_status_str(se), err);
        kvq_engine_free(eng[1]);
        return th_failed() ? -1 : -3;
    }
    TH_CHECK(sr == KVQ_OK, "reference: %s: %s", kvq_status_str(sr), err);
    TH_CHECK(se == KVQ_OK, "%s: %s: %s", BE, kvq_status_str(se), err);
    size_t kvn = (size_t)kvh * s->len * D, qn = (size_t)H * s->len * D, one = (size_t)B * kvh * D;
    size_t oneq = (size_t)B * H * D, cn = (size_t)kvh * maxlen * D;
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
                items[b] = (kvq_decode_item){seq[w][b], dk + (size_t)b * kvh * D, dv + (size_t)b * kvh * D,
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

#endif
