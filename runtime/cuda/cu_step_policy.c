/* The policy layers of planned decode steps (docs/cuda.md "Planned steps"): TailorKV's sparse layers and OTT's
 * outlier pools. Their decisions stay on the device as in a decode step; what the plan adds is that their
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
 *   scratch, and the key pages' mask addresses (for unmasking an evicted token, spill 0) travel in the tables.
 *
 * The launches are recorded by the same code as a decode step's (cu_slayer_append, cu_ott_compete) while c->rec
 * is set: cu_step_policy_record takes them. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cu_backend.h"

static size_t al16(size_t n) { return (n + 15) & ~(size_t)15; }
static int imax(int a, int b) { return a > b ? a : b; }
static int cdiv(long long a, long long b) { return (int)((a + b - 1) / b); }

void cu_step_policy_bounds(kvq_backend_ctx *c, const kvq_layer_cfg *lc, int cls, int T, cu_step *S)
{
    int H = c->H, D = c->D, tile = c->plan->cls[cls].tile;
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
}

int cu_step_policy_record(kvq_backend_ctx *c, const char *kernel, const void *params, size_t size, kvq_status *st,
                          char *msg, size_t ms)
{
    cu_rec *r = c->rec;
    const cu_step *S = &c->step;
    *st = KVQ_OK;
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

static kvq_status launch_items(kvq_backend_ctx *c, const char *kernel, unsigned gy, unsigned block, uint64_t items,
                               int n_items, char *msg, size_t ms)
{
    kvq_list_params lp;
    memset(&lp, 0, sizeof lp);
    lp.items = items, lp.n_items = n_items;
    const unsigned g[3] = {(unsigned)c->H, gy, (unsigned)n_items}, b[3] = {block, 1, 1};
    return cu_dev_launch(c->dev, c->mod, kernel, g, b, &lp, sizeof lp, msg, ms);
}

kvq_status cu_step_policy_run(kvq_backend_ctx *c, int layer, int n, uint64_t tk, uint64_t tkst, uint64_t ott,
                              char *msg, size_t ms)
{
    const cu_step *S = &c->step;
    const kvq_layer_cfg *lc = kvq_scheme_layer(c->e.scheme, layer);
    kvq_status st = KVQ_OK;
    if (c->e.layer_sparse[layer]) {
        /* every step retrieves: the top-k of every sequence, then their K and V rows gathered */
        st = launch_items(c, "kvq_tk_select_list", 1, 256, tk, n * S->tk_cap, msg, ms);
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
