/* Rotations as an engine-level transform (docs/runtime.md, "Rotations"). With q.(R k) = (R q).k and
 * sum_t p_t (R v_t) = R (sum_t p_t v_t), a layer whose every stored key is R_k k and every stored value R_v v
 * (quantized groups, fp16 windows, pools alike) attends exactly as an unrotated one when its query is R_k q and
 * its output is rotated back by R_v^T. So the engine rotates K/V rows as they arrive (prefill and decode), q once
 * per step per head, and the output once per step per head; the backends store and attend what they are given
 * and know nothing of rotations. Decode adds no per-token work. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "rotation.h"
#include "rt_internal.h"

/* The rotation tensor `t` of a quantize-mode layer uses, or none: only quantized tensors are rotated. */
static int wants(const kvq_tensor_cfg *t) { return t->rotate != KVQ_ROT_NONE && !kvq_bits_is_fp16(t->bits); }

/* TurboQuant's outlier channel split (arXiv 2504.19874 Sec. 4.3; turboquant.h kvq_tqv): the stored vector of a
 * head vector x is [R_out x_O | R_rest x_rest], O the sequence's outlier channels of that kv head (the n_out
 * largest by L2 norm over its prompt, ties to the lower channel: QJL Sec. 4.1 finds outlier channels in the
 * prompt) in ascending order, the rest ascending. R_out and R_rest are independent Haar-random rotations of
 * their sizes (seed S; streams HAAR_OUT and HAAR). The whole map is the orthogonal matrix blockdiag(R_out,
 * R_rest) P_seq, so attention stays exact algebra: q is mapped by the kv head's matrix once per step and the
 * output mapped back once per step, as for any rotation. */
struct rt_tq_split {
    int seed, n_out, D;
    kvq_rot out, rest;
};

static int wants_split(const kvq_tensor_cfg *t) { return wants(t) && t->turboquant != KVQ_TQ_NONE && t->tq_outliers > 0; }

static kvq_status find_or_build_split(kvq_engine *e, const kvq_tensor_cfg *t, const struct rt_tq_split **out)
{
    int D = e->cfg.dims.head_dim;
    for (int i = 0; i < e->n_splits; i++)
        if (e->splits[i].seed == t->rotate_seed && e->splits[i].n_out == t->tq_outliers) {
            *out = &e->splits[i];
            return KVQ_OK;
        }
    struct rt_tq_split *x = &e->splits[e->n_splits];
    if (t->tq_outliers <= 0 || t->tq_outliers >= D) return KVQ_ERR_SHAPE;
    kvq_status st = kvq_rot_build_random_stream(&x->out, t->rotate_seed, t->tq_outliers, KVQ_RNG_STREAM_HAAR_OUT);
    if (st == KVQ_OK) st = kvq_rot_build(&x->rest, KVQ_ROT_RANDOM, t->rotate_seed, D - t->tq_outliers);
    if (st != KVQ_OK) {
        kvq_rot_free(&x->out);
        return st;
    }
    x->seed = t->rotate_seed;
    x->n_out = t->tq_outliers;
    x->D = D;
    *out = &e->splits[e->n_splits++];
    return KVQ_OK;
}

static kvq_status find_or_build(kvq_engine *e, const kvq_tensor_cfg *t, const kvq_rot **out)
{
    int D = e->cfg.dims.head_dim;
    for (int i = 0; i < e->n_rots; i++)
        if (e->rots[i].kind == t->rotate && e->rots[i].seed == t->rotate_seed) {
            *out = &e->rots[i];
            return KVQ_OK;
        }
    kvq_status st = kvq_rot_build(&e->rots[e->n_rots], t->rotate, t->rotate_seed, D);
    if (st != KVQ_OK) return st;
    *out = &e->rots[e->n_rots++];
    return KVQ_OK;
}

kvq_status rt_rotate_init(kvq_engine *e, char *msg, size_t msg_size)
{
    int L = e->cfg.dims.layers;
    e->rot = kvq_calloc((size_t)L * 2, sizeof *e->rot);
    /* At most two distinct rotations per layer; usually one or two in all. */
    e->rots = kvq_calloc((size_t)L * 2, sizeof *e->rots);
    e->split = kvq_calloc((size_t)L * 2, sizeof *e->split);
    e->splits = kvq_calloc((size_t)L * 2, sizeof *e->splits);
    if (!e->rot || !e->rots || !e->split || !e->splits) return KVQ_ERR_NOMEM;
    for (int l = 0; l < L; l++) {
        const kvq_layer_cfg *c = kvq_scheme_layer(e->scheme, l);
        if (c->mode == KVQ_MODE_SPARSE) continue;
        const kvq_tensor_cfg *t[2] = {&c->quant.key, &c->quant.value};
        for (int w = 0; w < 2; w++) {
            if (wants_split(t[w])) {
                kvq_status st = find_or_build_split(e, t[w], &e->split[2 * l + w]);
                if (st == KVQ_ERR_SHAPE)
                    snprintf(msg, msg_size, "layer %d: outlier_channels %d leaves no regular channels at head_dim %d",
                             l, t[w]->tq_outliers, e->cfg.dims.head_dim);
                if (st != KVQ_OK) return st;
                continue;
            }
            if (!wants(t[w])) continue;
            kvq_status st = find_or_build(e, t[w], &e->rot[2 * l + w]);
            if (st == KVQ_ERR_SHAPE)
                snprintf(msg, msg_size, "layer %d: rotate %s has no construction for head_dim %d", l,
                         t[w]->rotate == KVQ_ROT_HADAMARD ? "hadamard" : "random", e->cfg.dims.head_dim);
            if (st != KVQ_OK) return st;
        }
    }
    return KVQ_OK;
}

void rt_rotate_free(kvq_engine *e)
{
    for (int i = 0; i < e->n_rots; i++) kvq_rot_free(&e->rots[i]);
    kvq_free(e->rots);
    kvq_free(e->rot);
    e->rots = NULL;
    e->rot = NULL;
    e->n_rots = 0;
    for (int i = 0; i < e->n_splits; i++) {
        kvq_rot_free(&e->splits[i].out);
        kvq_rot_free(&e->splits[i].rest);
    }
    kvq_free(e->splits);
    kvq_free(e->split);
    e->splits = NULL;
    e->split = NULL;
    e->n_splits = 0;
}

/* Rotations apply to a layer that quantizes: decided (a sparse layer stores everything fp16 and picks critical
 * channels, TailorKV Eq. 10, which a rotation would smear). */
static const kvq_rot *rot_of(const kvq_engine *e, int layer, int which)
{
    if (!e->rot || e->layer_sparse[layer] || !e->layer_decided[layer]) return NULL;
    return e->rot[2 * layer + which];
}

static const struct rt_tq_split *split_of(const kvq_engine *e, int layer, int which)
{
    if (!e->split || e->layer_sparse[layer] || !e->layer_decided[layer]) return NULL;
    return e->split[2 * layer + which];
}

int rt_rotate_configured(const kvq_engine *e, int layer)
{
    return (e->rot && (e->rot[2 * layer] || e->rot[2 * layer + 1])) ||
           (e->split && (e->split[2 * layer] || e->split[2 * layer + 1]));
}

int rt_rotate_active(const kvq_engine *e, int layer)
{
    return rot_of(e, layer, 0) || rot_of(e, layer, 1) || split_of(e, layer, 0) || split_of(e, layer, 1);
}

int rt_tq_split_any(const kvq_engine *e) { return e->n_splits > 0; }

uint64_t rt_tq_split_bytes(const kvq_engine *e, int layer)
{
    const kvq_dims *d = &e->cfg.dims;
    uint64_t n = 0;
    for (int w = 0; w < 2; w++)
        if (split_of(e, layer, w)) n += (uint64_t)d->kv_heads * (uint64_t)(d->head_dim / 8);
    return n;
}

/* The channel order of (layer, tensor, kv head) in seq. */
static unsigned char *perm_of(const kvq_engine *e, const kvq_seq *seq, int layer, int which, int h)
{
    const kvq_dims *d = &e->cfg.dims;
    return seq->tq_perm + (((size_t)layer * 2 + (size_t)which) * (size_t)d->kv_heads + (size_t)h) * (size_t)d->head_dim;
}

/* The prompt's outlier channels of each kv head: the n_out largest sums of squares over its n tokens. */
static void select_outliers(const kvq_engine *e, const kvq_seq *seq, int layer, int which, const struct rt_tq_split *sp,
                            const float *x, int n)
{
    int D = sp->D;
    for (int h = 0; h < e->cfg.dims.kv_heads; h++) {
        double ss[KVQ_ROT_MAX_D] = {0};
        unsigned char is_out[KVQ_ROT_MAX_D] = {0};
        const float *xh = x + (size_t)h * (size_t)n * (size_t)D;
        for (int t = 0; t < n; t++)
            for (int c = 0; c < D; c++) ss[c] += (double)xh[(size_t)t * D + c] * xh[(size_t)t * D + c];
        for (int k = 0; k < sp->n_out; k++) {
            int best = -1;
            for (int c = 0; c < D; c++)
                if (!is_out[c] && (best < 0 || ss[c] > ss[best])) best = c;
            is_out[best] = 1;
        }
        unsigned char *p = perm_of(e, seq, layer, which, h);
        int a = 0, b = sp->n_out;
        for (int c = 0; c < D; c++) p[is_out[c] ? a++ : b++] = (unsigned char)c;
    }
}

/* x <- blockdiag(R_out, R_rest) P x, or its transpose. */
static void split_apply(const struct rt_tq_split *sp, const unsigned char *p, float *x, int inverse)
{
    float y[KVQ_ROT_MAX_D];
    int D = sp->D;
    if (!inverse) {
        for (int i = 0; i < D; i++) y[i] = x[p[i]];
        kvq_rot_apply(&sp->out, y, 0);
        kvq_rot_apply(&sp->rest, y + sp->n_out, 0);
        memcpy(x, y, (size_t)D * sizeof *x);
    } else {
        memcpy(y, x, (size_t)D * sizeof *x);
        kvq_rot_apply(&sp->out, y, 1);
        kvq_rot_apply(&sp->rest, y + sp->n_out, 1);
        for (int i = 0; i < D; i++) x[p[i]] = y[i];
    }
}

/* Rows [kv_heads][n][D] (rows_per_head n, kv head h for row block h), or query rows [heads][n][D] (group > 1:
 * query head hq uses kv head hq / group). */
static void split_rows(const kvq_engine *e, const kvq_seq *seq, int layer, int which, const struct rt_tq_split *sp,
                       float *x, int heads, int group, size_t rows_per_head, size_t stride, int inverse)
{
    for (int hq = 0; hq < heads; hq++) {
        const unsigned char *p = perm_of(e, seq, layer, which, hq / group);
        for (size_t i = 0; i < rows_per_head; i++)
            split_apply(sp, p, x + ((size_t)hq * stride + i) * (size_t)sp->D, inverse);
    }
}

static void rotate_rows(const kvq_rot *r, float *x, size_t rows, int D, int inverse)
{
    for (size_t i = 0; i < rows; i++) kvq_rot_apply(r, x + i * (size_t)D, inverse);
}

kvq_status rt_rotate_in(kvq_engine *e, const char *fn, kvq_seq *seq, int item, int layer, float *k, float *v,
                        float *q, int n_tokens, int pos0)
{
    const kvq_dims *d = &e->cfg.dims;
    const kvq_rot *rk = rot_of(e, layer, 0), *rv = rot_of(e, layer, 1);
    const struct rt_tq_split *sk = split_of(e, layer, 0), *sv = split_of(e, layer, 1);
    size_t kv_rows = (size_t)d->kv_heads * (size_t)n_tokens, q_rows = (size_t)d->heads * (size_t)n_tokens;
    size_t n = (size_t)n_tokens;
    int group = d->heads / d->kv_heads;
    kvq_status st = KVQ_OK;
    /* The split's outlier channels come from the prompt (pos0 0: a prefill; decode appends at pos0 >= 1) */
    if (sk && pos0 == 0) select_outliers(e, seq, layer, 0, sk, k, n_tokens);
    if (sv && pos0 == 0) select_outliers(e, seq, layer, 1, sv, v, n_tokens);
    if (sk) {
        split_rows(e, seq, layer, 0, sk, k, d->kv_heads, 1, n, n, 0);
        e->rot_count[RT_ROT_K] += kv_rows;
        if (q) {
            split_rows(e, seq, layer, 0, sk, q, d->heads, group, n, n, 0);
            e->rot_count[RT_ROT_Q] += q_rows;
        }
        st = rt_check_kv(e, fn, item, layer, "k (rotated)", k, n_tokens, pos0);
        if (st == KVQ_OK && q) st = rt_check_q(e, fn, item, layer, q, n_tokens, pos0);
    }
    if (sv && st == KVQ_OK) {
        split_rows(e, seq, layer, 1, sv, v, d->kv_heads, 1, n, n, 0);
        e->rot_count[RT_ROT_V] += kv_rows;
        st = rt_check_kv(e, fn, item, layer, "v (rotated)", v, n_tokens, pos0);
    }
    if (rk && st == KVQ_OK) {
        rotate_rows(rk, k, kv_rows, d->head_dim, 0);
        e->rot_count[RT_ROT_K] += kv_rows;
        /* q.(R k) = (R q).k: the queries a backend sees (decode, ZipCache's probes) are in the keys' basis. */
        if (q) {
            rotate_rows(rk, q, q_rows, d->head_dim, 0);
            e->rot_count[RT_ROT_Q] += q_rows;
        }
        /* |R k|_inf <= |k|_2 can pass fp16's range where k did not: the same rule, on what is stored. */
        st = rt_check_kv(e, fn, item, layer, "k (rotated)", k, n_tokens, pos0);
        if (st == KVQ_OK && q) st = rt_check_q(e, fn, item, layer, q, n_tokens, pos0);
    }
    if (rv && st == KVQ_OK) {
        rotate_rows(rv, v, kv_rows, d->head_dim, 0);
        e->rot_count[RT_ROT_V] += kv_rows;
        st = rt_check_kv(e, fn, item, layer, "v (rotated)", v, n_tokens, pos0);
    }
    return st;
}

void rt_rotate_out(kvq_engine *e, const kvq_seq *seq, int layer, float *out, int rows)
{
    const kvq_rot *rv = rot_of(e, layer, 1);
    const struct rt_tq_split *sv = split_of(e, layer, 1);
    if (sv) { /* rows are the query heads [heads][D] */
        split_rows(e, seq, layer, 1, sv, out, rows, rows / e->cfg.dims.kv_heads, 1, 1, 1);
        e->rot_count[RT_ROT_OUT] += (uint64_t)rows;
    }
    if (!rv) return;
    /* sum p (R v) = R (sum p v): one R^T per output row. */
    rotate_rows(rv, out, (size_t)rows, e->cfg.dims.head_dim, 1);
    e->rot_count[RT_ROT_OUT] += (uint64_t)rows;
}

void rt_rotate_back(const kvq_engine *e, const kvq_seq *seq, int layer, float *k, float *v, int capacity,
                    int n_tokens)
{
    const kvq_dims *d = &e->cfg.dims;
    const struct rt_tq_split *sp[2] = {split_of(e, layer, 0), split_of(e, layer, 1)};
    float *xs[2] = {k, v};
    for (int w = 0; w < 2; w++)
        if (sp[w] && seq->prefilled[layer])
            split_rows(e, seq, layer, w, sp[w], xs[w], d->kv_heads, 1, (size_t)n_tokens, (size_t)capacity, 1);
    const kvq_rot *r[2] = {rot_of(e, layer, 0), rot_of(e, layer, 1)};
    float *x[2] = {k, v};
    for (int w = 0; w < 2; w++)
        for (int h = 0; r[w] && h < d->kv_heads; h++)
            rotate_rows(r[w], x[w] + (size_t)h * (size_t)capacity * (size_t)d->head_dim, (size_t)n_tokens,
                        d->head_dim, 1);
}
