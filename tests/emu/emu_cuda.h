/* The CUDA built-ins for the host compiler: with this header a C-subset CUDA translation unit compiles with g++
 * and runs under the emulator (emu.h). It is what NVRTC provides without includes: qualifiers, vector types,
 * threadIdx & co., barriers, warp collectives, atomics, __ldg, the usual intrinsics and math. kvq sources do not
 * include it directly: templates/kvq_intrin.cuh does when __CUDACC__ is not defined, and adds the kvq_* wrappers
 * (half/bf16, cp.async, lop3, prmt) on top of the emu_* hooks at the end of this file.
 *
 * __shared__ is static storage: one instance at a time, which is one per block since blocks run one after the
 * other. Every call that may switch fibers is fenced with a compiler memory barrier, so values in shared memory
 * are never kept in registers across a barrier (the compiler could otherwise prove that a non-escaping static is
 * out of reach of the runtime). */
#ifndef EMU_CUDA_H
#define EMU_CUDA_H

#ifndef __cplusplus
#error "emu_cuda.h: compile CUDA sources for the emulator as C++ (g++ -x c++)"
#endif

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "emu.h"
#include "emu_abi.h"
#include "emu_half.h"

/* ---- qualifiers ---- */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __shared__ static
#define __constant__
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __grid_constant__

#define EMU_FENCE_() __asm__ __volatile__("" ::: "memory")

/* ---- vector types (vector_types.h: same members, sizes and alignments) ---- */
#define EMU_VEC_(T, N, A2, A4)                                                                                 \
    struct __align__(sizeof(T)) N##1 { T x; };                                                                 \
    struct __align__(A2) N##2 { T x, y; };                                                                     \
    struct N##3 { T x, y, z; };                                                                                \
    struct __align__(A4) N##4 { T x, y, z, w; };                                                               \
    static inline N##1 make_##N##1(T x) { N##1 v = {x}; return v; }                                            \
    static inline N##2 make_##N##2(T x, T y) { N##2 v = {x, y}; return v; }                                    \
    static inline N##3 make_##N##3(T x, T y, T z) { N##3 v = {x, y, z}; return v; }                           \
    static inline N##4 make_##N##4(T x, T y, T z, T w) { N##4 v = {x, y, z, w}; return v; }
EMU_VEC_(signed char, char, 2, 4)
EMU_VEC_(unsigned char, uchar, 2, 4)
EMU_VEC_(short, short, 4, 8)
EMU_VEC_(unsigned short, ushort, 4, 8)
EMU_VEC_(int, int, 8, 16)
EMU_VEC_(unsigned int, uint, 8, 16)
EMU_VEC_(long long, longlong, 16, 16)
EMU_VEC_(unsigned long long, ulonglong, 16, 16)
EMU_VEC_(float, float, 8, 16)
EMU_VEC_(double, double, 16, 16)
#undef EMU_VEC_

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

/* ---- built-in variables: read-only values of the running fiber's thread and block ---- */
static inline uint3 emu_threadIdx_(void) { const emu_idx3 &i = emu_self_->tid; return make_uint3(i.x, i.y, i.z); }
static inline uint3 emu_blockIdx_(void) { const emu_idx3 &i = emu_blk_->bid; return make_uint3(i.x, i.y, i.z); }
static inline dim3 emu_blockDim_(void) { const emu_idx3 &i = emu_blk_->bdim; return dim3(i.x, i.y, i.z); }
static inline dim3 emu_gridDim_(void) { const emu_idx3 &i = emu_blk_->gdim; return dim3(i.x, i.y, i.z); }
#define threadIdx (emu_threadIdx_())
#define blockIdx (emu_blockIdx_())
#define blockDim (emu_blockDim_())
#define gridDim (emu_gridDim_())
#define warpSize 32

/* ---- block barriers: identified by file and line, so threads at different __syncthreads do not meet ---- */
static inline int emu_bar_(int kind, int pred, const char *file, int line)
{
    EMU_FENCE_();
    int r = emu_barrier(kind, pred, file, line);
    EMU_FENCE_();
    return r;
}
#define __syncthreads() ((void)emu_bar_(EMU_BAR_SYNC, 1, __FILE__, __LINE__))
#define __syncthreads_count(p) emu_bar_(EMU_BAR_COUNT, (p) != 0, __FILE__, __LINE__)
#define __syncthreads_and(p) emu_bar_(EMU_BAR_AND, (p) != 0, __FILE__, __LINE__)
#define __syncthreads_or(p) emu_bar_(EMU_BAR_OR, (p) != 0, __FILE__, __LINE__)

static inline void __threadfence_block(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_system(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#define __trap() emu_trap(__FILE__, __LINE__)

/* ---- warp collectives ---- */
static inline unsigned long long emu_warp_(int op, unsigned mask, unsigned long long v, unsigned size, int arg,
                                           int width, const char *file, int line)
{
    struct emu_warp_req r = {op, mask, v, size, arg, width, file, line};
    EMU_FENCE_();
    unsigned long long x = emu_warp(&r);
    EMU_FENCE_();
    return x;
}

/* __syncwarp() and __syncwarp(mask): a call on an object that remembers where it was written. */
struct emu_syncwarp_site_ {
    const char *file;
    int line;
    void operator()(unsigned mask = 0xffffffffu) const { emu_warp_(EMU_W_SYNC, mask, 0, 0, 0, 32, file, line); }
};
#define __syncwarp (emu_syncwarp_site_{__FILE__, __LINE__})

/* Shuffles: CUDA's overloads, operand moved as raw bits. */
#define EMU_SHFL_(T)                                                                                           \
    static inline T emu_shfl_(int op, const char *file, int line, unsigned mask, T var, int arg, int width = 32) \
    {                                                                                                          \
        unsigned long long b = 0;                                                                              \
        memcpy(&b, &var, sizeof var);                                                                          \
        b = emu_warp_(op, mask, b, sizeof var, arg, width, file, line);                                        \
        T r;                                                                                                   \
        memcpy(&r, &b, sizeof r);                                                                              \
        return r;                                                                                              \
    }
EMU_SHFL_(int)
EMU_SHFL_(unsigned int)
EMU_SHFL_(long)
EMU_SHFL_(unsigned long)
EMU_SHFL_(long long)
EMU_SHFL_(unsigned long long)
EMU_SHFL_(float)
EMU_SHFL_(double)
#undef EMU_SHFL_
#define __shfl_sync(...) emu_shfl_(EMU_W_IDX, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) emu_shfl_(EMU_W_UP, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) emu_shfl_(EMU_W_DOWN, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) emu_shfl_(EMU_W_XOR, __FILE__, __LINE__, __VA_ARGS__)

#define __ballot_sync(mask, pred) ((unsigned)emu_warp_(EMU_W_BALLOT, (mask), (pred) != 0, 4, 0, 32, __FILE__, __LINE__))
#define __any_sync(mask, pred) ((int)emu_warp_(EMU_W_ANY, (mask), (pred) != 0, 4, 0, 32, __FILE__, __LINE__))
#define __all_sync(mask, pred) ((int)emu_warp_(EMU_W_ALL, (mask), (pred) != 0, 4, 0, 32, __FILE__, __LINE__))

static inline unsigned emu_reduce_(int op, const char *file, int line, unsigned mask, unsigned v)
{
    return (unsigned)emu_warp_(op, mask, v, 4, 0, 32, file, line);
}
static inline unsigned emu_rmin_(const char *f, int l, unsigned mask, unsigned v) { return emu_reduce_(EMU_W_MIN_U, f, l, mask, v); }
static inline int emu_rmin_(const char *f, int l, unsigned mask, int v) { return (int)emu_reduce_(EMU_W_MIN_I, f, l, mask, (unsigned)v); }
static inline unsigned emu_rmax_(const char *f, int l, unsigned mask, unsigned v) { return emu_reduce_(EMU_W_MAX_U, f, l, mask, v); }
static inline int emu_rmax_(const char *f, int l, unsigned mask, int v) { return (int)emu_reduce_(EMU_W_MAX_I, f, l, mask, (unsigned)v); }
static inline unsigned emu_radd_(const char *f, int l, unsigned mask, unsigned v) { return emu_reduce_(EMU_W_ADD, f, l, mask, v); }
static inline int emu_radd_(const char *f, int l, unsigned mask, int v) { return (int)emu_reduce_(EMU_W_ADD, f, l, mask, (unsigned)v); }
#define __reduce_add_sync(mask, v) emu_radd_(__FILE__, __LINE__, (mask), (v))
#define __reduce_min_sync(mask, v) emu_rmin_(__FILE__, __LINE__, (mask), (v))
#define __reduce_max_sync(mask, v) emu_rmax_(__FILE__, __LINE__, (mask), (v))
#define __reduce_and_sync(mask, v) emu_reduce_(EMU_W_AND, __FILE__, __LINE__, (mask), (unsigned)(v))
#define __reduce_or_sync(mask, v) emu_reduce_(EMU_W_OR, __FILE__, __LINE__, (mask), (unsigned)(v))
#define __reduce_xor_sync(mask, v) emu_reduce_(EMU_W_XOR_R, __FILE__, __LINE__, (mask), (unsigned)(v))

#define EMU_MATCH_(T)                                                                                          \
    static inline unsigned emu_match_(const char *file, int line, unsigned mask, T v, int *pred)               \
    {                                                                                                          \
        unsigned long long b = 0;                                                                              \
        memcpy(&b, &v, sizeof v);                                                                              \
        unsigned r = (unsigned)emu_warp_(pred ? EMU_W_MATCH_ALL : EMU_W_MATCH_ANY, mask, b, sizeof v, 0, 32,   \
                                         file, line);                                                          \
        if (pred) *pred = r != 0;                                                                              \
        return r;                                                                                              \
    }
EMU_MATCH_(int)
EMU_MATCH_(unsigned int)
EMU_MATCH_(long)
EMU_MATCH_(unsigned long)
EMU_MATCH_(long long)
EMU_MATCH_(unsigned long long)
EMU_MATCH_(float)
EMU_MATCH_(double)
#undef EMU_MATCH_
#define __match_any_sync(mask, v) emu_match_(__FILE__, __LINE__, (mask), (v), (int *)0)
#define __match_all_sync(mask, v, pred) emu_match_(__FILE__, __LINE__, (mask), (v), (pred))

/* ---- atomics: fibers never run at the same time, so a plain read-modify-write is atomic ---- */
#define EMU_ATOMIC_(name, T, expr)                                                                             \
    static inline T name(T *p, T v)                                                                            \
    {                                                                                                          \
        T old = *p;                                                                                            \
        *p = (expr);                                                                                           \
        return old;                                                                                            \
    }
EMU_ATOMIC_(atomicAdd, int, (int)((unsigned)old + (unsigned)v))
EMU_ATOMIC_(atomicAdd, unsigned int, old + v)
EMU_ATOMIC_(atomicAdd, unsigned long long, old + v)
EMU_ATOMIC_(atomicAdd, float, old + v)
EMU_ATOMIC_(atomicAdd, double, old + v)
EMU_ATOMIC_(atomicSub, int, (int)((unsigned)old - (unsigned)v))
EMU_ATOMIC_(atomicSub, unsigned int, old - v)
EMU_ATOMIC_(atomicExch, int, v)
EMU_ATOMIC_(atomicExch, unsigned int, v)
EMU_ATOMIC_(atomicExch, unsigned long long, v)
EMU_ATOMIC_(atomicExch, float, v)
EMU_ATOMIC_(atomicMin, int, v < old ? v : old)
EMU_ATOMIC_(atomicMin, unsigned int, v < old ? v : old)
EMU_ATOMIC_(atomicMin, long long, v < old ? v : old)
EMU_ATOMIC_(atomicMin, unsigned long long, v < old ? v : old)
EMU_ATOMIC_(atomicMax, int, v > old ? v : old)
EMU_ATOMIC_(atomicMax, unsigned int, v > old ? v : old)
EMU_ATOMIC_(atomicMax, long long, v > old ? v : old)
EMU_ATOMIC_(atomicMax, unsigned long long, v > old ? v : old)
EMU_ATOMIC_(atomicInc, unsigned int, old >= v ? 0u : old + 1)
EMU_ATOMIC_(atomicDec, unsigned int, old == 0 || old > v ? v : old - 1)
EMU_ATOMIC_(atomicAnd, int, old & v)
EMU_ATOMIC_(atomicAnd, unsigned int, old & v)
EMU_ATOMIC_(atomicAnd, unsigned long long, old & v)
EMU_ATOMIC_(atomicOr, int, old | v)
EMU_ATOMIC_(atomicOr, unsigned int, old | v)
EMU_ATOMIC_(atomicOr, unsigned long long, old | v)
EMU_ATOMIC_(atomicXor, int, old ^ v)
EMU_ATOMIC_(atomicXor, unsigned int, old ^ v)
EMU_ATOMIC_(atomicXor, unsigned long long, old ^ v)
#undef EMU_ATOMIC_
#define EMU_CAS_(T)                                                                                            \
    static inline T atomicCAS(T *p, T compare, T v)                                                            \
    {                                                                                                          \
        T old = *p;                                                                                            \
        if (old == compare) *p = v;                                                                            \
        return old;                                                                                            \
    }
EMU_CAS_(int)
EMU_CAS_(unsigned int)
EMU_CAS_(unsigned long long)
EMU_CAS_(unsigned short)
#undef EMU_CAS_

/* ---- loads and stores with cache hints: plain memory here ---- */
template <class T> static inline T __ldg(const T *p) { return *p; }
template <class T> static inline T __ldcg(const T *p) { return *p; }
template <class T> static inline T __ldca(const T *p) { return *p; }
template <class T> static inline T __ldcs(const T *p) { return *p; }
template <class T> static inline T __ldlu(const T *p) { return *p; }
template <class T> static inline T __ldcv(const T *p) { return *p; }
template <class T> static inline void __stcg(T *p, T v) { *p = v; }
template <class T> static inline void __stcs(T *p, T v) { *p = v; }
template <class T> static inline void __stwb(T *p, T v) { *p = v; }
template <class T> static inline void __stwt(T *p, T v) { *p = v; }

/* ---- integer intrinsics ---- */
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __brev(unsigned x)
{
    x = (x >> 1 & 0x55555555u) | (x & 0x55555555u) << 1;
    x = (x >> 2 & 0x33333333u) | (x & 0x33333333u) << 2;
    x = (x >> 4 & 0x0f0f0f0fu) | (x & 0x0f0f0f0fu) << 4;
    return __builtin_bswap32(x);
}
static inline unsigned long long __brevll(unsigned long long x)
{
    return (unsigned long long)__brev((unsigned)x) << 32 | __brev((unsigned)(x >> 32));
}
/* prmt.b32 in its default mode: each selector nibble picks one of the 8 bytes of {b,a}; bit 3 of the nibble
 * replicates that byte's sign bit instead. __byte_perm ignores bit 3 (CUDA: "only the low 3 bits"). */
static inline unsigned emu_prmt(unsigned a, unsigned b, unsigned sel)
{
    unsigned long long v = (unsigned long long)b << 32 | a;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) {
        unsigned s = sel >> (4 * i) & 0xf, byte = (unsigned)(v >> (8 * (s & 7))) & 0xff;
        if (s & 8) byte = byte & 0x80 ? 0xff : 0;
        r |= byte << (8 * i);
    }
    return r;
}
static inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) { return emu_prmt(a, b, s & 0x7777u); }
static inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s)
{
    return (unsigned)((((unsigned long long)hi << 32 | lo) << (s & 31)) >> 32);
}
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s)
{
    return (unsigned)(((unsigned long long)hi << 32 | lo) >> (s & 31));
}
static inline unsigned __funnelshift_lc(unsigned lo, unsigned hi, unsigned s) { return s >= 32 ? lo : __funnelshift_l(lo, hi, s); }
static inline unsigned __funnelshift_rc(unsigned lo, unsigned hi, unsigned s) { return s >= 32 ? hi : __funnelshift_r(lo, hi, s); }
static inline int __mulhi(int a, int b) { return (int)((long long)a * b >> 32); }
static inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)((unsigned long long)a * b >> 32); }
static inline long long __mul64hi(long long a, long long b) { return (long long)((__int128)a * b >> 64); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b)
{
    return (unsigned long long)((unsigned __int128)a * b >> 64);
}
static inline int __mul24(int a, int b) /* low 32 bits of the product of the sign-extended low 24 bits */
{
    long long x = (int)((unsigned)a << 8) >> 8, y = (int)((unsigned)b << 8) >> 8;
    return (int)(unsigned)(unsigned long long)(x * y);
}
static inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }
static inline int __hadd(int a, int b) { return (int)(((long long)a + b) >> 1); }
static inline int __rhadd(int a, int b) { return (int)(((long long)a + b + 1) >> 1); }
static inline unsigned __uhadd(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a + b) >> 1); }
static inline unsigned __urhadd(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a + b + 1) >> 1); }
static inline unsigned __sad(int a, int b, unsigned c) { return c + (unsigned)(a > b ? (long long)a - b : (long long)b - a); }
static inline unsigned __usad(unsigned a, unsigned b, unsigned c) { return c + (a > b ? a - b : b - a); }

/* min/max: CUDA's overloads (std:: is not in scope in kernel code) */
#define EMU_MINMAX_(T)                                                                                         \
    static inline T min(T a, T b) { return a < b ? a : b; }                                                    \
    static inline T max(T a, T b) { return a > b ? a : b; }
EMU_MINMAX_(int)
EMU_MINMAX_(unsigned int)
EMU_MINMAX_(long)
EMU_MINMAX_(unsigned long)
EMU_MINMAX_(long long)
EMU_MINMAX_(unsigned long long)
#undef EMU_MINMAX_
static inline unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
static inline unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
static inline unsigned max(int a, unsigned b) { return max((unsigned)a, b); }
static inline unsigned max(unsigned a, int b) { return max(a, (unsigned)b); }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }

/* ---- bit casts and conversions ---- */
#define EMU_BITCAST_(name, From, To)                                                                           \
    static inline To name(From v)                                                                              \
    {                                                                                                          \
        To r;                                                                                                  \
        memcpy(&r, &v, sizeof r);                                                                              \
        return r;                                                                                              \
    }
EMU_BITCAST_(__float_as_int, float, int)
EMU_BITCAST_(__float_as_uint, float, unsigned int)
EMU_BITCAST_(__int_as_float, int, float)
EMU_BITCAST_(__uint_as_float, unsigned int, float)
EMU_BITCAST_(__double_as_longlong, double, long long)
EMU_BITCAST_(__longlong_as_double, long long, double)
#undef EMU_BITCAST_

/* float -> int conversions saturate and send NaN to 0, as cvt.rni.s32.f32 and friends do */
static inline int emu_f2i_(double r)
{
    return r != r ? 0 : r >= 2147483647.0 ? 2147483647 : r <= -2147483648.0 ? (-2147483647 - 1) : (int)r;
}
static inline unsigned emu_f2u_(double r) { return r != r || r <= 0 ? 0u : r >= 4294967295.0 ? 4294967295u : (unsigned)r; }
static inline int __float2int_rn(float x) { return emu_f2i_(nearbyint((double)x)); }
static inline int __float2int_rz(float x) { return emu_f2i_(trunc((double)x)); }
static inline int __float2int_rd(float x) { return emu_f2i_(floor((double)x)); }
static inline int __float2int_ru(float x) { return emu_f2i_(ceil((double)x)); }
static inline unsigned __float2uint_rn(float x) { return emu_f2u_(nearbyint((double)x)); }
static inline unsigned __float2uint_rz(float x) { return emu_f2u_(trunc((double)x)); }
static inline float __int2float_rn(int x) { return (float)x; }
static inline float __uint2float_rn(unsigned x) { return (float)x; }

/* ---- float intrinsics. Exact ones are exact; the approximate ones (__expf, __logf, ...) use libm, which is
 * within the GPU's documented error of the true value but not bit-identical to the SFU. ---- */
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __saturatef(float x) { return x != x || x <= 0.0f ? 0.0f : x >= 1.0f ? 1.0f : x; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
/* glibc declares these names itself (as aliases of expf & co.), so CUDA's spellings are macros here. */
static inline float emu_expf_(float x) { return exp2f(x * 1.4426950408889634f); } /* ex2.approx(x * log2 e) */
static inline float emu_exp10f_(float x) { return exp2f(x * 3.3219280948873622f); }
static inline float emu_logf_(float x) { return log2f(x) * 0.6931471805599453f; }
static inline float emu_log10f_(float x) { return log2f(x) * 0.3010299956639812f; }
static inline float emu_powf_(float x, float y) { return exp2f(y * log2f(x)); }
static inline void emu_sincosf_(float x, float *s, float *c)
{
    *s = sinf(x);
    *c = cosf(x);
}
#define __expf(x) emu_expf_(x)
#define __exp10f(x) emu_exp10f_(x)
#define __logf(x) emu_logf_(x)
#define __log2f(x) log2f(x)
#define __log10f(x) emu_log10f_(x)
#define __powf(x, y) emu_powf_((x), (y))
#define __sinf(x) sinf(x)
#define __cosf(x) cosf(x)
#define __tanf(x) tanf(x)
#define __sincosf(x, s, c) emu_sincosf_((x), (s), (c))
/* x * rcp.approx(y): the reciprocal of |y| in (2^126, 2^128) flushes to zero (CUDA math API notes) */
static inline float __fdividef(float x, float y)
{
    float ay = fabsf(y);
    if (ay > 8.507059173023462e37f && ay < INFINITY) return isinf(x) ? NAN : x * copysignf(0.0f, y);
    return x / y;
}

/* ---- emulator hooks for what the GPU does with inline PTX (kvq_intrin.cuh wraps them) ---- */
static inline void emu_cp_async_(void *dst, const void *src, unsigned size, unsigned src_size, const char *file,
                                 int line)
{
    emu_cp_async(dst, src, size, src_size, file, line);
}
static inline void emu_cp_async_wait_(int n)
{
    EMU_FENCE_();
    emu_cp_async_wait(n);
    EMU_FENCE_();
}
/* lop3.b32: bit i of the result is bit (a_i*4 + b_i*2 + c_i) of the lookup table */
static inline unsigned emu_lop3(unsigned a, unsigned b, unsigned c, unsigned lut)
{
    unsigned r = 0;
    for (unsigned k = 0; k < 8; k++)
        if (lut >> k & 1) r |= (k & 4 ? a : ~a) & (k & 2 ? b : ~b) & (k & 1 ? c : ~c);
    return r;
}

/* ---- entry points: what KVQ_KERNEL_EXPORT(name) defines (see emu.h) ---- */
template <class T> struct emu_unconst_ { typedef T type; };
template <class T> struct emu_unconst_<const T> { typedef T type; };
template <class F, F f> struct emu_thunk_;
template <class P, void (*f)(P)> struct emu_thunk_<void (*)(P), f> {
    static void call(const void *params) { f(*static_cast<const typename emu_unconst_<P>::type *>(params)); }
    static const size_t size = sizeof(P);
};
template <void (*f)()> struct emu_thunk_<void (*)(), f> {
    static void call(const void *) { f(); }
    static const size_t size = 0;
};
#define EMU_KERNEL_EXPORT(name)                                                                                \
    extern "C" const struct emu_kernel name##__emu = {#name, &emu_thunk_<decltype(&name), &name>::call,       \
                                                      emu_thunk_<decltype(&name), &name>::size}

#endif
