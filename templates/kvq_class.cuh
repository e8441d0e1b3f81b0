/* The entry points of one layer class. emit_cuda includes this text once per class of the plan, after a block
 * of #defines that specialises it (and #undefs them after):
 *   KVQ_C(name)            name with the class suffix (_c0, _c1, ...)
 *   KVQ_C_TILE             tokens per decode tile
 *   KVQ_C_KROW, KVQ_C_VROW largest staged row, bytes per token of one kv head
 *   KVQ_C_KPAR, KVQ_C_VPAR staged parameter floats per array (scales, zeros)
 *   KVQ_C_SBUF             bytes of the decode kernel's row buffer (also its merge scratch)
 *   KVQ_C_VOFF             offset of the value rows in it (keys before; sized for the class's pages)
 *   KVQ_C_SPLIT, KVQ_C_P1  decode phase 1: lanes per token, token lanes
 *   KVQ_C_KPAGES           most key pages a tile spans (page runs, layout/tiles.h): staged parameters and folds
 *   KVQ_C_MINB             decode blocks per SM for __launch_bounds__: what sm_80's shared memory allows
 *   KVQ_C_SMEM, KVQ_C_SO_* the decode kernel's dynamic shared memory and the offsets of its parts (plan.c)
 *   KVQ_C_STAGES, KVQ_C_STAGE_BYTES, KVQ_C_SO_KRAW, KVQ_C_SO_VRAW, KVQ_C_KRAWS, KVQ_C_VRAWS, KVQ_C_RAWF,
 *   KVQ_C_PAR_STEP
 *                          the load pipeline: stages of the staged part and its raw parameter bytes (plan.h)
 *   KVQ_C_MMA_K, KVQ_C_MMA_V  page classes (bit 0 high, bit 1 low) whose q.K / p.V run on tensor cores
 *   KVQ_C_KPRAW, KVQ_C_VPRAW  1 when the keys' (values') scales and zeros are read from their raw bytes (plan.h)
 *   KVQ_C_KHI, KVQ_C_KLO, KVQ_C_VHI, KVQ_C_VLO   kvq_fmt initialisers of the page formats (bits 0: absent)
 *   KVQ_C_<store>_Q        1 when the store is quantized (has a quantize kernel)
 *   KVQ_C_<store>_SEP      1 when it stores channel-separable factors (has a factor kernel) */

extern "C" __global__ void __launch_bounds__(KVQ_THREADS, KVQ_C_MINB) KVQ_C(kvq_decode)(const kvq_decode_params p)
{
    /* KVQ_C_SMEM bytes of dynamic shared memory (the launch passes them; above 48 KiB the module load raised the
     * kernel's limit with cuFuncSetAttribute), carved at the plan's offsets */
    KVQ_DYNAMIC_SHARED(unsigned char, smem);
    const kvq_fmt khi = KVQ_C_KHI, klo = KVQ_C_KLO, vhi = KVQ_C_VHI, vlo = KVQ_C_VLO;
    const kvq_dec_geo g = {KVQ_C_TILE,    KVQ_C_SPLIT,    KVQ_C_P1,       KVQ_C_VOFF,  KVQ_C_KPAR,
                           KVQ_C_VPAR,    KVQ_C_SO_KPAR,  KVQ_C_SO_VPAR,  KVQ_C_SO_KMASK, KVQ_C_SO_Q,
                           KVQ_C_SO_QK,   KVQ_C_SO_QSUM,  KVQ_C_SO_P,     KVQ_C_SO_RED,
                           KVQ_C_SO_W,    KVQ_C_MMA_K,    KVQ_C_MMA_V,    KVQ_C_KPAGES,
                           KVQ_C_STAGES,  KVQ_C_STAGE_BYTES, KVQ_C_SO_KRAW, KVQ_C_SO_VRAW, KVQ_C_KRAWS,
                           KVQ_C_VRAWS,   KVQ_C_RAWF,     KVQ_C_PAR_STEP, KVQ_C_KPRAW, KVQ_C_VPRAW};
    kvq_decode_body(&p, smem, khi, klo, vhi, vlo, g);
}
KVQ_KERNEL_EXPORT(KVQ_C(kvq_decode));

#if KVQ_POL_ZIP
/* ZipCache: a decode probe's normaliser over the cache this class's decode kernel reads, chunk by chunk
 * (kvq_policy.cuh: kvq_zip_norm_max, then kvq_zip_norm_sum, then kvq_zip_norm_fin). */
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) KVQ_C(kvq_zip_norm_max)(const kvq_zip_norm_params p)
{
    __shared__ float qs[KVQ_D];
    __shared__ double red[KVQ_PTHREADS];
    const kvq_fmt khi = KVQ_C_KHI, klo = KVQ_C_KLO;
    kvq_zip_norm_max_body(&p, khi, klo, qs, red);
}
KVQ_KERNEL_EXPORT(KVQ_C(kvq_zip_norm_max));
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) KVQ_C(kvq_zip_norm_sum)(const kvq_zip_norm_params p)
{
    __shared__ float qs[KVQ_D];
    __shared__ unsigned long long zsum;
    const kvq_fmt khi = KVQ_C_KHI, klo = KVQ_C_KLO;
    kvq_zip_norm_sum_body(&p, khi, klo, qs, &zsum);
}
KVQ_KERNEL_EXPORT(KVQ_C(kvq_zip_norm_sum));
/* A planned step's normalisers (kvq_list_params over kvq_zip_norm_params; q 0: not a probe step). */
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) KVQ_C(kvq_zip_norm_max_list)(const kvq_list_params lp)
{
    __shared__ float qs[KVQ_D];
    __shared__ double red[KVQ_PTHREADS];
    const kvq_fmt khi = KVQ_C_KHI, klo = KVQ_C_KLO;
    if ((int)blockIdx.z >= lp.n_items) return;
    const kvq_zip_norm_params p = ((const kvq_zip_norm_params *)lp.items)[blockIdx.z];
    if (p.q) kvq_zip_norm_max_body(&p, khi, klo, qs, red);
}
KVQ_KERNEL_EXPORT(KVQ_C(kvq_zip_norm_max_list));
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) KVQ_C(kvq_zip_norm_sum_list)(const kvq_list_params lp)
{
    __shared__ float qs[KVQ_D];
    __shared__ unsigned long long zsum;
    const kvq_fmt khi = KVQ_C_KHI, klo = KVQ_C_KLO;
    if ((int)blockIdx.z >= lp.n_items) return;
    const kvq_zip_norm_params p = ((const kvq_zip_norm_params *)lp.items)[blockIdx.z];
    if (p.q) kvq_zip_norm_sum_body(&p, khi, klo, qs, &zsum);
}
KVQ_KERNEL_EXPORT(KVQ_C(kvq_zip_norm_sum_list));
#endif

/* One quantize kernel per quantized store; the granularity picks the body (a constant). The _list form is the
 * same kernel over the items of a planned step (kvq_list_params): item blockIdx.z, n 0 = nothing; a per-channel
 * body runs on blockIdx.y 0 only and a hidden one on blockIdx.x 0 only, since the list's grid is the widest one. */
#define KVQ_QUANT_SHARED                                                                                       \
    __shared__ float xs[KVQ_QTOK * KVQ_D];                                                                     \
    __shared__ float ps[KVQ_QTOK * KVQ_D], pz[KVQ_QTOK * KVQ_D], fill[KVQ_D];                                 \
    __shared__ int ri[2 * KVQ_QTHREADS]
#define KVQ_QUANT_KERNEL(NAME, LNAME, FMT)                                                                     \
    extern "C" __global__ void __launch_bounds__(KVQ_QTHREADS, 4) KVQ_C(NAME)(const kvq_quant_params p)        \
    {                                                                                                          \
        KVQ_QUANT_SHARED;                                                                                      \
        const kvq_fmt f = FMT;                                                                                 \
        if (f.gran == 0)                                                                                       \
            kvq_quant_channel_body(&p, f, ps, pz, fill);                                                       \
        else if (f.hidden)                                                                                     \
            kvq_quant_hidden_body(&p, f, ps, ri);                                                              \
        else                                                                                                   \
            kvq_quant_token_body(&p, f, xs, ps, pz);                                                           \
    }                                                                                                          \
    KVQ_KERNEL_EXPORT(KVQ_C(NAME));                                                                            \
    extern "C" __global__ void __launch_bounds__(KVQ_QTHREADS, 4) KVQ_C(LNAME)(const kvq_list_params lp)       \
    {                                                                                                          \
        KVQ_QUANT_SHARED;                                                                                      \
        if ((int)blockIdx.z >= lp.n_items) return;                                                             \
        const kvq_fmt f = FMT;                                                                                 \
        kvq_quant_item((const kvq_quant_params *)lp.items + blockIdx.z, f, xs, ps, pz, fill, ri);              \
    }                                                                                                          \
    KVQ_KERNEL_EXPORT(KVQ_C(LNAME))
#define KVQ_FACTOR_KERNEL(NAME, LNAME, FMT)                                                                    \
    extern "C" __global__ void __launch_bounds__(KVQ_QTHREADS, 4) KVQ_C(NAME)(const kvq_quant_params p)        \
    {                                                                                                          \
        const kvq_fmt f = FMT;                                                                                 \
        kvq_factor_body(&p, f);                                                                                \
    }                                                                                                          \
    KVQ_KERNEL_EXPORT(KVQ_C(NAME));                                                                            \
    extern "C" __global__ void __launch_bounds__(KVQ_QTHREADS, 4) KVQ_C(LNAME)(const kvq_list_params lp)       \
    {                                                                                                          \
        if ((int)blockIdx.z >= lp.n_items) return;                                                             \
        const kvq_quant_params p = ((const kvq_quant_params *)lp.items)[blockIdx.z];                           \
        const kvq_fmt f = FMT;                                                                                 \
        if (p.n > 0 && blockIdx.y == 0) kvq_factor_body(&p, f);                                                \
    }                                                                                                          \
    KVQ_KERNEL_EXPORT(KVQ_C(LNAME))

#if KVQ_C_KHI_Q || KVQ_C_KLO_Q || KVQ_C_VHI_Q || KVQ_C_VLO_Q
/* Every quantized store's list in one launch (kvq_quant_lists_params): item z of the stores' items in the order
 * k_hi, k_lo, v_hi, v_lo, each on its list kernel's body. The stores write different pages and read rows no
 * quantization writes, so their items need no order among them (a separable store's factor list runs before this
 * launch). grid (the widest x and y of the stores' list grids, all the items), block KVQ_QTHREADS. */
extern "C" __global__ void __launch_bounds__(KVQ_QTHREADS, 4) KVQ_C(kvq_quant_lists)(const kvq_quant_lists_params lp)
{
    KVQ_QUANT_SHARED;
    int z = (int)blockIdx.z;
#define KVQ_QUANT_LISTS_STORE(S, FMT)                                                                          \
    if (z < lp.n_items[S]) {                                                                                   \
        const kvq_fmt f = FMT;                                                                                 \
        kvq_quant_item((const kvq_quant_params *)lp.items[S] + z, f, xs, ps, pz, fill, ri);                    \
        return;                                                                                                \
    }                                                                                                          \
    z -= lp.n_items[S]
#if KVQ_C_KHI_Q
    KVQ_QUANT_LISTS_STORE(0, KVQ_C_KHI);
#endif
#if KVQ_C_KLO_Q
    KVQ_QUANT_LISTS_STORE(1, KVQ_C_KLO);
#endif
#if KVQ_C_VHI_Q
    KVQ_QUANT_LISTS_STORE(2, KVQ_C_VHI);
#endif
#if KVQ_C_VLO_Q
    KVQ_QUANT_LISTS_STORE(3, KVQ_C_VLO);
#endif
#undef KVQ_QUANT_LISTS_STORE
}
KVQ_KERNEL_EXPORT(KVQ_C(kvq_quant_lists));
#endif

#if KVQ_C_KHI_Q
KVQ_QUANT_KERNEL(kvq_quant_k_hi, kvq_quant_list_k_hi, KVQ_C_KHI);
#endif
#if KVQ_C_KLO_Q
KVQ_QUANT_KERNEL(kvq_quant_k_lo, kvq_quant_list_k_lo, KVQ_C_KLO);
#endif
#if KVQ_C_VHI_Q
KVQ_QUANT_KERNEL(kvq_quant_v_hi, kvq_quant_list_v_hi, KVQ_C_VHI);
#endif
#if KVQ_C_VLO_Q
KVQ_QUANT_KERNEL(kvq_quant_v_lo, kvq_quant_list_v_lo, KVQ_C_VLO);
#endif
#if KVQ_C_KHI_SEP
KVQ_FACTOR_KERNEL(kvq_factor_k_hi, kvq_factor_list_k_hi, KVQ_C_KHI);
#endif
#if KVQ_C_KLO_SEP
KVQ_FACTOR_KERNEL(kvq_factor_k_lo, kvq_factor_list_k_lo, KVQ_C_KLO);
#endif
#if KVQ_C_VHI_SEP
KVQ_FACTOR_KERNEL(kvq_factor_v_hi, kvq_factor_list_v_hi, KVQ_C_VHI);
#endif
#if KVQ_C_VLO_SEP
KVQ_FACTOR_KERNEL(kvq_factor_v_lo, kvq_factor_list_v_lo, KVQ_C_VLO);
#endif

#undef KVQ_QUANT_KERNEL
#undef KVQ_FACTOR_KERNEL
#undef KVQ_QUANT_SHARED
