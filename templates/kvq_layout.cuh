/* Page section offsets (layout/layout.h) as the kernels compute them from a page's capacity. Plain integer C:
 * also compiled by the host test test_cuda_layout.c, which checks it against kvq_page_layout_compute for every
 * format, so kernels and runtime cannot disagree about where a section starts. */
#ifndef KVQ_LAYOUT_CUH
#define KVQ_LAYOUT_CUH

#include "kvq_params.cuh"

/* KVQ_HD (kvq_params.cuh): compiled by both sides */
/* A page's storage format: plan_store of compiler/plan.h, as kernel constants. */
typedef struct {
    int bits;   /* 1, 2, 3, 4, 8; 16 = fp16 values */
    int gran;   /* 0 per channel, 1 per token */
    int sep;    /* channel-separable factors stored */
    int group;  /* per token: channels per group (0 = hidden); per channel: tokens per group (0 = whole flush) */
    int hidden;
    int sbytes, zbytes; /* 2 (fp16) or 4 (fp32) */
    int masked;
    /* element formats (templates/kvq_format.cuh; 0 = asymmetric integers, the fields after it unused): the kind,
     * a tensor scale section per kv head (tsh), the static tensor scale (ts; 0 = from the prompt), a codebook's
     * levels (normal: Lloyd-Max levels, the group scale the root mean square). bits is the format's code width,
     * sbytes 1 an e4m3/e8m0 block scale, sbytes/zbytes 0 absent. */
    int kind, tsh, normal;
    float ts;
    int n_levels;
    float lv[16];
    /* TurboQuant pages (templates/kvq_turboquant.cuh; 0 = none, 1 mse, 2 prod: layout/layout.h): bits above is
     * the quantizer's (prod: one of them the QJL sign), tq_out the outlier split's channels (0 = no split) at
     * tq_ob bits, tl[j] part j's Lloyd-Max levels of N(0, 1/m_j) (part 0 the outliers when split, else the whole
     * vector), as kvq_tq_init computes them in double. Absent from every other format's initialiser (zeros). */
    int tq, tq_out, tq_ob;
    double tl[2][16];
} kvq_fmt;

typedef struct {
    long long codes, scale, zero, factor, qjl, mask, total;
    int cbpt;     /* code bytes per token of one kv head */
    int n_groups; /* per token: scale entries per token and kv head (1 when hidden) */
    int mask_stride; /* bytes of mask per kv head */
    long long tscale; /* element formats with a tensor scale: fp32 T, [1] or [kv_head] (layout/layout.h) */
} kvq_page_off;

KVQ_HD long long kvq_al16(long long n) { return (n + 15) & ~15LL; }

/* Formats whose levels are linear in the code, L = c - off (int symmetric, q8_0, q4_0, q5_0; off 0 for q4_1,
 * q5_1): the decode kernel runs them on its integer path, x = z' + s c with z' = z - s off. */
KVQ_HD int kvq_fmt_linear(int kind)
{
    return kind >= 1 && kind <= 6; /* compiler/scheme_format.h: int symmetric, q8_0, q4_0, q4_1, q5_0, q5_1 */
}

/* Code width the integer path stages a linear format's codes at (5-bit codes widen to 8). */
KVQ_HD int kvq_fmt_staged_bits(int kind, int bits) { return kvq_fmt_linear(kind) && bits == 5 ? 8 : bits; }

/* bits 32: the fp32 rows a decode tile stages for an element format (kvq_format.cuh kvq_fmt_staged), never a page */
KVQ_HD int kvq_fmt_cbpt(int bits, int D) { return bits >= 32 ? 4 * D : bits >= 16 ? 2 * D : D * bits / 8; }

KVQ_HD kvq_page_off kvq_page_offsets(kvq_fmt f, int H, int D, int cap)
{
    kvq_page_off o;
    long long off = 0, n_par = 0;
    int quantized = f.bits < 16;
    o.cbpt = kvq_fmt_cbpt(f.bits, D);
    if (quantized && f.tq) { /* TurboQuant: each part's codes at its MSE bits (prod spends one on QJL) */
        const int qjl = f.tq == 2;
        o.cbpt = kvq_fmt_cbpt(f.bits - qjl, D - f.tq_out) + (f.tq_out ? kvq_fmt_cbpt(f.tq_ob - qjl, f.tq_out) : 0);
    }
    o.n_groups = 0;
    o.codes = 0;
    off += kvq_al16((long long)H * cap * o.cbpt);
    if (quantized) {
        if (f.gran == 0) {
            n_par = (long long)H * D;
        } else if (f.hidden) {
            o.n_groups = 1;
            n_par = cap;
        } else {
            o.n_groups = f.tq && f.tq_out ? 2 : D / f.group; /* TurboQuant's split: a norm per part */
            n_par = (long long)H * cap * o.n_groups;
        }
    }
    o.scale = off;
    off += kvq_al16(n_par * f.sbytes);
    o.zero = off;
    off += f.tq == 1 ? 0 : kvq_al16(n_par * f.zbytes); /* TurboQuant mse: the norm only */
    o.factor = off;
    off += quantized && f.sep ? kvq_al16((long long)H * D * f.sbytes) : 0;
    o.qjl = off; /* TurboQuant prod's sign bits, [kv_head][cap][D / 8] */
    off += quantized && f.tq == 2 ? kvq_al16((long long)H * cap * D / 8) : 0;
    o.mask_stride = (cap + 7) / 8;
    o.mask = off;
    off += f.masked ? kvq_al16((long long)H * o.mask_stride) : 0;
    o.tscale = off; /* e4m3 (7), e5m2 (8), nvfp4 (9): compiler/scheme_format.h */
    off += quantized && (f.kind == 7 || f.kind == 8 || f.kind == 9) ? kvq_al16(4LL * (f.tsh ? H : 1)) : 0;
    o.total = off;
    return o;
}

/* Pages of a page run (layout/tiles.h: the pages of one flush back to back) start this far apart: the page's
 * total rounded up to 256 bytes, as kvq_page_run_stride. */
KVQ_HD long long kvq_page_stride(long long total) { return (total + 255) & ~255LL; }

/* Shared-memory token rows of a decode tile (docs/cuda.md "Bank conflicts"). Row t of R bytes sits at t R; its
 * 16-byte chunk c sits at chunk c ^ kvq_row_swz(t, R, c) of the row: an XOR below 8 that keeps a chunk inside its
 * row and its 128-byte line of the row, so rows keep their places and a reader of one row's consecutive chunks
 * (p.V over a row's channels) still reads a permutation of them. Rows of C = R / 16 chunks:
 *   C < 8 (8 / C rows a 128-byte line): the line's index, masked to C - 1. 2-bit p.V reads rows 2t, 2t + 1,
 *     2t + 8, 2t + 9 of a 16-token block at one chunk, 4-bit p.V its rows 0, 2, 4, 6: lines apart;
 *   C >= 8: the row (t mod 8), and for rows of several lines (nl = C / 8, fp16 rows at head_dim 128: 2) the
 *     row's line L placed at the top bits (L << (3 - log2 nl)): the score loop's 8 lanes of a quarter-warp read
 *     one chunk of 8 rows (split 1) or of 4 rows in both halves (split 2, the fp16 classes' 64-token tiles).
 * Rows whose chunk count is neither a power of two nor a multiple of 8 (head_dim 96: 24-byte rows) and rows of
 * one chunk are not swizzled. The XOR repeats every 8 rows (t mod 8), so it is the same for a row of every
 * 16-token block: a tensor-core warp computes it once. */
KVQ_HD int kvq_row_swz_ok(int R)
{
    const int C = R >> 4;
    return R % 16 == 0 && C > 1 && ((C & (C - 1)) == 0 || C % 8 == 0);
}
KVQ_HD int kvq_row_swz(int t, int R, int c)
{
    const int C = R >> 4;
    if (!kvq_row_swz_ok(R)) return 0;
    if (C < 8) return (t / (8 / C)) & (C - 1);
    int sh = 3;
    for (int nl = C >> 3; nl > 1 && sh > 0; nl >>= 1) sh--;
    return (t ^ ((c >> 3) << sh)) & 7;
}
/* The byte of a tile's rows (R bytes each, swizzled when sw) that holds logical byte b of row t. */
KVQ_HD int kvq_row_byte(int t, int R, int b, int sw)
{
    return t * R + (sw ? (((b >> 4) ^ kvq_row_swz(t, R, b >> 4)) << 4) + (b & 15) : b);
}

/* Phase 1's lanes (kvq_scores, kvq_probs): thread tid's part of its token (channels [part D / split, ...)) and
 * its token lane, split 1, 2 or 4 lanes a token. A token's parts are lanes 8 apart (bits 3 and 4), not
 * neighbours: a quarter-warp's eight lanes (one phase of a 16-byte load) take eight tokens of one part, so they
 * read one query row (a broadcast) and one chunk of eight rows (the swizzle's case), where neighbouring parts
 * read query rows D / split channels apart, in one bank group (2-way: the fp16 classes' fp32 score loop, ncu
 * run 4). test_cuda_banks derives that loop's loads from this function. */
KVQ_HD void kvq_p1_lane(int tid, int split, int *part, int *lane1)
{
    const int l = tid & 31;
    *part = (l >> 3) & (split - 1);
    *lane1 = (tid >> 5) * (32 / split) + ((l & 7) | ((l >> 3) / split) << 3);
}

/* The decode prologue's query copy (16-byte aligned rows): item i loads channels [c, c + 4) of head h in one
 * 16-byte load and stores them to the [D][GQA] rows in the order c + ((k + rot) & 3), k = 0..3. Items go heads
 * first and rotate by the channel quad cq: a store's word is 4 GQA cq + GQA ((k + rot) & 3) + h, so the banks the
 * warp's 32 lanes hit are distinct when rot takes the bits of cq above the 32 / (4 GQA) quads one bank row holds
 * (cq GQA / 8 up to GQA 8, cq beyond: powers of two; other GQA are correct, with conflicts). Channels first (32
 * lanes of one head) the stores hit 2 banks at GQA 4 (16-way: ncu, H200 run 6). */
KVQ_HD void kvq_q_copy_item(int i, int gqa, int *h, int *c, int *rot)
{
    const int cq = i / gqa;
    *h = i - cq * gqa, *c = 4 * cq, *rot = (gqa <= 8 ? cq * gqa / 8 : cq) & 3;
}

/* The bias partials of per-channel keys (kvq_fold_k: red, [page][GQA][8] floats, eight partial sums of q . z a
 * head): a page's block 8 GQA + 4 floats long, an odd multiple of 4 words, so that the fold's stores (one head
 * at a time, lanes over eight pages and four parts) fall in 32 banks, where blocks of 8 GQA words put a warp's
 * eight pages in one bank (8-way: ncu, H200 run 6). Still 16-byte aligned (two 16-byte loads a head). */
KVQ_HD int kvq_bred_page(int gqa) { return 8 * gqa + 4; }
KVQ_HD int kvq_bred_at(int gqa, int pg, int h) { return pg * kvq_bred_page(gqa) + 8 * h; }

#endif
