/* Element formats on the device (compiler/scheme_format.h): each format's element decode and its group
 * quantizer, reproduced operation by operation from runtime/quant.c and base/minifloat.c so that codes and
 * parameters are bit-exact with the reference backend (tests/emu/test_emu_format.c checks every code and
 * 10^5+ values per format, ties and saturation included). Every element decodes as
 *
 *     x = z + (s * T) * L[code]                                   (runtime/quant.h kvq_format_dequant)
 *
 * with L the format's level table (kvq_fmt_level). Arithmetic that the reference does in fp32 uses the _rn
 * intrinsics, so NVRTC's default --fmad=true cannot contract it into a fused multiply-add.
 *
 * Rounding, as the references do it:
 *   q8_0          ggml quantize_row_q8_0_ref: roundf (half away from zero) of x * (1 / d), d = absmax / 127;
 *   q4_0, q5_0    ggml quantize_row_q4_0_ref / q5_0: d = -(signed absmax) / 8 (16), (int)(x * id + 8.5 (16.5))
 *                 truncated toward zero, capped at 15 (31);
 *   q4_1, q5_1    ggml quantize_row_q4_1_ref / q5_1: d = (max - min) / 15 (31), (int)((x - min) * id + 0.5);
 *   e4m3, e5m2,   ml_dtypes' float8_e4m3fn / float8_e5m2 / float4_e2m1fn: round to nearest even, saturated at
 *   e2m1          the largest finite value (448, 57344, 6); NaN -> 0x7f (fp8) or 0 (e2m1);
 *   nvfp4         block scale e4m3((amax / 6) / T), elements e2m1(x / (s T));
 *   mxfp4         OCP MX v1.0: scale 2^(floor(log2 amax) - 2) as e8m0, elements e2m1(x / s);
 *   int symmetric clamp(rint(x / s), -(2^(b-1) - 1), 2^(b-1) - 1), s = absmax / (2^(b-1) - 1) rounded up;
 *   codebook      nearest level of x / s (the first of equals), s = absmax / max |L| rounded up, or for
 *                 `normal` the group's root mean square (sum of squares in double, as the reference).
 * Decoding the NaN codes of e4m3/e5m2 (and e5m2's infinities), which the quantizer never writes, gives 0, as
 * the reference's level table does (runtime/quant.c kvq_format_levels).
 *
 * sm_90 could convert e4m3/e5m2 pairs with cvt.rn.f16x2.e4m3x2; the element decode here is a bit trick on every
 * arch (exact, and no PTX the emulator would have to learn), used where a tile is staged. */
#ifndef KVQ_FORMAT_CUH
#define KVQ_FORMAT_CUH

#include "kvq_types.cuh"

/* compiler/scheme_format.h's kvq_format_kind, in the same order (tests/emu/test_emu_format.c checks it) */
#define KVQ_FK_INT 0
#define KVQ_FK_INT_SYM 1
#define KVQ_FK_Q8_0 2
#define KVQ_FK_Q4_0 3
#define KVQ_FK_Q4_1 4
#define KVQ_FK_Q5_0 5
#define KVQ_FK_Q5_1 6
#define KVQ_FK_E4M3 7
#define KVQ_FK_E5M2 8
#define KVQ_FK_NVFP4 9
#define KVQ_FK_MXFP4 10
#define KVQ_FK_CODEBOOK 11
#define KVQ_FK_CODEBOOK_MAX 16
#define KVQ_POS_INF_ (__uint_as_float(0x7f800000u))

/* ---- minifloats (base/minifloat.c) ---- */

/* 2^k as a float, k in [-126, 127] */
KVQ_DEV float kvq_pow2(int k) { return __uint_as_float((unsigned)(k + 127) << 23); }

/* sign-exponent-mantissa value of code c (ebits, mbits, bias), finite codes only */
KVQ_DEV float kvq_mf_decode(unsigned c, int ebits, int mbits, int bias)
{
    const unsigned ef = (c >> mbits) & ((1u << ebits) - 1u), mf = c & ((1u << mbits) - 1u);
    /* exact: at most 4 significant bits times a power of two within fp32's normal range */
    const float v = ef == 0 ? __fmul_rn((float)mf, kvq_pow2(1 - bias - mbits))
                            : __fmul_rn((float)(mf | 1u << mbits), kvq_pow2((int)ef - bias - mbits));
    return (c >> (ebits + mbits)) & 1u ? -v : v;
}

KVQ_DEV float kvq_e4m3_f32(unsigned c) { return (c & 0x7fu) == 0x7fu ? 0.0f : kvq_mf_decode(c & 0xffu, 4, 3, 7); }
KVQ_DEV float kvq_e5m2_f32(unsigned c) { return (c & 0x7cu) == 0x7cu ? 0.0f : kvq_mf_decode(c & 0xffu, 5, 2, 15); }
KVQ_DEV float kvq_e2m1_f32(unsigned c) { return kvq_mf_decode(c & 0x0fu, 2, 1, 1); }
KVQ_DEV float kvq_e8m0_f32(unsigned c)
{
    /* 2^(c - 127); 2^-127 is an fp32 subnormal; c = 0xff (NaN) never stored */
    return (int)c - 127 >= -126 ? kvq_pow2((int)c - 127) : __fmul_rn(kvq_pow2(-126), 0.5f);
}

/* base/minifloat.c encode(): round to nearest even with `mbits` mantissa bits, exponent at least 1 - bias,
 * |x| saturated at maxv (inf included). x is not NaN. */
KVQ_DEV unsigned kvq_mf_encode(float x, int ebits, int mbits, int bias, float maxv)
{
    const unsigned u = __float_as_uint(x), sign = (u >> 31) << (ebits + mbits);
    float a = __uint_as_float(u & 0x7fffffffu);
    const int emin = 1 - bias;
    if (a == 0.0f) return sign;
    if (a > maxv) a = maxv;
    int e = (int)((__float_as_uint(a) >> 23) & 0xffu) - 127; /* floor(log2 a) for a normal a */
    if (e < emin) e = emin;                                  /* also every fp32 subnormal */
    /* a * 2^(mbits - e): exact (a power of two, the result below 2^(mbits+1) and above fp32's subnormals
     * whenever it can round to a nonzero code), then rint: round half to even */
    const int k = mbits - e;
    const float q = __fmul_rn(a, kvq_pow2(k)); /* k in [-124, 16] */
    unsigned r = (unsigned)rintf(q);
    if (r == 0u) return sign;
    if (r >= (2u << mbits)) { /* rounded up into the next binade */
        r >>= 1;
        e += 1;
    }
    if (r < (1u << mbits)) return sign | r; /* subnormal (only at e == emin) */
    return sign | (unsigned)(e + bias) << mbits | (r - (1u << mbits));
}

KVQ_DEV unsigned kvq_e4m3_enc(float x) { return x != x ? 0x7fu : kvq_mf_encode(x, 4, 3, 7, 448.0f); }
KVQ_DEV unsigned kvq_e5m2_enc(float x) { return x != x ? 0x7fu : kvq_mf_encode(x, 5, 2, 15, 57344.0f); }
KVQ_DEV unsigned kvq_e2m1_enc(float x) { return x != x ? 0u : kvq_mf_encode(x, 2, 1, 1, 6.0f); }

/* ---- levels ---- */

/* Code width of a format's codes (runtime/quant.c kvq_format_code_bits): `bits` for int, int symmetric and
 * codebooks. */
KVQ_HD int kvq_fmt_code_bits(int kind, int bits)
{
    return kind == KVQ_FK_Q8_0 || kind == KVQ_FK_E4M3 || kind == KVQ_FK_E5M2                            ? 8
           : kind == KVQ_FK_Q4_0 || kind == KVQ_FK_Q4_1 || kind == KVQ_FK_NVFP4 || kind == KVQ_FK_MXFP4 ? 4
           : kind == KVQ_FK_Q5_0 || kind == KVQ_FK_Q5_1                                               ? 5
                                                                                                    : bits;
}

/* L[c] of a format whose codes are cbits wide; levels: a codebook's levels (n_levels of them, unused codes 0) */
KVQ_DEV float kvq_fmt_level(int kind, int cbits, unsigned c, const float *levels, int n_levels)
{
    switch (kind) {
    case KVQ_FK_INT:
    case KVQ_FK_Q4_1:
    case KVQ_FK_Q5_1: return (float)c;
    case KVQ_FK_INT_SYM:
    case KVQ_FK_Q8_0:
    case KVQ_FK_Q4_0:
    case KVQ_FK_Q5_0: return (float)((int)c - (1 << (cbits - 1))); /* the implied zero */
    case KVQ_FK_E4M3: return kvq_e4m3_f32(c);
    case KVQ_FK_E5M2: return kvq_e5m2_f32(c);
    case KVQ_FK_NVFP4:
    case KVQ_FK_MXFP4: return kvq_e2m1_f32(c);
    default: {
        /* selects over constant indices: a level table indexed by a code would live in local memory */
        float v = 0.0f;
#pragma unroll
        for (int i = 0; i < KVQ_FK_CODEBOOK_MAX; i++)
            if (i < n_levels && (int)c == i) v = levels[i];
        return v;
    }
    }
}

/* runtime/quant.h kvq_format_dequant: z + (s T) L, two roundings */
KVQ_DEV float kvq_fmt_dequant(float level, float s, float z, float T)
{
    return __fadd_rn(z, __fmul_rn(__fmul_rn(s, T), level));
}

/* ---- reading a page (layout/layout.h) ---- */

/* Code of channel c of a token row of cbits-bit codes: 1, 2, 4, 8 bits little-endian in 32-bit words; 3 bits a
 * 2-bit plane (D/4 bytes) then the high bits as a 1-bit plane; 5 bits (q5_0/q5_1) a 4-bit plane (D/2 bytes)
 * then the fifth bits as a 1-bit plane (runtime/quant.c kvq_pack_codes). */
KVQ_DEV unsigned kvq_fmt_code_at(const unsigned char *row, int cbits, int D, int c)
{
    if (cbits == 3) return ((row[c >> 2] >> (2 * (c & 3))) & 3u) | ((row[D / 4 + (c >> 3)] >> (c & 7)) & 1u) << 2;
    if (cbits == 5) return ((row[c >> 1] >> (4 * (c & 1))) & 15u) | ((row[D / 2 + (c >> 3)] >> (c & 7)) & 1u) << 4;
    const int bit = c * cbits;
    return (row[bit >> 3] >> (bit & 7)) & ((1u << cbits) - 1u);
}

/* Group scale i of a page's scale section: 1 byte (nvfp4: e4m3, mxfp4: e8m0), fp16/fp32, or none (fp8
 * elements: 1) (runtime/quant.c kvq_format_scale_bytes / kvq_format_scale8_decode). */
KVQ_DEV float kvq_fmt_ld_scale(const unsigned char *p, long long i, int kind, int sbytes)
{
    if (sbytes == 0) return 1.0f;
    if (sbytes == 1) return kind == KVQ_FK_MXFP4 ? kvq_e8m0_f32(p[i]) : kvq_e4m3_f32(p[i]);
    return kvq_ld_par(p, i, sbytes);
}

/* The byte a 1-byte scale is stored as (the quantizer's scale is already exactly representable) */
KVQ_DEV unsigned kvq_fmt_scale8(int kind, float s)
{
    if (kind != KVQ_FK_MXFP4) return kvq_e4m3_enc(s);
    const int be = (int)((__float_as_uint(s) >> 23) & 0xffu);
    return be ? (unsigned)be : 0u; /* 2^(be - 127); the subnormal 2^-127 is code 0 */
}

/* ---- the group quantizers (runtime/quant.c kvq_format_quantize_group) ---- */

/* What a group quantizer needs besides the values: the format, the class bits (int, int symmetric,
 * codebooks), parameter dtypes, the tensor scale of the page and a codebook. */
typedef struct {
    int kind, bits, s_f32, z_f32;
    float T;
    int normal, n_levels;
    const float *levels;
} kvq_fq;

KVQ_DEV float kvq_f16r(float x) { return kvq_h2f(kvq_f2h(x)); }

KVQ_DEV float kvq_fq_absmax(const float *x, int n, int stride)
{
    float a = 0.0f;
    for (int i = 0; i < n; i++) {
        const float v = fabsf(x[i * stride]);
        if (v > a) a = v;
    }
    return a;
}

/* ggml's (int8_t) cast of a non-negative float below 128 (quant.c trunc_int) */
KVQ_DEV int kvq_fq_trunc(float v) { return v >= 127.0f ? 127 : v <= 0.0f ? 0 : (int)v; }

/* The parameters of a group (kvq_format_fit and the block formats' scales). */
KVQ_DEV void kvq_fq_fit(const kvq_fq *q, const float *x, int n, int stride, float *s, float *z)
{
    *s = 1.0f, *z = 0.0f;
    switch (q->kind) {
    case KVQ_FK_INT: {
        float mn = x[0], mx = x[0];
        for (int i = 1; i < n; i++) {
            const float v = x[i * stride];
            if (v < mn) mn = v;
            if (v > mx) mx = v;
        }
        kvq_fit(mn, mx, q->bits, q->s_f32, q->z_f32, s, z);
        return;
    }
    case KVQ_FK_INT_SYM: {
        const float amax = kvq_fq_absmax(x, n, stride);
        *s = amax > 0.0f ? kvq_round_up(__fdiv_rn(amax, (float)((1 << (q->bits - 1)) - 1)), q->s_f32) : 0.0f;
        break;
    }
    case KVQ_FK_CODEBOOK:
        if (q->normal) {
            double ss = 0.0;
            for (int i = 0; i < n; i++) ss = __dadd_rn(ss, __dmul_rn((double)x[i * stride], (double)x[i * stride]));
            const float r = (float)sqrt(ss / (double)n); /* IEEE on the device too */
            *s = q->s_f32 ? r : kvq_f16r(r);
        } else {
            const float top = fmaxf(fabsf(q->levels[0]), fabsf(q->levels[q->n_levels - 1]));
            *s = kvq_round_up(__fdiv_rn(kvq_fq_absmax(x, n, stride), top), q->s_f32);
        }
        break;
    case KVQ_FK_Q8_0: *s = kvq_f16r(__fdiv_rn(kvq_fq_absmax(x, n, stride), 127.0f)); return;
    case KVQ_FK_Q4_0:
    case KVQ_FK_Q5_0: {
        /* the signed value of largest magnitude, the first of equals */
        float amax = 0.0f, mx = 0.0f;
        for (int i = 0; i < n; i++) {
            const float v = x[i * stride];
            if (amax < fabsf(v)) amax = fabsf(v), mx = v;
        }
        *s = kvq_f16r(__fdiv_rn(mx, q->kind == KVQ_FK_Q4_0 ? -8.0f : -16.0f));
        return;
    }
    case KVQ_FK_Q4_1:
    case KVQ_FK_Q5_1: {
        float mn = KVQ_POS_INF_, mx = -KVQ_POS_INF_;
        for (int i = 0; i < n; i++) {
            const float v = x[i * stride];
            if (v < mn) mn = v;
            if (v > mx) mx = v;
        }
        *s = kvq_f16r(__fdiv_rn(__fsub_rn(mx, mn), q->kind == KVQ_FK_Q4_1 ? 15.0f : 31.0f));
        *z = kvq_f16r(mn);
        return;
    }
    case KVQ_FK_NVFP4:
        *s = kvq_e4m3_f32(kvq_e4m3_enc(__fdiv_rn(__fdiv_rn(kvq_fq_absmax(x, n, stride), 6.0f), q->T)));
        return;
    case KVQ_FK_MXFP4: {
        const float amax = kvq_fq_absmax(x, n, stride);
        int e = -127;
        if (amax > 0.0f) {
            const int be = (int)((__float_as_uint(amax) >> 23) & 0xffu);
            e = be == 0 ? -127 : be - 127 - 2; /* floor(log2 amax) - emax(e2m1); a subnormal amax: below -127 */
            if (e < -127) e = -127;
            if (e > 127) e = 127;
        }
        *s = kvq_e8m0_f32((unsigned)(e + 127));
        return;
    }
    default: return;
    }
    if (!q->s_f32 && *s > 65504.0f) *s = 65504.0f;
}

/* The code of one element given its group's parameters (the exact ggml (and ml_dtypes) arithmetic). */
KVQ_DEV unsigned kvq_fq_code(const kvq_fq *q, float x, float s, float z)
{
    switch (q->kind) {
    case KVQ_FK_INT: return kvq_code(x, s, z, q->bits);
    case KVQ_FK_INT_SYM: {
        const int half = 1 << (q->bits - 1), lh = half - 1;
        float v = s > 0.0f ? rintf(__fdiv_rn(x, s)) : 0.0f;
        if (!(v == v)) v = 0.0f;
        if (v > (float)lh) v = (float)lh;
        if (v < (float)-lh) v = (float)-lh;
        return (unsigned)((int)v + half);
    }
    case KVQ_FK_CODEBOOK: {
        const float y = s > 0.0f ? __fdiv_rn(x, s) : 0.0f;
        int best = 0;
        float bd = fabsf(__fsub_rn(y, q->levels[0]));
#pragma unroll
        for (int i = 1; i < KVQ_FK_CODEBOOK_MAX; i++) { /* constant indices: no local memory */
            if (i >= q->n_levels) break;
            const float d = fabsf(__fsub_rn(y, q->levels[i]));
            if (d < bd) bd = d, best = i;
        }
        return (unsigned)best;
    }
    case KVQ_FK_Q8_0: {
        /* d = absmax / 127 before its fp16 rounding: recomputed by the caller into z's place (kvq_fq_group) */
        const float id = z != 0.0f ? __fdiv_rn(1.0f, z) : 0.0f;
        int v = (int)roundf(__fmul_rn(x, id));
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        return (unsigned)(v + 128);
    }
    case KVQ_FK_Q4_0:
    case KVQ_FK_Q5_0: {
        const int lh = q->kind == KVQ_FK_Q4_0 ? 8 : 16, top = 2 * lh - 1;
        const float id = z != 0.0f ? __fdiv_rn(1.0f, z) : 0.0f; /* z: the unrounded d */
        const int v = kvq_fq_trunc(__fadd_rn(__fmul_rn(x, id), (float)lh + 0.5f));
        return (unsigned)(v < top ? v : top);
    }
    case KVQ_FK_Q4_1:
    case KVQ_FK_Q5_1: {
        /* s: the unrounded d, z: the unrounded min (kvq_fq_group passes them) */
        const int top = q->kind == KVQ_FK_Q4_1 ? 15 : 31;
        const float id = s != 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
        const int v = kvq_fq_trunc(__fadd_rn(__fmul_rn(__fsub_rn(x, z), id), 0.5f));
        return (unsigned)(v < top ? v : top);
    }
    case KVQ_FK_E4M3: return kvq_e4m3_enc(__fdiv_rn(x, q->T));
    case KVQ_FK_E5M2: return kvq_e5m2_enc(__fdiv_rn(x, q->T));
    case KVQ_FK_NVFP4: {
        const float step = __fmul_rn(s, q->T);
        return step > 0.0f ? kvq_e2m1_enc(__fdiv_rn(x, step)) : 0u;
    }
    case KVQ_FK_MXFP4: return s > 0.0f ? kvq_e2m1_enc(__fdiv_rn(x, s)) : 0u;
    default: return 0u;
    }
}

/* A whole group, as runtime/quant.c kvq_format_quantize_group: n values stride apart -> n codes, the stored
 * scale and zero. ggml's types quantize with their unrounded d (and min), and store d rounded to fp16. */
/* The stored parameters (s, z) and those the codes are computed with (cs, cz): ggml's types quantize with
 * their unrounded d (and min) and store d rounded to fp16. */
KVQ_DEV void kvq_fq_params(const kvq_fq *q, const float *x, int n, int stride, float *s, float *z, float *ocs,
                           float *ocz)
{
    kvq_fq_fit(q, x, n, stride, s, z);
    float cs = *s, cz = *z;
    if (q->kind == KVQ_FK_Q8_0) {
        cz = __fdiv_rn(kvq_fq_absmax(x, n, stride), 127.0f);
    } else if (q->kind == KVQ_FK_Q4_0 || q->kind == KVQ_FK_Q5_0) {
        float amax = 0.0f, mx = 0.0f;
        for (int i = 0; i < n; i++) {
            const float v = x[i * stride];
            if (amax < fabsf(v)) amax = fabsf(v), mx = v;
        }
        cz = __fdiv_rn(mx, q->kind == KVQ_FK_Q4_0 ? -8.0f : -16.0f);
    } else if (q->kind == KVQ_FK_Q4_1 || q->kind == KVQ_FK_Q5_1) {
        float mn = KVQ_POS_INF_, mx = -KVQ_POS_INF_;
        for (int i = 0; i < n; i++) {
            const float v = x[i * stride];
            if (v < mn) mn = v;
            if (v > mx) mx = v;
        }
        cs = __fdiv_rn(__fsub_rn(mx, mn), q->kind == KVQ_FK_Q4_1 ? 15.0f : 31.0f);
        cz = mn;
    }
    *ocs = cs, *ocz = cz;
}

KVQ_DEV void kvq_fq_group(const kvq_fq *q, const float *x, int n, int stride, unsigned char *codes, float *s,
                          float *z)
{
    float cs, cz;
    kvq_fq_params(q, x, n, stride, s, z, &cs, &cz);
    for (int i = 0; i < n; i++) codes[i] = (unsigned char)kvq_fq_code(q, x[i * stride], cs, cz);
}

/* The same, each code written over its value (as a float): no per-thread array */
KVQ_DEV void kvq_fq_group_inplace(const kvq_fq *q, float *x, int n, float *s, float *z)
{
    float cs, cz;
    kvq_fq_params(q, x, n, 1, s, z, &cs, &cz);
    for (int i = 0; i < n; i++) x[i] = (float)kvq_fq_code(q, x[i], cs, cz);
}

/* ---- the kernels' format paths (hooks: kvq_quantize.cuh's token and channel bodies, kvq_decode.cuh's
 * kvq_stage_page and kvq_decode_body) ---- */

/* KVQ_FMT_ANY (compiler/emit_cuda.c): 0 in a unit whose plan has no element format, whose format branches below
 * are then left out before the compiler sees them (they are dead there, but NVRTC and the emulator's C++ compiler
 * still spent 10-25 % of a unit's compile on them; docs/testing.md, "Test time"). Absent: every format. */
#ifndef KVQ_FMT_ANY
#define KVQ_FMT_ANY 1
#endif
KVQ_DEV int kvq_fmt_is(kvq_fmt f) { return KVQ_FMT_ANY && f.kind != KVQ_FK_INT && f.bits > 0 && f.bits < 16; }

/* What the decode kernel's compute sees of a page format: linear formats as asymmetric integers of the staged
 * width with float parameters; the others (fp8, e2m1, codebooks) as fp32 rows x = z + (s T) L[code], the
 * reference's values exactly (bits 32, kvq_fmt_cbpt). fp16 rows would round s T L once more: a codebook's levels,
 * or a tensor scale from the prompt, are not fp16 numbers, and the structured keys' large scores amplify that
 * rounding (2^-12) past 1e-3 of the attention (test_cuda_formats: 1.1e-3 to 2.8e-3, docs/cuda.md). */
KVQ_DEV kvq_fmt kvq_fmt_staged(kvq_fmt f)
{
    if (!kvq_fmt_is(f)) return f;
    if (kvq_fmt_linear(f.kind)) {
        kvq_fmt g = {kvq_fmt_staged_bits(f.kind, f.bits), f.gran, 0, f.group, 0, 4, 4, 0, 0, 0, 0, 0.0f, 0, {0},
                     0, 0, 0, {{0}}};
        return g;
    }
    kvq_fmt g = {32, 0, 0, 0, 0, 4, 4, 0, 0, 0, 0, 0.0f, 0, {0}, 0, 0, 0, {{0}}};
    return g;
}

KVQ_DEV kvq_fq kvq_fmt_fq(const kvq_fmt *f, float T)
{
    kvq_fq q;
    q.kind = f->kind, q.bits = f->bits, q.s_f32 = f->sbytes == 4, q.z_f32 = f->zbytes == 4, q.T = T;
    q.normal = f->normal, q.n_levels = f->n_levels, q.levels = f->lv;
    return q;
}

/* runtime/quant.c kvq_format_tensor_scale: T = amax / top (top: the element's largest value, NVFP4's 6 * 448),
 * 1 when amax is not positive and finite or the division underflows. */
KVQ_DEV float kvq_fmt_tensor_scale(int kind, float amax)
{
    const float top = kind == KVQ_FK_E4M3    ? 448.0f
                      : kind == KVQ_FK_E5M2  ? 57344.0f
                      : kind == KVQ_FK_NVFP4 ? 2688.0f /* 6 * 448 */
                                             : 0.0f;
    if (top == 0.0f || !(amax > 0.0f) || !(amax < KVQ_POS_INF_)) return 1.0f;
    const float t = __fdiv_rn(amax, top);
    return t > 0.0f ? t : 1.0f;
}

/* The tensor scale a quantize kernel of kv head h uses: the spec's static value, or (tensor_scale prompt) the one
 * of the prompt's absolute maxima (kvq_tensor_amax): the head's own (per head), or the largest over every kv head,
 * taken as ref_quant_layer.c set_tscale takes it. */
KVQ_DEV float kvq_fmt_quant_T(const kvq_quant_params *p, kvq_fmt f, int h)
{
    if (f.ts > 0.0f) return f.ts;
    if (!p->tamax) return 1.0f;
    const float *a = (const float *)p->tamax;
    float m = 0.0f;
    if (f.tsh)
        m = a[h];
    else
        for (int i = 0; i < KVQ_HKV; i++) m = fmaxf(m, a[i]);
    return kvq_fmt_tensor_scale(f.kind, m);
}

/* kvq_tensor_amax (kvq_params.cuh kvq_tamax_params): one block per kv head, fmaxf over |x| (fmaxf ignores a NaN as
 * the reference's comparison does), then a tree of maxima. */
KVQ_DEV void kvq_tensor_amax_body(const kvq_tamax_params *p, float *red)
{
    const int h = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    float a = 0.0f;
    for (long long i = tid; i < (long long)p->n * KVQ_D; i += nt) {
        const int t = (int)(i / KVQ_D), c = (int)(i % KVQ_D);
        a = fmaxf(a, fabsf(kvq_src_ld(&p->src, kvq_row_at(&p->src, h, t, p->n), c)));
    }
    red[tid] = a;
    __syncthreads();
    for (int s = nt / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] = fmaxf(red[tid], red[tid + s]);
        __syncthreads();
    }
    if (tid == 0) ((float *)p->out)[h] = red[0];
}

/* Tensor scale T of kv head h of a page. */
KVQ_DEV float kvq_fmt_page_T(const unsigned char *page, kvq_fmt f, kvq_page_off o, int h)
{
    if (!(f.kind == KVQ_FK_E4M3 || f.kind == KVQ_FK_E5M2 || f.kind == KVQ_FK_NVFP4)) return 1.0f;
    return ((const float *)(page + o.tscale))[f.tsh ? h : 0];
}

/* Stores a group's scale and zero at parameter index i */
KVQ_DEV void kvq_fmt_st_par(unsigned char *page, kvq_page_off o, kvq_fmt f, long long i, float s, float z)
{
    if (f.sbytes == 1)
        page[o.scale + i] = (unsigned char)kvq_fmt_scale8(f.kind, s);
    else if (f.sbytes)
        kvq_st_par(page + o.scale, i, f.sbytes, s);
    if (f.zbytes) kvq_st_par(page + o.zero, i, f.zbytes, z);
}

/* Code word w of a token row of cbits-bit codes (runtime/quant.c kvq_pack_codes), code(c) giving channel c's. */
#define KVQ_FMT_PACK_WORD(cbits, w, code, out)                                                                 \
    do {                                                                                                       \
        unsigned word_ = 0;                                                                                    \
        const int lo_ = (cbits) == 3 ? 2 : (cbits) == 5 ? 4 : (cbits);                                         \
        const int lw_ = KVQ_D * lo_ / 32; /* words of the low plane */                                         \
        if ((w) < lw_) {                                                                                       \
            const int per_ = 32 / lo_;                                                                         \
            for (int k_ = 0; k_ < per_; k_++)                                                                  \
                word_ |= ((unsigned)code((w) * per_ + k_) & ((1u << lo_) - 1u)) << (lo_ * k_);                 \
        } else {                                                                                               \
            for (int k_ = 0; k_ < 32; k_++) word_ |= (((unsigned)code(((w) - lw_) * 32 + k_) >> lo_) & 1u) << k_; \
        }                                                                                                      \
        (out) = word_;                                                                                         \
    } while (0)

/* Per-token groups of an element format, tokens [tb, tb + nt) staged in xs ([KVQ_QTOK][D]): each group's
 * quantizer (codes written back over xs as floats), then the code words. The caller synchronised after xs. */
KVQ_DEV void kvq_fmt_quant_token_run(const kvq_quant_params *p, kvq_fmt f, kvq_page_off o, float *xs, int tb, int nt,
                                     int h, int tid, int nthreads)
{
    unsigned char *page = (unsigned char *)p->page;
    const float T = kvq_fmt_quant_T(p, f, h);
    /* each kv head's blocks write its own T (per head), or every block the one T (the same value) */
    if (tid == 0 && o.tscale < o.total) ((float *)(page + o.tscale))[f.tsh ? h : 0] = T;
    const kvq_fq q = kvq_fmt_fq(&f, T);
    const int G = f.group, ng = KVQ_D / G;
    for (int i = tid; i < nt * ng; i += nthreads) {
        const int t = i / ng, g = i % ng;
        float *x = xs + t * KVQ_D + g * G;
        float s, z;
        kvq_fq_group_inplace(&q, x, G, &s, &z);
        kvq_fmt_st_par(page, o, f, ((long long)h * p->cap + p->slot + tb + t) * ng + g, s, z);
    }
    __syncthreads();
    const int W = o.cbpt / 4;
    unsigned *codes = (unsigned *)(page + o.codes);
    for (int i = tid; i < nt * W; i += nthreads) {
        const int t = i / W, w = i % W;
        const float *x = xs + t * KVQ_D;
#define KVQ_FC_(c) ((unsigned)x[c])
        unsigned word;
        KVQ_FMT_PACK_WORD(f.bits, w, KVQ_FC_, word);
#undef KVQ_FC_
        codes[((long long)h * p->cap + p->slot + tb + t) * W + w] = word;
    }
}

/* Per-channel pages of an element format without group parameters (e4m3, e5m2: the element alone, x / T). */
KVQ_DEV void kvq_fmt_quant_channel(const kvq_quant_params *p, kvq_fmt f, int h, int tid, int nthreads)
{
    const kvq_page_off o = kvq_page_offsets(f, KVQ_HKV, KVQ_D, p->cap);
    unsigned char *page = (unsigned char *)p->page;
    const float T = kvq_fmt_quant_T(p, f, h);
    /* each kv head's blocks write its own T (per head), or every block the one T (the same value) */
    if (tid == 0 && o.tscale < o.total) ((float *)(page + o.tscale))[f.tsh ? h : 0] = T;
    const kvq_fq q = kvq_fmt_fq(&f, T);
    const int W = o.cbpt / 4;
    unsigned *codes = (unsigned *)(page + o.codes);
    for (int i = tid; i < p->n * W; i += nthreads) {
        const int t = i / W, w = i % W;
        const long long row = kvq_row_at(&p->src, h, t, p->n);
#define KVQ_FC_(c) kvq_fq_code(&q, kvq_src_ld(&p->src, row, (c)), 1.0f, 0.0f)
        unsigned word;
        KVQ_FMT_PACK_WORD(f.bits, w, KVQ_FC_, word);
#undef KVQ_FC_
        codes[((long long)h * p->cap + p->slot + t) * W + w] = word;
    }
}

/* Stages tokens [slot, slot + n) of a linear format's page for kv head h for the integer path: codes at the
 * staged width (kvq_fmt_staged_bits) into rows, each group's s and z' = z - s off into ss / sz as floats. */
KVQ_DEV void kvq_fmt_stage_linear(unsigned char *rows, float *ss, float *sz, const unsigned char *b, kvq_fmt f,
                                  int slot, int cap, int n, int h, int tid, int nthreads)
{
    /* per-token groups (kvq_fmt_quant_token_run); a page run is per channel only, so one page */
    const kvq_page_off o = kvq_page_offsets(f, KVQ_HKV, KVQ_D, cap);
    const int sb = kvq_fmt_staged_bits(f.kind, f.bits), cb = f.bits, ng = o.n_groups;
    const int scbpt = KVQ_D * sb / 8;
    const float off = f.kind == KVQ_FK_Q4_1 || f.kind == KVQ_FK_Q5_1 ? 0.0f : (float)(1 << (cb - 1));
    const unsigned char *codes = b + o.codes + ((long long)h * cap + slot) * o.cbpt;
    if (sb == cb) {
        kvq_stage_bytes(rows, codes, n * o.cbpt, tid, nthreads);
    } else {
#pragma unroll 1
        for (int i = tid; i < n * (scbpt / 4); i += nthreads) {
            const int t = i / (scbpt / 4), w = i % (scbpt / 4);
            const unsigned char *row = codes + (long long)t * o.cbpt;
            unsigned word = 0;
            for (int k = 0; k < 4; k++) word |= kvq_fmt_code_at(row, cb, KVQ_D, 4 * w + k) << (8 * k);
            ((unsigned *)rows)[i] = word;
        }
    }
#pragma unroll 1
    for (int j = tid; j < n * ng; j += nthreads) {
        const long long pi = ((long long)h * cap + slot) * ng + j;
        const float s = kvq_fmt_ld_scale(b + o.scale, pi, f.kind, f.sbytes);
        const float z = f.zbytes ? kvq_ld_par(b + o.zero, pi, f.zbytes) : 0.0f;
        ss[j] = s;
        sz[j] = __fsub_rn(z, __fmul_rn(s, off));
    }
}

/* Stages tokens [slot, slot + n) of an element-format page (and the pages of its run after it) for kv head h
 * as fp32 rows x = z + (s T) L[code]: the reference's value (runtime/quant.h kvq_format_dequant), bit for bit. */
KVQ_DEV void kvq_fmt_stage_page(unsigned char *rows, const unsigned char *b, kvq_fmt f, int slot, int cap, int n,
                                int h, int tid, int nthreads)
{
    const kvq_page_off o = kvq_page_offsets(f, KVQ_HKV, KVQ_D, cap);
    const long long stride = kvq_page_stride(o.total);
    const int pg0 = slot / cap, s0 = slot - pg0 * cap, np = n > 0 ? (s0 + n + cap - 1) / cap : 1;
    const int cb = f.bits;
    b += pg0 * stride;
    float *out = (float *)rows;
#pragma unroll 1
    for (int i = 0; i < np; i++, b += stride) {
        const int sl = i ? 0 : s0, t0 = i ? i * cap - s0 : 0, m = min(n - t0, cap - sl);
        const float T = kvq_fmt_page_T(b, f, o, h);
#pragma unroll 1
        for (int e = tid; e < m * KVQ_D; e += nthreads) {
            const int t = e / KVQ_D, c = e % KVQ_D, slt = sl + t;
            const unsigned code = kvq_fmt_code_at(b + o.codes + ((long long)h * cap + slt) * o.cbpt, cb, KVQ_D, c);
            long long pi;
            if (f.gran == 0)
                pi = (long long)h * KVQ_D + c;
            else
                pi = ((long long)h * cap + slt) * o.n_groups + c / f.group;
            const float s = kvq_fmt_ld_scale(b + o.scale, pi, f.kind, f.sbytes);
            const float z = f.zbytes ? kvq_ld_par(b + o.zero, pi, f.zbytes) : 0.0f;
            const float x = kvq_fmt_dequant(kvq_fmt_level(f.kind, cb, code, f.lv, f.n_levels), s, z, T);
            out[(long long)(t0 + t) * KVQ_D + c] = x;
        }
    }
}

#endif
