/* ZipCache's saliency policy for the cuda/emu backends (He et al. 2024, Eq. 7-9, Algorithms 2-3), deciding exactly
 * what ref_saliency.c decides so that the classes, hence the codes, are the reference's. The decisions run in the
 * policy kernels (templates/kvq_policy.cuh); the host draws the probe positions (kvq_select_probes, a seeded
 * PRNG); only the prefill's classes come back to the host (a prefill is not a step).
 *
 * Prefill (Alg. 2): kvq_zip_stats_max and kvq_zip_stats give each probe query's softmax over the keys it can see
 * (the prompt's fp16 keys, double precision, as the reference: max logit and fixed-point denominator), over
 * (probe, query head, key chunk) grids whose chunks may run in any order; kvq_zip_saliency Eq. 8 (or 7) of each
 * token being quantized from those rows, kvq_zip_select the round(ratio * n) most salient per kv head.
 * Decode (Alg. 3): a probe step's row is its attention probabilities over the tokens waiting in the window,
 * p_i = 2^(s_i * scale * log2 e - lse), with lse the log2-sum-exp2 over the whole cache that the decode kernel
 * returns for the step and s_i = q . k_i over the window's fp16 keys (kvq_zip_row, into the device rows). GQA: the
 * group's query heads' probabilities are summed (double), as the reference does. The compression every W tokens
 * classes the window's batch from the rows gathered during the cycle (kvq_zip_rowsal, kvq_zip_select); its flags
 * stay on the device (cu_qlayer.c turns them into each page's gather rows and members with kvq_zip_gather), so a
 * decode step never waits for them. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cu_backend.h"
#include "policy.h"


static int probe_bound(const kvq_saliency_cfg *s, int n)
{
    int r = kvq_frac_ceil(s->probe_recent, n);
    if (r < 1) r = 1;
    r += kvq_frac_round(s->probe_random, n);
    return r < n ? r : n;
}

kvq_status cu_sal_init(kvq_backend_ctx *c, cu_qlayer *L, int layer, char *msg, size_t n)
{
    uint64_t st = c->e.seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(layer + 1)); /* ref: one stream per layer */
    L->seed = kvq_splitmix64(&st);
    int wcap = L->rule[0].capacity > 0 ? L->rule[0].capacity : 1;
    L->probe_cap = probe_bound(&L->cfg->saliency, wcap);
    L->probe_pos = kvq_malloc((size_t)wcap * sizeof *L->probe_pos);
    if (!L->probe_pos) {
        snprintf(msg, n, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    if (L->rule[0].capacity == 0) return KVQ_OK; /* no window: no decode probes */
    return cu_dev_alloc(c->dev, (size_t)L->probe_cap * c->H * wcap * sizeof(float), &L->rows, msg, n);
}

void cu_sal_free(kvq_backend_ctx *c, cu_qlayer *L)
{
    kvq_free(L->probe_pos);
    cu_dev_free(c->dev, L->rows);
    L->probe_pos = NULL;
    L->rows = 0;
}

static size_t al16(size_t n) { return (n + 15) & ~(size_t)15; }

/* Kernels over n tokens of H heads: sal [H][n], is_high [H][n], work (keys + indices) [2][H][n]. */
static size_t class_bytes(int H, int n)
{
    return al16((size_t)H * n * 4) + al16((size_t)H * n) + 2 * al16((size_t)H * n * 4);
}

/* kvq_zip_select after the saliency of n tokens is in p->sal; is_high (if not NULL) copied to the host. */
static kvq_status classes(kvq_backend_ctx *c, kvq_zip_params *p, int n, int high, unsigned char *is_high, char *msg,
                          size_t ms)
{
    p->n = n, p->n_high = high;
    kvq_status st = cu_launch(c, "kvq_zip_select", (unsigned)c->H, 1, 1, 256, p, sizeof *p, msg, ms);
    if (st == KVQ_OK && is_high) st = cu_dev_d2h(c->dev, is_high, p->is_high, (size_t)c->H * n, msg, ms);
    return st;
}

kvq_status cu_sal_prefill(kvq_backend_ctx *c, const cu_qlayer *L, const kvq_rows *k, const float *q, int T, int first,
                          int n, unsigned char *is_high, char *msg, size_t ms)
{
    const kvq_saliency_cfg *s = &L->cfg->saliency;
    int H = c->H, Hq = c->Hq, D = c->D;
    int *pos = kvq_malloc((size_t)T * sizeof *pos);
    int np = pos ? kvq_select_probes(s, 0, T, L->seed, pos) : 0; /* Eq. 9: recent + random */
    float *qp = kvq_malloc((size_t)Hq * (np > 0 ? np : 1) * D * sizeof *qp);
    kvq_status st = pos && qp ? KVQ_OK : KVQ_ERR_NOMEM;
    /* c->pol: probe queries [Hq][np][D] | positions [np] | stats [Hq][np][2] | sal, is_high, work */
    size_t qb = al16((size_t)Hq * np * D * 4), pb = al16((size_t)np * 4), sb = al16((size_t)Hq * np * 16);
    if (st == KVQ_OK) st = cu_scratch(c, &c->pol, &c->pol_bytes, qb + pb + sb + class_bytes(H, n), msg, ms);
    for (int hq = 0; hq < Hq && st == KVQ_OK; hq++)
        for (int r = 0; r < np; r++)
            memcpy(qp + ((size_t)hq * np + r) * D, q + ((size_t)hq * T + pos[r]) * D, (size_t)D * sizeof *qp);
    if (st == KVQ_OK) st = cu_dev_h2d(c->dev, c->pol, qp, (size_t)Hq * np * D * 4, msg, ms);
    if (st == KVQ_OK) st = cu_dev_h2d(c->dev, c->pol + qb, pos, (size_t)np * 4, msg, ms);
    kvq_zip_params p;
    memset(&p, 0, sizeof p);
    p.q = c->pol, p.k = *k, p.pos = c->pol + qb, p.stats = c->pol + qb + pb;
    p.sal = p.stats + sb, p.is_high = p.sal + al16((size_t)H * n * 4), p.work = p.is_high + al16((size_t)H * n);
    p.scale = (double)c->e.softmax_scale;
    p.np = np, p.first = first, p.n = n, p.accumulated = s->metric == KVQ_SAL_ACCUMULATED;
    p.chunk = KVQ_ZS_CHUNK;
    unsigned nch = (unsigned)((T + KVQ_ZS_CHUNK - 1) / KVQ_ZS_CHUNK); /* the last probe sees at most T keys */
    /* the rows' maxima and integer sums are accumulated by atomics from zero */
    if (st == KVQ_OK) st = cu_dev_memset(c->dev, p.stats, 0, (size_t)Hq * np * 16, msg, ms);
    if (st == KVQ_OK) st = cu_launch(c, "kvq_zip_stats_max", (unsigned)np, (unsigned)Hq, nch, 256, &p, sizeof p, msg, ms);
    if (st == KVQ_OK) st = cu_launch(c, "kvq_zip_stats", (unsigned)np, (unsigned)Hq, nch, 256, &p, sizeof p, msg, ms);
    if (st == KVQ_OK)
        st = cu_launch(c, "kvq_zip_saliency", (unsigned)((n + 255) / 256), (unsigned)H, 1, 256, &p, sizeof p, msg, ms);
    if (st == KVQ_OK) st = classes(c, &p, n, kvq_saliency_high_count(s, n), is_high, msg, ms);
    kvq_free(pos), kvq_free(qp);
    if (st == KVQ_ERR_NOMEM) snprintf(msg, ms, "out of memory");
    return st;
}

void cu_sal_new_cycle(cu_qlayer *L)
{
    const cu_win *w = &L->win[0];
    L->cycle_first = w->count ? w->pos[w->head] : L->length;
    int steps = L->rule[0].capacity - w->count; /* steps until the window is full again */
    L->n_probes = kvq_select_probes(&L->cfg->saliency, L->length, steps, L->seed, L->probe_pos);
    L->n_rows = 0;
}

kvq_status cu_sal_record(kvq_backend_ctx *c, cu_qlayer *L, int pos, uint64_t q, const kvq_seq_tiles *tiles, char *msg,
                         size_t ms)
{
    if (L->n_rows >= L->n_probes || L->probe_pos[L->n_rows] != pos) return KVQ_OK;
    /* Eq. 9's normaliser over the whole cache as the reference computes it (docs/cuda.md "Determinism"); in a
     * plan into the sequence's policy scratch (cu_step_policy.c) */
    size_t nb = (size_t)KVQ_ZN_BYTES(c->Hq); /* the normaliser and its chunks' partials */
    kvq_status st = c->rec ? (nb <= c->rec->pol_bytes ? KVQ_OK : KVQ_ERR_INTERNAL)
                           : cu_scratch(c, &c->pol, &c->pol_bytes, nb, msg, ms);
    if (st == KVQ_ERR_INTERNAL) snprintf(msg, ms, "cuda: internal error: a planned probe's scratch is too small");
    uint64_t pol = c->rec ? c->rec->pol : c->pol;
    kvq_zip_norm_params np;
    memset(&np, 0, sizeof np);
    np.q = q, np.tiles = tiles->tiles, np.n_tiles = tiles->n_tiles, np.norm = pol;
    np.scale = (double)c->e.softmax_scale;
    char kname[32];
    snprintf(kname, sizeof kname, "kvq_zip_norm_max_c%d", L->cls);
    if (st == KVQ_OK) st = cu_launch(c, kname, (unsigned)c->H, KVQ_ZN_CHUNKS, 1, 256, &np, sizeof np, msg, ms);
    snprintf(kname, sizeof kname, "kvq_zip_norm_sum_c%d", L->cls);
    if (st == KVQ_OK) st = cu_launch(c, kname, (unsigned)c->H, KVQ_ZN_CHUNKS, 1, 256, &np, sizeof np, msg, ms);
    if (st == KVQ_OK) st = cu_launch(c, "kvq_zip_norm_fin", (unsigned)c->H, 1, 1, 32, &np, sizeof np, msg, ms);
    const cu_win *w = &L->win[0];
    kvq_zip_params p;
    memset(&p, 0, sizeof p);
    p.q = q, p.norm = pol, p.rows = L->rows;
    p.k = cu_rows_f16(w->addr, w->cap, w->head, w->cap);
    p.scale = (double)c->e.softmax_scale;
    p.row = L->n_rows, p.wcap = L->rule[0].capacity, p.count = w->count;
    if (st == KVQ_OK) st = cu_launch(c, "kvq_zip_row", (unsigned)c->H, 1, 1, 256, &p, sizeof p, msg, ms);
    if (st == KVQ_OK) L->n_rows++; /* the row is written where no row was: a failed step just forgets it */
    return st;
}

kvq_status cu_sal_flush(kvq_backend_ctx *c, const cu_qlayer *L, int B, uint64_t *is_high, char *msg, size_t ms)
{
    const kvq_saliency_cfg *s = &L->cfg->saliency;
    int nr = L->n_rows;
    int *ppos = kvq_malloc((size_t)(nr > 0 ? nr : 1) * sizeof *ppos);
    if (!ppos) {
        snprintf(msg, ms, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    for (int r = 0; r < nr; r++) ppos[r] = L->probe_pos[r] - L->cycle_first; /* window slot i: cycle_first + i */
    size_t pb = al16((size_t)(nr > 0 ? nr : 1) * 4);
    cu_rec *rec = c->rec;
    kvq_status st = KVQ_OK;
    uint64_t pol = c->pol, pos;
    if (rec) {
        /* a plan: the positions travel in its tables, the rest in the sequence's policy scratch */
        if (nr > c->step.zpos_cap || pb + class_bytes(c->H, B) > rec->pol_bytes) {
            snprintf(msg, ms, "cuda: internal error: a planned compression exceeds its bounds");
            st = KVQ_ERR_INTERNAL;
        } else {
            memcpy(rec->zpos_host, ppos, (size_t)nr * 4);
        }
        pol = rec->pol, pos = rec->zpos_dev;
    } else {
        st = cu_scratch(c, &c->pol, &c->pol_bytes, pb + class_bytes(c->H, B), msg, ms);
        pol = c->pol, pos = pol;
        if (st == KVQ_OK) st = cu_upload(c, pos, ppos, (size_t)nr * 4, msg, ms);
    }
    kvq_free(ppos);
    kvq_zip_params p;
    memset(&p, 0, sizeof p);
    p.pos = pos, p.rows = L->rows, p.sal = pol + pb;
    p.is_high = p.sal + al16((size_t)c->H * B * 4), p.work = p.is_high + al16((size_t)c->H * B);
    p.np = nr, p.n = B, p.wcap = L->rule[0].capacity, p.accumulated = s->metric == KVQ_SAL_ACCUMULATED;
    if (st == KVQ_OK)
        st = cu_launch(c, "kvq_zip_rowsal", (unsigned)((B + 255) / 256), (unsigned)c->H, 1, 256, &p, sizeof p, msg, ms);
    if (st == KVQ_OK) st = classes(c, &p, B, kvq_saliency_high_count(s, B), NULL, msg, ms);
    *is_high = p.is_high;
    return st;
}
