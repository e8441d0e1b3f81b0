/* Planned decode steps (kvq.h kvq_engine_reserve_step / kvq_decode_plan / kvq_decode_run; docs/cuda.md "Planned
 * steps"): FlashInfer's split of a step into a host plan, made once per step outside any graph, and a device run
 * per layer whose launches are the same at every step of a batch size, so a captured run of every layer replays.
 *
 * The plan advances each layer's host bookkeeping by one token with the same code as a decode step
 * (cu_qlayer_append: window slots, flush decisions, pages from the engine's pool) while cu_launch records the
 * store and quantize launches it would make as items of the step's tables (cu_step_record) instead of launching
 * them; it then computes every layer's tiles (the changes to each sequence's tile list on the device,
 * cu_step_tiles.c) and split-KV (cu_tiles_per_chunk, as decode_run does) and uploads all the tables with one async
 * copy from page-locked memory to the fixed device addresses kvq_engine_reserve_step allocated. The run converts
 * the caller's q, k, v into fixed buffers and launches the list forms of the store and quantize kernels over the
 * items (an unused item does nothing), the tile patches, the decode kernel with a grid fixed by the capacity (each
 * sequence's split read from the tables) and the merge: kernels, grids and parameter bytes depend on the layer and
 * the batch size only. Every output, cache and statistic equals the
 * decode_run path's bit for bit: the same items, tiles and splits, in the same kernels' bodies. The policy layers'
 * items and launches (TailorKV's retrieval, OTT's competition, ZipCache's probe rows and compressions after the
 * decode kernel) are in cu_step_policy.c. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cu_backend.h"

static size_t al16(size_t n) { return (n + 15) & ~(size_t)15; }

/* The tables of a batch of n: per layer at layer offset l * `layer`, the sequences' tile lists (their device
 * address, count and split), the store and quantize items and the tile patches (fixed sizes); after every
 * layer's, from `tiles`, the patches' tiles packed as the plan writes them, so the step's one copy sends the tiles
 * that changed (a few per sequence and layer), not the lists (cu_step_tiles.c). */
typedef struct {
    size_t seqs, st1, st2, q[CU_STEP_STORES], tk, tkst, ott, ottm, zn, zr, zc, zg, zpos, qp[CU_STEP_STORES], patch;
    size_t layer, tiles;
} tbl_off;

static void tbl_layout(const cu_step *S, int n, int layers, tbl_off *o)
{
    size_t at = 0;
    o->seqs = at, at += al16((size_t)n * sizeof(kvq_seq_tiles));
    o->st1 = at, at += al16((size_t)n * S->st1_cap * sizeof(kvq_store_params));
    o->st2 = at, at += al16((size_t)n * S->st2_cap * sizeof(kvq_store_params));
    for (int s = 0; s < CU_STEP_STORES; s++) o->q[s] = at, at += al16((size_t)n * S->q_cap[s] * sizeof(kvq_quant_params));
    /* the policy layers' items (cu_step_policy.c) */
    o->tk = at, at += al16((size_t)n * S->tk_cap * sizeof(kvq_tk_params));
    o->tkst = at, at += al16((size_t)n * S->tkst_cap * sizeof(kvq_store_params));
    o->ott = at, at += al16((size_t)n * S->ott_cap * sizeof(kvq_ott_params));
    o->ottm = at, at += al16((size_t)n * S->ottm_cap * sizeof(uint64_t));
    o->zn = at, at += al16((size_t)n * S->zip_cap * sizeof(kvq_zip_norm_params));
    o->zr = at, at += al16((size_t)n * S->zip_cap * sizeof(kvq_zip_params));
    o->zc = at, at += al16((size_t)n * S->zip_cap * sizeof(kvq_zip_params));
    o->zg = at, at += al16((size_t)n * S->zg_cap * sizeof(kvq_zip_params));
    o->zpos = at, at += al16((size_t)n * S->zpos_cap * sizeof(int));
    for (int s = 0; s < CU_STEP_STORES; s++)
        o->qp[s] = at, at += al16((size_t)n * S->qp_cap[s] * sizeof(kvq_quant_params));
    o->patch = at, at += al16((size_t)n * CU_STEP_PATCHES * sizeof(kvq_tile_patch));
    o->layer = at;
    o->tiles = at * (size_t)layers;
}
/* Bytes of the tables at batch n with every sequence's lists sent whole (its first plan). */
static size_t tbl_bytes_max(const cu_step *S, int n, int layers)
{
    tbl_off o;
    tbl_layout(S, n, layers, &o);
    return o.tiles + (size_t)layers * n * S->tiles_cap * sizeof(kvq_tile);
}

static const plan_store *class_store(const kvq_backend_ctx *c, int cls, int s)
{
    const plan_class *pc = &c->plan->cls[cls];
    return s == 0 ? &pc->k_hi : s == 1 ? &pc->k_lo : s == 2 ? &pc->v_hi : &pc->v_lo;
}
static int store_quantized(const plan_store *st) { return st->bits >= 1 && st->bits <= 8; }
static const char *const store_names[CU_STEP_STORES] = {"k_hi", "k_lo", "v_hi", "v_lo"};

static int imax(int a, int b) { return a > b ? a : b; }
static int cdiv(long long a, long long b) { return (int)((a + b - 1) / b); }

/* The chunks of a planned launch at batch n: what cu_tiles_per_chunk can split into, and never more than the
 * tiles a sequence may have (it splits at most one chunk per tile). */
static int step_chunks(const kvq_backend_ctx *c, int cls, int n)
{
    int ch = cu_chunks_max(c, cls, n);
    return ch < c->step.tiles_cap ? ch : c->step.tiles_cap;
}

void cu_step_free(kvq_backend_ctx *c)
{
    cu_step *S = &c->step;
    cu_dev_free(c->dev, S->mem);
    for (int i = 0; i < 2; i++) {
        /* a copy from the staging may still be queued: it must have read it before the memory goes */
        char m[256];
        if (S->pending[i]) cu_dev_event_wait(c->dev, S->copied[i], m, sizeof m);
        cu_dev_free_host(c->dev, S->host[i]);
        cu_dev_event_destroy(c->dev, S->copied[i]);
    }
    kvq_free(S->seqs);
    memset(S, 0, sizeof *S);
}

/* ---- capacity ---- */

/* The bounds of one quantized layer's work per sequence and step (cu_qlayer_append's streaming rules: KIVI
 * Alg. 1, flush kivi / group), for sequences of up to T tokens. */
static void layer_bounds(kvq_backend_ctx *c, const kvq_quant_cfg *q, int cls, int T, cu_step *S)
{
    const plan_class *pc = &c->plan->cls[cls];
    int t16 = plan_tile_tokens(pc, 1, 1); /* fp16 rows: sinks, windows (plan_tile_tokens) */
    int st2 = 0, tiles = cdiv(T, pc->tile) + cdiv(q->sinks, t16) + 16;
    for (int w = 0; w < 2; w++) {
        const kvq_tensor_cfg *t = w ? &q->value : &q->key;
        kvq_window_rule r;
        kvq_window_rule_of(q, w, &r);
        int B = r.capacity == 0 ? 1 : r.batch, fp16 = kvq_bits_is_fp16(t->bits);
        int append = r.batch == 1 && (fp16 || (t->gran == KVQ_GRAN_TOKEN && !t->channel_separable));
        int per_page = kvq_flush_page_tokens(t, B); /* flush_pages' cut: one page, or channel groups */
        if (per_page < 1) per_page = 1;
        int pages = append ? 1 : cdiv(B, per_page), maxn = append ? 1 : per_page;
        /* the runs a tile may end at: the pages (at least per_page tokens but for the prefill's and the append
         * page's last), the window's two ring runs */
        tiles += (append ? cdiv(T, KVQ_APPEND_ALIGN) + 1 : cdiv(T, per_page)) + 4 + cdiv(r.capacity, t16);
        if (fp16) {
            if (r.capacity) st2 += pages; /* without a window the token's own store (st1) writes the page */
        } else {
            int s = w ? 2 : 0;
            S->q_cap[s] = imax(S->q_cap[s], pages);
            S->q_maxn[cls][s] = imax(S->q_maxn[cls][s], maxn);
        }
    }
    S->st2_cap = imax(S->st2_cap, st2);
    S->tiles_cap = imax(S->tiles_cap, tiles);
}

kvq_status cu_step_reserve(kvq_backend_ctx *c, int max_batch, int max_tokens, char *msg, size_t ms)
{
    cu_step S;
    memset(&S, 0, sizeof S);
    S.max_batch = max_batch, S.max_tokens = max_tokens;
    S.st1_cap = 2; /* the new token's K and V: into a sink, the window, or (no window) an fp16 page */
    for (int l = 0; l < c->e.dims.layers; l++) {
        const kvq_layer_cfg *lc = kvq_scheme_layer(c->e.scheme, l);
        if (lc->mode != KVQ_MODE_SPARSE) layer_bounds(c, &lc->quant, c->plan->layer_class[l], max_tokens, &S);
        cu_step_policy_bounds(c, lc, c->plan->layer_class[l], max_tokens, &S);
    }
    if (S.tiles_cap < 1) S.tiles_cap = 1;
    /* gridDim.z of the list launches: the items of the whole batch */
    int zmax = imax(imax(S.st1_cap, S.st2_cap), imax(imax(S.q_cap[0], S.q_cap[1]), imax(S.q_cap[2], S.q_cap[3])));
    zmax = imax(zmax, imax(imax(S.tk_cap, S.tkst_cap), imax(S.ott_cap, S.zg_cap)));
    for (int s = 0; s < CU_STEP_STORES; s++) zmax = imax(zmax, S.qp_cap[s]);
    if ((long long)max_batch * zmax > CU_GRID_YZ_MAX) {
        snprintf(msg, ms, "a batch of %d needs %lld work items per launch, more than gridDim.z's %u", max_batch,
                 (long long)max_batch * zmax, CU_GRID_YZ_MAX);
        return KVQ_ERR_SHAPE;
    }
    int H = c->H, Hq = c->Hq, D = c->D;
    size_t part = 0;
    for (int k = 0; k < c->plan->n_classes; k++)
        for (int n = 1; n <= max_batch; n++) {
            int ch = cu_chunks_max(c, k, n);
            if (ch > S.tiles_cap) ch = S.tiles_cap;
            size_t b = (size_t)n * Hq * ch * (D + 1) * sizeof(float);
            if (b > part) part = b;
        }
    S.tables_bytes = tbl_bytes_max(&S, max_batch, c->e.dims.layers);
    /* the sequences' device tile lists (cu_step_tiles.c) come from the pool when they first enter a plan: room
     * for a full batch now, so no plan allocates a slab */
    size_t arrays = (size_t)max_batch * (size_t)c->e.dims.layers * (size_t)S.tiles_cap * sizeof(kvq_tile);
    size_t qb = al16((size_t)max_batch * Hq * D * sizeof(float)), lb = al16((size_t)max_batch * Hq * sizeof(float));
    size_t kb = al16((size_t)max_batch * 2 * H * D * 2);
    S.zaux_seq = al16(S.zaux_seq);
    S.mem_bytes = 2 * qb + lb + kb + al16(part) + S.tables_bytes + (size_t)max_batch * (S.pol_seq + S.zaux_seq);
    S.seqs = kvq_calloc((size_t)max_batch, sizeof *S.seqs);
    kvq_status st = S.seqs ? cu_dev_alloc(c->dev, S.mem_bytes, &S.mem, msg, ms) : KVQ_ERR_NOMEM;
    if (st == KVQ_OK) st = cu_pool_reserve(c, arrays, msg, ms);
    for (int i = 0; i < 2 && st == KVQ_OK; i++) {
        uint64_t unused;
        void *h = NULL;
        st = cu_dev_alloc_host(c->dev, S.tables_bytes, &h, &unused, msg, ms);
        S.host[i] = h;
        if (st == KVQ_OK) st = cu_dev_event_create(c->dev, &S.copied[i], msg, ms);
    }
    if (st != KVQ_OK) { /* the reservation in force, if any, stays */
        cu_dev_free(c->dev, S.mem);
        for (int i = 0; i < 2; i++) cu_dev_free_host(c->dev, S.host[i]), cu_dev_event_destroy(c->dev, S.copied[i]);
        kvq_free(S.seqs);
        if (st == KVQ_ERR_NOMEM) snprintf(msg, ms, "out of memory");
        return st;
    }
    cu_step_free(c); /* a new reservation replaces the old one (new addresses: capture again) */
    S.q = S.mem, S.out = S.q + qb, S.lse = S.out + qb, S.kvin = S.lse + lb, S.part = S.kvin + kb;
    S.tables = S.part + al16(part);
    S.pol = S.tables + S.tables_bytes;
    c->step = S;
    return KVQ_OK;
}

/* ---- the plan ---- */

kvq_status cu_step_record(kvq_backend_ctx *c, const char *kernel, unsigned gx, unsigned gy, const void *params,
                          size_t size, char *msg, size_t ms)
{
    (void)gx, (void)gy;
    cu_rec *r = c->rec;
    const cu_step *S = &c->step;
    kvq_status pst;
    if (cu_step_policy_record(c, kernel, params, size, &pst, msg, ms)) return pst; /* TailorKV's, OTT's */
    if (!strcmp(kernel, "kvq_store_f16") && size == sizeof(kvq_store_params)) {
        kvq_store_params sp;
        memcpy(&sp, params, sizeof sp);
        int own = sp.src.base >= r->kvin && sp.src.base < r->kvin_end;
        if (own ? r->n1 == S->st1_cap : r->n2 == S->st2_cap) {
            snprintf(msg, ms, "cuda: internal error: a planned step stores more rows than its bound (%d)",
                     own ? S->st1_cap : S->st2_cap);
            return KVQ_ERR_INTERNAL;
        }
        if (own)
            r->st1[r->n1++] = sp;
        else
            r->st2[r->n2++] = sp;
        return KVQ_OK;
    }
    /* a separable store's factor kernel: the run launches the factor list before the quantize list, over the
     * same items (the factors are computed from the item's rows, as page_write's pair of launches does) */
    if (!strncmp(kernel, "kvq_factor_", 11)) return KVQ_OK;
    for (int s = 0; s < CU_STEP_STORES && !strncmp(kernel, "kvq_quant_", 10); s++) {
        if (strncmp(kernel + 10, store_names[s], 4) || size != sizeof(kvq_quant_params)) continue;
        kvq_quant_params qp;
        memcpy(&qp, params, sizeof qp);
        if (r->nq[s] == S->q_cap[s] || qp.n > S->q_maxn[r->cls][s]) {
            snprintf(msg, ms,
                     "cuda: internal error: a planned step's quantize work (%d items, %d tokens) exceeds its bound "
                     "(%d items, %d tokens)",
                     r->nq[s] + 1, qp.n, S->q_cap[s], S->q_maxn[r->cls][s]);
            return KVQ_ERR_INTERNAL;
        }
        r->q[s][r->nq[s]++] = qp;
        return KVQ_OK;
    }
    snprintf(msg, ms, "cuda: internal error: %s cannot be part of a planned step", kernel);
    return KVQ_ERR_INTERNAL;
}

/* What a planned step cannot do: ZipCache without a window (each token its own compression, classes decided on
 * the host), capacities beyond the reservation (docs/cuda.md "Planned steps"). */
static kvq_status check_plannable(const kvq_backend_ctx *c, kvq_backend_seq *const *seqs, int n, char *msg, size_t ms)
{
    const cu_step *S = &c->step;
    if (!S->max_batch) {
        snprintf(msg, ms, "no step capacity: call kvq_engine_reserve_step first");
        return KVQ_ERR_STATE;
    }
    if (n > S->max_batch) {
        snprintf(msg, ms, "a batch of %d sequences is beyond the step capacity of %d (kvq_engine_reserve_step)", n,
                 S->max_batch);
        return KVQ_ERR_SHAPE;
    }
    for (int l = 0; l < c->e.dims.layers; l++)
        for (int i = 0; i < n; i++) {
            const cu_layer *L = seqs[i]->layers[l];
            if (L && !L->sparse && L->q.saliency && L->q.rule[0].capacity == 0) {
                snprintf(msg, ms,
                         "layer %d has saliency classes without a window (ZipCache: every token its own "
                         "compression): planned steps cover ZipCache with a window; capture such steps one at a time "
                         "with kvq_decode_device (docs/cuda.md)",
                         l);
                return KVQ_ERR_UNSUPPORTED;
            }
            int len = !L ? 0 : L->sparse ? L->s.length : L->q.length;
            if (L && len + 1 > S->max_tokens) {
                snprintf(msg, ms,
                         "sequence %d layer %d: %d tokens after the step, beyond the step capacity of %d "
                         "(kvq_engine_reserve_step)",
                         i, l, len + 1, S->max_tokens);
                return KVQ_ERR_SHAPE;
            }
        }
    return KVQ_OK;
}

/* Layer l of every sequence: the token's work recorded, the tiles and the split into the host tables. */
static kvq_status plan_layer(kvq_backend_ctx *c, int l, kvq_backend_seq *const *seqs, int n, unsigned char *tb,
                             const tbl_off *o, size_t *tiles_at, char *msg, size_t ms)
{
    cu_step *S = &c->step;
    int cls = c->plan->layer_class[l], H = c->H, D = c->D;
    size_t kvi = (size_t)2 * H * D * 2;
    unsigned char *hb = tb + (size_t)l * o->layer;
    kvq_seq_tiles *sq = (kvq_seq_tiles *)(hb + o->seqs);
    int max_tiles = 1;
    kvq_status st = KVQ_OK;
    for (int i = 0; i < n && st == KVQ_OK; i++) {
        cu_layer *L = seqs[i]->layers[l];
        cu_rec r;
        memset(&r, 0, sizeof r);
        r.st1 = (kvq_store_params *)(hb + o->st1) + (size_t)i * S->st1_cap;
        r.st2 = (kvq_store_params *)(hb + o->st2) + (size_t)i * S->st2_cap;
        for (int s = 0; s < CU_STEP_STORES; s++) r.q[s] = (kvq_quant_params *)(hb + o->q[s]) + (size_t)i * S->q_cap[s];
        r.kvin = S->kvin, r.kvin_end = S->kvin + (uint64_t)n * kvi, r.cls = cls;
        if (S->tk_cap && L->sparse) {
            r.tk = (kvq_tk_params *)(hb + o->tk) + (size_t)i * S->tk_cap;
            r.tkst = (kvq_store_params *)(hb + o->tkst) + (size_t)i * S->tkst_cap;
        }
        if (S->zip_cap && !L->sparse && L->q.saliency) {
            r.zn = (kvq_zip_norm_params *)(hb + o->zn) + (size_t)i * S->zip_cap;
            r.zr = (kvq_zip_params *)(hb + o->zr) + (size_t)i * S->zip_cap;
            r.zc = (kvq_zip_params *)(hb + o->zc) + (size_t)i * S->zip_cap;
            r.zg = (kvq_zip_params *)(hb + o->zg) + (size_t)i * S->zg_cap;
            for (int s = 0; s < CU_STEP_STORES; s++) r.qp[s] = (kvq_quant_params *)(hb + o->qp[s]) + (size_t)i * S->qp_cap[s];
            r.zpos_host = (int *)(hb + o->zpos) + (size_t)i * S->zpos_cap;
            r.zpos_dev = S->tables + (uint64_t)(hb - tb) + o->zpos + (uint64_t)i * S->zpos_cap * sizeof(int);
            r.zaux = S->pol + (uint64_t)S->max_batch * S->pol_seq + (uint64_t)i * S->zaux_seq;
            r.zaux_bytes = S->zaux_seq;
        }
        if (S->ott_cap && !L->sparse) {
            r.ott = (kvq_ott_params *)(hb + o->ott) + (size_t)i * S->ott_cap;
            r.ottm_host = (uint64_t *)(hb + o->ottm) + (size_t)i * S->ottm_cap;
            r.ottm_dev = S->tables + (uint64_t)(hb - tb) + o->ottm + (uint64_t)i * S->ottm_cap * sizeof(uint64_t);
        }
        r.pol = S->pol + (uint64_t)i * S->pol_seq, r.pol_bytes = S->pol_seq;
        c->rec = &r;
        /* the step's query (TailorKV's retrieval reads it) is converted into S->q by the run */
        st = L->sparse ? cu_slayer_append(c, &L->s, S->kvin + (uint64_t)i * kvi,
                                          S->q + (uint64_t)i * c->Hq * D * sizeof(float), msg, ms)
                       : cu_qlayer_append(c, &L->q, S->kvin + (uint64_t)i * kvi, msg, ms);
        c->rec = NULL;
        if (st != KVQ_OK) {
            char tmp[512];
            snprintf(tmp, sizeof tmp, "sequence %d layer %d: %s", i, l, msg);
            snprintf(msg, ms, "%s", tmp);
            break;
        }
        /* the tiles that changed go into the tables as patches of the sequence's device list */
        kvq_tile_patch *pt = (kvq_tile_patch *)(hb + o->patch) + (size_t)i * CU_STEP_PATCHES;
        st = cu_step_tiles_plan(c, seqs[i], l, tb, S->tables, tiles_at, pt, &sq[i], msg, ms);
        if (st != KVQ_OK) {
            char tmp[512];
            snprintf(tmp, sizeof tmp, "sequence %d layer %d: %s", i, l, msg);
            snprintf(msg, ms, "%s", tmp);
            break;
        }
        int nt = sq[i].n_tiles;
        if (nt > max_tiles) max_tiles = nt;
        /* ZipCache: what runs after the attention (a probe row over the step's tiles, a compression), recorded
         * for the run's second part */
        if (st == KVQ_OK && !L->sparse && L->q.saliency) {
            r.post = 1;
            c->rec = &r;
            st = cu_qlayer_after_attend(c, &L->q, S->q + (uint64_t)i * c->Hq * D * sizeof(float), &sq[i], msg, ms);
            c->rec = NULL;
            if (st != KVQ_OK) {
                char tmp[512];
                snprintf(tmp, sizeof tmp, "sequence %d layer %d: %s", i, l, msg);
                snprintf(msg, ms, "%s", tmp);
            }
        }
    }
    if (st != KVQ_OK) return st;
    /* decode_run's split of the same tiles (so the outputs are the same bits); the grid has step_chunks chunks */
    int tpc = cu_tiles_per_chunk(c, cls, n, max_tiles);
    if (cdiv(max_tiles, tpc) > step_chunks(c, cls, n)) {
        snprintf(msg, ms, "cuda: internal error: a split of %d chunks, the planned grid has %d", cdiv(max_tiles, tpc),
                 step_chunks(c, cls, n));
        return KVQ_ERR_INTERNAL;
    }
    for (int i = 0; i < n; i++) sq[i].tiles_per_chunk = tpc;
    return KVQ_OK;
}

kvq_status cu_step_plan(kvq_backend_ctx *c, kvq_backend_seq *const *seqs, int n, void *stream, char *msg, size_t ms)
{
    kvq_status st = check_plannable(c, seqs, n, msg, ms);
    if (st != KVQ_OK) return st;
    cu_step *S = &c->step;
    int layers = c->e.dims.layers;
    tbl_off o;
    tbl_layout(S, n, layers, &o);
    size_t tiles_at = o.tiles;
    /* the other page-locked buffer than the last plan's, whose copy may still be queued; the copy made from this
     * one two plans ago must have run before it is written (its event; at once in a decode loop, which waited
     * for that step's outputs) */
    int k = S->slot ^ 1;
    unsigned char *tb = S->host[k];
    S->tiles_built = 0;
    if (S->pending[k]) {
        st = cu_dev_event_wait(c->dev, S->copied[k], msg, ms);
        if (st != KVQ_OK) return st;
        S->pending[k] = 0;
    }
    memset(tb, 0, o.tiles); /* unused items: n = 0, nothing to do */
    cu_snap *snap = kvq_calloc((size_t)layers * n, sizeof *snap);
    if (!snap) {
        snprintf(msg, ms, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    int saved = 0;
    for (int l = 0; l < layers && st == KVQ_OK; l++)
        for (int i = 0; i < n && st == KVQ_OK; i++)
            if ((st = cu_step_layer_save(seqs[i]->layers[l], &snap[(size_t)l * n + i])) == KVQ_OK) saved++;
    if (st == KVQ_OK) { /* the sequences' device tile lists (a block put back is zeroed on the plan's stream) */
        void *prev = cu_dev_stream(c->dev);
        if (stream) cu_dev_set_stream(c->dev, stream);
        for (int i = 0; i < n && st == KVQ_OK; i++) st = cu_step_tiles_prepare(c, seqs[i], msg, ms);
        cu_dev_set_stream(c->dev, prev);
    }
    for (int l = 0; l < layers && st == KVQ_OK; l++) st = plan_layer(c, l, seqs, n, tb, &o, &tiles_at, msg, ms);
    if (st == KVQ_OK) {
        void *prev = cu_dev_stream(c->dev);
        if (stream) cu_dev_set_stream(c->dev, stream);
        st = cu_dev_h2d_async(c->dev, S->tables, tb, tiles_at, msg, ms); /* the step's one copy */
        if (st == KVQ_OK) {
            kvq_status er = cu_dev_event_record(c->dev, S->copied[k], msg, ms);
            /* without the event the next reuse waits for the whole stream instead */
            if (er == KVQ_OK) S->pending[k] = 1;
            else st = cu_dev_sync(c->dev, msg, ms);
        }
        cu_dev_set_stream(c->dev, prev);
    }
    if (st == KVQ_OK) {
        for (int l = 0; l < layers; l++)
            for (int i = 0; i < n; i++) cu_step_layer_commit(c, seqs[i]->layers[l]), cu_step_tiles_commit(seqs[i], l);
        S->slot ^= 1;
        S->planned = 1, S->n = n;
        memcpy(S->seqs, seqs, (size_t)n * sizeof *seqs);
    } else {
        if (st == KVQ_ERR_NOMEM) snprintf(msg, ms, "out of memory");
        /* every layer of every sequence back as it was (the pages the plan took go back to the pool) */
        for (int x = saved - 1; x >= 0; x--) cu_step_layer_restore(c, seqs[x % n]->layers[x / n], &snap[x]);
        S->planned = 0;
    }
    for (int x = 0; x < layers * n; x++) kvq_free(snap[x].probe_pos);
    kvq_free(snap);
    return st;
}

/* ---- the run of one layer ---- */

static kvq_status run_layer(kvq_backend_ctx *c, int layer, int n, const kvq_dev_decode *dv, char *msg, size_t ms)
{
    const cu_step *S = &c->step;
    int H = c->H, cls = c->plan->layer_class[layer];
    tbl_off o;
    tbl_layout(S, n, c->e.dims.layers, &o);
    uint64_t base = S->tables + (uint64_t)layer * o.layer;
    /* one launch: q to fp32 [n][Hq][D], k and v to fp16 rows [n][2][H][D] as decode_run converts them, the new
     * tokens into their sinks, windows or fp16 pages (the flushes after it read the windows), and the tiles that
     * changed into the sequences' device lists, which the decode kernel reads */
    kvq_status st = cu_step_in(c, dv, n, S->q, S->kvin, base + o.st1, n * S->st1_cap, base + o.patch,
                               n * CU_STEP_PATCHES, msg, ms);
    /* the policy layers' retrievals or competitions, which read the windows the new tokens are in */
    if (st == KVQ_OK) st = cu_step_policy_run(c, layer, n, base + o.tk, base + o.tkst, base + o.ott, msg, ms);
    if (st == KVQ_OK && S->st2_cap)
        st = cu_list_launch(c, "kvq_store_f16_list", (unsigned)H, 1, base + o.st2, n * S->st2_cap, msg, ms);
    /* every quantized store's items in one launch */
    uint64_t qi[CU_STEP_STORES];
    int qn[CU_STEP_STORES];
    for (int s = 0; s < CU_STEP_STORES; s++) {
        qi[s] = base + o.q[s];
        qn[s] = S->q_cap[s] && store_quantized(class_store(c, cls, s)) ? n * S->q_cap[s] : 0;
    }
    if (st == KVQ_OK) st = cu_quant_lists_all(c, cls, qi, qn, S->q_maxn[cls], msg, ms);
    /* the decode kernel over the planned tiles, its chunks fixed by the capacity, and the merge */
    int nch = step_chunks(c, cls, n);
    /* tpc 1: each sequence's split is in the tables */
    const uint64_t out = cu_out_rows(c, dv, S->out); /* the caller's rows, or ours */
    if (st == KVQ_OK) st = cu_decode_launch(c, cls, n, nch, 1, S->q, base + o.seqs, out, S->lse, S->part, 0, msg, ms);
    /* ZipCache: probe rows and compressions after the attention, as decode_run orders them */
    uint64_t qp[CU_STEP_STORES];
    for (int s = 0; s < CU_STEP_STORES; s++) qp[s] = base + o.qp[s];
    if (st == KVQ_OK)
        st = cu_step_policy_post(c, layer, n, base + o.zn, base + o.zr, base + o.zc, base + o.zg, qp, msg, ms);
    /* the outputs in the caller's dtype and strides; lse from base 2 to natural logarithms */
    if (st == KVQ_OK) st = cu_convert_out(c, dv, n, out, S->lse, msg, ms);
    return st;
}

kvq_status cu_step_run(kvq_backend_ctx *c, int layer, kvq_backend_seq *const *seqs, int n, const kvq_dev_decode *d,
                       char *msg, size_t ms)
{
    const cu_step *S = &c->step;
    if (!S->planned) {
        snprintf(msg, ms, "no planned step: call kvq_decode_plan first");
        return KVQ_ERR_STATE;
    }
    if (n != S->n || memcmp(seqs, S->seqs, (size_t)n * sizeof *seqs)) {
        snprintf(msg, ms, "the batch is not the one planned (%d sequences planned, in that order)", S->n);
        return KVQ_ERR_INVALID;
    }
    void *prev = cu_dev_stream(c->dev);
    if (d->stream) cu_dev_set_stream(c->dev, d->stream);
    kvq_status st = run_layer(c, layer, n, d, msg, ms);
    cu_dev_set_stream(c->dev, prev);
    /* the layer's patches may not have reached the device lists: the next plan sends them whole */
    if (st != KVQ_OK)
        for (int i = 0; i < n; i++) cu_step_tiles_forget(seqs[i], layer);
    return st;
}
