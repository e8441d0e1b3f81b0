/* The quantizer: see quant.h for the rules. */
#include "quant.h"

#include <math.h>
#include <string.h>

#include "half.h"
#include "minifloat.h"

float kvq_param_round(float x, kvq_param_dtype dt)
{
    return dt == KVQ_DT_FP32 ? x : kvq_f16_round(x);
}

/* fp16 neighbours by stepping the bit pattern: ordered for positive values, reversed for negative ones. */
static float f16_step(float r, int up)
{
    uint16_t h = kvq_f16_from_f32(r);
    int neg = (h & 0x8000) != 0;
    if ((h & 0x7fff) == 0) return up ? kvq_f32_from_f16(0x0001) : kvq_f32_from_f16(0x8001);
    if (up != neg)
        h = (uint16_t)(h + 1);
    else
        h = (uint16_t)(h - 1);
    return kvq_f32_from_f16(h);
}

float kvq_param_round_down(float x, kvq_param_dtype dt)
{
    if (dt == KVQ_DT_FP32 || !isfinite(x)) return x;
    float r = kvq_f16_round(x);
    if (r > x) r = f16_step(r, 0);
    return r;
}

float kvq_param_round_up(float x, kvq_param_dtype dt)
{
    if (dt == KVQ_DT_FP32 || !isfinite(x)) return x;
    float r = kvq_f16_round(x);
    if (r < x) r = f16_step(r, 1);
    return r;
}

kvq_qparams kvq_qparams_fit(float min, float max, int bits, kvq_param_dtype scale_dt, kvq_param_dtype zero_dt)
{
    kvq_qparams p;
    float L = (float)((1u << bits) - 1u);
    p.zero = kvq_param_round_down(min, zero_dt);
    if (max <= p.zero) {
        p.scale = 0.0f; /* constant group whose value the zero holds exactly */
        return p;
    }
    p.scale = kvq_param_round_up((max - p.zero) / L, scale_dt);
    /* An fp16 scale saturates at 65504 rather than becoming inf (quant.h): only 1-bit groups of inputs within
     * fp16's range (the engine's policy) get here, and their error stays within the exact step's bound. */
    if (scale_dt == KVQ_DT_FP16 && p.scale > KVQ_PARAM_F16_MAX) p.scale = KVQ_PARAM_F16_MAX;
    return p;
}

float kvq_channel_factor(float absmax, kvq_param_dtype dt)
{
    if (!(absmax > 0.0f)) return 1.0f;
    float c = kvq_param_round(sqrtf(absmax), dt);
    return c > 0.0f ? c : 1.0f;
}

/* One plane: codes of `width` bits (1, 2, 4 or 8) taken from bit `shift` of each code. */
static void pack_plane(const uint8_t *codes, int n, int width, int shift, uint8_t *dst)
{
    int per_word = 32 / width;
    uint32_t mask = (1u << width) - 1u;
    for (int w = 0; w < n / per_word; w++) {
        uint32_t word = 0;
        for (int k = 0; k < per_word; k++)
            word |= ((uint32_t)(codes[w * per_word + k] >> shift) & mask) << (k * width);
        /* Little-endian bytes regardless of the host's order. */
        dst[4 * w + 0] = (uint8_t)word;
        dst[4 * w + 1] = (uint8_t)(word >> 8);
        dst[4 * w + 2] = (uint8_t)(word >> 16);
        dst[4 * w + 3] = (uint8_t)(word >> 24);
    }
}

static void unpack_plane(const uint8_t *src, int n, int width, int shift, uint8_t *codes)
{
    int per_word = 32 / width;
    uint32_t mask = (1u << width) - 1u;
    for (int w = 0; w < n / per_word; w++) {
        uint32_t word = (uint32_t)src[4 * w] | (uint32_t)src[4 * w + 1] << 8 | (uint32_t)src[4 * w + 2] << 16 |
                        (uint32_t)src[4 * w + 3] << 24;
        for (int k = 0; k < per_word; k++)
            codes[w * per_word + k] |= (uint8_t)(((word >> (k * width)) & mask) << shift);
    }
}

void kvq_pack_codes(const uint8_t *codes, int head_dim, int bits, uint8_t *dst)
{
    if (bits == 3) {
        pack_plane(codes, head_dim, 2, 0, dst);
        pack_plane(codes, head_dim, 1, 2, dst + head_dim / 4);
    } else if (bits == 5) {
        /* A 4-bit plane (D/2 bytes) and the high bits as a 1-bit plane (D/8 bytes), like 3-bit codes. */
        pack_plane(codes, head_dim, 4, 0, dst);
        pack_plane(codes, head_dim, 1, 4, dst + head_dim / 2);
    } else {
        pack_plane(codes, head_dim, bits, 0, dst);
    }
}

void kvq_unpack_codes(const uint8_t *src, int head_dim, int bits, uint8_t *codes)
{
    memset(codes, 0, (size_t)head_dim);
    if (bits == 3) {
        unpack_plane(src, head_dim, 2, 0, codes);
        unpack_plane(src + head_dim / 4, head_dim, 1, 2, codes);
    } else if (bits == 5) {
        unpack_plane(src, head_dim, 4, 0, codes);
        unpack_plane(src + head_dim / 2, head_dim, 1, 4, codes);
    } else {
        unpack_plane(src, head_dim, bits, 0, codes);
    }
}

kvq_qparams kvq_quantize_group(const float *x, size_t n, size_t stride, int bits, kvq_param_dtype scale_dt,
                               kvq_param_dtype zero_dt, uint8_t *codes)
{
    float mn = x[0], mx = x[0];
    for (size_t i = 1; i < n; i++) {
        float v = x[i * stride];
        if (v < mn) mn = v;
        if (v > mx) mx = v;
    }
    kvq_qparams p = kvq_qparams_fit(mn, mx, bits, scale_dt, zero_dt);
    for (size_t i = 0; i < n; i++) codes[i] = (uint8_t)kvq_quant_code(x[i * stride], p, bits);
    return p;
}

/* ------------------------------------------------------------------------------------------ element formats -- */

int kvq_format_code_bits(const kvq_format_cfg *f, int bits)
{
    switch (f->kind) {
    case KVQ_FMT_Q8_0:
    case KVQ_FMT_E4M3:
    case KVQ_FMT_E5M2: return 8;
    case KVQ_FMT_Q4_0:
    case KVQ_FMT_Q4_1:
    case KVQ_FMT_NVFP4:
    case KVQ_FMT_MXFP4: return 4;
    case KVQ_FMT_Q5_0:
    case KVQ_FMT_Q5_1: return 5;
    default: return bits;
    }
}

int kvq_format_block(kvq_format_kind k)
{
    switch (k) {
    case KVQ_FMT_Q8_0:
    case KVQ_FMT_Q4_0:
    case KVQ_FMT_Q4_1:
    case KVQ_FMT_Q5_0:
    case KVQ_FMT_Q5_1:
    case KVQ_FMT_MXFP4: return 32;
    case KVQ_FMT_NVFP4: return 16;
    default: return 0;
    }
}

int kvq_format_has_zero(kvq_format_kind k) { return k == KVQ_FMT_INT || k == KVQ_FMT_Q4_1 || k == KVQ_FMT_Q5_1; }
int kvq_format_has_group_scale(kvq_format_kind k) { return k != KVQ_FMT_E4M3 && k != KVQ_FMT_E5M2; }
int kvq_format_has_tensor_scale(kvq_format_kind k)
{
    return k == KVQ_FMT_E4M3 || k == KVQ_FMT_E5M2 || k == KVQ_FMT_NVFP4;
}

int kvq_format_scale_bytes(kvq_format_kind k, kvq_param_dtype scale_dt)
{
    if (!kvq_format_has_group_scale(k)) return 0;
    if (k == KVQ_FMT_NVFP4 || k == KVQ_FMT_MXFP4) return 1;
    return scale_dt == KVQ_DT_FP32 ? 4 : 2;
}

int kvq_format_zero_bytes(kvq_format_kind k, kvq_param_dtype zero_dt)
{
    if (!kvq_format_has_zero(k)) return 0;
    return zero_dt == KVQ_DT_FP32 ? 4 : 2;
}

uint8_t kvq_format_scale8_encode(kvq_format_kind k, float s)
{
    return k == KVQ_FMT_MXFP4 ? kvq_e8m0_from_f32(s) : kvq_e4m3_from_f32(s);
}

float kvq_format_scale8_decode(kvq_format_kind k, uint8_t c)
{
    return k == KVQ_FMT_MXFP4 ? kvq_f32_from_e8m0(c) : kvq_f32_from_e4m3(c);
}

void kvq_format_levels(const kvq_format_cfg *f, int bits, float *table)
{
    int cb = kvq_format_code_bits(f, bits), n = 1 << cb;
    for (int c = 0; c < n; c++) {
        float v;
        switch (f->kind) {
        case KVQ_FMT_INT:
        case KVQ_FMT_Q4_1:
        case KVQ_FMT_Q5_1: v = (float)c; break;
        case KVQ_FMT_INT_SYM:
        case KVQ_FMT_Q8_0:
        case KVQ_FMT_Q4_0:
        case KVQ_FMT_Q5_0: v = (float)(c - (1 << (cb - 1))); break; /* the implied zero */
        case KVQ_FMT_E4M3: v = kvq_f32_from_e4m3((uint8_t)c); break;
        case KVQ_FMT_E5M2: v = kvq_f32_from_e5m2((uint8_t)c); break;
        case KVQ_FMT_NVFP4:
        case KVQ_FMT_MXFP4: v = kvq_f32_from_e2m1((uint8_t)c); break;
        default: v = c < f->n_levels ? f->levels[c] : 0.0f; break; /* unused codes decode to 0 */
        }
        /* The NaN codes of e4m3 / e5m2 (and e5m2's infinities) are never produced by the quantizer; decoding
         * them as 0 keeps a corrupted cache finite. */
        table[c] = isfinite(v) ? v : 0.0f;
    }
}

float kvq_format_tensor_scale(kvq_format_kind k, float amax)
{
    float top;
    if (k == KVQ_FMT_E4M3)
        top = KVQ_E4M3_MAX;
    else if (k == KVQ_FMT_E5M2)
        top = KVQ_E5M2_MAX;
    else if (k == KVQ_FMT_NVFP4)
        top = KVQ_E2M1_MAX * KVQ_E4M3_MAX;
    else
        return 1.0f;
    if (!(amax > 0.0f) || !isfinite(amax)) return 1.0f;
    float t = amax / top;
    return t > 0.0f ? t : 1.0f; /* an amax so small that the division underflows */
}

/* ggml's (int8_t) cast of a non-negative float below 128: truncation toward zero. */
static int trunc_int(float v) { return v >= 127.0f ? 127 : v <= 0.0f ? 0 : (int)v; }

/* roundf: half away from zero (ggml's q8_0). */
static int round_away(float v) { return (int)roundf(v); }

static void ggml_sym(int levels_half, const float *x, size_t n, size_t stride, uint8_t *codes, kvq_qparams *p)
{
    /* quantize_row_q4_0_ref / q5_0: the signed value of largest magnitude, the first of equals. */
    float amax = 0.0f, max = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float v = x[i * stride];
        if (amax < fabsf(v)) {
            amax = fabsf(v);
            max = v;
        }
    }
    float d = max / (float)-levels_half;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    int top = 2 * levels_half - 1;
    for (size_t i = 0; i < n; i++) {
        int q = trunc_int(x[i * stride] * id + ((float)levels_half + 0.5f));
        codes[i] = (uint8_t)(q < top ? q : top);
    }
    p->scale = kvq_f16_round(d);
    p->zero = 0.0f;
}

static void ggml_asym(int top, const float *x, size_t n, size_t stride, uint8_t *codes, kvq_qparams *p)
{
    /* quantize_row_q4_1_ref / q5_1 */
    float mn = INFINITY, mx = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        float v = x[i * stride];
        if (v < mn) mn = v;
        if (v > mx) mx = v;
    }
    float d = (mx - mn) / (float)top;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (size_t i = 0; i < n; i++) {
        int q = trunc_int((x[i * stride] - mn) * id + 0.5f);
        codes[i] = (uint8_t)(q < top ? q : top);
    }
    p->scale = kvq_f16_round(d);
    p->zero = kvq_f16_round(mn);
}

static float absmax_of(const float *x, size_t n, size_t stride)
{
    float a = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float v = fabsf(x[i * stride]);
        if (v > a) a = v;
    }
    return a;
}

static uint8_t nearest_level(float y, const float *lv, int n)
{
    int best = 0;
    float bd = fabsf(y - lv[0]);
    for (int i = 1; i < n; i++) {
        float d = fabsf(y - lv[i]);
        if (d < bd) {
            bd = d;
            best = i;
        }
    }
    return (uint8_t)best;
}

kvq_qparams kvq_format_quantize_group(const kvq_format_cfg *f, int bits, kvq_param_dtype scale_dt,
                                      kvq_param_dtype zero_dt, float tscale, const float *x, size_t n,
                                      size_t stride, uint8_t *codes)
{
    kvq_qparams p = {1.0f, 0.0f};
    switch (f->kind) {
    case KVQ_FMT_INT: return kvq_quantize_group(x, n, stride, bits, scale_dt, zero_dt, codes);
    case KVQ_FMT_INT_SYM: {
        int half = 1 << (bits - 1), lh = half - 1;
        float amax = absmax_of(x, n, stride);
        p.scale = amax > 0.0f ? kvq_param_round_up(amax / (float)lh, scale_dt) : 0.0f;
        if (scale_dt == KVQ_DT_FP16 && p.scale > KVQ_PARAM_F16_MAX) p.scale = KVQ_PARAM_F16_MAX;
        for (size_t i = 0; i < n; i++) {
            float v = p.scale > 0.0f ? __builtin_rintf(x[i * stride] / p.scale) : 0.0f;
            if (!(v == v)) v = 0.0f;
            if (v > (float)lh) v = (float)lh;
            if (v < (float)-lh) v = (float)-lh;
            codes[i] = (uint8_t)((int)v + half);
        }
        return p;
    }
    case KVQ_FMT_Q8_0: {
        float d = absmax_of(x, n, stride) / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (size_t i = 0; i < n; i++) {
            int q = round_away(x[i * stride] * id);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            codes[i] = (uint8_t)(q + 128);
        }
        p.scale = kvq_f16_round(d);
        return p;
    }
    case KVQ_FMT_Q4_0: ggml_sym(8, x, n, stride, codes, &p); return p;
    case KVQ_FMT_Q5_0: ggml_sym(16, x, n, stride, codes, &p); return p;
    case KVQ_FMT_Q4_1: ggml_asym(15, x, n, stride, codes, &p); return p;
    case KVQ_FMT_Q5_1: ggml_asym(31, x, n, stride, codes, &p); return p;
    case KVQ_FMT_E4M3:
    case KVQ_FMT_E5M2:
        for (size_t i = 0; i < n; i++) {
            float y = x[i * stride] / tscale;
            codes[i] = f->kind == KVQ_FMT_E4M3 ? kvq_e4m3_from_f32(y) : kvq_e5m2_from_f32(y);
        }
        return p;
    case KVQ_FMT_NVFP4:
    case KVQ_FMT_MXFP4: {
        float amax = absmax_of(x, n, stride), step;
        if (f->kind == KVQ_FMT_NVFP4) {
            p.scale = kvq_f32_from_e4m3(kvq_e4m3_from_f32((amax / KVQ_E2M1_MAX) / tscale));
            step = p.scale * tscale;
        } else {
            int e = -127;
            if (amax > 0.0f) {
                frexpf(amax, &e);
                e = e - 1 - 2; /* floor(log2 amax) - emax(e2m1) */
                if (e < -127) e = -127;
                if (e > 127) e = 127;
            }
            p.scale = kvq_f32_from_e8m0((uint8_t)(e + 127));
            step = p.scale;
        }
        for (size_t i = 0; i < n; i++) codes[i] = step > 0.0f ? kvq_e2m1_from_f32(x[i * stride] / step) : 0;
        return p;
    }
    default: { /* codebook */
        const float *lv = f->levels;
        int nl = f->n_levels;
        if (f->codebook_normal) {
            double ss = 0;
            for (size_t i = 0; i < n; i++) ss += (double)x[i * stride] * (double)x[i * stride];
            p.scale = kvq_param_round((float)sqrt(ss / (double)n), scale_dt);
        } else {
            float top = fmaxf(fabsf(lv[0]), fabsf(lv[nl - 1]));
            p.scale = kvq_param_round_up(absmax_of(x, n, stride) / top, scale_dt);
        }
        if (scale_dt == KVQ_DT_FP16 && p.scale > KVQ_PARAM_F16_MAX) p.scale = KVQ_PARAM_F16_MAX;
        for (size_t i = 0; i < n; i++)
            codes[i] = nearest_level(p.scale > 0.0f ? x[i * stride] / p.scale : 0.0f, lv, nl);
        return p;
    }
    }
}
