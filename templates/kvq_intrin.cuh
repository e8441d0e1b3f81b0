/* kvq_intrin.cuh: the one header through which kvq's CUDA templates reach inline PTX and 16-bit floats.
 *
 * Kernel sources are C-subset CUDA compiled two ways, from the same text:
 *   - by NVRTC (or nvcc) for the GPU: __CUDACC__ is defined and everything below is inline PTX;
 *   - by the host C++ compiler for the SIMT emulator (tests/emu, docs/emulator.md): this header then includes
 *     emu_cuda.h (put tests/emu on the include path), which supplies the CUDA built-ins, and each wrapper calls
 *     the emulator's bit-exact software version instead.
 * No CUDA toolkit header is used on either side: fp16 / bf16 values are the kvq_half / kvq_bf16 structs below
 * (raw bits; arithmetic goes through float or the f16x2 / bf16x2 wrappers).
 *
 * What a kernel source may use from here:
 *   kvq_half, kvq_half2, kvq_bf16, kvq_bf162          raw 16-bit floats; .x is the low half of a pair
 *   kvq_h2f, kvq_f2h, kvq_bf2f, kvq_f2bf              cvt.f32.f16 / cvt.rn.f16.f32 / shift / cvt.rn.bf16.f32
 *   kvq_f2h2(lo, hi), kvq_f2bf2(lo, hi)               cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32
 *   kvq_h22f2, kvq_bf22f2                             pair -> float2
 *   kvq_hfma2, kvq_hmul2, kvq_hadd2, kvq_bffma2       fma.rn / mul.rn / add.rn .f16x2, fma.rn.bf16x2
 *   kvq_h2_bits, kvq_bits_h2, kvq_bf2_bits, kvq_bits_bf2   pair <-> 32-bit register
 *   kvq_cp_async4/8/16(dst, src), kvq_cp_async16_zfill(dst, src, src_bytes)   shared <- global
 *   kvq_cp_async_commit(), kvq_cp_async_wait_group(N) (N a literal), kvq_cp_async_wait_all()
 *   kvq_lop3(a, b, c, LUT) (LUT a constant), kvq_prmt(a, b, selector)
 *   kvq_mma_m16n8k16(acc[4], a[4], b[2])             mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, acc += A B
 *                                                     in place (warp-collective: all 32 lanes, converged); fragment
 *                                                     layout in tests/emu/emu_abi.h (emu_mma_frag), from the PTX
 *                                                     ISA. The emulator adds the 16 exact products to acc one at a
 *                                                     time in fp32, k ascending; the hardware's internal order and
 *                                                     rounding are undocumented (docs/cuda.md, "Tensor cores")
 *   kvq_ex2(x)                                        ex2.approx.ftz.f32 (2^x, ~2 ulp, -inf -> +0); the emulator
 *                                                     computes exp2f (correctly rounded or within 1 ulp): a
 *                                                     documented tolerance, docs/cuda.md
 *   kvq_dmul(a, b)                                    mul.rn.f64: never fused into an fma (policy kernels
 *                                                     reproduce the host's separately rounded a * b - c)
 *   KVQ_DYNAMIC_SHARED(type, name)   declares `type *name` at the block's dynamic shared memory
 *   KVQ_KERNEL_EXPORT(name);         after each extern "C" __global__ entry point (the emulator's launch handle)
 * Needs sm_80 or newer (cp.async, bf16 conversions). */
#ifndef KVQ_INTRIN_CUH
#define KVQ_INTRIN_CUH

#if !defined(__CUDACC__)
#include "emu_cuda.h"
#endif

struct __align__(2) kvq_half { unsigned short bits; };
struct __align__(2) kvq_bf16 { unsigned short bits; };
struct __align__(4) kvq_half2 { kvq_half x, y; };
struct __align__(4) kvq_bf162 { kvq_bf16 x, y; };

static __device__ __forceinline__ unsigned kvq_h2_bits(kvq_half2 v) { return (unsigned)v.x.bits | (unsigned)v.y.bits << 16; }
static __device__ __forceinline__ unsigned kvq_bf2_bits(kvq_bf162 v) { return (unsigned)v.x.bits | (unsigned)v.y.bits << 16; }
static __device__ __forceinline__ kvq_half2 kvq_bits_h2(unsigned u)
{
    kvq_half2 v;
    v.x.bits = (unsigned short)(u & 0xffffu);
    v.y.bits = (unsigned short)(u >> 16);
    return v;
}
static __device__ __forceinline__ kvq_bf162 kvq_bits_bf2(unsigned u)
{
    kvq_bf162 v;
    v.x.bits = (unsigned short)(u & 0xffffu);
    v.y.bits = (unsigned short)(u >> 16);
    return v;
}

#if defined(__CUDACC__) /* ------------------------------------------------------------------------ GPU */

static __device__ __forceinline__ float kvq_h2f(kvq_half h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
}
static __device__ __forceinline__ kvq_half kvq_f2h(float f)
{
    kvq_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}
static __device__ __forceinline__ float kvq_bf2f(kvq_bf16 b) { return __uint_as_float((unsigned)b.bits << 16); }
static __device__ __forceinline__ kvq_bf16 kvq_f2bf(float f)
{
    kvq_bf16 b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(f));
    return b;
}
/* cvt.rn.f16x2.f32 d, a, b puts a in the upper half */
static __device__ __forceinline__ kvq_half2 kvq_f2h2(float lo, float hi)
{
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return kvq_bits_h2(r);
}
static __device__ __forceinline__ kvq_bf162 kvq_f2bf2(float lo, float hi)
{
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return kvq_bits_bf2(r);
}
static __device__ __forceinline__ kvq_half2 kvq_hfma2(kvq_half2 a, kvq_half2 b, kvq_half2 c)
{
    unsigned r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(kvq_h2_bits(a)), "r"(kvq_h2_bits(b)), "r"(kvq_h2_bits(c)));
    return kvq_bits_h2(r);
}
static __device__ __forceinline__ kvq_half2 kvq_hmul2(kvq_half2 a, kvq_half2 b)
{
    unsigned r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(kvq_h2_bits(a)), "r"(kvq_h2_bits(b)));
    return kvq_bits_h2(r);
}
static __device__ __forceinline__ kvq_half2 kvq_hadd2(kvq_half2 a, kvq_half2 b)
{
    unsigned r;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(kvq_h2_bits(a)), "r"(kvq_h2_bits(b)));
    return kvq_bits_h2(r);
}
static __device__ __forceinline__ kvq_bf162 kvq_bffma2(kvq_bf162 a, kvq_bf162 b, kvq_bf162 c)
{
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(kvq_bf2_bits(a)), "r"(kvq_bf2_bits(b)), "r"(kvq_bf2_bits(c)));
    return kvq_bits_bf2(r);
}

/* the builtin, not inline cvta: NVVM sees the extern __shared__ base through it and keeps 32-bit shared offsets
 * (inline asm made every cp.async of a loop recompute the window base with two S2R and 64-bit adds) */
static __device__ __forceinline__ unsigned kvq_smem_addr_(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
static __device__ __forceinline__ void kvq_cp_async4(void *dst, const void *src)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(kvq_smem_addr_(dst)), "l"(src) : "memory");
}
static __device__ __forceinline__ void kvq_cp_async8(void *dst, const void *src)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(kvq_smem_addr_(dst)), "l"(src) : "memory");
}
static __device__ __forceinline__ void kvq_cp_async16(void *dst, const void *src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(kvq_smem_addr_(dst)), "l"(src) : "memory");
}
/* copies src_bytes (0..16) and zero-fills the rest of the 16 */
static __device__ __forceinline__ void kvq_cp_async16_zfill(void *dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(kvq_smem_addr_(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}
#define kvq_cp_async_commit() asm volatile("cp.async.commit_group;" ::: "memory")
#define kvq_cp_async_wait_group(n) asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory")
#define kvq_cp_async_wait_all() asm volatile("cp.async.wait_all;" ::: "memory")

template <unsigned LUT> static __device__ __forceinline__ unsigned kvq_lop3_(unsigned a, unsigned b, unsigned c)
{
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
    return d;
}
static __device__ __forceinline__ unsigned kvq_prmt(unsigned a, unsigned b, unsigned sel)
{
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

static __device__ __forceinline__ double kvq_dmul(double a, double b) { return __dmul_rn(a, b); }
static __device__ __forceinline__ void kvq_mma_m16n8k16(float acc[4], const unsigned a[4], const unsigned b[2])
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
static __device__ __forceinline__ float kvq_ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

#define KVQ_DYNAMIC_SHARED(type, name)                                                                         \
    extern __shared__ __align__(16) unsigned char kvq_dyn_smem_[];                                             \
    type *name = reinterpret_cast<type *>(kvq_dyn_smem_)
#define KVQ_KERNEL_EXPORT(name) static_assert(true, #name)

#else /* ------------------------------------------------------------------------------------- emulator */

static inline float kvq_h2f(kvq_half h) { return emu_h2f(h.bits); }
static inline kvq_half kvq_f2h(float f)
{
    kvq_half h;
    h.bits = emu_f2h_rn(f);
    return h;
}
static inline float kvq_bf2f(kvq_bf16 b) { return emu_bf2f(b.bits); }
static inline kvq_bf16 kvq_f2bf(float f)
{
    kvq_bf16 b;
    b.bits = emu_f2bf_rn(f);
    return b;
}
static inline kvq_half2 kvq_f2h2(float lo, float hi) { return kvq_bits_h2(emu_f2h_rn(lo) | (unsigned)emu_f2h_rn(hi) << 16); }
static inline kvq_bf162 kvq_f2bf2(float lo, float hi) { return kvq_bits_bf2(emu_f2bf_rn(lo) | (unsigned)emu_f2bf_rn(hi) << 16); }
static inline kvq_half2 kvq_hfma2(kvq_half2 a, kvq_half2 b, kvq_half2 c)
{
    kvq_half2 r;
    r.x.bits = emu_fma_small(emu_h2f(a.x.bits), emu_h2f(b.x.bits), emu_h2f(c.x.bits), 10, 5);
    r.y.bits = emu_fma_small(emu_h2f(a.y.bits), emu_h2f(b.y.bits), emu_h2f(c.y.bits), 10, 5);
    return r;
}
/* mul.rn: a*b + (-0) is a*b exactly, sign of zero included; add.rn: a*1 + b */
static inline kvq_half2 kvq_hmul2(kvq_half2 a, kvq_half2 b) { return kvq_hfma2(a, b, kvq_bits_h2(0x80008000u)); }
static inline kvq_half2 kvq_hadd2(kvq_half2 a, kvq_half2 b) { return kvq_hfma2(a, kvq_bits_h2(0x3c003c00u), b); }
static inline kvq_bf162 kvq_bffma2(kvq_bf162 a, kvq_bf162 b, kvq_bf162 c)
{
    kvq_bf162 r;
    r.x.bits = emu_fma_small(emu_bf2f(a.x.bits), emu_bf2f(b.x.bits), emu_bf2f(c.x.bits), 7, 8);
    r.y.bits = emu_fma_small(emu_bf2f(a.y.bits), emu_bf2f(b.y.bits), emu_bf2f(c.y.bits), 7, 8);
    return r;
}

#define kvq_cp_async4(dst, src) emu_cp_async_((dst), (src), 4, 4, __FILE__, __LINE__)
#define kvq_cp_async8(dst, src) emu_cp_async_((dst), (src), 8, 8, __FILE__, __LINE__)
#define kvq_cp_async16(dst, src) emu_cp_async_((dst), (src), 16, 16, __FILE__, __LINE__)
#define kvq_cp_async16_zfill(dst, src, src_bytes) emu_cp_async_((dst), (src), 16, (unsigned)(src_bytes), __FILE__, __LINE__)
#define kvq_cp_async_commit() emu_cp_async_commit()
#define kvq_cp_async_wait_group(n) emu_cp_async_wait_(n)
#define kvq_cp_async_wait_all() emu_cp_async_wait_(-1)

template <unsigned LUT> static inline unsigned kvq_lop3_(unsigned a, unsigned b, unsigned c) { return emu_lop3(a, b, c, LUT); }
static inline unsigned kvq_prmt(unsigned a, unsigned b, unsigned sel) { return emu_prmt(a, b, sel); }

/* one warp collective: the emulator gathers the 32 lanes' fragments and computes every lane's D at once */
static inline void emu_mma_m16n8k16_(float acc[4], const unsigned a[4], const unsigned b[2], const char *file, int line)
{
    struct emu_mma_frag f;
    memcpy(f.a, a, sizeof f.a);
    memcpy(f.b, b, sizeof f.b);
    memcpy(f.c, acc, sizeof f.c);
    emu_warp_(EMU_W_MMA, 0xffffffffu, (unsigned long long)(uintptr_t)&f, sizeof f, 0, 32, file, line);
    memcpy(acc, f.d, sizeof f.d);
}
#define kvq_mma_m16n8k16(acc, a, b) emu_mma_m16n8k16_((acc), (a), (b), __FILE__, __LINE__)

/* the unit is compiled with -ffp-contract=off (cu_emu.c), so a product is never fused */
static inline double kvq_dmul(double a, double b) { return a * b; }
/* ex2.approx.ftz: subnormal results flush to zero; the value is libm's exp2f (the GPU's is within 2 ulp) */
static inline float kvq_ex2(float x)
{
    float y = exp2f(x);
    return y < 1.17549435e-38f ? 0.0f : y;
}

#define KVQ_DYNAMIC_SHARED(type, name) type *name = static_cast<type *>(emu_blk_->dyn_smem)
#define KVQ_KERNEL_EXPORT(name) EMU_KERNEL_EXPORT(name)

#endif

#define kvq_lop3(a, b, c, lut) kvq_lop3_<(lut)>((a), (b), (c))

static __device__ __forceinline__ float2 kvq_h22f2(kvq_half2 v) { return make_float2(kvq_h2f(v.x), kvq_h2f(v.y)); }
static __device__ __forceinline__ float2 kvq_bf22f2(kvq_bf162 v) { return make_float2(kvq_bf2f(v.x), kvq_bf2f(v.y)); }

#endif
