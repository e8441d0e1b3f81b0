/* The fused decode-attention kernel body and the merge of split-KV partial results (DESIGN §6).
 *
 * One block serves one kv head of one sequence over one chunk of its tiles, for all GQA query heads of that kv
 * head. A tile is a run of tokens whose keys and values each sit in one container (kvq_tile): a quantized page
 * of either precision class, or fp16 rows (sinks, residual window, outlier and spill pools, sparse rows). For
 * each tile the block stages the codes (16-byte cp.async) and the tile's scales, zeros, factors and mask bits
 * into shared memory once; every thread then reads only its VEC channels of a token:
 *
 *   thread (tx, ty, tz): channels [tx*VEC, tx*VEC+VEC), query heads ty*HPT .. ty*HPT+HPT-1, tokens tz, tz+TZ, ...
 *   score  = sum over lanes tx of the partial dot products (shuffle-xor within TX lanes), log2 domain
 *   online softmax per head (m, d), o += p * v over the thread's channels
 *   end of chunk: the TZ token lanes merge (m, d, o) through shared memory; with one chunk the block writes
 *   o / d, with several it writes (o / d, lse) and kvq_merge combines the chunks.
 *
 * Algebra keeps scales out of the inner loops: per-channel key scales and zeros fold into the query once per
 * tile (q'_c = q_c s_c, bias = sum_c q_c z_c); per-token key parameters multiply the code dot product once per
 * token; per-token value scales fold into the attention weight (w = p s_t) and the zeros accumulate as one
 * scalar per head (sum p z_t) added back at the end of the tile. Plan constants: KVQ_D, KVQ_HQ, KVQ_HKV,
 * KVQ_GQA, KVQ_VEC (8), KVQ_TX, KVQ_TY, KVQ_HPT, KVQ_TZ, KVQ_THREADS. */
#ifndef KVQ_DECODE_CUH
#define KVQ_DECODE_CUH

#include "kvq_format.cuh"
#include "kvq_mma.cuh"
#include "kvq_turboquant.cuh"

/* Staged tile of one tensor in shared memory (one stage of the load pipeline). */
typedef struct {
    unsigned char *rows; /* [tile][row bytes] */
    float *s, *z;        /* per channel: [D]; per token: [tile][n_groups] */
    float *f;            /* channel-separable factors [D] */
    unsigned char *mask; /* keys: [tile], 1 = masked slot */
    unsigned char *raw;  /* parameter bytes as cp.async lands them: scales, zeros (raws bytes each), factors (rawf),
                          * mask bits */
    int raws, rawf;
    const float *sq;     /* TurboQuant prod keys: the block's sqrt(pi/2)/m S q, [D][GQA] (kvq_turboquant.cuh) */
    int praw;            /* scales and zeros are read from raw (kvq_kpar_raw, kvq_vpar_raw), never widened into s, z
                          * (plan.c, par_raw_ok: per-channel integer keys, per-token values on the tensor cores) */
} kvq_stage_buf;

/* What a call of kvq_stage stages of a tensor's tile: its rows (codes or fp16), its parameters (scales, zeros,
 * factors, mask bits), or both. */
#define KVQ_PART_ROWS 1
#define KVQ_PART_PARS 2
#define KVQ_PART_ALL 3

/* count 16-byte copies whose sources may run through pages m steps a page: copy i from s + (i / m) ps + (i % m) js
 * to d + i jd (m 1, 2 or 4, a constant after inlining; m 1 is a plain run with ps = js). Four an iteration: where
 * the steps are constants both addresses then take immediate offsets, about 4.5 instructions a copy (LDGSTS, the
 * predicated-off LDS that ptxas puts before a group of them, the loop's own) where a rolled loop took 12 (its
 * index, two 64-bit moves and adds, compare, branch). Each body starts with a line of its own that runs once an
 * iteration (the cost model counts a loop's line with its exit, compiler/sass_cost.c). */
KVQ_DEV void kvq_cp_async16_run(unsigned char *d, const unsigned char *s, int count, int jd, long long js, int m,
                                long long ps)
{
    int i = 0;
#pragma unroll 1
    while (i + 4 <= count) {
        i += 4, d += 4 * jd, s += (4 / m) * ps;
#pragma unroll
        for (int j = 0; j < 4; j++) kvq_cp_async16(d + (j - 4) * jd, s + (j / m - 4 / m) * ps + (j % m) * js);
    }
#pragma unroll 1
    while (i < count) {
        const int j = i++ & 3; /* the copy's place in its group of four (i left the loop a multiple of 4) */
        kvq_cp_async16(d + j * jd, s + (j / m) * ps + (j % m) * js);
    }
}

/* The copies thread tid of nt takes of blocks [0, nb) (blocks tid, tid + nt, ...). */
KVQ_DEV int kvq_copies_of(int nb, int tid, int nt) { return tid < nb ? (nb - tid + nt - 1) / nt : 0; }

/* Block k of kvq_stage_par's range (r = src & 15, src16 = src - r): issue its copy (fin 0) or widen it (fin 1). */
KVQ_DEV void kvq_par_block(int fin, float *out, unsigned char *dst, const unsigned char *src16, int r, int n, int eb,
                           int k)
{
    if (!fin) {
        kvq_cp_async16(dst + 16 * k, src16 + 16 * k);
        return;
    }
    /* the common case, an aligned range (every per-channel page section; per-token ranges from an even slot):
     * block k is elements [16k / eb, 16k / eb + 16 / eb), one 16-byte load, two (one) 16-byte stores */
    const int vec = r == 0 && (eb == 2 || eb == 4) && ((kvq_u64)out & 15) == 0;
    if (vec && (k + 1) * (16 / eb) <= n) {
        const uint4 u = *(const uint4 *)(dst + 16 * k);
        float4 *o4 = (float4 *)(out + k * (16 / eb));
        if (eb == 4) {
            o4[0] = make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z), __uint_as_float(u.w));
        } else {
            const float2 a = kvq_h22f2(kvq_bits_h2(u.x)), c = kvq_h22f2(kvq_bits_h2(u.y));
            const float2 d = kvq_h22f2(kvq_bits_h2(u.z)), e = kvq_h22f2(kvq_bits_h2(u.w));
            o4[0] = make_float4(a.x, a.y, c.x, c.y);
            o4[1] = make_float4(d.x, d.y, e.x, e.y);
        }
        return;
    }
    const int j0 = max(0, (16 * k - r + eb - 1) / eb), j1 = min(n, (16 * k + 16 - r + eb - 1) / eb);
    for (int j = j0; j < j1; j++) out[j] = kvq_ld_par(dst + r, j, eb);
}

/* The parameters of a tile move as whole 16-byte blocks: [src, src + n eb) is covered by the aligned blocks from
 * src & ~15, landed at dst (16-aligned), so element j sits at dst + (src & 15) + j eb. A page's sections start
 * 16-byte aligned and their sizes are multiples of 16 (kvq_page_offsets), so every covering block lies inside
 * the page. fin 0 issues the copies (cp.async 16 B, thread tid of the nt staging the stream takes blocks tid,
 * tid + nt, ...); fin 1, after the thread's cp.async.wait_group, widens the elements of the same blocks (the
 * thread's own copies: no barrier between) into out[0, n) as floats. */
KVQ_DEV void kvq_stage_par(int fin, float *out, unsigned char *dst, const unsigned char *src, int n, int eb, int tid,
                           int nt)
{
    const int r = (int)((kvq_u64)src & 15), nb = n > 0 ? (r + n * eb + 15) >> 4 : 0;
#pragma unroll 1
    for (int k = tid; k < nb; k += nt) kvq_par_block(fin, out, dst, src - r, r, n, eb, k);
}

/* Two ranges of n elements each (a per-token page's scales and zeros) as kvq_stage_par does each, in one pass:
 * one loop's set-up instead of two, the threads taking the blocks of both. */
KVQ_DEV void kvq_stage_par2(int fin, float *out0, unsigned char *dst0, const unsigned char *src0, int eb0, float *out1,
                            unsigned char *dst1, const unsigned char *src1, int eb1, int n, int tid, int nt)
{
    const int r0 = (int)((kvq_u64)src0 & 15), nb0 = n > 0 ? (r0 + n * eb0 + 15) >> 4 : 0;
    const int r1 = (int)((kvq_u64)src1 & 15), nb1 = n > 0 ? (r1 + n * eb1 + 15) >> 4 : 0;
    if (!fin) {
        /* the copies: two runs (one loop with a test a block took 20 instructions a copy), each thread on the blocks
         * of the combined index k it widens at fin 1 (its own copies: no barrier between) */
        const int c0 = kvq_copies_of(nb0, tid, nt), k1 = tid + c0 * nt - nb0; /* the thread's first of the second */
        kvq_cp_async16_run(dst0 + 16 * tid, src0 - r0 + 16 * tid, c0, 16 * nt, 16 * nt, 1, 16 * nt);
        kvq_cp_async16_run(dst1 + 16 * k1, src1 - r1 + 16 * k1, kvq_copies_of(nb1, k1, nt), 16 * nt, 16 * nt, 1,
                           16 * nt);
        return;
    }
#pragma unroll 1
    for (int k = tid; k < nb0 + nb1; k += nt) {
        if (k < nb0)
            kvq_par_block(fin, out0, dst0, src0 - r0, r0, n, eb0, k);
        else
            kvq_par_block(fin, out1, dst1, src1 - r1, r1, n, eb1, k - nb0);
    }
}

/* Mask bits [bit0, bit0 + m) from src (bit0 < 8) the same way: out[t] = bit bit0 + t. */
KVQ_DEV void kvq_stage_mask(int fin, unsigned char *out, unsigned char *dst, const unsigned char *src, int bit0, int m,
                            int tid, int nt)
{
    const int r = (int)((kvq_u64)src & 15), nb = m > 0 ? (r + ((bit0 + m + 7) >> 3) + 15) >> 4 : 0;
    if (!fin) {
#pragma unroll 1
        for (int k = tid; k < nb; k += nt) kvq_cp_async16(dst + 16 * k, src - r + 16 * k);
        return;
    }
#pragma unroll 1
    for (int k = tid; k < nb; k += nt) {
        const int t0 = max(0, 8 * (16 * k - r) - bit0), t1 = min(m, 8 * (16 * k + 16 - r) - bit0);
        for (int t = t0; t < t1; t++) out[t] = (dst[r + ((bit0 + t) >> 3)] >> ((bit0 + t) & 7)) & 1;
    }
}

/* Rows of m tokens (R bytes each, R % 16 == 0 when sw) from src into rows t0 .. t0 + m - 1 of a tile's rows, each
 * 16-byte chunk to its place under the XOR swizzle when sw (kvq_row_swz, kvq_layout.cuh), else back to back
 * (kvq_stage_bytes). The swizzle repeats every 8 rows, so where a step of nt chunks (the threads staging the tensor)
 * is a multiple of 8 rows (C = R / 16 chunks a row, nt % 8 C == 0) a thread's destination advances by the same 16 nt
 * bytes as its source and its place in a row is computed once. A source not 16-byte aligned (none in practice:
 * pages, pools and their sections are 16-byte aligned) moves by 4-byte copies to the same places. */
KVQ_DEV void kvq_stage_rows(unsigned char *rows, int t0, int R, const unsigned char *src, int m, int tid, int nt, int sw)
{
    if (!sw || !kvq_row_swz_ok(R)) {
        kvq_stage_bytes(rows + t0 * R, src, m * R, tid, nt);
        return;
    }
    const int C = R >> 4, n16 = m * C;
    if ((kvq_u64)src & 15) {
#pragma unroll 1
        for (int i = tid; i < m * (R >> 2); i += nt) {
            const int t = i / (R >> 2), b = 4 * (i - t * (R >> 2));
            kvq_cp_async4(rows + kvq_row_byte(t0 + t, R, b, 1), src + 4 * i);
        }
    } else if (nt % (8 * C) == 0) {
        unsigned char *d = rows + kvq_row_byte(t0 + tid / C, R, 16 * (tid % C), 1);
        kvq_cp_async16_run(d, src + 16 * tid, kvq_copies_of(n16, tid, nt), 16 * nt, 16 * nt, 1, 16 * nt);
    } else {
#pragma unroll 1
        for (int i = tid; i < n16; i += nt)
            kvq_cp_async16(rows + kvq_row_byte(t0 + i / C, R, 16 * (i % C), 1), src + 16 * i);
    }
}

/* Whether kvq_stage_run_rows can stage rows of R bytes from src (a page's codes of a kv head, pages `stride` bytes
 * apart): swizzled rows whose 16-byte chunks a step of nt chunks advances by whole 8-row periods, 16-byte
 * aligned sources. */
KVQ_DEV int kvq_run_rows_ok(int R, const unsigned char *src, long long stride, int nt)
{
    return kvq_row_swz_ok(R) && nt % (8 * (R >> 4)) == 0 && (((kvq_u64)src | (kvq_u64)stride) & 15) == 0;
}

/* Rows of tokens [0, n) of a tile whose token t sits at slot s0 + t of a page run (page (s0 + t) / cap at `stride`
 * bytes a page, slot (s0 + t) % cap; one page when the tile stays in it), src = the kv head's row 0 of the first
 * page, into the tile's swizzled rows (kvq_stage_rows). One pass over the tile's chunks for all its pages, with
 * no set-up a page: a thread's destination advances by 16 nt bytes (whole 8-row periods of the swizzle),
 * its source by nt / C rows: a fixed number of whole pages and slots, and one page more when the slot passes the
 * capacity (kvq_divmod once a call, no test a page). Needs kvq_run_rows_ok. */
KVQ_DEV void kvq_stage_run_rows(unsigned char *rows, int R, const unsigned char *src, long long stride, int s0,
                                int cap, int n, int tid, int nt, int capk)
{
    const int C = R >> 4, c = tid % C;
    unsigned char *d = rows + kvq_row_byte(tid / C, R, 16 * c, 1);
    const unsigned char *s;
    long long jump;
    if (s0 + n <= cap) { /* the tile in one page: no division (see kvq_stage_page), a step of nt / C rows */
        s = src + 16 * c + (long long)(s0 + tid / C) * R;
        const long long js = (long long)(nt / C) * R;
        kvq_cp_async16_run(d, s, kvq_copies_of(n * C, tid, nt), 16 * nt, js, 1, js);
        return;
    } else {
        int ds, sl;
        const int dp = kvq_divmod(nt / C, cap, &ds); /* a step: dp pages and ds slots */
        const int pg = kvq_divmod(s0 + tid / C, cap, &sl);
        s = src + 16 * c + pg * stride + (long long)sl * R;
        jump = (long long)ds * R + dp * stride;
        if (ds != 0) { /* a step may pass a page's end: at most one more page (ds < cap) */
            if (capk && cap % ds == 0 && (cap / ds == 2 || cap / ds == 4) && sl < ds) {
                /* whole pages in 2 or 4 steps from the page's first step (KIVI's 32-token key pages at 16 or 8 rows a
                 * step, a warp staging them; capk: the capacity is a constant, so are the steps): copy i at page
                 * pg + i / m, slot sl + (i % m) ds */
                kvq_cp_async16_run(d, s, kvq_copies_of(n * C, tid, nt), 16 * nt, (long long)ds * R, cap / ds, stride);
                return;
            }
            const long long wrap = stride - (long long)cap * R;
#pragma unroll 1
            for (int k = tid; k < n * C; k += nt, d += 16 * nt) {
                kvq_cp_async16(d, s);
                sl += ds, s += jump;
                if (sl >= cap) sl -= cap, s += wrap;
            }
            return;
        }
    }
    /* no step passes a page's end (whole pages a step, as KIVI's 32-token key pages at 32 or 64 rows a step): the
     * source advances by a constant, four copies a trip */
    kvq_cp_async16_run(d, s, kvq_copies_of(n * C, tid, nt), 16 * nt, jump, 1, jump);
}

/* Per-channel scales and zeros of kv head h on np pages of a page run (page i at b + i stride), in one pass: item
 * k is a 16-byte block of page k / P (P = the scale's nbs blocks and the zero's nbz of a page), landed where
 * kvq_stage_par puts it (s at raw + al16(i D sbytes) + 64 i, z at rz + ...), and after the wait widened by the
 * same thread into s / z + i D. A head's section starts 16-byte aligned when D sbytes and D zbytes are multiples
 * of 16 (the caller's condition): every block is whole. One set-up and nt-wide passes for the whole run
 * instead of two calls a page (a 128-token KIVI tile over 4 pages: 128 blocks, one pass). */
KVQ_DEV void kvq_stage_chan_pars(const kvq_stage_buf *sb, const unsigned char *b, long long stride, kvq_page_off o,
                                 kvq_fmt f, int h, int np, int tid, int nt, int fin)
{
    const int nbs = KVQ_D * f.sbytes / 16, nbz = KVQ_D * f.zbytes / 16, P = nbs + nbz;
    unsigned char *rz = sb->raw + sb->raws;
    if (!fin && nt % P == 0) {
        /* a thread's block of a page is the same on every page it takes (P divides the block: head_dim 64, 128,
         * 256), and page i's lands at i (D eb + 64) (kvq_raw_page; D eb is a multiple of 16): both addresses
         * advance by constants (35 instructions a copy at KIVI-2 where the index was divided each time); block
         * k = i P + r is still thread k mod nt's, the one that widens it below */
        const int r = tid % P, zs = r >= nbs, c = zs ? r - nbs : r, eb = zs ? f.zbytes : f.sbytes;
        const int di = nt / P, dstep = di * (KVQ_D * eb + 64);
        unsigned char *dst = (zs ? rz : sb->raw) + (tid / P) * (KVQ_D * eb + 64) + 16 * c;
        const unsigned char *src =
            b + (tid / P) * stride + (zs ? o.zero : o.scale) + (long long)h * KVQ_D * eb + 16 * c;
        kvq_cp_async16_run(dst, src, kvq_copies_of(np, tid / P, di), dstep, di * stride, 1, di * stride);
        return;
    }
#pragma unroll 1
    for (int k = tid; k < np * P; k += nt) {
        const int i = k / P, r = k - i * P, zs = r >= nbs, c = zs ? r - nbs : r, eb = zs ? f.zbytes : f.sbytes;
        unsigned char *dst = (zs ? rz : sb->raw) + kvq_raw_page(i * KVQ_D * eb, i) + 16 * c;
        if (!fin) {
            kvq_cp_async16(dst, b + i * stride + (zs ? o.zero : o.scale) + (long long)h * KVQ_D * eb + 16 * c);
            continue;
        }
        const uint4 u = *(const uint4 *)dst;
        float *out = (zs ? sb->z : sb->s) + i * KVQ_D + c * (16 / eb);
        if (eb == 4) {
            ((float4 *)out)[0] = make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z),
                                             __uint_as_float(u.w));
        } else {
            const float2 x0 = kvq_h22f2(kvq_bits_h2(u.x)), x1 = kvq_h22f2(kvq_bits_h2(u.y));
            const float2 x2 = kvq_h22f2(kvq_bits_h2(u.z)), x3 = kvq_h22f2(kvq_bits_h2(u.w));
            ((float4 *)out)[0] = make_float4(x0.x, x0.y, x1.x, x1.y);
            ((float4 *)out)[1] = make_float4(x2.x, x2.y, x3.x, x3.y);
        }
    }
}

/* Stages tokens [slot, slot + n) of a page for kv head h: codes to rows, parameters to s/z/f, mask bits. A slot
 * past the page's capacity is in a later page of a page run (layout/tiles.h: pages of one flush back to back at
 * kvq_page_stride), and a tile may span several of them: page i of the tile's pages stages its codes after the
 * previous page's tokens and, per channel, its scales and zeros at s/z + i * D (one fold of the query each).
 * fin 0 issues every copy (codes and parameters, cp.async); fin 1 (after the wait for this tile's group) widens
 * the thread's own parameter blocks into floats and mask bytes. Page i's raw parameter bytes sit at
 * al16(its first element's offset) + 64 i (plan.c, store_raw: the 16-byte blocks' slack). */
KVQ_DEV void kvq_stage_page(const kvq_stage_buf *sb, const unsigned char *b, kvq_fmt f, int slot, int cap, int n,
                            int h, int tid, int nt, int fin, int part, int capk)
{
#if KVQ_TQ_ANY
    if (kvq_tq_is(f)) { /* TurboQuant pages (kvq_turboquant.cuh): fp32 rows by plain loads and stores, as below */
        if (!fin && (part & KVQ_PART_ROWS)) kvq_tq_stage_page(sb->rows, sb->s, sb->sq, b, f, slot, cap, n, h, tid, nt);
        return;
    }
#endif
#if KVQ_FMT_ANY
    if (kvq_fmt_is(f)) { /* element formats (kvq_format.cuh): integer codes and parameters, or fp16 rows, staged by
                          * plain loads and stores when the copies are issued (fin 0; the barrier after the wait
                          * publishes them); nothing to widen afterwards */
        if (fin || !(part & KVQ_PART_ROWS)) return;
        if (kvq_fmt_linear(f.kind))
            kvq_fmt_stage_linear(sb->rows, sb->s, sb->z, b, f, slot, cap, n, h, tid, nt);
        else
            kvq_fmt_stage_page(sb->rows, b, f, slot, cap, n, h, tid, nt);
        return;
    }
#endif
    kvq_page_off o = kvq_page_offsets(f, KVQ_HKV, KVQ_D, cap);
    const long long stride = kvq_page_stride(o.total);
    /* a tile inside one page (every value page tile; a key tile of one page) needs no division: the general
     * capacity (the prefill's value page, 32,640 slots at 32k) takes the divisions' slow path */
    int s0 = slot, np = 1, rn, pg0 = 0;
    if (slot + n > cap) {
        pg0 = kvq_divmod(slot, cap, &s0);
        if (n > 0) np = kvq_divmod(s0 + n + cap - 1, cap, &rn);
    }
    unsigned char *rz = sb->raw + sb->raws, *rf = sb->raw + 2 * sb->raws, *rm = rf + sb->rawf;
    b += pg0 * stride;
    /* per-channel parameters of fp16 or fp32 scales and zeros: all pages in one pass */
    const int chan1 = f.bits < 16 && f.gran == 0 && (f.sbytes == 2 || f.sbytes == 4) &&
                      (f.zbytes == 2 || f.zbytes == 4) && KVQ_D % 8 == 0;
    const int rows = part & KVQ_PART_ROWS, pars = part & KVQ_PART_PARS;
    if (pars && chan1 && !(fin && sb->praw)) kvq_stage_chan_pars(sb, b, stride, o, f, h, np, tid, nt, fin);
    /* the codes of all the tile's pages in one pass where the rows allow (every KIVI page) */
    const unsigned char *c0 = b + o.codes + (long long)h * cap * o.cbpt;
    const int run = !fin && rows && kvq_run_rows_ok(o.cbpt, c0, stride, nt);
    if (run) kvq_stage_run_rows(sb->rows, o.cbpt, c0, stride, s0, cap, n, tid, nt, capk);
    /* nothing left a page: rows staged (or not this part's), per-channel parameters of all pages staged, no factors
     * or mask bits; or the rows were this part's only work */
    if ((run || fin || !rows) && (f.bits >= 16 || (chan1 && !f.sep && !f.masked))) return;
    if (run && !pars) return;
#pragma unroll 1
    for (int i = 0; i < np; i++, b += stride) {
        const int sl = i ? 0 : s0, t0 = i ? i * cap - s0 : 0, m = min(n - t0, cap - sl);
        if (!fin && !run && rows)
            kvq_stage_rows(sb->rows, t0, o.cbpt, b + o.codes + ((long long)h * cap + sl) * o.cbpt, m, tid, nt, 1);
        if (f.bits >= 16 || !pars) continue;
        if (f.gran == 0) {
            const long long e = (long long)h * KVQ_D;
            if (!chan1) {
                kvq_stage_par(fin, sb->s + i * KVQ_D, sb->raw + kvq_raw_page(i * KVQ_D * f.sbytes, i),
                              b + o.scale + e * f.sbytes, KVQ_D, f.sbytes, tid, nt);
                kvq_stage_par(fin, sb->z + i * KVQ_D, rz + kvq_raw_page(i * KVQ_D * f.zbytes, i),
                              b + o.zero + e * f.zbytes, KVQ_D, f.zbytes, tid, nt);
            }
        } else if (!(fin && sb->praw)) {
            const long long first = f.hidden ? sl : ((long long)h * cap + sl) * o.n_groups;
            const int e0 = t0 * o.n_groups;
            kvq_stage_par2(fin, sb->s + e0, sb->raw + kvq_raw_page(e0 * f.sbytes, i), b + o.scale + first * f.sbytes,
                           f.sbytes, sb->z + e0, rz + kvq_raw_page(e0 * f.zbytes, i), b + o.zero + first * f.zbytes,
                           f.zbytes, m * o.n_groups, tid, nt);
        }
        if (f.sep) /* channel-separable pages never form runs (kvq_page_run_ok): one page */
            kvq_stage_par(fin, sb->f, rf, b + o.factor + (long long)h * KVQ_D * f.sbytes, KVQ_D, f.sbytes, tid, nt);
        if (f.masked)
            kvq_stage_mask(fin, sb->mask + t0, rm + kvq_raw_page(t0 >> 3, i),
                           b + o.mask + (long long)h * o.mask_stride + (sl >> 3), sl & 7, m, tid, nt);
    }
}

/* kvq_stage_page with the capacity a constant where it is the format's group: per-channel pages of one group (every
 * full KIVI key page), whose tiles then stage with the page layout, the page stride and the slot arithmetic
 * folded (the general copy computes them from the tile's capacity each tile) */
KVQ_DEV void kvq_stage_page_cap(const kvq_stage_buf *sb, const unsigned char *b, kvq_fmt f, int slot, int cap, int n,
                                int h, int tid, int nt, int fin, int part)
{
    if (f.bits < 16 && f.gran == 0 && f.group > 0 && cap == f.group)
        kvq_stage_page(sb, b, f, slot, f.group, n, h, tid, nt, fin, part, 1);
    else
        kvq_stage_page(sb, b, f, slot, cap, n, h, tid, nt, fin, part, 0);
}

KVQ_DEV void kvq_stage(const kvq_stage_buf *sb, kvq_u64 base, int kind, int slot, int cap, int n, int h,
                       kvq_fmt hi, kvq_fmt lo, int tid, int nt, int fin, int part)
{
    const unsigned char *b = (const unsigned char *)base;
    if (kind == KVQ_SRC_F16) {
        if (!fin && (part & KVQ_PART_ROWS))
            kvq_stage_rows(sb->rows, 0, 2 * KVQ_D, b + ((long long)h * cap + slot) * (2 * KVQ_D), n, tid, nt, 1);
    } else if (kind == KVQ_SRC_HI && hi.bits)
        kvq_stage_page_cap(sb, b, hi, slot, cap, n, h, tid, nt, fin, part);
    else if (kind == KVQ_SRC_LO && lo.bits)
        kvq_stage_page_cap(sb, b, lo, slot, cap, n, h, tid, nt, fin, part);
}

/* Decode geometry of a layer class (kvq_class.cuh passes constants, folded after inlining): tile tokens, phase-1
 * lanes per token and token lanes, staged parameter floats, and the byte offsets of the dynamic shared memory. */
typedef struct {
    int tile, split, p1, voff, kparn, vparn; /* voff: the value rows' offset (keys' rows before it) */
    int so_kpar, so_vpar, so_kmask, so_q, so_qk, so_qsum, so_p, so_red;
    int so_w, mk, mv; /* tensor-core paths (kvq_mma.cuh): the weight fragments; page classes (bit 0 hi, 1 lo) */
    int kpages;       /* most key pages a tile spans (page runs): qk, the bias and kpar hold that many folds */
    /* the load pipeline (plan.h): stages (2) of [0, stage_bytes), the raw parameter bytes of K and V in each */
    int stages, stage_bytes, so_kraw, so_vraw, kraws, vraws, rawf;
    /* the widened parameter floats and mask bytes (so_kpar, so_vpar, so_kmask) of stage st at st * par_step:
     * stage_bytes (a copy per stage, inside it), or 0 (one copy after the stages: only cp.async fills a stage, and
     * tile i's floats are written after the barrier that ends tile i - 1's math) */
    int par_step;
    int kpraw, vpraw; /* kvq_stage_buf.praw of the keys' and the values' buffers */
} kvq_dec_geo;

/* The staged buffers of K and V of pipeline stage st (plan.c: stage st at st * stage_bytes). */
KVQ_DEV void kvq_stage_bufs(unsigned char *smem, const kvq_dec_geo *g, int st, kvq_stage_buf *kb, kvq_stage_buf *vb)
{
    unsigned char *s0 = smem + st * g->stage_bytes, *p0 = smem + st * g->par_step;
    float *kpar = (float *)(p0 + g->so_kpar), *vpar = (float *)(p0 + g->so_vpar);
    kb->rows = s0, kb->s = kpar, kb->z = kpar + g->kparn, kb->f = kpar + 2 * g->kparn, kb->mask = p0 + g->so_kmask;
    vb->rows = s0 + g->voff, vb->s = vpar, vb->z = vpar + g->vparn, vb->f = vpar + 2 * g->vparn, vb->mask = 0;
    kb->raw = s0 + g->so_kraw, vb->raw = s0 + g->so_vraw;
    kb->raws = g->kraws, vb->raws = g->vraws, kb->rawf = vb->rawf = g->rawf;
    kb->sq = vb->sq = (const float *)(smem + g->so_qk); /* TurboQuant prod keys: their tiles never fold q */
    kb->praw = g->kpraw, vb->praw = g->vpraw;
}

/* Tokens of tile T this kv head reads (a pool's tile: kvq_tile.count) and its K and V kinds. */
KVQ_DEV int kvq_tile_n(const kvq_tile *T, int hk)
{
    int n = T->n;
    if (T->count) n = max(0, min(n, ((const int *)T->count)[hk] - T->k_slot));
    return n;
}

/* Whether pages of format f stage in a warp a stream (kvq_stage_tile): integer codes whose rows a step of 32
 * chunks advances by whole 8-row periods of the swizzle (kvq_run_rows_ok at 32 threads: rows of at most 64 bytes,
 * 4 bits at head_dim 128), or no pages of that class. */
KVQ_DEV int kvq_stage_quarters_ok(kvq_fmt f)
{
    const int R = kvq_fmt_cbpt(f.bits, KVQ_D);
    return f.bits == 0 || f.bits >= 16 || (!kvq_fmt_is(f) && !kvq_tq_is(f) && (R == 16 || R == 32 || R == 64));
}

/* Issues (fin 0) or finishes (fin 1) the staging of tile T into stage buffers kb, vb, a stream a warp where the
 * formats allow (kvq_stage_quarters_ok: the keys' rows, their parameters, the values' rows, theirs), else K on warps
 * [0, NW / 2) and V on the others: the set-up (page geometry, slots, the parameters' ranges, every stream's
 * addresses), which was most of the staging's instructions when every thread took part in every stream (6.3 a token
 * of KIVI-2 on the H200, 0.19 of them LDGSTS: docs/cuda.md "Load path"), runs once a stream. A tile of fp16 rows on
 * both sides (windows, sinks, pools, fp16 layers) keeps the whole block for each tensor: its copies dominate, and
 * only a step of 128 threads is whole 8-row periods of the fp16 rows' swizzle (kvq_stage_rows). A thread widens
 * (fin 1) the blocks it issued (fin 0): the same split both times. */
KVQ_DEV void kvq_stage_tile(const kvq_tile *T, int kk, int vk, int n, int hk, const kvq_stage_buf *kb,
                            const kvq_stage_buf *vb, kvq_fmt khi, kvq_fmt klo, kvq_fmt vhi, kvq_fmt vlo, int tid,
                            int fin)
{
    if (kk == KVQ_SRC_F16 && vk == KVQ_SRC_F16) { /* the kinds as constants: only the rows' copy is compiled here */
        kvq_stage(kb, T->k, KVQ_SRC_F16, T->k_slot, T->k_cap, n, hk, khi, klo, tid, KVQ_THREADS, fin, KVQ_PART_ALL);
        kvq_stage(vb, T->v, KVQ_SRC_F16, T->v_slot, T->v_cap, n, hk, vhi, vlo, tid, KVQ_THREADS, fin, KVQ_PART_ALL);
    } else if (KVQ_THREADS % 64 == 0) {
        /* quarters: a warp a stream (the keys' rows, the keys' parameters, the values' rows, theirs); else halves,
         * K then V (whole warps) */
        const int q = KVQ_THREADS == 128 && kvq_stage_quarters_ok(khi) && kvq_stage_quarters_ok(klo) &&
                      kvq_stage_quarters_ok(vhi) && kvq_stage_quarters_ok(vlo);
        const int nt = q ? 32 : KVQ_THREADS / 2, w = tid / nt, t = tid % nt;
        const int part = !q ? KVQ_PART_ALL : w & 1 ? KVQ_PART_PARS : KVQ_PART_ROWS, vals = q ? w >> 1 : w;
        if (!vals)
            kvq_stage(kb, T->k, kk, T->k_slot, T->k_cap, n, hk, khi, klo, t, nt, fin, part);
        else
            kvq_stage(vb, T->v, vk, T->v_slot, T->v_cap, n, hk, vhi, vlo, t, nt, fin, part);
    } else { /* a block that is not whole pairs of warps (96 threads: GQA 12 at head_dim 128) */
        kvq_stage(kb, T->k, kk, T->k_slot, T->k_cap, n, hk, khi, klo, tid, KVQ_THREADS, fin, KVQ_PART_ALL);
        kvq_stage(vb, T->v, vk, T->v_slot, T->v_cap, n, hk, vhi, vlo, tid, KVQ_THREADS, fin, KVQ_PART_ALL);
    }
}

/* Per-channel parameter c of page pg of a tile (zs: the zero, else the scale) where cp.async landed it: page pg's
 * section at kvq_raw_page(pg D eb, pg) of the scales' (zeros') raw part, whole 16-byte blocks from the section's start
 * (kvq_stage_chan_pars). Every thread may read it after the barrier that follows the tile's wait. */
KVQ_DEV float kvq_kpar_raw(const kvq_stage_buf *kb, kvq_fmt f, int zs, int pg, int c)
{
    const int eb = zs ? f.zbytes : f.sbytes;
    return kvq_ld_par(kb->raw + (zs ? kb->raws : 0) + kvq_raw_page(pg * KVQ_D * eb, pg), c, eb);
}
/* Per-token parameter e (token t, group gi: t n_groups + gi) of a tile's value page (a tile reads one: value pages
 * do not form runs, layout/tiles.h) where cp.async landed it: the range began at byte (first eb) & 15 of its first
 * block (kvq_stage_par2), first = the tile's first element in the page's section. */
KVQ_DEV float kvq_vpar_raw(const kvq_stage_buf *vb, kvq_fmt f, int zs, long long first, int e)
{
    const int eb = zs ? f.zbytes : f.sbytes;
    return kvq_ld_par(vb->raw + (zs ? vb->raws : 0) + (int)((first * eb) & 15), e, eb);
}

/* Per-token value parameter e of a tile wherever it was staged: raw (kvq_vpar_raw) or converted (s, z) */
KVQ_DEV float kvq_vpar(const kvq_stage_buf *vb, kvq_fmt f, int zs, long long first, int e)
{
    return vb->praw ? kvq_vpar_raw(vb, f, zs, first, e) : zs ? vb->z[e] : vb->s[e];
}

/* n fp16 values (2, 4 or 8) from p, 2 n-byte aligned, in one load (8: kvq_unpack8_half) */
KVQ_DEV void kvq_ld_halves(const unsigned char *p, int n, float *out)
{
    if (n == 8) {
        kvq_unpack8_half(p, out);
        return;
    }
    const uint2 u = n == 4 ? *(const uint2 *)p : make_uint2(*(const unsigned *)p, 0u);
    const float2 a = kvq_h22f2(kvq_bits_h2(u.x)), b = kvq_h22f2(kvq_bits_h2(u.y));
    out[0] = a.x, out[1] = a.y;
    if (n == 4) out[2] = b.x, out[3] = b.y;
}

/* Value groups a token: 1 for hidden (one group of all channels), else D / group */
KVQ_DEV int kvq_vgroups(kvq_fmt f) { return f.hidden ? 1 : KVQ_D / (f.group > 0 ? f.group : KVQ_D); }

/* Per-token key groups that cover whole runs of 8 channels use s_t (q . codes) + z_t sum(q) per group run. */
KVQ_DEV int kvq_k_runs(kvq_fmt f) { return f.bits < 16 && f.gran != 0 && (f.hidden || f.group % KVQ_VEC == 0); }
/* Codes that are pre-shifted (kvq_unpack8_ps): the operand they multiply raw, the folded query, carries 2^-k. */
KVQ_DEV int kvq_k_preshift(kvq_fmt f) { return kvq_preshift_ok(f.bits) && (f.gran == 0 || kvq_k_runs(f)); }
/* The query dotted with the codes is folded (q'_c = q_c s_c per channel, or q_c f_c channel-separable, times
 * 2^-k(c) for pre-shifted codes). */
KVQ_DEV int kvq_k_folds(kvq_fmt f) { return f.bits < 16 && (f.gran == 0 || f.sep || kvq_k_preshift(f)); }

/* Loads the GQA query values of channel c (G consecutive floats, 16-byte aligned when G % 4 == 0). */
KVQ_DEV void kvq_ld_qrow(const float *q, int c, float *out)
{
    if (KVQ_GQA % 4 == 0) {
#pragma unroll
        for (int h = 0; h < KVQ_GQA; h += 4) {
            float4 x = *(const float4 *)(q + c * KVQ_GQA + h);
            out[h] = x.x, out[h + 1] = x.y, out[h + 2] = x.z, out[h + 3] = x.w;
        }
    } else {
#pragma unroll
        for (int h = 0; h < KVQ_GQA; h++) out[h] = q[c * KVQ_GQA + h];
    }
}

/* Per-tile fold of the query (layout [D][GQA], pre-scaled) into the key format: qk = q * (scale or factor) per
 * channel; qsum = sum of the folded query over each 8 channels (per-token groups); red[GQA][8] = eight partial
 * sums of q . z in channel order (per-channel zeros; a head's eight side by side, two 16-byte loads for the sum;
 * pages kvq_bred_page apart).
 * Per-channel keys of a tile that spans np pages of a page run fold once per page: qk + i D GQA and red +
 * kvq_bred_at(GQA, i, 0) from the page's scales and zeros at kb->s + i D. Every thread takes items. */
KVQ_DEV void kvq_fold_k(kvq_fmt f, int mma, float qscale, const kvq_stage_buf *kb, const float *qs, float *qk,
                        float *qsum, float *red, int np, int tid)
{
    const int G = KVQ_GQA, D = KVQ_D;
    if (f.bits >= 16) return;
    if (f.gran != 0) np = 1;
    if (mma) /* q.K on tensor cores: qk's place holds B's fragments, KVQ_MMA_QPAGE words a page */
        kvq_fold_k_mma(f.bits, kb->s, kb->praw ? kb->raw : (const unsigned char *)0, f.sbytes, qs, qscale,
                       (unsigned *)qk, np, tid);
    else if (kvq_k_folds(f))
        for (int i = tid; i < np * D * G; i += KVQ_THREADS) {
            const int pg = i / (D * G), j = i - pg * (D * G), c = j / G;
            const float sc = f.gran != 0 ? 0.0f : kb->praw ? kvq_kpar_raw(kb, f, 0, pg, c) : kb->s[pg * D + c];
            const float x = f.gran == 0 ? qs[j] * sc : f.sep ? qs[j] * kb->f[c] : qs[j];
            qk[i] = kvq_k_preshift(f) ? x * kvq_preshift_inv(f.bits, c) : x; /* exact: a power of two */
        }
    if (f.gran == 0) {
        /* one item a (page, eighth of the channels) for all heads: the query row of a channel in one load */
        /* items in groups of 64: eight neighbouring lanes take one part of eight pages and read the same query
         * row (a broadcast), where lanes of one page's eight parts read rows D / 8 channels apart, all in one bank
         * group (8-way: 32 wavefronts a 16-byte load on the H200); the pages' zeros, 2 or 4 bytes a lane, cost
         * about the same either way. Slots past the last page are skipped */
        for (int i = tid; i < ((np + 7) >> 3) * 64; i += KVQ_THREADS) {
            const int part = (i >> 3) & 7, pg = (i & 7) | (i >> 6) << 3;
            if (pg >= np) continue;
            const float *z = kb->z + pg * D;
            float acc[KVQ_GQA];
#pragma unroll
            for (int h = 0; h < KVQ_GQA; h++) acc[h] = 0.0f;
            for (int c = part * (D / 8); c < (part + 1) * (D / 8); c++) {
                float q[KVQ_GQA];
                kvq_ld_qrow(qs, c, q);
                const float zc = kb->praw ? kvq_kpar_raw(kb, f, 1, pg, c) : z[c];
#pragma unroll
                for (int h = 0; h < KVQ_GQA; h++) acc[h] = fmaf(q[h], zc, acc[h]);
            }
#pragma unroll
            for (int h = 0; h < KVQ_GQA; h++) red[kvq_bred_at(G, pg, h) + part] = acc[h];
        }
    } else if (kvq_k_runs(f)) {
        for (int i = tid; i < (D / 8) * G; i += KVQ_THREADS) {
            const int h = i % G, c8 = i / G;
            float acc = 0.0f;
#pragma unroll
            for (int v = 0; v < 8; v++) {
                float x = qs[(c8 * 8 + v) * G + h];
                acc += f.sep ? x * kb->f[c8 * 8 + v] : x; /* the product qk holds, rounded the same */
            }
            qsum[i] = acc;
        }
    }
}

/* Phase 1: the scores of tokens [0, n) for every query head of the kv head, each code unpacked once. split
 * lanes per token, 8 apart (kvq_p1_lane), each a run of head_dim / split channels, reduced by shuffles; the
 * part-0 lane writes the token's scores (-inf for masked slots) to ps[t][GQA] and every lane keeps the maxima. */
KVQ_DEV void kvq_scores(kvq_fmt f, const kvq_stage_buf *kb, const float *qs, const float *qk, const float *qsum,
                        int n, int s0, int kcap, int tid, int split, int p1, float *ps, float mloc[KVQ_GQA], int sw)
{
    const int G = KVQ_GQA, D = KVQ_D;
    int part, lane1;
    kvq_p1_lane(tid, split, &part, &lane1);
    const int cp = D / split, cbeg = part * cp;
    const int cbpt = kvq_fmt_cbpt(f.bits, D);
    const float *qv = kvq_k_folds(f) ? qk : qs;
    const float *bias = qsum + (D / 8) * G;
    const int runs = kvq_k_runs(f), grp = f.hidden ? D : f.group;
    /* a lane's runs within one 128-byte line of its row (fp16 at split 2, every code row): the swizzle's XOR,
     * which depends on the row and the line only (kvq_row_swz), is the token's, computed once a token */
    const int oneline = cp * f.bits <= 1024 && (cbeg * f.bits) % 1024 == 0;
    /* the same trip count on every lane: the shuffles need the whole warp */
#pragma unroll 1
    for (int base = 0; base < n; base += p1) {
        const int t = base + lane1, live = t < n, tt = live ? t : 0;
        const unsigned char *row = kb->rows + tt * cbpt;
        /* the token's page of a page run (kcap > 0: per-channel keys over several pages): its fold and bias */
        const int pg = kcap > 0 ? (s0 + tt) / kcap : 0;
        const float *qvp = qv + pg * (D * G);
        const int xt = sw ? kvq_row_swz(tt, cbpt, cbeg * f.bits / 128) : 0;
        float sc[KVQ_GQA], acc[KVQ_GQA], zacc[KVQ_GQA];
#pragma unroll
        for (int h = 0; h < KVQ_GQA; h++) sc[h] = 0.0f, acc[h] = 0.0f, zacc[h] = 0.0f;
        /* runs of 8 channels, not unrolled: unrolled, the compiler hoists every run's query loads and spills */
#pragma unroll 2
        for (int j = 0; j < cp / KVQ_VEC; j++) {
            const int c0 = cbeg + j * KVQ_VEC, ch = c0 * f.bits / 128; /* the 16-byte chunk of the run's codes */
            const int x = !sw ? 0 : oneline ? xt : kvq_row_swz(tt, cbpt, ch); /* the row's swizzle (kvq_layout.cuh) */
            const unsigned char *rj = row + 16 * ((ch ^ x) - ch);  /* where it put the chunk */
            float cv[KVQ_VEC];
            if (f.bits == 32) /* element formats' fp32 rows (kvq_format.cuh; never swizzled: rj is row) */
                kvq_unpack8_f32(rj + 4 * c0, cv);
            else if (f.bits >= 16)
                kvq_unpack8_half(rj + 2 * c0, cv);
            else if (kvq_k_preshift(f))
                kvq_unpack8_ps(rj, c0, f.bits, cv);
            else
                kvq_unpack8(rj, c0, f.bits, D, cv);
            if (f.bits < 16 && f.gran != 0 && !runs) {
                /* groups narrower than 8 channels: dequantise each code */
                const int ng = D / f.group;
#pragma unroll
                for (int v = 0; v < KVQ_VEC; v++) {
                    const int g = (c0 + v) / f.group;
                    cv[v] = fmaf(kb->s[tt * ng + g], cv[v], kb->z[tt * ng + g]);
                }
            }
            if (KVQ_GQA % 4 == 0) {
#pragma unroll
                for (int v = 0; v < KVQ_VEC; v++) {
                    float q[KVQ_GQA];
                    kvq_ld_qrow(qvp, c0 + v, q);
#pragma unroll
                    for (int h = 0; h < KVQ_GQA; h++) acc[h] = fmaf(q[h], cv[v], acc[h]);
                }
            } else {
                /* GQA 1 and 2: the run's 8 G query values in 16-byte loads (32 G bytes, 16-byte aligned), so that a
                 * phase is a quarter-warp of one part (kvq_p1_lane), not the whole warp of 4-byte loads over both
                 * parts' rows D / 2 channels apart (2-way) */
                float qr[KVQ_VEC * KVQ_GQA];
#pragma unroll
                for (int k = 0; k < KVQ_VEC * KVQ_GQA; k += 4) {
                    const float4 x = *(const float4 *)(qvp + c0 * KVQ_GQA + k);
                    qr[k] = x.x, qr[k + 1] = x.y, qr[k + 2] = x.z, qr[k + 3] = x.w;
                }
#pragma unroll
                for (int v = 0; v < KVQ_VEC; v++)
#pragma unroll
                    for (int h = 0; h < KVQ_GQA; h++) acc[h] = fmaf(qr[v * KVQ_GQA + h], cv[v], acc[h]);
            }
            if (runs) {
#pragma unroll
                for (int h = 0; h < KVQ_GQA; h++) zacc[h] += qsum[(c0 / 8) * G + h];
                if ((j + 1) * KVQ_VEC >= cp || (c0 + KVQ_VEC) % grp == 0) {
                    /* end of a group run: s_t (q . codes) + z_t sum(q) */
                    const int ng = f.hidden ? 1 : D / f.group, g = f.hidden ? 0 : c0 / f.group;
                    const float s = kb->s[tt * ng + g], z = kb->z[tt * ng + g];
#pragma unroll
                    for (int h = 0; h < KVQ_GQA; h++) {
                        sc[h] = fmaf(s, acc[h], fmaf(z, zacc[h], sc[h]));
                        acc[h] = 0.0f, zacc[h] = 0.0f;
                    }
                }
            }
        }
        const int dead = !live || (f.masked && kb->mask[t]);
#pragma unroll
        for (int h = 0; h < KVQ_GQA; h++) {
            float x = runs ? sc[h] : acc[h];
            for (int off = 4 * split; off >= 8; off >>= 1) x += __shfl_xor_sync(KVQ_FULL_MASK, x, off); /* the parts */
            if (f.bits < 16 && f.gran == 0) x += bias[pg * G + h];
#if KVQ_TQ_ANY
            if (f.tq == 2) x += kb->s[tt * G + h]; /* TurboQuant prod keys: the QJL term (kvq_turboquant.cuh) */
#endif
            if (dead) x = KVQ_NEG_INF;
            mloc[h] = fmaxf(mloc[h], x);
            if (part == 0 && live) ps[t * G + h] = x;
        }
    }
}

/* Sums each of n values (n a power of two, at most 32) over the warp's 32 lanes in n - 1 + 5 shuffles, where a
 * butterfly a value takes 5 n: while a lane holds several, each step with offset `off` halves them, the lane
 * keeping the half its bit `off` selects and sending the other to its partner, which keeps that one. The pairs
 * and their order are the butterflies' (own + partner's, offsets 16 down to 1), so each sum is bit-identical.
 * Returns the sum of value lane >> (5 - log2 n); v is overwritten. */
KVQ_DEV float kvq_warp_sum_spread(float *v, int n, int lane)
{
    int m = n;
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) {
        if (m > 1) {
            const int hi = (lane & off) != 0;
            m >>= 1;
#pragma unroll
            for (int i = 0; i < 16; i++)
                if (i < m) {
                    const float send = hi ? v[i] : v[i + m], keep = hi ? v[i + m] : v[i];
                    v[i] = keep + __shfl_xor_sync(KVQ_FULL_MASK, send, off);
                }
        } else
            v[0] += __shfl_xor_sync(KVQ_FULL_MASK, v[0], off);
    }
    return v[0];
}
/* The shift of kvq_warp_sum_spread's value index: 5 - log2 n (a constant after inlining) */
KVQ_DEV int kvq_spread_shift(int n)
{
    int sh = 5;
    for (int k = n; k > 1; k >>= 1) sh--;
    return sh;
}

/* The warp's maxima per head of phase 1's lanes (the split lanes of a token agree already) to wmax[warp][GQA]. */
KVQ_DEV void kvq_warp_max(float mloc[KVQ_GQA], int split, int tid, float *wmax)
{
#pragma unroll
    for (int h = 0; h < KVQ_GQA; h++) {
        for (int off = 16; off > 0; off >>= 1)
            if (off < 8 || off > 4 * split) /* not between a token's parts (kvq_p1_lane): they agree already */
                mloc[h] = fmaxf(mloc[h], __shfl_xor_sync(KVQ_FULL_MASK, mloc[h], off));
        if ((tid & 31) == 0) wmax[(tid >> 5) * KVQ_GQA + h] = mloc[h];
    }
}

/* Phase 3: o += p_t v_t over tokens [tz, n) step TZ for this lane's channels and heads; p from ps. Per-channel
 * value scales and zeros stay in registers for the tile; per-token scales fold into the weight (w = p s_t) and
 * their zeros accumulate as one scalar per head (sum p z_t) added back at the end of the tile. */
KVQ_DEV void kvq_values(kvq_fmt f, const kvq_stage_buf *vb, const float *ps, int n, int c0, int hl0, int tz,
                        float o[KVQ_HPT][KVQ_VEC], int sw)
{
    const int G = KVQ_GQA, D = KVQ_D;
    const int cbpt = kvq_fmt_cbpt(f.bits, D);
    const int quant = f.bits < 16, runs = quant && f.gran != 0 && (f.hidden || f.group % KVQ_VEC == 0);
    /* pre-shifted codes (kvq_unpack8_ps) where the operand they multiply is a per-channel register: the value
     * scales (per channel), the factors (separable), or else o itself, kept scaled by 2^k(v) for the tile's
     * token loop (two multiplications of o by powers of two, exact) */
    const int psh = quant && kvq_preshift_ok(f.bits) && (f.gran == 0 || runs);
    const int oscale = psh && runs && !f.sep;
    float vs[KVQ_VEC], vz[KVQ_VEC], vf[KVQ_VEC], oz[KVQ_HPT];
#pragma unroll
    for (int v = 0; v < KVQ_VEC; v++) {
        const float inv = psh ? kvq_preshift_inv(f.bits, v) : 1.0f; /* c0 is a multiple of 8 */
        vs[v] = 1.0f, vz[v] = 0.0f, vf[v] = 1.0f;
        if (quant && f.gran == 0) vs[v] = vb->s[c0 + v] * inv, vz[v] = vb->z[c0 + v];
        if (quant && f.sep) vf[v] = vb->f[c0 + v];
        if (quant && f.sep && runs && psh) vf[v] *= inv;
    }
    if (oscale)
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++)
#pragma unroll
            for (int v = 0; v < KVQ_VEC; v++) o[i][v] *= 1.0f / kvq_preshift_inv(f.bits, v);
#pragma unroll
    for (int i = 0; i < KVQ_HPT; i++) oz[i] = 0.0f;
    /* two tokens an iteration, the second with weight 0 past the end (0 c + o is o: codes are finite), so that
     * no remainder copy of the body follows the loop; pointers advance by the step (addressing is otherwise a
     * sixth of the loop) */
    const int ngv = runs ? kvq_vgroups(f) : 0, gv = runs && !f.hidden ? c0 / f.group : 0;
    const unsigned char *rp = vb->rows + tz * cbpt;
    /* the lane's channels lie in one 16-byte chunk of a row (8 codes or 8 halves at c0), moved by the row's
     * swizzle: fixed for the loop's rows when a step of 2 TZ rows is a multiple of its period, 8 */
    const int ch = c0 * f.bits / 128, x0 = sw ? kvq_row_swz(tz, cbpt, ch) : 0;
    const int x1 = sw ? kvq_row_swz(tz + KVQ_TZ, cbpt, ch) : 0;
    const int adj0 = 16 * ((ch ^ x0) - ch), adj1 = 16 * ((ch ^ x1) - ch);
    const float *pp = ps + tz * G + hl0, *sp = vb->s + tz * ngv + gv, *zp = vb->z + tz * ngv + gv;
#pragma unroll 1
    for (int t2 = tz; t2 < n; t2 += 2 * KVQ_TZ) {
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int live = u == 0 || t2 + KVQ_TZ < n, du = live ? u * KVQ_TZ : 0;
            const int t = t2 + du;
            const int x = (2 * KVQ_TZ) % 8 == 0 ? 0 : sw ? kvq_row_swz(t, cbpt, ch) : 0;
            const unsigned char *row = rp + du * cbpt + ((2 * KVQ_TZ) % 8 == 0 ? (du ? adj1 : adj0) : 16 * ((ch ^ x) - ch));
            float p[KVQ_HPT], cv[KVQ_VEC];
            if (KVQ_HPT == 4) {
                float4 x = *(const float4 *)(pp + du * G);
                p[0] = x.x, p[1] = x.y, p[2] = x.z, p[3] = x.w;
            } else {
#pragma unroll
                for (int i = 0; i < KVQ_HPT; i++) p[i] = pp[du * G + i];
            }
            if (!live)
#pragma unroll
                for (int i = 0; i < KVQ_HPT; i++) p[i] = 0.0f;
            if (f.bits == 32) /* element formats' fp32 rows (kvq_format.cuh) */
                kvq_unpack8_f32(row + 4 * c0, cv);
            else if (f.bits >= 16)
                kvq_unpack8_half(row + 2 * c0, cv);
            else if (psh)
                kvq_unpack8_ps(row, c0, f.bits, cv);
            else
                kvq_unpack8(row, c0, f.bits, D, cv);
            if (!quant || f.gran == 0) {
                if (quant)
#pragma unroll
                    for (int v = 0; v < KVQ_VEC; v++) cv[v] = fmaf(vs[v], cv[v], vz[v]);
#pragma unroll
                for (int i = 0; i < KVQ_HPT; i++)
#pragma unroll
                    for (int v = 0; v < KVQ_VEC; v++) o[i][v] = fmaf(p[i], cv[v], o[i][v]);
            } else if (runs) {
                const float s = sp[du * ngv], z = zp[du * ngv];
#pragma unroll
                for (int i = 0; i < KVQ_HPT; i++) {
                    const float w = p[i] * s;
                    oz[i] = fmaf(p[i], z, oz[i]);
#pragma unroll
                    for (int v = 0; v < KVQ_VEC; v++) o[i][v] = fmaf(f.sep ? w * vf[v] : w, cv[v], o[i][v]);
                }
            } else {
                const int ng = D / f.group;
#pragma unroll
                for (int v = 0; v < KVQ_VEC; v++) {
                    const int g = (c0 + v) / f.group;
                    cv[v] = fmaf(vb->s[t * ng + g], cv[v], vb->z[t * ng + g]) * vf[v];
                }
#pragma unroll
                for (int i = 0; i < KVQ_HPT; i++)
#pragma unroll
                    for (int v = 0; v < KVQ_VEC; v++) o[i][v] = fmaf(p[i], cv[v], o[i][v]);
            }
        }
        rp += 2 * KVQ_TZ * cbpt, pp += 2 * KVQ_TZ * G, sp += 2 * KVQ_TZ * ngv, zp += 2 * KVQ_TZ * ngv;
    }
    if (oscale)
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++)
#pragma unroll
            for (int v = 0; v < KVQ_VEC; v++) o[i][v] *= kvq_preshift_inv(f.bits, v);
    if (runs) /* per-token value zeros: sum_t p_t z_t, times the channel factors when separable */
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++)
#pragma unroll
            for (int v = 0; v < KVQ_VEC; v++)
                o[i][v] = fmaf(oz[i], psh && f.sep ? vf[v] / kvq_preshift_inv(f.bits, v) : vf[v], o[i][v]);
}

/* kvq_probs' tensor-core pass over the lane's token pairs t0, t0 + step, ...: vec (a constant after inlining: the
 * caller calls it once with 1 and once with 0) says the pair's scales and zeros load as one fp16 vector each
 * (kvq_ld_halves), so the loop holds only one way of loading them. */
KVQ_DEV void kvq_probs_pairs(kvq_fmt f, const kvq_stage_buf *vb, const float *ps, const float m[KVQ_GQA], int n, int t0,
                             int step, long long first, int vec, unsigned short *wb, float dl[KVQ_GQA],
                             float oz[KVQ_GQA][4])
{
    const int G = KVQ_GQA, ngv = kvq_vgroups(f), wks = KVQ_MMA_WKS(ngv);
#pragma unroll 1
    for (int t = t0; t < n; t += step) {
        const int live1 = t + 1 < n;
        float pr[2][KVQ_GQA], sc[2 * KVQ_GQA];
        /* both tokens' scores in 8- or 16-byte loads (t is even: 8 G-byte aligned), not 2 G loads of 4 bytes at a
         * 32-byte lane stride (8-way at GQA 4); token t + 1 past n reads a slot of the tile's scores (n <= the
         * tile, an even count) and is replaced below */
        if (G % 2 == 0)
#pragma unroll
            for (int i = 0; i < 2 * G; i += 4) {
                const float4 x = *(const float4 *)(ps + t * G + i);
                sc[i] = x.x, sc[i + 1] = x.y, sc[i + 2] = x.z, sc[i + 3] = x.w;
            }
        else
#pragma unroll
            for (int i = 0; i < 2 * G; i += 2) {
                const float2 x = *(const float2 *)(ps + t * G + i);
                sc[i] = x.x, sc[i + 1] = x.y;
            }
#pragma unroll
        for (int u = 0; u < 2; u++)
#pragma unroll
            for (int h = 0; h < KVQ_GQA; h++) {
                const float x = u == 0 || live1 ? sc[u * G + h] : KVQ_NEG_INF;
                pr[u][h] = x == KVQ_NEG_INF ? 0.0f : kvq_ex2(x - m[h]);
                dl[h] += pr[u][h]; /* p goes to p.V as weights only: nothing reads ps after this pass */
            }
        /* both tokens' scales and zeros: where they lie aligned as fp16 (KIVI's), one load each (16 bytes at 4
         * groups, lanes 16 bytes apart: no bank conflict) instead of 4 ngv loads of 2 bytes (4-way) */
        float sv[8] = {0.0f}, zv[8] = {0.0f}; /* [u ngv + gi] */
        if (vec) {
            const unsigned char *sr = vb->raw + (int)((first * 2) & 15) + 4 * (t >> 1) * ngv;
            kvq_ld_halves(sr, 2 * ngv, sv);
            kvq_ld_halves(sr + vb->raws, 2 * ngv, zv);
        }
#pragma unroll
        for (int gi = 0; gi < 4; gi++)
            if (gi < ngv) {
                /* token t + 1 past n: weight 0 (its staged parameters may be anything, even not finite) */
                const int e0 = t * ngv + gi, e1 = e0 + ngv;
                /* the non-vector loads stay here, next to their use: loading all 4 ngv first (one array either way)
                 * holds them live across the group loop, and KIVI-4's kernel then spills */
                const float s0 = vec ? sv[gi] : kvq_vpar(vb, f, 0, first, e0);
                const float z0 = vec ? zv[gi] : kvq_vpar(vb, f, 1, first, e0);
                const float s1 = !live1 ? 0.0f : vec ? sv[ngv + gi] : kvq_vpar(vb, f, 0, first, e1);
                const float z1 = !live1 ? 0.0f : vec ? zv[ngv + gi] : kvq_vpar(vb, f, 1, first, e1);
#pragma unroll
                for (int h = 0; h < KVQ_GQA; h++) {
                    kvq_mma_put_w2(wb, wks, gi, t, h, pr[0][h] * s0, pr[1][h] * s1);
                    oz[h][gi] = fmaf(pr[1][h], z1, fmaf(pr[0][h], z0, oz[h][gi]));
                }
            }
    }
}

/* Phase 2: p = 2^(s - m) of this lane's own tokens (written by itself in phase 1), d += p. When the tile's values
 * take the tensor-core path, the lane takes two adjacent tokens instead (any lane may: phase 1's maximum put a
 * barrier after every score) and writes their weights w = p s_t as p.V's B fragments (kvq_mma.cuh), both tokens'
 * halves of a register in one 32-bit store (0 for the tokens from n up to the next 32: p.V takes blocks in pairs),
 * and keeps sum p z_t per head and value group in oz (the per-token zeros, added at the end of the chunk). */
KVQ_DEV void kvq_probs(kvq_fmt f, int mma, const kvq_stage_buf *vb, float *ps, const float m[KVQ_GQA], int n,
                       int part0, int lane1, int p1, int tid, unsigned short *wb, float dl[KVQ_GQA],
                       float oz[KVQ_GQA][4], int vslot, int vcap, int hk)
{
    const int G = KVQ_GQA, ngv = kvq_vgroups(f), wks = KVQ_MMA_WKS(ngv);
    if (mma) {
        /* parameters read from raw (vb->praw): the tile's first element in its value page's section, as
         * kvq_stage_page computes it */
        long long first = 0;
        if (vb->praw) {
            int sl;
            kvq_divmod(vslot, vcap, &sl);
            first = f.hidden ? sl : ((long long)hk * vcap + sl) * ngv;
        }
        /* fp16 scales and zeros with a token pair's 2 ngv values 4 ngv-byte aligned in both sections */
        const int pvec = vb->praw && f.sbytes == 2 && f.zbytes == 2 && ((first * 2) & (4 * ngv - 1)) == 0 &&
                         (vb->raws & 15) == 0;
        const int t0 = part0 ? 2 * lane1 : n;
        if (pvec)
            kvq_probs_pairs(f, vb, ps, m, n, t0, 2 * p1, first, 1, wb, dl, oz);
        else
            kvq_probs_pairs(f, vb, ps, m, n, t0, 2 * p1, first, 0, wb, dl, oz);
        for (int t = ((n + 1) & ~1) + tid; t < ((n + 31) & ~31); t += KVQ_THREADS) /* p.V reads 32-token pairs */
            for (int gi = 0; gi < ngv; gi++)
                for (int h = 0; h < KVQ_GQA; h++) kvq_mma_put_w(wb, wks, gi, t, h, 0.0f);
        return;
    }
#pragma unroll 1
    for (int t = part0 ? lane1 : n; t < n; t += p1)
#pragma unroll
        for (int h = 0; h < KVQ_GQA; h++) {
            const float x = ps[t * G + h];
            const float pr = x == KVQ_NEG_INF ? 0.0f : kvq_ex2(x - m[h]);
            ps[t * G + h] = pr;
            dl[h] += pr;
        }
}

KVQ_DEV kvq_fmt kvq_fmt_f16(void)
{
    kvq_fmt f = {16, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 0.0f, 0, {0}, 0, 0, 0, {{0}}};
    return f;
}

/* Dispatch on a tile's (uniform) kind so that each call below is specialised on constant formats. The low
 * class is tested only when the class has one (lo.bits is a constant). M_ says whether the kind's pages take the
 * tensor-core path (bit 0 of mm for the high class, bit 1 for the low one; the plan's mma_k / mma_v), S_ whether its
 * rows are swizzled (sw, the same bits; fp16 rows always: kvq_stage_rows). */
#define KVQ_BY_KIND(kind, hi, lo, mm, sw, CALL)                                                                \
    do {                                                                                                       \
        if ((kind) == KVQ_SRC_HI) {                                                                            \
            const kvq_fmt F_ = (hi);                                                                           \
            const int M_ = (mm) & 1, S_ = (sw) & 1;                                                            \
            CALL;                                                                                              \
        } else if ((lo).bits && (kind) == KVQ_SRC_LO) {                                                        \
            const kvq_fmt F_ = (lo);                                                                           \
            const int M_ = ((mm) >> 1) & 1, S_ = ((sw) >> 1) & 1;                                              \
            CALL;                                                                                              \
        } else {                                                                                               \
            const kvq_fmt F_ = kvq_fmt_f16();                                                                  \
            const int M_ = 0, S_ = 1;                                                                          \
            CALL;                                                                                              \
        }                                                                                                      \
    } while (0)

/* The whole decode kernel of a layer class; hi/lo are the class's page formats and g its geometry (constants
 * after inlining), smem the dynamic shared memory laid out by the plan (compiler/plan.c, tile_mapping).
 *
 * Per tile: stage K and V (cp.async, issued a tile ahead); fold the query into the key format; phase 1, the
 * scores of every token for every query head, the tile's maximum per head and m' = max(m, tile max),
 * a = 2^(m - m'), p_t = 2^(s_t - m') written back to shared memory, d = d a + sum p; phase 3, o = o a once, then
 * o += p_t v_t. m is the same on every thread (each computes it from the same shared values), so the end of a
 * chunk only adds. */
KVQ_DEV void kvq_decode_body(const kvq_decode_params *p, unsigned char *smem, kvq_fmt khi, kvq_fmt klo, kvq_fmt vhi,
                             kvq_fmt vlo, const kvq_dec_geo g)
{
    /* element formats are staged as integer codes or fp32 rows, and computed on as such (kvq_format.cuh);
     * TurboQuant pages as fp32 rows (kvq_turboquant.cuh) */
    const kvq_fmt skhi = khi, sklo = klo, svhi = vhi, svlo = vlo;
    khi = kvq_dec_staged(khi), klo = kvq_dec_staged(klo), vhi = kvq_dec_staged(vhi), vlo = kvq_dec_staged(vlo);
    /* rows this kernel stages are swizzled (kvq_stage_rows); element formats' and TurboQuant's rows are not */
    const int ksw = !kvq_dec_rows_own(skhi) | !kvq_dec_rows_own(sklo) << 1;
    const int vsw = !kvq_dec_rows_own(svhi) | !kvq_dec_rows_own(svlo) << 1;
    const int G = KVQ_GQA, D = KVQ_D, NW = KVQ_THREADS / 32;
    const int tx = threadIdx.x, ty = threadIdx.y, tz = threadIdx.z;
    const int tid = tx + KVQ_TX * (ty + KVQ_TY * tz);
    const int hk = blockIdx.x, chunk = blockIdx.y, b = blockIdx.z;
    const kvq_seq_tiles st = ((const kvq_seq_tiles *)p->seqs)[b];
    const int tpc = st.tiles_per_chunk > 0 ? st.tiles_per_chunk : p->tiles_per_chunk;
    const int t0 = chunk * tpc;
    const int t1 = min(st.n_tiles, t0 + tpc);
    if (t0 >= t1 && t0 > 0) return; /* a chunk past this sequence's tiles: kvq_merge ignores it */
    const int c0 = tx * KVQ_VEC, act = c0 < D, hl0 = ty * KVQ_HPT;
    int part, lane1;
    kvq_p1_lane(tid, g.split, &part, &lane1);

    float *qs = (float *)(smem + g.so_q), *qk = (float *)(smem + g.so_qk), *qsum = (float *)(smem + g.so_qsum);
    float *ps = (float *)(smem + g.so_p), *red = (float *)(smem + g.so_red);
    float *wmax = red, *bred = red + NW * G, *sa = bred + g.kpages * kvq_bred_page(G), *sm = sa + G;
    kvq_stage_buf kb, vb;

    /* The chunk's first tile into stage 0 (the load pipeline below): issued first, so that its copies fly while
     * the query is loaded and scaled, and where few values are live (after the query's set-up, the split staging
     * paths made KIVI-4's kernel spill 56 bytes at 128 registers). TurboQuant prod keys stage their QJL terms from
     * the query's sketch (kvq_tq_stage_page reads kb.sq): after it. */
#define KVQ_STAGE_T0()                                                                                               \
    do {                                                                                                             \
        const kvq_tile T0 = ((const kvq_tile *)st.tiles)[t0];                                                        \
        kvq_stage_bufs(smem, &g, 0, &kb, &vb);                                                                       \
        kvq_stage_tile(&T0, KVQ_TILE_KK(T0), KVQ_TILE_VK(T0), kvq_tile_n(&T0, hk), hk, &kb, &vb, skhi, sklo, svhi,  \
                       svlo, tid, 0);                                                                                \
    } while (0)
#define KVQ_TILE_KK(T) ((T).kinds & 255)
#define KVQ_TILE_VK(T) (((T).kinds >> 8) & 255)
#if KVQ_TQ_ANY
    const int t0_early = !(kvq_tq_is(skhi) && skhi.tq == 2);
#else
    const int t0_early = 1;
#endif
    if (t0_early && t0 < t1) KVQ_STAGE_T0();

    /* the group's queries, [D][GQA], in the log2 domain: four channels of one head a 16-byte load where the rows
     * allow (once a chunk, but at 4k tokens a chunk is 2 tiles: element by element it was ~6 instructions a token) */
    float qmax = 0.0f;
    const float *qg = (const float *)p->q + ((long long)b * KVQ_HQ + hk * G) * D;
    if (D % 4 == 0 && ((kvq_u64)qg & 15) == 0) {
        for (int i = tid; i < D * G / 4; i += KVQ_THREADS) {
            int h, c, rot;
            kvq_q_copy_item(i, G, &h, &c, &rot); /* heads first, stores rotated: no bank conflict */
            const float4 x = *(const float4 *)(qg + h * D + c);
            float y[4] = {x.x * p->scale, x.y * p->scale, x.z * p->scale, x.w * p->scale};
#pragma unroll
            for (int v = 0; v < 4; v++) qmax = fmaxf(qmax, fabsf(y[v]));
            /* y rotated by rot in registers (selects: an index by rot would put y in local memory) */
            float r[4];
#pragma unroll
            for (int k = 0; k < 4; k++) r[k] = rot & 1 ? y[(k + 1) & 3] : y[k];
#pragma unroll
            for (int k = 0; k < 4; k++) y[k] = rot & 2 ? r[(k + 2) & 3] : r[k];
#pragma unroll
            for (int k = 0; k < 4; k++) qs[(c + ((k + rot) & 3)) * G + h] = y[k];
        }
    } else {
        for (int i = tid; i < D * G; i += KVQ_THREADS) {
            const int c = i / G, h = i % G;
            qs[i] = qg[h * D + c] * p->scale;
            qmax = fmaxf(qmax, fabsf(qs[i]));
        }
    }
    /* q.K on tensor cores: the chunk's max |q| sets the power of two that keeps the folded query inside fp16
     * (kvq_mma_qscale) */
    float qscale = 1.0f, qinv = 1.0f;
    if (g.mk) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) qmax = fmaxf(qmax, __shfl_xor_sync(KVQ_FULL_MASK, qmax, off));
        if ((tid & 31) == 0) wmax[tid >> 5] = qmax;
        __syncthreads();
        for (int w = 0; w < NW; w++) qmax = fmaxf(qmax, wmax[w]);
        /* powers of two; qinv also undoes the codes' 2^-24 (kvq_mma_codes): at most 2^101 2^24, finite */
        qscale = kvq_mma_qscale(qmax), qinv = KVQ_MMA_ASCALE / qscale;
    }
#if KVQ_TQ_ANY
    if (kvq_tq_is(skhi) && skhi.tq == 2) { /* TurboQuant prod keys: S q once per block, where qk would fold */
        __syncthreads();
        kvq_tq_sketch_q(p->tq_s, skhi, qs, (float *)(smem + g.so_qk), tid, KVQ_THREADS);
        __syncthreads();
    }
#endif
    unsigned short *wb = (unsigned short *)(smem + g.so_w);
    float macc[KVQ_MMA_MPW][4], oz[KVQ_GQA][4];
#pragma unroll
    for (int i = 0; i < KVQ_MMA_MPW; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) macc[i][e] = 0.0f;
#pragma unroll
    for (int h = 0; h < KVQ_GQA; h++)
#pragma unroll
        for (int gi = 0; gi < 4; gi++) oz[h][gi] = 0.0f;
    float m[KVQ_GQA], dl[KVQ_GQA], o[KVQ_HPT][KVQ_VEC];
#pragma unroll
    for (int h = 0; h < KVQ_GQA; h++) m[h] = KVQ_NEG_INF, dl[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < KVQ_HPT; i++)
#pragma unroll
        for (int v = 0; v < KVQ_VEC; v++) o[i][v] = 0.0f;

    /* The load pipeline (docs/cuda.md "Load path"): two stages; tile i waits for its group (cp.async.wait_group
     * 0, issued a tile ago), widens its parameters, and after the barrier that publishes them issues tile i + 1's
     * copies (codes, parameters, masks, cp.async) as one group, in flight during tile i's math. Prologue: tile t0
     * into stage 0. */
    if (!t0_early && t0 < t1) KVQ_STAGE_T0();
    kvq_cp_async_commit();
    int pvm = 0; /* the previous tile's values took the tensor cores: its phase 3 read its rows and p.V's fragments */
#pragma unroll 1
    for (int ti = t0; ti < t1; ti++) {
        const kvq_tile T = ((const kvq_tile *)st.tiles)[ti];
        const int kk = KVQ_TILE_KK(T), vk = KVQ_TILE_VK(T);
        const int n = kvq_tile_n(&T, hk), cur = (ti - t0) & 1;
        kvq_cp_async_wait_group(0); /* tile ti's copies, the only group in flight (issued a tile ago) */
        /* the widening below overwrites the parameters and the scores (which share their part) that tile ti - 1's
         * phases 2 and 3 read on the fp32 path; p.V on tensor cores reads neither, so after such a tile the barrier
         * that ends the widening is the tile's first */
        if (!pvm) __syncthreads();
        kvq_stage_bufs(smem, &g, cur, &kb, &vb);
        /* own blocks: parameters to floats */
        kvq_stage_tile(&T, kk, vk, n, hk, &kb, &vb, skhi, sklo, svhi, svlo, tid, 1);
        /* publishes the floats; every thread is past tile ti - 1, so its stage takes tile ti + 1's copies, in
         * flight during all of tile ti's math */
        __syncthreads();
        if (ti + 1 < t1) {
            const kvq_tile T1 = ((const kvq_tile *)st.tiles)[ti + 1];
            kvq_stage_buf kb1, vb1; /* kb, vb stay tile ti's */
            kvq_stage_bufs(smem, &g, cur ^ 1, &kb1, &vb1);
            kvq_stage_tile(&T1, KVQ_TILE_KK(T1), KVQ_TILE_VK(T1), kvq_tile_n(&T1, hk), hk, &kb1, &vb1, skhi, sklo,
                           svhi, svlo, tid, 0);
        }
        kvq_cp_async_commit(); /* possibly empty */
        pvm = (vk == KVQ_SRC_HI && (g.mv & 1)) || (vlo.bits && vk == KVQ_SRC_LO && (g.mv & 2));
        const int kchan = (kk == KVQ_SRC_HI && khi.bits < 16 && khi.gran == 0) ||
                          (kk == KVQ_SRC_LO && klo.bits && klo.bits < 16 && klo.gran == 0);
        /* per-channel keys over several pages of a page run (layout/tiles.h): a fold and a bias per page */
        int ks0 = 0, knp = 1, krn;
        const int kcap = kchan && g.kpages > 1 ? T.k_cap : 0;
        if (kchan) kvq_divmod(T.k_slot, T.k_cap, &ks0);
        if (kcap && n > 0) knp = kvq_divmod(ks0 + n + kcap - 1, kcap, &krn);
        /* q.K on tensor cores (the kind's M_ in KVQ_BY_KIND): kvq_scores_mma adds the bias partials itself */
        const int kmma = (kk == KVQ_SRC_HI && (g.mk & 1)) || (klo.bits && kk == KVQ_SRC_LO && (g.mk & 2));
        KVQ_BY_KIND(kk, khi, klo, g.mk, ksw, kvq_fold_k(F_, M_, qscale, &kb, qs, qk, qsum, bred, knp, tid));
        __syncthreads();
        if (kchan && !kmma) { /* q . z per (page, head), the eight partial sums in order */
            for (int i = tid; i < knp * G; i += KVQ_THREADS) {
                const int pg = i / G, h = i % G;
                float acc = 0.0f;
                for (int k = 0; k < 8; k++) acc += bred[kvq_bred_at(G, pg, h) + k];
                qsum[(D / 8) * G + i] = acc;
            }
            __syncthreads();
        }

        /* phase 1: scores, then the tile's maximum per head over the block (each warp's in wmax) */
        float mloc[KVQ_GQA];
#pragma unroll
        for (int h = 0; h < KVQ_GQA; h++) mloc[h] = KVQ_NEG_INF;
        KVQ_BY_KIND(kk, khi, klo, g.mk, ksw,
                    if (M_) kvq_scores_mma(F_.bits, kb.rows, kb.mask, F_.masked, (const unsigned *)qk, bred, qinv,
                                           n, ks0, kcap, tid, ps, wmax, S_);
                    else {
                        kvq_scores(F_, &kb, qs, qk, qsum, n, ks0, kcap, tid, g.split, g.p1, ps, mloc, S_);
                        kvq_warp_max(mloc, g.split, tid, wmax);
                    });
        __syncthreads();
        /* the warps' maxima, in warp order per head: a warp's GQA values in 16-byte loads (red is 16-byte
         * aligned, plan.c) */
        float wm[KVQ_GQA];
#pragma unroll
        for (int h = 0; h < KVQ_GQA; h++) wm[h] = m[h];
        for (int w = 0; w < NW; w++) {
            if (KVQ_GQA % 4 == 0)
#pragma unroll
                for (int h = 0; h < KVQ_GQA; h += 4) {
                    const float4 x = *(const float4 *)(wmax + w * G + h);
                    wm[h] = fmaxf(wm[h], x.x), wm[h + 1] = fmaxf(wm[h + 1], x.y);
                    wm[h + 2] = fmaxf(wm[h + 2], x.z), wm[h + 3] = fmaxf(wm[h + 3], x.w);
                }
            else
#pragma unroll
                for (int h = 0; h < KVQ_GQA; h++) wm[h] = fmaxf(wm[h], wmax[w * G + h]);
        }
        float a[KVQ_GQA];
#pragma unroll
        for (int h = 0; h < KVQ_GQA; h++) {
            const float mx = wm[h];
            a[h] = mx == KVQ_NEG_INF ? 1.0f : kvq_ex2(m[h] - mx);
            m[h] = mx;
            dl[h] *= a[h];
        }
        if (tid < G) {
#pragma unroll
            for (int h = 0; h < KVQ_GQA; h++)
                if (h == tid) sa[h] = a[h], sm[h] = m[h];
        }
        if (g.mv)
#pragma unroll
            for (int h = 0; h < KVQ_GQA; h++)
#pragma unroll
                for (int gi = 0; gi < 4; gi++) oz[h][gi] *= a[h];
        /* p = 2^(s - m) of this lane's own tokens (written by itself in phase 1) */
        KVQ_BY_KIND(vk, vhi, vlo, g.mv, vsw,
                    kvq_probs(F_, M_, &vb, ps, m, n, part == 0, lane1, g.p1, tid, wb, dl, oz, T.v_slot, T.v_cap,
                              hk));
        __syncthreads();

        /* phase 3: values, o rescaled once per tile */
        if (act) {
#pragma unroll
            for (int i = 0; i < KVQ_HPT; i++) {
                const float ai = sa[hl0 + i];
#pragma unroll
                for (int v = 0; v < KVQ_VEC; v++) o[i][v] *= ai;
            }
        }
        if (g.mv) {
            /* the lane's head in the tensor-core accumulators (lanes t >= GQA hold zero columns) */
            const float ai = sa[min(tid & 3, KVQ_GQA - 1)];
#pragma unroll
            for (int i = 0; i < KVQ_MMA_MPW; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) macc[i][e] *= ai;
        }
        KVQ_BY_KIND(vk, vhi, vlo, g.mv, vsw,
                    if (M_) kvq_values_mma(F_.bits, F_.group, F_.hidden, vb.rows, (const unsigned *)wb, n, tid,
                                           macc, S_);
                    else if (act) kvq_values(F_, &vb, ps, n, c0, hl0, tz, o, S_));
    }

#undef KVQ_TILE_KK
#undef KVQ_TILE_VK
#undef KVQ_STAGE_T0
    /* End of the chunk: o summed over the TZ token lanes and d over the phase-1 lanes, in a fixed order,
     * through the stages' buffers (scratch [TZ][GQA][D] then [warps][GQA] from 0; every copy has landed). d: a
     * warp's lanes by shuffles (lanes that are not a token's part 0 hold 0), then the warps' sums in order; it
     * was [P1][GQA] summed serially by every output thread, 128 loads and adds a head. */
    float *so = (float *)smem, *dred = so + KVQ_TZ * G * D;
    const int lane = tid & 31, gpow = (G & (G - 1)) == 0;
    float dsum = 0.0f; /* gpow: the warp's d of head lane >> dsh (kvq_warp_sum_spread) */
    const int dsh = kvq_spread_shift(G);
    if (gpow)
        dsum = kvq_warp_sum_spread(dl, G, lane);
    else
#pragma unroll
        for (int h = 0; h < KVQ_GQA; h++)
            for (int off = 16; off > 0; off >>= 1) dl[h] += __shfl_xor_sync(KVQ_FULL_MASK, dl[h], off);
    __syncthreads();
    if (gpow) {
        if ((lane & ((1 << dsh) - 1)) == 0) dred[(tid >> 5) * G + (lane >> dsh)] = dsum;
    } else if (lane == 0)
#pragma unroll
        for (int h = 0; h < KVQ_GQA; h++) dred[(tid >> 5) * G + h] = dl[h];
    if (act)
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++) {
            float4 *d4 = (float4 *)(so + (tz * G + hl0 + i) * D + c0); /* c0 = 8 tx: 32-byte aligned */
            d4[0] = make_float4(o[i][0], o[i][1], o[i][2], o[i][3]);
            d4[1] = make_float4(o[i][4], o[i][5], o[i][6], o[i][7]);
        }
    if (tid < G && t1 <= t0) sm[tid] = KVQ_NEG_INF; /* an empty sequence: no tile ran */
    __syncthreads();
    if (g.mv) {
        /* the tensor-core accumulators and the zero sums join the o partials of token lane 0 */
        float *ozs = (float *)wb; /* [warps][GQA][4] */
        /* 4 GQA values, 4 GQA - 1 + 5 shuffles: the plan takes p.V to the tensor cores at GQA 1, 2 and 4 only
         * (plan.c mma_shape_ok), so 4 GQA is a power of two up to 16 wherever this runs */
        float v[4 * KVQ_GQA];
#pragma unroll
        for (int h = 0; h < KVQ_GQA; h++)
#pragma unroll
            for (int gi = 0; gi < 4; gi++) v[h * 4 + gi] = oz[h][gi];
        const float x = kvq_warp_sum_spread(v, 4 * G, lane);
        const int sh = kvq_spread_shift(4 * G);
        if ((lane & ((1 << sh) - 1)) == 0) ozs[(tid >> 5) * G * 4 + (lane >> sh)] = x;
        __syncthreads();
        /* one shift pattern and one grouping: the plan puts both page classes on tensor cores only when their
         * bits and groups agree */
        const int hv = tid & 3, gq = (tid & 31) >> 2, vbits = (g.mv & 1) ? vhi.bits : vlo.bits;
        const int vgrp = (g.mv & 1) ? (vhi.hidden ? D : vhi.group) : (vlo.hidden ? D : vlo.group);
#pragma unroll
        for (int i = 0; i < KVQ_MMA_MPW; i++)
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int cl = 2 * gq + u, c = ((tid >> 5) * KVQ_MMA_MPW + i) * 16 + cl, gi = c / vgrp;
                float zs = 0.0f;
                for (int w = 0; w < NW && hv < G; w++) zs += ozs[(w * G + hv) * 4 + gi];
                const float x = fmaf(macc[i][2 * u + 1], KVQ_MMA_LO_INV, macc[i][2 * u]) * kvq_mma_vinv(vbits, cl);
                if (c < D && hv < G) so[hv * D + c] += x + zs;
            }
        __syncthreads();
    }
    if (tz != 0 || !act) return;
#pragma unroll
    for (int i = 0; i < KVQ_HPT; i++) {
        const int hl = hl0 + i, head = hk * G + hl;
        float dd = 0.0f;
        for (int w = 0; w < NW; w++) dd += dred[w * G + hl];
        float acc[KVQ_VEC];
#pragma unroll
        for (int v = 0; v < KVQ_VEC; v++) acc[v] = 0.0f;
        for (int z = 0; z < KVQ_TZ; z++) {
            const float4 *s4 = (const float4 *)(so + (z * G + hl) * D + c0), x = s4[0], y = s4[1];
            acc[0] += x.x, acc[1] += x.y, acc[2] += x.z, acc[3] += x.w;
            acc[4] += y.x, acc[5] += y.y, acc[6] += y.z, acc[7] += y.w;
        }
        const float mh = sm[hl];
        const float inv = dd > 0.0f ? __fdividef(1.0f, dd) : 0.0f; /* d >= 1: the max term is 1 */
        const float lse = dd > 0.0f ? mh + log2f(dd) : KVQ_NEG_INF;
        float *dst;
        if (p->n_chunks == 1) {
            dst = (float *)p->out + ((long long)b * KVQ_HQ + head) * D + c0;
            if (p->lse && tx == 0) ((float *)p->lse)[(long long)b * KVQ_HQ + head] = lse;
        } else {
            long long pi = ((long long)b * KVQ_HQ + head) * p->n_chunks + chunk;
            dst = (float *)p->part_o + pi * D + c0;
            if (tx == 0) ((float *)p->part_lse)[pi] = lse;
        }
        ((float4 *)dst)[0] = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
        ((float4 *)dst)[1] = make_float4(acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv);
    }
}

/* kvq_merge: out = sum_j 2^(lse_j - M) o_j / sum_j 2^(lse_j - M) over the chunks sequence b has. */
KVQ_DEV void kvq_merge_body(const kvq_decode_params *p)
{
    const int head = blockIdx.x, b = blockIdx.y, c = threadIdx.x;
    const kvq_seq_tiles st = ((const kvq_seq_tiles *)p->seqs)[b];
    const int tpc = st.tiles_per_chunk > 0 ? st.tiles_per_chunk : p->tiles_per_chunk;
    int nch = (st.n_tiles + tpc - 1) / tpc;
    if (nch < 1) nch = 1;
    if (nch > p->n_chunks) nch = p->n_chunks;
    long long pi = ((long long)b * KVQ_HQ + head) * p->n_chunks;
    const float *lse = (const float *)p->part_lse + pi;
    float mx = KVQ_NEG_INF;
    for (int j = 0; j < nch; j++) mx = fmaxf(mx, lse[j]);
    float num = 0.0f, den = 0.0f;
    if (mx != KVQ_NEG_INF)
        for (int j = 0; j < nch; j++) {
            float w = exp2f(lse[j] - mx);
            den += w;
            num = fmaf(w, ((const float *)p->part_o)[(pi + j) * KVQ_D + c], num);
        }
    if (c < KVQ_D)
        ((float *)p->out)[((long long)b * KVQ_HQ + head) * KVQ_D + c] = den > 0.0f ? __fdividef(num, den) : 0.0f;
    if (c == 0 && p->lse)
        ((float *)p->lse)[(long long)b * KVQ_HQ + head] = den > 0.0f ? mx + log2f(den) : KVQ_NEG_INF;
}

#endif
