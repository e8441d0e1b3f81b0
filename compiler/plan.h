/* The kernel plan: a resolved scheme plus model dimensions turned into everything the CUDA code generator and
 * the cuda/emu backends need, every constant known (DESIGN §2: scheme -> plan -> emit_cuda).
 *
 * Layers with identical configurations form one *layer class*; each class gets its own kernel variants, named
 * with the suffix `_c<id>` (kvq_decode_c0, kvq_quant_k_hi_c0, ...). What depends only on the model dimensions
 * (the decode kernel's thread mapping, its tile size, the merge and copy kernels) is global to the plan.
 *
 * Decode thread mapping (one block per (kv head, KV chunk, sequence)): a block has TX x TY x TZ threads.
 *   TX lanes split head_dim, VEC channels each (TX a power of two, lanes past head_dim idle);
 *   TY lanes split the GQA group's query heads, HPT heads each (TY * HPT = heads / kv_heads);
 *   TZ lanes split the tokens of a tile.
 * Every K/V byte of a tile is staged once into shared memory and serves all query heads of the kv head. */
#ifndef KVQ_PLAN_H
#define KVQ_PLAN_H

#include <stddef.h>

#include "kvq.h"
#include "layout.h"
#include "scheme.h"
#include "tiles.h"

#define PLAN_MAX_CLASSES 16
#define PLAN_MAX_LAYERS 1024
/* Stages of the decode kernel's load pipeline: tile i + 1 is in flight while tile i computes. */
#define PLAN_DECODE_STAGES 2

/* Storage format of one tensor (keys or values) in one precision class: what a page of it holds. */
typedef struct {
    int bits;   /* 1, 2, 3, 4, 8; 16 = fp16 values (no parameters) */
    int gran;   /* kvq_gran */
    int sep;    /* channel-separable (per token only): ZipCache Eq. 6 factors stored per page */
    int group;  /* per channel: tokens per group, 0 = the whole flush; per token: channels per group, 0 = hidden */
    int hidden; /* per token: one group spans every kv head (scale/zero [capacity]) */
    int scale_f32, zero_f32;
    int masked; /* keys of a layer with an outlier pool: per-slot mask bits */
    /* element format (compiler/scheme_format.h; KVQ_FMT_INT by default): bits above is its code width; the
     * decode kernel stages its tiles as fp16 (templates/kvq_format.cuh) */
    kvq_format_cfg format;
    /* TurboQuant codes (kvq_turboquant; 0 = none) and its outlier channel split (layout.h tq_out, tq_out_bits):
     * the cpu kernels decode them (compiler/emit_llvm_turboquant.c), the CUDA templates too
     * (templates/kvq_turboquant.cuh) except prod values (plan_cuda_ok) */
    int tq, tq_out, tq_out_bits;
} plan_store;

typedef struct {
    int id;
    kvq_layer_mode mode;
    int quant;         /* has the quantized-layer kernels (mode QUANT or AUTO) */
    int sparse;        /* has the sparse-layer kernels (mode SPARSE or AUTO) */
    kvq_quant_cfg q;   /* the class's configuration (meaningful when quant) */
    kvq_sparse_cfg sp; /* meaningful when sparse */
    kvq_tensor_cfg kcfg, vcfg;
    plan_store k_hi, k_lo, v_hi, v_lo; /* *_lo.bits == 0: one precision class */
    kvq_window_rule rule_k, rule_v;
    int has_low; /* saliency: two precision classes */
    int has_pool, has_spill;
    int n_layers; /* layers in the class */
    /* Decode: largest staged row (bytes per token of one kv head) over the kinds K and V come in. */
    int k_row_bytes, v_row_bytes;
    int tile; /* tokens per decode tile: 32, 64 or 128 */
    /* Most key pages a tile spans (layout/tiles.h, page runs: KIVI's per-channel key pages of one group each, a
     * flush of them back to back); the kernel stages and folds the query once per page: kpar, qk, the bias and its
     * partial sums hold kpages copies. 1 without page runs. */
    int kpages;
    /* Decode scores (phase 1): `split` adjacent lanes per token (a power of two), each head_dim / split channels
     * of all the GQA heads; `p1` = threads / split token lanes. */
    int split, p1;
    /* Dynamic shared memory of the decode kernel, byte offsets (16-aligned) and total (docs/cuda.md). */
    int kpar, vpar; /* staged parameter floats per array (scales, zeros) */
    int so_rows, so_kpar, so_vpar, so_kmask, so_q, so_qk, so_qsum, so_p, so_red, so_w, smem;
    /* Tensor-core paths (templates/kvq_mma.cuh, docs/cuda.md "Tensor cores"): bit 0 the high class's pages, bit 1
     * the low class's, for q.K (mma_k) and p.V (mma_v); so_w holds p.V's weight fragments. */
    int mma_k, mma_v;
    int rows_bytes; /* K then V rows of a tile (of one stage; the end-of-chunk merge scratch overlays the stages) */
    /* The rows are sized for the class's pages, not for fp16 rows (docs/cuda.md "Shared memory"): keys at
     * [0, rows_k), values at [rows_k, rows_bytes); a tile whose keys (values) are fp16 rows (sinks, windows, pools)
     * holds at most tile_k16 (tile_v16) tokens (plan_tile_tokens). */
    int rows_k, tile_k16, tile_v16;
    /* The load pipeline (docs/cuda.md "Load path"): `stages` copies of the staged part [0, stage_bytes) (rows,
     * parameter floats, key mask, then the raw parameter bytes the cp.async copies land in: per tensor scales and
     * zeros `kraws` / `vraws` bytes each, then `rawf` bytes of factors and, keys only, the mask bytes), stage s at
     * s * stage_bytes; the rest of the layout follows them. The widened parameter floats and mask bytes (so_kpar,
     * so_vpar, so_kmask) of stage s sit at s * par_step: one copy after the stages (par_step 0), or, for classes
     * with element formats (staged by plain stores while the copies are issued), one per stage inside it
     * (par_step = stage_bytes). */
    int stages, stage_bytes, so_kraw, so_vraw, kraws, vraws, rawf, par_step;
    /* Keys (kpraw) and values (vpraw) whose scales and zeros the kernel reads from the raw bytes instead of widened
     * floats (plan.c, par_raw_ok): their part of the floats is not allocated (docs/cuda.md "Shared memory"). */
    int kpraw, vpraw;
} plan_class;

typedef struct kvq_plan {
    char scheme[KVQ_NAME_MAX];
    int layers, heads, kv_heads, head_dim, gqa;
    int in_dtype; /* kvq_dtype of the K/V/Q rows the kernels read */
    /* decode mapping, see above */
    int vec, tx, ty, hpt, tz, threads;
    int n_classes;
    plan_class cls[PLAN_MAX_CLASSES];
    int layer_class[PLAN_MAX_LAYERS];
    int any_sparse, any_saliency, any_pool;
    int any_auto; /* a class of mode auto: calibration (TailorKV Eq. 6-9) runs on the device */
    /* Tuning knob: the decode kernels' blocks per SM for __launch_bounds__ (KVQ_C_MINB) of every quantized class,
     * 0 = the plan's choice (plan_decode_min_blocks); plan_build takes it from $KVQ_DECODE_MINB (docs/cuda.md,
     * "Tuning knobs"). */
    int decode_minb;
    /* Tuning knob: the decode tile (tokens) of every class whose pages hold codes, 0 = the plan's choice (128 for
     * KIVI); plan_build takes it from $KVQ_DECODE_TILE (32, 64, 128 or 256; docs/cuda.md, "Tuning knobs"). */
    int decode_tile;
} kvq_plan;

/* Builds the plan of `scheme` for `dims` (layers, heads, kv_heads, head_dim all > 0) with inputs of
 * `in_dtype`. Returns KVQ_OK, or KVQ_ERR_UNSUPPORTED / KVQ_ERR_SHAPE with the reason in msg. */
kvq_status plan_build(const kvq_scheme *scheme, const kvq_dims *dims, kvq_dtype in_dtype, kvq_plan *out, char *msg,
                      size_t msg_size);

/* The page format (layout.h) of store `st` at capacity cap, for the plan's dims. */
void plan_page_format(const kvq_plan *p, const plan_store *st, int cap, kvq_page_format *fmt);

/* Tokens a decode tile of class c may hold when its keys (k_f16) or values (v_f16) are fp16 rows: the tile, or
 * fewer where fp16 rows would overrun the staging (plan_class.rows_k). Every tile list the backends build is cut to
 * it (with kvq_tile_len, layout/tiles.h). */
int plan_tile_tokens(const plan_class *c, int k_f16, int v_f16);

/* Cache bytes the decode kernel reads per token of one kv head on the quantized path of class c (its body
 * pages, high class): K and V codes, per-token parameters, per-channel parameters and factors amortised over
 * the tokens they cover, mask bits (docs/cuda.md, "Issue budget"). */
double plan_body_bytes_per_token(const kvq_plan *p, const plan_class *c);

/* Bytes of one token of one kv head as the decode kernel stages it (codes, or fp16 values). */
int plan_row_bytes(int head_dim, int bits);

/* KVQ_OK if the CUDA templates decode every class of p; else KVQ_ERR_UNSUPPORTED with the reason (TurboQuant prod
 * values: only the reference and cpu backends decode them). plan_check_target checks it too. */
kvq_status plan_cuda_ok(const kvq_plan *p, char *msg, size_t msg_size);

/* Checks the plan against a target's limits: the decode kernel's dynamic shared memory against the opt-in
 * maximum of `sm` (80: 163 KiB, 86/89: 99 KiB, 90: 227 KiB), threads per block, and the registers per thread
 * that __launch_bounds__ leaves. KVQ_ERR_UNSUPPORTED with the reason in msg. */
kvq_status plan_check_target(const kvq_plan *p, int sm, char *msg, size_t msg_size);
/* Blocks per SM the decode kernel of class c declares in __launch_bounds__ (KVQ_C_MINB): what sm_90's shared
 * memory allows, at most 512 threads for quantized classes whose q.K and p.V take the tensor cores at head_dim up
 * to 128 (4 x 128: ptxas's register cap 128), else 384 (3 x 128: 170); p->decode_minb, when set, for every
 * class that reads codes. */
int plan_decode_min_blocks(const kvq_plan *p, const plan_class *c);
/* The opt-in shared memory per block of sm (bytes). */
int plan_smem_optin(int sm);
/* Shared memory per SM of sm (bytes; a CTA also takes 1 KiB of it). */
int plan_smem_per_sm(int sm);
/* CTAs per SM of a kernel of `threads` threads a CTA, `smem` bytes of shared memory a CTA (static and dynamic) and
 * `regs` registers a thread (0: not known, not limiting) on sm, as the GPU's occupancy API answers: the least of
 * what registers (in units of 256 a warp), shared memory (1 KiB reserved a CTA), 2048 threads and 32 CTAs allow.
 * The plan's figures below and the emulator's occupancy (runtime/cuda/cu_emu.c) both use it. */
int plan_ctas_per_sm(int sm, int threads, size_t smem, int regs);
/* plan_ctas_per_sm of class c's decode kernel at `regs` registers a thread. */
int plan_decode_ctas_per_sm(const kvq_plan *p, const plan_class *c, int sm, int regs);
/* Cache bytes one decode tile of tile_tokens body tokens moves (codes, parameters, masks of K and V). */
double plan_decode_tile_bytes(const kvq_plan *p, const plan_class *c, double tile_tokens);
/* Bytes in flight per SM: stages x tile bytes x CTAs per SM (the pipeline issues tile i + stages - 1 before tile
 * i's math; at the top of a chunk all `stages` tiles are in flight). tile_tokens 0: the plan's tile. */
double plan_decode_bytes_in_flight(const kvq_plan *p, const plan_class *c, int sm, int regs, double tile_tokens);

/* Dims given on the command line win over the scheme's `model { }` block; then the defaults
 * (32 layers, 32 heads, 8 kv heads, head_dim 128). */
void plan_default_dims(const kvq_scheme *scheme, kvq_dims *dims);

#endif
