/* OTT's outlier and spill pools on the device (Su et al. 2025, Sec. 3.2 and App. E). The competition of each flush
 * runs in kvq_ott_compete (templates/kvq_policy.cuh), deciding exactly what ref_outlier_step decides: the flush's
 * key L1 norms, its rank order, the admissions against the pool's worst member, the spill pool or the unmasking of
 * an evicted token's body slot, and the group-mean replacement of the pooled tokens in the rows the quantize
 * kernels then read. The pool state lives in two copies (cu_backend.h: cu_ott) so that a decode step can be
 * abandoned after its competition ran: the step's tiles read the copy it wrote, the batch adopts it at the end. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cu_backend.h"
#include "half.h"

static uint64_t meta_field(const kvq_backend_ctx *c, const cu_ott *o, int copy, int field)
{
    return o->meta[copy] + (uint64_t)kvq_ott_meta_off(c->H, o->keep, o->spill, field);
}

void cu_ott_free(kvq_backend_ctx *c, cu_ott *o)
{
    for (int i = 0; i < 2; i++) {
        cu_dev_free(c->dev, o->rows[i]);
        cu_dev_free(c->dev, o->meta[i]);
    }
    cu_dev_free(c->dev, o->srows);
    kvq_free(o->count);
    memset(o, 0, sizeof *o);
}

kvq_status cu_ott_init(kvq_backend_ctx *c, cu_ott *o, int keep, int spill, char *msg, size_t n)
{
    memset(o, 0, sizeof *o);
    int H = c->H;
    o->keep = keep, o->spill = spill;
    o->rows_bytes = kvq_window_bytes(H, c->D, keep);
    o->srows_bytes = kvq_window_bytes(H, c->D, spill);
    o->meta_bytes = (size_t)kvq_ott_meta_off(H, keep, spill, KVQ_OM_END);
    o->count = kvq_calloc(2 * (size_t)H, sizeof *o->count);
    if (!o->count) {
        snprintf(msg, n, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    kvq_status st = KVQ_OK; /* device memory is zeroed: empty pools */
    for (int i = 0; i < 2 && st == KVQ_OK; i++) {
        st = cu_dev_alloc(c->dev, o->rows_bytes, &o->rows[i], msg, n);
        if (st == KVQ_OK) st = cu_dev_alloc(c->dev, o->meta_bytes, &o->meta[i], msg, n);
    }
    if (st == KVQ_OK && spill > 0) st = cu_dev_alloc(c->dev, o->srows_bytes, &o->srows, msg, n);
    if (st != KVQ_OK) cu_ott_free(c, o);
    return st;
}

kvq_status cu_ott_compete(kvq_backend_ctx *c, cu_qlayer *L, const kvq_rows *k, const kvq_rows *v, int B, int first_pos,
                          int pg, uint64_t *rows, uint64_t *flags, char *msg, size_t n)
{
    cu_ott *o = &L->ott;
    int H = c->H, D = c->D, N = o->keep, G = L->cfg->key.group > 0 ? L->cfg->key.group : 0;
    int n_pages = G > 0 ? (B + G - 1) / G : 1;
    if (o->pending || B <= 0 || N <= 0 || !k->f16 || !v->f16) {
        snprintf(msg, n, "cuda: internal error: OTT competition of %d tokens out of sequence", B);
        return KVQ_ERR_INTERNAL;
    }
    /* c->pol: rows to quantize [2][H][B][D] fp16 | pooled flags | key pages' mask sections | work */
    size_t rows_b = 2 * (size_t)H * B * D * 2, flags_b = ((size_t)H * B + 15) & ~(size_t)15;
    size_t mask_b = (size_t)n_pages * 8, work_b = (size_t)H * (2 * (size_t)B + 4 * (size_t)N + 8) * 4;
    /* the engine's policy scratch, or in a plan the sequence's (cu_step_policy.c) */
    size_t need = rows_b + flags_b + mask_b + work_b;
    cu_rec *rec = c->rec;
    if (rec && (need > rec->pol_bytes || n_pages > c->step.ottm_cap)) {
        snprintf(msg, n, "cuda: internal error: a planned competition needs %zu bytes and %d pages, %zu and %d reserved",
                 need, n_pages, rec->pol_bytes, c->step.ottm_cap);
        return KVQ_ERR_INTERNAL;
    }
    kvq_status st = rec ? KVQ_OK : cu_scratch(c, &c->pol, &c->pol_bytes, need, msg, n);
    if (st != KVQ_OK) return st;
    uint64_t pol = rec ? rec->pol : c->pol;
    kvq_ott_params p;
    memset(&p, 0, sizeof p);
    p.k = *k, p.v = *v;
    p.meta_in = o->meta[o->cur], p.meta_out = o->meta[o->cur ^ 1];
    p.pool_in = o->rows[o->cur], p.pool_out = o->rows[o->cur ^ 1], p.spill = o->srows;
    p.out_k = pol, p.out_v = pol + rows_b / 2, p.flags = pol + rows_b;
    p.work = pol + rows_b + flags_b + mask_b;
    p.B = B, p.first_pos = first_pos, p.keep = N, p.spill_cap = o->spill;
    p.largest = L->cfg->outliers.metric == KVQ_OUTLIER_KEY_L1_LARGEST;
    p.group = G;
    if (o->spill == 0) {
        /* an evicted member returns to the body: the kernel unmasks its key slot, so it needs the key pages' mask
         * sections (those of this flush; earlier members carry theirs in the pool state) */
        uint64_t *mb = kvq_malloc(mask_b);
        if (!mb) {
            snprintf(msg, n, "out of memory");
            return KVQ_ERR_NOMEM;
        }
        for (int j = 0; j < n_pages; j++) {
            const cu_page *pgp = L->pages[0][pg + j];
            mb[j] = pgp->addr + (uint64_t)pgp->lay.mask;
        }
        if (rec) { /* a plan: the addresses travel in its tables (its one copy) */
            memcpy(rec->ottm_host, mb, mask_b);
            p.mask = rec->ottm_dev;
        } else {
            p.mask = pol + rows_b + flags_b;
            st = cu_upload(c, p.mask, mb, mask_b, msg, n);
        }
        kvq_free(mb);
    }
    if (st == KVQ_OK) st = cu_launch(c, "kvq_ott_compete", (unsigned)H, 1, 1, 256, &p, sizeof p, msg, n);
    if (st != KVQ_OK) return st;
    /* the counts stay on the device: the step's tiles read them there (kvq_tile.count), the statistics fetch them
     * when asked (cu_ott_account) */
    o->pending = 1;
    o->unmasked = o->spill == 0;
    *rows = pol;
    *flags = p.flags;
    return st;
}

void cu_ott_commit(kvq_backend_ctx *c, cu_ott *o)
{
    if (!o->pending) return;
    (void)c;
    o->cur ^= 1;
    o->stale = 1;
    o->pending = o->unmasked = 0;
}

kvq_status cu_ott_undo(kvq_backend_ctx *c, cu_ott *o, char *msg, size_t n)
{
    kvq_status st = KVQ_OK;
    if (o->pending && o->unmasked) {
        kvq_ott_params p;
        memset(&p, 0, sizeof p);
        p.meta_out = o->meta[o->cur ^ 1], p.keep = o->keep, p.spill_cap = o->spill;
        st = cu_launch(c, "kvq_ott_undo", (unsigned)c->H, 1, 1, 32, &p, sizeof p, msg, n);
    }
    o->pending = o->unmasked = 0;
    return st;
}

void cu_ott_tiles(kvq_backend_ctx *c, const cu_ott *o, int tile, int *nt)
{
    int cp = o->cur ^ o->pending; /* this step's competition, when it ran */
    for (int i = 0; i < 2; i++) {
        int cap = i ? o->spill : o->keep;
        uint64_t base = i ? o->srows : o->rows[cp];
        /* A pool is cut into tiles of at most the plan's tile (the decode kernel stages a tile in shared memory
         * sized for `tile` rows); each tile's kv head h attends to its slots below count[h] (kvq_tile.count). */
        for (int s = 0; s < cap && *nt >= 0; s += tile) {
            kvq_tile t;
            memset(&t, 0, sizeof t);
            t.k = base, t.v = base + kvq_window_tensor_bytes(c->H, c->D, cap), t.k_cap = t.v_cap = cap;
            t.k_slot = t.v_slot = s, t.n = cap - s < tile ? cap - s : tile;
            t.count = meta_field(c, o, cp, i ? KVQ_OM_SCOUNT : KVQ_OM_COUNT);
            t.kinds = KVQ_SRC_F16 | KVQ_SRC_F16 << 8;
            cu_tiles_push(c, nt, t);
        }
    }
}

void cu_ott_account(const kvq_backend_ctx *c, cu_ott *o, kvq_mem_stats *out)
{
    /* the pool and spill counts of the adopted copy, fetched when a competition ran since the last time (a
     * synchronous copy: statistics are asked for outside steps); if the device fails the copy, the last counts
     * fetched are reported */
    if (o->stale) {
        char msg[256];
        if (cu_dev_d2h(c->dev, o->count, meta_field(c, o, o->cur, KVQ_OM_COUNT), (size_t)c->H * sizeof(int), msg,
                       sizeof msg) == KVQ_OK &&
            cu_dev_d2h(c->dev, o->count + c->H, meta_field(c, o, o->cur, KVQ_OM_SCOUNT), (size_t)c->H * sizeof(int),
                       msg, sizeof msg) == KVQ_OK)
            o->stale = 0;
    }
    /* one copy of each, as the reference holds them: the second copy is the step's transaction buffer */
    out->bytes[KVQ_SEG_OUTLIER] += o->rows_bytes;
    out->bytes[KVQ_SEG_SPILL] += o->spill > 0 ? o->srows_bytes : 0;
    for (int h = 0; h < c->H; h++) {
        out->tokens[KVQ_SEG_OUTLIER] += 2 * (uint64_t)o->count[h];
        out->tokens[KVQ_SEG_SPILL] += 2 * (uint64_t)o->count[c->H + h];
    }
}

kvq_status cu_ott_read(kvq_backend_ctx *c, const cu_ott *o, float *k, float *v, int capacity, char *msg, size_t n)
{
    int H = c->H, D = c->D, cp = o->cur ^ o->pending;
    unsigned char *meta = kvq_malloc(o->meta_bytes);
    uint16_t *rows = kvq_malloc(o->rows_bytes + o->srows_bytes + 2);
    kvq_status st = meta && rows ? KVQ_OK : KVQ_ERR_NOMEM;
    if (st == KVQ_OK) st = cu_dev_d2h(c->dev, meta, o->meta[cp], o->meta_bytes, msg, n);
    if (st == KVQ_OK) st = cu_dev_d2h(c->dev, rows, o->rows[cp], o->rows_bytes, msg, n);
    if (st == KVQ_OK && o->spill > 0)
        st = cu_dev_d2h(c->dev, rows + o->rows_bytes / 2, o->srows, o->srows_bytes, msg, n);
    for (int i = 0; i < 2 && st == KVQ_OK; i++) {
        int cap = i ? o->spill : o->keep;
        const int *cnt = (const int *)(meta + kvq_ott_meta_off(H, o->keep, o->spill, i ? KVQ_OM_SCOUNT : KVQ_OM_COUNT));
        const int *pos = (const int *)(meta + kvq_ott_meta_off(H, o->keep, o->spill, i ? KVQ_OM_SPOS : KVQ_OM_POS));
        const uint16_t *rk = rows + (i ? o->rows_bytes / 2 : 0), *rv = rk + (size_t)H * cap * D;
        for (int h = 0; h < H; h++)
            for (int s = 0; s < cnt[h] && s < cap; s++) {
                size_t off = ((size_t)h * cap + s) * D, at = ((size_t)h * capacity + pos[h * cap + s]) * D;
                kvq_f32_from_f16_n(k + at, rk + off, (size_t)D);
                kvq_f32_from_f16_n(v + at, rv + off, (size_t)D);
            }
    }
    kvq_free(meta);
    kvq_free(rows);
    if (st == KVQ_ERR_NOMEM) snprintf(msg, n, "out of memory");
    return st;
}
