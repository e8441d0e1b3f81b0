/* The reference backend's internal types: the oracle every fast backend is tested against. Readable and slow on
 * purpose. The storage is exactly layout.h's (pages, fp16 windows, pools) so that kvq_engine_stats equals
 * kvq_scheme_account byte for byte; docs/runtime.md describes the semantics, docs/layout.md the bytes.
 *
 * What is *not* device memory and so not accounted: token positions of every slot (read_cache and the pool
 * need them), OTT key scores of pooled tokens, ZipCache probe rows gathered during decode, TailorKV's per-channel
 * key absmax, and per-call scratch. A GPU backend keeps the equivalent on the host or recomputes it. */
#ifndef KVQ_REF_H
#define KVQ_REF_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "layout.h"
#include "quant.h"
#include "turboquant.h"

/* ---- fp16 storage: one tensor (K or V) of an fp16 window, [H][cap][D], tokens in arrival order ---- */
typedef struct {
    int H, D, cap, count;
    size_t bytes;   /* kvq_window_tensor_bytes(H, D, cap): what is allocated and accounted */
    uint16_t *data; /* [H][cap][D] fp16 */
    int *pos;       /* [cap] token position of each slot, the same for every kv head */
} ref_win;

kvq_status ref_win_init(ref_win *w, int H, int D, int cap);
void ref_win_free(ref_win *w);
/* Appends one token: x[h * x_head_stride + c] for every head h and channel c. count < cap. */
void ref_win_push(ref_win *w, const float *x, size_t x_head_stride, int pos);
/* Slot `slot` of head h widened to fp32. */
void ref_win_read(const ref_win *w, int h, int slot, float *out);
/* Drops the n oldest tokens (the window keeps arrival order). */
void ref_win_drop_front(ref_win *w, int n);

/* ---- OTT outlier pool / spill pool: K and V fp16, each kv head with its own members ---- */
typedef struct {
    int H, D, cap;
    size_t bytes;      /* kvq_window_bytes(H, D, cap) */
    uint16_t *k, *v;   /* [H][cap][D] each (one allocation) */
    int *count;        /* [H] */
    int *pos;          /* [H][cap] */
    float *score;      /* [H][cap] the competition metric of each member (host metadata) */
} ref_pool;

kvq_status ref_pool_init(ref_pool *p, int H, int D, int cap);
void ref_pool_free(ref_pool *p);

/* ---- a quantized page (layout.h): one quantization batch of one tensor and one precision class ---- */
typedef struct {
    kvq_page_format fmt;
    kvq_page_layout lay;
    kvq_segment seg; /* KVQ_SEG_BODY_HIGH or KVQ_SEG_BODY_LOW: where its codes are accounted */
    int count;       /* slots filled (an appendable page fills one token per step) */
    uint8_t *mem;    /* lay.total bytes, zero-initialised */
    const kvq_tqv *tq; /* TurboQuant pages (fmt.tq): the layer's quantizer (its parts' levels and QJL matrices) */
    int *pos;        /* [H][cap] token position of each slot (host metadata) */
    float levels[256]; /* element formats other than int: the level table L (kvq_format_levels) */
    int run_idx, run_len; /* a page run (layout/tiles.h) of run_len full key pages of one flush, this the
                           * run_idx-th; run_len 0: none. The pages stay separate allocations: the cpu backend's
                           * tiles span a run through per-page descriptors (docs/cpu.md "Spans and tiles") */
} ref_page;

/* Allocates a page of the given format (capacity inside fmt). */
kvq_status ref_page_new(const kvq_page_format *fmt, kvq_segment seg, ref_page **out);
void ref_page_free(ref_page *p);
/* Quantizes n = fmt.capacity tokens as one batch (ZipCache Alg. 1 / KIVI GroupQuant): token i of head h is at
 * x[h * head_stride + i * D], its position at pos[h * pos_stride + i]. */
void ref_page_fill(ref_page *p, const float *x, size_t head_stride, const int *pos, size_t pos_stride);
/* Appends one token (per-token or fp16 pages only): x [H][D]. */
void ref_page_append(ref_page *p, const float *x, int pos);
/* The tensor scale T of element formats that have one (e4m3, e5m2, nvfp4): set before a fill or an append,
 * stored in the page's tscale section; t[kv_heads] (each head's; all equal unless per head). */
void ref_page_set_tscale(ref_page *p, const float *t);
/* Dequantized slot of head h (fp32). */
void ref_page_read(const ref_page *p, int h, int slot, float *out);
int ref_page_masked(const ref_page *p, int h, int slot);
void ref_page_set_mask(ref_page *p, int h, int slot, int on);
/* 1 if a per-channel page: its parameters span the page's tokens, so it cannot be appended to. */
int ref_page_appendable(const kvq_page_format *fmt);

typedef struct {
    ref_page **v;
    int n, cap;
} ref_pages;

kvq_status ref_pages_reserve(ref_pages *l, int extra);
void ref_pages_free(ref_pages *l);

/* Capacities of the pages a flush class of `count` tokens is stored in: per channel, pages of the group size
 * (the last may be short; group all: one page); per token, one page. Exactly account.c's split. Returns the
 * number of pages (caps may be NULL to count). */
int ref_class_split(const kvq_tensor_cfg *t, int count, int *caps);

/* ---- scratch: one allocation carved in order, so a call allocates everything before it mutates ---- */
typedef struct {
    unsigned char *base;
    size_t size, used;
} ref_arena;

kvq_status ref_arena_init(ref_arena *a, size_t size);
void ref_arena_free(ref_arena *a);
void *ref_arena_take(ref_arena *a, size_t bytes); /* 16-byte aligned; the caller sized the arena */
/* Bytes ref_arena_take needs for `bytes` (its rounding), to size an arena. */
static inline size_t ref_arena_need(size_t bytes) { return (bytes + 15) & ~(size_t)15; }

/* ---- layers ---- */
typedef struct ref_qlayer {
    const kvq_quant_cfg *cfg;
    int H, Hq, D;
    float scale; /* softmax scale */
    uint64_t seed;
    int layer;
    int length;
    kvq_window_rule rule[2];
    ref_win sink[2];      /* K, V of the first `sinks` tokens */
    ref_win win[2];       /* residual window of K, of V (rule[which].capacity slots) */
    ref_pages pages[2];   /* quantized body of K, of V */
    ref_page *append[2];  /* the appendable page being filled, or NULL (it is also in pages[]) */
    ref_pool pool, spill; /* OTT: outlier pool (keep) and spill pool */
    kvq_tqv *tq[2];       /* TurboQuant K, V quantizers (heap: pages point at them), or NULL */
    /* ZipCache decode: the probe queries of the current cycle and their attention rows over the window. */
    int probe_cap;        /* bound on probes per cycle */
    int *probe_pos;       /* [probe_cap] absolute positions, ascending */
    int n_probes, n_rows; /* probes chosen for this cycle; rows recorded so far (rows[i] is probe_pos[i]'s) */
    int cycle_first;      /* position of window slot 0 during this cycle */
    float *tscale[2];     /* element formats' tensor scale T of K, of V, per kv head; 0 until known */
    float *rows;          /* [probe_cap][H][wcap]: per kv head, the group's query heads' probabilities summed */
} ref_qlayer;

typedef struct ref_slayer {
    const kvq_sparse_cfg *cfg;
    int H, Hq, D;
    float scale;
    int length, T; /* T: prompt length (what host memory holds) */
    ref_win host[2];  /* every prompt token, fp16 (KVQ_SEG_HOST) */
    ref_win local[2]; /* sinks + recent of the prompt (KVQ_SEG_SPARSE_LOCAL) */
    ref_win *gen;     /* [2 * n_gen] generated tokens, KVQ_APPEND_PAGE_TOKENS per page, K then V */
    int n_gen, gen_cap;
    float *absmax;    /* [H][D] TailorKV Eq. 10 max_t |K_t,i| over the prompt (App. I absmax_k) */
} ref_slayer;

typedef struct ref_layer {
    int sparse;
    ref_qlayer q;
    ref_slayer s;
} ref_layer;

struct kvq_backend_ctx {
    kvq_be_engine e;
    void *ext; /* a backend built on the reference's storage (the cpu backend) keeps its own state here */
};

struct kvq_backend_seq {
    int n_layers;
    ref_layer **layers; /* NULL until the layer's prefill */
};

/* ref_backend.c: the vtable's entries (backend.h) that a backend built on this storage (the cpu backend) shares. */
kvq_status ref_seq_create(kvq_backend_ctx *ctx, kvq_backend_seq **out, char *msg, size_t msg_size);
void ref_seq_free(kvq_backend_ctx *ctx, kvq_backend_seq *s);
int ref_seq_length(const kvq_backend_seq *s, int layer);
kvq_status ref_prefill(kvq_backend_ctx *ctx, int layer, const kvq_be_prefill *items, int n, char *msg,
                       size_t msg_size);
void ref_seq_account(const kvq_backend_ctx *ctx, const kvq_backend_seq *s, kvq_mem_stats *out);
kvq_status ref_read_cache(kvq_backend_ctx *ctx, const kvq_backend_seq *s, int layer, float *k, float *v,
                          int capacity, int *n_tokens, char *msg, size_t msg_size);

/* What a decode step allocates before it mutates anything (kvq_backend.decode is all-or-nothing). */
typedef struct {
    ref_page **pages; /* new pages, used in order */
    int n_pages, used_pages;
    ref_win gen[2];   /* sparse layers: a new page of generated tokens, or cap 0 */
    ref_arena arena;  /* scratch of the step */
} ref_reserve;

void ref_reserve_free(ref_reserve *r);

/* ref_quant_layer.c */
/* What a decode step moves (plan_step in ref_quant_layer.c). */
typedef struct {
    int to_sink;
    int flush[2];  /* tokens leaving the window of K / V this step (0: none) */
    int direct[2]; /* the token skips the window (capacity 0): a flush of itself */
} ref_step_plan;

/* One decode step in three phases, so that a faster backend can replace the attention in the middle and keep
 * the storage: begin (fp16 rounding, sinks, windows, and KIVI/OTT flushes: Alg. 1 quantizes before attending),
 * attention over L->length tokens, end (ZipCache Alg. 3: record the probe row, then compress every W).
 * ref_qlayer_step is the three in a row with ref_qlayer_attend_all. */
typedef struct {
    ref_step_plan plan;
    const float *xnew[2]; /* the new token's fp16-rounded K and V [H][D] (in the reserve's arena) */
    int pos;
    int saliency; /* step_end has work: ZipCache decode */
    int probe;    /* the query is a ZipCache probe: step_end needs its probability rows [Hq][length] */
} ref_qstep;

kvq_status ref_qlayer_step_begin(ref_qlayer *L, ref_reserve *r, const float *k, const float *v, ref_qstep *s);
kvq_status ref_qlayer_step_end(ref_qlayer *L, ref_reserve *r, ref_qstep *s, const float *probs);
/* Attention of every query head over the cache: materialise each kv head, attend with its group's query heads.
 * probs [Hq][length] when the caller needs the rows (ZipCache probes), else NULL. Scratch from `a`:
 * ref_attend_scratch_bytes(length, D). */
kvq_status ref_qlayer_attend_all(const ref_qlayer *L, const float *q, float *out, float *probs, ref_arena *a);
kvq_status ref_qlayer_prefill(ref_layer *L, const kvq_be_engine *e, int layer, const kvq_quant_cfg *cfg,
                              const kvq_be_prefill *it, char *msg, size_t msg_size);
kvq_status ref_qlayer_reserve(ref_qlayer *L, ref_reserve *r);
kvq_status ref_qlayer_step(ref_qlayer *L, ref_reserve *r, const float *k, const float *v, const float *q, float *out);
void ref_qlayer_free(ref_qlayer *L);
void ref_qlayer_account(const ref_qlayer *L, kvq_mem_stats *out);
/* The cache of kv head h as attention sees it, in token order: K, V [length][D]. seen: 2 * length bytes of
 * scratch. KVQ_ERR_INTERNAL if a token is missing or present twice (an invariant of the streaming rules). */
kvq_status ref_qlayer_materialize(const ref_qlayer *L, int h, float *K, float *V, unsigned char *seen);
/* Scratch bytes ref_qlayer_materialize and one attention over `len` tokens need. */
size_t ref_attend_scratch_bytes(int len, int D);

/* ref_outlier.c: OTT (Sec. 3.2, App. E) */
/* One quantization step of the outlier pool for a flush of B consecutive tokens (first position first_pos),
 * xk/xv [H][B][D] (fp16 values, modified: pooled tokens are replaced by their group's mean). Marks pooled[h*B+i]
 * for the tokens that entered the pool; evictions go to the spill pool or back to the body (spill 0). The key
 * pages of the flush are written after this, with pooled slots masked. */
void ref_outlier_step(ref_qlayer *L, float *xk, float *xv, int B, int first_pos, unsigned char *pooled,
                      ref_arena *scratch);
size_t ref_outlier_scratch_bytes(int B);

/* ref_saliency.c: ZipCache (Alg. 2-3) */
/* Prefill (Alg. 2): probe queries of the prompt, their attention rows, saliency, and the high-precision class
 * of the n tokens [first, first + n) of the prompt: is_high[h * n + i]. k: [H][T][D], q: [Hq][T][D]. */
void ref_saliency_prefill(const ref_qlayer *L, const float *k, const float *q, int T, int first, int n,
                          unsigned char *is_high, ref_arena *scratch);
size_t ref_saliency_prefill_scratch_bytes(const ref_qlayer *L, int T, int n);
/* Decode (Alg. 3): the class of the window's B oldest tokens from the rows gathered this cycle. */
void ref_saliency_flush(const ref_qlayer *L, int B, unsigned char *is_high, ref_arena *scratch);
size_t ref_saliency_flush_scratch_bytes(const ref_qlayer *L, int B);
/* The most probe queries kvq_select_probes picks among n positions. */
int ref_probe_bound(const kvq_saliency_cfg *s, int n);
/* Starts a decode cycle: chooses the probe queries among the next decode positions until the next flush. */
void ref_saliency_new_cycle(ref_qlayer *L);
/* Records the attention row of the decode query at position pos if it is a probe: probs [Hq][length] are the
 * probabilities of each query head over the positions [0, length). */
void ref_saliency_record(ref_qlayer *L, int pos, const float *probs, int length);

/* ref_sparse.c: TailorKV sparse layers (Sec. 4.2, App. I) */
kvq_status ref_slayer_prefill(ref_layer *L, const kvq_be_engine *e, const kvq_sparse_cfg *cfg,
                              const kvq_be_prefill *it, char *msg, size_t msg_size);
kvq_status ref_slayer_reserve(ref_slayer *L, ref_reserve *r);
void ref_slayer_step(ref_slayer *L, ref_reserve *r, const float *k, const float *v, const float *q, float *out);
void ref_slayer_free(ref_slayer *L);
void ref_slayer_account(const ref_slayer *L, kvq_mem_stats *out);
/* Every token of kv head h in order (host copy + generated): K, V [length][D]. */
void ref_slayer_read(const ref_slayer *L, int h, float *K, float *V);

/* ref_attend.c */
/* Exact softmax attention of one query over n rows (double accumulation, two passes): out [D]; probs [n] (may
 * be NULL) receives the probabilities. */
void ref_attend(const float *q, const float *K, const float *V, int n, int D, float scale, float *out,
                float *probs);
/* fp16 storage rounding of n values (everything the cache stores or quantizes is fp16 first). */
void ref_round_f16(float *dst, const float *src, size_t n);

#endif
