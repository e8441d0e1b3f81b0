/* The policy layers of planned decode steps (docs/cuda.md "Planned steps"): TailorKV's sparse layers, OTT's
 * outlier pools and ZipCache's saliency classes. Their decisions stay on the device as in a decode step; what the plan adds is that their
 * launches become fixed launches of the run, list kernels over per-sequence items the plan writes into the step's
 * tables:
 *
 * - a sparse layer retrieves at every step (App. I): kvq_tk_select_list (one kvq_tk_params per sequence: reduced
 *   query, critical channels, scores, top-k into the sequence's scratch), then kvq_store_f16_list over two
 *   gathers per sequence (the top-k K and V rows from page-locked host memory into the layer's fetch buffers),
 *   before the decode kernel attends over the local window, the fetched rows and the generated tokens;
 * - an OTT layer launches kvq_ott_compete_list at every step; a sequence's item is its flush (B = 0 when the step
 *   flushes nothing), reading pool-state copy cur and writing cur ^ 1, the copy the step's pool tiles then read
 *   (kvq_tile.count: the counts never leave the device). Which copy is cur is host state the plan decides: it
 *   adopts the flip when the plan succeeded (cu_ott_commit), as a decode step does when its batch succeeded. The
 *   flush's quantize items read the competition's mean-replaced rows and pooled flags from the sequence's
 *   scratch, and the key pages' mask addresses (for unmasking an evicted token, spill 0) travel in the tables;
 * - a ZipCache layer with a window (Alg. 3) works after the attention, as decode_run does: at a probe step (the
 *   host drew the positions) kvq_zip_norm_{max,sum}_list_c<k> and kvq_zip_norm_fin_list over the sequence's
 *   tiles of the step, and kvq_zip_row_list into the layer's probe rows; at a compression (every `interval` tokens: host-known) kvq_zip_rowsal_list and
 *   kvq_zip_select_list (one item; the cycle's probe positions in the tables), kvq_zip_gather_list (a page per
 *   item, each with its own gather rows) and the pages' factor and quantize lists (a second set, by store).
 *   Items are empty where a sequence has no probe or compression; the classes never leave the device.
 *
 * The launches are recorded by the same code as a decode step's (cu_slayer_append, cu_ott_compete,
 * cu_qlayer_after_attend) while c->rec is set: cu_step_policy_record takes them (c->rec->post: after the decode
 * kernel). */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cu_backend.h"
#include "policy.h"

static size_t al16(size_t n) { return (n + 15) & ~(size_t)15; }
static int imax(int a, int b) { return a > b ? a : b; }
static int cdiv(long long a, long long b) { return (int)((a + b - 1) / b); }
static const char *const store_names[CU_STEP_STORES] = {"k_hi", "k_lo", "v_hi", "v_lo"};

/* The pages flush_pages cuts a class of nc tokens of tensor t into: their count, the largest in *maxn, the
 * bytes of their gather rows (H ints a slot, each page's 16-byte aligned) added to *rows. */
static int class_pages(const kvq_tensor_cfg *t, int nc, int H, int *maxn, size_t *rows)
{
    int pages = 0;
    for (int off = 0; off < nc; pages++) {
        int cap = kvq_flush_page_tokens(t, nc - off);
        if (cap < 1) cap = 1;
        if (cap > *maxn) *maxn = cap;
        if (rows) *rows += al16((size_t)H * cap * 4);
        off += cap;
    }
    return pages;
}

/* ZipCache with a window (Alg. 3): a probe row per probe step, a compression of the window's batch B every B
 * steps into pages of two classes, after the decode kernel. */
static void zip_bounds(kvq_backend_ctx *c, const kvq_quant_cfg *q, int cls, int T, cu_step *S)
{
    int H = c->H, Hq = c->Hq;
    kvq_window_rule r;
    kvq_window_rule_of(q, 0, &r);
    if (r.capacity == 0) return; /* refused by the plan */
    int B = r.batch, high = kvq_saliency_high_count(&q->saliency, B), gathers = 0, tiles = 0;
    if (high > B) high = B;
    size_t zaux = 0;
    for (int w = 0; w < 2; w++) {
        const kvq_tensor_cfg *t = w ? &q->value : &q->key;
        for (int k = 0; k < 2; k++) {
            int st = 2 * w + k, maxn = 0, mt = 0;
            int pages = class_pages(t, k ? B - high : high, H, &maxn, &zaux);
            gathers += pages;
            S->qp_cap[st] = imax(S->qp_cap[st], pages);
            S->q_maxn[cls][st] = imax(S->q_maxn[cls][st], maxn);
            /* the pages of every compression over T tokens and of the prompt, each its own run of tiles */
            tiles += pages * (cdiv(T, B) + 1) + class_pages(t, T, H, &mt, NULL);
        }
    }
    S->tiles_cap += tiles + 8;
    S->zip_cap = 1;
    S->zg_cap = imax(S->zg_cap, gathers);
    S->zpos_cap = imax(S->zpos_cap, r.capacity);
    S->zc_gx = imax(S->zc_gx, cdiv(B, 256));
    if (zaux > S->zaux_seq) S->zaux_seq = zaux;
    /* the probe's normaliser and its chunks' partials (KVQ_ZN_BYTES); a compression's saliency, flags and work
     * (cu_saliency.c) */
    size_t cls_b = al16((size_t)H * B * 4) + al16((size_t)H * B) + 2 * al16((size_t)H * B * 4);
    size_t zn_b = (size_t)KVQ_ZN_BYTES(Hq);
    size_t pol = zn_b > al16((size_t)r.capacity * 4) + cls_b ? zn_b : al16((size_t)r.capacity * 4) + cls_b;
    if (pol > S->pol_seq) S->pol_seq = al16(pol);
}

void cu_step_policy_bounds(kvq_backend_ctx *c, const kvq_layer_cfg *lc, int cls, int T, cu_step *S)
{
    int H = c->H, D = c->D, tile = plan_tile_tokens(&c->plan->cls[cls], 1, 1); /* pools, sparse rows: fp16 */
    if (lc->mode != KVQ_MODE_QUANT) {
        /* a sparse layer (cu_slayer_append, cu_slayer_tiles): the local window (two ring runs at most), the
         * fetched rows, pages of KVQ_APPEND_PAGE_TOKENS generated tokens (one ring run each) */
        const kvq_sparse_cfg *sc = &lc->sparse;
        int topk = sc->topk > 0 ? sc->topk : 1, cap = sc->sinks + sc->recent;
        int tiles = cdiv(cap, tile) + 2 + cdiv(topk, tile) + (cdiv(T, KVQ_APPEND_PAGE_TOKENS) + 1) *
                                                               (cdiv(KVQ_APPEND_PAGE_TOKENS, tile) + 1);
        S->tiles_cap = imax(S->tiles_cap, tiles);
        S->tk_cap = 1, S->tkst_cap = 2;
        S->tk_gy = imax(S->tk_gy, (int)cu_grid_y(topk));
        /* kvq_tk_select's gather rows [H][nf] and its work (keys and selection of nc <= T candidates) */
        size_t pol = al16((size_t)H * topk * 4) + 2 * (size_t)H * (T > 0 ? T : 1) * 4;
        if (pol > S->pol_seq) S->pol_seq = al16(pol);
    }
    if (lc->mode != KVQ_MODE_SPARSE && lc->quant.outliers.keep > 0) {
        /* an OTT layer: one competition per flush of B tokens (cu_ott_compete's scratch), its pool tiles */
        const kvq_quant_cfg *q = &lc->quant;
        kvq_window_rule r;
        kvq_window_rule_of(q, 0, &r);
        int B = r.capacity == 0 ? 1 : r.batch, N = q->outliers.keep, sp = q->outliers.spill;
        S->ott_cap = 1;
        S->ottm_cap = imax(S->ottm_cap, B);
        S->tiles_cap = imax(S->tiles_cap, S->tiles_cap + cdiv(N, tile) + cdiv(sp, tile));
        size_t pol = 2 * (size_t)H * B * D * 2 + al16((size_t)H * B) + (size_t)B * 8 +
                     (size_t)H * (2 * (size_t)B + 4 * (size_t)N + 8) * 4;
        if (pol > S->pol_seq) S->pol_seq = al16(pol);
    }
    if (lc->mode != KVQ_MODE_SPARSE && lc->quant.saliency.metric != KVQ_SAL_NONE)
        zip_bounds(c, &lc->quant, cls, T, S);
}

/* What ZipCache's after-attention work records (r->post): normaliser, row, classes, gathers, their pages. */
static int record_post(kvq_backend_ctx *c, const char *kernel, const void *params, size_t size, kvq_status *st,
                       char *msg, size_t ms)
{
    cu_rec *r = c->rec;
    const cu_step *S = &c->step;
    /* a probe's normaliser is kvq_zip_norm_max_c<k>, _sum_c<k>, then _fin with the same parameters: one item,
     * recorded at the last */
    if (!strncmp(kernel, "kvq_zip_norm_max_c", 18) || !strncmp(kernel, "kvq_zip_norm_sum_c", 18)) return 1;
    if (!strcmp(kernel, "kvq_zip_norm_fin") && size == sizeof(kvq_zip_norm_params)) {
        if (!r->zn || r->nzn == S->zip_cap) goto over;
        memcpy(&r->zn[r->nzn++], params, size);
        return 1;
    }
    if (!strcmp(kernel, "kvq_zip_row") && size == sizeof(kvq_zip_params)) {
        if (!r->zr || r->nzr == S->zip_cap) goto over;
        memcpy(&r->zr[r->nzr++], params, size);
        return 1;
    }
    if (!strcmp(kernel, "kvq_zip_rowsal") && size == sizeof(kvq_zip_params)) {
        if (!r->zc || r->nzc == S->zip_cap) goto over;
        memcpy(&r->zc[r->nzc++], params, size);
        return 1;
    }
    if (!strcmp(kernel, "kvq_zip_select") && size == sizeof(kvq_zip_params)) {
        /* the same item as the rowsal before it (cu_sal_flush), with the class size set */
        if (!r->zc || r->nzc == 0) goto over;
        memcpy(&r->zc[r->nzc - 1], params, size);
        return 1;
    }
    if (!strcmp(kernel, "kvq_zip_gather") && size == sizeof(kvq_zip_params)) {
        if (!r->zg || r->nzg == S->zg_cap) goto over;
        memcpy(&r->zg[r->nzg++], params, size);
        return 1;
    }
    /* a separable page's factors: the run launches the factor list before the quantize list, over the same items */
    if (!strncmp(kernel, "kvq_factor_", 11)) return 1;
    for (int s = 0; s < CU_STEP_STORES && !strncmp(kernel, "kvq_quant_", 10); s++) {
        if (strncmp(kernel + 10, store_names[s], 4) || size != sizeof(kvq_quant_params)) continue;
        kvq_quant_params qp;
        memcpy(&qp, params, sizeof qp);
        if (r->nqp[s] == S->qp_cap[s] || qp.n > S->q_maxn[r->cls][s]) goto over;
        r->qp[s][r->nqp[s]++] = qp;
        return 1;
    }
    snprintf(msg, ms, "cuda: internal error: %s cannot run after the decode kernel of a planned step", kernel);
    *st = KVQ_ERR_INTERNAL;
    return 1;
over:
    snprintf(msg, ms, "cuda: internal error: a planned step's %s work exceeds its bound", kernel);
    *st = KVQ_ERR_INTERNAL;
    return 1;
}

int cu_step_policy_record(kvq_backend_ctx *c, const char *kernel, const void *params, size_t size, kvq_status *st,
                          char *msg, size_t ms)
{
    cu_rec *r = c->rec;
    const cu_step *S = &c->step;
    *st = KVQ_OK;
    if (r->post) return record_post(c, kernel, params, size, st, msg, ms);
    /* a retrieval is kvq_tk_score then kvq_tk_select with the same parameters: one item, recorded at the second */
    if (!strcmp(kernel, "kvq_tk_score") && size == sizeof(kvq_tk_params)) return 1;
    if (!strcmp(kernel, "kvq_tk_select") && size == sizeof(kvq_tk_params)) {
        if (!r->tk || r->ntk == S->tk_cap) goto over;
        memcpy(&r->tk[r->ntk++], params, size);
        return 1;
    }
    if (!strcmp(kernel, "kvq_store_f16") && size == sizeof(kvq_store_params) && r->tkst) {
        kvq_store_params sp;
        memcpy(&sp, params, sizeof sp);
        if (!sp.src.gather) return 0; /* the token's own rows (st1) */
        if (r->ntkst == S->tkst_cap) goto over;
        r->tkst[r->ntkst++] = sp;
        return 1;
    }
    if (!strcmp(kernel, "kvq_ott_compete") && size == sizeof(kvq_ott_params)) {
        if (!r->ott || r->nott == S->ott_cap) goto over;
        memcpy(&r->ott[r->nott++], params, size);
        return 1;
    }
    return 0;
over:
    snprintf(msg, ms, "cuda: internal error: a planned step's %s work exceeds its bound", kernel);
    *st = KVQ_ERR_INTERNAL;
    return 1;
}

static kvq_status launch_grid(kvq_backend_ctx *c, const char *kernel, unsigned gx, unsigned gy, unsigned block,
                              uint64_t items, int n_items, char *msg, size_t ms)
{
    kvq_list_params lp;
    memset(&lp, 0, sizeof lp);
    lp.items = items, lp.n_items = n_items;
    const unsigned g[3] = {gx, gy, (unsigned)n_items}, b[3] = {block, 1, 1};
    return cu_dev_launch(c->dev, c->mod, kernel, g, b, &lp, sizeof lp, msg, ms);
}
static kvq_status launch_items(kvq_backend_ctx *c, const char *kernel, unsigned gy, unsigned block, uint64_t items,
                               int n_items, char *msg, size_t ms)
{
    return launch_grid(c, kernel, (unsigned)c->H, gy, block, items, n_items, msg, ms);
}

kvq_status cu_step_policy_run(kvq_backend_ctx *c, int layer, int n, uint64_t tk, uint64_t tkst, uint64_t ott,
                              char *msg, size_t ms)
{
    const cu_step *S = &c->step;
    const kvq_layer_cfg *lc = kvq_scheme_layer(c->e.scheme, layer);
    kvq_status st = KVQ_OK;
    if (c->e.layer_sparse[layer]) {
        /* every step retrieves: the top-k of every sequence, then their K and V rows gathered */
        st = launch_items(c, "kvq_tk_score_list", KVQ_TK_CHUNKS, 256, tk, n * S->tk_cap, msg, ms);
        if (st == KVQ_OK) st = launch_items(c, "kvq_tk_select_list", 1, 256, tk, n * S->tk_cap, msg, ms);
        if (st == KVQ_OK)
            st = launch_items(c, "kvq_store_f16_list", (unsigned)S->tk_gy, 128, tkst, n * S->tkst_cap, msg, ms);
    } else if (lc->quant.outliers.keep > 0) {
        /* every step of an OTT layer: the flushes' competitions (an item of B = 0 does nothing) */
        st = launch_items(c, "kvq_ott_compete_list", 1, 256, ott, n * S->ott_cap, msg, ms);
    }
    return st;
}

kvq_status cu_step_layer_save(cu_layer *L, cu_snap *s)
{
    if (!L->sparse) return cu_qlayer_save(&L->q, s);
    cu_slayer_save(&L->s, s);
    return KVQ_OK;
}

void cu_step_layer_restore(kvq_backend_ctx *c, cu_layer *L, cu_snap *s)
{
    if (L->sparse) {
        cu_slayer_restore(c, &L->s, s);
        return;
    }
    /* a plan only recorded its competition: no slot was unmasked on the device, so there is nothing to undo, and
     * the pending copy is simply not adopted */
    L->q.ott.unmasked = 0;
    char um[256];
    cu_qlayer_restore(c, &L->q, s, um, sizeof um);
}

void cu_step_layer_commit(kvq_backend_ctx *c, cu_layer *L)
{
    if (!L->sparse) cu_qlayer_commit(c, &L->q);
}

kvq_status cu_step_policy_post(kvq_backend_ctx *c, int layer, int n, uint64_t zn, uint64_t zr, uint64_t zc,
                               uint64_t zg, const uint64_t *qp, char *msg, size_t ms)
{
    const cu_step *S = &c->step;
    const kvq_layer_cfg *lc = kvq_scheme_layer(c->e.scheme, layer);
    if (c->e.layer_sparse[layer] || lc->quant.saliency.metric == KVQ_SAL_NONE || !S->zip_cap) return KVQ_OK;
    int cls = c->plan->layer_class[layer], H = c->H;
    char name[48];
    /* a probe step's normaliser over the step's tiles and its row over the window (Alg. 3, Eq. 9) */
    snprintf(name, sizeof name, "kvq_zip_norm_max_list_c%d", cls);
    kvq_status st = launch_items(c, name, KVQ_ZN_CHUNKS, 256, zn, n * S->zip_cap, msg, ms);
    snprintf(name, sizeof name, "kvq_zip_norm_sum_list_c%d", cls);
    if (st == KVQ_OK) st = launch_items(c, name, KVQ_ZN_CHUNKS, 256, zn, n * S->zip_cap, msg, ms);
    if (st == KVQ_OK) st = launch_items(c, "kvq_zip_norm_fin_list", 1, 32, zn, n * S->zip_cap, msg, ms);
    if (st == KVQ_OK) st = launch_items(c, "kvq_zip_row_list", 1, 256, zr, n * S->zip_cap, msg, ms);
    /* a compression: the batch's saliency from the cycle's rows, the classes, each page's gather rows */
    if (st == KVQ_OK)
        st = launch_grid(c, "kvq_zip_rowsal_list", (unsigned)S->zc_gx, (unsigned)H, 256, zc, n * S->zip_cap, msg, ms);
    if (st == KVQ_OK) st = launch_items(c, "kvq_zip_select_list", 1, 256, zc, n * S->zip_cap, msg, ms);
    if (st == KVQ_OK) st = launch_items(c, "kvq_zip_gather_list", 1, 256, zg, n * S->zg_cap, msg, ms);
    /* its pages: factors, then codes, per store (cu_step.c's quantize lists) */
    const plan_class *pc = &c->plan->cls[cls];
    for (int s = 0; s < CU_STEP_STORES && st == KVQ_OK; s++) {
        const plan_store *ps = s == 0 ? &pc->k_hi : s == 1 ? &pc->k_lo : s == 2 ? &pc->v_hi : &pc->v_lo;
        if (S->qp_cap[s] && ps->bits >= 1 && ps->bits <= 8)
            st = cu_quant_lists(c, cls, s, qp[s], n * S->qp_cap[s], S->q_maxn[cls][s], msg, ms);
    }
    return st;
}
