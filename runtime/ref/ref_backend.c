/* The reference backend's vtable (backend.h): sequences, batched prefill and decode, accounting, read_cache.
 * Prefill and decode are all-or-nothing over the whole batch: every allocation of every item is made first (a
 * prefill builds each new layer aside; a decode reserves each step's pages and scratch), then the state changes,
 * which cannot fail. So KVQ_ERR_NOMEM leaves every sequence as it was, as kvq.h promises. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "ref.h"

static kvq_status ref_probe(char *msg, size_t msg_size)
{
    (void)msg;
    (void)msg_size;
    return KVQ_OK; /* plain C: runs everywhere */
}

static kvq_status ref_supports(const kvq_be_engine *e, char *msg, size_t msg_size)
{
    for (int l = 0; l < e->dims.layers; l++) {
        const kvq_layer_cfg *c = kvq_scheme_layer(e->scheme, l);
        if (c->mode == KVQ_MODE_SPARSE) continue;
        const kvq_quant_cfg *q = &c->quant;
        if (q->outliers.keep > 0 && q->flush != KVQ_FLUSH_GROUP) {
            /* OTT's competition moves K and V of the same tokens at one quantization step (Sec. 3.2); under
             * KIVI's rule keys and values leave the window at different times. */
            snprintf(msg, msg_size, "layer %d: an outlier pool needs keys and values flushed together (flush group)",
                     l);
            return KVQ_ERR_UNSUPPORTED;
        }
        if (q->outliers.keep > 0 && (kvq_bits_is_fp16(q->key.bits) || kvq_bits_is_fp16(q->value.bits))) {
            /* An fp16 tensor skips the window, so its tokens would not leave with the other tensor's. */
            snprintf(msg, msg_size, "layer %d: an outlier pool needs both keys and values quantized (not bits 16)", l);
            return KVQ_ERR_UNSUPPORTED;
        }
        if (q->outliers.keep > 0 && q->saliency.metric != KVQ_SAL_NONE) {
            snprintf(msg, msg_size, "layer %d: outlier pools combined with saliency classes are not supported", l);
            return KVQ_ERR_UNSUPPORTED;
        }
    }
    return KVQ_OK;
}

static kvq_status ref_prepare(const kvq_be_engine *e, kvq_backend_ctx **out, char *msg, size_t msg_size)
{
    (void)msg;
    (void)msg_size;
    kvq_backend_ctx *c = kvq_calloc(1, sizeof *c);
    if (!c) return KVQ_ERR_NOMEM;
    c->e = *e;
    *out = c;
    return KVQ_OK;
}

static void ref_destroy(kvq_backend_ctx *ctx) { kvq_free(ctx); }

static void layer_free(ref_layer *L)
{
    if (!L) return;
    if (L->sparse)
        ref_slayer_free(&L->s);
    else
        ref_qlayer_free(&L->q);
    kvq_free(L);
}

kvq_status ref_seq_create(kvq_backend_ctx *ctx, kvq_backend_seq **out, char *msg, size_t msg_size)
{
    (void)msg;
    (void)msg_size;
    kvq_backend_seq *s = kvq_calloc(1, sizeof *s);
    if (!s) return KVQ_ERR_NOMEM;
    s->n_layers = ctx->e.dims.layers;
    s->layers = kvq_calloc((size_t)s->n_layers, sizeof *s->layers);
    if (!s->layers) {
        kvq_free(s);
        return KVQ_ERR_NOMEM;
    }
    *out = s;
    return KVQ_OK;
}

void ref_seq_free(kvq_backend_ctx *ctx, kvq_backend_seq *s)
{
    (void)ctx;
    if (!s) return;
    for (int l = 0; l < s->n_layers; l++) layer_free(s->layers[l]);
    kvq_free(s->layers);
    kvq_free(s);
}

static int layer_length(const ref_layer *L) { return !L ? 0 : L->sparse ? L->s.length : L->q.length; }

int ref_seq_length(const kvq_backend_seq *s, int layer)
{
    if (!s || layer < 0 || layer >= s->n_layers) return 0;
    return layer_length(s->layers[layer]);
}

kvq_status ref_prefill(kvq_backend_ctx *ctx, int layer, const kvq_be_prefill *items, int n, char *msg,
                              size_t msg_size)
{
    const kvq_be_engine *e = &ctx->e;
    const kvq_layer_cfg *cfg = kvq_scheme_layer(e->scheme, layer);
    int sparse = e->layer_sparse[layer];
    ref_layer **built = kvq_calloc((size_t)n, sizeof *built);
    if (!built) {
        snprintf(msg, msg_size, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    kvq_status st = KVQ_OK;
    int i;
    for (i = 0; i < n && st == KVQ_OK; i++) {
        built[i] = kvq_calloc(1, sizeof **built);
        if (!built[i]) {
            st = KVQ_ERR_NOMEM;
            break;
        }
        st = sparse ? ref_slayer_prefill(built[i], e, &cfg->sparse, &items[i], msg, msg_size)
                    : ref_qlayer_prefill(built[i], e, layer, &cfg->quant, &items[i], msg, msg_size);
        if (st != KVQ_OK) {
            kvq_free(built[i]); /* the layer freed its own parts */
            built[i] = NULL;
            break;
        }
    }
    if (st != KVQ_OK) {
        for (int j = 0; j < n; j++) layer_free(built[j]);
        kvq_free(built);
        snprintf(msg, msg_size, "prefill item %d: %s", i, st == KVQ_ERR_NOMEM ? "out of memory" : kvq_status_str(st));
        return st;
    }
    for (i = 0; i < n; i++) items[i].seq->layers[layer] = built[i];
    kvq_free(built);
    return KVQ_OK;
}

static kvq_status ref_decode(kvq_backend_ctx *ctx, int layer, const kvq_be_decode *items, int n, char *msg,
                             size_t msg_size)
{
    (void)ctx;
    ref_reserve *res = kvq_calloc((size_t)n, sizeof *res);
    if (!res) {
        snprintf(msg, msg_size, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    kvq_status st = KVQ_OK;
    int i;
    for (i = 0; i < n && st == KVQ_OK; i++) {
        ref_layer *L = items[i].seq->layers[layer];
        st = L->sparse ? ref_slayer_reserve(&L->s, &res[i]) : ref_qlayer_reserve(&L->q, &res[i]);
    }
    if (st != KVQ_OK) {
        for (int j = 0; j < n; j++) ref_reserve_free(&res[j]);
        kvq_free(res);
        snprintf(msg, msg_size, "decode item %d: out of memory", i - 1);
        return st;
    }
    for (i = 0; i < n; i++) {
        ref_layer *L = items[i].seq->layers[layer];
        const kvq_be_decode *it = &items[i];
        kvq_status s2 = KVQ_OK;
        if (L->sparse)
            ref_slayer_step(&L->s, &res[i], it->k, it->v, it->q, it->out);
        else
            s2 = ref_qlayer_step(&L->q, &res[i], it->k, it->v, it->q, it->out);
        if (s2 != KVQ_OK && st == KVQ_OK) {
            st = s2;
            snprintf(msg, msg_size, "decode item %d: the cache broke an invariant (a token missing or counted twice)",
                     i);
        }
    }
    for (i = 0; i < n; i++) ref_reserve_free(&res[i]);
    kvq_free(res);
    return st;
}

void ref_seq_account(const kvq_backend_ctx *ctx, const kvq_backend_seq *s, kvq_mem_stats *out)
{
    (void)ctx;
    for (int l = 0; l < s->n_layers; l++) {
        const ref_layer *L = s->layers[l];
        if (!L) continue;
        if (L->sparse)
            ref_slayer_account(&L->s, out);
        else
            ref_qlayer_account(&L->q, out);
    }
}

kvq_status ref_read_cache(kvq_backend_ctx *ctx, const kvq_backend_seq *s, int layer, float *k, float *v,
                                 int capacity, int *n_tokens, char *msg, size_t msg_size)
{
    const ref_layer *L = s->layers[layer];
    int len = layer_length(L), D = ctx->e.dims.head_dim, H = ctx->e.dims.kv_heads;
    *n_tokens = len;
    if (capacity < len) {
        snprintf(msg, msg_size, "capacity %d is smaller than the %d tokens of layer %d", capacity, len, layer);
        return KVQ_ERR_INVALID;
    }
    if (!L) return KVQ_OK;
    if (L->sparse) {
        for (int h = 0; h < H; h++)
            ref_slayer_read(&L->s, h, k + (size_t)h * (size_t)capacity * (size_t)D,
                            v + (size_t)h * (size_t)capacity * (size_t)D);
        return KVQ_OK;
    }
    unsigned char *seen = kvq_malloc((size_t)len * 2);
    if (!seen) {
        snprintf(msg, msg_size, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    kvq_status st = KVQ_OK;
    for (int h = 0; h < H && st == KVQ_OK; h++)
        st = ref_qlayer_materialize(&L->q, h, k + (size_t)h * (size_t)capacity * (size_t)D,
                                    v + (size_t)h * (size_t)capacity * (size_t)D, seen);
    kvq_free(seen);
    if (st != KVQ_OK) snprintf(msg, msg_size, "layer %d: the cache broke an invariant (a token missing or twice)", layer);
    return st;
}

const kvq_backend kvq_backend_reference = {
    .name = "reference",
    .probe = ref_probe,
    .supports = ref_supports,
    .prepare = ref_prepare,
    .destroy = ref_destroy,
    .seq_create = ref_seq_create,
    .seq_free = ref_seq_free,
    .seq_length = ref_seq_length,
    .prefill = ref_prefill,
    .decode = ref_decode,
    .seq_account = ref_seq_account,
    .read_cache = ref_read_cache,
};
