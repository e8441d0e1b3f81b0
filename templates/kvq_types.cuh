/* Device helpers shared by every kvq kernel: element loads of the three input dtypes, parameter loads and
 * stores, the quantizer of runtime/quant.h reproduced operation by operation (codes must be bit-exact with the
 * reference backend), and cooperative global -> shared copies with 16-byte cp.async where alignment allows.
 *
 * Plan constants used here (from the generated prelude): KVQ_D (head_dim), KVQ_IN_DTYPE (0 fp32, 1 fp16,
 * 2 bf16: the element type of K/V/Q rows handed to the kernels). */
#ifndef KVQ_TYPES_CUH
#define KVQ_TYPES_CUH

#include "kvq_intrin.cuh"
#include "kvq_layout.cuh"
#include "kvq_params.cuh"

#define KVQ_DEV static __device__ __forceinline__
#define KVQ_NEG_INF (__uint_as_float(0xff800000u))
#define KVQ_FULL_MASK 0xffffffffu

KVQ_DEV float kvq_ld_half(const void *p, long long i) { return kvq_h2f(((const kvq_half *)p)[i]); }

/* Element i of a row buffer: fp16 windows, or the plan's input dtype. */
KVQ_DEV float kvq_ld_elem(const void *p, long long i, int f16)
{
    if (f16 || KVQ_IN_DTYPE == 1) return kvq_h2f(((const kvq_half *)p)[i]);
    if (KVQ_IN_DTYPE == 2) return kvq_bf2f(((const kvq_bf16 *)p)[i]);
    return ((const float *)p)[i];
}

/* First element of row (h, t) of a kvq_rows source of n tokens per head (kvq_params.cuh). */
KVQ_DEV long long kvq_row_at(const kvq_rows *r, int h, int t, int n)
{
    long long row;
    if (r->gather)
        row = ((const int *)r->gather)[(long long)h * n + t];
    else if (r->ring)
        row = (r->first + t) % r->ring;
    else
        row = r->first + t;
    return ((long long)h * r->head_stride + row) * KVQ_D;
}

KVQ_DEV float kvq_src_ld(const kvq_rows *r, long long row0, int c)
{
    return kvq_ld_elem((const void *)r->base, row0 + c, r->f16);
}

/* Scale / zero / factor entries: fp16 or fp32. */
KVQ_DEV float kvq_ld_par(const unsigned char *p, long long i, int bytes)
{
    if (bytes == 4) return ((const float *)p)[i];
    return kvq_h2f(((const kvq_half *)p)[i]);
}
/* Where page i of a tile's pages lands its raw parameter bytes in a stage's raw part, the range's first byte at
 * offset `first` of the tile's parameters: al16(first) + 64 i (plan.c store_raw: 64 bytes a page of slack for the
 * range's two partial 16-byte blocks). The staging and every reader of raw parameters use it. */
KVQ_DEV long long kvq_raw_page(long long first, int i) { return kvq_al16(first) + 64 * i; }
KVQ_DEV void kvq_st_par(unsigned char *p, long long i, int bytes, float v)
{
    if (bytes == 4)
        ((float *)p)[i] = v;
    else
        ((kvq_half *)p)[i] = kvq_f2h(v); /* exact: v was rounded to fp16 already */
}

/* ---- the quantizer (runtime/quant.c, step for step) ---- */

KVQ_DEV int kvq_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

KVQ_DEV float kvq_h16(unsigned short bits)
{
    kvq_half h;
    h.bits = bits;
    return kvq_h2f(h);
}

/* The fp16 neighbour of an fp16 value r: bit steps are ordered for positive values, reversed for negative. */
KVQ_DEV float kvq_f16_step(float r, int up)
{
    unsigned short h = kvq_f2h(r).bits;
    int neg = (h & 0x8000) != 0;
    if ((h & 0x7fff) == 0) return kvq_h16(up ? 0x0001 : 0x8001);
    h = (unsigned short)(up != neg ? h + 1 : h - 1);
    return kvq_h16(h);
}

KVQ_DEV float kvq_round_down(float x, int f32)
{
    if (f32 || !kvq_finite(x)) return x;
    float r = kvq_h2f(kvq_f2h(x));
    return r > x ? kvq_f16_step(r, 0) : r;
}

KVQ_DEV float kvq_round_up(float x, int f32)
{
    if (f32 || !kvq_finite(x)) return x;
    float r = kvq_h2f(kvq_f2h(x));
    return r < x ? kvq_f16_step(r, 1) : r;
}

/* kvq_qparams_fit: z = min rounded down, s = (max - z) / L rounded up; s = 0 for a constant group; an fp16
 * scale saturates at 65504 instead of becoming inf (1-bit groups wider than 65504, runtime/quant.h). */
KVQ_DEV void kvq_fit(float mn, float mx, int bits, int s_f32, int z_f32, float *s, float *z)
{
    float L = (float)((1u << bits) - 1u);
    *z = kvq_round_down(mn, z_f32);
    *s = mx <= *z ? 0.0f : kvq_round_up(__fdiv_rn(__fsub_rn(mx, *z), L), s_f32);
    if (!s_f32 && *s > 65504.0f) *s = 65504.0f;
}

/* kvq_quant_code: clamp(rint((x - z) / s), 0, L) with a correctly rounded division; NaN -> 0. */
KVQ_DEV unsigned kvq_code(float x, float s, float z, int bits)
{
    unsigned L = (1u << bits) - 1u;
    if (s == 0.0f) return 0u;
    float v = rintf(__fdiv_rn(__fsub_rn(x, z), s));
    if (!(v > 0.0f)) return 0u;
    if (v >= (float)L) return L;
    return (unsigned)v;
}

/* kvq_channel_factor: sqrt(absmax) rounded to the scale dtype, 1 for an all-zero channel. */
KVQ_DEV float kvq_factor(float absmax, int f32)
{
    if (!(absmax > 0.0f)) return 1.0f;
    float c = __fsqrt_rn(absmax);
    if (!f32) c = kvq_h2f(kvq_f2h(c));
    return c > 0.0f ? c : 1.0f;
}

/* ---- cooperative copies into shared memory ---- */

/* a / b (a >= 0, b > 0) and a % b in *r for page capacities b: a shift and a mask when b is a power of two (every
 * KIVI page: groups of 32, value pages of tiles), else by subtraction where the quotient is small, else a
 * division. An integer division by a value known only at run time is ~20 instructions, and a tile took five of
 * them (its first page and page count in each staging pass, the fold's and q.K's pages: ~5 warp-instructions a
 * token at 4k tokens). */
KVQ_DEV int kvq_divmod(int a, int b, int *r)
{
    if ((b & (b - 1)) == 0) {
        *r = a & (b - 1);
        return a >> __popc((unsigned)(b - 1));
    }
    int q = 0;
    if (a < 4 * b) {
#pragma unroll 1
        while (a >= b) a -= b, q++;
    } else {
        q = a / b, a -= q * b;
    }
    *r = a;
    return q;
}

/* Copies `bytes` (a multiple of 4) from global src to 16-byte aligned shared dst with cp.async: 16 bytes per
 * request when src is 16-byte aligned, else 8 or 4. The caller commits, waits and syncs. */
KVQ_DEV void kvq_stage_bytes(unsigned char *dst, const unsigned char *src, int bytes, int tid, int nthreads)
{
    kvq_u64 a = (kvq_u64)src;
    if ((a & 15) == 0) {
        int n16 = bytes >> 4;
        /* a few iterations a tile (2 for a 128-token tile of 2-bit codes at head_dim 128): not unrolled */
#pragma unroll 1
        for (int i = tid; i < n16; i += nthreads) kvq_cp_async16(dst + 16 * i, src + 16 * i);
#pragma unroll 1
        for (int i = (n16 << 2) + tid; i < (bytes >> 2); i += nthreads) kvq_cp_async4(dst + 4 * i, src + 4 * i);
    } else if ((a & 7) == 0) {
        int n8 = bytes >> 3;
        for (int i = tid; i < n8; i += nthreads) kvq_cp_async8(dst + 8 * i, src + 8 * i);
        for (int i = (n8 << 1) + tid; i < (bytes >> 2); i += nthreads) kvq_cp_async4(dst + 4 * i, src + 4 * i);
    } else {
        for (int i = tid; i < (bytes >> 2); i += nthreads) kvq_cp_async4(dst + 4 * i, src + 4 * i);
    }
}

#endif
