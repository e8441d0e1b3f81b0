/* The engine's input policy (docs/runtime.md, "Non-finite and out-of-range input"): every K and V element must
 * be finite and within fp16's range (|x| <= 65504: the cache stores fp16 before anything else), every Q element
 * finite, and each query row's logits must fit fp32 with room to spare. A call with one bad element is refused
 * whole with KVQ_ERR_INVALID and a message that names the element; nothing is stored. The check runs on the fp32
 * arrays the backends receive, so every backend answers the same. */
#include <math.h>

#include "half.h"
#include "rt_internal.h"

/* fp16's largest finite value (base/half.h rounds anything at or beyond 65520 to inf). */
#define RT_KV_MAX 65504.0f
/* A query row is refused when softmax_scale * sum_c |q_c| exceeds this: then a logit against keys of at most
 * 65504 could pass 2^112, and a backend that forms logits in fp32 (or folds per-channel scales into the query,
 * a further factor below 2^16) could overflow to inf and produce inf - inf in its softmax. 2^96 ~ 7.9e28: no
 * model's queries come near it. */
#define RT_Q_L1_MAX 79228162514264337593543950336.0 /* 2^96 */

/* "kvq_prefill: item 1, layer 3: k[kv head 0][token 17][channel 5] = inf ..." */
static kvq_status refuse(kvq_engine *e, const char *fn, int item, int layer, const char *tensor, const char *head,
                         int h, int token, int c, float x, const char *why)
{
    return rt_error(e, KVQ_ERR_INVALID,
                    "%s: item %d (sequence %d of the batch), layer %d: %s[%s %d][token %d][channel %d] = %g %s; "
                    "nothing was stored",
                    fn, item, item, layer, tensor, head, h, token, c, (double)x, why);
}

/* K or V rows [kv_heads][n_tokens][D], fp32 (x32) or fp16 bits (x16): the first element the cache cannot hold. An
 * fp16 element can only be non-finite (exponent all ones); every finite one fits. */
static kvq_status check_kv(kvq_engine *e, const char *fn, int item, int layer, const char *tensor, const float *x32,
                           const uint16_t *x16, int n_tokens, int pos0)
{
    const kvq_dims *d = &e->cfg.dims;
    size_t D = (size_t)d->head_dim, n = (size_t)n_tokens;
    for (int h = 0; h < d->kv_heads; h++)
        for (size_t t = 0; t < n; t++) {
            size_t row = ((size_t)h * n + t) * D;
            for (size_t c = 0; c < D; c++) {
                if (x16 ? (x16[row + c] & 0x7c00u) != 0x7c00u : fabsf(x32[row + c]) <= RT_KV_MAX)
                    continue; /* the fp32 test is false for NaN too */
                float v = x16 ? kvq_f32_from_f16(x16[row + c]) : x32[row + c];
                return refuse(e, fn, item, layer, tensor, "kv head", h, pos0 + (int)t, (int)c, v,
                              isnan(v) || isinf(v) ? "is not finite"
                                                   : "is beyond fp16's range (|x| <= 65504; the cache stores fp16)");
            }
        }
    return KVQ_OK;
}

kvq_status rt_check_kv(kvq_engine *e, const char *fn, int item, int layer, const char *tensor, const float *x,
                       int n_tokens, int pos0)
{
    return check_kv(e, fn, item, layer, tensor, x, NULL, n_tokens, pos0);
}

kvq_status rt_check_kv16(kvq_engine *e, const char *fn, int item, int layer, const char *tensor, const uint16_t *x,
                         int n_tokens, int pos0)
{
    return check_kv(e, fn, item, layer, tensor, NULL, x, n_tokens, pos0);
}

kvq_status rt_check_q(kvq_engine *e, const char *fn, int item, int layer, const float *q, int n_tokens, int pos0)
{
    const kvq_dims *d = &e->cfg.dims;
    size_t D = (size_t)d->head_dim, n = (size_t)n_tokens;
    double scale = (double)e->bee.softmax_scale;
    for (int h = 0; h < d->heads; h++)
        for (size_t t = 0; t < n; t++) {
            const float *row = q + ((size_t)h * n + t) * D;
            double l1 = 0;
            size_t big = 0;
            for (size_t c = 0; c < D; c++) {
                float v = row[c];
                if (!isfinite(v)) return refuse(e, fn, item, layer, "q", "head", h, pos0 + (int)t, (int)c, v, "is not finite");
                l1 += fabs((double)v);
                if (fabsf(v) > fabsf(row[big])) big = c;
            }
            if (l1 * scale > RT_Q_L1_MAX)
                return refuse(e, fn, item, layer, "q", "head", h, pos0 + (int)t, (int)big, row[big],
                              "makes the row's logits too large (softmax_scale * sum |q| must be <= 2^96)");
        }
    return KVQ_OK;
}
