/* The small floating-point element and scale formats of the OCP 8-bit floating point (OFP8) and Microscaling
 * (MX v1.0) specifications, as NVIDIA's and ml_dtypes' names call them:
 *
 *   e4m3  float8_e4m3fn   1 sign, 4 exponent (bias 7), 3 mantissa; no infinities; S.1111.111 is NaN; max 448
 *   e5m2  float8_e5m2     1 sign, 5 exponent (bias 15), 2 mantissa; IEEE-like, infinities and NaNs; max 57344
 *   e2m1  float4_e2m1fn   1 sign, 2 exponent (bias 1), 1 mantissa; values 0 0.5 1 1.5 2 3 4 6; no inf, no NaN
 *   e8m0  float8_e8m0fnu  8 exponent bits (bias 127), no sign, no mantissa: 2^(code - 127); 0xff is NaN
 *
 * Encoding rounds to nearest, ties to even (the encoding whose last bit is 0), subnormals kept, the sign of a
 * zero kept: equal to ml_dtypes' conversions from float32 for every value within the format's range. e8m0 has no
 * mantissa to make a tie even; it rounds a tie (1.5 * 2^e) up, as ml_dtypes does.
 * Saturation (kvq's choice, documented in docs/language.md): a finite value beyond the largest finite one
 * encodes as +-max (NVIDIA's cvt ... .satfinite, what vLLM and TensorRT-LLM use for KV caches); ml_dtypes instead
 * gives NaN (e4m3) or inf (e5m2) there. NaN encodes as the format's NaN (e4m3, e5m2, e8m0) or +0 (e2m1, which
 * has none); inf saturates like a large finite value. e8m0 takes the magnitude (no sign): 0 and values below
 * 2^-127 encode as 0x00 (2^-127), values that round above 2^127 as 0xfe (ml_dtypes: NaN for 0, negatives and
 * overflow).
 *
 * All of it works on exact binary arithmetic (frexp/ldexp and integer rounding), independent of the FPU's
 * rounding mode. */
#ifndef KVQ_MINIFLOAT_H
#define KVQ_MINIFLOAT_H

#include <stddef.h>
#include <stdint.h>

#define KVQ_E4M3_MAX 448.0f
#define KVQ_E5M2_MAX 57344.0f
#define KVQ_E2M1_MAX 6.0f

uint8_t kvq_e4m3_from_f32(float x);
uint8_t kvq_e5m2_from_f32(float x);
uint8_t kvq_e2m1_from_f32(float x); /* the 4-bit code in the low bits */
uint8_t kvq_e8m0_from_f32(float x);

float kvq_f32_from_e4m3(uint8_t c);
float kvq_f32_from_e5m2(uint8_t c);
float kvq_f32_from_e2m1(uint8_t c); /* low 4 bits */
float kvq_f32_from_e8m0(uint8_t c);


/* Whole arrays, by format (the Python package's tests compare them with ml_dtypes). */
typedef enum { KVQ_MF_E4M3 = 0, KVQ_MF_E5M2 = 1, KVQ_MF_E2M1 = 2, KVQ_MF_E8M0 = 3 } kvq_minifloat;
void kvq_minifloat_encode_n(kvq_minifloat which, const float *x, size_t n, uint8_t *out);
void kvq_minifloat_decode_n(kvq_minifloat which, const uint8_t *c, size_t n, float *out);

#endif
