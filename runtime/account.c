/* Memory accounting: the bytes the runtime allocates for a cache after a prefill of `seq` tokens, by segment.
 * Built only from the layout (layout.h) and the streaming rules, which the runtime uses to allocate, so the two
 * agree byte for byte (tests/unit/test_account_runtime.c checks it). Counts are allocated bytes: fp16 windows
 * and pools at their capacity, pages at theirs. */
#include <stdint.h>
#include <string.h>

#include "kvq.h"
#include "layout.h"
#include "scheme.h"

static const char *const seg_names[KVQ_SEG_COUNT] = {
    "sinks", "body_high", "body_low", "params", "outlier_pool", "spill_pool", "residual", "sparse_local", "host",
};

const char *kvq_segment_name(kvq_segment seg)
{
    return (unsigned)seg < KVQ_SEG_COUNT ? seg_names[seg] : "?";
}

/* Byte and token counts in checked 64-bit arithmetic: any step that would pass 2^63 - 1 sets `overflow`, and
 * kvq_scheme_account then refuses the request instead of printing a wrapped number (issue 12: "device total 0"
 * at the CLI's largest dims). */
#define ACCT_MAX ((uint64_t)INT64_MAX)
typedef struct {
    int overflow;
} acct_guard;

static uint64_t cmul(acct_guard *g, uint64_t a, uint64_t b)
{
    uint64_t r;
    if (__builtin_mul_overflow(a, b, &r) || r > ACCT_MAX) {
        g->overflow = 1;
        return 0;
    }
    return r;
}

static uint64_t cadd(acct_guard *g, uint64_t a, uint64_t b)
{
    uint64_t r;
    if (__builtin_add_overflow(a, b, &r) || r > ACCT_MAX) {
        g->overflow = 1;
        return 0;
    }
    return r;
}

/* Bytes of one sequence's layer, split into what is per sequence and what ZipCache's accounting shares. */
typedef struct {
    uint64_t bytes[KVQ_SEG_COUNT];
    uint64_t tokens[KVQ_SEG_COUNT];
    uint64_t shared_params; /* part of bytes[KVQ_SEG_PARAMS] that is per-channel metadata */
} layer_acct;

/* `n` pages of capacity `cap` (all alike). */
static void account_pages(acct_guard *g, layer_acct *a, const kvq_tensor_cfg *t, int bits, int masked, int H, int D,
                          int cap, uint64_t n, kvq_segment code_seg)
{
    if (!n || cap <= 0) return;
    kvq_page_format fmt;
    kvq_page_layout lay;
    kvq_page_format_init(&fmt, t, bits, masked, H, D, cap);
    kvq_page_layout_compute(&fmt, &lay);
    /* codes: the code planes and TurboQuant's QJL sign bits (one of the prod variant's b bits) */
    a->bytes[code_seg] = cadd(g, a->bytes[code_seg], cmul(g, n, lay.codes_size + lay.qjl_size));
    a->tokens[code_seg] = cadd(g, a->tokens[code_seg], cmul(g, n, (uint64_t)cap * (uint64_t)H));
    a->bytes[KVQ_SEG_PARAMS] = cadd(g, a->bytes[KVQ_SEG_PARAMS], cmul(g, n, lay.total - lay.codes_size - lay.qjl_size));
    a->shared_params = cadd(g, a->shared_params, cmul(g, n, kvq_page_channel_param_bytes(&lay, &fmt)));
}

/* The pages of one flush class of `count` tokens of tensor `t`, in closed form from kvq_flush_page_tokens (the
 * rule the backends' page writes follow): count / c pages of c tokens and one of count % c. (A loop over pages
 * took 62 s at group 1, 4096 layers and a million tokens.) */
static void account_class(acct_guard *g, layer_acct *a, const kvq_tensor_cfg *t, int bits, int masked, int H, int D,
                          int count, kvq_segment code_seg)
{
    if (count <= 0) return;
    int cap = kvq_flush_page_tokens(t, count);
    account_pages(g, a, t, bits, masked, H, D, cap, (uint64_t)(count / cap), code_seg);
    account_pages(g, a, t, bits, masked, H, D, count % cap, 1, code_seg);
}

static void account_quant_layer(acct_guard *g, layer_acct *a, const kvq_quant_cfg *q, int H, int D, int T)
{
    int S = T < q->sinks ? T : q->sinks;
    a->bytes[KVQ_SEG_SINK] += kvq_window_bytes(H, D, q->sinks);
    a->tokens[KVQ_SEG_SINK] += 2 * (uint64_t)S * (uint64_t)H;
    int n = T - S;
    int pooled = 0;

    for (int which = 0; which < 2; which++) {
        const kvq_tensor_cfg *t = which == 0 ? &q->key : &q->value;
        kvq_window_rule rule;
        kvq_window_rule_of(q, which, &rule);
        int quantized = kvq_window_prefill_quantized(&rule, n);
        a->bytes[KVQ_SEG_RESIDUAL] += kvq_window_tensor_bytes(H, D, rule.capacity);
        a->tokens[KVQ_SEG_RESIDUAL] += (uint64_t)(n - quantized) * (uint64_t)H;

        int masked = which == 0 && q->outliers.keep > 0;
        if (q->saliency.metric != KVQ_SAL_NONE) {
            int high = kvq_saliency_high_count(&q->saliency, quantized);
            account_class(g, a, t, q->saliency.high_bits, masked, H, D, high, KVQ_SEG_BODY_HIGH);
            account_class(g, a, t, q->saliency.low_bits, masked, H, D, quantized - high, KVQ_SEG_BODY_LOW);
        } else {
            account_class(g, a, t, t->bits, masked, H, D, quantized, KVQ_SEG_BODY_HIGH);
        }
        if (which == 0) pooled = quantized < q->outliers.keep ? quantized : q->outliers.keep;
        /* TurboQuant's outlier split: the sequence's channel selection, a head_dim-bit mask per kv head, chosen
         * from the prompt (rt_rotate.c) */
        if (T > 0 && !kvq_bits_is_fp16(t->bits) && t->turboquant != KVQ_TQ_NONE && t->tq_outliers > 0)
            a->bytes[KVQ_SEG_PARAMS] += (uint64_t)H * (uint64_t)(D / 8);
    }

    if (q->outliers.keep > 0) {
        /* The prefill is one quantization step: a single competition fills the pool, nothing spills yet. */
        a->bytes[KVQ_SEG_OUTLIER] += kvq_window_bytes(H, D, q->outliers.keep);
        a->tokens[KVQ_SEG_OUTLIER] += 2 * (uint64_t)pooled * (uint64_t)H;
        a->bytes[KVQ_SEG_SPILL] += kvq_window_bytes(H, D, q->outliers.spill);
    }
}

static void account_sparse_layer(layer_acct *a, const kvq_sparse_cfg *sp, int H, int D, int T)
{
    /* TailorKV Sec. 4.3: every token fp16 in host memory; the device keeps sinks + recent (generated tokens
     * join them during decode). */
    int local_cap = sp->sinks + sp->recent;
    int local = T < local_cap ? T : local_cap;
    a->bytes[KVQ_SEG_HOST] += kvq_window_bytes(H, D, T);
    a->tokens[KVQ_SEG_HOST] += 2 * (uint64_t)T * (uint64_t)H;
    a->bytes[KVQ_SEG_SPARSE_LOCAL] += kvq_window_bytes(H, D, local_cap);
    a->tokens[KVQ_SEG_SPARSE_LOCAL] += 2 * (uint64_t)local * (uint64_t)H;
}

kvq_status kvq_scheme_account(const kvq_scheme *s, const kvq_dims *d, int batch, int seq,
                              const kvq_account_opts *opts, kvq_mem_stats *out)
{
    if (!s || !d || !out) return KVQ_ERR_INVALID;
    memset(out, 0, sizeof *out);
    if (batch <= 0 || seq < 0) return KVQ_ERR_INVALID;
    kvq_status st = kvq_scheme_check_dims(s, d, NULL, 0);
    if (st != KVQ_OK) return st;
    int share = opts && opts->share_channel_params_across_batch;
    acct_guard g = {0};
    kvq_mem_stats m;
    memset(&m, 0, sizeof m);

    /* Per layer: O(1) each (closed-form page counts). Within one layer every figure fits 64 bits: the dims are
     * capped by kvq_scheme_check_dims (4096 kv heads, head_dim 256) and seq < 2^31, so a window or a page is
     * below 2^53 bytes; products with the batch and the sums over layers are checked. */
    for (int l = 0; l < d->layers && !g.overflow; l++) {
        const kvq_layer_cfg *cfg = kvq_scheme_layer(s, l);
        int sparse = cfg->mode == KVQ_MODE_SPARSE ||
                     (cfg->mode == KVQ_MODE_AUTO && opts && opts->auto_sparse && opts->auto_sparse[l]);
        layer_acct a;
        memset(&a, 0, sizeof a);
        if (sparse)
            account_sparse_layer(&a, &cfg->sparse, d->kv_heads, d->head_dim, seq);
        else
            account_quant_layer(&g, &a, &cfg->quant, d->kv_heads, d->head_dim, seq);
        for (int k = 0; k < KVQ_SEG_COUNT; k++) {
            uint64_t b = a.bytes[k];
            if (k == KVQ_SEG_PARAMS && share) {
                /* Per-channel metadata once for the whole batch, as ZipCache Appendix A counts it. */
                m.bytes[k] = cadd(&g, m.bytes[k], cadd(&g, cmul(&g, b - a.shared_params, (uint64_t)batch), a.shared_params));
            } else {
                m.bytes[k] = cadd(&g, m.bytes[k], cmul(&g, b, (uint64_t)batch));
            }
            m.tokens[k] = cadd(&g, m.tokens[k], cmul(&g, a.tokens[k], (uint64_t)batch));
        }
    }
    for (int k = 0; k < KVQ_SEG_COUNT; k++)
        if (k != KVQ_SEG_HOST) m.device_bytes = cadd(&g, m.device_bytes, m.bytes[k]);
    uint64_t elems = cmul(&g, cmul(&g, cmul(&g, (uint64_t)d->layers, (uint64_t)batch), (uint64_t)d->kv_heads),
                          cmul(&g, (uint64_t)seq, (uint64_t)d->head_dim * 2));
    m.fp16_bytes = cmul(&g, elems, 2);
    if (g.overflow) return KVQ_ERR_INVALID; /* *out stays zeroed */
    m.effective_bits = elems ? (double)m.device_bytes * 8.0 / (double)elems : 0.0;
    m.compression_ratio = m.device_bytes ? (double)m.fp16_bytes / (double)m.device_bytes : 0.0;
    *out = m;
    return KVQ_OK;
}
