/* The cuda and emu backends (backend.h): the reference's streaming rules (runtime/ref, docs/cuda.md) with the
 * cache on the device and the work in the generated kernels, policy decisions included (kvq_policy.cuh: OTT's
 * pool competition, ZipCache's probe rows, saliency and classes, TailorKV's critical channels, scores, top-k and
 * calibration). The host keeps metadata the reference also keeps (token positions of every slot, counts) and
 * TailorKV's prompt K/V, which live in page-locked host memory the kernels read directly.
 *
 * Failure semantics: a prefill builds each sequence's layer aside and installs them all only when every item
 * succeeded. A decode step snapshots each item's layer metadata first (cu_snap), writes on the device only into
 * fresh pages, free slots and the second copy of OTT's pool state, and adopts that copy when the whole batch
 * succeeded; on any failure, allocation or device call, every item is put back as it was (cu_*_restore), the one
 * device write undone rather than avoided being OTT's unmasking of evicted tokens (kvq_ott_undo). Internal to
 * libkvq. */
#ifndef KVQ_CU_BACKEND_H
#define KVQ_CU_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "cu_dev.h"
#include "kvq_params.cuh"
#include "layout.h"
#include "plan.h"

/* A page on the device (layout.h), with its slots' positions on the host. A page of a ZipCache compression
 * (decode) keeps them on the device instead, as members (kvq_zip_gather: batch index of each slot, [H][capacity]
 * ints in the pool), until read_cache derives pos = members + pos_base. */
typedef struct {
    uint64_t addr;
    kvq_page_format fmt;
    kvq_page_layout lay;
    kvq_segment seg;
    int kind;  /* KVQ_SRC_* the decode kernel reads it as */
    int store; /* 0 k_hi, 1 k_lo, 2 v_hi, 3 v_lo */
    int count;
    int *pos; /* [H][capacity] */
    uint64_t members; /* 0, or device int [H][capacity] not yet turned into pos */
    int pos_base;
    uint64_t run; /* 0, or the address of the block its flush's page run shares (layout/tiles.h): key pages with the
                   * same run are back to back at kvq_page_run_stride, and a decode tile may span them */
} cu_page;

/* An fp16 window on the device, [H][cap][D], used as a ring: logical slot i is ring slot (head + i) % cap. */
typedef struct {
    uint64_t addr;
    size_t bytes;
    int cap, head, count;
    int *pos; /* [cap] by ring slot */
} cu_win;

/* OTT's pools (App. E) on the device: pool rows and pool state (kvq_params.cuh KVQ_OM_*) in two copies, spill rows
 * appended to in place (free slots only). A competition reads copy cur and writes copy cur ^ 1, which the step's
 * tiles then read; the step adopts it (cur ^= 1) only when the batch succeeded. The host keeps the counts. */
typedef struct {
    int keep, spill;
    size_t rows_bytes, srows_bytes, meta_bytes; /* one copy each */
    uint64_t rows[2], meta[2], srows;
    int cur, pending; /* pending: copy cur ^ 1 holds this step's competition */
    int unmasked;     /* the pending competition may have unmasked body key slots (spill 0) */
    int *count;       /* [2][H]: pool and spill counts of copy cur, as last fetched (statistics only) */
    int stale;        /* a competition was adopted since: count is fetched again when asked for */
} cu_ott;

typedef struct {
    int cls;
    const kvq_quant_cfg *cfg;
    int length;
    kvq_window_rule rule[2];
    cu_win sink[2], win[2];
    cu_page **pages[2];
    int n_pages[2], cap_pages[2];
    cu_page *append[2];
    int has_pool;
    cu_ott ott;
    /* ZipCache (Alg. 2-3): saliency classes; probe rows recorded on the device during a decode cycle */
    int saliency, pending_flush;
    uint64_t seed;
    int probe_cap, n_probes, n_rows, cycle_first;
    int *probe_pos;  /* [window capacity] */
    uint64_t rows;   /* device float [probe_cap][H][window capacity] */
    /* element formats whose tensor scale comes from the prompt (tensor_scale prompt), K and V: the prompt's absolute
     * maxima, device float [H] (kvq_tensor_amax), or 0 */
    uint64_t tamax[2];
    uint64_t tq_s; /* TurboQuant prod keys: the layer's QJL matrices on the device (kvq_backend_ctx.tq_s), or 0 */
} cu_qlayer;

typedef struct {
    int cls;
    const kvq_sparse_cfg *cfg;
    int length, T;
    uint16_t *host[2]; /* prompt K, V in page-locked host memory [H][T][D] fp16 */
    uint64_t host_dev[2];
    size_t host_bytes;
    uint16_t *host_kc; /* the prompt K again, channel-major [H][D][T] fp16, page-locked: what retrieval reads */
    uint64_t host_kc_dev;
    cu_win local[2]; /* sinks + recent of the prompt */
    cu_win *gen;     /* [2 * n_gen] generated tokens, KVQ_APPEND_PAGE_TOKENS per page, K then V */
    int n_gen, gen_cap;
    uint64_t absmax;   /* device float [H][D]: Eq. 10's max_t |K_t,i| over the prompt */
    uint64_t fetch[2]; /* device [H][topk][D] fp16: the rows fetched this step */
    int fetch_cap, n_fetch;
} cu_slayer;

typedef struct {
    int sparse;
    cu_qlayer q;
    cu_slayer s;
} cu_layer;

/* What a decode step may change in a layer's host metadata, saved before the step (cu_*_save) so a failed batch
 * can put it back (cu_*_restore). Device data needs no copy: the step writes only where nothing is yet. */
typedef struct {
    int length;
    int sink_count[2], win_head[2], win_count[2];
    int n_pages[2];
    cu_page *append[2];
    int append_count[2];
    int pending_flush, n_probes, n_rows, cycle_first;
    int *probe_pos; /* copy (saliency layers) */
    int n_gen, gen_count[2];
} cu_snap;

/* cu_pool.c: the engine's device memory for the cache (slabs, free lists by size). */
typedef struct {
    uint64_t addr;
    size_t bytes, used;
} cu_slab;
typedef struct {
    size_t bytes;
    uint64_t *addr;
    int n, cap;
} cu_free_list;
typedef struct {
    cu_slab *slabs;
    int n_slabs, cap_slabs;
    cu_free_list *lists;
    int n_lists, cap_lists;
    size_t total, used;
} cu_pool;

/* cu_step.c: planned decode steps (kvq_decode_plan / kvq_decode_run, docs/cuda.md "Planned steps"). The step
 * buffers are one allocation made by kvq_engine_reserve_step, so their addresses never change: the queries,
 * new K/V rows, outputs and split-KV partials of a layer's run, and the tables the plan uploads (per layer: the
 * sequences' tile counts and splits, their tiles, the store and quantize items). */
#define CU_STEP_STORES 4 /* k_hi, k_lo, v_hi, v_lo */
typedef struct {
    int max_batch, max_tokens; /* 0: no capacity reserved */
    int tiles_cap;             /* tiles of one sequence's layer */
    int st1_cap, st2_cap;      /* store items per sequence and layer: the new token's rows, a flush's fp16 pages */
    int q_cap[CU_STEP_STORES]; /* quantize items per sequence and layer, by store */
    int q_maxn[PLAN_MAX_CLASSES][CU_STEP_STORES]; /* most tokens one quantize item of a class's store writes */
    uint64_t mem;
    size_t mem_bytes;
    uint64_t q, out, lse, kvin, part, tables; /* in mem */
    size_t tables_bytes;                      /* for max_batch */
    unsigned char *host[2];                   /* page-locked staging of the tables, alternate plans */
    void *copied[2];                          /* events recorded after the copy from host[i] */
    int pending[2];                           /* copied[i] recorded and not yet waited for */
    int slot;
    /* the plan in force */
    int planned, n;
    kvq_backend_seq **seqs; /* [max_batch] */
    long tiles_built; /* tiles the last plan computed on the host (cu_step_tiles.c): O(tiles that change) */
    /* policy layers (cu_step_policy.c): their items per sequence and layer (TailorKV's retrieval and its two
     * gathers, OTT's competition and the mask addresses of its key pages), the retrieval's gather grid, and each
     * sequence's device scratch (the policy kernels' outputs and work, reused layer after layer) */
    int tk_cap, tkst_cap, ott_cap, ottm_cap, tk_gy;
    size_t pol_seq;
    uint64_t pol; /* in mem: [max_batch][pol_seq] */
    /* ZipCache layers, after the decode kernel: a probe's normaliser and row, a compression's classes (one item
     * for kvq_zip_rowsal and kvq_zip_select), its pages' gathers, their quantize items by store, the probe
     * positions of a cycle (host data, in the tables); rowsal's gridDim.x; the gathers' rows per sequence */
    int zip_cap, zg_cap, zpos_cap, qp_cap[CU_STEP_STORES], zc_gx;
    size_t zaux_seq;
} cu_step;

/* Where a plan's store and quantize launches go instead of the device (cu_launch while c->rec is set). */
typedef struct {
    kvq_store_params *st1, *st2;
    kvq_quant_params *q[CU_STEP_STORES];
    int n1, n2, nq[CU_STEP_STORES];
    uint64_t kvin, kvin_end; /* the new rows: a store from them is the token's own (st1) */
    int cls;
    /* policy items of the sequence (cu_step_policy.c), and where its policy kernels write and work */
    kvq_tk_params *tk;
    kvq_store_params *tkst; /* TailorKV's gathers of the fetched rows */
    kvq_ott_params *ott;
    uint64_t *ottm_host; /* the mask addresses of an OTT flush's key pages, in the tables at ottm_dev */
    uint64_t ottm_dev;
    int ntk, ntkst, nott;
    uint64_t pol;
    size_t pol_bytes;
    /* ZipCache (post: recording what runs after the decode kernel) */
    int post;
    kvq_zip_norm_params *zn;
    kvq_zip_params *zr, *zc, *zg;
    kvq_quant_params *qp[CU_STEP_STORES];
    int nzn, nzr, nzc, nzg, nqp[CU_STEP_STORES];
    int *zpos_host;
    uint64_t zpos_dev;
    uint64_t zaux; /* the gathers' rows: each page's own */
    size_t zaux_bytes, zaux_used;
} cu_rec;

/* cu_step_tiles.c: a sequence's decode tiles on the device for planned steps (docs/cuda.md "Planned steps"). A
 * layer's list is [sinks][OTT pools][body pages][window ring runs]; the body's tiles up to the last page that can
 * still change (the append page) never change again, so the plan sends only the head (a few tiles, compared with
 * the mirror) and the tail after `stable`, resumed from the merge's position there (cu_qlayer_body_tiles). */
typedef struct {
    int i, ko, j, vo; /* key run, offset in it; value run, offset in it (cu_qlayer.c stream_run) */
} cu_tile_cursor;
#define CU_STEP_PATCHES 2 /* patches per sequence and layer: the head's changed tiles, the tail's */
typedef struct {
    kvq_tile *mirror; /* what the device list holds (after the runs of the plans committed so far) */
    int n, cap;
    int head;           /* tiles of the sinks and pools, at [0, head) */
    int stable;         /* tiles [head, stable) come from frozen pages only */
    cu_tile_cursor at;  /* the body's merge position after tile stable - 1 */
    int valid;          /* 0: the device list holds nothing known (new, moved, a failed run): sent whole */
    /* the plan in progress, adopted by cu_step_tiles_commit */
    int p_n, p_head, p_stable, p_valid;
    cu_tile_cursor p_at;
    int p_first[CU_STEP_PATCHES], p_count[CU_STEP_PATCHES];
    const kvq_tile *p_src[CU_STEP_PATCHES]; /* in the plan's host tables */
} cu_tl;
typedef struct {
    uint64_t addr; /* [n_layers][cap] kvq_tile, from the engine's pool */
    int cap;
    cu_tl *layer; /* [n_layers] */
} cu_seq_tl;

struct kvq_backend_seq {
    int n_layers;
    cu_layer **layers;
    cu_seq_tl tl;
};

struct kvq_backend_ctx {
    kvq_be_engine e;
    cu_dev *dev;
    kvq_plan *plan;
    cu_module *mod;
    int H, Hq, D;
    /* per-step device scratch, grown as needed */
    uint64_t stage;
    size_t stage_bytes; /* fp16 rows of a prefill / a step, flags, gather indices */
    uint64_t tiles;
    size_t tiles_bytes;
    uint64_t seqs;
    size_t seqs_bytes;
    uint64_t qbuf;
    size_t qbuf_bytes; /* the batch's queries, outputs and lse */
    uint64_t part;
    size_t part_bytes;
    uint64_t aux;
    size_t aux_bytes; /* gather indices and mask flags of one page write */
    uint64_t pol;
    size_t pol_bytes; /* policy kernels' inputs, outputs and work */
    uint64_t kvin;
    size_t kvin_bytes; /* kvq_decode_device: the batch's new K and V rows, fp16 [n][2][H][D] */
    uint64_t *retired; /* scratch outgrown inside steps, freed outside them (cu_scratch_release) */
    int n_retired, cap_retired;
    kvq_tile *htiles;
    int htiles_cap;
    cu_pool pool;
    /* page-locked staging of a decode step's host data (cu_upload) and of its outputs: bump-allocated, started
     * over at a step after a synchronised one, and when full after a cu_dev_sync */
    unsigned char *hst;
    uint64_t hst_dev;
    size_t hst_bytes, hst_used;
    int hst_synced; /* the last step ended with a synchronisation: the staging can start over */
    int in_step; /* inside a decode step: host data goes through the staging, asynchronously */
    /* Fixed at load: decode blocks of each class one SM holds (the occupancy API) and the SM count, which size
     * every step's split-KV without a driver call. */
    int decode_blocks_per_sm[PLAN_MAX_CLASSES];
    int sm_count;
    int decode_waves; /* the split-KV rule, $KVQ_DECODE_WAVES (cu_tiles_per_chunk): 0 the shortest launch, N N waves */
    /* TurboQuant prod keys: per layer, the device copy of its QJL matrices (kvq_tqv's S, double, part by part), or
     * 0 (templates/kvq_turboquant.cuh); NULL when no layer has them */
    uint64_t *tq_s;
    cu_step step;
    cu_rec *rec; /* set while kvq_decode_plan records a layer's work */
    /* where cu_launch sends a launch while rec is set: cu_step_record (a hook, so cu_base.c calls nothing above it) */
    kvq_status (*record)(kvq_backend_ctx *c, const char *kernel, unsigned gx, unsigned gy, const void *params,
                         size_t size, char *msg, size_t ms);
    /* an eager step's batching (cu_batch.c): set while a step appends its sequences' tokens; cu_launch sends
     * every launch to batch_take, which keeps the stores and quantizations as items of list launches */
    struct cu_batch *batch, *batch_store; /* batch: the open one (NULL: none); batch_store: its memory */
    kvq_status (*batch_take)(kvq_backend_ctx *c, const char *kernel, unsigned gx, unsigned gy, unsigned gz,
                             unsigned bx, const void *params, size_t size, char *msg, size_t ms);
    uint64_t bitems;
    size_t bitems_bytes; /* the batch's items on the device */
};

/* cu_pool.c: zero-filled device memory from the engine's pool (cu_pool_put zeroes a block when it comes back). */
kvq_status cu_pool_get(kvq_backend_ctx *c, size_t bytes, uint64_t *addr, char *msg, size_t n);
void cu_pool_put(kvq_backend_ctx *c, uint64_t addr, size_t bytes);
/* Makes room for `bytes` more without a cuMemAlloc later (one slab). */
kvq_status cu_pool_reserve(kvq_backend_ctx *c, size_t bytes, char *msg, size_t n);
void cu_pool_free(kvq_backend_ctx *c);

/* cu_base.c: the helpers the layer files and planned steps call (they call only cu_dev and cu_pool) */
/* Host data for the device: inside a decode step, copied into the page-locked staging and sent with an async
 * copy on the engine's stream (no synchronisation); outside, a synchronous copy. */
kvq_status cu_upload(kvq_backend_ctx *c, uint64_t dst, const void *src, size_t bytes, char *msg, size_t n);
/* *out = `bytes` of the page-locked staging for this step (16-byte aligned). */
kvq_status cu_stage_take(kvq_backend_ctx *c, size_t bytes, void **out, char *msg, size_t n);
/* (cu_backend.c) A decode step's device work, queued on the engine's stream without any synchronisation, allocation (after
 * warm-up) or device-to-host copy (a ZipCache compression included, docs/cuda.md): append, plan, attend,
 * policies. The outputs are left on the device: [n][Hq][D] fp32 at *out_dev. On failure every item is as it
 * was. kvq_decode is this plus one async copy of the outputs into the staging and one cu_dev_sync. The caller
 * brackets it with cu_dev_enter / cu_dev_leave. */
kvq_status cu_decode_enqueue(kvq_backend_ctx *c, int layer, const kvq_be_decode *items, int n, uint64_t *out_dev,
                             char *msg, size_t ms);
/* Split-KV of a decode launch of class cls over n sequences whose longest has max_tiles tiles: tiles per chunk
 * (the chunks are then at most cu_chunks_max(c, cls, n)). */
int cu_tiles_per_chunk(const kvq_backend_ctx *c, int cls, int n_items, int max_tiles);
int cu_chunks_max(const kvq_backend_ctx *c, int cls, int n_items);
/* A device batch's inputs in one launch (kvq_step_in): q as fp32 [n][Hq][D] at q, k and v as fp16 rows
 * [n][2][H][D] at kv (K then V of each item), as the host path rounds them; with a planned step's n_stores new
 * tokens' stores at `stores` (kvq_store_params whose rows are in kv: read from the caller's tensors) and its
 * n_patches tile patches at `patches`, none of which depends on another. */
kvq_status cu_step_in(kvq_backend_ctx *c, const kvq_dev_decode *dv, int n, uint64_t q, uint64_t kv, uint64_t stores,
                      int n_stores, uint64_t patches, int n_patches, char *msg, size_t ms);
/* Where the decode kernel and the merge write the outputs: the caller's rows when they can take them in place
 * (fp32 [n][Hq][D] back to back, 16-byte aligned: the epilogue's float4 stores), else `own` (the engine's fp32 rows,
 * converted after). A layer step at batch 1 launched nine kernels, seven of them a few blocks (docs/gpu-results.md
 * run 8): this is one fewer. */
uint64_t cu_out_rows(const kvq_backend_ctx *c, const kvq_dev_decode *dv, uint64_t own);
/* The batch's outputs (fp32 [n][Hq][D] at out, base-2 lse [n][Hq] at lse) into the caller's dtype and strides,
 * lse as natural logarithms; out the caller's own rows (cu_out_rows) converts only lse. */
kvq_status cu_convert_out(kvq_backend_ctx *c, const kvq_dev_decode *dv, int n, uint64_t out, uint64_t lse, char *msg,
                          size_t ms);
/* The fused decode kernel of class cls over n sequences (their kvq_seq_tiles at seqs), split into nch chunks of
 * tpc tiles (tpc 1 with each sequence's split in its kvq_seq_tiles: planned steps), then the merge of the chunks
 * when nch > 1. q: [n][Hq][D] fp32; out, lse: [n][Hq][D] and [n][Hq] fp32; part: the chunks' partials; tq_s: the
 * layer's TurboQuant QJL matrices (kvq_backend_ctx.tq_s) or 0. */
kvq_status cu_decode_launch(kvq_backend_ctx *c, int cls, int n, int nch, int tpc, uint64_t q, uint64_t seqs,
                            uint64_t out, uint64_t lse, uint64_t part, uint64_t tq_s, char *msg, size_t ms);
/* kvq_convert_rows of n tokens x heads rows of dim elements (kvq_params.cuh). */
kvq_status cu_convert_rows(kvq_backend_ctx *c, uint64_t src, int sdt, long long sts, long long shs, uint64_t dst,
                           int ddt, long long dts, long long dhs, int n, int heads, int dim, float mul, char *msg,
                           size_t ms);
/* Device scratch `*buf` of at least `need` bytes: grown (doubling) by a new allocation, never by a free inside a
 * step (the outgrown buffer is retired until cu_scratch_release, outside steps). */
kvq_status cu_scratch(kvq_backend_ctx *c, uint64_t *buf, size_t *have, size_t need, char *msg, size_t n);
void cu_scratch_release(kvq_backend_ctx *c);
/* (cu_backend.c) kvq_engine_reserve_step: the eager step's scratch for max_batch sequences at the bounds S (cu_step_reserve). */
kvq_status cu_scratch_reserve(kvq_backend_ctx *c, int max_batch, const cu_step *S, char *msg, size_t ms);
kvq_status cu_launch(kvq_backend_ctx *c, const char *kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                     const void *params, size_t size, char *msg, size_t n);
/* gridDim.y for `blocks` blocks of work on y: at most 65535, the hardware's limit (the kernels that take tokens on
 * y stride over them, kvq_quantize.cuh). */
#define CU_GRID_YZ_MAX 65535u
unsigned cu_grid_y(long long blocks);
/* (cu_base.c, below cu_step.c, cu_step_policy.c and cu_qlayer.c, which all use them) A list kernel of a planned
 * step over n_items items at `items` (grid z), block 128. */
kvq_status cu_list_launch(kvq_backend_ctx *c, const char *kernel, unsigned gx, unsigned gy, uint64_t items,
                          int n_items, char *msg, size_t ms);
/* The factor and quantize list launches of store s (k_hi, k_lo, v_hi, v_lo) of class cls over n_items items at
 * `items`: the grids of the widest direct launch for items of up to maxn tokens. */
kvq_status cu_quant_lists(kvq_backend_ctx *c, int cls, int s, uint64_t items, int n_items, int maxn, char *msg,
                          size_t ms);
/* Every quantized store's list in one launch (kvq_quant_lists_c<cls>): store s's n_items[s] items at items[s], of
 * up to maxn[s] tokens (n_items 0: none), after the separable stores' factor lists; a launch a store when the items
 * exceed gridDim.z. The stores' items are independent (different pages), so one launch gives the bits of one a
 * store in turn. Nothing when no store has items. */
kvq_status cu_quant_lists_all(kvq_backend_ctx *c, int cls, const uint64_t items[CU_STEP_STORES],
                              const int n_items[CU_STEP_STORES], const int maxn[CU_STEP_STORES], char *msg, size_t ms);
/* ZipCache's gather rows of a page in a plan: `bytes` of the recording sequence's region (c->rec), or 0 with msg
 * set. */
uint64_t cu_rec_zaux_take(kvq_backend_ctx *c, size_t bytes, char *msg, size_t ms);
kvq_status cu_win_init(kvq_backend_ctx *c, cu_win *w, int cap, char *msg, size_t n);
void cu_win_free(kvq_backend_ctx *c, cu_win *w);
/* Stores n fp16 rows (src) into the window's next slots. */
kvq_status cu_win_push(kvq_backend_ctx *c, cu_win *w, const kvq_rows *src, int n, const int *pos, char *msg,
                       size_t msg_n);
void cu_tiles_push(kvq_backend_ctx *c, int *nt, kvq_tile t);
/* Tiles of a K window and a V window holding the same tokens (ring runs cut where either wraps). */
void cu_tiles_windows(kvq_backend_ctx *c, int *nt, const cu_win *k, const cu_win *v, int tile);
kvq_rows cu_rows_f16(uint64_t base, int head_stride, int first, int ring);

/* cu_qlayer.c */
kvq_status cu_qlayer_prefill(kvq_backend_ctx *c, cu_layer *L, int layer, const kvq_be_prefill *it, char *msg, size_t n);
/* The step's new token: fp16 rows on the device, K [H][D] at kv, V after it. */
kvq_status cu_qlayer_append(kvq_backend_ctx *c, cu_qlayer *L, uint64_t kv, char *msg, size_t n);
/* ZipCache layers with a window: after the step's attention (q: device [Hq][D] query rows; st: the sequence's tiles
 * of the step on the device), record the probe row when the step is a probe, then compress when the window is
 * full. */
kvq_status cu_qlayer_after_attend(kvq_backend_ctx *c, cu_qlayer *L, uint64_t q, const kvq_seq_tiles *st, char *msg,
                                  size_t n);
void cu_qlayer_tiles(kvq_backend_ctx *c, const cu_qlayer *L, int *nt);
/* cu_qlayer_tiles in two parts: the sinks' and pools' tiles, then the body's (pages, window runs) from the merge
 * position `at` (tiles appended at *nt). frozen_nt, frozen_at (may be NULL): the tile count and position after
 * the last tile before which every tile came from frozen runs (cu_tile_cursor), or at. */
void cu_qlayer_head_tiles(kvq_backend_ctx *c, const cu_qlayer *L, int *nt);
void cu_qlayer_body_tiles(kvq_backend_ctx *c, const cu_qlayer *L, cu_tile_cursor at, int *nt, int *frozen_nt,
                          cu_tile_cursor *frozen_at);
void cu_qlayer_free(kvq_backend_ctx *c, cu_qlayer *L);
void cu_qlayer_account(const kvq_backend_ctx *c, cu_qlayer *L, kvq_mem_stats *o);
kvq_status cu_qlayer_read(kvq_backend_ctx *c, const cu_qlayer *L, float *k, float *v, int capacity, char *msg,
                          size_t n);
kvq_status cu_qlayer_save(const cu_qlayer *L, cu_snap *s);
/* Puts L back as saved (frees what the step created); KVQ_OK unless undoing an OTT unmask failed on the device. */
kvq_status cu_qlayer_restore(kvq_backend_ctx *c, cu_qlayer *L, cu_snap *s, char *msg, size_t n);
void cu_qlayer_commit(kvq_backend_ctx *c, cu_qlayer *L);

/* cu_ott.c: OTT's pools (Sec. 3.2, App. E) on the device */
kvq_status cu_ott_init(kvq_backend_ctx *c, cu_ott *o, int keep, int spill, char *msg, size_t n);
void cu_ott_free(kvq_backend_ctx *c, cu_ott *o);
/* The competition of a flush of B tokens (fp16 rows k, v; positions first_pos + i) whose key pages are
 * L->pages[0][pg ..] (allocated, not written). On success *rows is the device [2][H][B][D] fp16 rows to
 * quantize (pooled tokens mean-replaced) and *flags the pooled flags by key page (kvq_ott_params.flags), both in
 * c->pol; the result is pending until cu_ott_commit. */
kvq_status cu_ott_compete(kvq_backend_ctx *c, cu_qlayer *L, const kvq_rows *k, const kvq_rows *v, int B, int first_pos,
                          int pg, uint64_t *rows, uint64_t *flags, char *msg, size_t n);
void cu_ott_commit(kvq_backend_ctx *c, cu_ott *o);
kvq_status cu_ott_undo(kvq_backend_ctx *c, cu_ott *o, char *msg, size_t n);
/* The pools' decode tiles, at most `tile` tokens each. */
void cu_ott_tiles(kvq_backend_ctx *c, const cu_ott *o, int tile, int *nt);
/* Statistics: fetches the adopted copy's counts from the device when they changed (outside steps). */
void cu_ott_account(const kvq_backend_ctx *c, cu_ott *o, kvq_mem_stats *out);
/* A pooled outlier reads as its fp16 copy, keys and values. */
kvq_status cu_ott_read(kvq_backend_ctx *c, const cu_ott *o, float *k, float *v, int capacity, char *msg, size_t n);

/* cu_saliency.c: ZipCache's policy (He et al. 2024, Eq. 7-9, Alg. 2-3) exactly as ref_saliency.c decides it */
kvq_status cu_sal_init(kvq_backend_ctx *c, cu_qlayer *L, int layer, char *msg, size_t n);
void cu_sal_free(kvq_backend_ctx *c, cu_qlayer *L);
/* Alg. 2: classes of the prompt's tokens [first, first + n): is_high [H][n] (host). k: the prompt's fp16 keys on
 * the device ([H][T][D] rows), q: [Hq][T][D] host. */
kvq_status cu_sal_prefill(kvq_backend_ctx *c, const cu_qlayer *L, const kvq_rows *k, const float *q, int T, int first,
                          int n, unsigned char *is_high, char *msg, size_t ms);
void cu_sal_new_cycle(cu_qlayer *L);
/* A probe step's row: kvq_zip_norm_{max,sum}_c<cls> and kvq_zip_norm_fin over the step's tiles (st), then
 * kvq_zip_row over the window. */
kvq_status cu_sal_record(kvq_backend_ctx *c, cu_qlayer *L, int pos, uint64_t q, const kvq_seq_tiles *st, char *msg,
                         size_t ms);
/* Alg. 3's classes of the window's batch of B tokens, left on the device: *is_high the device flags [H][B] (in
 * c->pol, valid until the next policy launch), for kvq_zip_gather. */
kvq_status cu_sal_flush(kvq_backend_ctx *c, const cu_qlayer *L, int B, uint64_t *is_high, char *msg, size_t ms);

/* cu_slayer.c */
kvq_status cu_slayer_prefill(kvq_backend_ctx *c, cu_layer *L, int layer, const kvq_be_prefill *it, char *msg, size_t n);
/* kv: the new token's fp16 rows on the device (K [H][D], V after it); q: its query there ([Hq][D] fp32). */
kvq_status cu_slayer_append(kvq_backend_ctx *c, cu_slayer *L, uint64_t kv, uint64_t q, char *msg, size_t n);
void cu_slayer_tiles(kvq_backend_ctx *c, const cu_slayer *L, int *nt);
void cu_slayer_free(kvq_backend_ctx *c, cu_slayer *L);
void cu_slayer_account(const kvq_backend_ctx *c, const cu_slayer *L, kvq_mem_stats *o);
kvq_status cu_slayer_read(kvq_backend_ctx *c, const cu_slayer *L, float *k, float *v, int capacity, char *msg,
                          size_t n);
void cu_slayer_save(const cu_slayer *L, cu_snap *s);
void cu_slayer_restore(kvq_backend_ctx *c, cu_slayer *L, const cu_snap *s);

/* cu_step.c (ctx entry points bracket the device themselves) */
kvq_status cu_step_reserve(kvq_backend_ctx *c, int max_batch, int max_tokens, char *msg, size_t ms);
kvq_status cu_step_plan(kvq_backend_ctx *c, kvq_backend_seq *const *seqs, int n, void *stream, char *msg, size_t ms);
kvq_status cu_step_run(kvq_backend_ctx *c, int layer, kvq_backend_seq *const *seqs, int n, const kvq_dev_decode *d,
                       char *msg, size_t ms);
/* cu_batch.c: an eager step's appends as list launches (docs/cuda.md "Eager steps"). The appends of a batch's
 * sequences launched a store per new K and V row and a quantization per value token and flush, 3 launches a
 * sequence for KIVI (99 at batch 32); between cu_batch_begin and cu_batch_end they are kept as the items of a planned
 * step's list kernels and launched as the planned run orders them: the new rows' stores (their sources in
 * [kvin, kvin_end)), the other stores (a flush's fp16 page writes, which read the windows the first ones wrote),
 * then every store's quantizations (cu_quant_lists_all). That order is the planned step's, which gives the same
 * bits; a launch of any other kernel first sends what is pending, in that order. Layers with policies (ZipCache,
 * OTT, TailorKV) are not batched. */
typedef struct cu_batch cu_batch;
/* dv: device rows of n sequences not converted yet (the batch then launches kvq_step_in with the new rows' stores,
 * before anything that reads them: q to fp32 rows at q, k and v to fp16 rows at kvin), or NULL. */
kvq_status cu_batch_begin(kvq_backend_ctx *c, int cls, uint64_t kvin, uint64_t kvin_end, const kvq_dev_decode *dv,
                          int n, uint64_t q, char *msg, size_t ms);
/* Sends what is pending (the inputs at least) and ends the batching; when st is not KVQ_OK nothing is sent. */
kvq_status cu_batch_end(kvq_backend_ctx *c, kvq_status st, char *msg, size_t ms);
void cu_batch_free(kvq_backend_ctx *c);

/* A launch while a plan records (c->rec): the store or quantize item goes into the plan's tables. */
kvq_status cu_step_record(kvq_backend_ctx *c, const char *kernel, unsigned gx, unsigned gy, const void *params,
                          size_t size, char *msg, size_t ms);
void cu_step_free(kvq_backend_ctx *c);

/* cu_step_policy.c: the policy layers of planned steps (TailorKV's sparse layers, OTT's pools, ZipCache) */
/* The bounds of layer configuration lc's policy work per sequence and step, for sequences of up to T tokens. */
void cu_step_policy_bounds(kvq_backend_ctx *c, const kvq_layer_cfg *lc, int cls, int T, cu_step *S);
/* A recorded launch of a policy kernel: 1 when it is one (*st its outcome), 0 otherwise. */
int cu_step_policy_record(kvq_backend_ctx *c, const char *kernel, const void *params, size_t size, kvq_status *st,
                          char *msg, size_t ms);
/* Layer `layer`'s policy launches of a run over n sequences, after the new tokens' stores: items at tk, tkst,
 * ott in the tables (fixed per layer and batch size). */
kvq_status cu_step_policy_run(kvq_backend_ctx *c, int layer, int n, uint64_t tk, uint64_t tkst, uint64_t ott,
                              char *msg, size_t ms);
/* ZipCache's launches of a run after the decode kernel: items at zn, zr, zc, zg, qp[store]. */
kvq_status cu_step_policy_post(kvq_backend_ctx *c, int layer, int n, uint64_t zn, uint64_t zr, uint64_t zc,
                               uint64_t zg, const uint64_t *qp, char *msg, size_t ms);
/* A layer of any mode in a plan: save before, put back when the plan fails (nothing of it ran on the device),
 * adopt when it succeeded. */
kvq_status cu_step_layer_save(cu_layer *L, cu_snap *s);
void cu_step_layer_restore(kvq_backend_ctx *c, cu_layer *L, cu_snap *s);
void cu_step_layer_commit(kvq_backend_ctx *c, cu_layer *L);

/* cu_step_tiles.c: the sequences' device tile lists of planned steps */
/* Bytes of one sequence's lists at the step capacity (every layer). */
size_t cu_step_tiles_seq_bytes(const kvq_backend_ctx *c);
/* Before a plan's layers: the sequence's array of tiles_cap tiles per layer, made at its first plan and made again
 * (its lists then sent whole) after a reservation with more tiles per layer. On the plan's stream. */
kvq_status cu_step_tiles_prepare(kvq_backend_ctx *c, kvq_backend_seq *s, char *msg, size_t ms);
/* Layer l of sequence s (after the plan's cu_qlayer_append): its tiles of the step, as the changes to its device
 * list: up to CU_STEP_PATCHES patches of kvq_tile_patch at `patch` (unused ones n = 0), their tiles at the host
 * tables' *tiles_at (tb: the host tables, dev: their device address), advanced; *st gets the list's address and
 * count. Adopted by cu_step_tiles_commit when the whole plan succeeds; otherwise nothing changed. */
kvq_status cu_step_tiles_plan(kvq_backend_ctx *c, kvq_backend_seq *s, int l, unsigned char *tb, uint64_t dev,
                              size_t *tiles_at, kvq_tile_patch *patch, kvq_seq_tiles *st, char *msg, size_t ms);
void cu_step_tiles_commit(kvq_backend_seq *s, int l);
/* The backends' step_tiles (backend.h, rt_step_tiles): the layer's tiles as cu_qlayer_tiles / cu_slayer_tiles
 * build them now, the list its last decode step read. */
kvq_status cu_step_tiles_info(kvq_backend_ctx *c, const kvq_backend_seq *s, int layer, kvq_tile_info *out, int cap,
                              int *n, char *msg, size_t ms);
/* The device list of layer l is no longer what the mirror says (a failed run, a new prefill): sent whole next. */
void cu_step_tiles_forget(kvq_backend_seq *s, int l);
void cu_step_tiles_free(kvq_backend_ctx *c, kvq_backend_seq *s);

/* cu_calib.c: TailorKV Eq. 6-9 (calibration) with kvq_tk_dense */
kvq_status cu_dense_preference(kvq_backend_ctx *c, const float *q, const float *k, int n, int n_q, double top,
                               double *score, char *msg, size_t ms);

#endif
