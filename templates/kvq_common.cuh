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

/* A planned step's tile patches (kvq_tile_patch): each sequence keeps its decode tiles on the device from step
 * to step, and the plan sends only the tiles that changed (the sinks' and pools', the tail after the last page
 * that can no longer change), copied here into place before the layer's decode launch. A tile is 6 words.
 * grid (1, 1, n_items). */
extern "C" __global__ void __launch_bounds__(128) kvq_tiles_patch(const kvq_list_params p)
{
    if ((int)blockIdx.z >= p.n_items) return;
    const kvq_tile_patch tp = ((const kvq_tile_patch *)p.items)[blockIdx.z];
    const kvq_u64 *src = (const kvq_u64 *)tp.src;
    kvq_u64 *dst = (kvq_u64 *)tp.dst;
    const int words = tp.n * (int)(sizeof(kvq_tile) / sizeof(kvq_u64));
    for (int i = (int)threadIdx.x; i < words; i += (int)blockDim.x) dst[i] = src[i];
}
KVQ_KERNEL_EXPORT(kvq_tiles_patch);

/* Strided fp32/fp16/bf16 rows to strided fp32/fp16/bf16 rows (kvq_convert_params): the device-tensor entry
 * points' q, k, v in, outputs and lse out. The conversions are the host's (exact widening, round to nearest even
 * narrowing), so the device path stores and attends to what the host-pointer path does, bit for bit. */
static __device__ __forceinline__ float kvq_cvt_load(kvq_u64 base, int dtype, long long i)
{
    if (dtype == 1) return kvq_h2f(((const kvq_half *)base)[i]);
    if (dtype == 2) return kvq_bf2f(((const kvq_bf16 *)base)[i]);
    return ((const float *)base)[i];
}

extern "C" __global__ void __launch_bounds__(128) kvq_convert_rows(const kvq_convert_params p)
{
    const long long h = blockIdx.x;
    for (long long t = blockIdx.y; t < p.n; t += gridDim.y)
        for (int d = threadIdx.x; d < p.dim; d += blockDim.x) {
            float x = kvq_cvt_load(p.src, p.src_dtype, t * p.src_ts + h * p.src_hs + d) * p.mul;
            long long o = t * p.dst_ts + h * p.dst_hs + d;
            if (p.dst_dtype == 1)
                ((kvq_half *)p.dst)[o] = kvq_f2h(x);
            else if (p.dst_dtype == 2)
                ((kvq_bf16 *)p.dst)[o] = kvq_f2bf(x);
            else
                ((float *)p.dst)[o] = x;
        }
}
KVQ_KERNEL_EXPORT(kvq_convert_rows);

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
