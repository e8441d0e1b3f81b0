/* Reference backend storage: fp16 windows, outlier pools, quantized pages (layout.h) and the quantization of a
 * batch into a page. Every element goes through quant.h (fit, code, dequant, pack); nothing here rounds or
 * clamps on its own. */
#include <math.h>
#include <string.h>

#include "alloc.h"
#include "half.h"
#include "ref.h"

/* ------------------------------------------------------------------------------------------------ arena -- */

kvq_status ref_arena_init(ref_arena *a, size_t size)
{
    a->used = 0;
    a->size = size;
    a->base = size ? kvq_malloc(size) : NULL;
    return size && !a->base ? KVQ_ERR_NOMEM : KVQ_OK;
}

void ref_arena_free(ref_arena *a)
{
    kvq_free(a->base);
    a->base = NULL;
    a->size = a->used = 0;
}

void *ref_arena_take(ref_arena *a, size_t bytes)
{
    size_t n = ref_arena_need(bytes);
    /* The caller sized the arena from the same counts; running out is a bug in a *_scratch_bytes function. */
    if (n == 0 || a->used + n > a->size) return NULL;
    void *p = a->base + a->used;
    a->used += n;
    return p;
}

/* ---------------------------------------------------------------------------------------------- windows -- */

kvq_status ref_win_init(ref_win *w, int H, int D, int cap)
{
    memset(w, 0, sizeof *w);
    w->H = H;
    w->D = D;
    w->cap = cap;
    w->bytes = kvq_window_tensor_bytes(H, D, cap);
    if (cap == 0) return KVQ_OK;
    w->data = kvq_calloc(1, w->bytes);
    w->pos = kvq_malloc((size_t)cap * sizeof *w->pos);
    if (!w->data || !w->pos) {
        ref_win_free(w);
        return KVQ_ERR_NOMEM;
    }
    return KVQ_OK;
}

void ref_win_free(ref_win *w)
{
    kvq_free(w->data);
    kvq_free(w->pos);
    w->data = NULL;
    w->pos = NULL;
    w->count = 0;
}

void ref_win_push(ref_win *w, const float *x, size_t x_head_stride, int pos)
{
    int s = w->count++;
    for (int h = 0; h < w->H; h++)
        kvq_f16_from_f32_n(w->data + ((size_t)h * (size_t)w->cap + (size_t)s) * (size_t)w->D,
                           x + (size_t)h * x_head_stride, (size_t)w->D);
    w->pos[s] = pos;
}

void ref_win_read(const ref_win *w, int h, int slot, float *out)
{
    kvq_f32_from_f16_n(out, w->data + ((size_t)h * (size_t)w->cap + (size_t)slot) * (size_t)w->D, (size_t)w->D);
}

void ref_win_drop_front(ref_win *w, int n)
{
    /* Reference only: a window keeps arrival order by moving its tail down (a GPU backend would use a ring). */
    int rest = w->count - n;
    for (int h = 0; h < w->H; h++) {
        uint16_t *base = w->data + (size_t)h * (size_t)w->cap * (size_t)w->D;
        memmove(base, base + (size_t)n * (size_t)w->D, (size_t)rest * (size_t)w->D * sizeof *base);
    }
    memmove(w->pos, w->pos + n, (size_t)rest * sizeof *w->pos);
    w->count = rest;
}

/* ------------------------------------------------------------------------------------------------ pools -- */

kvq_status ref_pool_init(ref_pool *p, int H, int D, int cap)
{
    memset(p, 0, sizeof *p);
    p->H = H;
    p->D = D;
    p->cap = cap;
    p->bytes = kvq_window_bytes(H, D, cap);
    p->count = kvq_calloc((size_t)H, sizeof *p->count);
    if (!p->count) return KVQ_ERR_NOMEM;
    if (cap == 0) return KVQ_OK;
    /* One allocation of the accounted size: K at 0, V at the 16-byte-aligned half. */
    p->k = kvq_calloc(1, p->bytes);
    p->pos = kvq_malloc((size_t)H * (size_t)cap * sizeof *p->pos);
    p->score = kvq_malloc((size_t)H * (size_t)cap * sizeof *p->score);
    if (!p->k || !p->pos || !p->score) {
        ref_pool_free(p);
        return KVQ_ERR_NOMEM;
    }
    p->v = (uint16_t *)((uint8_t *)p->k + kvq_window_tensor_bytes(H, D, cap));
    return KVQ_OK;
}

void ref_pool_free(ref_pool *p)
{
    kvq_free(p->k);
    kvq_free(p->pos);
    kvq_free(p->score);
    kvq_free(p->count);
    memset(p, 0, sizeof *p);
}

/* ------------------------------------------------------------------------------------------------ pages -- */

int ref_page_appendable(const kvq_page_format *fmt)
{
    if (kvq_bits_is_fp16(fmt->bits)) return 1;
    return fmt->gran == KVQ_GRAN_TOKEN && !fmt->channel_separable;
}

kvq_status ref_page_new(const kvq_page_format *fmt, kvq_segment seg, ref_page **out)
{
    *out = NULL;
    ref_page *p = kvq_calloc(1, sizeof *p);
    if (!p) return KVQ_ERR_NOMEM;
    p->fmt = *fmt;
    kvq_page_layout_compute(fmt, &p->lay);
    p->seg = seg;
    if (fmt->format.kind != KVQ_FMT_INT && !kvq_bits_is_fp16(fmt->bits))
        kvq_format_levels(&fmt->format, fmt->bits, p->levels);
    p->mem = kvq_calloc(1, p->lay.total);
    p->pos = kvq_malloc((size_t)fmt->kv_heads * (size_t)fmt->capacity * sizeof *p->pos);
    if (!p->mem || !p->pos) {
        ref_page_free(p);
        return KVQ_ERR_NOMEM;
    }
    *out = p;
    return KVQ_OK;
}

void ref_page_free(ref_page *p)
{
    if (!p) return;
    kvq_free(p->mem);
    kvq_free(p->pos);
    kvq_free(p);
}

/* Parameters are stored in the scale dtype: fp16 as its bit pattern, fp32 as its bytes, little-endian both;
 * one-byte scales (nvfp4: e4m3, mxfp4: e8m0) by kvq_format_scale8_encode; 0 bytes: nothing stored. */
static void put_param8(const ref_page *p, uint8_t *sec, size_t i, int bytes, float v)
{
    if (bytes == 1) sec[i] = kvq_format_scale8_encode(p->fmt.format.kind, v);
}

static void put_param(uint8_t *sec, size_t i, int bytes, float v)
{
    if (bytes == 0 || bytes == 1) return; /* put_param8 */
    if (bytes == 2) {
        uint16_t h = kvq_f16_from_f32(v);
        sec[2 * i] = (uint8_t)h;
        sec[2 * i + 1] = (uint8_t)(h >> 8);
    } else {
        uint32_t u;
        memcpy(&u, &v, 4);
        for (int b = 0; b < 4; b++) sec[4 * i + (size_t)b] = (uint8_t)(u >> (8 * b));
    }
}

static float get_param(const uint8_t *sec, size_t i, int bytes)
{
    if (bytes == 0 || bytes == 1) return 0.0f; /* get_scale */
    if (bytes == 2) return kvq_f32_from_f16((uint16_t)(sec[2 * i] | sec[2 * i + 1] << 8));
    uint32_t u = 0;
    for (int b = 0; b < 4; b++) u |= (uint32_t)sec[4 * i + (size_t)b] << (8 * b);
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* A group's stored scale and zero, any element format: 1 where no scale is stored, 0 where no zero is. */
static void put_qparams(const ref_page *p, size_t idx, kvq_qparams qp)
{
    const kvq_page_format *f = &p->fmt;
    put_param(p->mem + p->lay.scale, idx, f->scale_bytes, qp.scale);
    put_param8(p, p->mem + p->lay.scale, idx, f->scale_bytes, qp.scale);
    put_param(p->mem + p->lay.zero, idx, f->zero_bytes, qp.zero);
}

static kvq_qparams get_qparams(const ref_page *p, size_t idx)
{
    const kvq_page_format *f = &p->fmt;
    kvq_qparams qp = {1.0f, 0.0f};
    if (f->scale_bytes == 1)
        qp.scale = kvq_format_scale8_decode(f->format.kind, p->mem[p->lay.scale + idx]);
    else if (f->scale_bytes)
        qp.scale = get_param(p->mem + p->lay.scale, idx, f->scale_bytes);
    if (f->zero_bytes) qp.zero = get_param(p->mem + p->lay.zero, idx, f->zero_bytes);
    return qp;
}

void ref_page_set_tscale(ref_page *p, const float *t)
{
    if (!p->lay.tscale_size) return;
    memcpy(p->mem + p->lay.tscale, t, (p->fmt.format.tensor_scale_per_head ? (size_t)p->fmt.kv_heads : 1) * sizeof *t);
}

static float page_tscale(const ref_page *p, int h)
{
    float t = 1.0f;
    if (p->lay.tscale_size)
        memcpy(&t, p->mem + p->lay.tscale + (p->fmt.format.tensor_scale_per_head ? (size_t)h * sizeof t : 0), sizeof t);
    return t;
}

static uint8_t *slot_codes(const ref_page *p, int h, int slot)
{
    return p->mem + p->lay.codes +
           ((size_t)h * (size_t)p->fmt.capacity + (size_t)slot) * p->lay.code_bytes_per_token;
}

static kvq_param_dtype sdt(const kvq_page_format *f) { return f->scale_bytes == 4 ? KVQ_DT_FP32 : KVQ_DT_FP16; }
static kvq_param_dtype zdt(const kvq_page_format *f) { return f->zero_bytes == 4 ? KVQ_DT_FP32 : KVQ_DT_FP16; }

/* fp16 values stored as they are (bits 16: no quantization). */
static void put_fp16_token(ref_page *p, int h, int slot, const float *x)
{
    uint8_t *dst = slot_codes(p, h, slot);
    for (int c = 0; c < p->fmt.head_dim; c++) {
        uint16_t v = kvq_f16_from_f32(x[c]);
        dst[2 * c] = (uint8_t)v;
        dst[2 * c + 1] = (uint8_t)(v >> 8);
    }
}

/* Per-token quantization of token `slot` for every head: x(h) is head h's [D] values. Groups of fmt.group
 * channels (KIVI values), or one group over every kv head (hidden), after dividing by the channel factors when
 * channel-separable (ZipCache Alg. 1: X_i / c_i, then TokenQuant). */
static void quant_token(ref_page *p, const float *x, size_t head_stride, int slot)
{
    const kvq_page_format *f = &p->fmt;
    int H = f->kv_heads, D = f->head_dim, bits = f->bits;
    uint8_t *scale = p->mem + p->lay.scale, *zero = p->mem + p->lay.zero, *factor = p->mem + p->lay.factor;
    float y[256];
    uint8_t codes[256];

    if (f->hidden) {
        /* One group over the token's H * D elements (the group hidden of ZipCache's accounting). */
        float mn = INFINITY, mx = -INFINITY;
        for (int h = 0; h < H; h++)
            for (int c = 0; c < D; c++) {
                float v = x[(size_t)h * head_stride + (size_t)c];
                if (f->channel_separable) v = v / get_param(factor, (size_t)h * (size_t)D + (size_t)c, f->scale_bytes);
                if (v < mn) mn = v;
                if (v > mx) mx = v;
            }
        kvq_qparams qp = kvq_qparams_fit(mn, mx, bits, sdt(f), zdt(f));
        put_param(scale, (size_t)slot, f->scale_bytes, qp.scale);
        put_param(zero, (size_t)slot, f->zero_bytes, qp.zero);
        for (int h = 0; h < H; h++) {
            for (int c = 0; c < D; c++) {
                float v = x[(size_t)h * head_stride + (size_t)c];
                if (f->channel_separable) v = v / get_param(factor, (size_t)h * (size_t)D + (size_t)c, f->scale_bytes);
                codes[c] = (uint8_t)kvq_quant_code(v, qp, bits);
            }
            kvq_pack_codes(codes, D, bits, slot_codes(p, h, slot));
        }
        return;
    }
    if (f->tq != KVQ_TQ_NONE) {
        /* TurboQuant Algorithms 1-2 on each part of the rotated head vector (one part, or the outlier split's
         * two): norm as the scale, residual norm as the zero, one entry per part */
        uint8_t signs[256];
        int ng = p->lay.n_groups;
        for (int h = 0; h < H; h++) {
            size_t idx = (size_t)h * (size_t)f->capacity + (size_t)slot, cb_off = 0;
            for (int j = 0; j < p->tq->n_parts; j++) {
                const kvq_tq *t = &p->tq->part[j];
                int off = p->tq->off[j];
                float norm, rnorm = 0;
                kvq_tq_quantize(t, x + (size_t)h * head_stride + off, codes, &norm, signs, &rnorm);
                put_param(scale, idx * (size_t)ng + (size_t)j, f->scale_bytes, norm);
                kvq_pack_codes(codes, t->D, t->mse_bits, slot_codes(p, h, slot) + cb_off);
                cb_off += kvq_code_bytes(t->D, t->mse_bits);
                if (f->tq != KVQ_TQ_PROD) continue;
                put_param(zero, idx * (size_t)ng + (size_t)j, f->zero_bytes, rnorm);
                kvq_pack_codes(signs, t->D, 1, p->mem + p->lay.qjl + idx * (size_t)(D / 8) + off / 8);
            }
        }
        return;
    }
    int G = f->group, ng = p->lay.n_groups;
    for (int h = 0; h < H; h++) {
        const float *xh = x + (size_t)h * head_stride;
        for (int c = 0; c < D; c++)
            y[c] = f->channel_separable ? xh[c] / get_param(factor, (size_t)h * (size_t)D + (size_t)c, f->scale_bytes)
                                        : xh[c];
        for (int g = 0; g < ng; g++) {
            size_t idx = ((size_t)h * (size_t)f->capacity + (size_t)slot) * (size_t)ng + (size_t)g;
            if (f->format.kind != KVQ_FMT_INT) {
                /* Element formats: the format's own rounding (quant.h); sema keeps them off hidden groups and
                 * channel factors. */
                put_qparams(p, idx, kvq_format_quantize_group(&f->format, bits, sdt(f), zdt(f), page_tscale(p, h),
                                                               y + g * G, (size_t)G, 1, codes + g * G));
                continue;
            }
            kvq_qparams qp = kvq_quantize_group(y + g * G, (size_t)G, 1, bits, sdt(f), zdt(f), codes + g * G);
            put_param(scale, idx, f->scale_bytes, qp.scale);
            put_param(zero, idx, f->zero_bytes, qp.zero);
        }
        kvq_pack_codes(codes, D, bits, slot_codes(p, h, slot));
    }
}

void ref_page_fill(ref_page *p, const float *x, size_t head_stride, const int *pos, size_t pos_stride)
{
    const kvq_page_format *f = &p->fmt;
    int H = f->kv_heads, D = f->head_dim, n = f->capacity, bits = f->bits;
    for (int h = 0; h < H; h++)
        for (int i = 0; i < n; i++) p->pos[h * n + i] = pos[(size_t)h * pos_stride + (size_t)i];
    p->count = n;

    if (kvq_bits_is_fp16(bits)) {
        for (int h = 0; h < H; h++)
            for (int i = 0; i < n; i++) put_fp16_token(p, h, i, x + (size_t)h * head_stride + (size_t)i * (size_t)D);
        return;
    }
    if (f->gran == KVQ_GRAN_CHANNEL) {
        /* KIVI keys: one group per (head, channel) over the page's tokens (the page is one group of G tokens). */
        kvq_qparams qp[256];
        uint8_t codes[256];
        for (int h = 0; h < H; h++) {
            const float *xh = x + (size_t)h * head_stride;
            for (int c = 0; c < D; c++) {
                float mn = xh[c], mx = xh[c];
                for (int i = 1; i < n; i++) {
                    float v = xh[(size_t)i * (size_t)D + (size_t)c];
                    if (v < mn) mn = v;
                    if (v > mx) mx = v;
                }
                if (f->format.kind != KVQ_FMT_INT) /* elementwise formats only (sema: the others are per token) */
                    qp[c] = kvq_format_fit(&f->format, bits, sdt(f), zdt(f), xh + c, (size_t)n, (size_t)D);
                else
                    qp[c] = kvq_qparams_fit(mn, mx, bits, sdt(f), zdt(f));
                put_qparams(p, (size_t)h * (size_t)D + (size_t)c, qp[c]);
            }
            for (int i = 0; i < n; i++) {
                for (int c = 0; c < D; c++)
                    codes[c] = f->format.kind != KVQ_FMT_INT
                                   ? kvq_format_code(&f->format, bits, xh[(size_t)i * (size_t)D + (size_t)c], qp[c],
                                                     page_tscale(p, h))
                                   : (uint8_t)kvq_quant_code(xh[(size_t)i * (size_t)D + (size_t)c], qp[c], bits);
                kvq_pack_codes(codes, D, bits, slot_codes(p, h, i));
            }
        }
        return;
    }
    if (f->channel_separable) {
        /* ZipCache Eq. 6: c_i = sqrt(max |X_i|) over the tokens being quantized (this batch), per kv head. */
        uint8_t *factor = p->mem + p->lay.factor;
        for (int h = 0; h < H; h++) {
            const float *xh = x + (size_t)h * head_stride;
            for (int c = 0; c < D; c++) {
                float am = 0.0f;
                for (int i = 0; i < n; i++) {
                    float a = fabsf(xh[(size_t)i * (size_t)D + (size_t)c]);
                    if (a > am) am = a;
                }
                put_param(factor, (size_t)h * (size_t)D + (size_t)c, f->scale_bytes, kvq_channel_factor(am, sdt(f)));
            }
        }
    }
    for (int i = 0; i < n; i++) quant_token(p, x + (size_t)i * (size_t)D, head_stride, i);
}

void ref_page_append(ref_page *p, const float *x, int pos)
{
    int H = p->fmt.kv_heads, D = p->fmt.head_dim, s = p->count++;
    for (int h = 0; h < H; h++) p->pos[h * p->fmt.capacity + s] = pos;
    if (kvq_bits_is_fp16(p->fmt.bits)) {
        for (int h = 0; h < H; h++) put_fp16_token(p, h, s, x + (size_t)h * (size_t)D);
        return;
    }
    quant_token(p, x, (size_t)D, s);
}

void ref_page_read(const ref_page *p, int h, int slot, float *out)
{
    const kvq_page_format *f = &p->fmt;
    int D = f->head_dim, bits = f->bits;
    const uint8_t *src = slot_codes(p, h, slot);
    if (kvq_bits_is_fp16(bits)) {
        for (int c = 0; c < D; c++) out[c] = kvq_f32_from_f16((uint16_t)(src[2 * c] | src[2 * c + 1] << 8));
        return;
    }
    const uint8_t *scale = p->mem + p->lay.scale, *zero = p->mem + p->lay.zero, *factor = p->mem + p->lay.factor;
    uint8_t codes[256];
    if (f->tq != KVQ_TQ_NONE) {
        /* TurboQuant's dequantization: the prod key's q.k is Algorithm 2's unbiased estimate */
        uint8_t signs[256];
        size_t idx = (size_t)h * (size_t)f->capacity + (size_t)slot, cb_off = 0;
        int ng = p->lay.n_groups;
        for (int j = 0; j < p->tq->n_parts; j++) {
            const kvq_tq *t = &p->tq->part[j];
            int off = p->tq->off[j];
            kvq_unpack_codes(src + cb_off, t->D, t->mse_bits, codes);
            cb_off += kvq_code_bytes(t->D, t->mse_bits);
            float norm = get_param(scale, idx * (size_t)ng + (size_t)j, f->scale_bytes), rnorm = 0;
            if (f->tq == KVQ_TQ_PROD) {
                rnorm = get_param(zero, idx * (size_t)ng + (size_t)j, f->zero_bytes);
                kvq_unpack_codes(p->mem + p->lay.qjl + idx * (size_t)(D / 8) + off / 8, t->D, 1, signs);
            }
            kvq_tq_dequant(t, codes, norm, signs, rnorm, out + off);
        }
        return;
    }
    kvq_unpack_codes(src, D, bits, codes);
    for (int c = 0; c < D; c++) {
        size_t idx;
        if (f->gran == KVQ_GRAN_CHANNEL)
            idx = (size_t)h * (size_t)D + (size_t)c;
        else if (f->hidden)
            idx = (size_t)slot;
        else
            idx = ((size_t)h * (size_t)f->capacity + (size_t)slot) * (size_t)p->lay.n_groups + (size_t)(c / f->group);
        float r;
        if (f->format.kind != KVQ_FMT_INT) {
            /* x = z + (s * T) * L[code] (scheme_format.h) */
            r = kvq_format_dequant(p->levels[codes[c]], get_qparams(p, idx), page_tscale(p, h));
        } else {
            kvq_qparams qp = {get_param(scale, idx, f->scale_bytes), get_param(zero, idx, f->zero_bytes)};
            r = kvq_dequant(codes[c], qp);
        }
        /* ZipCache Alg. 1: multiply the channel factor back (one fp32 multiply after dequantization). */
        if (f->channel_separable) r = r * get_param(factor, (size_t)h * (size_t)D + (size_t)c, f->scale_bytes);
        out[c] = r;
    }
}

int ref_page_masked(const ref_page *p, int h, int slot)
{
    if (!p->fmt.masked) return 0;
    size_t row = (size_t)(p->fmt.capacity + 7) / 8;
    return (p->mem[p->lay.mask + (size_t)h * row + (size_t)slot / 8] >> (slot % 8)) & 1;
}

void ref_page_set_mask(ref_page *p, int h, int slot, int on)
{
    size_t row = (size_t)(p->fmt.capacity + 7) / 8;
    uint8_t *b = &p->mem[p->lay.mask + (size_t)h * row + (size_t)slot / 8];
    if (on)
        *b = (uint8_t)(*b | (1u << (slot % 8)));
    else
        *b = (uint8_t)(*b & ~(1u << (slot % 8)));
}

kvq_status ref_pages_reserve(ref_pages *l, int extra)
{
    if (l->n + extra <= l->cap) return KVQ_OK;
    int cap = l->cap ? l->cap : 8;
    while (cap < l->n + extra) cap *= 2;
    ref_page **v = kvq_realloc(l->v, (size_t)cap * sizeof *v);
    if (!v) return KVQ_ERR_NOMEM;
    l->v = v;
    l->cap = cap;
    return KVQ_OK;
}

void ref_pages_free(ref_pages *l)
{
    for (int i = 0; i < l->n; i++) ref_page_free(l->v[i]);
    kvq_free(l->v);
    memset(l, 0, sizeof *l);
}

int ref_class_split(const kvq_tensor_cfg *t, int count, int *caps)
{
    int n = 0;
    while (count > 0) {
        int cap = kvq_flush_page_tokens(t, count);
        if (caps) caps[n] = cap;
        n++;
        count -= cap;
    }
    return n;
}

void ref_reserve_free(ref_reserve *r)
{
    for (int i = r->used_pages; i < r->n_pages; i++) ref_page_free(r->pages[i]);
    kvq_free(r->pages);
    ref_win_free(&r->gen[0]);
    ref_win_free(&r->gen[1]);
    ref_arena_free(&r->arena);
    memset(r, 0, sizeof *r);
}
