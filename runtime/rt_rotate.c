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
    if (!e->rot || !e->rots) return KVQ_ERR_NOMEM;
    for (int l = 0; l < L; l++) {
        const kvq_layer_cfg *c = kvq_scheme_layer(e->scheme, l);
        if (c->mode == KVQ_MODE_SPARSE) continue;
        const kvq_tensor_cfg *t[2] = {&c->quant.key, &c->quant.value};
        for (int w = 0; w < 2; w++) {
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
}

/* Rotations apply to a layer that quantizes: decided (a sparse layer stores everything fp16 and picks critical
 * channels, TailorKV Eq. 10, which a rotation would smear). */
static const kvq_rot *rot_of(const kvq_engine *e, int layer, int which)
{
    if (!e->rot || e->layer_sparse[layer] || !e->layer_decided[layer]) return NULL;
    return e->rot[2 * layer + which];
}

int rt_rotate_configured(const kvq_engine *e, int layer)
{
    return e->rot && (e->rot[2 * layer] || e->rot[2 * layer + 1]);
}

int rt_rotate_active(const kvq_engine *e, int layer) { return rot_of(e, layer, 0) || rot_of(e, layer, 1); }

static void rotate_rows(const kvq_rot *r, float *x, size_t rows, int D, int inverse)
{
    for (size_t i = 0; i < rows; i++) kvq_rot_apply(r, x + i * (size_t)D, inverse);
}

kvq_status rt_rotate_in(kvq_engine *e, const char *fn, int item, int layer, float *k, float *v, float *q,
                        int n_tokens, int pos0)
{
    const kvq_dims *d = &e->cfg.dims;
    const kvq_rot *rk = rot_of(e, layer, 0), *rv = rot_of(e, layer, 1);
    size_t kv_rows = (size_t)d->kv_heads * (size_t)n_tokens, q_rows = (size_t)d->heads * (size_t)n_tokens;
    kvq_status st = KVQ_OK;
    if (rk) {
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

void rt_rotate_out(kvq_engine *e, int layer, float *out, int rows)
{
    const kvq_rot *rv = rot_of(e, layer, 1);
    if (!rv) return;
    /* sum p (R v) = R (sum p v): one R^T per output row. */
    rotate_rows(rv, out, (size_t)rows, e->cfg.dims.head_dim, 1);
    e->rot_count[RT_ROT_OUT] += (uint64_t)rows;
}

void rt_rotate_back(const kvq_engine *e, int layer, float *k, float *v, int capacity, int n_tokens)
{
    const kvq_dims *d = &e->cfg.dims;
    const kvq_rot *r[2] = {rot_of(e, layer, 0), rot_of(e, layer, 1)};
    float *x[2] = {k, v};
    for (int w = 0; w < 2; w++)
        for (int h = 0; r[w] && h < d->kv_heads; h++)
            rotate_rows(r[w], x[w] + (size_t)h * (size_t)capacity * (size_t)d->head_dim, (size_t)n_tokens,
                        d->head_dim, 1);
}
