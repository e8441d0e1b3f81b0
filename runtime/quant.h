/* The one quantizer (DESIGN §4), used by every backend and mirrored exactly by the CUDA templates.
 *
 * Asymmetric uniform, b bits, L = 2^b - 1 levels above zero:
 *   z = min rounded DOWN to the parameter dtype,
 *   s = (max - z) / L rounded UP to the parameter dtype,
 *   code = clamp(rint((x - z) / s), 0, L)      (rint: round half to even, fp32 division correctly rounded)
 *   x'   = z + s * code                         (fp32, one multiply then one add: no fused multiply-add)
 * Rounding z down and s up keeps [min, max] inside the grid, so |x - x'| <= s/2 (up to fp32 rounding) even
 * though the stored parameters are fp16. A group with max == min and a representable min gets s = 0, codes 0,
 * and reconstructs exactly (no division by zero: the peers' kernels produce NaN there).
 *
 * Saturation of an fp16 scale: with every input within fp16's range (|x| <= 65504, the engine refuses anything
 * else), max - z <= 131008, so only L = 1 (1-bit) can give a step beyond fp16's 65504. There s is stored as
 * 65504 (never inf: inf * 0 would dequantize to NaN), and codes are computed against the stored s, so
 * x' is z or z + 65504. For R = max - z in (65504, 131008]: |x - x'| <= max(65504 / 2, R - 65504) <= R / 2, the
 * bound of the exact step R / L: the saturated group is no less accurate than 1-bit promises. */
#ifndef KVQ_QUANT_H
#define KVQ_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "scheme.h"

#define KVQ_PARAM_F16_MAX 65504.0f /* fp16's largest finite value: an fp16 scale saturates here */

typedef struct {
    float scale, zero; /* exactly representable in their storage dtypes */
} kvq_qparams;

/* Rounds to the parameter dtype: to nearest even, or toward -inf / +inf. fp32 is returned as is. */
float kvq_param_round(float x, kvq_param_dtype dt);
float kvq_param_round_down(float x, kvq_param_dtype dt);
float kvq_param_round_up(float x, kvq_param_dtype dt);

kvq_qparams kvq_qparams_fit(float min, float max, int bits, kvq_param_dtype scale_dt, kvq_param_dtype zero_dt);

static inline uint32_t kvq_quant_code(float x, kvq_qparams p, int bits)
{
    uint32_t L = (1u << bits) - 1u;
    if (p.scale == 0.0f) return 0;
    float v = __builtin_rintf((x - p.zero) / p.scale);
    if (!(v > 0.0f)) return 0; /* also maps NaN to 0 */
    if (v >= (float)L) return L;
    return (uint32_t)v;
}

static inline float kvq_dequant(uint32_t code, kvq_qparams p)
{
    /* Two roundings (the build uses -ffp-contract=off), as the GPU computes it with __fmul_rn + __fadd_rn. */
    return p.zero + p.scale * (float)code;
}

/* ZipCache Eq. 6 channel factor c_i = sqrt(max_t |X_t,i|), rounded to the scale dtype; 1 for an all-zero
 * channel so that dividing by it is harmless. */
float kvq_channel_factor(float absmax, kvq_param_dtype dt);

/* Packs head_dim codes of one token (values < 2^bits) into dst (kvq_code_bytes(head_dim, bits) bytes), in the
 * bit order of layout.h; bits in {1, 2, 3, 4, 5, 8}. unpack is the inverse. */
void kvq_pack_codes(const uint8_t *codes, int head_dim, int bits, uint8_t *dst);
void kvq_unpack_codes(const uint8_t *src, int head_dim, int bits, uint8_t *codes);

/* Quantizes n values (stride apart) as one group: fits parameters, writes n codes. */
kvq_qparams kvq_quantize_group(const float *x, size_t n, size_t stride, int bits, kvq_param_dtype scale_dt,
                               kvq_param_dtype zero_dt, uint8_t *codes);


/* ---- element formats (compiler/scheme_format.h): x = z + s * T * L[code] ----
 *
 * Each format's own rounding, bit for bit:
 *   int          as above (kvq_qparams_fit, kvq_quant_code).
 *   int sym      s = absmax / (2^(b-1) - 1) rounded up to the scale dtype; code = clamp(rint(x / s),
 *                -(2^(b-1) - 1), 2^(b-1) - 1) + 2^(b-1); L = code - 2^(b-1). No zero stored; bits >= 2.
 *   q8_0         ggml quantize_row_q8_0_ref: d = absmax / 127, id = d ? 1/d : 0, q = roundf(x * id) (half away
 *                from zero); code = q + 128, L = code - 128, s = fp16(d).
 *   q4_0, q5_0   ggml quantize_row_q4_0_ref / q5_0: m = the element of largest magnitude (the first of ties),
 *                d = m / -8 (-16), id = d ? 1/d : 0, code = min(15 (31), (int)(x * id + 8.5 (16.5))) truncated;
 *                L = code - 8 (16), s = fp16(d).
 *   q4_1, q5_1   ggml quantize_row_q4_1_ref / q5_1: d = (max - min) / 15 (31), id = d ? 1/d : 0,
 *                code = min(15 (31), (int)((x - min) * id + 0.5)); s = fp16(d), z = fp16(min), L = code.
 *                (ggml computes the codes with the fp32 d and min, and stores them rounded to fp16.)
 *   e4m3, e5m2   code = the element format of x / T (base/minifloat.h: nearest even, saturating); s = 1.
 *   nvfp4        blocks of 16: s = e4m3((absmax / 6) / T); code = e2m1(x / (s * T)) (s = 0: codes +0).
 *   mxfp4        OCP MX v1.0 Sec. 6.3: blocks of 32: s = 2^(floor(log2(absmax)) - 2) (e8m0; 2 = e2m1's largest
 *                exponent), code = e2m1(x / s), saturating (absmax / s < 8: the top values clamp to 6).
 *   codebook     s = absmax / max |L| rounded up to the scale dtype (explicit levels), or the group's root mean
 *                square rounded to nearest (`normal`: the levels are for N(0,1)); code = the nearest level to
 *                x / s, the lower of two equally near; s = 0 gives code of the level nearest 0.
 * NaN inputs give code 0 / the format's zero (the engine refuses non-finite K/V before this). */
#include "scheme_format.h"

/* Bits of one code of a format whose tensor says `bits` (the named formats fix their own). */
int kvq_format_code_bits(const kvq_format_cfg *f, int bits);
/* The block size a format fixes (32 for the q types and MXFP4, 16 for NVFP4), 0 when the group is free. */
int kvq_format_block(kvq_format_kind k);
int kvq_format_has_zero(kvq_format_kind k);         /* stores a zero / min per group */
int kvq_format_has_group_scale(kvq_format_kind k);  /* stores a scale per group (all but e4m3 / e5m2) */
int kvq_format_has_tensor_scale(kvq_format_kind k); /* e4m3, e5m2, nvfp4 */
/* Bytes of one stored group scale: 1 (nvfp4: e4m3, mxfp4: e8m0), 0 (none), else the scale dtype's. */
int kvq_format_scale_bytes(kvq_format_kind k, kvq_param_dtype scale_dt);
int kvq_format_zero_bytes(kvq_format_kind k, kvq_param_dtype zero_dt);
/* A one-byte group scale's encoding and value (nvfp4: e4m3, mxfp4: e8m0). */
uint8_t kvq_format_scale8_encode(kvq_format_kind k, float s);
float kvq_format_scale8_decode(kvq_format_kind k, uint8_t c);

/* The level table L[0 .. 2^code_bits) (code_bits <= 8). */
void kvq_format_levels(const kvq_format_cfg *f, int bits, float *table);

/* The tensor scale T computed from a batch's absolute maximum (the prompt): amax / (largest element value *
 * largest block scale): e4m3 amax / 448, e5m2 amax / 57344, nvfp4 amax / (6 * 448); 1 when amax is 0 or the
 * format has no tensor scale. */
float kvq_format_tensor_scale(kvq_format_kind k, float amax);

/* Quantizes n values (stride apart) as one group of format f: writes n codes, returns the stored parameters
 * (scale as stored, decoded; zero 0 where none is stored). tscale: T (1 for formats without). */
kvq_qparams kvq_format_quantize_group(const kvq_format_cfg *f, int bits, kvq_param_dtype scale_dt,
                                      kvq_param_dtype zero_dt, float tscale, const float *x, size_t n,
                                      size_t stride, uint8_t *codes);

/* x = z + (s * T) * L[code]: fp32, a multiply, a multiply, an add (no fused multiply-add). For int, T = 1 and
 * this is kvq_dequant exactly. */
static inline float kvq_format_dequant(float level, kvq_qparams p, float tscale)
{
    return p.zero + (p.scale * tscale) * level;
}

#endif
