/* Quantize-mode layers of the cuda/emu backends: the reference's streaming rules (ref_quant_layer.c, KIVI
 * Alg. 1, OTT Sec. 3.2; everything stored is the fp16 rounding of the input) with the cache on the device:
 * windows are fp16 rings (nothing is ever moved), flushes run the quantize kernels from the window or from the
 * step's staged rows, sinks/windows/fp16 pages are written by kvq_store_f16. OTT's pool competition (cu_ott.c)
 * and ZipCache's classes (cu_saliency.c) run in the policy kernels; the pooled tokens reach the quantize kernel as
 * the competition's mask flags and mean-replaced rows, the classes as per-head gather indices. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cu_backend.h"
#include "half.h"
#include "policy.h"
#include "quant.h"
#include "turboquant.h"

static const kvq_tensor_cfg *tcfg(const cu_qlayer *L, int w) { return w ? &L->cfg->value : &L->cfg->key; }

static int append_mode(const cu_qlayer *L, int w)
{
    const kvq_tensor_cfg *t = tcfg(L, w);
    if (L->rule[w].batch != 1 || L->saliency) return 0;
    return kvq_bits_is_fp16(t->bits) || (t->gran == KVQ_GRAN_TOKEN && !t->channel_separable);
}

static const plan_store *store_of(kvq_backend_ctx *c, const cu_qlayer *L, int store)
{
    const plan_class *pc = &c->plan->cls[L->cls];
    return store == 0 ? &pc->k_hi : store == 1 ? &pc->k_lo : store == 2 ? &pc->v_hi : &pc->v_lo;
}

static const char *store_name(int store)
{
    return store == 0 ? "k_hi" : store == 1 ? "k_lo" : store == 2 ? "v_hi" : "v_lo";
}

/* ---- a tensor scale from the prompt (element formats, tensor_scale prompt) ---- */

static int prompt_scale(const cu_qlayer *L, int w)
{
    const kvq_tensor_cfg *t = tcfg(L, w);
    return !kvq_bits_is_fp16(t->bits) && kvq_format_has_tensor_scale(t->format.kind) &&
           !(t->format.tensor_scale > 0.0f);
}

static size_t tamax_bytes(const kvq_backend_ctx *c) { return (size_t)c->H * sizeof(float); }

/* The prompt's absolute maxima of tensor w's tensor scale (kvq_tensor_amax), from which the quantize kernels derive
 * T (kvq_format.cuh kvq_fmt_quant_T): the whole prompt, sinks and window included, as ref_quant_layer.c set_tscale
 * takes it. A prefill has at least one token (kvq_prefill), so T is fixed before any flush. */
static kvq_status take_tamax(kvq_backend_ctx *c, cu_qlayer *L, int w, const kvq_rows *src, int n, char *msg,
                             size_t mn)
{
    if (!prompt_scale(L, w)) return KVQ_OK;
    kvq_status st = cu_pool_get(c, tamax_bytes(c), &L->tamax[w], msg, mn);
    kvq_tamax_params tp;
    memset(&tp, 0, sizeof tp);
    tp.src = *src, tp.out = L->tamax[w], tp.n = n;
    if (st == KVQ_OK) st = cu_launch(c, "kvq_tensor_amax", (unsigned)c->H, 1, 1, 128, &tp, sizeof tp, msg, mn);
    return st;
}

/* ---- pages ---- */

static void page_free(kvq_backend_ctx *c, cu_page *p)
{
    if (!p) return;
    cu_pool_put(c, p->addr, p->lay.total);
    if (p->members) cu_pool_put(c, p->members, (size_t)c->H * p->fmt.capacity * sizeof(int));
    kvq_free(p->pos);
    kvq_free(p);
}

/* A page of tensor w in precision class cls (0: the only or the high class, 1: ZipCache's low class). */
static kvq_status page_new_at(kvq_backend_ctx *c, cu_qlayer *L, int w, int cls, int cap, uint64_t at, uint64_t run,
                              cu_page **out, char *msg, size_t n)
{
    *out = NULL;
    if (L->n_pages[w] == L->cap_pages[w]) {
        int nc = L->cap_pages[w] ? 2 * L->cap_pages[w] : 8;
        cu_page **v = kvq_realloc(L->pages[w], (size_t)nc * sizeof *v);
        if (!v) goto nomem;
        L->pages[w] = v;
        L->cap_pages[w] = nc;
    }
    cu_page *p = kvq_calloc(1, sizeof *p);
    if (!p) goto nomem;
    const kvq_saliency_cfg *sal = &L->cfg->saliency;
    int bits = !L->saliency ? tcfg(L, w)->bits : cls ? sal->low_bits : sal->high_bits;
    kvq_page_format_init(&p->fmt, tcfg(L, w), bits, w == 0 && L->cfg->outliers.keep > 0, c->H, c->D, cap);
    kvq_page_layout_compute(&p->fmt, &p->lay);
    p->seg = cls ? KVQ_SEG_BODY_LOW : KVQ_SEG_BODY_HIGH;
    p->kind = kvq_bits_is_fp16(bits) ? KVQ_SRC_F16 : cls ? KVQ_SRC_LO : KVQ_SRC_HI;
    p->store = (w ? 2 : 0) + cls;
    p->pos = kvq_calloc((size_t)c->H * (size_t)cap, sizeof *p->pos);
    p->run = run;
    kvq_status st = !p->pos ? KVQ_ERR_NOMEM : at ? KVQ_OK : cu_pool_get(c, p->lay.total, &p->addr, msg, n);
    if (st == KVQ_OK && at) p->addr = at; /* a page of a page run: its slice of the run's block */
    if (st != KVQ_OK) {
        page_free(c, p);
        if (st == KVQ_ERR_NOMEM) snprintf(msg, n, "out of memory");
        return st;
    }
    L->pages[w][L->n_pages[w]++] = p;
    *out = p;
    return KVQ_OK;
nomem:
    snprintf(msg, n, "out of memory");
    return KVQ_ERR_NOMEM;
}

static kvq_status page_new(kvq_backend_ctx *c, cu_qlayer *L, int w, int cls, int cap, cu_page **out, char *msg,
                           size_t n)
{
    return page_new_at(c, L, w, cls, cap, 0, 0, out, msg, n);
}

/* The full key pages of a flush class of nc tokens as one page run (layout/tiles.h): one block of the pool for
 * all of them, each page a slice at kvq_page_run_stride (freed one by one, as any page: the pool's blocks of that
 * size). *made: pages made (0 when the class's pages do not form a run, or fewer than two of them). */
static kvq_status page_run_new(kvq_backend_ctx *c, cu_qlayer *L, int w, int cls, int nc, int *made, char *msg,
                               size_t n)
{
    *made = 0;
    const kvq_tensor_cfg *t = tcfg(L, w);
    int cap = kvq_flush_page_tokens(t, nc), k = cap > 0 ? nc / cap : 0;
    if (w != 0 || k < 2 || L->saliency) return KVQ_OK;
    kvq_page_format f;
    kvq_page_layout lay;
    kvq_page_format_init(&f, t, t->bits, L->cfg->outliers.keep > 0, c->H, c->D, cap);
    if (!kvq_page_run_ok(&f)) return KVQ_OK;
    kvq_page_layout_compute(&f, &lay);
    size_t stride = kvq_page_run_stride(lay.total);
    uint64_t block = 0;
    kvq_status st = cu_pool_get(c, stride * (size_t)k, &block, msg, n);
    for (int i = 0; i < k && st == KVQ_OK; i++) {
        cu_page *p;
        st = page_new_at(c, L, w, cls, cap, block + (uint64_t)i * stride, block, &p, msg, n);
        if (st == KVQ_OK) (*made)++;
    }
    /* slices no page took go back to the pool */
    for (int i = *made; i < k && block; i++) cu_pool_put(c, block + (uint64_t)i * stride, stride);
    return st;
}

/* Writes n tokens of src (rows t of src are tokens slot..slot+n-1 of the page) into page p: quantize kernels, or
 * fp16 rows for bits 16. masked: device address of [H][n] flags, or 0. */
static kvq_status page_write(kvq_backend_ctx *c, const cu_qlayer *L, cu_page *p, const kvq_rows *src, int slot, int n,
                             uint64_t masked, char *msg, size_t mn)
{
    if (p->kind == KVQ_SRC_F16) {
        kvq_store_params sp;
        memset(&sp, 0, sizeof sp);
        sp.src = *src, sp.dst = p->addr + p->lay.codes, sp.dst_cap = p->fmt.capacity, sp.slot = slot, sp.n = n;
        return cu_launch(c, "kvq_store_f16", (unsigned)c->H, cu_grid_y(n), 1, 128, &sp, sizeof sp, msg, mn);
    }
    const plan_store *st = store_of(c, L, p->store);
    kvq_quant_params qp;
    memset(&qp, 0, sizeof qp);
    qp.src = *src, qp.page = p->addr, qp.masked = masked, qp.cap = p->fmt.capacity, qp.slot = slot, qp.n = n;
    qp.tamax = prompt_scale(L, p->store / 2) ? L->tamax[p->store / 2] : 0;
    qp.tq_s = p->store / 2 == 0 ? L->tq_s : 0; /* TurboQuant prod keys' QJL matrices */
    char name[48];
    const char *sn = store_name(p->store);
    kvq_status s = KVQ_OK;
    if (st->sep) {
        snprintf(name, sizeof name, "kvq_factor_%s_c%d", sn, L->cls);
        s = cu_launch(c, name, (unsigned)c->H, 1, 1, 128, &qp, sizeof qp, msg, mn);
    }
    snprintf(name, sizeof name, "kvq_quant_%s_c%d", sn, L->cls);
    unsigned gx = (unsigned)c->H, gy = 1;
    if (st->gran == KVQ_GRAN_TOKEN && st->hidden)
        gx = 1, gy = cu_grid_y(n);
    else if (st->gran == KVQ_GRAN_TOKEN)
        gy = cu_grid_y((n + 7) / 8);
    if (s == KVQ_OK) s = cu_launch(c, name, gx, gy, 1, 128, &qp, sizeof qp, msg, mn);
    return s;
}

/* A flush of B tokens of tensor w (rows src, positions first_pos + i) into pages split as the reference splits
 * them (ref_class_split). masked: 0, or the device pooled flags of an OTT competition (by key page,
 * kvq_ott_params.flags); pre: index in L->pages[w] of pages allocated ahead for this flush (key_pages_new), or -1.
 * is_high: host [H][B] ZipCache classes, or NULL: each class is its own batch, tokens in position order, read
 * through per-head gather indices (each kv head has its own members), uploaded one page at a time. dflags: or the
 * device flags [H][B] of a decode compression (cu_sal_flush; is_high NULL): kvq_zip_gather writes each page's
 * gather indices and members on the device, nothing comes back (the slots' positions wait for read_cache). */
static kvq_status flush_pages(kvq_backend_ctx *c, cu_qlayer *L, int w, const kvq_rows *src, int B, int first_pos,
                              uint64_t masked, int pre, const unsigned char *is_high, uint64_t dflags, char *msg,
                              size_t mn)
{
    const kvq_tensor_cfg *t = tcfg(L, w);
    int H = c->H;
    kvq_status st = cu_scratch(c, &c->aux, &c->aux_bytes, (size_t)H * (B > 0 ? B : 1) * sizeof(int) + 64, msg, mn);
    int *member = kvq_malloc((size_t)H * (B > 0 ? B : 1) * sizeof *member);
    int *gidx = kvq_malloc((size_t)H * (B > 0 ? B : 1) * sizeof *gidx);
    if (st == KVQ_OK && (!member || !gidx)) st = KVQ_ERR_NOMEM;
    int high = dflags ? kvq_saliency_high_count(&L->cfg->saliency, B) : 0;
    if (high > B) high = B;
    for (int cls = 0; cls < (is_high || dflags ? 2 : 1) && st == KVQ_OK; cls++) {
        int nc = dflags ? (cls ? B - high : high) : 0; /* kvq_zip_select marks exactly high per head */
        for (int h = 0; h < H && !dflags; h++) {
            int j = 0;
            for (int i = 0; i < B; i++)
                if (!is_high || (is_high[(size_t)h * B + i] != 0) == (cls == 0)) member[(size_t)h * B + j++] = i;
            nc = j; /* the same for every head: the class size depends on B only */
        }
        int run_left = 0, run_at = 0; /* the class's full key pages as a page run, made first */
        if (pre < 0 && !dflags && !is_high && st == KVQ_OK) {
            st = page_run_new(c, L, w, cls, nc, &run_left, msg, mn);
            run_at = L->n_pages[w] - run_left;
        }
        for (int off = 0; off < nc && st == KVQ_OK;) {
            int cap = kvq_flush_page_tokens(t, nc - off);
            cu_page *p;
            if (pre >= 0)
                p = L->pages[w][pre++];
            else if (run_left > 0)
                p = L->pages[w][run_at++], run_left--;
            else
                st = page_new(c, L, w, cls, cap, &p, msg, mn);
            if (st != KVQ_OK) break;
            kvq_rows r = *src;
            for (int h = 0; h < H && !dflags; h++)
                for (int j = 0; j < cap; j++) {
                    int i = member[(size_t)h * B + off + j];
                    p->pos[h * cap + j] = first_pos + i;
                    gidx[(size_t)h * cap + j] = src->ring ? (src->first + i) % src->ring : src->first + i;
                }
            if (dflags) {
                st = cu_pool_get(c, (size_t)H * p->fmt.capacity * sizeof(int), &p->members, msg, mn);
                /* each page's gather rows: the engine's scratch (used at once), or in a plan the sequence's, one
                 * region a page (the run gathers every page before it quantizes any) */
                uint64_t aux = c->aux;
                if (st == KVQ_OK && c->rec && !(aux = cu_rec_zaux_take(c, (size_t)H * cap * sizeof(int), msg, mn)))
                    st = KVQ_ERR_INTERNAL;
                kvq_zip_params zp;
                memset(&zp, 0, sizeof zp);
                zp.is_high = dflags, zp.n = B, zp.row = cls, zp.count = off, zp.np = cap;
                zp.work = aux, zp.pos = p->members, zp.first = src->first, zp.wcap = src->ring;
                p->pos_base = first_pos;
                if (st == KVQ_OK) st = cu_launch(c, "kvq_zip_gather", (unsigned)H, 1, 1, 256, &zp, sizeof zp, msg, mn);
                r.gather = aux;
            } else if (is_high) {
                st = cu_upload(c, c->aux, gidx, (size_t)H * cap * sizeof *gidx, msg, mn);
                r.gather = c->aux;
            } else if (r.ring) {
                r.first = (r.first + off) % r.ring;
            } else {
                r.first += off;
            }
            /* the competition's flags of this key page: [H][cap] at off * H */
            uint64_t mk = masked && p->fmt.masked ? masked + (uint64_t)off * H : 0;
            if (st == KVQ_OK) st = page_write(c, L, p, &r, 0, cap, mk, msg, mn);
            p->count = cap;
            off += cap;
        }
    }
    kvq_free(member), kvq_free(gidx);
    if (st == KVQ_ERR_NOMEM) snprintf(msg, mn, "out of memory");
    return st;
}

/* The key pages of an OTT flush of B tokens, allocated before the competition (it records where each pooled
 * token's key slot is, to unmask it if it is evicted back to the body). *first: index of the first in pages[0]. */
static kvq_status key_pages_new(kvq_backend_ctx *c, cu_qlayer *L, int B, int *first, char *msg, size_t mn)
{
    *first = L->n_pages[0];
    kvq_status st = KVQ_OK;
    for (int off = 0; off < B && st == KVQ_OK;) {
        int cap = kvq_channel_group_tokens(&L->cfg->key, B - off);
        if (cap > B - off) cap = B - off;
        cu_page *p;
        st = page_new(c, L, 0, 0, cap, &p, msg, mn);
        off += cap;
    }
    return st;
}

/* OTT: the competition of a flush of B tokens (K and V leave together), then its pages. k, v: the flush's fp16
 * rows. */
static kvq_status ott_flush(kvq_backend_ctx *c, cu_qlayer *L, const kvq_rows *k, const kvq_rows *v, int B,
                            int first_pos, char *msg, size_t mn)
{
    int pg;
    uint64_t rows = 0, flags = 0;
    kvq_status st = key_pages_new(c, L, B, &pg, msg, mn);
    if (st == KVQ_OK) st = cu_ott_compete(c, L, k, v, B, first_pos, pg, &rows, &flags, msg, mn);
    size_t half = (size_t)c->H * B * c->D * 2;
    kvq_rows ok = cu_rows_f16(rows, B, 0, 0), ov = cu_rows_f16(rows + half, B, 0, 0);
    if (st == KVQ_OK) st = flush_pages(c, L, 0, &ok, B, first_pos, flags, pg, NULL, 0, msg, mn);
    if (st == KVQ_OK) st = flush_pages(c, L, 1, &ov, B, first_pos, 0, -1, NULL, 0, msg, mn);
    return st;
}

/* ---- staging ---- */

/* fp16 rows of x [H][n][D] (fp32, rounded here) into the stage at row offset `at` of a [2][H][n_all][D] layout. */
static kvq_status stage_rows(kvq_backend_ctx *c, const float *x, int n, uint64_t dst, char *msg, size_t mn)
{
    size_t cnt = (size_t)c->H * n * c->D;
    uint16_t *h16 = kvq_malloc(cnt * 2 + 2);
    if (!h16) {
        snprintf(msg, mn, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    kvq_f16_from_f32_n(h16, x, cnt);
    kvq_status st = cu_upload(c, dst, h16, cnt * 2, msg, mn);
    kvq_free(h16);
    return st;
}

static void win_drop(cu_win *w, int n)
{
    w->head = (w->head + n) % w->cap;
    w->count -= n;
}

/* ---- prefill ---- */

kvq_status cu_qlayer_prefill(kvq_backend_ctx *c, cu_layer *RL, int layer, const kvq_be_prefill *it, char *msg,
                             size_t mn)
{
    cu_qlayer *L = &RL->q;
    memset(L, 0, sizeof *L);
    RL->sparse = 0;
    L->cls = c->plan->layer_class[layer];
    L->cfg = &kvq_scheme_layer(c->e.scheme, layer)->quant;
    L->tq_s = c->tq_s ? c->tq_s[layer] : 0;
    const kvq_quant_cfg *cfg = L->cfg;
    int H = c->H, D = c->D, T = it->n_tokens, S = T < cfg->sinks ? T : cfg->sinks, n = T - S, quantized[2];
    L->has_pool = cfg->outliers.keep > 0;
    L->saliency = cfg->saliency.metric != KVQ_SAL_NONE;
    kvq_status st = KVQ_OK;
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        kvq_window_rule_of(cfg, w, &L->rule[w]);
        quantized[w] = kvq_window_prefill_quantized(&L->rule[w], n);
        st = cu_win_init(c, &L->sink[w], cfg->sinks, msg, mn);
        if (st == KVQ_OK) st = cu_win_init(c, &L->win[w], L->rule[w].capacity, msg, mn);
    }
    if (st == KVQ_OK && L->saliency) st = cu_sal_init(c, L, layer, msg, mn);
    if (st == KVQ_OK && L->has_pool) st = cu_ott_init(c, &L->ott, cfg->outliers.keep, cfg->outliers.spill, msg, mn);
    /* stage: K then V rows [H][T][D] fp16 */
    size_t rows = (size_t)H * (size_t)(T > 0 ? T : 1) * D * 2;
    if (st == KVQ_OK) st = cu_scratch(c, &c->stage, &c->stage_bytes, 2 * rows + 64, msg, mn);
    if (it->k16) { /* the caller's fp16 rows, uploaded as they are (backend.h) */
        if (st == KVQ_OK) st = cu_upload(c, c->stage, it->k16, rows, msg, mn);
        if (st == KVQ_OK) st = cu_upload(c, c->stage + rows, it->v16, rows, msg, mn);
    } else {
        if (st == KVQ_OK) st = stage_rows(c, it->k, T, c->stage, msg, mn);
        if (st == KVQ_OK) st = stage_rows(c, it->v, T, c->stage + rows, msg, mn);
    }
    int *pos = kvq_malloc(((size_t)T + 1) * sizeof *pos);
    if (!pos && st == KVQ_OK) st = KVQ_ERR_NOMEM;
    for (int t = 0; pos && t < T; t++) pos[t] = t;
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        kvq_rows r = cu_rows_f16(c->stage + (w ? rows : 0), T, 0, 0);
        st = cu_win_push(c, &L->sink[w], &r, S, pos, msg, mn);
        if (st == KVQ_OK) st = take_tamax(c, L, w, &r, T, msg, mn); /* before any flush */
    }
    /* the flush: OTT's competition (the prefill is one quantization step), or ZipCache's classes, then pages */
    kvq_rows fr[2] = {cu_rows_f16(c->stage, T, S, 0), cu_rows_f16(c->stage + rows, T, S, 0)};
    unsigned char *is_high = NULL;
    int Bs = quantized[0] > quantized[1] ? quantized[0] : quantized[1];
    if (st == KVQ_OK && L->has_pool && quantized[0] > 0 && quantized[0] == quantized[1]) {
        st = ott_flush(c, L, &fr[0], &fr[1], quantized[0], S, msg, mn); /* flush group: K and V together */
        if (st == KVQ_OK) cu_ott_commit(c, &L->ott);
    } else {
        if (st == KVQ_OK && L->saliency && Bs > 0) {
            /* ZipCache Alg. 2; K and V share the rule, hence the tokens and the classes */
            is_high = kvq_malloc((size_t)H * Bs);
            kvq_rows all = cu_rows_f16(c->stage, T, 0, 0); /* the probes see keys from position 0 */
            st = is_high ? cu_sal_prefill(c, L, &all, it->q, T, S, Bs, is_high, msg, mn) : KVQ_ERR_NOMEM;
        }
        for (int w = 0; w < 2 && st == KVQ_OK; w++)
            st = flush_pages(c, L, w, &fr[w], quantized[w], S, 0, -1, is_high, 0, msg, mn);
    }
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        int from = S + quantized[w];
        kvq_rows r = cu_rows_f16(c->stage + (w ? rows : 0), T, from, 0);
        st = cu_win_push(c, &L->win[w], &r, T - from, pos ? pos + from : NULL, msg, mn);
    }
    kvq_free(pos), kvq_free(is_high);
    if (st != KVQ_OK) {
        if (st == KVQ_ERR_NOMEM) snprintf(msg, mn, "out of memory");
        cu_qlayer_free(c, L);
        return st;
    }
    L->length = T;
    if (L->saliency && L->rule[0].capacity > 0) cu_sal_new_cycle(L);
    return KVQ_OK;
}

/* ---- decode step: the new token into its window or page, and the flushes it triggers (ref plan_step) ---- */

kvq_status cu_qlayer_append(kvq_backend_ctx *c, cu_qlayer *L, uint64_t kv, char *msg, size_t mn)
{
    int H = c->H, D = c->D, pos = L->length;
    size_t one = (size_t)H * D * 2;
    kvq_status st = KVQ_OK;
    kvq_rows newr[2] = {cu_rows_f16(kv, 1, 0, 0), cu_rows_f16(kv + one, 1, 0, 0)};
    if (L->length < L->cfg->sinks) {
        for (int w = 0; w < 2 && st == KVQ_OK; w++) st = cu_win_push(c, &L->sink[w], &newr[w], 1, &pos, msg, mn);
        if (st == KVQ_OK) L->length++;
        return st;
    }
    int direct[2], B[2] = {0, 0}, first[2] = {0, 0};
    kvq_rows src[2];
    for (int w = 0; w < 2; w++) {
        direct[w] = L->rule[w].capacity == 0;
        B[w] = direct[w] ? 1 : L->win[w].count + 1 == L->rule[w].capacity ? L->rule[w].batch : 0;
    }
    if (L->saliency && !direct[0]) {
        /* ZipCache Alg. 3: the token waits in the window; the step attends first (its row may be a probe's) and
         * compresses after, in cu_qlayer_after_attend */
        for (int w = 0; w < 2 && st == KVQ_OK; w++) st = cu_win_push(c, &L->win[w], &newr[w], 1, &pos, msg, mn);
        L->pending_flush = B[0] > 0;
        if (st == KVQ_OK) L->length++;
        return st;
    }
    for (int w = 0; w < 2 && st == KVQ_OK; w++)
        if (!direct[w]) st = cu_win_push(c, &L->win[w], &newr[w], 1, &pos, msg, mn);
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        if (!B[w]) continue;
        cu_win *win = &L->win[w];
        if (append_mode(L, w)) {
            /* KIVI values (Alg. 1: popped one at a time), or an fp16 tensor: an appendable page */
            cu_page *ap = L->append[w];
            if (!ap || ap->count == ap->fmt.capacity) {
                int first = direct[w] ? pos : win->pos[win->head]; /* aligned: layout.h */
                st = page_new(c, L, w, 0, kvq_append_page_tokens(first, L->cfg->sinks), &ap, msg, mn);
                if (st != KVQ_OK) return st;
                L->append[w] = ap;
            }
            kvq_rows r = direct[w] ? newr[w] : cu_rows_f16(win->addr, win->cap, win->head, win->cap);
            int fp = direct[w] ? pos : win->pos[win->head];
            st = page_write(c, L, ap, &r, ap->count, 1, 0, msg, mn);
            for (int h = 0; h < H; h++) ap->pos[h * ap->fmt.capacity + ap->count] = fp;
            ap->count++;
            if (!direct[w]) win_drop(win, 1);
            B[w] = 0;
            continue;
        }
        src[w] = direct[w] ? newr[w] : cu_rows_f16(win->addr, win->cap, win->head, win->cap);
        first[w] = direct[w] ? pos : win->pos[win->head];
    }
    if (st == KVQ_OK && L->has_pool && B[0] > 0 && B[0] == B[1]) {
        /* OTT: K and V of the same G tokens leave together; one competition per flush */
        st = ott_flush(c, L, &src[0], &src[1], B[0], first[0], msg, mn);
    } else {
        unsigned char *is_high = NULL;
        int Bm = B[0] > B[1] ? B[0] : B[1];
        if (st == KVQ_OK && L->saliency && Bm > 0) {
            /* no window (interval 1, no residual): a batch of one token, whose class the count decides */
            is_high = kvq_malloc((size_t)H * Bm);
            if (!is_high)
                st = KVQ_ERR_NOMEM;
            else
                memset(is_high, kvq_saliency_high_count(&L->cfg->saliency, Bm) > 0, (size_t)H * Bm);
        }
        for (int w = 0; w < 2 && st == KVQ_OK; w++)
            if (B[w]) st = flush_pages(c, L, w, &src[w], B[w], first[w], 0, -1, is_high, 0, msg, mn);
        kvq_free(is_high);
    }
    for (int w = 0; w < 2 && st == KVQ_OK; w++)
        if (B[w] && !direct[w]) win_drop(&L->win[w], B[w]);
    if (st == KVQ_ERR_NOMEM) snprintf(msg, mn, "out of memory");
    if (st == KVQ_OK) L->length++;
    return st;
}

kvq_status cu_qlayer_after_attend(kvq_backend_ctx *c, cu_qlayer *L, uint64_t q, const kvq_seq_tiles *tiles,
                                  char *msg, size_t mn)
{
    if (!L->saliency || L->rule[0].capacity == 0) return KVQ_OK;
    kvq_status st = cu_sal_record(c, L, L->length - 1, q, tiles, msg, mn);
    if (st != KVQ_OK || !L->pending_flush) return st;
    L->pending_flush = 0;
    int B = L->rule[0].batch; /* K and V share the rule */
    uint64_t flags = 0;
    st = cu_sal_flush(c, L, B, &flags, msg, mn); /* Alg. 3 with this cycle's rows; the classes stay on the device */
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        cu_win *win = &L->win[w];
        kvq_rows r = cu_rows_f16(win->addr, win->cap, win->head, win->cap);
        st = flush_pages(c, L, w, &r, B, win->pos[win->head], 0, -1, NULL, flags, msg, mn);
    }
    for (int w = 0; w < 2 && st == KVQ_OK; w++) win_drop(&L->win[w], B);
    if (st == KVQ_OK) cu_sal_new_cycle(L);
    if (st == KVQ_ERR_NOMEM) snprintf(msg, mn, "out of memory");
    return st;
}

/* ---- tiles ---- */

typedef struct {
    uint64_t base;
    int kind, cap, slot, n;
    int np;   /* pages it takes in the stream: more than 1 for a page run */
    int pcap; /* a page run's page capacity (layout/tiles.h), else 0 */
} run;

/* Run x of stream w (0 keys, 1 values): pages 0 .. n_pages - 1 (an empty page is a run of 0 tokens), then the
 * window's ring runs (at most two); 0 past the end. *frozen: the run can never change again, a page other than
 * the append page (pages are only ever appended; flushes write a page whole, and only the append page grows). */
static int stream_run(const cu_qlayer *L, int w, int x, run *r, int *frozen)
{
    if (x < L->n_pages[w]) {
        const cu_page *p = L->pages[w][x];
        *r = (run){p->addr, p->kind, p->fmt.capacity, 0, p->count, 1, 0};
        *frozen = p != L->append[w];
        /* keys: the pages of a flush's page run are one run (full pages, back to back) */
        while (w == 0 && p->run && x + r->np < L->n_pages[w] && L->pages[w][x + r->np]->run == p->run)
            r->n += L->pages[w][x + r->np++]->count;
        if (r->np > 1) r->pcap = p->fmt.capacity;
        return 1;
    }
    const cu_win *win = &L->win[w];
    int k = x - L->n_pages[w], first = win->count < win->cap - win->head ? win->count : win->cap - win->head;
    *frozen = 0;
    if (k == 0 && first > 0) *r = (run){win->addr, KVQ_SRC_F16, win->cap, win->head, first, 1, 0};
    else if (k == 1 && win->count > first) *r = (run){win->addr, KVQ_SRC_F16, win->cap, 0, win->count - first, 1, 0};
    else return 0;
    return 1;
}

void cu_qlayer_head_tiles(kvq_backend_ctx *c, const cu_qlayer *L, int *nt)
{
    int tile = plan_tile_tokens(&c->plan->cls[L->cls], 1, 1); /* sinks and pools: fp16 rows */
    cu_tiles_windows(c, nt, &L->sink[0], &L->sink[1], tile);
    if (L->has_pool) cu_ott_tiles(c, &L->ott, tile, nt);
}

void cu_qlayer_body_tiles(kvq_backend_ctx *c, const cu_qlayer *L, cu_tile_cursor at, int *nt, int *frozen_nt,
                          cu_tile_cursor *frozen_at)
{
    const plan_class *pc = &c->plan->cls[L->cls];
    int kf = 0, vf = 0, all_frozen = 1;
    run kr, vr;
    if (frozen_nt) *frozen_nt = *nt, *frozen_at = at;
    int hk = stream_run(L, 0, at.i, &kr, &kf), hv = stream_run(L, 1, at.j, &vr, &vf);
    /* the keys' and the values' streams hold the same tokens in the same order: cut where either run ends */
    while (hk && hv && *nt >= 0) {
        if (at.ko == kr.n) {
            at.i += kr.np, at.ko = 0;
            hk = stream_run(L, 0, at.i, &kr, &kf);
            continue;
        }
        if (at.vo == vr.n) {
            at.j++, at.vo = 0;
            hv = stream_run(L, 1, at.j, &vr, &vf);
            continue;
        }
        /* the one rule (layout/tiles.h), at most what the staging holds of these kinds */
        int tile = plan_tile_tokens(pc, kr.kind == KVQ_SRC_F16, vr.kind == KVQ_SRC_F16);
        int n = kvq_tile_len(tile, kr.n - at.ko, vr.n - at.vo, at.ko, kr.pcap);
        kvq_tile t;
        memset(&t, 0, sizeof t);
        t.k = kr.base, t.v = vr.base, t.k_slot = kr.slot + at.ko, t.v_slot = vr.slot + at.vo;
        t.k_cap = kr.cap, t.v_cap = vr.cap, t.n = n, t.kinds = kr.kind | vr.kind << 8;
        cu_tiles_push(c, nt, t);
        at.ko += n, at.vo += n;
        /* a tile of frozen pages only is the same at every later step, and so is every tile before it */
        all_frozen &= kf && vf;
        if (all_frozen && frozen_nt && *nt >= 0) *frozen_nt = *nt, *frozen_at = at;
    }
}

void cu_qlayer_tiles(kvq_backend_ctx *c, const cu_qlayer *L, int *nt)
{
    cu_qlayer_head_tiles(c, L, nt);
    cu_tile_cursor at = {0, 0, 0, 0};
    if (*nt >= 0) cu_qlayer_body_tiles(c, L, at, nt, NULL, NULL);
}

/* ---- read_cache, accounting, free ---- */

static float get_param(const uint8_t *sec, size_t i, int bytes)
{
    if (bytes == 2) return kvq_f32_from_f16((uint16_t)(sec[2 * i] | sec[2 * i + 1] << 8));
    uint32_t u = 0;
    for (int b = 0; b < 4; b++) u |= (uint32_t)sec[4 * i + (size_t)b] << (8 * b);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Dequantized slot of head h of a page copied to the host (ref_page_read's arithmetic). tq: the page's TurboQuant
 * quantizer, else NULL. */
static void page_read(const cu_page *p, const uint8_t *mem, int h, int slot, const kvq_tqv *tq, float *out)
{
    const kvq_page_format *f = &p->fmt;
    int D = f->head_dim;
    const uint8_t *src = mem + p->lay.codes + ((size_t)h * f->capacity + slot) * p->lay.code_bytes_per_token;
    if (kvq_bits_is_fp16(f->bits)) {
        for (int x = 0; x < D; x++) out[x] = kvq_f32_from_f16((uint16_t)(src[2 * x] | src[2 * x + 1] << 8));
        return;
    }
    uint8_t codes[256];
    if (tq) { /* TurboQuant: Algorithm 1's (mse) or 2's (prod) DeQuant per part (ref_store.c ref_page_read) */
        size_t tok = (size_t)h * f->capacity + slot, idx = tok * (size_t)p->lay.n_groups, cb = 0;
        uint8_t signs[256];
        for (int j = 0; j < tq->n_parts; j++) {
            const kvq_tq *t = &tq->part[j];
            float norm, rnorm = 0;
            memcpy(&norm, mem + p->lay.scale + (idx + (size_t)j) * 4, 4);
            kvq_unpack_codes(src + cb, t->D, t->mse_bits, codes);
            cb += kvq_code_bytes(t->D, t->mse_bits);
            if (t->prod) {
                memcpy(&rnorm, mem + p->lay.zero + (idx + (size_t)j) * 4, 4);
                kvq_unpack_codes(mem + p->lay.qjl + tok * (size_t)(D / 8) + tq->off[j] / 8, t->D, 1, signs);
            }
            kvq_tq_dequant(t, codes, norm, signs, rnorm, out + tq->off[j]);
        }
        return;
    }
    kvq_unpack_codes(src, D, f->bits, codes);
    if (f->format.kind != KVQ_FMT_INT) { /* element formats: x = z + (s T) L[code] (ref_store.c) */
        float lv[256], T = 1.0f;
        kvq_format_levels(&f->format, f->bits, lv);
        if (p->lay.tscale_size)
            memcpy(&T, mem + p->lay.tscale + (f->format.tensor_scale_per_head ? (size_t)h * sizeof T : 0), sizeof T);
        for (int x = 0; x < D; x++) {
            size_t idx = f->gran == KVQ_GRAN_CHANNEL ? (size_t)h * D + x
                                                     : ((size_t)h * f->capacity + slot) * p->lay.n_groups +
                                                           (size_t)(x / f->group);
            kvq_qparams qp = {1.0f, 0.0f};
            if (f->scale_bytes == 1)
                qp.scale = kvq_format_scale8_decode(f->format.kind, mem[p->lay.scale + idx]);
            else if (f->scale_bytes)
                qp.scale = get_param(mem + p->lay.scale, idx, f->scale_bytes);
            if (f->zero_bytes) qp.zero = get_param(mem + p->lay.zero, idx, f->zero_bytes);
            out[x] = kvq_format_dequant(lv[codes[x]], qp, T);
        }
        return;
    }
    for (int x = 0; x < D; x++) {
        size_t idx = f->gran == KVQ_GRAN_CHANNEL ? (size_t)h * D + x
                     : f->hidden                 ? (size_t)slot
                                 : ((size_t)h * f->capacity + slot) * p->lay.n_groups + (size_t)(x / f->group);
        kvq_qparams qp = {get_param(mem + p->lay.scale, idx, f->scale_bytes),
                          get_param(mem + p->lay.zero, idx, f->zero_bytes)};
        float r = kvq_dequant(codes[x], qp);
        if (f->channel_separable) r = r * get_param(mem + p->lay.factor, (size_t)h * D + x, f->scale_bytes);
        out[x] = r;
    }
}

static kvq_status read_window(kvq_backend_ctx *c, const cu_win *w, float *dst, int capacity, char *msg, size_t mn)
{
    if (w->count == 0) return KVQ_OK;
    size_t n = (size_t)c->H * w->cap * c->D;
    uint16_t *h16 = kvq_malloc(n * 2);
    if (!h16) return KVQ_ERR_NOMEM;
    kvq_status st = cu_dev_d2h(c->dev, h16, w->addr, n * 2, msg, mn);
    for (int h = 0; h < c->H && st == KVQ_OK; h++)
        for (int i = 0; i < w->count; i++) {
            int s = (w->head + i) % w->cap;
            kvq_f32_from_f16_n(dst + ((size_t)h * capacity + w->pos[s]) * c->D, h16 + ((size_t)h * w->cap + s) * c->D,
                               (size_t)c->D);
        }
    kvq_free(h16);
    return st;
}

/* The slots' positions of a ZipCache compression's page, derived from its device members when read_cache asks
 * (outside a step: the synchronous copy is allowed); the members go back to the pool. */
static kvq_status page_positions(kvq_backend_ctx *c, cu_page *p, char *msg, size_t mn)
{
    if (!p->members) return KVQ_OK;
    size_t n = (size_t)c->H * p->fmt.capacity;
    int *m = kvq_malloc(n * sizeof *m);
    if (!m) return KVQ_ERR_NOMEM;
    kvq_status st = cu_dev_d2h(c->dev, m, p->members, n * sizeof *m, msg, mn);
    for (size_t i = 0; i < n && st == KVQ_OK; i++) p->pos[i] = p->pos_base + m[i];
    kvq_free(m);
    if (st == KVQ_OK) {
        cu_pool_put(c, p->members, n * sizeof(int));
        p->members = 0;
    }
    return st;
}

kvq_status cu_qlayer_read(kvq_backend_ctx *c, const cu_qlayer *L, float *k, float *v, int capacity, char *msg,
                          size_t mn)
{
    kvq_status st = KVQ_OK;
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        float *dst = w ? v : k;
        st = read_window(c, &L->sink[w], dst, capacity, msg, mn);
        if (st == KVQ_OK) st = read_window(c, &L->win[w], dst, capacity, msg, mn);
        for (int j = 0; j < L->n_pages[w] && st == KVQ_OK; j++) {
            cu_page *p = L->pages[w][j];
            uint8_t *mem = kvq_malloc(p->lay.total);
            if (!mem) {
                st = KVQ_ERR_NOMEM;
                break;
            }
            kvq_tqv tq;
            const kvq_page_format *f = &p->fmt;
            int has_tq = !kvq_bits_is_fp16(f->bits) && f->tq != KVQ_TQ_NONE;
            const kvq_tensor_cfg *tc = w ? &L->cfg->value : &L->cfg->key; /* its seed: the QJL matrix of prod */
            st = has_tq ? kvq_tqv_init(&tq, f->head_dim, f->bits, f->tq == KVQ_TQ_PROD, tc->rotate_seed, f->tq_out,
                                       f->tq_out_bits)
                        : KVQ_OK;
            if (st == KVQ_OK) st = page_positions(c, p, msg, mn);
            if (st == KVQ_OK) st = cu_dev_d2h(c->dev, mem, p->addr, p->lay.total, msg, mn);
            for (int h = 0; h < c->H && st == KVQ_OK; h++)
                for (int s = 0; s < p->count; s++)
                    page_read(p, mem, h, s, has_tq ? &tq : NULL,
                              dst + ((size_t)h * capacity + p->pos[h * p->fmt.capacity + s]) * c->D);
            if (has_tq) kvq_tqv_free(&tq);
            kvq_free(mem);
        }
    }
    /* a pooled outlier reads as its fp16 copy, keys and values (its body slots hold the group mean) */
    if (L->has_pool && st == KVQ_OK) st = cu_ott_read(c, &L->ott, k, v, capacity, msg, mn);
    if (st == KVQ_ERR_NOMEM) snprintf(msg, mn, "out of memory");
    return st;
}

void cu_qlayer_account(const kvq_backend_ctx *c, cu_qlayer *L, kvq_mem_stats *o)
{
    uint64_t H = (uint64_t)c->H;
    for (int w = 0; w < 2; w++) {
        o->bytes[KVQ_SEG_SINK] += L->sink[w].bytes;
        o->tokens[KVQ_SEG_SINK] += (uint64_t)L->sink[w].count * H;
        o->bytes[KVQ_SEG_RESIDUAL] += L->win[w].bytes;
        o->tokens[KVQ_SEG_RESIDUAL] += (uint64_t)L->win[w].count * H;
        for (int j = 0; j < L->n_pages[w]; j++) {
            const cu_page *p = L->pages[w][j];
            o->bytes[p->seg] += p->lay.codes_size + p->lay.qjl_size; /* QJL signs are codes (account.c) */
            o->bytes[KVQ_SEG_PARAMS] += p->lay.total - p->lay.codes_size - p->lay.qjl_size;
            o->tokens[p->seg] += (uint64_t)p->count * H;
        }
    }
    if (L->has_pool) cu_ott_account(c, &L->ott, o);
}

void cu_qlayer_free(kvq_backend_ctx *c, cu_qlayer *L)
{
    for (int w = 0; w < 2; w++) {
        cu_win_free(c, &L->sink[w]);
        cu_win_free(c, &L->win[w]);
        for (int j = 0; j < L->n_pages[w]; j++) page_free(c, L->pages[w][j]);
        kvq_free(L->pages[w]);
        L->pages[w] = NULL;
        L->n_pages[w] = L->cap_pages[w] = 0;
    }
    for (int w = 0; w < 2; w++) {
        if (L->tamax[w]) cu_pool_put(c, L->tamax[w], tamax_bytes(c));
        L->tamax[w] = 0;
    }
    cu_ott_free(c, &L->ott);
    cu_sal_free(c, L);
}

/* ---- a decode step's snapshot: cu_backend.h ---- */

static int probe_slots(const cu_qlayer *L) { return L->rule[0].capacity > 0 ? L->rule[0].capacity : 1; }

kvq_status cu_qlayer_save(const cu_qlayer *L, cu_snap *s)
{
    memset(s, 0, sizeof *s);
    s->length = L->length;
    for (int w = 0; w < 2; w++) {
        s->sink_count[w] = L->sink[w].count;
        s->win_head[w] = L->win[w].head, s->win_count[w] = L->win[w].count;
        s->n_pages[w] = L->n_pages[w];
        s->append[w] = L->append[w];
        s->append_count[w] = L->append[w] ? L->append[w]->count : 0;
    }
    s->pending_flush = L->pending_flush, s->n_probes = L->n_probes, s->n_rows = L->n_rows;
    s->cycle_first = L->cycle_first;
    if (L->probe_pos) {
        s->probe_pos = kvq_malloc((size_t)probe_slots(L) * sizeof *s->probe_pos);
        if (!s->probe_pos) return KVQ_ERR_NOMEM;
        memcpy(s->probe_pos, L->probe_pos, (size_t)probe_slots(L) * sizeof *s->probe_pos);
    }
    return KVQ_OK;
}

kvq_status cu_qlayer_restore(kvq_backend_ctx *c, cu_qlayer *L, cu_snap *s, char *msg, size_t mn)
{
    kvq_status st = L->has_pool ? cu_ott_undo(c, &L->ott, msg, mn) : KVQ_OK;
    for (int w = 0; w < 2; w++) {
        /* pages the step created, the append page too if it was new; the windows' rows were never moved */
        for (int j = s->n_pages[w]; j < L->n_pages[w]; j++) page_free(c, L->pages[w][j]);
        L->n_pages[w] = s->n_pages[w];
        L->append[w] = s->append[w];
        if (L->append[w]) L->append[w]->count = s->append_count[w];
        L->sink[w].count = s->sink_count[w];
        L->win[w].head = s->win_head[w], L->win[w].count = s->win_count[w];
    }
    L->length = s->length;
    L->pending_flush = s->pending_flush, L->n_probes = s->n_probes, L->n_rows = s->n_rows;
    L->cycle_first = s->cycle_first;
    if (s->probe_pos) memcpy(L->probe_pos, s->probe_pos, (size_t)probe_slots(L) * sizeof *s->probe_pos);
    return st;
}

void cu_qlayer_commit(kvq_backend_ctx *c, cu_qlayer *L)
{
    if (L->has_pool) cu_ott_commit(c, &L->ott);
}
