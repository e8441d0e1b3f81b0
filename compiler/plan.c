/* Scheme + dims -> kernel plan: see plan.h. */
#include "plan.h"

#include <stdio.h>
#include <string.h>

static int tensor_eq(const kvq_tensor_cfg *a, const kvq_tensor_cfg *b)
{
    return a->bits == b->bits && a->gran == b->gran && a->channel_separable == b->channel_separable &&
           a->group == b->group && a->scale_dtype == b->scale_dtype && a->zero_dtype == b->zero_dtype;
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

static void store_init(plan_store *st, const kvq_tensor_cfg *t, int bits, int masked, int head_dim)
{
    memset(st, 0, sizeof *st);
    st->bits = bits;
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
        c->k_row_bytes = max_i(fp16_k ? fp16_row : 0, plan_row_bytes(D, c->k_hi.bits));
        c->v_row_bytes = max_i(fp16_v ? fp16_row : 0, plan_row_bytes(D, c->v_hi.bits));
        if (sal) {
            c->k_row_bytes = max_i(c->k_row_bytes, plan_row_bytes(D, c->k_lo.bits));
            c->v_row_bytes = max_i(c->v_row_bytes, plan_row_bytes(D, c->v_lo.bits));
        }
    }
    if (c->sparse) {
        /* Sparse layers attend over fp16 rows only (local window and fetched rows). */
        c->k_row_bytes = fp16_row;
        c->v_row_bytes = fp16_row;
    }
}

static int bits_ok(int b) { return b == 1 || b == 2 || b == 3 || b == 4 || b == 8 || b == 16; }

static kvq_status check_class(const plan_class *c, int D, char *msg, size_t n)
{
    if (!c->quant) return KVQ_OK;
    const plan_store *st[4] = {&c->k_hi, &c->v_hi, &c->k_lo, &c->v_lo};
    for (int i = 0; i < (c->has_low ? 4 : 2); i++) {
        if (!bits_ok(st[i]->bits)) {
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

/* Decode mapping (plan.h). TY is the largest divisor of the GQA ratio that keeps TX*TY <= 128 threads, widened
 * (up to 512 threads) when a thread would otherwise hold more than 4 heads: q and o live in registers,
 * HPT * VEC floats each, and must not spill. */
static void choose_mapping(kvq_plan *p)
{
    int D = p->head_dim, g = p->gqa;
    p->vec = 8; /* 16 bytes of fp16, 8 codes of any width fit one 32-bit word (b <= 4) or two (b = 8) */
    int lanes = (D + p->vec - 1) / p->vec;
    p->tx = 1;
    while (p->tx < lanes) p->tx *= 2;
    int ty = 1;
    for (int d = 1; d <= g; d++)
        if (g % d == 0 && p->tx * d <= 128) ty = d;
    if (g / ty > 4)
        for (int d = ty + 1; d <= g; d++)
            if (g % d == 0 && p->tx * d <= 512 && g / d <= 4) {
                ty = d;
                break;
            }
    p->ty = ty;
    p->hpt = g / ty;
    /* TZ: whole warps (the shuffles name all 32 lanes), as many as fit 128 threads */
    int xy = p->tx * p->ty, w = 32;
    while (xy % w) w /= 2;
    int tz0 = 32 / w;
    p->tz = tz0 * (xy * tz0 >= 128 ? 1 : 128 / (xy * tz0));
    p->threads = xy * p->tz;
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
    choose_mapping(p);

    const kvq_layer_cfg *seen[PLAN_MAX_CLASSES];
    for (int l = 0; l < p->layers; l++) {
        const kvq_layer_cfg *cfg = kvq_scheme_layer(scheme, l);
        int c = 0;
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
            /* Tile: K and V staging together within 32 KiB of shared memory at the widest row. */
            int row = max_i(max_i(pc->k_row_bytes, pc->v_row_bytes), 1);
            int tile = 16384 / row / 32 * 32;
            if (tile < 32) tile = 32;
            if (tile > 128) tile = 128;
            pc->tile = tile;
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
