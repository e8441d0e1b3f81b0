/* TailorKV sparsity-friendly layers of the cuda/emu backends (Sec. 4.2, App. I; the reference is ref_sparse.c): the
 * prompt's K/V in page-locked host memory mapped for the device (KVQ_SEG_HOST), plus the prompt's K again
 * channel-major for retrieval (not counted in the stats: docs/cuda.md, "TailorKV retrieval"), sinks + recent of the
 * prompt and the generated tokens on the device. Retrieval runs in the policy kernels where the keys live:
 * kvq_tk_absmax takes Eq. 10's max_t |K_t,i| over the prompt once; each step kvq_tk_score and kvq_tk_select reduce the group's
 * query (App. I reduce_q), picks the critical channels (Eq. 10), scores every candidate on those channels only,
 * reading just them from host memory (App. I approximate_attn), and writes the top-k rows' indices, which
 * kvq_store_f16 then gathers from host memory into a device buffer the decode kernel attends over with the local
 * and generated tokens. Decisions equal policy.h's (docs/cuda.md, "Determinism"). */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cu_backend.h"
#include "half.h"

static kvq_rows host_rows(const cu_slayer *L, int w, int first)
{
    kvq_rows r;
    memset(&r, 0, sizeof r);
    r.base = L->host_dev[w], r.f16 = 1, r.head_stride = L->T, r.first = first;
    return r;
}

kvq_status cu_slayer_prefill(kvq_backend_ctx *c, cu_layer *RL, int layer, const kvq_be_prefill *it, char *msg,
                             size_t mn)
{
    cu_slayer *L = &RL->s;
    memset(L, 0, sizeof *L);
    RL->sparse = 1;
    L->cls = c->plan->layer_class[layer];
    L->cfg = &kvq_scheme_layer(c->e.scheme, layer)->sparse;
    int H = c->H, D = c->D, T = it->n_tokens, cap = L->cfg->sinks + L->cfg->recent;
    L->T = T;
    L->host_bytes = kvq_window_tensor_bytes(H, D, T);
    kvq_status st = KVQ_OK;
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        st = cu_dev_alloc_host(c->dev, L->host_bytes, (void **)&L->host[w], &L->host_dev[w], msg, mn);
        if (st == KVQ_OK && it->k16) /* the caller's fp16 rows (backend.h) */
            memcpy(L->host[w], w ? it->v16 : it->k16, (size_t)H * T * D * 2);
        else if (st == KVQ_OK)
            kvq_f16_from_f32_n(L->host[w], w ? it->v : it->k, (size_t)H * T * D);
        if (st == KVQ_OK) st = cu_win_init(c, &L->local[w], cap, msg, mn);
    }
    /* Retrieval reads n_ch channels of every candidate: channel-major, each channel is one contiguous run of T
     * halves over PCIe instead of n_ch scattered 2-byte reads per 2*D-byte row (docs/cuda.md, "TailorKV"). */
    if (st == KVQ_OK) st = cu_dev_alloc_host(c->dev, L->host_bytes, (void **)&L->host_kc, &L->host_kc_dev, msg, mn);
    for (int h = 0; st == KVQ_OK && h < H; h++)
        for (int t = 0; t < T; t++)
            for (int d = 0; d < D; d++)
                L->host_kc[((size_t)h * D + d) * T + t] = L->host[0][((size_t)h * T + t) * D + d];
    L->fetch_cap = L->cfg->topk > 0 ? L->cfg->topk : 1;
    for (int w = 0; w < 2 && st == KVQ_OK; w++)
        st = cu_dev_alloc(c->dev, (size_t)H * L->fetch_cap * D * 2, &L->fetch[w], msg, mn);
    if (st == KVQ_OK) st = cu_dev_alloc(c->dev, (size_t)H * D * sizeof(float), &L->absmax, msg, mn);
    int *pos = kvq_malloc(((size_t)T + 1) * sizeof *pos);
    if (st == KVQ_OK && !pos) st = KVQ_ERR_NOMEM;
    for (int t = 0; pos && t < T; t++) pos[t] = t;
    /* App. I static_k: the first `sinks` and last `recent` prompt tokens (all of them when the prompt is short) */
    int head_n = T <= cap ? T : L->cfg->sinks, tail_from = T <= cap ? T : T - L->cfg->recent;
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        kvq_rows r = host_rows(L, w, 0);
        st = cu_win_push(c, &L->local[w], &r, head_n, pos, msg, mn);
        r = host_rows(L, w, tail_from);
        if (st == KVQ_OK) st = cu_win_push(c, &L->local[w], &r, T - tail_from, pos ? pos + tail_from : NULL, msg, mn);
    }
    kvq_tk_params p; /* App. I absmax_k over the prompt's (fp16) keys, read from host memory (channel-major) */
    memset(&p, 0, sizeof p);
    p.k = L->host_kc_dev, p.absmax = L->absmax, p.T = T;
    /* absmax is zero from cu_dev_alloc: the kernel's blocks take their maxima in with atomicMax */
    if (st == KVQ_OK) st = cu_launch(c, "kvq_tk_absmax", (unsigned)H, KVQ_TK_CHUNKS, 1, 256, &p, sizeof p, msg, mn);
    kvq_free(pos);
    if (st != KVQ_OK) {
        if (st == KVQ_ERR_NOMEM) snprintf(msg, mn, "out of memory");
        cu_slayer_free(c, L);
        return st;
    }
    L->length = T;
    return KVQ_OK;
}

kvq_status cu_slayer_append(kvq_backend_ctx *c, cu_slayer *L, uint64_t kv, uint64_t q, char *msg, size_t mn)
{
    int H = c->H, D = c->D, pos = L->length, gen = L->length - L->T;
    kvq_status st = KVQ_OK;
    if (gen % KVQ_APPEND_PAGE_TOKENS == 0) {
        if (L->n_gen == L->gen_cap) {
            int cap = L->gen_cap ? 2 * L->gen_cap : 4;
            cu_win *g = kvq_realloc(L->gen, (size_t)cap * 2 * sizeof *g);
            if (!g) {
                snprintf(msg, mn, "out of memory");
                return KVQ_ERR_NOMEM;
            }
            L->gen = g;
            L->gen_cap = cap;
        }
        st = cu_win_init(c, &L->gen[2 * L->n_gen], KVQ_APPEND_PAGE_TOKENS, msg, mn);
        if (st == KVQ_OK) st = cu_win_init(c, &L->gen[2 * L->n_gen + 1], KVQ_APPEND_PAGE_TOKENS, msg, mn);
        if (st != KVQ_OK) {
            cu_win_free(c, &L->gen[2 * L->n_gen]);
            return st;
        }
        L->n_gen++;
    }
    /* the new token (fp16 rows on the device) into the current page of generated tokens */
    int cap = L->cfg->sinks + L->cfg->recent, first = L->cfg->sinks, nc = L->T > cap ? L->T - cap : 0;
    int k_sel = L->cfg->topk, nf = k_sel < nc ? (k_sel > 0 ? k_sel : 0) : nc;
    size_t one = (size_t)H * D * 2;
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        kvq_rows r;
        memset(&r, 0, sizeof r);
        r.base = kv + (w ? one : 0), r.f16 = 1, r.head_stride = 1;
        st = cu_win_push(c, &L->gen[2 * (L->n_gen - 1) + w], &r, 1, &pos, msg, mn);
    }
    if (st != KVQ_OK) return st;
    L->length++;

    /* retrieval (Eq. 10, App. I approximate_attn) on the device, then the fetch of the top-k rows */
    L->n_fetch = nf;
    if (nf == 0) return KVQ_OK;
    int n_ch = L->cfg->critical_channels > 0 && L->cfg->critical_channels < D ? L->cfg->critical_channels : D;
    size_t gb = ((size_t)H * nf * 4 + 15) & ~(size_t)15, wb = 2 * (size_t)H * nc * 4;
    /* the gather rows and the work: the engine's policy scratch, or in a plan the sequence's (cu_step_policy.c) */
    uint64_t pol = c->rec ? c->rec->pol : 0;
    if (!c->rec)
        st = cu_scratch(c, &c->pol, &c->pol_bytes, gb + wb, msg, mn), pol = c->pol;
    else if (gb + wb > c->rec->pol_bytes) {
        snprintf(msg, mn, "cuda: internal error: a planned retrieval needs %zu bytes of scratch, %zu reserved",
                 gb + wb, c->rec->pol_bytes);
        st = KVQ_ERR_INTERNAL;
    }
    kvq_tk_params p;
    memset(&p, 0, sizeof p);
    p.q = q, p.k = L->host_kc_dev, p.absmax = L->absmax, p.gather = pol, p.work = pol + gb;
    p.T = L->T, p.first = first, p.nc = nc, p.nf = nf, p.n_ch = n_ch;
    if (st == KVQ_OK) st = cu_launch(c, "kvq_tk_score", (unsigned)H, KVQ_TK_CHUNKS, 1, 256, &p, sizeof p, msg, mn);
    if (st == KVQ_OK) st = cu_launch(c, "kvq_tk_select", (unsigned)H, 1, 1, 256, &p, sizeof p, msg, mn);
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        kvq_store_params sp;
        memset(&sp, 0, sizeof sp);
        sp.src = host_rows(L, w, 0);
        sp.src.gather = pol;
        sp.dst = L->fetch[w], sp.dst_cap = L->fetch_cap, sp.n = nf;
        st = cu_launch(c, "kvq_store_f16", (unsigned)H, cu_grid_y(nf), 1, 128, &sp, sizeof sp, msg, mn);
    }
    return st;
}

void cu_slayer_tiles(kvq_backend_ctx *c, const cu_slayer *L, int *nt)
{
    int tile = plan_tile_tokens(&c->plan->cls[L->cls], 1, 1); /* fp16 rows only */
    cu_tiles_windows(c, nt, &L->local[0], &L->local[1], tile);
    for (int o = 0; o < L->n_fetch && *nt >= 0; o += tile) {
        kvq_tile t;
        memset(&t, 0, sizeof t);
        t.k = L->fetch[0], t.v = L->fetch[1], t.k_slot = t.v_slot = o, t.k_cap = t.v_cap = L->fetch_cap;
        t.n = L->n_fetch - o < tile ? L->n_fetch - o : tile;
        t.kinds = KVQ_SRC_F16 | KVQ_SRC_F16 << 8;
        cu_tiles_push(c, nt, t);
    }
    for (int g = 0; g < L->n_gen; g++) cu_tiles_windows(c, nt, &L->gen[2 * g], &L->gen[2 * g + 1], tile);
}

kvq_status cu_slayer_read(kvq_backend_ctx *c, const cu_slayer *L, float *k, float *v, int capacity, char *msg,
                          size_t mn)
{
    int H = c->H, D = c->D;
    kvq_status st = KVQ_OK;
    uint16_t *g16 = kvq_malloc((size_t)H * KVQ_APPEND_PAGE_TOKENS * D * 2);
    if (!g16) return KVQ_ERR_NOMEM;
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        float *dst = w ? v : k;
        for (int h = 0; h < H; h++)
            kvq_f32_from_f16_n(dst + (size_t)h * capacity * D, L->host[w] + (size_t)h * L->T * D, (size_t)L->T * D);
        for (int g = 0; g < L->n_gen && st == KVQ_OK; g++) {
            const cu_win *win = &L->gen[2 * g + w];
            st = cu_dev_d2h(c->dev, g16, win->addr, (size_t)H * win->cap * D * 2, msg, mn);
            for (int h = 0; h < H && st == KVQ_OK; h++)
                for (int s = 0; s < win->count; s++)
                    kvq_f32_from_f16_n(dst + ((size_t)h * capacity + win->pos[s]) * D,
                                       g16 + ((size_t)h * win->cap + s) * D, (size_t)D);
        }
    }
    kvq_free(g16);
    return st;
}

void cu_slayer_account(const kvq_backend_ctx *c, const cu_slayer *L, kvq_mem_stats *o)
{
    uint64_t H = (uint64_t)c->H;
    for (int w = 0; w < 2; w++) {
        o->bytes[KVQ_SEG_HOST] += L->host_bytes;
        o->tokens[KVQ_SEG_HOST] += (uint64_t)L->T * H;
        o->bytes[KVQ_SEG_SPARSE_LOCAL] += L->local[w].bytes;
        o->tokens[KVQ_SEG_SPARSE_LOCAL] += (uint64_t)L->local[w].count * H;
    }
    for (int i = 0; i < 2 * L->n_gen; i++) {
        o->bytes[KVQ_SEG_SPARSE_LOCAL] += L->gen[i].bytes;
        o->tokens[KVQ_SEG_SPARSE_LOCAL] += (uint64_t)L->gen[i].count * H;
    }
}

void cu_slayer_free(kvq_backend_ctx *c, cu_slayer *L)
{
    for (int w = 0; w < 2; w++) {
        cu_dev_free_host(c->dev, L->host[w]);
        if (w == 0) cu_dev_free_host(c->dev, L->host_kc);
        cu_win_free(c, &L->local[w]);
        cu_dev_free(c->dev, L->fetch[w]);
    }
    for (int i = 0; i < 2 * L->n_gen; i++) cu_win_free(c, &L->gen[i]);
    kvq_free(L->gen);
    cu_dev_free(c->dev, L->absmax);
    memset(L, 0, sizeof *L);
}

void cu_slayer_save(const cu_slayer *L, cu_snap *s)
{
    memset(s, 0, sizeof *s);
    s->length = L->length, s->n_gen = L->n_gen;
    for (int w = 0; w < 2 && L->n_gen > 0; w++) s->gen_count[w] = L->gen[2 * (L->n_gen - 1) + w].count;
}

void cu_slayer_restore(kvq_backend_ctx *c, cu_slayer *L, const cu_snap *s)
{
    for (int i = 2 * s->n_gen; i < 2 * L->n_gen; i++) cu_win_free(c, &L->gen[i]); /* pages the step opened */
    L->n_gen = s->n_gen;
    for (int w = 0; w < 2 && L->n_gen > 0; w++) L->gen[2 * (L->n_gen - 1) + w].count = s->gen_count[w];
    L->length = s->length;
}
