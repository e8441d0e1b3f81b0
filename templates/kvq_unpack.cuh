/* Unpacking 8 consecutive channels of one token's codes (bit order of layout/layout.h) into floats.
 *
 * No int -> float conversion instructions: a code c becomes the float 2^23 + c by OR-ing it into the mantissa
 * of 2^23 (0x4B000000) — one lop3 that also masks the field (4-bit, 2-bit, 1-bit) or one prmt that also picks
 * the byte (8-bit) — and one subtraction of 2^23, exact. The caller folds scales and zeros around the codes,
 * so the inner loops multiply-add on these values only. */
#ifndef KVQ_UNPACK_CUH
#define KVQ_UNPACK_CUH

#include "kvq_types.cuh"

#define KVQ_MAGIC 0x4B000000u
#define KVQ_MAGIC_F 8388608.0f
/* lop3 look-up table of (a & b) | c */
#define KVQ_LOP_AND_OR 0xEA

KVQ_DEV float kvq_magic_to_f(unsigned u) { return __uint_as_float(u) - KVQ_MAGIC_F; }

/* w holds 8 codes of `bits` (1, 2 or 4) bits from bit 0 up. */
KVQ_DEV void kvq_unpack8_word(unsigned w, int bits, float *cv)
{
    unsigned m = (1u << bits) - 1u;
#pragma unroll
    for (int v = 0; v < 8; v++) cv[v] = kvq_magic_to_f(kvq_lop3(w >> (v * bits), m, KVQ_MAGIC, KVQ_LOP_AND_OR));
}

/* 8-bit codes: prmt moves byte v of w under the exponent byte 0x4B taken from the second operand. */
KVQ_DEV void kvq_unpack8_bytes(unsigned w0, unsigned w1, float *cv)
{
#pragma unroll
    for (int v = 0; v < 4; v++) {
        cv[v] = kvq_magic_to_f(kvq_prmt(w0, KVQ_MAGIC, 0x7440u | (unsigned)v));
        cv[v + 4] = kvq_magic_to_f(kvq_prmt(w1, KVQ_MAGIC, 0x7440u | (unsigned)v));
    }
}

/* Channels c0 .. c0+7 (c0 a multiple of 8) of a token row of `bits`-bit codes for head_dim D, row 4-byte
 * aligned in shared memory. */
KVQ_DEV void kvq_unpack8(const unsigned char *row, int c0, int bits, int D, float *cv)
{
    const unsigned *w = (const unsigned *)row;
    if (bits == 8) {
        kvq_unpack8_bytes(w[c0 >> 2], w[(c0 >> 2) + 1], cv);
    } else if (bits == 3) {
        /* 2-bit plane (D/4 bytes) then the 1-bit plane of the high bits */
        unsigned lo = w[c0 >> 4] >> ((c0 & 15) * 2);
        unsigned hi = ((const unsigned *)(row + D / 4))[c0 >> 5] >> (c0 & 31);
#pragma unroll
        for (int v = 0; v < 8; v++) {
            unsigned c = kvq_lop3(lo >> (2 * v), 3u, KVQ_MAGIC, KVQ_LOP_AND_OR);
            cv[v] = kvq_magic_to_f(c | ((hi >> v) & 1u) << 2);
        }
    } else {
        int bit = c0 * bits;
        kvq_unpack8_word(w[bit >> 5] >> (bit & 31), bits, cv);
    }
}

/* Pre-shifted unpacking of 1, 2 and 4-bit codes: the lop3 masks the field where it already sits (mask << k)
 * instead of shifting the word for every code, so code v of a run of 8 becomes c 2^k(v) exactly (c 2^k < 2^15,
 * inside the 23 mantissa bits of the magic float) for at most one shift a run. The caller scales the operand
 * it multiplies by 2^-k(v) once per tile (exact: a power of two), so every product, and every fma that takes
 * it, is bit-identical to the unshifted one. k(v) = bits v, except for 4-bit codes, whose upper four sit in
 * the word's upper half and are shifted down together: k = 4 (v mod 4). */
KVQ_DEV int kvq_preshift_ok(int bits) { return bits == 1 || bits == 2 || bits == 4; }
KVQ_DEV int kvq_preshift_k(int bits, int v) { return bits == 4 ? 4 * (v & 3) : bits * v; }
/* 2^-k(c mod 8) for the channel c, or 1 when the width is not pre-shifted */
KVQ_DEV float kvq_preshift_inv(int bits, int c)
{
    return kvq_preshift_ok(bits) ? __uint_as_float((unsigned)(127 - kvq_preshift_k(bits, c & 7)) << 23) : 1.0f;
}

KVQ_DEV void kvq_unpack8_ps(const unsigned char *row, int c0, int bits, float *cv)
{
    const unsigned *w = (const unsigned *)row;
    const unsigned m = (1u << bits) - 1u;
    if (bits == 4) {
        const unsigned lo = w[c0 >> 3], hi = lo >> 16;
#pragma unroll
        for (int v = 0; v < 8; v++)
            cv[v] = kvq_magic_to_f(kvq_lop3(v < 4 ? lo : hi, m << kvq_preshift_k(4, v), KVQ_MAGIC, KVQ_LOP_AND_OR));
    } else {
        const int bit = c0 * bits;
        const unsigned x = w[bit >> 5] >> (bit & 31);
#pragma unroll
        for (int v = 0; v < 8; v++)
            cv[v] = kvq_magic_to_f(kvq_lop3(x, m << kvq_preshift_k(bits, v), KVQ_MAGIC, KVQ_LOP_AND_OR));
    }
}

/* 8 fp16 values from a 16-byte aligned shared address. */
KVQ_DEV void kvq_unpack8_half(const unsigned char *p, float *cv)
{
    uint4 u = *(const uint4 *)p;
    float2 a = kvq_h22f2(kvq_bits_h2(u.x)), b = kvq_h22f2(kvq_bits_h2(u.y));
    float2 c = kvq_h22f2(kvq_bits_h2(u.z)), d = kvq_h22f2(kvq_bits_h2(u.w));
    cv[0] = a.x, cv[1] = a.y, cv[2] = b.x, cv[3] = b.y;
    cv[4] = c.x, cv[5] = c.y, cv[6] = d.x, cv[7] = d.y;
}

/* Eight fp32 values of a staged fp32 row (element formats other than the linear ones, kvq_format.cuh), 16-byte
 * aligned */
KVQ_DEV void kvq_unpack8_f32(const unsigned char *p, float *cv)
{
    const float4 a = *(const float4 *)p, b = *(const float4 *)(p + 16);
    cv[0] = a.x, cv[1] = a.y, cv[2] = a.z, cv[3] = a.w;
    cv[4] = b.x, cv[5] = b.y, cv[6] = b.z, cv[7] = b.w;
}

#endif
