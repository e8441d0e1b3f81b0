/* Parameter structs of the kvq kernels: plain C, included by the CUDA templates (NVRTC, emulator) and by host C
 * code (runtime/cuda), so both sides agree on every byte. Each kernel takes exactly one of these by value.
 * Addresses are 64-bit integers (CUdeviceptr on the host, cast to pointers on the device); every field is
 * naturally aligned and every struct's size is a multiple of 8, so no compiler inserts padding. The layout is
 * asserted below, in both compilations, and the host checks it again at run time against kvq_params_layout_sig
 * computed from the device side (cu_launch). Keep the two lists in step when a field changes. */
#ifndef KVQ_PARAMS_CUH
#define KVQ_PARAMS_CUH

typedef unsigned long long kvq_u64;
typedef int kvq_i32;
typedef unsigned int kvq_u32;

#if defined(__cplusplus)
#define KVQ_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define KVQ_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif
/* NVRTC has no offsetof without headers: there the offsets are checked at run time only (kvq_params_sig computes
 * them from an object); everywhere else they are also static assertions. */
#if defined(__CUDACC_RTC__)
#define KVQ_RT_OFFSETOF(t, f) ((long long)((const char *)&((const t *)16)->f - (const char *)16))
#define KVQ_OFFSET_ASSERT(t, f, off)
#else
#define KVQ_RT_OFFSETOF(t, f) ((long long)__builtin_offsetof(t, f))
#define KVQ_OFFSET_ASSERT(t, f, off) KVQ_STATIC_ASSERT(__builtin_offsetof(t, f) == (off), #t "." #f)
#endif

/* Functions both sides compile (pure integer C). */
#ifndef KVQ_HD
#if defined(__CUDACC__) || defined(EMU_CUDA_H)
#define KVQ_HD static __device__ __forceinline__
#else
#define KVQ_HD static inline
#endif
#endif

/* What a decode tile reads its keys / values from. */
enum {
    KVQ_SRC_F16 = 1, /* fp16 rows [kv_head][cap][D]: sinks, residual window, pools, fp16 pages, sparse rows */
    KVQ_SRC_HI = 2,  /* a quantized page of the only (or the high-bit) precision class */
    KVQ_SRC_LO = 3   /* a quantized page of the low-bit class */
};

/* A run of n <= tile tokens whose keys sit in slots [k_slot, k_slot + n) of one container and whose values in
 * slots [v_slot, v_slot + n) of another (token i of the run: key slot k_slot + i, value slot v_slot + i). */
typedef struct {
    kvq_u64 k, v;       /* container base addresses: a page (layout.h) or an fp16 window */
    kvq_u64 count;      /* 0, or the address of int[kv_heads]: kv head h attends only to the container's slots
                         * below count[h], i.e. to the first clamp(count[h] - k_slot, 0, n) tokens of the run (a
                         * pool longer than a tile is cut into several tiles sharing one count) */
    kvq_i32 k_slot, v_slot;
    kvq_i32 k_cap, v_cap; /* capacities of the containers (their row strides per kv head) */
    kvq_i32 n;
    kvq_i32 kinds;        /* key kind | value kind << 8 (KVQ_SRC_*) */
} kvq_tile;

/* The tiles of one sequence of a decode batch. */
typedef struct {
    kvq_u64 tiles;      /* const kvq_tile[n_tiles] */
    kvq_i32 n_tiles;
    kvq_i32 tiles_per_chunk; /* 0: kvq_decode_params.tiles_per_chunk; else this sequence's split (a planned step,
                              * kvq_decode_plan: the grid's n_chunks is fixed by the step capacity, the split of
                              * the step's tiles is sent with them, so a replayed launch reads the current one) */
} kvq_seq_tiles;

/* kvq_decode_c<k>: grid (kv_heads, n_chunks, batch); block (TX, TY, TZ) of the plan.
 * kvq_merge: grid (heads, batch); block (head_dim). */
typedef struct {
    kvq_u64 q;          /* const float [batch][heads][D] */
    kvq_u64 out;        /* float [batch][heads][D] */
    kvq_u64 seqs;       /* const kvq_seq_tiles [batch] */
    kvq_u64 part_o;     /* float [batch][heads][n_chunks][D]: per-chunk normalised outputs (n_chunks > 1) */
    kvq_u64 part_lse;   /* float [batch][heads][n_chunks]: per-chunk log2-sum-exp2 of the scaled scores */
    kvq_u64 lse;        /* 0, or float [batch][heads]: log2-sum-exp2 of every scaled score (ZipCache's probe rows) */
    float scale;        /* softmax scale times log2(e): scores live in the log2 domain */
    kvq_i32 batch;
    kvq_i32 n_chunks;   /* gridDim.y; 1: the decode kernel writes out directly */
    kvq_i32 tiles_per_chunk;
    kvq_u64 tq_s;       /* 0, or TurboQuant prod keys: the layer's QJL matrices, const double, part 0's m0 x m0 then
                         * part 1's (runtime/turboquant.h kvq_tqv; templates/kvq_turboquant.cuh) */
} kvq_decode_params;

/* Rows a kernel reads: row (h, t) of a source sits at base + (h * head_stride + r * D) elements, where
 * r = (first + t) mod ring (ring 0: no wrap), or r = gather[h * n + t] when gather is set. */
typedef struct {
    kvq_u64 base;
    kvq_u64 gather;     /* 0, or const int[kv_heads][n] */
    kvq_i32 f16;        /* 1: fp16 rows (a window); 0: rows of the plan's input dtype */
    kvq_i32 first;
    kvq_i32 ring;
    kvq_i32 head_stride;/* in rows: elements / D */
} kvq_rows;

/* kvq_quant_<k|v>_<hi|lo>_c<k>: quantizes n tokens (every kv head) into slots [slot, slot + n) of a page of
 * capacity cap, with its scales, zeros and factors; per-channel pages take all their tokens in one call.
 * grid (kv_heads, ceil(n / tokens per block)) for per-token pages, (kv_heads) for per-channel ones, (1, n) for
 * hidden groups; block KVQ_QTHREADS. */
typedef struct {
    kvq_rows src;
    kvq_u64 page;
    kvq_u64 masked;     /* 0, or const unsigned char [kv_heads][n]: 1 = the slot is masked (pooled outlier) */
    kvq_i32 cap, slot, n;
    kvq_i32 mean_fill;  /* OTT: masked tokens are replaced by the mean of the group's unmasked tokens first */
    kvq_u64 tamax;      /* 0, or const float [kv_heads]: the absolute maxima a tensor scale from the prompt comes
                         * from (element formats, tensor_scale prompt; kvq_tensor_amax) */
    kvq_u64 tq_s;       /* 0, or TurboQuant prod: the QJL matrices, as kvq_decode_params.tq_s */
} kvq_quant_params;

/* kvq_tensor_amax (kvq_common.cuh): out[h] = max |x| over the n rows of kv head h of src (NaN ignored), from
 * which the quantize kernels derive a tensor scale from the prompt (runtime/quant.c kvq_format_tensor_scale;
 * ref_quant_layer.c set_tscale). A maximum does not depend on the order it is taken in: the reference's value,
 * bit for bit. grid (kv_heads), block 128. */
typedef struct {
    kvq_rows src;
    kvq_u64 out;
    kvq_i32 n;
    kvq_i32 reserved;
} kvq_tamax_params;

/* kvq_store_f16: copies n rows of every kv head into fp16 slots (slot + t) mod dst_ring (0: no wrap) of a
 * window of capacity dst_cap. grid (kv_heads, n); block min(D, 128) threads. */
typedef struct {
    kvq_rows src;
    kvq_u64 dst;
    kvq_i32 dst_cap, slot, dst_ring, n;
} kvq_store_params;

/* A planned step's lists of work (kvq_decode_plan, docs/cuda.md "Planned steps"): kvq_store_f16_list reads
 * kvq_store_params, kvq_quant_list_<store>_c<k> and kvq_factor_list_<store>_c<k> read kvq_quant_params, item
 * blockIdx.z of `items` (written by the plan's one upload at a fixed address); an item with n = 0 does nothing. So
 * the launch, its grid and its parameter bytes are the same at every step of a batch size, and a captured graph
 * replays whatever the current step's plan holds. grid (kv_heads, y, n_items), y and block as the direct kernel. */
typedef struct {
    kvq_u64 items;
    kvq_i32 n_items;
    kvq_i32 reserved;
} kvq_list_params;

/* kvq_quant_lists_c<k> (kvq_class.cuh): every quantized store's list of kvq_quant_params items in one launch,
 * store s's n_items[s] items at items[s] (k_hi, k_lo, v_hi, v_lo; 0 items for a store the class lacks). */
typedef struct {
    kvq_u64 items[4];
    kvq_i32 n_items[4];
} kvq_quant_lists_params;

/* A planned step's change to the sequences' tile lists on the device (docs/cuda.md "Planned steps"): kvq_step_in
 * copies n tiles from src (the step tables the plan uploaded) to dst (a run of one sequence's device tile list of
 * one layer); n = 0 does nothing. */
typedef struct {
    kvq_u64 dst, src;
    kvq_i32 n;
    kvq_i32 reserved;
} kvq_tile_patch;

/* kvq_convert_rows (kvq_common.cuh): the device-tensor entry points' inputs and outputs (kvq.h, docs/cuda.md
 * "Device tensors"): n x heads rows of `dim` elements, element d of row (t, h) at t * ts + h * hs + d elements
 * from src / dst; dtype 0 fp32, 1 fp16, 2 bf16 (kvq_dtype); each element times mul, then rounded to nearest
 * even. grid (heads, min(n, 65535)) striding over the tokens, block 128. */
typedef struct {
    kvq_u64 src, dst;
    long long src_ts, src_hs, dst_ts, dst_hs;
    kvq_i32 src_dtype, dst_dtype, n, dim;
    float mul;
    kvq_i32 reserved;
} kvq_convert_params;

/* kvq_step_in (kvq_common.cuh): a device step's inputs in one launch. cv[0..2] convert q, k, v (cv[j].n tokens x
 * heads[j] rows, as kvq_convert_rows; k and v into kvin = cv[1].dst, fp16 [n][2][kv_heads][D], K then V of each
 * token, kv_heads = heads[1]); then n_stores kvq_store_params at `stores` (each over every kv head; a store whose
 * rows lie in kvin reads the caller's rows through cv[1] or cv[2]) and n_patches kvq_tile_patch at `patches`. grid (the sum of those rows, items x
 * kv_heads and patches), block 128. */
typedef struct {
    kvq_convert_params cv[3];
    kvq_u64 stores, patches;
    kvq_i32 heads[3];
    kvq_i32 n_stores, n_patches;
    kvq_i32 reserved;
} kvq_step_in_params;

/* ---- policy kernels (kvq_policy.cuh; docs/cuda.md "Policy kernels") ---- */

/* OTT pool state (App. E) of one layer: H kv heads, a pool of `keep` and a spill pool of `spill` per head. The
 * layer keeps two copies; a competition reads one and writes the whole of the other, so a step that fails later
 * leaves the copy it started from. Sections in this order, each 8-byte aligned: */
enum {
    KVQ_OM_COUNT = 0, /* int [H]: pool members */
    KVQ_OM_SCOUNT,    /* int [H]: spill members */
    KVQ_OM_NEVICT,    /* int [H]: body key slots this competition unmasked (spill 0) */
    KVQ_OM_POS,       /* int [H][keep]: the members' positions */
    KVQ_OM_SCORE,     /* float [H][keep]: their scores (||K||_1, negated when the largest are outliers) */
    KVQ_OM_SPOS,      /* int [H][spill] */
    KVQ_OM_SSCORE,    /* float [H][spill] */
    KVQ_OM_MASK,      /* u64 [H][keep]: each member's key slot in the body, mask byte address << 3 | bit (0: none) */
    KVQ_OM_EVICT,     /* u64 [H][keep]: the slots unmasked by the competition that wrote this copy, same encoding */
    KVQ_OM_END        /* total bytes */
};
KVQ_HD long long kvq_al8(long long n) { return (n + 7) & ~7LL; }
KVQ_HD long long kvq_ott_meta_off(int H, int keep, int spill, int field)
{
    long long hd = kvq_al8(4LL * H), pk = kvq_al8(4LL * H * keep), ps = kvq_al8(4LL * H * spill), off = 0;
    off += field > KVQ_OM_COUNT ? hd : 0;
    off += field > KVQ_OM_SCOUNT ? hd : 0;
    off += field > KVQ_OM_NEVICT ? hd : 0;
    off += field > KVQ_OM_POS ? pk : 0;
    off += field > KVQ_OM_SCORE ? pk : 0;
    off += field > KVQ_OM_SPOS ? ps : 0;
    off += field > KVQ_OM_SSCORE ? ps : 0;
    off += field > KVQ_OM_MASK ? 8LL * H * keep : 0;
    off += field > KVQ_OM_EVICT ? 8LL * H * keep : 0;
    return off;
}

/* kvq_ott_compete: the competition of one flush of B tokens for the pool (App. E, decided as ref_outlier.c does),
 * grid (kv_heads), block KVQ_PTHREADS. kvq_ott_undo, grid (kv_heads), block 32: sets back the mask bits that
 * meta_out's competition cleared (a failed step). */
typedef struct {
    kvq_rows k, v;             /* the flush's tokens (fp16 rows) */
    kvq_u64 meta_in, meta_out; /* pool state copies (KVQ_OM_*) */
    kvq_u64 pool_in, pool_out; /* pool rows: K [H][keep][D] then V, fp16 */
    kvq_u64 spill;             /* spill rows: K [H][spill][D] then V; evicted members are appended */
    kvq_u64 out_k, out_v;      /* [H][B][D] fp16: the flush's rows, pooled tokens replaced by their group's mean */
    kvq_u64 flags;             /* u8 pooled flags by key page: page c (tokens [c*G, c*G + n_c)) at c*G*H, [H][n_c] */
    kvq_u64 mask;              /* 0, or const u64 [pages]: address of each key page's mask section (spill 0) */
    kvq_u64 work;              /* int [H][2 * B + 4 * keep + 8] scratch */
    kvq_i32 B, first_pos, keep, spill_cap;
    kvq_i32 largest;           /* the largest L1 norms are the outliers */
    kvq_i32 group;             /* tokens per key page G (0: the whole flush) */
} kvq_ott_params;

/* ZipCache (Eq. 7-9, Alg. 2-3), block KVQ_PTHREADS:
 *   kvq_zip_stats_max, then kvq_zip_stats, grid (np, heads, ceil(T / chunk)), stats zeroed before: max logit
 *                    and softmax denominator of each prefill probe row, key chunk by key chunk (order-independent);
 *   kvq_zip_saliency grid (ceil(n / KVQ_PTHREADS), kv_heads): Eq. 7/8 of prompt tokens [first, first + n);
 *   kvq_zip_norm_{max,sum}_c<k> grid (kv_heads, KVQ_ZN_CHUNKS), then kvq_zip_norm_fin grid (kv_heads): a decode
 *                    probe's max logit and normaliser over the whole cache (its tiles), kvq_zip_norm_params;
 *   kvq_zip_row      grid (kv_heads): a decode probe's row over the key window, into rows[row];
 *   kvq_zip_rowsal   grid (ceil(n / KVQ_PTHREADS), kv_heads): Eq. 7/8 of the window's first n tokens from the
 *                    rows recorded during the cycle;
 *   kvq_zip_select   grid (kv_heads): the n_high most salient of the n tokens (Alg. 2 Split). */
typedef struct {
    kvq_u64 q;        /* const float: probe queries [heads][np][D] (stats, saliency); the step's [heads][D] (row) */
    kvq_rows k;       /* fp16 keys: the prompt [kv_heads][T][D]; the key window ring (row) */
    kvq_u64 pos;      /* const int [np]: probe positions (stats, saliency), relative to the window (rowsal) */
    kvq_u64 stats;    /* u64 [heads][np][2]: max logit's order key, fixed-point denominator (kvq_zip_stats) */
    kvq_u64 rows;     /* float [probe rows][kv_heads][wcap] */
    kvq_u64 norm;     /* const double [heads][2]: the probe's max logit and normaliser over the cache (row) */
    kvq_u64 sal;      /* float [kv_heads][n] */
    kvq_u64 is_high;  /* u8 [kv_heads][n] */
    kvq_u64 work;     /* u32 [kv_heads][n] keys, then int [kv_heads][n] */
    double scale;     /* the softmax scale */
    kvq_i32 np, first, n, accumulated;
    kvq_i32 n_high, row, wcap, count; /* count: tokens in the window (row) */
    kvq_i32 chunk, reserved;          /* chunk: keys per block of kvq_zip_stats{,_max} (KVQ_ZS_CHUNK) */
} kvq_zip_params;
/* Keys per block of the prefill probe rows: 8 per thread, a 128k prompt in 64 chunks. */
#define KVQ_ZS_CHUNK 2048

/* The normaliser of a decode probe's row, Eq. 9's softmax over every token of the cache (docs/cuda.md
 * "Determinism"): per query head the max logit m and Z = sum of kvq_prob_fixed(e^(l - m)), written to norm. Over
 * token chunks (block y of a kv head takes tiles y, y + KVQ_ZN_CHUNKS, ...): kvq_zip_norm_max_c<k> each chunk's
 * maximum, kvq_zip_norm_sum_c<k> each chunk's integer sum at the maximum of the chunks' maxima, kvq_zip_norm_fin
 * their maximum and sum; a maximum and an integer sum are the same in any order, so the split does not change
 * them. Block KVQ_PTHREADS. */
#define KVQ_ZN_CHUNKS 16
/* norm's bytes: double [heads][2] (m, Z), then the chunks' double maxima and u64 sums [heads][KVQ_ZN_CHUNKS] */
#define KVQ_ZN_BYTES(heads) ((unsigned long long)(heads) * 16u * (1u + KVQ_ZN_CHUNKS))
typedef struct {
    kvq_u64 q;      /* const float [heads][D]: the step's query */
    kvq_u64 tiles;  /* const kvq_tile [n_tiles]: the sequence's tiles of this step (those the decode kernel read) */
    kvq_u64 norm;   /* KVQ_ZN_BYTES(heads): double [heads][2], then the chunks' partials */
    double scale;   /* the softmax scale */
    kvq_i32 n_tiles, reserved;
} kvq_zip_norm_params;

/* TailorKV (Sec. 4.2, App. I), block KVQ_PTHREADS: kvq_tk_absmax, grid (kv_heads, KVQ_TK_CHUNKS): Eq. 10's
 * max_t |K_t,i| over the prompt (absmax zeroed before); a retrieval is kvq_tk_score, grid (kv_heads, KVQ_TK_CHUNKS):
 * reduced query, critical channels and the candidates' scores on them, then kvq_tk_select, grid (kv_heads): the
 * top nf candidates as gather rows. */
#define KVQ_TK_CHUNKS 16
typedef struct {
    kvq_u64 q;      /* const float [heads][D]: the step's query */
    kvq_u64 k;      /* fp16 prompt keys channel-major [kv_heads][D][T] (page-locked host memory) */
    kvq_u64 absmax; /* float [kv_heads][D] */
    kvq_u64 gather; /* int [kv_heads][nf]: prompt rows to fetch, in rank order */
    kvq_u64 work;   /* u32 [kv_heads][nc] keys, then int [kv_heads][nc] */
    kvq_i32 T, first, nc, nf;
    kvq_i32 n_ch, reserved;
} kvq_tk_params;

/* kvq_tk_dense: TailorKV Eq. 6-8 of one query head (calibration), grid (n_q), block KVQ_PTHREADS: block r the
 * sparse error of row n - n_q + r. */
typedef struct {
    kvq_u64 q;      /* const float [n_q][D]: the head's last n_q queries */
    kvq_u64 k;      /* const float [n][D]: its kv head's keys */
    kvq_u64 logits; /* float [n_q][n] scratch */
    kvq_u64 keys;   /* u32 [n_q][n] scratch */
    kvq_u64 err;    /* double [n_q] */
    float scale;
    kvq_i32 n, n_q, kk;
} kvq_dense_params;

/* kvq_params_sig: writes KVQ_PARAMS_SIG_LIST as the device compilation sees it to out, then the tensor cores' answer
 * to one mma.sync whose A is the fp16 subnormal 3 x 2^-24 and B 1.5 everywhere (the decode's code unpacking,
 * kvq_mma.cuh): each of D's elements is 16 x 4.5 x 2^-24 = 72 x 2^-24, whose fp32 bits are KVQ_MMA_PROBE; a GPU
 * that flushed subnormal inputs would answer 0. */
typedef struct {
    kvq_u64 out; /* long long[KVQ_PARAMS_SIG_N + 1] */
} kvq_sig_params;
#define KVQ_MMA_PROBE_A 0x00030003u /* the subnormal 3 x 2^-24 in both halves */
#define KVQ_MMA_PROBE_B 0x3E003E00u /* 1.5 in both halves */
#define KVQ_MMA_PROBE 0x36900000ll  /* 72 x 2^-24 = 1.125 x 2^-18 */

/* Sizes and offsets the host compares with the device's before it launches anything. */
#define KVQ_PARAMS_SIG_LIST                                                                                    \
    (long long)sizeof(kvq_tile), (long long)sizeof(kvq_seq_tiles), (long long)sizeof(kvq_decode_params),        \
        (long long)sizeof(kvq_rows), (long long)sizeof(kvq_quant_params), (long long)sizeof(kvq_store_params),  \
        (long long)KVQ_RT_OFFSETOF(kvq_tile, kinds), (long long)KVQ_RT_OFFSETOF(kvq_decode_params, tiles_per_chunk),  \
        (long long)KVQ_RT_OFFSETOF(kvq_rows, head_stride), (long long)KVQ_RT_OFFSETOF(kvq_quant_params, mean_fill),   \
        (long long)KVQ_RT_OFFSETOF(kvq_store_params, n), (long long)sizeof(kvq_ott_params),                     \
        (long long)sizeof(kvq_zip_params), (long long)sizeof(kvq_tk_params), (long long)sizeof(kvq_dense_params), \
        (long long)KVQ_RT_OFFSETOF(kvq_ott_params, group), (long long)KVQ_RT_OFFSETOF(kvq_zip_params, scale),     \
        (long long)KVQ_RT_OFFSETOF(kvq_zip_params, count), (long long)KVQ_RT_OFFSETOF(kvq_tk_params, n_ch),       \
        (long long)KVQ_RT_OFFSETOF(kvq_dense_params, kk), (long long)sizeof(kvq_zip_norm_params),              \
        (long long)KVQ_RT_OFFSETOF(kvq_zip_norm_params, n_tiles), (long long)sizeof(kvq_convert_params),       \
        (long long)KVQ_RT_OFFSETOF(kvq_convert_params, mul), (long long)sizeof(kvq_list_params),                \
        (long long)KVQ_RT_OFFSETOF(kvq_seq_tiles, tiles_per_chunk), (long long)sizeof(kvq_tile_patch),       \
        (long long)KVQ_RT_OFFSETOF(kvq_tile_patch, n), (long long)sizeof(kvq_tamax_params),                  \
        (long long)KVQ_RT_OFFSETOF(kvq_quant_params, tamax), (long long)sizeof(kvq_step_in_params),                 \
        (long long)KVQ_RT_OFFSETOF(kvq_step_in_params, n_patches), (long long)sizeof(kvq_quant_lists_params)
#define KVQ_PARAMS_SIG_N 33

/* Byte sizes and field offsets, asserted in every compilation of this header. */
#define KVQ_PARAMS_CHECK(t, size) KVQ_STATIC_ASSERT(sizeof(t) == (size), #t " size")
KVQ_PARAMS_CHECK(kvq_tile, 48);
KVQ_PARAMS_CHECK(kvq_seq_tiles, 16);
KVQ_PARAMS_CHECK(kvq_decode_params, 72);
KVQ_PARAMS_CHECK(kvq_rows, 32);
KVQ_PARAMS_CHECK(kvq_quant_params, 80);
KVQ_OFFSET_ASSERT(kvq_quant_params, tamax, 64);
KVQ_PARAMS_CHECK(kvq_tamax_params, 48);
KVQ_PARAMS_CHECK(kvq_store_params, 56);
KVQ_OFFSET_ASSERT(kvq_tile, n, 40);
KVQ_OFFSET_ASSERT(kvq_decode_params, scale, 48);
KVQ_OFFSET_ASSERT(kvq_decode_params, tiles_per_chunk, 60);
KVQ_OFFSET_ASSERT(kvq_quant_params, cap, 48);
KVQ_OFFSET_ASSERT(kvq_store_params, n, 52);
KVQ_PARAMS_CHECK(kvq_ott_params, 168);
KVQ_PARAMS_CHECK(kvq_zip_params, 144);
KVQ_PARAMS_CHECK(kvq_tk_params, 64);
KVQ_PARAMS_CHECK(kvq_dense_params, 56);
KVQ_OFFSET_ASSERT(kvq_ott_params, group, 164);
KVQ_OFFSET_ASSERT(kvq_zip_params, scale, 96);
KVQ_OFFSET_ASSERT(kvq_zip_params, count, 132);
KVQ_OFFSET_ASSERT(kvq_zip_params, chunk, 136);
KVQ_OFFSET_ASSERT(kvq_tk_params, n_ch, 56);
KVQ_OFFSET_ASSERT(kvq_dense_params, kk, 52);
KVQ_PARAMS_CHECK(kvq_zip_norm_params, 40);
KVQ_PARAMS_CHECK(kvq_convert_params, 72);
KVQ_PARAMS_CHECK(kvq_step_in_params, 256);
KVQ_PARAMS_CHECK(kvq_quant_lists_params, 48);
KVQ_OFFSET_ASSERT(kvq_convert_params, mul, 64);
KVQ_OFFSET_ASSERT(kvq_step_in_params, n_patches, 248);
KVQ_OFFSET_ASSERT(kvq_zip_norm_params, n_tiles, 32);
KVQ_PARAMS_CHECK(kvq_list_params, 16);
KVQ_OFFSET_ASSERT(kvq_seq_tiles, tiles_per_chunk, 12);
KVQ_PARAMS_CHECK(kvq_tile_patch, 24);
KVQ_OFFSET_ASSERT(kvq_tile_patch, n, 16);

#endif
