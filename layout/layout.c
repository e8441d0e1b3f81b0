/* The page layout and streaming rules: see layout.h and docs/layout.md. */
#include "layout.h"

#include "policy.h"
#include "quant.h"

size_t kvq_code_bytes(int head_dim, int bits)
{
    if (kvq_bits_is_fp16(bits)) return (size_t)head_dim * 2;
    /* b = 3 is a 2-bit plane plus a 1-bit plane: exactly 3 bits per code as well. */
    return (size_t)head_dim * (size_t)bits / 8;
}

void kvq_page_format_init(kvq_page_format *fmt, const kvq_tensor_cfg *t, int bits, int masked, int kv_heads,
                          int head_dim, int capacity)
{
    fmt->format = t->format;
    fmt->bits = kvq_bits_is_fp16(bits) ? bits : kvq_format_code_bits(&t->format, bits);
    fmt->gran = t->gran;
    fmt->channel_separable = t->gran == KVQ_GRAN_TOKEN && t->channel_separable;
    fmt->hidden = t->gran == KVQ_GRAN_TOKEN && t->group == KVQ_GROUP_HIDDEN;
    if (t->gran == KVQ_GRAN_TOKEN)
        fmt->group = fmt->hidden ? 0 : (t->group > 0 ? t->group : head_dim);
    else
        fmt->group = t->group > 0 ? t->group : capacity;
    fmt->masked = masked;
    fmt->scale_bytes = kvq_format_scale_bytes(t->format.kind, t->scale_dtype);
    fmt->zero_bytes = kvq_format_zero_bytes(t->format.kind, t->zero_dtype);
    fmt->kv_heads = kv_heads;
    fmt->head_dim = head_dim;
    fmt->capacity = capacity;
    fmt->tq = kvq_bits_is_fp16(bits) ? KVQ_TQ_NONE : t->turboquant;
    fmt->tq_out = fmt->tq != KVQ_TQ_NONE ? t->tq_outliers : 0;
    fmt->tq_out_bits = fmt->tq_out ? t->tq_outlier_bits : 0;
    if (fmt->tq != KVQ_TQ_NONE) {
        /* One group of the head; norms fp32: a head vector's norm can pass fp16's range where its elements do not */
        fmt->group = head_dim;
        fmt->scale_bytes = fmt->zero_bytes = 4;
    }
}

void kvq_page_layout_compute(const kvq_page_format *f, kvq_page_layout *o)
{
    size_t H = (size_t)f->kv_heads, D = (size_t)f->head_dim, cap = (size_t)f->capacity;
    size_t off = 0;
    int quantized = !kvq_bits_is_fp16(f->bits);

    int qjl = f->tq == KVQ_TQ_PROD; /* prod spends one bit of each part on its QJL sign */
    o->code_bytes_per_token = kvq_code_bytes(f->head_dim - f->tq_out, f->bits - qjl);
    if (f->tq_out) o->code_bytes_per_token += kvq_code_bytes(f->tq_out, f->tq_out_bits - qjl);
    o->n_groups = 0;
    o->codes = off;
    o->codes_size = kvq_align16(H * cap * o->code_bytes_per_token);
    off += o->codes_size;

    size_t n_scale = 0, n_zero = 0;
    if (quantized) {
        if (f->gran == KVQ_GRAN_CHANNEL) {
            n_scale = n_zero = H * D;
        } else if (f->hidden) {
            o->n_groups = 1;
            n_scale = n_zero = cap;
        } else {
            o->n_groups = f->tq_out ? 2 : (int)(D / (size_t)f->group); /* TurboQuant split: a norm per part */
            n_scale = n_zero = H * cap * (size_t)o->n_groups;
        }
        if (f->tq == KVQ_TQ_MSE) n_zero = 0; /* the norm only */
    }
    o->scale = off;
    o->scale_size = kvq_align16(n_scale * (size_t)f->scale_bytes);
    off += o->scale_size;
    o->zero = off;
    o->zero_size = kvq_align16(n_zero * (size_t)f->zero_bytes);
    off += o->zero_size;

    o->factor = off;
    o->factor_size = quantized && f->channel_separable ? kvq_align16(H * D * (size_t)f->scale_bytes) : 0;
    off += o->factor_size;

    o->qjl = off;
    o->qjl_size = f->tq == KVQ_TQ_PROD ? kvq_align16(H * cap * D / 8) : 0;
    off += o->qjl_size;

    o->mask = off;
    o->mask_size = f->masked ? kvq_align16(H * ((cap + 7) / 8)) : 0;
    off += o->mask_size;
    o->tscale = off;
    o->tscale_size = quantized && kvq_format_has_tensor_scale(f->format.kind)
                         ? kvq_align16(4 * (f->format.tensor_scale_per_head ? H : 1))
                         : 0;
    off += o->tscale_size;
    o->total = off;
}

size_t kvq_page_channel_param_bytes(const kvq_page_layout *lay, const kvq_page_format *fmt)
{
    size_t n = lay->factor_size;
    if (fmt->gran == KVQ_GRAN_CHANNEL) n += lay->scale_size + lay->zero_size;
    return n;
}

void kvq_window_rule_of(const kvq_quant_cfg *q, int which, kvq_window_rule *r)
{
    const kvq_tensor_cfg *t = which == 0 ? &q->key : &q->value;
    int R = q->residual;

    if (q->saliency.metric != KVQ_SAL_NONE) {
        /* ZipCache Alg. 2-3: the prompt is quantized whole; decoded tokens wait in fp16 and are compressed
         * every `interval` tokens (past the optional residual window). */
        r->keep = R;
        r->batch = q->saliency.interval;
        r->prefill_multiple = 1;
    } else if (q->flush == KVQ_FLUSH_GROUP) {
        /* OTT Sec. 3.2: K and V quantized together every G steps; sema guarantees keys per channel with G > 0. */
        int G = q->key.gran == KVQ_GRAN_CHANNEL && q->key.group > 0 ? q->key.group : 1;
        r->keep = R;
        r->batch = G;
        r->prefill_multiple = G;
    } else if (t->gran == KVQ_GRAN_CHANNEL) {
        /* KIVI Alg. 1, keys: collected in the window and quantized R at a time when it holds R (G at a time
         * without a window: a per-channel group needs G tokens). Prefill leaves l mod R tokens. */
        int G = t->group > 0 ? t->group : 1;
        int B = R > 0 ? R : G;
        r->keep = 0;
        r->batch = B;
        r->prefill_multiple = B;
    } else {
        /* KIVI Alg. 1, values: quantized one token at a time as they leave a window of R. */
        r->keep = R;
        r->batch = 1;
        r->prefill_multiple = 1;
    }
    if (kvq_bits_is_fp16(t->bits) && q->saliency.metric == KVQ_SAL_NONE) {
        /* Nothing to quantize: tokens go straight into fp16 pages, no window. */
        r->keep = 0;
        r->batch = 1;
        r->prefill_multiple = 1;
    }
    /* A token flushed as soon as it arrives needs no window: it is written straight into an appendable page. */
    r->capacity = r->keep == 0 && r->batch == 1 ? 0 : r->keep + r->batch;
}

int kvq_window_prefill_quantized(const kvq_window_rule *r, int n)
{
    if (n <= r->keep) return 0;
    int q = n - r->keep;
    return q - q % r->prefill_multiple;
}

int kvq_saliency_high_count(const kvq_saliency_cfg *s, int n)
{
    if (s->metric == KVQ_SAL_NONE) return n;
    return kvq_frac_round(s->salient, n); /* the one rounding of "fraction of n" (policy.h) */
}

int kvq_channel_group_tokens(const kvq_tensor_cfg *t, int n) { return t->group > 0 ? t->group : n; }

int kvq_flush_page_tokens(const kvq_tensor_cfg *t, int remaining)
{
    /* bits 16 is not quantized: no group to cut at, whatever the granularity says (the default key is per channel,
     * group 32: a prefill of fp16 keys in 32-token pages read, per kv head, 1/H of each page and jumped) */
    int cap = t->gran == KVQ_GRAN_CHANNEL && !kvq_bits_is_fp16(t->bits) ? kvq_channel_group_tokens(t, remaining)
                                                                        : remaining;
    return cap < remaining ? cap : remaining;
}

int kvq_append_page_tokens(int first, int sinks)
{
    int off = first - sinks;
    if (off < 0) off = 0;
    return KVQ_APPEND_ALIGN - off % KVQ_APPEND_ALIGN;
}
