/* Quantize-mode layers of the reference backend: prefill, the streaming rules of each decode step, flushes into
 * pages, accounting. The rules come from layout.h's kvq_window_rule_of (one definition with account.c):
 *
 *   KIVI (Alg. 1): keys wait in a window of R and are quantized R at a time when it holds R (prefill: l mod R
 *     stay); values wait in a window of R and leave it one at a time, each quantized alone (into an appendable
 *     page). The step quantizes first and attends after, as Alg. 1's Decoding does (KIVI's released code attends
 *     first; the two differ only in that one step's output).
 *   OTT (Sec. 3.2): keys and values quantized together, G at a time, when the window holds R + G; each flush is
 *     one competition of the outlier pool (ref_outlier.c); the prefill is one quantization step. Quantize, then
 *     attend, as KIVI (OTT is built on it).
 *   ZipCache (Alg. 2-3): the prompt is quantized whole with saliency classes; decoded tokens wait fp16 and are
 *     compressed every W, keeping `residual` newest; the step attends first (its query may be a probe whose row
 *     the compression uses), then compresses, as Alg. 3 does.
 *   fp16 tensors (bits 16): stored straight into fp16 pages.
 * Sinks: the first `sinks` tokens stay fp16, before anything else; a decode token whose position is below
 * `sinks` (a prompt shorter than the sinks) joins them. Everything stored is the fp16 rounding of the input. */
#include <string.h>

#include "alloc.h"
#include "half.h"
#include "policy.h"
#include "quant.h"
#include "ref.h"
#include "tiles.h"

static int saliency_on(const ref_qlayer *L) { return L->cfg->saliency.metric != KVQ_SAL_NONE; }
static const kvq_tensor_cfg *tcfg(const ref_qlayer *L, int which) { return which ? &L->cfg->value : &L->cfg->key; }
static int masked_tensor(const ref_qlayer *L, int which) { return which == 0 && L->cfg->outliers.keep > 0; }

/* The tensor scale T of tensor `which` for element formats that have one (e4m3, e5m2, nvfp4): the spec's static
 * value, or (tensor_scale prompt) from the absolute maximum of the first values the layer is given: the whole
 * prompt, K and V each over every kv head, or each kv head's own (per head); a layer prefilled with no tokens:
 * its first flushed batch. Fixed from then on: later tokens beyond the prompt's range saturate (minifloat.h).
 * x: [H][n] (each head's n values). */
static void set_tscale(ref_qlayer *L, int which, const float *x, size_t n)
{
    const kvq_format_cfg *f = &tcfg(L, which)->format;
    float *T = L->tscale[which];
    if (T[0] > 0.0f || !kvq_format_has_tensor_scale(f->kind) || kvq_bits_is_fp16(tcfg(L, which)->bits)) return;
    if (f->tensor_scale > 0.0f || n == 0) {
        for (int h = 0; h < L->H; h++) T[h] = f->tensor_scale;
        return;
    }
    float all = 0.0f;
    for (int h = 0; h < L->H; h++) {
        float amax = 0.0f;
        for (size_t i = 0; i < n; i++) {
            float a = x[(size_t)h * n + i] < 0 ? -x[(size_t)h * n + i] : x[(size_t)h * n + i];
            if (a > amax) amax = a;
        }
        T[h] = amax;
        if (amax > all) all = amax;
    }
    for (int h = 0; h < L->H; h++) T[h] = kvq_format_tensor_scale(f->kind, f->tensor_scale_per_head ? T[h] : all);
}

/* A flush of one token goes into an appendable page when the tensor's pages can take tokens one at a time
 * (per token without channel factors, or fp16) and no saliency split applies (kvq_append_page_tokens). */
static int append_mode(const ref_qlayer *L, int which)
{
    if (L->rule[which].batch != 1 || saliency_on(L)) return 0;
    kvq_page_format f;
    kvq_page_format_init(&f, tcfg(L, which), tcfg(L, which)->bits, masked_tensor(L, which), L->H, L->D,
                         KVQ_APPEND_ALIGN);
    return ref_page_appendable(&f);
}

/* The page formats of a flush of B tokens of tensor `which`, in the order flush_pages uses them: the high class
 * (or the only one) then the low class, each split by ref_class_split (account.c's account_class). */
static int plan_flush(const ref_qlayer *L, int which, int B, kvq_page_format *fmts, kvq_segment *segs)
{
    const kvq_tensor_cfg *t = tcfg(L, which);
    int counts[2], bits[2], nclass = 1, n = 0;
    if (saliency_on(L)) {
        counts[0] = kvq_saliency_high_count(&L->cfg->saliency, B);
        counts[1] = B - counts[0];
        bits[0] = L->cfg->saliency.high_bits;
        bits[1] = L->cfg->saliency.low_bits;
        nclass = 2;
    } else {
        counts[0] = B;
        bits[0] = t->bits;
    }
    for (int c = 0; c < nclass; c++) {
        int k = ref_class_split(t, counts[c], NULL);
        if (fmts) {
            int caps[k > 0 ? k : 1];
            ref_class_split(t, counts[c], caps);
            for (int j = 0; j < k; j++) {
                kvq_page_format_init(&fmts[n + j], t, bits[c], masked_tensor(L, which), L->H, L->D, caps[j]);
                segs[n + j] = c == 0 ? KVQ_SEG_BODY_HIGH : KVQ_SEG_BODY_LOW;
            }
        }
        n += k;
    }
    return n;
}

static kvq_status alloc_pages(const ref_qlayer *L, int which, int B, ref_page **dst, int *n)
{
    int k = plan_flush(L, which, B, NULL, NULL);
    if (k == 0) return KVQ_OK;
    kvq_page_format *f = kvq_malloc((size_t)k * sizeof *f);
    kvq_segment *sg = kvq_malloc((size_t)k * sizeof *sg);
    kvq_status st = f && sg ? KVQ_OK : KVQ_ERR_NOMEM;
    if (st == KVQ_OK) {
        plan_flush(L, which, B, f, sg);
        int first = *n;
        for (int j = 0; j < k && st == KVQ_OK; j++) {
            st = ref_page_new(&f[j], sg[j], &dst[*n]);
            if (st == KVQ_OK) dst[(*n)++]->tq = L->tq[which];
        }
        /* The flush's full key pages as a page run, as the cuda backend makes them (cu_qlayer.c page_run_new):
         * keys only, no saliency classes, no OTT competition (its masked pages are made ahead there). */
        int run = 0;
        while (st == KVQ_OK && which == 0 && !saliency_on(L) && run < k && !f[run].masked && kvq_page_run_ok(&f[run]))
            run++;
        for (int j = 0; st == KVQ_OK && run >= 2 && j < run; j++) {
            dst[first + j]->run_idx = j;
            dst[first + j]->run_len = run;
        }
    }
    kvq_free(f);
    kvq_free(sg);
    return st;
}

/* Scratch of flush_pages for B tokens. */
static size_t flush_scratch_bytes(const ref_qlayer *L, int B)
{
    size_t HB = (size_t)L->H * (size_t)B;
    return ref_arena_need(HB * (size_t)L->D * sizeof(float)) + ref_arena_need(HB * sizeof(int)) +
           ref_arena_need(HB);
}

/* Writes a flush of B tokens of tensor `which` into pages taken in order from src (*next advances): x [H][B][D]
 * holds the fp16 values (OTT: pooled tokens already replaced), positions first_pos + i. is_high [H][B] (saliency
 * classes: each kv head its own members, the same count) or NULL; pooled [H][B] (keys of OTT layers: the slot
 * is masked) or NULL. Each class is quantized as its own batch (ZipCache Alg. 2: ChannelQuant / CSTQuant of
 * K_salient and K_regular separately), tokens in position order. */
static kvq_status flush_pages(ref_qlayer *L, int which, const float *x, int B, int first_pos,
                              const unsigned char *is_high, const unsigned char *pooled, ref_page **src, int *next,
                              ref_arena *a)
{
    int H = L->H, D = L->D;
    const kvq_tensor_cfg *t = tcfg(L, which);
    set_tscale(L, which, x, (size_t)B * (size_t)D);
    float *gx = ref_arena_take(a, (size_t)H * (size_t)B * (size_t)D * sizeof(float));
    int *gpos = ref_arena_take(a, (size_t)H * (size_t)B * sizeof(int));
    unsigned char *gmask = ref_arena_take(a, (size_t)H * (size_t)B);
    int nclass = is_high ? 2 : 1;
    for (int c = 0; c < nclass; c++) {
        int nc = 0;
        for (int h = 0; h < H; h++) {
            int j = 0;
            for (int i = 0; i < B; i++) {
                if (is_high && (is_high[(size_t)h * (size_t)B + (size_t)i] != 0) != (c == 0)) continue;
                memcpy(gx + ((size_t)h * (size_t)B + (size_t)j) * (size_t)D,
                       x + ((size_t)h * (size_t)B + (size_t)i) * (size_t)D, (size_t)D * sizeof *gx);
                gpos[(size_t)h * (size_t)B + (size_t)j] = first_pos + i;
                gmask[(size_t)h * (size_t)B + (size_t)j] = pooled ? pooled[(size_t)h * (size_t)B + (size_t)i] : 0;
                j++;
            }
            nc = j; /* the same for every head: the class size depends on B only */
        }
        int k = ref_class_split(t, nc, NULL);
        int caps[k > 0 ? k : 1];
        ref_class_split(t, nc, caps);
        for (int j = 0, off = 0; j < k; off += caps[j], j++) {
            ref_page *pg = src[*next];
            /* The pages were planned by plan_flush from the same counts; a mismatch is a bug, not bad input. */
            if (pg->fmt.capacity != caps[j] || pg->fmt.gran != t->gran) return KVQ_ERR_INTERNAL;
            (*next)++;
            ref_page_set_tscale(pg, L->tscale[which]);
            ref_page_fill(pg, gx + (size_t)off * (size_t)D, (size_t)B * (size_t)D, gpos + off, (size_t)B);
            if (pg->fmt.masked)
                for (int h = 0; h < H; h++)
                    for (int s = 0; s < caps[j]; s++)
                        if (gmask[(size_t)h * (size_t)B + (size_t)(off + s)]) ref_page_set_mask(pg, h, s, 1);
            L->pages[which].v[L->pages[which].n++] = pg; /* room reserved by the caller */
        }
    }
    return KVQ_OK;
}

/* Copies tokens [first, first + n) of every head of x [H][T][D] into dst [H][n][D]. */
static void gather_range(float *dst, const float *x, int H, int T, int D, int first, int n)
{
    if (n <= 0) return;
    for (int h = 0; h < H; h++)
        memcpy(dst + (size_t)h * (size_t)n * (size_t)D, x + ((size_t)h * (size_t)T + (size_t)first) * (size_t)D,
               (size_t)n * (size_t)D * sizeof *dst);
}

/* ---------------------------------------------------------------------------------------------- prefill -- */

void ref_qlayer_free(ref_qlayer *L)
{
    for (int w = 0; w < 2; w++) {
        ref_win_free(&L->sink[w]);
        ref_win_free(&L->win[w]);
        ref_pages_free(&L->pages[w]);
        L->append[w] = NULL;
    }
    ref_pool_free(&L->pool);
    ref_pool_free(&L->spill);
    for (int w = 0; w < 2; w++) {
        kvq_free(L->tscale[w]);
        L->tscale[w] = NULL;
        kvq_tqv_free(L->tq[w]);
        kvq_free(L->tq[w]);
        L->tq[w] = NULL;
    }
    kvq_free(L->probe_pos);
    kvq_free(L->rows);
    L->probe_pos = NULL;
    L->rows = NULL;
}

kvq_status ref_qlayer_prefill(ref_layer *RL, const kvq_be_engine *e, int layer, const kvq_quant_cfg *cfg,
                              const kvq_be_prefill *it, char *msg, size_t msg_size)
{
    (void)msg;
    (void)msg_size;
    ref_qlayer *L = &RL->q;
    memset(L, 0, sizeof *L);
    RL->sparse = 0;
    L->cfg = cfg;
    L->H = e->dims.kv_heads;
    L->Hq = e->dims.heads;
    L->D = e->dims.head_dim;
    L->scale = e->softmax_scale;
    L->layer = layer;
    {
        /* ZipCache probes: one stream per (engine seed, layer); kvq_select_probes mixes in the position. */
        uint64_t st = e->seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(layer + 1));
        L->seed = kvq_splitmix64(&st);
    }
    int H = L->H, D = L->D, T = it->n_tokens;
    int S = T < cfg->sinks ? T : cfg->sinks, n = T - S, quantized[2], npages[2], total_pages = 0;
    for (int w = 0; w < 2; w++) {
        kvq_window_rule_of(cfg, w, &L->rule[w]);
        quantized[w] = kvq_window_prefill_quantized(&L->rule[w], n);
        npages[w] = plan_flush(L, w, quantized[w], NULL, NULL);
        total_pages += npages[w];
    }
    kvq_status st = KVQ_OK;
    ref_page **pg = NULL;
    ref_arena a = {0};
    int got = 0;
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        st = ref_win_init(&L->sink[w], H, D, cfg->sinks);
        if (st == KVQ_OK) st = ref_win_init(&L->win[w], H, D, L->rule[w].capacity);
        if (st == KVQ_OK) st = ref_pages_reserve(&L->pages[w], npages[w]);
        if (st == KVQ_OK && !(L->tscale[w] = kvq_calloc((size_t)H, sizeof *L->tscale[w]))) st = KVQ_ERR_NOMEM;
    }
    for (int w = 0; w < 2 && st == KVQ_OK; w++) {
        /* TurboQuant: the layer's quantizer (levels, QJL matrix seeded by the tensor's rotate seed) */
        const kvq_tensor_cfg *t = tcfg(L, w);
        if (t->turboquant == KVQ_TQ_NONE || kvq_bits_is_fp16(t->bits)) continue;
        L->tq[w] = kvq_calloc(1, sizeof *L->tq[w]);
        st = L->tq[w] ? kvq_tqv_init(L->tq[w], D, t->bits, t->turboquant == KVQ_TQ_PROD, t->rotate_seed, t->tq_outliers,
                                      t->tq_outlier_bits)
                       : KVQ_ERR_NOMEM;
    }
    if (st == KVQ_OK && cfg->outliers.keep > 0) {
        st = ref_pool_init(&L->pool, H, D, cfg->outliers.keep);
        if (st == KVQ_OK) st = ref_pool_init(&L->spill, H, D, cfg->outliers.spill);
    }
    if (st == KVQ_OK && saliency_on(L)) {
        int wcap = L->rule[0].capacity > 0 ? L->rule[0].capacity : 1;
        L->probe_cap = ref_probe_bound(&cfg->saliency, wcap);
        L->probe_pos = kvq_malloc((size_t)wcap * sizeof *L->probe_pos);
        L->rows = kvq_malloc((size_t)L->probe_cap * (size_t)H * (size_t)wcap * sizeof *L->rows);
        if (!L->probe_pos || !L->rows) st = KVQ_ERR_NOMEM;
    }
    if (st == KVQ_OK) {
        pg = kvq_calloc((size_t)(total_pages > 0 ? total_pages : 1), sizeof *pg);
        if (!pg) st = KVQ_ERR_NOMEM;
    }
    for (int w = 0; w < 2 && st == KVQ_OK; w++) st = alloc_pages(L, w, quantized[w], pg, &got);

    /* Scratch: fp16-rounded K and V, the flushed tokens of each tensor, per-token flags, the policies'. */
    int B = quantized[0] > quantized[1] ? quantized[0] : quantized[1];
    size_t TD = (size_t)H * (size_t)T * (size_t)D, HB = (size_t)H * (size_t)(B > 0 ? B : 1);
    size_t need = 2 * ref_arena_need(TD * sizeof(float)) + 2 * ref_arena_need(HB * (size_t)D * sizeof(float)) +
                  2 * ref_arena_need(HB) + flush_scratch_bytes(L, B > 0 ? B : 1) * 2 + ref_outlier_scratch_bytes(B);
    if (saliency_on(L)) need += ref_saliency_prefill_scratch_bytes(L, T, B);
    if (st == KVQ_OK) st = ref_arena_init(&a, need);
    if (st != KVQ_OK) {
        for (int j = 0; j < got; j++) ref_page_free(pg[j]);
        kvq_free(pg);
        ref_arena_free(&a);
        ref_qlayer_free(L);
        return st;
    }

    /* Everything is allocated: from here on nothing fails. */
    float *kr = ref_arena_take(&a, TD * sizeof(float)), *vr = ref_arena_take(&a, TD * sizeof(float));
    ref_round_f16(kr, it->k, TD);
    ref_round_f16(vr, it->v, TD);
    set_tscale(L, 0, kr, (size_t)T * (size_t)D);
    set_tscale(L, 1, vr, (size_t)T * (size_t)D);
    for (int t = 0; t < S; t++) {
        ref_win_push(&L->sink[0], kr + (size_t)t * (size_t)D, (size_t)T * (size_t)D, t);
        ref_win_push(&L->sink[1], vr + (size_t)t * (size_t)D, (size_t)T * (size_t)D, t);
    }
    float *xk = ref_arena_take(&a, HB * (size_t)D * sizeof(float));
    float *xv = ref_arena_take(&a, HB * (size_t)D * sizeof(float));
    unsigned char *is_high = ref_arena_take(&a, HB), *pooled = ref_arena_take(&a, HB);
    gather_range(xk, kr, H, T, D, S, quantized[0]);
    gather_range(xv, vr, H, T, D, S, quantized[1]);
    int use_pool = cfg->outliers.keep > 0 && quantized[0] > 0;
    if (use_pool) /* OTT: the prefill is one quantization step (K and V flush the same tokens: one rule) */
        ref_outlier_step(L, xk, xv, quantized[0], S, pooled, &a);
    if (saliency_on(L) && B > 0) /* ZipCache Alg. 2; K and V share the rule, hence the tokens and classes */
        ref_saliency_prefill(L, kr, it->q, T, S, B, is_high, &a);
    int next = 0;
    st = flush_pages(L, 0, xk, quantized[0], S, saliency_on(L) ? is_high : NULL, use_pool ? pooled : NULL, pg, &next,
                     &a);
    if (st == KVQ_OK) st = flush_pages(L, 1, xv, quantized[1], S, saliency_on(L) ? is_high : NULL, NULL, pg, &next, &a);
    if (st != KVQ_OK) {
        for (int j = next; j < got; j++) ref_page_free(pg[j]);
        kvq_free(pg);
        ref_arena_free(&a);
        ref_qlayer_free(L);
        return st;
    }
    for (int w = 0; w < 2; w++) {
        const float *x = w ? vr : kr;
        for (int t = S + quantized[w]; t < T; t++)
            ref_win_push(&L->win[w], x + (size_t)t * (size_t)D, (size_t)T * (size_t)D, t);
    }
    L->length = T;
    if (saliency_on(L) && L->rule[0].capacity > 0) ref_saliency_new_cycle(L);
    kvq_free(pg);
    ref_arena_free(&a);
    return KVQ_OK;
}

/* ----------------------------------------------------------------------------------------------- decode -- */

typedef ref_step_plan step_plan;

static void plan_step(const ref_qlayer *L, step_plan *p)
{
    memset(p, 0, sizeof *p);
    if (L->length < L->cfg->sinks) {
        p->to_sink = 1;
        return;
    }
    for (int w = 0; w < 2; w++) {
        const kvq_window_rule *r = &L->rule[w];
        if (r->capacity == 0)
            p->direct[w] = 1;
        else if (L->win[w].count + 1 == r->capacity)
            p->flush[w] = r->batch;
    }
}

kvq_status ref_qlayer_reserve(ref_qlayer *L, ref_reserve *r)
{
    step_plan p;
    plan_step(L, &p);
    int H = L->H, D = L->D, len = L->length + 1, n = 0, need_pages = 0;
    size_t arena = ref_attend_scratch_bytes(len, D) + ref_arena_need((size_t)L->Hq * (size_t)len * sizeof(float)) +
                   3 * ref_arena_need((size_t)H * (size_t)D * sizeof(float));
    int Bmax = 0;
    for (int w = 0; w < 2; w++) {
        int B = p.direct[w] ? 1 : p.flush[w];
        if (!B) continue;
        if (append_mode(L, w)) {
            const ref_page *ap = L->append[w];
            need_pages += !ap || ap->count == ap->fmt.capacity;
        } else {
            need_pages += plan_flush(L, w, B, NULL, NULL);
            if (B > Bmax) Bmax = B;
        }
    }
    if (Bmax > 0) {
        size_t HB = (size_t)H * (size_t)Bmax;
        arena += 2 * ref_arena_need(HB * (size_t)D * sizeof(float)) + 2 * ref_arena_need(HB) +
                 2 * flush_scratch_bytes(L, Bmax) + ref_outlier_scratch_bytes(Bmax);
        if (saliency_on(L)) arena += ref_saliency_flush_scratch_bytes(L, Bmax);
    }
    memset(r, 0, sizeof *r);
    kvq_status st = ref_arena_init(&r->arena, arena);
    if (st == KVQ_OK && need_pages) {
        r->pages = kvq_calloc((size_t)need_pages, sizeof *r->pages);
        if (!r->pages) st = KVQ_ERR_NOMEM;
    }
    /* In the order do_flushes takes them: appendable pages of K then V first, then the flush pages of K then V. */
    for (int pass = 0; pass < 2; pass++)
        for (int w = 0; w < 2 && st == KVQ_OK; w++) {
            int B = p.direct[w] ? 1 : p.flush[w];
            if (!B || append_mode(L, w) != (pass == 0)) continue;
            if (pass == 0) {
                const ref_page *ap = L->append[w];
                if (!ap || ap->count == ap->fmt.capacity) {
                    /* the page's first token: the new one, or the window's oldest (aligned: layout.h) */
                    int first = p.direct[w] ? L->length : L->win[w].pos[0];
                    kvq_page_format f;
                    kvq_page_format_init(&f, tcfg(L, w), tcfg(L, w)->bits, masked_tensor(L, w), H, D,
                                         kvq_append_page_tokens(first, L->cfg->sinks));
                    st = ref_page_new(&f, KVQ_SEG_BODY_HIGH, &r->pages[n]);
                    if (st == KVQ_OK) r->pages[n++]->tq = L->tq[w];
                    if (st == KVQ_OK) st = ref_pages_reserve(&L->pages[w], 1);
                }
            } else {
                int before = n;
                st = alloc_pages(L, w, B, r->pages, &n);
                if (st == KVQ_OK) st = ref_pages_reserve(&L->pages[w], n - before);
            }
        }
    r->n_pages = n;
    if (st != KVQ_OK) ref_reserve_free(r);
    return st;
}

/* Reads the window's B oldest tokens into x [H][B][D] and drops them. */
static int take_oldest(ref_win *w, int B, float *x)
{
    int first = w->pos[0];
    for (int h = 0; h < w->H; h++)
        for (int i = 0; i < B; i++) ref_win_read(w, h, i, x + ((size_t)h * (size_t)B + (size_t)i) * (size_t)w->D);
    ref_win_drop_front(w, B);
    return first;
}

/* Attention of every query head over the cache (L->length tokens): materialise each kv head, attend with its
 * group's query heads. probs [Hq][len] when the caller needs the rows (ZipCache probes), else NULL. */
kvq_status ref_qlayer_attend_all(const ref_qlayer *L, const float *q, float *out, float *probs, ref_arena *a)
{
    int len = L->length, D = L->D, g = L->Hq / L->H;
    float *K = ref_arena_take(a, (size_t)len * (size_t)D * sizeof(float));
    float *V = ref_arena_take(a, (size_t)len * (size_t)D * sizeof(float));
    unsigned char *seen = ref_arena_take(a, (size_t)len * 2);
    for (int h = 0; h < L->H; h++) {
        kvq_status st = ref_qlayer_materialize(L, h, K, V, seen);
        if (st != KVQ_OK) return st;
        for (int j = 0; j < g; j++) {
            int qh = h * g + j;
            ref_attend(q + (size_t)qh * (size_t)D, K, V, len, D, L->scale, out + (size_t)qh * (size_t)D,
                       probs ? probs + (size_t)qh * (size_t)len : NULL);
        }
    }
    return KVQ_OK;
}

/* The tokens leaving (or skipping) the windows this step, written to pages. xnew: the new token [2][H][D]. */
static kvq_status do_flushes(ref_qlayer *L, const step_plan *p, const float *xnew[2], int pos, ref_reserve *r)
{
    int H = L->H, D = L->D;
    float *x[2] = {NULL, NULL};
    int first[2] = {0, 0}, B[2] = {0, 0};
    for (int w = 0; w < 2; w++) {
        B[w] = p->direct[w] ? 1 : p->flush[w];
        if (!B[w]) continue;
        if (append_mode(L, w)) {
            /* KIVI values (Alg. 1: XVr[:-R] popped one at a time), or an fp16 tensor. */
            ref_page *ap = L->append[w];
            if (!ap || ap->count == ap->fmt.capacity) {
                ap = r->pages[r->used_pages++];
                L->pages[w].v[L->pages[w].n++] = ap;
                L->append[w] = ap;
            }
            if (p->direct[w]) {
                set_tscale(L, w, xnew[w], (size_t)D);
                ref_page_set_tscale(ap, L->tscale[w]);
                ref_page_append(ap, xnew[w], pos);
            } else {
                float *buf = ref_arena_take(&r->arena, (size_t)H * (size_t)D * sizeof(float));
                int fp = take_oldest(&L->win[w], 1, buf);
                set_tscale(L, w, buf, (size_t)D);
                ref_page_set_tscale(ap, L->tscale[w]);
                ref_page_append(ap, buf, fp);
            }
            B[w] = 0;
            continue;
        }
        x[w] = ref_arena_take(&r->arena, (size_t)H * (size_t)B[w] * (size_t)D * sizeof(float));
        if (p->direct[w]) {
            memcpy(x[w], xnew[w], (size_t)H * (size_t)D * sizeof(float));
            first[w] = pos;
        } else {
            first[w] = take_oldest(&L->win[w], B[w], x[w]);
        }
    }
    int Bm = B[0] > B[1] ? B[0] : B[1];
    if (!Bm) return KVQ_OK;
    unsigned char *pooled = NULL, *is_high = NULL;
    if (L->cfg->outliers.keep > 0 && B[0] > 0 && B[1] == B[0]) {
        /* OTT: K and V of the same G tokens leave together (one rule); one competition per flush. */
        pooled = ref_arena_take(&r->arena, (size_t)H * (size_t)Bm);
        ref_outlier_step(L, x[0], x[1], B[0], first[0], pooled, &r->arena);
    }
    if (saliency_on(L)) {
        is_high = ref_arena_take(&r->arena, (size_t)H * (size_t)Bm);
        if (!p->direct[0]) {
            ref_saliency_flush(L, Bm, is_high, &r->arena); /* Alg. 3 with this cycle's probe rows */
        } else {
            /* No window (interval 1, no residual): a batch of one token, whose class the count decides. */
            int hc = kvq_saliency_high_count(&L->cfg->saliency, Bm);
            memset(is_high, hc > 0, (size_t)H * (size_t)Bm);
        }
    }
    kvq_status st = KVQ_OK;
    for (int w = 0; w < 2 && st == KVQ_OK; w++)
        if (B[w])
            st = flush_pages(L, w, x[w], B[w], first[w], is_high, w == 0 ? pooled : NULL, r->pages, &r->used_pages,
                             &r->arena);
    return st;
}

kvq_status ref_qlayer_step_begin(ref_qlayer *L, ref_reserve *r, const float *k, const float *v, ref_qstep *s)
{
    step_plan *p = &s->plan;
    plan_step(L, p);
    int H = L->H, D = L->D, pos = L->length;
    float *kr = ref_arena_take(&r->arena, (size_t)H * (size_t)D * sizeof(float));
    float *vr = ref_arena_take(&r->arena, (size_t)H * (size_t)D * sizeof(float));
    ref_round_f16(kr, k, (size_t)H * (size_t)D);
    ref_round_f16(vr, v, (size_t)H * (size_t)D);
    s->xnew[0] = kr;
    s->xnew[1] = vr;
    s->pos = pos;
    s->saliency = 0;
    s->probe = 0;

    if (p->to_sink) {
        ref_win_push(&L->sink[0], kr, (size_t)D, pos);
        ref_win_push(&L->sink[1], vr, (size_t)D, pos);
        L->length++;
        /* ZipCache: the first decode cycle starts with the first token after the sinks. */
        if (L->length == L->cfg->sinks && saliency_on(L) && L->rule[0].capacity > 0) ref_saliency_new_cycle(L);
        return KVQ_OK;
    }
    for (int w = 0; w < 2; w++)
        if (!p->direct[w]) ref_win_push(&L->win[w], s->xnew[w], (size_t)D, pos);

    if (saliency_on(L) && L->rule[0].capacity > 0) {
        /* ZipCache Alg. 3: attend (recording the probe row), then compress every W: both in step_end. */
        L->length++;
        s->saliency = 1;
        s->probe = L->n_rows < L->n_probes && L->probe_pos[L->n_rows] == pos;
        return KVQ_OK;
    }
    /* KIVI Alg. 1 / OTT: quantize what leaves the window, then attend. */
    kvq_status st = do_flushes(L, p, s->xnew, pos, r);
    L->length++;
    return st;
}

kvq_status ref_qlayer_step_end(ref_qlayer *L, ref_reserve *r, ref_qstep *s, const float *probs)
{
    if (!s->saliency) return KVQ_OK;
    ref_saliency_record(L, s->pos, probs, L->length); /* reads probs only when the step is a probe */
    kvq_status st = KVQ_OK;
    if (s->plan.flush[0]) {
        st = do_flushes(L, &s->plan, s->xnew, s->pos, r);
        ref_saliency_new_cycle(L);
    }
    return st;
}

kvq_status ref_qlayer_step(ref_qlayer *L, ref_reserve *r, const float *k, const float *v, const float *q, float *out)
{
    ref_qstep s;
    kvq_status st = ref_qlayer_step_begin(L, r, k, v, &s);
    if (st != KVQ_OK) return st;
    float *probs = NULL;
    if (s.saliency) probs = ref_arena_take(&r->arena, (size_t)L->Hq * (size_t)L->length * sizeof(float));
    st = ref_qlayer_attend_all(L, q, out, probs, &r->arena);
    if (st != KVQ_OK) return st;
    return ref_qlayer_step_end(L, r, &s, probs);
}

/* ------------------------------------------------------------------------------------------- accounting -- */

void ref_qlayer_account(const ref_qlayer *L, kvq_mem_stats *o)
{
    uint64_t H = (uint64_t)L->H;
    for (int w = 0; w < 2; w++) {
        o->bytes[KVQ_SEG_SINK] += L->sink[w].bytes;
        o->tokens[KVQ_SEG_SINK] += (uint64_t)L->sink[w].count * H;
        o->bytes[KVQ_SEG_RESIDUAL] += L->win[w].bytes;
        o->tokens[KVQ_SEG_RESIDUAL] += (uint64_t)L->win[w].count * H;
        for (int j = 0; j < L->pages[w].n; j++) {
            const ref_page *pg = L->pages[w].v[j];
            o->bytes[pg->seg] += pg->lay.codes_size + pg->lay.qjl_size; /* QJL signs are codes (account.c) */
            o->bytes[KVQ_SEG_PARAMS] += pg->lay.total - pg->lay.codes_size - pg->lay.qjl_size;
            o->tokens[pg->seg] += (uint64_t)pg->count * H;
        }
    }
    const ref_pool *pools[2] = {&L->pool, &L->spill};
    const kvq_segment segs[2] = {KVQ_SEG_OUTLIER, KVQ_SEG_SPILL};
    for (int i = 0; i < 2; i++) {
        if (!pools[i]->count) continue; /* no outlier pool in this layer */
        o->bytes[segs[i]] += pools[i]->bytes;
        for (int h = 0; h < L->H; h++) o->tokens[segs[i]] += 2 * (uint64_t)pools[i]->count[h];
    }
}
