/* kvq_scheme_check_dims: whether a scheme can run at given model dims. The one check that kvq_engine_create,
 * kvq_scheme_account (so `kvqc report`) and `kvq eval` share, so that what one accepts the others accept
 * (issue 12: report once counted OTT's value group 128 at head_dim 64 as zero groups, a size the engine
 * refuses). Sema checks what a spec can know alone; this adds what needs the dims. */
#include "kvq.h"
#include "scheme.h"
#include "status.h"
#include "sema.h" /* SEMA_LAYERS_MAX: the language's cap on layers, heads and kv_heads */

kvq_status kvq_scheme_check_dims(const kvq_scheme *s, const kvq_dims *d, char *msg, size_t size)
{
    if (msg && size) msg[0] = '\0';
    if (!s || !d) return kvq_status_msg(msg, size, KVQ_ERR_INVALID, "%s is NULL", s ? "dims" : "scheme");
    if (d->layers < 1 || d->heads < 1 || d->kv_heads < 1)
        return kvq_status_msg(msg, size, KVQ_ERR_SHAPE, "dims must be positive (layers %d, heads %d, kv_heads %d)", d->layers,
                    d->heads, d->kv_heads);
    /* The language caps a model block at these; the engine allocates per layer and per head, so an
     * unbounded count is memory and time without bound (layers = INT_MAX once took 52 s and 23 GB). */
    if (d->layers > SEMA_LAYERS_MAX || d->heads > SEMA_LAYERS_MAX || d->kv_heads > SEMA_LAYERS_MAX)
        return kvq_status_msg(msg, size, KVQ_ERR_SHAPE, "dims out of range (layers %d, heads %d, kv_heads %d; at most %d each)",
                    d->layers, d->heads, d->kv_heads, SEMA_LAYERS_MAX);
    if (d->heads % d->kv_heads != 0)
        return kvq_status_msg(msg, size, KVQ_ERR_SHAPE, "heads %d is not a multiple of kv_heads %d", d->heads, d->kv_heads);
    if (d->head_dim != 64 && d->head_dim != 96 && d->head_dim != 128 && d->head_dim != 256)
        return kvq_status_msg(msg, size, KVQ_ERR_SHAPE, "head_dim %d is not 64, 96, 128 or 256", d->head_dim);
    const kvq_model_dims *m = &s->model;
    if ((m->layers && m->layers != d->layers) || (m->heads && m->heads != d->heads) ||
        (m->kv_heads && m->kv_heads != d->kv_heads) || (m->head_dim && m->head_dim != d->head_dim))
        return kvq_status_msg(msg, size, KVQ_ERR_SHAPE,
                    "scheme '%s' is for layers %d heads %d kv_heads %d head_dim %d, not %d %d %d %d", s->name,
                    m->layers, m->heads, m->kv_heads, m->head_dim, d->layers, d->heads, d->kv_heads, d->head_dim);
    for (int l = 0; l < d->layers; l++) {
        const kvq_layer_cfg *c = kvq_scheme_layer(s, l);
        if (c->mode != KVQ_MODE_SPARSE)
            for (int w = 0; w < 2; w++) {
                const kvq_tensor_cfg *t = w ? &c->quant.value : &c->quant.key;
                if (!kvq_bits_is_fp16(t->bits) && t->gran == KVQ_GRAN_TOKEN && t->group > 0 &&
                    d->head_dim % t->group != 0)
                    return kvq_status_msg(msg, size, KVQ_ERR_SHAPE, "layer %d: %s group %d does not divide head_dim %d", l,
                                w ? "value" : "key", t->group, d->head_dim);
                /* TurboQuant's outlier split leaves at least one 32-channel word of regular channels */
                if (!kvq_bits_is_fp16(t->bits) && t->turboquant != KVQ_TQ_NONE && t->tq_outliers >= d->head_dim)
                    return kvq_status_msg(msg, size, KVQ_ERR_SHAPE,
                                "layer %d: %s outlier_channels %d leaves no regular channels at head_dim %d", l,
                                w ? "value" : "key", t->tq_outliers, d->head_dim);
            }
        if (c->mode != KVQ_MODE_QUANT) {
            if (!s->classify.enabled)
                return kvq_status_msg(msg, size, KVQ_ERR_INVALID, "layer %d: mode %s needs the scheme's classify block", l,
                            c->mode == KVQ_MODE_SPARSE ? "sparse" : "auto");
            if (c->sparse.critical_channels > d->head_dim)
                return kvq_status_msg(msg, size, KVQ_ERR_SHAPE, "layer %d: critical_channels %d is more than head_dim %d", l,
                            c->sparse.critical_channels, d->head_dim);
        }
    }
    return KVQ_OK;
}
