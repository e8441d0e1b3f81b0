/* OFP8 / MX element and scale formats: see minifloat.h. */
#include "minifloat.h"

#include <math.h>

/* Round half to even of a non-negative double that holds an exact multiple of a power of two. */
static double round_even(double q)
{
    double fl = floor(q), diff = q - fl;
    if (diff > 0.5) return fl + 1;
    if (diff < 0.5) return fl;
    return fmod(fl, 2.0) == 0.0 ? fl : fl + 1;
}

/* A sign-exponent-mantissa format with `mbits` mantissa bits, exponent bias `bias` and largest finite magnitude
 * `maxv`: the code of x, rounded to nearest even and saturated at +-maxv; sign at bit 1 + ebits + mbits - 1. */
static unsigned encode(float x, int ebits, int mbits, int bias, double maxv)
{
    unsigned sign = signbit(x) ? 1u << (ebits + mbits) : 0u;
    double a = fabs((double)x);
    int e, emin = 1 - bias;
    if (a == 0) return sign;
    if (a > maxv) a = maxv; /* also inf */
    frexp(a, &e);
    e -= 1; /* a = 1.f * 2^e */
    if (e < emin) e = emin;
    double v = ldexp(round_even(ldexp(a, mbits - e)), e - mbits); /* exact: scaling by powers of two */
    if (v > maxv) v = maxv;
    if (v == 0) return sign;
    frexp(v, &e);
    e -= 1;
    if (e < emin) return sign | (unsigned)ldexp(v, mbits - emin); /* subnormal: exponent field 0 */
    return sign | (unsigned)(e + bias) << mbits | (unsigned)(ldexp(v, mbits - e) - ldexp(1.0, mbits));
}

static float decode(unsigned c, int ebits, int mbits, int bias)
{
    unsigned ef = (c >> mbits) & ((1u << ebits) - 1u), mf = c & ((1u << mbits) - 1u);
    double v = ef == 0 ? ldexp((double)mf, 1 - bias - mbits) : ldexp((double)(mf | 1u << mbits), (int)ef - bias - mbits);
    return (float)((c >> (ebits + mbits)) & 1u ? -v : v);
}

uint8_t kvq_e4m3_from_f32(float x)
{
    if (isnan(x)) return 0x7f;
    return (uint8_t)encode(x, 4, 3, 7, KVQ_E4M3_MAX);
}

uint8_t kvq_e5m2_from_f32(float x)
{
    if (isnan(x)) return 0x7f;
    return (uint8_t)encode(x, 5, 2, 15, KVQ_E5M2_MAX);
}

uint8_t kvq_e2m1_from_f32(float x)
{
    if (isnan(x)) return 0;
    return (uint8_t)encode(x, 2, 1, 1, KVQ_E2M1_MAX);
}

uint8_t kvq_e8m0_from_f32(float x)
{
    double a = fabs((double)x);
    int e;
    if (isnan(x)) return 0xff;
    if (a < 0x1p-127) return 0x00;
    if (a >= 0x1p127) return 0xfe;
    double f = frexp(a, &e) * 2; /* a = f * 2^(e - 1), f in [1, 2) */
    e -= 1;
    /* No mantissa bits: f rounds to 1 or 2, a tie (f = 1.5) up, as ml_dtypes' float8_e8m0fnu does. */
    if (f >= 1.5) e += 1;
    if (e + 127 > 0xfe) return 0xfe;
    if (e + 127 < 0) return 0x00;
    return (uint8_t)(e + 127);
}

float kvq_f32_from_e4m3(uint8_t c)
{
    if ((c & 0x7f) == 0x7f) return NAN;
    return decode(c, 4, 3, 7);
}

float kvq_f32_from_e5m2(uint8_t c)
{
    if ((c & 0x7c) == 0x7c) return (c & 0x03) ? NAN : ((c & 0x80) ? -INFINITY : INFINITY);
    return decode(c, 5, 2, 15);
}

float kvq_f32_from_e2m1(uint8_t c) { return decode(c & 0x0fu, 2, 1, 1); }

float kvq_f32_from_e8m0(uint8_t c)
{
    if (c == 0xff) return NAN;
    return ldexpf(1.0f, (int)c - 127);
}

void kvq_minifloat_encode_n(kvq_minifloat which, const float *x, size_t n, uint8_t *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = which == KVQ_MF_E4M3   ? kvq_e4m3_from_f32(x[i])
                 : which == KVQ_MF_E5M2 ? kvq_e5m2_from_f32(x[i])
                 : which == KVQ_MF_E2M1 ? kvq_e2m1_from_f32(x[i])
                                        : kvq_e8m0_from_f32(x[i]);
}

void kvq_minifloat_decode_n(kvq_minifloat which, const uint8_t *c, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = which == KVQ_MF_E4M3   ? kvq_f32_from_e4m3(c[i])
                 : which == KVQ_MF_E5M2 ? kvq_f32_from_e5m2(c[i])
                 : which == KVQ_MF_E2M1 ? kvq_f32_from_e2m1(c[i])
                                        : kvq_f32_from_e8m0(c[i]);
}
