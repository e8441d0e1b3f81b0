/* The generated CUDA kernels of every spec in specs/ (and specs/paper/), run under the SIMT emulator and
 * compared with the reference backend:
 *   - quantize-and-append: every page format of every layer class, filled by the kernels and by the reference's
 *     ref_page_fill / ref_page_append from the same fp16 values (random, structured, constant groups), masks set
 *     from the same flags: the page bytes must be identical (codes, scales, zeros, factors, mask bits);
 *   - fp16 row stores and the gather of fetched rows (TailorKV) into fp16 windows: identical bytes;
 *   - fused decode attention: a batch of sequences of different lengths prefilled and decoded by the reference
 *     engine on structured K/V (kvq_synth), then attended by the decode kernel directly over the reference's own
 *     pages, windows and pools, in one chunk and split over chunks with the merge kernel: within 1e-3 of the
 *     reference's attention over the same cache (relative to the output's magnitude), GQA, MHA and MQA, head_dim
 *     64 to 256.
 * Kernels compile with the host C++ compiler (with the sanitizers when this program has them) in two processes,
 * through $KVQ_CACHE_DIR. Without a C++ compiler or the emulator sources: "skipped: <reason>", exit 0. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "alloc.h"
#include "cuda/cu_dev.h"
#include "emit_cuda.h"
#include "half.h"
#include "harness.h"
#include "kvq.h"
#include "plan.h"
#include "quant.h"
#include "rt_internal.h"
#include "synth.h"
#include "test_cuda_mirror.h"

typedef struct {
    const char *file, *scheme;
    int heads, kv_heads, head_dim;
} emu_case;

/* Every scheme with GQA at head_dim 128 (GQA 2: KIVI, OTT and TailorKV-2 on the tensor cores, 4 of N's 8 columns
 * used); MHA for one scheme of each policy family at head_dims 96 (lanes left idle: 12 of 16), 128 (OTT on the
 * tensor cores at GQA 1: 2 columns) and 256 (a full warp along head_dim); MQA (8 query heads on one kv head) at
 * 64; GQA 4 (the tensor-core path's full N) at 64, 128 and 256. */
static const emu_case cases[] = {
    {"specs/fp16.kvq", "fp16", 4, 2, 128},
    {"specs/kivi2.kvq", "kivi2", 4, 2, 128},
    {"specs/kivi2-r32.kvq", "kivi2-r32", 4, 2, 128},
    {"specs/kivi4.kvq", "kivi4", 4, 2, 128},
    {"specs/ott.kvq", "ott", 4, 2, 128},
    {"specs/zipcache.kvq", "zipcache", 4, 2, 128},
    {"specs/tailorkv1.kvq", "tailorkv1", 4, 2, 128},
    {"specs/tailorkv2.kvq", "tailorkv2", 4, 2, 128},
    {"specs/paper/zipcache-appendix-a.kvq", "groupwise", 4, 2, 128},
    {"specs/paper/zipcache-appendix-a.kvq", "tokenwise", 4, 2, 128},
    {"specs/paper/zipcache-appendix-a.kvq", "baseline", 4, 2, 128},
    {"specs/kivi2-r32.kvq", "kivi2-r32", 2, 2, 96},
    {"specs/ott.kvq", "ott", 2, 2, 128},
    {"specs/zipcache.kvq", "zipcache", 2, 2, 256},
    {"specs/kivi4.kvq", "kivi4", 8, 1, 64},
    /* fp16's fp32 score loop at split 2 (64-token tiles) with its parts 8 lanes apart (kvq_p1_lane): GQA 1 at
     * head_dim 96 (the run's query floats as 16-byte loads, 6 runs a part) and GQA 8 at 128 (two loads a row) */
    {"specs/fp16.kvq", "fp16", 2, 2, 96},
    {"specs/fp16.kvq", "fp16", 8, 1, 128},
    /* GQA 4: q.K and p.V on tensor cores (kvq_mma.cuh) at head_dim 64 (one 16-channel block a warp), 128 and
     * 256 (four a warp, tiles of 64; KIVI-4's value groups of 32 are 8 a token: p.V stays fp32) */
    {"specs/kivi2.kvq", "kivi2", 8, 2, 64},
    {"specs/kivi2-r32.kvq", "kivi2-r32", 8, 2, 128},
    {"specs/kivi4.kvq", "kivi4", 8, 2, 256},
    {"specs/tailorkv2.kvq", "tailorkv2", 8, 2, 256}, /* p.V too at 256: value groups of 64, phase 1 split 2 */
    {"specs/paper/zipcache-appendix-a.kvq", "groupwise", 8, 2, 128},
};
#define N_CASES ((int)(sizeof cases / sizeof cases[0]))
#define LAYERS 3

static cu_dev *dev;

static uint64_t xl_host(const void *p, size_t n, void *ctx)
{
    (void)n, (void)ctx;
    return (uint64_t)(uintptr_t)p;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float urand(void) /* [-1, 1) */
{
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (float)((double)(rng_state >> 11) / 4503599627370496.0 - 1.0);
}

typedef struct {
    kvq_spec *spec;
    const kvq_scheme *sch;
    kvq_plan *plan;
    char *src;
    cu_module *mod;
} loaded;

static int load_case(const emu_case *c, loaded *L, int quiet)
{
    memset(L, 0, sizeof *L);
    char msg[2048];
    if (kvq_spec_parse_file(th_path(c->file), &L->spec) != KVQ_OK) {
        if (!quiet) TH_CHECK(0, "%s does not parse", c->file);
        return 0;
    }
    L->sch = kvq_spec_scheme(L->spec, c->scheme);
    kvq_dims d = {LAYERS, c->heads, c->kv_heads, c->head_dim};
    L->plan = kvq_malloc(sizeof *L->plan);
    if (!L->sch || !L->plan || plan_build(L->sch, &d, KVQ_F32, L->plan, msg, sizeof msg) != KVQ_OK ||
        emit_cuda_source(L->plan, &L->src, NULL) != KVQ_OK) {
        if (!quiet) TH_CHECK(0, "plan/emit %s: %s", c->scheme, msg);
        return 0;
    }
    kvq_status st = cu_dev_load(dev, L->src, NULL, &L->mod, msg, sizeof msg);
    if (!quiet) TH_CHECK(st == KVQ_OK, "load: %s", msg);
    return st == KVQ_OK;
}

static void unload(loaded *L)
{
    cu_module_free(L->mod);
    kvq_free(L->src);
    kvq_free(L->plan);
    kvq_spec_free(L->spec);
    memset(L, 0, sizeof *L);
}

/* ------------------------------------------------------------------------------------- quantize kernels -- */

static const char *store_name(int i) { return i == 0 ? "k_hi" : i == 1 ? "k_lo" : i == 2 ? "v_hi" : "v_lo"; }

/* x [H][n][D]: pattern 0 random, 1 structured (outlier channels, tiny tokens, heavy rows), 2 constant groups
 * and signed zeros; all fp16-rounded as the cache stores them. */
static void fill_values(float *x, int H, int n, int D, int pattern)
{
    for (int h = 0; h < H; h++)
        for (int t = 0; t < n; t++)
            for (int c = 0; c < D; c++) {
                float v = urand();
                if (pattern == 1) {
                    if (c % 17 == 3) v = 8.0f + 4.0f * v; /* outlier channel */
                    if (t % 11 == 5) v *= 0.01f;          /* tiny token */
                    if (t % 13 == 0) v *= 30.0f;          /* heavy token */
                } else if (pattern == 2) {
                    v = (c / 32 + t / 16) % 3 == 0 ? 0.5f : (t % 2 ? -0.0f : 0.0f);
                }
                x[((size_t)h * n + t) * D + c] = kvq_f16_round(v);
            }
}

static void test_quant_store(const loaded *L, int cls, int which, int pattern)
{
    const kvq_plan *p = L->plan;
    const plan_class *pc = &p->cls[cls];
    const plan_store *st = which == 0 ? &pc->k_hi : which == 1 ? &pc->k_lo : which == 2 ? &pc->v_hi : &pc->v_lo;
    if (st->bits < 1 || st->bits > 8) return;
    int H = p->kv_heads, D = p->head_dim;
    /* capacity: a per-channel group, or a batch of per-token rows that is not a multiple of the block's 8 */
    int cap = st->gran == KVQ_GRAN_CHANNEL ? (st->group > 0 ? st->group : 45) : 37;
    th_begin("emu quant: %s class %d %s (%d-bit, %s%s%s) pattern %d, H %d D %d", p->scheme, cls, store_name(which),
             st->bits,
             st->gran == KVQ_GRAN_CHANNEL ? "per channel"
             : st->hidden                 ? "hidden"
                                          : "per token",
             st->sep ? ", separable" : "", st->masked ? ", masked" : "", pattern, H, D);
    kvq_page_format fmt;
    plan_page_format(p, st, cap, &fmt);
    ref_page *rp = NULL;
    float *x = kvq_malloc((size_t)H * cap * D * sizeof *x);
    int *pos = kvq_malloc((size_t)H * cap * sizeof *pos);
    unsigned char *flags = kvq_calloc((size_t)H * cap, 1);
    TH_CHECK(ref_page_new(&fmt, KVQ_SEG_BODY_HIGH, &rp) == KVQ_OK && x && pos && flags, "alloc");
    if (th_failed()) goto out;
    fill_values(x, H, cap, D, pattern);
    for (int i = 0; i < H * cap; i++) pos[i] = i % cap, flags[i] = st->masked && (i * 7) % 5 == 1;
    ref_page_fill(rp, x, (size_t)cap * D, pos, (size_t)cap);
    for (int h = 0; h < H; h++)
        for (int s = 0; s < cap; s++)
            if (flags[h * cap + s]) ref_page_set_mask(rp, h, s, 1);

    uint64_t page = 0;
    char msg[1024];
    TH_CHECK(cu_dev_alloc(dev, rp->lay.total, &page, msg, sizeof msg) == KVQ_OK, "%s", msg);
    kvq_quant_params qp;
    memset(&qp, 0, sizeof qp);
    qp.src.base = (uint64_t)(uintptr_t)x;
    qp.src.head_stride = cap;
    qp.page = page;
    qp.masked = st->masked ? (uint64_t)(uintptr_t)flags : 0;
    qp.cap = cap, qp.slot = 0, qp.n = cap;
    char kname[64];
    const unsigned blk[3] = {128, 1, 1};
    if (st->sep) {
        snprintf(kname, sizeof kname, "kvq_factor_%s_c%d", store_name(which), cls);
        const unsigned g[3] = {(unsigned)H, 1, 1};
        TH_CHECK(cu_dev_launch(dev, L->mod, kname, g, blk, &qp, sizeof qp, msg, sizeof msg) == KVQ_OK, "%s", msg);
    }
    snprintf(kname, sizeof kname, "kvq_quant_%s_c%d", store_name(which), cls);
    unsigned g[3] = {(unsigned)H, 1, 1};
    if (st->gran == KVQ_GRAN_TOKEN && st->hidden)
        g[0] = 1, g[1] = (unsigned)cap;
    else if (st->gran == KVQ_GRAN_TOKEN)
        g[1] = (unsigned)((cap + 7) / 8);
    /* fewer blocks on y than runs of tokens (as past gridDim.y's 65535): the blocks stride over the tokens */
    if (g[1] > 3) g[1] = 3;
    TH_CHECK(cu_dev_launch(dev, L->mod, kname, g, blk, &qp, sizeof qp, msg, sizeof msg) == KVQ_OK, "%s", msg);
    const unsigned char *got = (const unsigned char *)(uintptr_t)page;
    size_t first = rp->lay.total;
    for (size_t i = 0; i < rp->lay.total && first == rp->lay.total; i++)
        if (got[i] != rp->mem[i]) first = i;
    TH_CHECK(first == rp->lay.total,
             "page differs from the reference at byte %zu (codes %zu+%zu, scale %zu, zero %zu, factor %zu, mask %zu): "
             "kernel %02x, reference %02x",
             first, rp->lay.codes, rp->lay.codes_size, rp->lay.scale, rp->lay.zero, rp->lay.factor, rp->lay.mask,
             first < rp->lay.total ? got[first] : 0, first < rp->lay.total ? rp->mem[first] : 0);

    /* Appendable pages (per token, not separable): one token per launch, as decode fills them. */
    if (st->gran == KVQ_GRAN_TOKEN && !st->sep && !st->hidden && pattern == 0) {
        kvq_page_format af;
        plan_page_format(p, st, KVQ_APPEND_PAGE_TOKENS, &af);
        ref_page *ap = NULL;
        uint64_t apage = 0;
        TH_CHECK(ref_page_new(&af, KVQ_SEG_BODY_HIGH, &ap) == KVQ_OK, "alloc");
        TH_CHECK(cu_dev_alloc(dev, ap->lay.total, &apage, msg, sizeof msg) == KVQ_OK, "%s", msg);
        float *tok = kvq_malloc((size_t)H * D * sizeof *tok);
        for (int s = 0; s < 21 && tok && ap && apage; s++) {
            for (int h = 0; h < H; h++)
                memcpy(tok + (size_t)h * D, x + ((size_t)h * cap + s) * D, (size_t)D * sizeof *tok);
            ref_page_append(ap, tok, s);
            kvq_quant_params aq;
            memset(&aq, 0, sizeof aq);
            aq.src.base = (uint64_t)(uintptr_t)tok;
            aq.src.head_stride = 1;
            aq.page = apage, aq.cap = KVQ_APPEND_PAGE_TOKENS, aq.slot = s, aq.n = 1;
            const unsigned ag[3] = {(unsigned)H, 1, 1};
            TH_CHECK(cu_dev_launch(dev, L->mod, kname, ag, blk, &aq, sizeof aq, msg, sizeof msg) == KVQ_OK, "%s", msg);
        }
        if (ap && apage)
            TH_CHECK(memcmp((const void *)(uintptr_t)apage, ap->mem, ap->lay.total) == 0,
                     "appended page differs from the reference");
        kvq_free(tok);
        ref_page_free(ap);
        cu_dev_free(dev, apage);
    }
    cu_dev_free(dev, page);
out:
    ref_page_free(rp);
    kvq_free(x);
    kvq_free(pos);
    kvq_free(flags);
    th_end();
}

/* kvq_store_f16 from fp32 rows into a ring, and the gather of fetched rows from an fp16 window. */
static void test_store(const loaded *L)
{
    const kvq_plan *p = L->plan;
    int H = p->kv_heads, D = p->head_dim, n = 9, cap = 16, T = 40;
    th_begin("emu store: %s fp16 ring store and row gather, H %d D %d", p->scheme, H, D);
    float *x = kvq_malloc((size_t)H * n * D * sizeof *x);
    uint16_t *win = kvq_calloc((size_t)H * cap * D, 2), *want = kvq_calloc((size_t)H * cap * D, 2);
    uint16_t *host = kvq_malloc((size_t)H * T * D * 2);
    int *idx = kvq_malloc((size_t)H * n * sizeof *idx);
    for (size_t i = 0; i < (size_t)H * n * D; i++) x[i] = 3.0f * urand();
    for (size_t i = 0; i < (size_t)H * T * D; i++) host[i] = kvq_f16_from_f32(urand());
    char msg[512];
    /* 2 blocks on y for 9 tokens (as past gridDim.y's 65535): the blocks stride over the tokens */
    const unsigned blk[3] = {128, 1, 1}, g[3] = {(unsigned)H, 2, 1};
    kvq_store_params sp;
    memset(&sp, 0, sizeof sp);
    sp.src.base = (uint64_t)(uintptr_t)x, sp.src.head_stride = n;
    sp.dst = (uint64_t)(uintptr_t)win, sp.dst_cap = cap, sp.slot = 11, sp.dst_ring = cap, sp.n = n;
    TH_CHECK(cu_dev_launch(dev, L->mod, "kvq_store_f16", g, blk, &sp, sizeof sp, msg, sizeof msg) == KVQ_OK, "%s", msg);
    for (int h = 0; h < H; h++)
        for (int t = 0; t < n; t++)
            for (int c = 0; c < D; c++)
                want[((size_t)h * cap + (11 + t) % cap) * D + c] = kvq_f16_from_f32(x[((size_t)h * n + t) * D + c]);
    TH_CHECK(memcmp(win, want, (size_t)H * cap * D * 2) == 0, "ring store differs");
    /* gather: row idx[h][t] of kv head h of the host window into slot t */
    for (int h = 0; h < H; h++)
        for (int t = 0; t < n; t++) idx[h * n + t] = (h * 7 + t * 5) % T;
    memset(&sp.src, 0, sizeof sp.src);
    sp.src.base = (uint64_t)(uintptr_t)host, sp.src.f16 = 1, sp.src.head_stride = T;
    sp.src.gather = (uint64_t)(uintptr_t)idx;
    sp.slot = 0, sp.dst_ring = 0;
    TH_CHECK(cu_dev_launch(dev, L->mod, "kvq_store_f16", g, blk, &sp, sizeof sp, msg, sizeof msg) == KVQ_OK, "%s", msg);
    int same = 1;
    for (int h = 0; h < H; h++)
        for (int t = 0; t < n; t++)
            same &= memcmp(win + ((size_t)h * cap + t) * D, host + ((size_t)h * T + idx[h * n + t]) * D,
                           (size_t)D * 2) == 0;
    TH_CHECK(same, "gathered rows differ");
    kvq_free(x);
    kvq_free(win);
    kvq_free(want);
    kvq_free(host);
    kvq_free(idx);
    th_end();
}

/* --------------------------------------------------------------------------------------- decode kernel -- */

#define BATCH 3
static const int prompt_len[BATCH] = {21, 150, 260};
static const int decode_steps[BATCH] = {5, 40, 12};

/* Reference attention of every query head over the cache of one (sequence, layer), as the reference computes it. */
static void ref_expected(const ref_layer *RL, const float *q, int Hq, int H, int D, float scale, float *out,
                         const float *fk, const float *fv, int nf)
{
    int g = Hq / H;
    if (!RL->sparse) {
        const ref_qlayer *L = &RL->q;
        int len = L->length;
        float *K = kvq_malloc((size_t)len * D * sizeof *K), *V = kvq_malloc((size_t)len * D * sizeof *V);
        unsigned char *seen = kvq_malloc((size_t)len * 2);
        for (int h = 0; h < H; h++) {
            TH_CHECK(ref_qlayer_materialize(L, h, K, V, seen) == KVQ_OK, "materialize");
            for (int j = 0; j < g; j++)
                ref_attend(q + (size_t)(h * g + j) * D, K, V, len, D, scale, out + (size_t)(h * g + j) * D, NULL);
        }
        kvq_free(K), kvq_free(V), kvq_free(seen);
        return;
    }
    /* sparse: local + generated + the fetched rows */
    const ref_slayer *S = &RL->s;
    int cap = S->local[0].count + S->n_gen * KVQ_APPEND_PAGE_TOKENS + nf;
    float *K = kvq_malloc((size_t)cap * D * sizeof *K), *V = kvq_malloc((size_t)cap * D * sizeof *V);
    for (int h = 0; h < H; h++) {
        int n = 0;
        for (int s = 0; s < S->local[0].count; s++, n++) {
            ref_win_read(&S->local[0], h, s, K + (size_t)n * D);
            ref_win_read(&S->local[1], h, s, V + (size_t)n * D);
        }
        for (int gi = 0; gi < S->n_gen; gi++)
            for (int s = 0; s < S->gen[2 * gi].count; s++, n++) {
                ref_win_read(&S->gen[2 * gi], h, s, K + (size_t)n * D);
                ref_win_read(&S->gen[2 * gi + 1], h, s, V + (size_t)n * D);
            }
        for (int t = 0; t < nf; t++, n++) {
            memcpy(K + (size_t)n * D, fk + ((size_t)h * nf + t) * D, (size_t)D * sizeof *K);
            memcpy(V + (size_t)n * D, fv + ((size_t)h * nf + t) * D, (size_t)D * sizeof *V);
        }
        for (int j = 0; j < g; j++)
            ref_attend(q + (size_t)(h * g + j) * D, K, V, n, D, scale, out + (size_t)(h * g + j) * D, NULL);
    }
    kvq_free(K), kvq_free(V);
}

typedef struct {
    uint16_t *fk, *fv; /* fetched rows [H][nf][D] fp16 (written by the gather kernel) */
    float *fk32, *fv32;
    int *idx;
    int nf;
} fetched;

/* Sparse layers: local window, generated pages, and nf rows per head gathered from the host copy. */
static void sparse_tiles(const loaded *Ld, const ref_slayer *S, int tile, tm_tiles *ts, fetched *f, int H, int D)
{
    const ref_win *lk = &S->local[0], *lv = &S->local[1];
    if (lk->count > 0) {
        tm_run a = {xl_host(lk->data, 0, NULL), KVQ_SRC_F16, lk->cap, 0, lk->count, NULL, 0};
        tm_run b = {xl_host(lv->data, 0, NULL), KVQ_SRC_F16, lv->cap, 0, lv->count, NULL, 0};
        tm_pair(ts, &a, &b, lk->count, tile, 0);
    }
    for (int gi = 0; gi < S->n_gen; gi++) {
        const ref_win *gk = &S->gen[2 * gi], *gv = &S->gen[2 * gi + 1];
        if (!gk->count) continue;
        tm_run a = {xl_host(gk->data, 0, NULL), KVQ_SRC_F16, gk->cap, 0, gk->count, NULL, 0};
        tm_run b = {xl_host(gv->data, 0, NULL), KVQ_SRC_F16, gv->cap, 0, gv->count, NULL, 0};
        tm_pair(ts, &a, &b, gk->count, tile, 0);
    }
    int T = S->host[0].count;
    f->nf = T < 24 ? T : 24;
    f->fk = kvq_calloc((size_t)H * f->nf * D + 8, 2), f->fv = kvq_calloc((size_t)H * f->nf * D + 8, 2);
    f->fk32 = kvq_malloc(((size_t)H * f->nf * D + 1) * 4), f->fv32 = kvq_malloc(((size_t)H * f->nf * D + 1) * 4);
    f->idx = kvq_malloc(((size_t)H * f->nf + 1) * sizeof(int));
    for (int h = 0; h < H; h++)
        for (int t = 0; t < f->nf; t++) f->idx[h * f->nf + t] = (h * 13 + t * 7) % T;
    char msg[512];
    const unsigned blk[3] = {128, 1, 1}, g[3] = {(unsigned)H, (unsigned)f->nf, 1};
    for (int w = 0; w < 2 && f->nf > 0; w++) {
        kvq_store_params sp;
        memset(&sp, 0, sizeof sp);
        sp.src.base = xl_host(S->host[w].data, 0, NULL), sp.src.f16 = 1, sp.src.head_stride = S->host[w].cap;
        sp.src.gather = xl_host(f->idx, 0, NULL);
        sp.dst = xl_host(w ? f->fv : f->fk, 0, NULL), sp.dst_cap = f->nf, sp.n = f->nf;
        TH_CHECK(cu_dev_launch(dev, Ld->mod, "kvq_store_f16", g, blk, &sp, sizeof sp, msg, sizeof msg) == KVQ_OK, "%s",
                 msg);
    }
    kvq_f32_from_f16_n(f->fk32, f->fk, (size_t)H * f->nf * D);
    kvq_f32_from_f16_n(f->fv32, f->fv, (size_t)H * f->nf * D);
    if (f->nf > 0) {
        tm_run a = {xl_host(f->fk, 0, NULL), KVQ_SRC_F16, f->nf, 0, f->nf, NULL, 0};
        tm_run b = {xl_host(f->fv, 0, NULL), KVQ_SRC_F16, f->nf, 0, f->nf, NULL, 0};
        tm_pair(ts, &a, &b, f->nf, tile, 0);
    }
}

static void test_decode(const loaded *Ld, const emu_case *c)
{
    const kvq_plan *p = Ld->plan;
    int H = p->kv_heads, Hq = p->heads, D = p->head_dim;
    th_begin("emu decode: %s, %d heads / %d kv heads, head_dim %d, batch %d (lengths %d..%d), %d layers", p->scheme, Hq,
             H, D, BATCH, prompt_len[0] + decode_steps[0], prompt_len[2] + decode_steps[2], LAYERS);
    kvq_synth_params sp = kvq_synth_params_default();
    sp.layers = LAYERS, sp.kv_heads = H, sp.heads = Hq, sp.head_dim = D, sp.tokens = 320, sp.seed = 7;
    kvq_synth syn;
    char err[256];
    TH_CHECK(kvq_synth_generate(&sp, &syn, err, sizeof err) == KVQ_OK, "synth: %s", err);
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){LAYERS, Hq, H, D};
    cfg.dtype = KVQ_F32;
    kvq_engine *e = NULL;
    TH_CHECK(kvq_engine_create(Ld->sch, &cfg, &e, err, sizeof err) == KVQ_OK, "engine: %s", err);
    kvq_seq *seqs[BATCH] = {0};
    size_t T = (size_t)sp.tokens;
    float *k1 = kvq_malloc((size_t)H * D * 4), *v1 = kvq_malloc((size_t)H * D * 4),
          *q1 = kvq_malloc((size_t)Hq * D * 4);
    float *o1 = kvq_malloc((size_t)Hq * D * 4), *pk = kvq_malloc((size_t)H * T * D * 4),
          *pv = kvq_malloc((size_t)H * T * D * 4);
    float *pq = kvq_malloc((size_t)Hq * T * D * 4);
    for (int b = 0; b < BATCH && e && !th_failed(); b++) TH_CHECK(kvq_seq_create(e, &seqs[b]) == KVQ_OK, "seq");
    for (int l = 0; l < LAYERS && !th_failed(); l++) {
        const float *K = syn.k + (size_t)l * H * T * D, *V = syn.v + (size_t)l * H * T * D,
                    *Q = syn.q + (size_t)l * Hq * T * D;
        for (int b = 0; b < BATCH && !th_failed(); b++) {
            int n = prompt_len[b];
            for (int h = 0; h < H; h++) {
                memcpy(pk + (size_t)h * n * D, K + (size_t)h * T * D, (size_t)n * D * 4);
                memcpy(pv + (size_t)h * n * D, V + (size_t)h * T * D, (size_t)n * D * 4);
            }
            for (int h = 0; h < Hq; h++) memcpy(pq + (size_t)h * n * D, Q + (size_t)h * T * D, (size_t)n * D * 4);
            kvq_prefill_item it = {seqs[b], n, pk, pv, pq};
            TH_CHECK(kvq_prefill(e, l, &it, 1) == KVQ_OK, "prefill: %s", kvq_engine_errmsg(e));
            for (int s = 0; s < decode_steps[b] && !th_failed(); s++) {
                int t = n + s;
                for (int h = 0; h < H; h++) {
                    memcpy(k1 + (size_t)h * D, K + ((size_t)h * T + t) * D, (size_t)D * 4);
                    memcpy(v1 + (size_t)h * D, V + ((size_t)h * T + t) * D, (size_t)D * 4);
                }
                for (int h = 0; h < Hq; h++) memcpy(q1 + (size_t)h * D, Q + ((size_t)h * T + t) * D, (size_t)D * 4);
                kvq_decode_item di = {seqs[b], k1, v1, q1, o1};
                TH_CHECK(kvq_decode(e, l, &di, 1) == KVQ_OK, "decode: %s", kvq_engine_errmsg(e));
            }
        }
    }
    /* Attend over each layer's cache with a fresh query per sequence (structured: the synthetic queries). */
    float *q = kvq_malloc((size_t)BATCH * Hq * D * 4), *out = kvq_malloc((size_t)BATCH * Hq * D * 4);
    float *want = kvq_malloc((size_t)BATCH * Hq * D * 4);
    kvq_seq_tiles st[BATCH];
    tm_tiles ts[BATCH];
    fetched fe[BATCH];
    float scale = 1.0f / sqrtf((float)D);
    for (int l = 0; l < LAYERS && !th_failed(); l++) {
        int cls = p->layer_class[l], tile = plan_tile_tokens(&p->cls[cls], 1, 1), max_tiles = 0;
        memset(ts, 0, sizeof ts);
        memset(fe, 0, sizeof fe);
        for (int b = 0; b < BATCH; b++) {
            const ref_layer *RL = seqs[b]->bseq->layers[l];
            for (int h = 0; h < Hq; h++)
                memcpy(q + ((size_t)b * Hq + h) * D, syn.q + (((size_t)l * Hq + h) * T + (size_t)(T - 1 - b)) * D,
                       (size_t)D * 4);
            if (RL->sparse)
                sparse_tiles(Ld, &RL->s, tile, &ts[b], &fe[b], H, D);
            else
                TH_CHECK(tm_quant_tiles(&RL->q, &p->cls[cls], &ts[b], xl_host, NULL), "K and V streams pair different tokens");
            ref_expected(RL, q + (size_t)b * Hq * D, Hq, H, D, scale, want + (size_t)b * Hq * D, fe[b].fk32, fe[b].fv32,
                         fe[b].nf);
            st[b].tiles = (uint64_t)(uintptr_t)ts[b].t;
            st[b].n_tiles = ts[b].n;
            st[b].tiles_per_chunk = 0; /* the launch's */
            if (ts[b].n > max_tiles) max_tiles = ts[b].n;
        }
        /* one chunk, then split over chunks of 2 tiles with the merge */
        for (int split = 0; split < 2 && !th_failed(); split++) {
            int tpc = split ? 2 : (max_tiles > 0 ? max_tiles : 1), nch = (max_tiles + tpc - 1) / tpc;
            if (nch < 1) nch = 1;
            float *po = kvq_malloc((size_t)BATCH * Hq * nch * D * 4 + 4),
                  *pl = kvq_malloc((size_t)BATCH * Hq * nch * 4 + 4);
            kvq_decode_params dp;
            memset(&dp, 0, sizeof dp);
            dp.q = (uint64_t)(uintptr_t)q, dp.out = (uint64_t)(uintptr_t)out, dp.seqs = (uint64_t)(uintptr_t)st;
            dp.part_o = (uint64_t)(uintptr_t)po, dp.part_lse = (uint64_t)(uintptr_t)pl;
            dp.scale = scale * 1.4426950408889634f;
            dp.batch = BATCH, dp.n_chunks = nch, dp.tiles_per_chunk = tpc;
            char msg[1024], kname[32];
            snprintf(kname, sizeof kname, "kvq_decode_c%d", cls);
            const unsigned g[3] = {(unsigned)H, (unsigned)nch, BATCH},
                           blk[3] = {(unsigned)p->tx, (unsigned)p->ty, (unsigned)p->tz};
            memset(out, 0xff, (size_t)BATCH * Hq * D * 4);
            /* past 48 KiB the kernel opts in first, as the backend does at load */
            if (p->cls[cls].smem > 48 * 1024)
                TH_CHECK(cu_dev_func_max_dyn_smem(dev, Ld->mod, kname, (unsigned)p->cls[cls].smem, msg, sizeof msg) ==
                             KVQ_OK,
                         "%s", msg);
            TH_CHECK(cu_dev_launch_smem(dev, Ld->mod, kname, g, blk, (unsigned)p->cls[cls].smem, &dp, sizeof dp, msg,
                                        sizeof msg) == KVQ_OK,
                     "%s", msg);
            if (nch > 1) {
                const unsigned mg[3] = {(unsigned)Hq, BATCH, 1}, mb[3] = {(unsigned)D, 1, 1};
                TH_CHECK(cu_dev_launch(dev, Ld->mod, "kvq_merge", mg, mb, &dp, sizeof dp, msg, sizeof msg) == KVQ_OK,
                         "%s", msg);
            }
            for (int b = 0; b < BATCH; b++)
                for (int h = 0; h < Hq; h++) {
                    const float *o = out + ((size_t)b * Hq + h) * D, *w = want + ((size_t)b * Hq + h) * D;
                    double err_max = 0, mag = 0;
                    for (int i = 0; i < D; i++) {
                        double d = fabs((double)o[i] - w[i]);
                        if (!(d <= err_max)) err_max = d; /* NaN propagates */
                        if (fabs(w[i]) > mag) mag = fabs(w[i]);
                    }
                    TH_CHECK(err_max <= 1e-3 * (mag > 1e-3 ? mag : 1e-3),
                             "layer %d seq %d head %d (%s): max error %.3g vs magnitude %.3g (%d tiles, %d chunks)", l,
                             b, h, split ? "split" : "one chunk", err_max, mag, ts[b].n, nch);
                }
            kvq_free(po);
            kvq_free(pl);
        }
        for (int b = 0; b < BATCH; b++) {
            kvq_free(ts[b].t);
            kvq_free(fe[b].fk), kvq_free(fe[b].fv), kvq_free(fe[b].fk32), kvq_free(fe[b].fv32), kvq_free(fe[b].idx);
        }
    }
    kvq_free(q), kvq_free(out), kvq_free(want), kvq_free(k1), kvq_free(v1), kvq_free(q1), kvq_free(o1);
    kvq_free(pk), kvq_free(pv), kvq_free(pq);
    kvq_engine_free(e);
    kvq_synth_free(&syn);
    (void)c;
    th_end();
}

/* Whether case c's scheme is in the comma-separated list `only` (NULL or empty: every case). */
static int case_selected(const char *only, const emu_case *c)
{
    if (!only || !*only) return 1;
    size_t n = strlen(c->scheme);
    for (const char *t = only; *t;) {
        const char *e = strchr(t, ',');
        size_t len = e ? (size_t)(e - t) : strlen(t);
        if (len == n && !strncmp(t, c->scheme, n)) return 1;
        t += len + (e != NULL);
    }
    return 0;
}

int main(void)
{
    char why[1024];
    if (cu_dev_open(CU_DEV_EMU, &dev, why, sizeof why) != KVQ_OK) {
        printf("skipped: %s\n", why);
        return 0;
    }
    /* KVQ_EMU_CASES=a,b: only the cases whose scheme is named (a quick check; the lead's make test runs all) */
    const char *only = getenv("KVQ_EMU_CASES");
    /* Build every module in two processes first (the compiles dominate), then test from the cache. */
    pid_t pid[2];
    for (int w = 0; w < 2; w++) {
        pid[w] = fork();
        if (pid[w] == 0) {
            for (int i = w; i < N_CASES; i += 2) {
                if (!case_selected(only, &cases[i])) continue;
                loaded L;
                load_case(&cases[i], &L, 1);
                unload(&L);
            }
            _exit(0);
        }
    }
    for (int w = 0; w < 2; w++)
        if (pid[w] > 0) waitpid(pid[w], NULL, 0);

    for (int i = 0; i < N_CASES; i++) {
        loaded L;
        if (!case_selected(only, &cases[i])) continue;
        th_begin("emu: %s/%s compiles for the emulator and its parameter layout matches the host's", cases[i].file,
                 cases[i].scheme);
        int ok = load_case(&cases[i], &L, 0);
        char msg[512];
        if (ok) TH_CHECK(cu_dev_check_params(dev, L.mod, 1, msg, sizeof msg) == KVQ_OK, "%s", msg);
        th_end();
        if (!ok) {
            unload(&L);
            continue;
        }
        if (cases[i].head_dim == 128) /* the page formats do not depend on the GQA ratio */
            for (int c = 0; c < L.plan->n_classes; c++)
                for (int which = 0; which < 4; which++)
                    for (int pat = 0; pat < 3; pat++) test_quant_store(&L, c, which, pat);
        if (i == 0 || i == N_CASES - 1) test_store(&L);
        test_decode(&L, &cases[i]);
        unload(&L);
    }
    cu_dev_close(dev);
    return th_summary();
}
