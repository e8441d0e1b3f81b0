/* The quantizer: see quant.h for the rules. */
#include "quant.h"

#include <math.h>
#include <string.h>

#include "half.h"

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
