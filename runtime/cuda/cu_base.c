/* The helpers below the cuda backend's layer files (cu_qlayer.c, cu_slayer.c, cu_ott.c, cu_saliency.c, cu_calib.c)
 * and its planned steps (cu_step*.c): device scratch, the page-locked staging and uploads, launches, fp16 windows,
 * tile lists, split-KV and the decode launch, the device tensors' conversions, the list launches of planned steps
 * and the plan's gather-row region (used by cu_step.c, cu_step_policy.c and cu_qlayer.c alike). They call only the
 * device layer
 * (cu_dev.h) and the pool (cu_pool.c), never up: a launch while a plan records goes to the plan through the
 * context's `record` hook (cu_step_record), so that the backend's files form layers, not a circle (docs/cuda.md
 * "Source files"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cu_backend.h"

/* Grows a scratch buffer to `need` bytes (doubling). The old buffer is not freed here: cuMemFree synchronises the
 * device (and a stream capture refuses it), and its last users may still be queued. It is retired and freed
 * outside any step: at the next reservation or with the engine (cu_scratch_release). */
kvq_status cu_scratch(kvq_backend_ctx *c, uint64_t *buf, size_t *have, size_t need, char *msg, size_t n)
{
    if (need <= *have && *buf) return KVQ_OK;
    size_t cap = *have ? *have : 4096;
    while (cap < need) cap *= 2;
    if (*buf && c->n_retired == c->cap_retired) {
        int rc = c->cap_retired ? 2 * c->cap_retired : 16;
        uint64_t *nr = kvq_realloc(c->retired, (size_t)rc * sizeof *nr);
        if (!nr) {
            snprintf(msg, n, "out of memory");
            return KVQ_ERR_NOMEM;
        }
        c->retired = nr, c->cap_retired = rc;
    }
    uint64_t nb = 0;
    kvq_status st = cu_dev_alloc(c->dev, cap, &nb, msg, n);
    if (st != KVQ_OK) return st;
    if (*buf) c->retired[c->n_retired++] = *buf;
    *buf = nb;
    *have = cap;
    return KVQ_OK;
}

void cu_scratch_release(kvq_backend_ctx *c)
{
    for (int i = 0; i < c->n_retired; i++) cu_dev_free(c->dev, c->retired[i]);
    c->n_retired = 0;
}

kvq_status cu_launch(kvq_backend_ctx *c, const char *kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                     const void *params, size_t size, char *msg, size_t n)
{
    if (c->rec) return c->record(c, kernel, gx, gy, params, size, msg, n); /* a plan: into its tables */
    if (c->batch) return c->batch_take(c, kernel, gx, gy, gz, bx, params, size, msg, n); /* an eager step's lists */
    const unsigned g[3] = {gx, gy, gz}, b[3] = {bx, 1, 1};
    return cu_dev_launch(c->dev, c->mod, kernel, g, b, params, size, msg, n);
}

kvq_status cu_stage_take(kvq_backend_ctx *c, size_t bytes, void **out, char *msg, size_t n)
{
    *out = NULL;
    size_t need = (bytes + 15) & ~(size_t)15;
    if (c->hst_used + need > c->hst_bytes) {
        /* full: the copies queued from it must have read it before it is written again (a sync, which after
         * warm-up only a run of steps without one reaches: cu_decode_enqueue's), and it grows if too small */
        kvq_status st = c->hst ? cu_dev_sync(c->dev, msg, n) : KVQ_OK;
        if (st != KVQ_OK) return st;
        if (need > c->hst_bytes) {
            size_t cap = c->hst_bytes ? 2 * c->hst_bytes : 65536;
            while (cap < need) cap *= 2;
            void *h = NULL;
            uint64_t hd = 0;
            st = cu_dev_alloc_host(c->dev, cap, &h, &hd, msg, n);
            if (st != KVQ_OK) return st;
            cu_dev_free_host(c->dev, c->hst);
            c->hst = h, c->hst_dev = hd, c->hst_bytes = cap;
        }
        c->hst_used = 0;
    }
    *out = c->hst + c->hst_used;
    c->hst_used += need;
    return KVQ_OK;
}

kvq_status cu_upload(kvq_backend_ctx *c, uint64_t dst, const void *src, size_t bytes, char *msg, size_t n)
{
    if (!bytes) return KVQ_OK;
    if (!c->in_step) return cu_dev_h2d(c->dev, dst, src, bytes, msg, n);
    void *h = NULL;
    kvq_status st = cu_stage_take(c, bytes, &h, msg, n);
    if (st != KVQ_OK) return st;
    memcpy(h, src, bytes);
    return cu_dev_h2d_async(c->dev, dst, h, bytes, msg, n);
}

unsigned cu_grid_y(long long blocks)
{
    return blocks < 1 ? 1u : blocks > (long long)CU_GRID_YZ_MAX ? CU_GRID_YZ_MAX : (unsigned)blocks;
}

kvq_status cu_win_init(kvq_backend_ctx *c, cu_win *w, int cap, char *msg, size_t n)
{
    memset(w, 0, sizeof *w);
    w->cap = cap;
    w->bytes = kvq_window_tensor_bytes(c->H, c->D, cap);
    if (cap == 0) return KVQ_OK;
    kvq_status st = cu_pool_get(c, w->bytes, &w->addr, msg, n);
    if (st != KVQ_OK) return st;
    w->pos = kvq_calloc((size_t)cap, sizeof *w->pos);
    if (!w->pos) {
        cu_win_free(c, w);
        snprintf(msg, n, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    return KVQ_OK;
}

kvq_rows cu_rows_f16(uint64_t base, int head_stride, int first, int ring)
{
    kvq_rows r;
    memset(&r, 0, sizeof r);
    r.base = base, r.f16 = 1, r.head_stride = head_stride, r.first = first, r.ring = ring;
    return r;
}

void cu_win_free(kvq_backend_ctx *c, cu_win *w)
{
    cu_pool_put(c, w->addr, w->bytes);
    kvq_free(w->pos);
    memset(w, 0, sizeof *w);
}

kvq_status cu_win_push(kvq_backend_ctx *c, cu_win *w, const kvq_rows *src, int n, const int *pos, char *msg,
                       size_t msg_n)
{
    if (n <= 0) return KVQ_OK;
    kvq_store_params sp;
    memset(&sp, 0, sizeof sp);
    sp.src = *src;
    sp.dst = w->addr;
    sp.dst_cap = w->cap;
    sp.slot = (w->head + w->count) % w->cap;
    sp.dst_ring = w->cap;
    sp.n = n;
    kvq_status st = cu_launch(c, "kvq_store_f16", (unsigned)c->H, cu_grid_y(n), 1, 128, &sp, sizeof sp, msg, msg_n);
    if (st != KVQ_OK) return st;
    for (int i = 0; i < n; i++) w->pos[(w->head + w->count + i) % w->cap] = pos[i];
    w->count += n;
    return KVQ_OK;
}

void cu_tiles_push(kvq_backend_ctx *c, int *nt, kvq_tile t)
{
    if (*nt == c->htiles_cap) {
        int cap = c->htiles_cap ? 2 * c->htiles_cap : 256;
        kvq_tile *nb = kvq_realloc(c->htiles, (size_t)cap * sizeof *nb);
        if (!nb) {
            *nt = -1; /* reported by the caller as out of memory */
            return;
        }
        c->htiles = nb;
        c->htiles_cap = cap;
    }
    if (*nt >= 0) c->htiles[(*nt)++] = t;
}

void cu_tiles_windows(kvq_backend_ctx *c, int *nt, const cu_win *k, const cu_win *v, int tile)
{
    for (int i = 0; i < k->count && *nt >= 0;) {
        int ks = (k->head + i) % k->cap, vs = (v->head + i) % v->cap;
        int n = k->count - i;
        if (n > k->cap - ks) n = k->cap - ks;
        if (n > v->cap - vs) n = v->cap - vs;
        if (n > tile) n = tile;
        kvq_tile t;
        memset(&t, 0, sizeof t);
        t.k = k->addr, t.v = v->addr, t.k_slot = ks, t.v_slot = vs, t.k_cap = k->cap, t.v_cap = v->cap, t.n = n;
        t.kinds = KVQ_SRC_F16 | KVQ_SRC_F16 << 8;
        cu_tiles_push(c, nt, t);
        i += n;
    }
}

/* Split-KV: chunks of a sequence's tiles so that the grid fills every SM to its occupancy (the occupancy API with
 * the kernel's block, registers and shared memory, times the SM count: `slots` CTAs at once), counted in tokens
 * (a tile holds up to `tile`) with a floor of KVQ_CHUNK_MIN_TOKENS: below it the merge and the per-chunk setup
 * cost more than the parallelism gains. One chunk when the batch alone fills the device.
 * The split (c->decode_waves, $KVQ_DECODE_WAVES; docs/cuda.md "Tuning knobs"): 0, the default, takes the chunk
 * count c from 1 to ceil(slots / blocks) whose launch finishes first if every CTA of a chunk of ceil(tiles / c)
 * tiles takes as long: ceil(blocks c / slots) waves of ceil(tiles / c) tiles (within 1 % of the shortest, the
 * split with the most CTAs: more warps where the estimate cannot tell; a last wave that is mostly empty costs a
 * whole one: batch 32 at 4 CTAs an SM on 132 SMs, 265 tiles a kv head, takes 2 chunks, one wave of 512 CTAs,
 * where ceil(528 / 256) = 3 chunks made 768 CTAs, 1.45 waves); N >= 1 aims at N waves, c = ceil(N slots /
 * blocks) (1: the rule before the knob). */
#define KVQ_CHUNK_MIN_TOKENS 256
static long split_slots(const kvq_backend_ctx *c, int cls)
{
    int occ = c->decode_blocks_per_sm[cls];
    return (long)(occ > 0 ? occ : 1) * c->sm_count * (c->decode_waves > 0 ? c->decode_waves : 1);
}

int cu_chunks_max(const kvq_backend_ctx *c, int cls, int n_items)
{
    long want = split_slots(c, cls), blocks = (long)c->H * n_items;
    long chunks = blocks >= want ? 1 : (want + blocks - 1) / blocks;
    return chunks < 1 ? 1 : (int)chunks;
}

int cu_tiles_per_chunk(const kvq_backend_ctx *c, int cls, int n_items, int max_tiles)
{
    const long slots = split_slots(c, cls), blocks = (long)c->H * n_items;
    int tile = c->plan->cls[cls].tile, floor_tiles = (KVQ_CHUNK_MIN_TOKENS + tile - 1) / tile;
    long chunks = cu_chunks_max(c, cls, n_items);
    if (chunks > max_tiles) chunks = max_tiles;
    if (chunks < 1) chunks = 1;
    if (c->decode_waves <= 0) { /* the shortest launch in waves x tiles a CTA; within 1 % of it, the most CTAs */
        long best = -1, best_ch = 1, best_used = 0;
        for (int pass = 0; pass < 2; pass++)
            for (long ch = 1; ch <= chunks; ch++) {
                long tpc = (max_tiles + ch - 1) / ch;
                if (tpc < floor_tiles) tpc = floor_tiles;
                long used = (max_tiles + tpc - 1) / tpc; /* the chunks tpc really makes */
                long cost = ((blocks * used + slots - 1) / slots) * tpc;
                if (pass == 0 && (best < 0 || cost < best)) best = cost;
                if (pass == 1 && 100 * cost <= 101 * best && used > best_used) best_used = used, best_ch = ch;
            }
        chunks = best_ch;
    }
    int tpc = (int)((max_tiles + chunks - 1) / chunks);
    if (tpc < floor_tiles) tpc = floor_tiles;
    return tpc < 1 ? 1 : tpc;
}

static uint64_t dev_addr(const void *p) { return (uint64_t)(uintptr_t)p; }

static void convert_params(kvq_convert_params *p, const kvq_dev_tensor *src, uint64_t dst, int ddt, long long dts,
                           int n, int dim)
{
    memset(p, 0, sizeof *p);
    p->src = dev_addr(src->data), p->dst = dst, p->src_ts = src->token_stride, p->src_hs = src->head_stride;
    p->dst_ts = dts, p->dst_hs = dim, p->src_dtype = src->dtype, p->dst_dtype = ddt, p->n = n, p->dim = dim;
    p->mul = 1.0f;
}

kvq_status cu_step_in(kvq_backend_ctx *c, const kvq_dev_decode *dv, int n, uint64_t q, uint64_t kv, uint64_t stores,
                      int n_stores, uint64_t patches, int n_patches, char *msg, size_t ms)
{
    const int H = c->H, Hq = c->Hq, D = c->D;
    kvq_step_in_params p;
    memset(&p, 0, sizeof p);
    convert_params(&p.cv[0], &dv->q, q, KVQ_F32, (long long)Hq * D, n, D);
    convert_params(&p.cv[1], &dv->k, kv, KVQ_F16, 2LL * H * D, n, D);
    convert_params(&p.cv[2], &dv->v, kv + (uint64_t)H * D * 2, KVQ_F16, 2LL * H * D, n, D);
    p.heads[0] = Hq, p.heads[1] = p.heads[2] = H;
    p.stores = stores, p.n_stores = n_stores, p.patches = patches, p.n_patches = n_patches;
    const long long blocks = (long long)n * (Hq + 2 * H) + (long long)n_stores * H + n_patches;
    if (blocks > 2147483647LL) { /* gridDim.x's limit */
        snprintf(msg, ms, "a batch of %d needs %lld blocks for its inputs, more than gridDim.x's 2^31 - 1", n, blocks);
        return KVQ_ERR_UNSUPPORTED;
    }
    const unsigned g[3] = {(unsigned)blocks, 1, 1}, b[3] = {128, 1, 1};
    return cu_dev_launch(c->dev, c->mod, "kvq_step_in", g, b, &p, sizeof p, msg, ms);
}

uint64_t cu_out_rows(const kvq_backend_ctx *c, const kvq_dev_decode *dv, uint64_t own)
{
    if (!dv || dv->out.dtype != KVQ_F32 || dv->out.head_stride != c->D ||
        dv->out.token_stride != (long long)c->Hq * c->D)
        return own;
    const uint64_t a = dev_addr(dv->out.data);
    return (a & 15) == 0 ? a : own;
}

kvq_status cu_convert_out(kvq_backend_ctx *c, const kvq_dev_decode *dv, int n, uint64_t out, uint64_t lse, char *msg,
                          size_t ms)
{
    int Hq = c->Hq, D = c->D;
    kvq_status st = KVQ_OK;
    if (out != dev_addr(dv->out.data)) /* not written in place by the decode kernel or the merge (cu_out_rows) */
        st = cu_convert_rows(c, out, KVQ_F32, (long long)Hq * D, D, dev_addr(dv->out.data), dv->out.dtype,
                             dv->out.token_stride, dv->out.head_stride, n, Hq, D, 1.0f, msg, ms);
    if (st == KVQ_OK && dv->lse)
        st = cu_convert_rows(c, lse, KVQ_F32, Hq, 1, dev_addr(dv->lse), KVQ_F32, Hq, 1, n, Hq, 1, 0.69314718055994531f,
                             msg, ms);
    return st;
}

kvq_status cu_decode_launch(kvq_backend_ctx *c, int cls, int n, int nch, int tpc, uint64_t q, uint64_t seqs,
                            uint64_t out, uint64_t lse, uint64_t part, uint64_t tq_s, char *msg, size_t ms)
{
    int H = c->H, Hq = c->Hq, D = c->D;
    kvq_decode_params dp;
    memset(&dp, 0, sizeof dp);
    dp.q = q, dp.out = out, dp.seqs = seqs, dp.lse = lse, dp.tq_s = tq_s;
    dp.part_o = part, dp.part_lse = part + (uint64_t)n * Hq * nch * D * sizeof(float);
    dp.scale = c->e.softmax_scale * 1.4426950408889634f; /* log2(e): the kernel works in base 2 */
    dp.batch = n, dp.n_chunks = nch, dp.tiles_per_chunk = tpc;
    char kname[32];
    snprintf(kname, sizeof kname, "kvq_decode_c%d", cls);
    const unsigned g[3] = {(unsigned)H, (unsigned)nch, (unsigned)n};
    const unsigned b[3] = {(unsigned)c->plan->tx, (unsigned)c->plan->ty, (unsigned)c->plan->tz};
    kvq_status st =
        cu_dev_launch_smem(c->dev, c->mod, kname, g, b, (unsigned)c->plan->cls[cls].smem, &dp, sizeof dp, msg, ms);
    if (st == KVQ_OK && nch > 1) {
        const unsigned mg[3] = {(unsigned)Hq, (unsigned)n, 1}, mb[3] = {(unsigned)(D < 256 ? D : 256), 1, 1};
        st = cu_dev_launch(c->dev, c->mod, "kvq_merge", mg, mb, &dp, sizeof dp, msg, ms);
    }
    return st;
}

kvq_status cu_convert_rows(kvq_backend_ctx *c, uint64_t src, int sdt, long long sts, long long shs, uint64_t dst,
                           int ddt, long long dts, long long dhs, int n, int heads, int dim, float mul, char *msg,
                           size_t ms)
{
    kvq_convert_params p;
    memset(&p, 0, sizeof p);
    p.src = src, p.dst = dst, p.src_ts = sts, p.src_hs = shs, p.dst_ts = dts, p.dst_hs = dhs;
    p.src_dtype = sdt, p.dst_dtype = ddt, p.n = n, p.dim = dim, p.mul = mul;
    return cu_launch(c, "kvq_convert_rows", (unsigned)heads, cu_grid_y(n), 1, 128, &p, sizeof p, msg, ms);
}

kvq_status cu_list_launch(kvq_backend_ctx *c, const char *kernel, unsigned gx, unsigned gy, uint64_t items,
                          int n_items, char *msg, size_t ms)
{
    kvq_list_params lp;
    memset(&lp, 0, sizeof lp);
    lp.items = items, lp.n_items = n_items;
    const unsigned g[3] = {gx, gy, (unsigned)n_items}, b[3] = {128, 1, 1};
    return cu_dev_launch(c->dev, c->mod, kernel, g, b, &lp, sizeof lp, msg, ms);
}

static const char *const store_names[CU_STEP_STORES] = {"k_hi", "k_lo", "v_hi", "v_lo"};

static const plan_store *class_store(const kvq_backend_ctx *c, int cls, int s)
{
    const plan_class *pc = &c->plan->cls[cls];
    return s == 0 ? &pc->k_hi : s == 1 ? &pc->k_lo : s == 2 ? &pc->v_hi : &pc->v_lo;
}

/* The widest grid the direct quantize kernel of store ps takes for up to maxn tokens (page_write's). */
static void quant_grid(const kvq_backend_ctx *c, const plan_store *ps, int maxn, unsigned *gx, unsigned *gy)
{
    if (maxn < 1) maxn = 1;
    *gx = (unsigned)c->H, *gy = 1;
    if (ps->gran == KVQ_GRAN_TOKEN && ps->hidden)
        *gx = 1, *gy = cu_grid_y(maxn);
    else if (ps->gran == KVQ_GRAN_TOKEN)
        *gy = cu_grid_y((maxn + 7) / 8);
}

/* Store s's factor list, a separable store's (its quantize items are the factor launches' parameters). */
static kvq_status factor_list(kvq_backend_ctx *c, int cls, int s, uint64_t items, int n_items, char *msg, size_t ms)
{
    if (!class_store(c, cls, s)->sep) return KVQ_OK;
    char name[48];
    snprintf(name, sizeof name, "kvq_factor_list_%s_c%d", store_names[s], cls);
    return cu_list_launch(c, name, (unsigned)c->H, 1, items, n_items, msg, ms);
}

kvq_status cu_quant_lists(kvq_backend_ctx *c, int cls, int s, uint64_t items, int n_items, int maxn, char *msg,
                          size_t ms)
{
    kvq_status st = factor_list(c, cls, s, items, n_items, msg, ms);
    unsigned gx, gy;
    quant_grid(c, class_store(c, cls, s), maxn, &gx, &gy);
    char name[48];
    snprintf(name, sizeof name, "kvq_quant_list_%s_c%d", store_names[s], cls);
    if (st == KVQ_OK) st = cu_list_launch(c, name, gx, gy, items, n_items, msg, ms);
    return st;
}

kvq_status cu_quant_lists_all(kvq_backend_ctx *c, int cls, const uint64_t items[CU_STEP_STORES],
                              const int n_items[CU_STEP_STORES], const int maxn[CU_STEP_STORES], char *msg, size_t ms)
{
    kvq_quant_lists_params lp;
    memset(&lp, 0, sizeof lp);
    long long total = 0;
    unsigned gx = 1, gy = 1;
    for (int s = 0; s < CU_STEP_STORES; s++) {
        if (n_items[s] <= 0) continue;
        unsigned x, y; /* store s's list grid: the fused one is the widest */
        quant_grid(c, class_store(c, cls, s), maxn[s], &x, &y);
        if (x > gx) gx = x;
        if (y > gy) gy = y;
        lp.items[s] = items[s], lp.n_items[s] = n_items[s];
        total += n_items[s];
    }
    if (total == 0) return KVQ_OK;
    kvq_status st = KVQ_OK;
    if (total > (long long)CU_GRID_YZ_MAX) { /* gridDim.z: a launch a store */
        for (int s = 0; s < CU_STEP_STORES && st == KVQ_OK; s++)
            if (n_items[s] > 0) st = cu_quant_lists(c, cls, s, items[s], n_items[s], maxn[s], msg, ms);
        return st;
    }
    /* separable stores' factors first, over the same items (page_write's pair of launches) */
    for (int s = 0; s < CU_STEP_STORES && st == KVQ_OK; s++)
        if (n_items[s] > 0) st = factor_list(c, cls, s, items[s], n_items[s], msg, ms);
    char name[48];
    snprintf(name, sizeof name, "kvq_quant_lists_c%d", cls);
    const unsigned g[3] = {gx, gy, (unsigned)total}, b[3] = {128, 1, 1};
    if (st == KVQ_OK) st = cu_dev_launch(c->dev, c->mod, name, g, b, &lp, sizeof lp, msg, ms);
    return st;
}

uint64_t cu_rec_zaux_take(kvq_backend_ctx *c, size_t bytes, char *msg, size_t ms)
{
    cu_rec *r = c->rec;
    bytes = (bytes + 15) & ~(size_t)15;
    if (!r->zaux || r->zaux_used + bytes > r->zaux_bytes) {
        snprintf(msg, ms, "cuda: internal error: a planned compression's gather rows exceed their bound (%zu bytes)",
                 r->zaux_bytes);
        return 0;
    }
    uint64_t a = r->zaux + r->zaux_used;
    r->zaux_used += bytes;
    return a;
}
