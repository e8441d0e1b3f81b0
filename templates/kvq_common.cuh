/* Entry points that depend only on the model dimensions: the split-KV merge, fp16 row stores, the prompt's
 * absolute maxima of a tensor scale, and the parameter-layout signature the host checks before its first launch
 * (kvq_params.cuh). */
#ifndef KVQ_COMMON_CUH
#define KVQ_COMMON_CUH

#include "kvq_decode.cuh"
#include "kvq_quantize.cuh"

extern "C" __global__ void __launch_bounds__(256) kvq_merge(const kvq_decode_params p) { kvq_merge_body(&p); }
KVQ_KERNEL_EXPORT(kvq_merge);

extern "C" __global__ void __launch_bounds__(128) kvq_store_f16(const kvq_store_params p) { kvq_store_f16_body(&p); }
KVQ_KERNEL_EXPORT(kvq_store_f16);

/* A planned step's fp16 row stores (kvq_list_params): the new tokens into their windows, sinks or fp16 pages, and
 * fp16 page writes of a flush. grid (kv_heads, 1, n_items). */
extern "C" __global__ void __launch_bounds__(128) kvq_store_f16_list(const kvq_list_params p)
{
    if ((int)blockIdx.z >= p.n_items) return;
    const kvq_store_params sp = ((const kvq_store_params *)p.items)[blockIdx.z];
    if (sp.n > 0) kvq_store_f16_body(&sp);
}
KVQ_KERNEL_EXPORT(kvq_store_f16_list);

/* Strided fp32/fp16/bf16 rows to strided fp32/fp16/bf16 rows (kvq_convert_params): the device-tensor entry
 * points' q, k, v in, outputs and lse out. The conversions are the host's (exact widening, round to nearest even
 * narrowing), so the device path stores and attends to what the host-pointer path does, bit for bit. */
static __device__ __forceinline__ float kvq_cvt_load(kvq_u64 base, int dtype, long long i)
{
    if (dtype == 1) return kvq_h2f(((const kvq_half *)base)[i]);
    if (dtype == 2) return kvq_bf2f(((const kvq_bf16 *)base)[i]);
    return ((const float *)base)[i];
}

/* Row (t, h) of a conversion, its elements strided over the block's threads. */
KVQ_DEV void kvq_convert_row(const kvq_convert_params *p, long long t, long long h)
{
    for (int d = threadIdx.x; d < p->dim; d += blockDim.x) {
        float x = kvq_cvt_load(p->src, p->src_dtype, t * p->src_ts + h * p->src_hs + d) * p->mul;
        long long o = t * p->dst_ts + h * p->dst_hs + d;
        if (p->dst_dtype == 1)
            ((kvq_half *)p->dst)[o] = kvq_f2h(x);
        else if (p->dst_dtype == 2)
            ((kvq_bf16 *)p->dst)[o] = kvq_f2bf(x);
        else
            ((float *)p->dst)[o] = x;
    }
}

extern "C" __global__ void __launch_bounds__(128) kvq_convert_rows(const kvq_convert_params p)
{
    for (long long t = blockIdx.y; t < p.n; t += gridDim.y) kvq_convert_row(&p, t, blockIdx.x);
}
KVQ_KERNEL_EXPORT(kvq_convert_rows);

/* A device step's inputs in one launch (kvq_step_in_params): at batch 1 a layer step was nine launches, seven of
 * them a few blocks each (docs/gpu-results.md run 8), and the conversions, the new tokens' stores and the tile
 * patches depend on nothing of each other. One block a row: the conversions' rows (q, k, v: cv[j], n x heads[j]
 * rows), then every kv head of the store items, then the tile patches. A store item whose rows lie in the
 * converted k, v buffer (kvin, [n][2][kv_heads][D] fp16, which this launch writes) reads the caller's row through
 * the same conversion instead: f2h(x) is what the stored row f2h(h2f(f2h(x))) would be, bit for bit. */
KVQ_DEV void kvq_step_in_store(const kvq_step_in_params *p, const kvq_store_params *sp, int h)
{
    const kvq_u64 kvin = p->cv[1].dst; /* K then V rows of each token: cv[1].dst_ts = 2 H D elements */
    const int H = p->heads[1];
    const long long kvin_elems = (long long)p->cv[1].n * p->cv[1].dst_ts;
    for (int t = 0; t < sp->n; t++) {
        kvq_half *dst = kvq_store_dst(sp, h, t);
        const long long row0 = kvq_row_at(&sp->src, h, t, sp->n);
        const long long e = sp->src.f16 && sp->src.base >= kvin ? (long long)(sp->src.base - kvin) / 2 + row0 : -1;
        if (e >= 0 && e < kvin_elems) {
            const long long R = e / KVQ_D; /* kvin row: token i = R / 2H, K or V = R / H mod 2, head R mod H */
            const kvq_convert_params *cv = &p->cv[1 + (int)(R / H % 2)];
            const long long i = R / (2 * H), hh = R % H;
            for (int c = threadIdx.x; c < KVQ_D; c += blockDim.x)
                dst[c] = kvq_f2h(kvq_cvt_load(cv->src, cv->src_dtype, i * cv->src_ts + hh * cv->src_hs + c) * cv->mul);
        } else {
            for (int c = threadIdx.x; c < KVQ_D; c += blockDim.x) dst[c] = kvq_f2h(kvq_src_ld(&sp->src, row0, c));
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) kvq_step_in(const kvq_step_in_params p)
{
    long long b = blockIdx.x;
    for (int j = 0; j < 3; j++) {
        const long long rows = (long long)p.cv[j].n * p.heads[j];
        if (b < rows) {
            kvq_convert_row(&p.cv[j], b / p.heads[j], b % p.heads[j]);
            return;
        }
        b -= rows;
    }
    const int H = p.heads[1];
    if (b < (long long)p.n_stores * H) {
        const kvq_store_params sp = ((const kvq_store_params *)p.stores)[b / H];
        if (sp.n > 0) kvq_step_in_store(&p, &sp, (int)(b % H));
        return;
    }
    b -= (long long)p.n_stores * H;
    if (b < p.n_patches) { /* a planned step's changes to the sequences' device tile lists (6 words a tile) */
        const kvq_tile_patch tp = ((const kvq_tile_patch *)p.patches)[b];
        const kvq_u64 *src = (const kvq_u64 *)tp.src;
        kvq_u64 *dst = (kvq_u64 *)tp.dst;
        const int words = tp.n * (int)(sizeof(kvq_tile) / sizeof(kvq_u64));
        for (int i = (int)threadIdx.x; i < words; i += (int)blockDim.x) dst[i] = src[i];
    }
}
KVQ_KERNEL_EXPORT(kvq_step_in);

/* The prompt's absolute maxima of a tensor whose element format takes its tensor scale from the prompt
 * (kvq_tamax_params, kvq_format.cuh). grid (kv_heads), block 128. */
extern "C" __global__ void __launch_bounds__(128) kvq_tensor_amax(const kvq_tamax_params p)
{
    __shared__ float red[128];
    kvq_tensor_amax_body(&p, red);
}
KVQ_KERNEL_EXPORT(kvq_tensor_amax);

/* Sizes and offsets of the parameter structs as this compilation lays them out (KVQ_PARAMS_SIG_LIST), and the
 * tensor-core probe (kvq_params.cuh: subnormal fp16 inputs, which kvq_mma.cuh's unpacking relies on). Block 32:
 * one warp, converged, as mma.sync needs. */
extern "C" __global__ void kvq_params_sig(const kvq_sig_params p)
{
    const long long sig[] = {KVQ_PARAMS_SIG_LIST};
    const unsigned a[4] = {KVQ_MMA_PROBE_A, KVQ_MMA_PROBE_A, KVQ_MMA_PROBE_A, KVQ_MMA_PROBE_A};
    const unsigned b[2] = {KVQ_MMA_PROBE_B, KVQ_MMA_PROBE_B};
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    kvq_mma_m16n8k16(acc, a, b);
    if (threadIdx.x == 0) {
        for (int i = 0; i < KVQ_PARAMS_SIG_N; i++) ((long long *)p.out)[i] = sig[i];
        ((long long *)p.out)[KVQ_PARAMS_SIG_N] = (long long)__float_as_uint(acc[0]);
    }
}
KVQ_KERNEL_EXPORT(kvq_params_sig);

#endif
