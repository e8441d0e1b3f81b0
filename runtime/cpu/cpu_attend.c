/* Attention of a quantize-mode layer's decode step on the cpu backend, over the reference's storage.
 *
 * Per (sequence, kv head): the K storage as spans in storage order (sinks, pages, window: every slot, masked ones
 * included) and the V storage as spans sorted by position; each token is in exactly one K slot and one V slot
 * (OTT's pooled tokens too: their K slot is masked, their V slot holds the group mean that p = 0 ignores), and
 * pooled tokens also sit in the pools, whose K and V rows are side by side.
 * Per (sequence, kv head, KV chunk): a range of K slots cut into tiles by the one rule (kvq_tile_len,
 * layout/tiles.h, the plan's tile): up to `tile` slots of one K span, or of one page run of K spans (a KIVI
 * flush's key pages: the kernel takes one descriptor per page), whose tokens lie at consecutive slots of one V
 * span (K row i and V row i the same token); each tile runs the compiled kernel of its (K source, V source) pair
 * on the chunk's online-softmax state.
 * Per (sequence, kv head): the chunks' states merge by (m, l): o = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
 * Attention does not depend on the order of tokens (DESIGN §4), so tiles can follow storage order. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "tiles.h"

#define TILE EMIT_LLVM_TILE

static int saliency_on(const ref_qlayer *L) { return L->cfg->saliency.metric != KVQ_SAL_NONE; }

/* KV chunks per kv head: enough tasks for the pool (about 4 per thread over the batch), chunks of at least
 * 1024 tokens (a chunk's fixed cost, state and merge, is ~ one tile). */
static int chunk_count(int len, int H, int threads, int n_items)
{
    int want = (4 * threads + n_items * H - 1) / (n_items * H);
    int most = (len + 1023) / 1024;
    int c = want < most ? want : most;
    if (c > 64) c = 64;
    return c > 0 ? c : 1;
}

static size_t state_floats(const ref_qlayer *L)
{
    int g = L->Hq / L->H;
    return (size_t)g * ((size_t)L->D + 2 + TILE);
}

/* TurboQuant prod keys: the QJL term needs S q once per step (emit_llvm_turboquant.h). */
static int qjl_keys(const ref_qlayer *L) { return L->tq[0] && L->tq[0]->part[0].prod; }

static int span_cap(const ref_qlayer *L, int new_pages)
{
    return L->pages[0].n + L->pages[1].n + new_pages + 4;
}

size_t cpu_item_size(cpu_item *it, const ref_qlayer *L, int new_pages, int threads, int n_items)
{
    int H = L->H, len = L->length + 1, C = chunk_count(len, H, threads, n_items), cap = span_cap(L, new_pages);
    it->chunks = C;
    it->span_cap = cap;
    it->use_vmap = saliency_on(L);
    size_t n = ref_arena_need((size_t)H * sizeof(cpu_head)) +
               (size_t)H * (2 * ref_arena_need((size_t)cap * sizeof(cpu_span)) + ref_arena_need(2 * sizeof(cpu_span))) +
               ref_arena_need((size_t)L->Hq * (size_t)L->D * sizeof(float)) +
               ref_arena_need((size_t)H * (size_t)C * state_floats(L) * sizeof(float));
    if (qjl_keys(L)) n += ref_arena_need((size_t)L->Hq * (size_t)L->D * sizeof(float));
    if (saliency_on(L)) n += (size_t)H * ref_arena_need(2 * (size_t)len * sizeof(int));
    return n;
}

void cpu_item_init(cpu_item *it, const ref_qlayer *L, const cpu_class *cls, ref_arena *a)
{
    int H = L->H;
    it->L = L;
    it->cls = cls;
    /* L->length already counts the new token (step_begin ran): cpu_item_size took length + 1. */
    atomic_init(&it->bad, 0);
    it->heads = ref_arena_take(a, (size_t)H * sizeof(cpu_head));
    for (int h = 0; h < H; h++) {
        cpu_head *hd = &it->heads[h];
        memset(hd, 0, sizeof *hd);
        hd->ks = ref_arena_take(a, (size_t)it->span_cap * sizeof(cpu_span));
        hd->vs = ref_arena_take(a, (size_t)it->span_cap * sizeof(cpu_span));
        hd->pools = ref_arena_take(a, 2 * sizeof(cpu_span));
        if (it->use_vmap) hd->vmap = ref_arena_take(a, 2 * (size_t)L->length * sizeof(int));
    }
    it->qs = ref_arena_take(a, (size_t)L->Hq * (size_t)L->D * sizeof(float));
    it->state = ref_arena_take(a, (size_t)H * (size_t)it->chunks * state_floats(L) * sizeof(float));
    size_t nq = (size_t)L->Hq * (size_t)L->D;
    for (size_t i = 0; i < nq; i++) it->qs[i] = it->q ? it->q[i] * L->scale : 0.0f; /* no q: a tile list only */
    it->sq = NULL;
    if (qjl_keys(L)) {
        /* TurboQuant Algorithm 2's estimator: sqrt(pi/2)/m_j (S_j q_j) per part, once per step and query head
         * (the keys' QJL term is then one dot product per token, emit_llvm_turboquant.h) */
        it->sq = ref_arena_take(a, nq * sizeof(float));
        const kvq_tqv *tv = L->tq[0];
        double sqd[256];
        for (int hq = 0; hq < L->Hq; hq++)
            for (int j = 0; j < tv->n_parts; j++) {
                const kvq_tq *t = &tv->part[j];
                size_t o = (size_t)hq * (size_t)L->D + (size_t)tv->off[j];
                kvq_tq_sketch_query(t, it->qs + o, sqd);
                for (int i = 0; i < t->m; i++) it->sq[o + (size_t)i] = (float)(sqd[i] * sqrt(M_PI / 2) / t->m);
            }
    }
}

/* ------------------------------------------------------------------------------------------------ spans -- */

static void add_win(cpu_span *list, int *n, const ref_win *w, int h)
{
    if (!w->count) return;
    cpu_span *s = &list[(*n)++];
    memset(s, 0, sizeof *s);
    s->rows = w->data + (size_t)h * (size_t)w->cap * (size_t)w->D;
    s->pos = w->pos;
    s->n = w->count;
    s->first = s->pos[0];
    s->run = 1;
    s->rn = s->n;
}

static int add_page(cpu_span *list, int *n, const ref_page *pg, int h, const cpu_class *cls, int which)
{
    if (!pg->count) return 1;
    cpu_span *s = &list[(*n)++];
    memset(s, 0, sizeof *s);
    int cap = pg->fmt.capacity;
    s->pos = pg->pos + (size_t)h * (size_t)cap;
    s->n = pg->count;
    s->first = s->pos[0];
    s->consec = s->pos[s->n - 1] - s->first == s->n - 1; /* positions ascend strictly within a span */
    s->run = 1;
    s->rn = s->n;
    if (kvq_bits_is_fp16(pg->fmt.bits)) {
        /* fp16 pages are fp16 rows: the same kernels as windows. */
        s->rows = (const uint16_t *)(pg->mem + pg->lay.codes) + (size_t)h * (size_t)cap * (size_t)pg->fmt.head_dim;
        return 1;
    }
    s->pg = pg;
    s->src = cpu_class_source(cls, which, &pg->fmt);
    s->paged = which == 0 && pg->fmt.gran == KVQ_GRAN_CHANNEL && pg->fmt.format.kind == KVQ_FMT_INT; /* emit_llvm_paged_keys */
    const kvq_page_format *fm = &pg->fmt;
    const kvq_page_layout *lay = &pg->lay;
    size_t hh = (size_t)h, D = (size_t)fm->head_dim, c = (size_t)cap, p0, step;
    s->xb = lay->code_bytes_per_token;
    s->x = pg->mem + lay->codes + hh * c * s->xb;
    if (fm->gran == KVQ_GRAN_CHANNEL) {
        p0 = hh * D;
        step = 0;
        s->sfix = D * (size_t)fm->scale_bytes;
        s->zfix = D * (size_t)fm->zero_bytes;
    } else if (fm->hidden) {
        p0 = 0;
        step = 1;
    } else {
        p0 = hh * c * (size_t)lay->n_groups;
        step = (size_t)lay->n_groups;
    }
    s->sc = pg->mem + lay->scale + p0 * (size_t)fm->scale_bytes;
    s->z = pg->mem + lay->zero + p0 * (size_t)fm->zero_bytes;
    s->sb = step * (size_t)fm->scale_bytes;
    s->zb = step * (size_t)fm->zero_bytes;
    if (fm->channel_separable) {
        s->f = pg->mem + lay->factor + hh * D * (size_t)fm->scale_bytes;
        s->fb = D * (size_t)fm->scale_bytes;
    }
    if (fm->masked) s->mask = pg->mem + lay->mask + hh * ((c + 7) / 8);
    if (lay->qjl_size) s->qjl = pg->mem + lay->qjl + hh * c * (D / 8);
    if (lay->tscale_size) /* element formats: the page's tensor scale, one or one per kv head (layout.h) */
        s->t = (const float *)(pg->mem + lay->tscale + (fm->format.tensor_scale_per_head ? hh * sizeof(float) : 0));
    return s->src > 0;
}

/* Page runs among the K spans (layout/tiles.h): consecutive spans of one run's full pages (ref_page.run_idx
 * ascending by one, the same source), positions consecutive across them, become one unit of the tile loop: the
 * first span's run and rn count them, pcap is their pages' capacity. */
static void join_runs(cpu_span *ks, int nk)
{
    for (int i = 0; i < nk;) {
        cpu_span *s = &ks[i];
        int j = i + 1;
        if (s->paged && s->pg->run_len > 0 && s->consec && s->n == s->pg->fmt.capacity) {
            int rn = s->n;
            while (j < nk && ks[j].pg && ks[j].pg->run_len > 0 && ks[j].pg->run_idx == ks[j - 1].pg->run_idx + 1 &&
                   ks[j].src == s->src && ks[j].consec && ks[j].n == s->n && ks[j].first == ks[j - 1].first + ks[j - 1].n)
                rn += ks[j++].n;
            if (j - i >= 2) {
                s->run = j - i;
                s->rn = rn;
                s->pcap = s->n;
            }
        }
        i = j;
    }
}

static void sort_by_first(cpu_span *v, int n)
{
    for (int i = 1; i < n; i++) {
        cpu_span x = v[i];
        int j = i - 1;
        while (j >= 0 && v[j].first > x.first) {
            v[j + 1] = v[j];
            j--;
        }
        v[j + 1] = x;
    }
}

void cpu_item_spans(cpu_item *it, int h)
{
    const ref_qlayer *L = it->L;
    cpu_head *hd = &it->heads[h];
    int ok = 1, len = L->length;
    hd->nk = hd->nv = hd->npool = 0;
    add_win(hd->ks, &hd->nk, &L->sink[0], h);
    /* The page headers are separate allocations, thousands at long contexts, and so are their position arrays,
     * whose first and last slots of this head add_page reads: the headers are requested 8 ahead, the positions
     * (through the header requested before) 4 ahead. */
    for (int w = 0; w < 2; w++) {
        if (w) {
            add_win(hd->ks, &hd->nk, &L->win[0], h);
            add_win(hd->vs, &hd->nv, &L->sink[1], h);
        }
        ref_page *const *pv = L->pages[w].v;
        int np = L->pages[w].n;
        for (int j = 0; j < np; j++) {
            if (j + 8 < np) __builtin_prefetch(pv[j + 8], 0, 3);
            if (j + 4 < np && pv[j + 4]->count) {
                const int *pp = pv[j + 4]->pos + (size_t)h * (size_t)pv[j + 4]->fmt.capacity;
                __builtin_prefetch(pp, 0, 3);
                __builtin_prefetch(pp + pv[j + 4]->count - 1, 0, 3);
            }
            ok &= add_page(w ? hd->vs : hd->ks, w ? &hd->nv : &hd->nk, pv[j], h, it->cls, w);
        }
    }
    add_win(hd->vs, &hd->nv, &L->win[1], h);
    sort_by_first(hd->vs, hd->nv);
    join_runs(hd->ks, hd->nk);
    const ref_pool *pools[2] = {&L->pool, &L->spill};
    for (int i = 0; i < 2; i++) {
        const ref_pool *P = pools[i];
        if (!P->cap || !P->count[h]) continue;
        cpu_span *s = &hd->pools[hd->npool++];
        memset(s, 0, sizeof *s);
        s->rows = P->k + (size_t)h * (size_t)P->cap * (size_t)P->D;
        s->vrows = P->v + (size_t)h * (size_t)P->cap * (size_t)P->D;
        s->pos = P->pos + (size_t)h * (size_t)P->cap;
        s->n = P->count[h];
        s->first = s->pos[0];
    }
    int nk = 0, nv = 0;
    for (int i = 0; i < hd->nk; i++) nk += hd->ks[i].n;
    for (int i = 0; i < hd->nv; i++) nv += hd->vs[i].n;
    hd->total = nk;
    /* Every token has one K slot and one V slot (masked K slots included). */
    ok &= nk == len && nv == len;
    if (ok && hd->vmap) {
        int *span = hd->vmap, *slot = hd->vmap + len;
        for (int p = 0; p < len; p++) span[p] = -1;
        for (int i = 0; i < hd->nv && ok; i++)
            for (int s = 0; s < hd->vs[i].n; s++) {
                int p = hd->vs[i].pos[s];
                if (p < 0 || p >= len || span[p] >= 0) {
                    ok = 0;
                    break;
                }
                span[p] = i;
                slot[p] = s;
            }
    }
    hd->broken = !ok;
}

/* The V span and slot of position p: the map, or a search over the spans (consecutive positions): first the
 * span `hint` (the previous tile's) and the one after it, as K and V storage mostly ascend together, then a
 * binary search. */
static int find_v(const cpu_head *hd, int p, int len, int hint, int *slot)
{
    if (hd->vmap) {
        if (p < 0 || p >= len || hd->vmap[p] < 0) return -1;
        *slot = hd->vmap[len + p];
        return hd->vmap[p];
    }
    for (int c = hint; c >= 0 && c < hd->nv && c <= hint + 1; c++) {
        const cpu_span *s = &hd->vs[c];
        int off = p - s->first;
        if (off >= 0 && off < s->n && (s->consec || s->pos[off] == p)) {
            *slot = off;
            return c;
        }
    }
    int lo = 0, hi = hd->nv - 1, at = -1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (hd->vs[mid].first <= p) {
            at = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    if (at >= 0) {
        const cpu_span *s = &hd->vs[at];
        int off = p - s->first;
        if (off < s->n && (s->consec || s->pos[off] == p)) {
            *slot = off;
            return at;
        }
    }
    /* Not consecutive after all: search every span (positions ascend within a span). */
    for (int i = 0; i < hd->nv; i++) {
        const cpu_span *s = &hd->vs[i];
        int a = 0, b = s->n - 1;
        while (a <= b) {
            int m = (a + b) / 2;
            if (s->pos[m] == p) {
                *slot = m;
                return i;
            }
            if (s->pos[m] < p) a = m + 1;
            else b = m - 1;
        }
    }
    return -1;
}

/* ------------------------------------------------------------------------------------------------ tiles -- */

/* The kernel arguments of slot `slot` of span s: rows, codes, parameters, mask (emit_llvm.h; the span holds
 * this kv head's bases, add_page). */
static void source_args(const cpu_span *s, int slot, int D, const uint8_t **x, const uint8_t **sc,
                        const uint8_t **z, const uint8_t **f, const uint8_t **mask, int32_t *mbit)
{
    if (!s->pg) {
        *x = (const uint8_t *)(s->rows + (size_t)slot * (size_t)D);
        return;
    }
    size_t sl = (size_t)slot;
    *x = s->x + sl * s->xb;
    *sc = s->sc + sl * s->sb;
    *z = s->z + sl * s->zb;
    *f = s->f;
    if (s->mask) {
        *mask = s->mask;
        *mbit = (int32_t)slot;
    }
}

/* Prefetches [p, p + n) into the cache (DRAM latency: a tile's codes are a few short runs in separate pages,
 * too short for the hardware prefetcher to ramp up, so the next tiles' runs are requested while this one runs).
 * A macro, not a function: GCC 12 finds a void function whose only effect is __builtin_prefetch "const" and
 * deletes its calls. */
#define PREFETCH_BYTES(p, n)                                                                                    \
    do {                                                                                                        \
        const uint8_t *pf_p = (p);                                                                              \
        size_t pf_n = (n);                                                                                      \
        if (pf_p && pf_n) {                                                                                     \
            for (size_t pf_o = 0; pf_o < pf_n; pf_o += 64) __builtin_prefetch(pf_p + pf_o, 0, 3);              \
            __builtin_prefetch(pf_p + pf_n - 1, 0, 3);                                                          \
        }                                                                                                       \
    } while (0)

/* The bytes a tile of n slots reads from span s, given its source_args pointers; short quantized spans only.
 * fp16 rows are long contiguous runs that the hardware prefetcher follows (prefetching 2 x 64 rows of 2 x 256
 * bytes ahead overflowed the L1 and cost fp16 ~25 %), and so is a span of more than PF_SPAN_MAX slots (a
 * prefill's one value page: per head one run of T rows): prefetching those too filled the fill buffers, the
 * prefetch instructions themselves then took ~12 % of a KIVI-2 64k step in perf's samples, and dropping them
 * made KIVI-2 and KIVI-4 at 64k ~8 % faster (docs/cpu.md "int8 P.V and where the time goes now"). */
#define PF_SPAN_MAX 256
#define PREFETCH_SOURCE(s, cnt, x, sc, z, f)                                                                 \
    do {                                                                                                        \
        size_t pf_nn = (size_t)(cnt);                                                                           \
        if ((s)->pg && (s)->n <= PF_SPAN_MAX) {                                                                 \
            PREFETCH_BYTES(x, pf_nn * (s)->xb);                                                                 \
            PREFETCH_BYTES(sc, (s)->sb ? pf_nn * (s)->sb : (s)->sfix);                                          \
            PREFETCH_BYTES(z, (s)->zb ? pf_nn * (s)->zb : (s)->zfix);                                           \
            PREFETCH_BYTES(f, (s)->fb);                                                                         \
        }                                                                                                       \
    } while (0)

/* One tile ready to run: its kernel and arguments (paged keys: a descriptor per key page, a.kp), and what
 * rt_step_tiles reports of it. */
typedef struct {
    emit_llvm_tile_fn fn;
    emit_llvm_tile_args a;
    emit_llvm_kpage kp[EMIT_LLVM_TILE / 16 + 1];
    kvq_tile_info info;
} tile_job;

/* Walks the K slots [lo, hi) of a kv head's spans as tiles. */
typedef struct {
    const cpu_head *hd;
    int si, i, end, len, D;
    int vhint; /* the previous tile's V span */
    long base, lo, hi;
} tile_iter;

static void iter_seek(tile_iter *t)
{
    while (t->si < t->hd->nk && t->base < t->hi) {
        const cpu_span *ks = &t->hd->ks[t->si]; /* a span, or the first of a page run's (join_runs) */
        if (t->base + ks->rn > t->lo) {
            if (t->end < 0) {
                t->i = (int)(t->lo > t->base ? t->lo - t->base : 0);
                t->end = (int)(t->hi - t->base < ks->rn ? t->hi - t->base : ks->rn);
            }
            if (t->i < t->end) return;
        }
        t->base += ks->rn;
        t->si += ks->run;
        t->end = -1;
    }
    t->si = t->hd->nk;
}

/* The next tile into *j (its fixed arguments already set), its bytes requested; 0 when done, -1 if a K slot has
 * no V slot. */
static int iter_next(tile_iter *t, const cpu_class *cls, tile_job *j)
{
    iter_seek(t);
    if (t->si >= t->hd->nk) return 0;
    const cpu_head *hd = t->hd;
    const cpu_span *ks = &hd->ks[t->si];
    int i = t->i, end = t->end;
    int p = ks->consec ? ks->first + i : ks->pos[i], off = 0, vi = find_v(hd, p, t->len, t->vhint, &off);
    if (vi < 0) return -1;
    t->vhint = vi;
    const cpu_span *vs = &hd->vs[vi];
    /* the one tile rule (layout/tiles.h), the plan's tile; a page run's pages are pcap slots each */
    int n = kvq_tile_len(cls->tile, end - i, vs->n - off, i, ks->pcap);
    /* Both spans ascend strictly: equal ends at distance n - 1 mean the same consecutive tokens (spans of
     * consecutive positions, page runs among them, hold them by construction: no position array is read, they
     * are cache misses). */
    int kc = ks->consec;
    if (!(kc && vs->consec) && ((!kc && ks->pos[i + n - 1] != p + n - 1) || (!vs->consec && vs->pos[off + n - 1] != p + n - 1))) {
        int m = 1;
        while (m < n && (kc ? p + m : ks->pos[i + m]) == (vs->consec ? p + m : vs->pos[off + m])) m++;
        n = m;
    }
    emit_llvm_tile_args *a = &j->a;
    a->n = n;
    a->ks = a->kz = a->kf = a->kmask = NULL;
    a->vs = a->vz = a->vf = NULL;
    a->kmbit = 0;
    const uint8_t *unused_mask = NULL;
    int32_t unused_bit = 0;
    a->kp = NULL;
    a->nkp = 0;
    if (ks->paged) {
        /* a descriptor per key page the tile spans (the kernel folds q once per page) */
        int np = 0;
        for (int at = i; at < i + n; np++) {
            const cpu_span *ps = ks->pcap ? ks + at / ks->pcap : ks;
            int sl = ks->pcap ? at % ks->pcap : at, pn = ks->pcap ? ks->pcap - sl : n;
            if (pn > i + n - at) pn = i + n - at;
            emit_llvm_kpage *d = &j->kp[np];
            const uint8_t *f = NULL;
            d->kmask = NULL;
            d->kmbit = 0;
            source_args(ps, sl, t->D, &d->k, &d->ks, &d->kz, &f, &d->kmask, &d->kmbit);
            d->n = pn;
            PREFETCH_SOURCE(ps, pn, d->k, d->ks, d->kz, f);
            at += pn;
        }
        a->kp = j->kp;
        a->nkp = np;
    } else {
        source_args(ks, i, t->D, &a->k, &a->ks, &a->kz, &a->kf, &a->kmask, &a->kmbit);
        a->kqjl = ks->qjl ? ks->qjl + (size_t)i * (size_t)(t->D / 8) : NULL;
        PREFETCH_SOURCE(ks, n, a->k, a->ks, a->kz, a->kf);
    }
    source_args(vs, off, t->D, &a->v, &a->vs, &a->vz, &a->vf, &unused_mask, &unused_bit);
    a->kt = ks->t;
    a->vt = vs->t;
    PREFETCH_SOURCE(vs, n, a->v, a->vs, a->vz, a->vf);
    j->fn = cls->fn[ks->src][vs->src];
    j->info.n = n;
    j->info.k_kind = ks->src + 1;
    j->info.v_kind = vs->src + 1;
    j->info.k_pages = kvq_tile_pages(n, i, ks->pcap);
    t->i = i + n;
    return 1;
}

/* The first K slot of chunk c: an even share of the slots, rounded down to whole tiles past the sinks (the
 * first span when there are sinks), so that chunk edges fall on page and tile boundaries and cut no tile the
 * rule would not. */
static long chunk_edge(const cpu_item *it, const cpu_head *hd, int c)
{
    if (c <= 0) return 0;
    if (c >= it->chunks) return hd->total;
    long s0 = it->L->sink[0].count, T = it->cls->tile, x = (long)hd->total * c / it->chunks;
    if (x <= s0) return x;
    return s0 + (x - s0) / T * T;
}

void cpu_item_tiles(cpu_item *it, int h, int chunk)
{
    const ref_qlayer *L = it->L;
    const cpu_head *hd = &it->heads[h];
    int D = L->D, g = L->Hq / L->H, C = it->chunks, len = L->length;
    float *st = it->state + ((size_t)h * (size_t)C + (size_t)chunk) * state_floats(L);
    emit_llvm_tile_args a;
    memset(&a, 0, sizeof a);
    a.q = it->qs + (size_t)h * (size_t)g * (size_t)D;
    a.sq = it->sq ? it->sq + (size_t)h * (size_t)g * (size_t)D : NULL;
    a.acc = st;
    a.ml = st + (size_t)g * (size_t)D;
    a.p = a.ml + 2 * g;
    memset(a.acc, 0, (size_t)g * (size_t)D * sizeof(float));
    for (int j = 0; j < g; j++) {
        a.ml[2 * j] = -FLT_MAX;
        a.ml[2 * j + 1] = 0.0f;
    }
    if (hd->broken) return;
    if (chunk == 0)
        for (int i = 0; i < hd->npool; i++) {
            const cpu_span *s = &hd->pools[i];
            for (int t = 0; t < s->n; t += it->cls->tile) {
                a.n = s->n - t < it->cls->tile ? s->n - t : it->cls->tile;
                a.k = (const uint8_t *)(s->rows + (size_t)t * (size_t)D);
                a.v = (const uint8_t *)(s->vrows + (size_t)t * (size_t)D);
                it->cls->fn[0][0](&a);
            }
        }
    tile_iter t = {hd, 0, 0, -1, len, D, 0, 0, chunk_edge(it, hd, chunk), chunk_edge(it, hd, chunk + 1)};
    /* Tiles run PF behind the iterator: the bytes of the tiles PF - 1 and PF ahead are requested while this one
     * runs (a DRAM access plus, pages being separate allocations, a page walk). */
    enum { PF = 2 };
    tile_job job[PF + 1];
    int r = 1, have = 0, head = 0;
    for (int k = 0; k <= PF; k++) job[k].a = a;
    while (have < PF && (r = iter_next(&t, it->cls, &job[(head + have) % (PF + 1)])) > 0) have++;
    while (have > 0) {
        if (r > 0 && (r = iter_next(&t, it->cls, &job[(head + have) % (PF + 1)])) > 0) have++;
        job[head].fn(&job[head].a);
        head = (head + 1) % (PF + 1);
        have--;
    }
    if (r < 0) atomic_store(&it->bad, 1);
}

void cpu_item_merge(cpu_item *it, int h)
{
    const ref_qlayer *L = it->L;
    int D = L->D, g = L->Hq / L->H, C = it->chunks;
    size_t sf = state_floats(L);
    for (int j = 0; j < g; j++) {
        float *out = it->out + (size_t)(h * g + j) * (size_t)D;
        float M = -FLT_MAX;
        for (int c = 0; c < C; c++) {
            const float *ml = it->state + ((size_t)h * (size_t)C + (size_t)c) * sf + (size_t)g * (size_t)D;
            if (ml[2 * j] > M) M = ml[2 * j];
        }
        double l = 0, w[64];
        for (int c = 0; c < C; c++) {
            const float *ml = it->state + ((size_t)h * (size_t)C + (size_t)c) * sf + (size_t)g * (size_t)D;
            w[c] = exp((double)ml[2 * j] - (double)M);
            l += w[c] * (double)ml[2 * j + 1];
        }
        for (int d = 0; d < D; d++) {
            double o = 0;
            for (int c = 0; c < C; c++)
                o += w[c] * (double)it->state[((size_t)h * (size_t)C + (size_t)c) * sf + (size_t)j * (size_t)D + (size_t)d];
            out[d] = l > 0 ? (float)(o / l) : 0.0f;
        }
    }
}

int cpu_item_ok(const cpu_item *it)
{
    if (atomic_load(&it->bad)) return 0;
    for (int h = 0; h < it->L->H; h++)
        if (it->heads[h].broken) return 0;
    return 1;
}

int cpu_item_tile_list(cpu_item *it, int h, kvq_tile_info *out, int cap)
{
    const cpu_head *hd = &it->heads[h];
    if (hd->broken) return -1;
    int cnt = 0, T = it->cls->tile;
    for (int i = 0; i < hd->npool; i++)
        for (int t = 0; t < hd->pools[i].n; t += T, cnt++)
            if (cnt < cap) out[cnt] = (kvq_tile_info){hd->pools[i].n - t < T ? hd->pools[i].n - t : T, 1, 1, 1};
    for (int c = 0; c < it->chunks; c++) {
        tile_iter t = {hd, 0, 0, -1, it->L->length, it->L->D, 0, 0, chunk_edge(it, hd, c), chunk_edge(it, hd, c + 1)};
        tile_job j;
        memset(&j, 0, sizeof j);
        int r;
        while ((r = iter_next(&t, it->cls, &j)) > 0) {
            if (cnt < cap) out[cnt] = j.info;
            cnt++;
        }
        if (r < 0) return -1;
    }
    return cnt;
}
