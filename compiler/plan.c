/* Scheme + dims -> kernel plan: see plan.h. */
#include "plan.h"

#include "kvq_layout.cuh"
#include "quant.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int tensor_eq(const kvq_tensor_cfg *a, const kvq_tensor_cfg *b)
{
    return a->bits == b->bits && a->gran == b->gran && a->channel_separable == b->channel_separable &&
           a->group == b->group && a->scale_dtype == b->scale_dtype && a->zero_dtype == b->zero_dtype &&
           a->format.kind == b->format.kind && a->format.n_levels == b->format.n_levels &&
           !memcmp(a->format.levels, b->format.levels, (size_t)a->format.n_levels * sizeof(float)) &&
           a->format.codebook_normal == b->format.codebook_normal &&
           a->format.tensor_scale == b->format.tensor_scale &&
           a->format.tensor_scale_per_head == b->format.tensor_scale_per_head && a->turboquant == b->turboquant &&
           a->tq_outliers == b->tq_outliers && a->tq_outlier_bits == b->tq_outlier_bits;
}

/* Field by field: the scheme is plain data but its padding bytes are not guaranteed to be zero. */
static int quant_eq(const kvq_quant_cfg *a, const kvq_quant_cfg *b)
{
    const kvq_saliency_cfg *x = &a->saliency, *y = &b->saliency;
    return tensor_eq(&a->key, &b->key) && tensor_eq(&a->value, &b->value) && a->sinks == b->sinks &&
           a->residual == b->residual && a->flush == b->flush && a->outliers.keep == b->outliers.keep &&
           a->outliers.metric == b->outliers.metric && a->outliers.spill == b->outliers.spill &&
           x->metric == y->metric && x->probe_recent == y->probe_recent && x->probe_random == y->probe_random &&
           x->salient == y->salient && x->high_bits == y->high_bits && x->low_bits == y->low_bits &&
           x->interval == y->interval;
}

static int sparse_eq(const kvq_sparse_cfg *a, const kvq_sparse_cfg *b)
{
    return a->host_offload == b->host_offload && a->sinks == b->sinks && a->recent == b->recent && a->topk == b->topk &&
           a->critical_channels == b->critical_channels;
}

static int layer_eq(const kvq_layer_cfg *a, const kvq_layer_cfg *b)
{
    if (a->mode != b->mode) return 0;
    if (a->mode != KVQ_MODE_SPARSE && !quant_eq(&a->quant, &b->quant)) return 0;
    if (a->mode != KVQ_MODE_QUANT && !sparse_eq(&a->sparse, &b->sparse)) return 0;
    return 1;
}

int plan_row_bytes(int head_dim, int bits) { return (int)kvq_code_bytes(head_dim, bits); }

/* Bytes a decode tile stages per token of a store: its codes; for element formats, the linear ones' codes at
 * their staged width, the others' fp32 rows, which templates/kvq_format.cuh decodes while staging (the
 * reference's values exactly: fp16 rows would round a codebook's levels and a prompt's tensor scale). */
static int staged_row_bytes(int head_dim, const plan_store *st)
{
    if (st->bits < 16 && st->tq) return 4 * head_dim; /* TurboQuant: fp32 rows (templates/kvq_turboquant.cuh) */
    if (st->bits >= 16 || st->format.kind == KVQ_FMT_INT) return plan_row_bytes(head_dim, st->bits);
    if (!kvq_fmt_linear((int)st->format.kind)) return 4 * head_dim;
    return plan_row_bytes(head_dim, kvq_fmt_staged_bits((int)st->format.kind, st->bits));
}

static void store_init(plan_store *st, const kvq_tensor_cfg *t, int bits, int masked, int head_dim)
{
    memset(st, 0, sizeof *st);
    st->format = t->format;
    st->bits = kvq_bits_is_fp16(bits) ? bits : kvq_format_code_bits(&t->format, bits);
    st->gran = (int)t->gran;
    st->sep = t->gran == KVQ_GRAN_TOKEN && t->channel_separable;
    st->hidden = t->gran == KVQ_GRAN_TOKEN && t->group == KVQ_GROUP_HIDDEN;
    if (t->gran == KVQ_GRAN_TOKEN)
        st->group = st->hidden ? 0 : (t->group > 0 ? t->group : head_dim);
    else
        st->group = t->group > 0 ? t->group : 0;
    st->scale_f32 = t->scale_dtype == KVQ_DT_FP32;
    st->zero_f32 = t->zero_dtype == KVQ_DT_FP32;
    st->masked = masked;
    if (!kvq_bits_is_fp16(bits) && t->turboquant != KVQ_TQ_NONE) {
        st->tq = (int)t->turboquant;
        st->tq_out = t->tq_outliers;
        st->tq_out_bits = t->tq_outliers ? t->tq_outlier_bits : 0;
        st->scale_f32 = st->zero_f32 = 1; /* fp32 norms (layout.c) */
    }
}

void plan_page_format(const kvq_plan *p, const plan_store *st, int cap, kvq_page_format *fmt)
{
    kvq_tensor_cfg t;
    memset(&t, 0, sizeof t);
    t.bits = st->bits;
    t.gran = (kvq_gran)st->gran;
    t.channel_separable = st->sep;
    t.group = st->hidden ? KVQ_GROUP_HIDDEN : (st->group > 0 ? st->group : KVQ_GROUP_ALL);
    t.scale_dtype = st->scale_f32 ? KVQ_DT_FP32 : KVQ_DT_FP16;
    t.zero_dtype = st->zero_f32 ? KVQ_DT_FP32 : KVQ_DT_FP16;
    t.format = st->format;
    t.turboquant = (kvq_turboquant)st->tq;
    t.tq_outliers = st->tq_out;
    t.tq_outlier_bits = st->tq_out_bits;
    kvq_page_format_init(fmt, &t, st->bits, st->masked, p->kv_heads, p->head_dim, cap);
}

/* Per-channel parameters cover a group of tokens: the group, or the flush batch (group all). A hidden group's
 * scale and zero serve every kv head: one kv head's share is counted. */
static double store_bytes_per_token(const plan_store *st, int D, int kv_heads, int batch, int page_tokens)
{
    double b = plan_row_bytes(D, st->bits);
    if (st->bits >= 16) return b;
    double par = (st->scale_f32 ? 4 : 2) + (st->zero_f32 ? 4 : 2); /* one scale and one zero */
    if (st->gran == KVQ_GRAN_TOKEN) {
        b += st->hidden ? par / kv_heads : par * (D / st->group);
        if (st->sep) b += (double)D * (st->scale_f32 ? 4 : 2) / page_tokens;
    } else {
        int g = st->group > 0 ? st->group : batch;
        b += par * D / (g > 0 ? g : 1);
    }
    if (st->masked) b += 1.0 / 8.0;
    return b;
}

double plan_body_bytes_per_token(const kvq_plan *p, const plan_class *c)
{
    if (!c->quant) return 4.0 * p->head_dim; /* sparse layers attend over fp16 rows */
    int page_k = c->rule_k.batch > 1 ? c->rule_k.batch : KVQ_APPEND_PAGE_TOKENS;
    int page_v = c->rule_v.batch > 1 ? c->rule_v.batch : KVQ_APPEND_PAGE_TOKENS;
    return store_bytes_per_token(&c->k_hi, p->head_dim, p->kv_heads, c->rule_k.batch, page_k) +
           store_bytes_per_token(&c->v_hi, p->head_dim, p->kv_heads, c->rule_v.batch, page_v);
}

static int max_i(int a, int b) { return a > b ? a : b; }

static void class_init(plan_class *c, const kvq_layer_cfg *cfg, int D)
{
    memset(c, 0, sizeof *c);
    c->mode = cfg->mode;
    c->quant = cfg->mode != KVQ_MODE_SPARSE;
    c->sparse = cfg->mode != KVQ_MODE_QUANT;
    c->q = cfg->quant;
    c->sp = cfg->sparse;
    int fp16_row = 2 * D;
    if (c->quant) {
        const kvq_quant_cfg *q = &cfg->quant;
        int sal = q->saliency.metric != KVQ_SAL_NONE;
        int masked = q->outliers.keep > 0;
        c->kcfg = q->key;
        c->vcfg = q->value;
        store_init(&c->k_hi, &q->key, sal ? q->saliency.high_bits : q->key.bits, masked, D);
        store_init(&c->v_hi, &q->value, sal ? q->saliency.high_bits : q->value.bits, 0, D);
        if (sal) {
            store_init(&c->k_lo, &q->key, q->saliency.low_bits, masked, D);
            store_init(&c->v_lo, &q->value, q->saliency.low_bits, 0, D);
            c->has_low = 1;
        }
        kvq_window_rule_of(q, 0, &c->rule_k);
        kvq_window_rule_of(q, 1, &c->rule_v);
        c->has_pool = q->outliers.keep > 0;
        c->has_spill = c->has_pool && q->outliers.spill > 0;
        /* Staged rows: fp16 windows (sinks, residual, pools) and the pages of each class. */
        int fp16_k = q->sinks > 0 || c->rule_k.capacity > 0 || c->has_pool;
        int fp16_v = q->sinks > 0 || c->rule_v.capacity > 0 || c->has_pool;
        c->k_row_bytes = max_i(fp16_k ? fp16_row : 0, staged_row_bytes(D, &c->k_hi));
        c->v_row_bytes = max_i(fp16_v ? fp16_row : 0, staged_row_bytes(D, &c->v_hi));
        if (sal) {
            c->k_row_bytes = max_i(c->k_row_bytes, staged_row_bytes(D, &c->k_lo));
            c->v_row_bytes = max_i(c->v_row_bytes, staged_row_bytes(D, &c->v_lo));
        }
    }
    if (c->sparse) {
        /* Sparse layers attend over fp16 rows only (local window and fetched rows). */
        c->k_row_bytes = fp16_row;
        c->v_row_bytes = fp16_row;
    }
}

static int bits_ok(int b) { return b == 1 || b == 2 || b == 3 || b == 4 || b == 5 || b == 8 || b == 16; }

static kvq_status check_class(const plan_class *c, int D, char *msg, size_t n)
{
    if (!c->quant) return KVQ_OK;
    const plan_store *st[4] = {&c->k_hi, &c->v_hi, &c->k_lo, &c->v_lo};
    for (int i = 0; i < (c->has_low ? 4 : 2); i++) {
        const kvq_format_cfg *f = &st[i]->format;
        int q5 = st[i]->bits == 5 && (f->kind == KVQ_FMT_Q5_0 || f->kind == KVQ_FMT_Q5_1); /* llama.cpp's 5-bit types */
        if (!bits_ok(st[i]->bits) && !q5) {
            snprintf(msg, n, "plan: %d-bit storage is not supported", st[i]->bits);
            return KVQ_ERR_UNSUPPORTED;
        }
        if (st[i]->gran == KVQ_GRAN_TOKEN && !st[i]->hidden && D % st[i]->group != 0) {
            snprintf(msg, n, "plan: per-token group %d does not divide head_dim %d", st[i]->group, D);
            return KVQ_ERR_SHAPE;
        }
    }
    return KVQ_OK;
}

void plan_default_dims(const kvq_scheme *scheme, kvq_dims *d)
{
    if (d->layers <= 0) d->layers = scheme->model.layers > 0 ? scheme->model.layers : 32;
    if (d->heads <= 0) d->heads = scheme->model.heads > 0 ? scheme->model.heads : 32;
    if (d->kv_heads <= 0) d->kv_heads = scheme->model.kv_heads > 0 ? scheme->model.kv_heads : 8;
    if (d->head_dim <= 0) d->head_dim = scheme->model.head_dim > 0 ? scheme->model.head_dim : 128;
}

/* Decode mapping (plan.h). Values (phase 3): HPT = the largest divisor of the GQA ratio up to 4, so a thread
 * unpacks each value code once for up to 4 query heads (o lives in registers, HPT * VEC floats) and TY = GQA / HPT
 * head lanes share nothing but the staged bytes; TZ token lanes fill 128 threads. Scores (phase 1) use the same
 * threads another way, per class (tile_mapping). */
static void choose_mapping(kvq_plan *p)
{
    int D = p->head_dim, g = p->gqa;
    p->vec = 8; /* 16 bytes of fp16, 8 codes of any width fit one 32-bit word (b <= 4) or two (b = 8) */
    int lanes = (D + p->vec - 1) / p->vec;
    p->tx = 1;
    while (p->tx < lanes) p->tx *= 2;
    int hpt = 1;
    for (int d = 1; d <= 4 && d <= g; d++)
        if (g % d == 0) hpt = d;
    p->hpt = hpt;
    p->ty = g / hpt;
    /* TZ: whole warps, as many as fit 128 threads */
    int xy = p->tx * p->ty, w = 32;
    while (xy % w) w /= 2;
    int tz0 = 32 / w;
    p->tz = tz0 * (xy * tz0 >= 128 ? 1 : 128 / (xy * tz0));
    p->threads = xy * p->tz;
}

static int align16(int n) { return (n + 15) & ~15; }

/* Staged parameter floats of one store per tile (scales or zeros). */
static int store_par(const kvq_plan *p, const plan_store *st, int tile)
{
    if (st->bits == 0 || st->bits >= 16) return 1;
    if (st->tq == KVQ_TQ_PROD) return tile * p->gqa; /* TurboQuant prod keys: each token's QJL term per head */
    if ((st->format.kind != KVQ_FMT_INT && !kvq_fmt_linear((int)st->format.kind)) || st->tq) return 1; /* fp32 rows */
    if (st->gran == KVQ_GRAN_CHANNEL) return p->head_dim * kvq_tile_max_pages(tile, st->group);
    if (st->hidden) return tile;
    return tile * (p->head_dim / st->group);
}

/* Pages of a store a tile spans: per-channel pages in page runs (layout/tiles.h), else 1. */
static int store_pages(const plan_store *st, int tile)
{
    if (st->bits == 0 || st->bits >= 16 || st->gran != KVQ_GRAN_CHANNEL) return 1;
    return kvq_tile_max_pages(tile, st->group);
}

/* Raw bytes of one parameter array (scales or zeros) of a store per tile as cp.async lands them: the elements
 * at their width, and 64 bytes a page for the slack of whole 16-byte blocks (kvq_stage_page). */
static int store_raw(const kvq_plan *p, const plan_store *st, int tile)
{
    if (st->bits == 0 || st->bits >= 16) return 0;
    const int eb = st->scale_f32 || st->zero_f32 ? 4 : 2;
    return align16(store_par(p, st, tile) * eb) + 64 * store_pages(st, tile);
}

/* The tensor-core paths of templates/kvq_mma.cuh: 2- and 4-bit codes become fp16 exactly, the query (keys) and
 * the weights p s_t (values) are split into two fp16 numbers each, so mma.sync.m16n8k16 sums exact products in
 * fp32. N = 8 columns are the heads' high and low parts: GQA 1, 2 or 4 (at GQA 1 and 2 the columns past 2 GQA are
 * zero: the same instructions a token as GQA 4, whose fold and weights cost less); 128 threads (4 warps), head_dim a
 * multiple of 64 (whole 16-byte rows of 16 channels' codes, 16-channel blocks spread evenly over the warps).
 * Keys per channel with fp16 scales (their magnitude bounds the folded query: no per-tile range reduction);
 * values per token with fp16 scales (w = p s_t <= 65504 stays finite in fp16), groups of whole 16-channel blocks
 * and at most 4 per token (the zero sums of the 4 heads stay in 16 registers). */
static int mma_shape_ok(const kvq_plan *p)
{
    return (p->gqa == 1 || p->gqa == 2 || p->gqa == 4) && p->threads == 128 && p->head_dim % 64 == 0;
}
static int mma_k_ok(const kvq_plan *p, const plan_store *st)
{
    return mma_shape_ok(p) && (st->bits == 2 || st->bits == 4) && st->format.kind == KVQ_FMT_INT && !st->tq &&
           st->gran == KVQ_GRAN_CHANNEL && !st->scale_f32;
}
static int mma_v_groups(const kvq_plan *p, const plan_store *st) { return st->hidden ? 1 : p->head_dim / st->group; }
static int mma_v_ok(const kvq_plan *p, const plan_store *st)
{
    return mma_shape_ok(p) && (st->bits == 2 || st->bits == 4) && st->format.kind == KVQ_FMT_INT && !st->tq &&
           st->gran == KVQ_GRAN_TOKEN && !st->sep &&
           !st->scale_f32 && (st->hidden || st->group % 16 == 0) && mma_v_groups(p, st) <= 4;
}

/* n tokens rounded down to a multiple of 16 (when at least 16), at most t */
static int fit16(int n, int t)
{
    if (n >= 16) n &= ~15;
    if (n < 1) n = 1;
    return n < t ? n : t;
}

int plan_tile_tokens(const plan_class *c, int k_f16, int v_f16)
{
    int t = c->tile;
    if (k_f16 && c->tile_k16 < t) t = c->tile_k16;
    if (v_f16 && c->tile_v16 < t) t = c->tile_v16;
    return t;
}

/* A store whose decode reads its scales and zeros where cp.async lands them (kvq_decode.cuh, kvq_stage_buf.praw):
 * absent or fp16 rows, or integer codes of granularity `gran` with fp16 or fp32 parameters (whole 16-byte blocks of
 * 8 channels per channel) and nothing else staged beside them (no factors, element formats or TurboQuant). */
static int par_raw_ok(int D, const plan_store *st, int gran)
{
    if (st->bits == 0 || st->bits >= 16) return 1;
    return st->gran == gran && st->format.kind == KVQ_FMT_INT && !st->tq && !st->sep && D % 8 == 0;
}

/* The widest row of the class's code pages (its fp16 rows are not staged in full tiles: plan_tile_tokens). */
static int qrow_bytes(const kvq_plan *p, const plan_class *c)
{
    int r = max_i(staged_row_bytes(p->head_dim, &c->k_hi), staged_row_bytes(p->head_dim, &c->v_hi));
    if (c->has_low)
        r = max_i(r, max_i(staged_row_bytes(p->head_dim, &c->k_lo), staged_row_bytes(p->head_dim, &c->v_lo)));
    return r;
}

/* Phase 1 and the shared memory layout of class c's decode kernel. */
static void tile_mapping(const kvq_plan *p, plan_class *c)
{
    int D = p->head_dim, G = p->gqa, T = c->tile;
    int s = 1;
    while (2 * s <= 32 && 2 * s * T <= p->threads && D % (16 * s) == 0) s *= 2;
    c->split = s;
    c->p1 = p->threads / s;
    int kp = c->quant ? max_i(store_par(p, &c->k_hi, T), store_par(p, &c->k_lo, T)) : 1;
    int KP = 1; /* key pages a tile spans (page runs) */
    if (c->quant) {
        if (c->k_hi.bits && c->k_hi.bits < 16 && c->k_hi.gran == KVQ_GRAN_CHANNEL) KP = max_i(KP, kvq_tile_max_pages(T, c->k_hi.group));
        if (c->k_lo.bits && c->k_lo.bits < 16 && c->k_lo.gran == KVQ_GRAN_CHANNEL) KP = max_i(KP, kvq_tile_max_pages(T, c->k_lo.group));
    }
    c->kpages = KP;
    int vp = c->quant ? max_i(store_par(p, &c->v_hi, T), store_par(p, &c->v_lo, T)) : 1;
    c->kpar = (kp + 3) & ~3;
    c->vpar = (vp + 3) & ~3;
    int merge = (p->tz * G * D + c->p1 * G) * 4; /* o partials of the TZ lanes, d partials of the token lanes */
    /* Rows sized for the class's pages (the quantized rows of both classes, fp16 rows for bits-16 stores and sparse
     * layers), each part at least half the merge scratch that overlays them at the end of a chunk; fp16 rows
     * (sinks, windows, pools) take as many tokens as fit, a multiple of 16 (plan_tile_tokens). */
    int qk = 2 * D, qv = 2 * D;
    if (c->quant && !c->sparse) {
        qk = max_i(staged_row_bytes(D, &c->k_hi), c->k_lo.bits ? staged_row_bytes(D, &c->k_lo) : 0);
        qv = max_i(staged_row_bytes(D, &c->v_hi), c->v_lo.bits ? staged_row_bytes(D, &c->v_lo) : 0);
    }
    /* With several stages the merge scratch overlays all of them (the loop is over), so a stage's rows are the
     * pages' rows, with room for at least 16 fp16 rows of keys and of values (sinks, windows, pools) */
    c->stages = PLAN_DECODE_STAGES;
    const int rk = c->stages > 1 ? max_i(T * qk, 16 * 2 * D) : max_i(T * qk, merge / 2);
    c->rows_k = align16(rk);
    c->rows_bytes = c->rows_k + align16(c->stages > 1 ? max_i(T * qv, 16 * 2 * D) : max_i(T * qv, merge - c->rows_k));
    c->tile_k16 = fit16(c->rows_k / (2 * D), T);
    c->tile_v16 = fit16((c->rows_bytes - c->rows_k) / (2 * D), T);
    /* raw parameter bytes as cp.async lands them (kvq_stage_page): each page's range of a tile covered by whole
     * 16-byte blocks, page i at al16(its first element's bytes) + 64 i (room for the blocks' slack at both ends) */
    int sep = 0, efmt = 0, masked = 0, kchan = 1;
    c->kraws = c->vraws = 0;
    if (c->quant) {
        const plan_store *all[4] = {&c->k_hi, &c->k_lo, &c->v_hi, &c->v_lo};
        c->kraws = max_i(store_raw(p, &c->k_hi, T), store_raw(p, &c->k_lo, T));
        c->vraws = max_i(store_raw(p, &c->v_hi, T), store_raw(p, &c->v_lo, T));
        for (int i = 0; i < 4; i++) {
            sep |= all[i]->bits && all[i]->sep;
            /* element formats and TurboQuant pages write their floats while the copies are issued */
            efmt |= all[i]->bits && all[i]->bits < 16 && (all[i]->format.kind != KVQ_FMT_INT || all[i]->tq);
            masked |= all[i]->bits && all[i]->masked;
            /* keys whose parameters phase 1 does not read: per channel (folded before it), or fp16 */
            if (i < 2 && all[i]->bits && all[i]->bits < 16 && all[i]->gran != KVQ_GRAN_CHANNEL) kchan = 0;
        }
    }
    c->rawf = sep ? align16(D * 4) + 64 : 0; /* channel-separable pages never form runs: one page */
    /* The widened parameter floats (scales, zeros, the factors when separable) and the key mask bytes: one copy
     * after the stages (tile i's are written after the barrier that ends tile i - 1's math; only cp.async fills a
     * stage ahead), except for element formats and TurboQuant pages, which kvq_format.cuh and kvq_turboquant.cuh
     * stage while the copies are issued (prod keys' QJL terms): a copy per stage then (par_step = stage_bytes). One copy saves KIVI-2 10 KB at head_dim 128 (docs/cuda.md).
     * The scores and probabilities [T][GQA] (so_p) share the key parameters' part where phase 1 does not read the
     * key parameters (kchan): the fold and the bias read them before the barriers that precede phase 1's writes,
     * and the next tile's are widened after the barrier at the top of the tile loop (2 KB for KIVI-2). The mask
     * bytes (16 at least: the parts stay in order) and their raw blocks are sized only for masked pages. */
    c->mma_k = c->mma_v = 0;
    int wgroups = 0;
    if (c->quant) {
        const plan_store *kst[2] = {&c->k_hi, &c->k_lo}, *vst[2] = {&c->v_hi, &c->v_lo};
        for (int i = 0; i < 2; i++) {
            if (kst[i]->bits && mma_k_ok(p, kst[i])) c->mma_k |= 1 << i;
            /* one accumulator for both classes: the low class joins only with the high class's shifts and groups */
            int same = i == 0 || !(c->mma_v & 1) ||
                       (vst[1]->bits == vst[0]->bits && vst[1]->group == vst[0]->group && vst[1]->hidden == vst[0]->hidden);
            if (vst[i]->bits && mma_v_ok(p, vst[i]) && same) {
                c->mma_v |= 1 << i;
                wgroups = max_i(wgroups, mma_v_groups(p, vst[i]));
            }
        }
    }
    /* Parameters read where cp.async lands them (no widened floats): per-channel keys of integer formats (the fold
     * and the bias read each page's scales and zeros from its raw blocks: whole, aligned sections) and per-token
     * values whose every quantized class takes p.V on the tensor cores (the weights' pass reads a tile's one value
     * page at the section's offset). The floats' part then holds only what shares it (the scores). */
    c->kpraw = c->quant && !c->sparse && !sep && !efmt && par_raw_ok(D, &c->k_hi, KVQ_GRAN_CHANNEL) &&
               par_raw_ok(D, &c->k_lo, KVQ_GRAN_CHANNEL) && c->k_hi.bits < 16;
    c->vpraw = c->quant && !c->sparse && !sep && !efmt && par_raw_ok(D, &c->v_hi, KVQ_GRAN_TOKEN) &&
               par_raw_ok(D, &c->v_lo, KVQ_GRAN_TOKEN) && c->v_hi.bits < 16 && (c->mma_v & 1) &&
               (!c->v_lo.bits || c->v_lo.bits >= 16 || (c->mma_v & 2));
    const int fd = sep ? D : 0, psh = !efmt && kchan;
    int kparb = c->kpraw ? 16 : align16((2 * c->kpar + fd) * 4);
    const int vparb = c->vpraw ? 16 : align16((2 * c->vpar + fd) * 4), maskb = masked ? align16(T) : 16;
    if (psh) kparb = max_i(kparb, align16(T * G * 4));
    int o = 0;
    c->so_rows = o, o += c->rows_bytes;
    if (efmt) c->so_kpar = o, o += kparb, c->so_vpar = o, o += vparb, c->so_kmask = o, o += maskb;
    c->so_kraw = o, o += 2 * c->kraws + c->rawf + (masked ? align16(T / 8 + 1) + 64 * KP : 0); /* mask bytes last */
    c->so_vraw = o, o += 2 * c->vraws + c->rawf;
    c->stage_bytes = o;
    o = c->stages * c->stage_bytes;
    c->par_step = efmt ? c->stage_bytes : 0;
    if (!efmt) c->so_kpar = o, o += kparb, c->so_vpar = o, o += vparb, c->so_kmask = o, o += maskb;
    o = max_i(o, align16(merge)); /* the end-of-chunk merge scratch from 0 */
    /* The folded query (a fold per key page) is read by phase 1 only, p.V's B fragments (so_w: per value group, 8
     * fp16 columns of each token; the first 256 bytes double as the end-of-chunk sum of the zero terms over the
     * warps) are written by phase 2 and read by phase 3: a barrier separates phase 1 from phase 2 (the tile's
     * maximum) and phase 3 from the next tile's fold (the top of the tile loop), so they share one part, as large
     * as the larger (KIVI-2 at head_dim 128: 8 KB saved). */
    /* a page's B fragments: D / 16 k-blocks of 34 8-byte entries (KVQ_MMA_KBS, kvq_mma.cuh) */
    int qkb = align16((c->mma_k ? D / 16 * 34 * 8 : D * G * 4) * KP);
    /* p.V's B fragments: per 16-token block, the groups' 64 words and 8 more (KVQ_MMA_WKS, kvq_mma.cuh) */
    if (c->mma_v) qkb = max_i(qkb, align16(max_i(T / 16 * (wgroups * 64 + 8) * 4, (p->threads / 32) * G * 4 * 4)));
    c->so_q = o, o += align16(D * G * 4);
    c->so_qk = o, o += qkb;
    c->so_w = c->mma_v ? c->so_qk : 0;
    c->so_qsum = o, o += align16((D / 8 + KP) * G * 4); /* per 8 channels, then the per-channel bias per page */
    if (psh)
        c->so_p = c->so_kpar;
    else
        c->so_p = o, o += align16(T * G * 4);
    /* warp maxima, bias partials (kvq_bred_page floats a page), a and m */
    c->so_red = o, o += align16(((p->threads / 32 + 2) * G + KP * kvq_bred_page(G)) * 4);
    c->smem = o;
}

/* a class whose decode reads codes (not only fp16 rows) */
static int class_codes(const plan_class *c) { return c->quant && (c->k_hi.bits < 16 || c->v_hi.bits < 16); }

int plan_decode_min_blocks(const kvq_plan *p, const plan_class *c)
{
    /* what sm_90's shared memory per SM allows (the occupancy the load pipeline is sized for), at most 4 blocks of
     * 128 threads where q.K and p.V take the tensor cores at head_dim up to 128 (ptxas then has 128 registers:
     * KIVI-4, OTT, TailorKV-2 fit without spilling, KIVI-2 spills 8 bytes outside its loops; 16 warps an SM
     * instead of 12; at head_dim 256 a sweep case spilled 20 bytes), else 3 (170
     * registers, what the fp32 paths need without spilling). $KVQ_DECODE_MINB (p->decode_minb) overrides it for
     * the quantized classes, whatever the shared memory: a knob for timing the choice on a GPU (docs/cuda.md). */
    if (p->decode_minb > 0 && class_codes(c)) {
        const int most = p->threads >= 2048 ? 1 : 2048 / p->threads;
        return p->decode_minb < most ? p->decode_minb : most;
    }
    const int mma = c->quant && c->mma_k && c->mma_v && p->head_dim <= 128; /* at 256: 4 accumulator blocks a warp */
    int pminb = (mma ? 512 : 384) / p->threads;
    /* 256-token tiles keep 3 blocks (plan.c, the class's tile): at 128 registers OTT's spilled 40 bytes on sm_90 */
    if (c->tile > 128 && pminb > 384 / p->threads) pminb = 384 / p->threads;
    if (pminb < 1) pminb = 1;
    int minb = plan_smem_per_sm(90) / (c->smem + 1024);
    if (minb > pminb) minb = pminb;
    return minb < 1 ? 1 : minb;
}

int plan_smem_per_sm(int sm)
{
    if (sm >= 90) return 228 * 1024;
    if (sm == 80 || sm == 87) return 164 * 1024;
    if (sm >= 86) return 100 * 1024;
    return 64 * 1024;
}

int plan_ctas_per_sm(int sm, int threads, size_t smem, int regs)
{
    if (threads <= 0) return 0;
    const int warps = (threads + 31) / 32, per_warp = ((regs * 32 + 255) / 256) * 256;
    int n = 32;
    if (per_warp && 65536 / (per_warp * warps) < n) n = 65536 / (per_warp * warps);
    if ((size_t)plan_smem_per_sm(sm) / (smem + 1024) < (size_t)n) n = (int)((size_t)plan_smem_per_sm(sm) / (smem + 1024));
    if (2048 / threads < n) n = 2048 / threads;
    return n;
}

int plan_decode_ctas_per_sm(const kvq_plan *p, const plan_class *c, int sm, int regs)
{
    return plan_ctas_per_sm(sm, p->threads, (size_t)c->smem, regs);
}

double plan_decode_tile_bytes(const kvq_plan *p, const plan_class *c, double tile_tokens)
{
    return (tile_tokens > 0 ? tile_tokens : c->tile) * plan_body_bytes_per_token(p, c);
}

double plan_decode_bytes_in_flight(const kvq_plan *p, const plan_class *c, int sm, int regs, double tile_tokens)
{
    return c->stages * plan_decode_tile_bytes(p, c, tile_tokens) * plan_decode_ctas_per_sm(p, c, sm, regs);
}

int plan_smem_optin(int sm)
{
    if (sm >= 90) return 227 * 1024;
    if (sm == 80 || sm == 87) return 163 * 1024;
    if (sm >= 86) return 99 * 1024;
    return 48 * 1024;
}

kvq_status plan_cuda_ok(const kvq_plan *p, char *msg, size_t n)
{
    for (int l = 0; l < p->layers; l++) {
        const plan_class *c = &p->cls[p->layer_class[l]];
        /* templates/kvq_turboquant.cuh decodes mse keys and values and prod keys (QJL's score term), not prod values */
        if (c->quant && c->v_hi.tq == KVQ_TQ_PROD) {
            snprintf(msg, n, "plan: layer %d stores TurboQuant prod values (turboquant prod of the values), which the "
                             "CUDA kernels do not decode (mse values and prod keys they do; the reference and cpu "
                             "backends decode them)", l);
            return KVQ_ERR_UNSUPPORTED;
        }
    }
    return KVQ_OK;
}

kvq_status plan_check_target(const kvq_plan *p, int sm, char *msg, size_t n)
{
    kvq_status tq = plan_cuda_ok(p, msg, n);
    if (tq != KVQ_OK) return tq;
    if (p->threads > 1024) {
        snprintf(msg, n, "plan: the decode block needs %d threads (head_dim %d, GQA %d), more than 1024", p->threads,
                 p->head_dim, p->gqa);
        return KVQ_ERR_UNSUPPORTED;
    }
    /* The decode kernel keeps per-head state of the whole GQA group in registers (m, d, a, and the scores, partial
     * sums and query of a token in phase 1: about 6 x GQA), besides o (HPT x VEC) and about 48 for addresses and
     * codes; __launch_bounds__ caps ptxas at 64K registers over THREADS x the class's blocks per SM (emit_cuda:
     * KVQ_C_MINB), at most 255. A larger group would spill, and is refused. */
    for (int k = 0; k < p->n_classes; k++) {
        /* a forced $KVQ_DECODE_MINB is the user's (ptxas may spill to meet it): not checked against the estimate */
        int minb = p->decode_minb > 0 && class_codes(&p->cls[k]) ? 1 : plan_decode_min_blocks(p, &p->cls[k]);
        int regs = 65536 / (p->threads * minb);
        if (regs > 255) regs = 255;
        int need = 48 + p->hpt * p->vec + 6 * p->gqa;
        if (need > regs) {
            snprintf(msg, n, "plan: the decode kernel keeps about %d registers per thread for GQA %d (the query heads "
                     "of one kv head), more than the %d a block of %d threads can have", need, p->gqa, regs, p->threads);
            return KVQ_ERR_UNSUPPORTED;
        }
    }
    int lim = plan_smem_optin(sm);
    for (int k = 0; k < p->n_classes; k++)
        if (p->cls[k].smem > lim) {
            snprintf(msg, n, "plan: class %d's decode kernel needs %d bytes of shared memory (tile %d, head_dim %d, "
                     "GQA %d), sm_%d allows %d", k, p->cls[k].smem, p->cls[k].tile, p->head_dim, p->gqa, sm, lim);
            return KVQ_ERR_UNSUPPORTED;
        }
    return KVQ_OK;
}

/* A tuning knob's value: 0 when unset or empty (the default), 1 with *v its number, or 1 with *v = -1 when it is
 * not a whole decimal number (the caller refuses it, naming the variable) */
static int env_number(const char *s, long *v)
{
    *v = 0;
    if (!s || !*s) return 0;
    char *end = NULL;
    *v = strtol(s, &end, 10);
    if (*end) *v = -1;
    return 1;
}

kvq_status plan_build(const kvq_scheme *scheme, const kvq_dims *dims, kvq_dtype in_dtype, kvq_plan *p, char *msg,
                      size_t n)
{
    memset(p, 0, sizeof *p);
    if (dims->layers <= 0 || dims->heads <= 0 || dims->kv_heads <= 0 || dims->head_dim <= 0) {
        snprintf(msg, n, "plan: dimensions must be positive");
        return KVQ_ERR_SHAPE;
    }
    if (dims->heads % dims->kv_heads != 0) {
        snprintf(msg, n, "plan: heads (%d) is not a multiple of kv_heads (%d)", dims->heads, dims->kv_heads);
        return KVQ_ERR_SHAPE;
    }
    if (dims->head_dim % 32 != 0 || dims->head_dim > 256) {
        snprintf(msg, n, "plan: head_dim %d is not a multiple of 32 up to 256", dims->head_dim);
        return KVQ_ERR_SHAPE;
    }
    if (dims->layers > PLAN_MAX_LAYERS) {
        snprintf(msg, n, "plan: %d layers, at most %d", dims->layers, PLAN_MAX_LAYERS);
        return KVQ_ERR_UNSUPPORTED;
    }
    snprintf(p->scheme, sizeof p->scheme, "%s", scheme->name);
    p->layers = dims->layers;
    p->heads = dims->heads;
    p->kv_heads = dims->kv_heads;
    p->head_dim = dims->head_dim;
    p->gqa = dims->heads / dims->kv_heads;
    p->in_dtype = (int)in_dtype;
    /* tuning knob (plan.h, docs/cuda.md "Tuning knobs"): the quantized decode kernels' blocks per SM */
    long v;
    const char *minb = getenv("KVQ_DECODE_MINB");
    if (env_number(minb, &v) && (v < 0 || v > 32)) v = -1;
    if (v < 0) {
        snprintf(msg, n, "plan: KVQ_DECODE_MINB='%s' is not a number of blocks per SM from 0 to 32", minb);
        return KVQ_ERR_INVALID;
    }
    p->decode_minb = (int)v;
    /* tuning knob: the quantized classes' decode tile (tokens), for timing 256-token tiles against the default */
    const char *tile = getenv("KVQ_DECODE_TILE");
    if (env_number(tile, &v) && !(v == 0 || v == 32 || v == 64 || v == 128 || v == 256)) v = -1;
    if (v < 0) {
        snprintf(msg, n, "plan: KVQ_DECODE_TILE='%s' is not 0 or a decode tile of 32, 64, 128 or 256 tokens", tile);
        return KVQ_ERR_INVALID;
    }
    p->decode_tile = (int)v;
    choose_mapping(p);

    const kvq_layer_cfg *seen[PLAN_MAX_CLASSES];
    for (int l = 0; l < p->layers; l++) {
        const kvq_layer_cfg *cfg = kvq_scheme_layer(scheme, l);
        int c = 0;
        /* Element formats are planned like integers (plan_store carries the format): the cpu kernels
         * (compiler/emit_llvm_format.c) and the CUDA templates (templates/kvq_format.cuh) decode them; what a
         * backend cannot run it refuses in its supports() (cu_supports: per-channel groups of a block format). */
        while (c < p->n_classes && !layer_eq(seen[c], cfg)) c++;
        if (c == p->n_classes) {
            if (c == PLAN_MAX_CLASSES) {
                snprintf(msg, n, "plan: more than %d distinct layer configurations", PLAN_MAX_CLASSES);
                return KVQ_ERR_UNSUPPORTED;
            }
            seen[c] = cfg;
            plan_class *pc = &p->cls[c];
            class_init(pc, cfg, p->head_dim);
            pc->id = c;
            kvq_status st = check_class(pc, p->head_dim, msg, n);
            if (st != KVQ_OK) return st;
            /* Tile: K and V staging together within 64 KiB of shared memory at the widest row, a power of two
             * from 32 to 128 (phase 1 gives each token `split` lanes of a warp). A class whose pages are fp16 rows
             * (fp16 stores, sparse layers) fits all the load pipeline's stages in it: 64 tokens at head_dim 128,
             * so that two stages fit sm_86's 99 KiB and two CTAs an sm_90 SM (quantized classes stage their fp16
             * rows in fewer tokens, plan_tile_tokens). */
            int row = max_i(max_i(pc->k_row_bytes, pc->v_row_bytes), 1);
            const int f16pages = !pc->quant || pc->sparse || (pc->k_hi.bits >= 16 && pc->v_hi.bits >= 16);
            int tile = 32;
            while (tile < 128 && (f16pages ? PLAN_DECODE_STAGES : 1) * 2 * tile * row <= 32768) tile *= 2;
            /* $KVQ_DECODE_TILE (p->decode_tile) for the classes whose pages hold codes; their fp16 rows (windows,
             * sinks) keep as many tokens as fit the stage (plan_tile_tokens), and the shared memory is checked
             * against the arch like any plan's (plan_check_target) */
            if (p->decode_tile > 0 && !f16pages) tile = p->decode_tile;
            pc->tile = tile;
            tile_mapping(p, pc);
            /* 256-token tiles where they keep 3 blocks an sm_90 SM (12 warps, the occupancy the GPU run measured,
             * docs/gpu-results.md): the per-tile work (staging set-up, fold, maximum, rescale, barriers) is paid
             * half as often (KIVI-2 at 32k: 51.9 -> 44.1 warp-instructions a token, docs/cuda.md "Cost model") */
            if (p->decode_tile == 0 && !f16pages && tile == 128 && 2 * 256 * qrow_bytes(p, pc) <= 32768) {
                plan_class wide = *pc;
                wide.tile = 256;
                tile_mapping(p, &wide);
                if (plan_smem_per_sm(90) / (wide.smem + 1024) >= 3) *pc = wide;
            }
            p->any_sparse |= pc->sparse;
            p->any_saliency |= pc->quant && pc->has_low;
            p->any_pool |= pc->quant && pc->has_pool;
            p->any_auto |= pc->mode == KVQ_MODE_AUTO;
            p->n_classes++;
        }
        p->layer_class[l] = c;
        p->cls[c].n_layers++;
    }
    return KVQ_OK;
}
