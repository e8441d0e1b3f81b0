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
 * bit order of layout.h; bits in {1, 2, 3, 4, 8}. unpack is the inverse. */
void kvq_pack_codes(const uint8_t *codes, int head_dim, int bits, uint8_t *dst);
void kvq_unpack_codes(const uint8_t *src, int head_dim, int bits, uint8_t *codes);

/* Quantizes n values (stride apart) as one group: fits parameters, writes n codes. */
kvq_qparams kvq_quantize_group(const float *x, size_t n, size_t stride, int bits, kvq_param_dtype scale_dt,
                               kvq_param_dtype zero_dt, uint8_t *codes);

#endif
