/* Tensor-core q.K and p.V of the decode kernel for 2- and 4-bit pages (docs/cuda.md, "Tensor cores").
 *
 * mma.sync.m16n8k16 (kvq_mma_m16n8k16: fp16 A and B, fp32 accumulators) with every product exact, so that only
 * the fp32 accumulation rounds, as in the fp32 path:
 *   - a code c becomes the fp16 number c 2^k 2^-24 exactly, two codes one AND: the mask keeps two fields where
 *     they sit (16 bits apart), and with the exponent bits zero a half whose mantissa is m is the subnormal
 *     m 2^-24 (c 2^k < 1024; k is the field's offset in its half). The 2^-24 and the 2^-k are undone where the
 *     code's partner operand is scaled or at the end: powers of two, exact. (Until 2026-11-27 the fields went into
 *     the mantissa of 1024 and an HADD2 of -1024 followed: one instruction more a pair, 4 a token of KIVI-2.)
 *     Tensor cores take fp16 subnormal inputs (mma.sync has no flush-to-zero form for f16); kvq_params_sig probes
 *     it on every module load and cu_dev_check_params refuses a GPU that flushes them (docs/cuda.md);
 *   - the other operand x (the folded query of q.K, the weight p s_t of p.V) is split into x_hi = fp16(x) and
 *     x_lo = fp16((x - x_hi) 2^11): x = x_hi + 2^-11 x_lo to about 2^-22 relative (x - x_hi is exact in fp32),
 *     each an 11-bit significand, so code x code-operand products have at most 15 bits: exact in fp32 (the
 *     smallest, a subnormal code times a subnormal x_lo, 2^-48: an fp32 normal);
 *   - the N = 8 columns of B are the GQA group's heads, high and low part side by side (column 2h, 2h + 1): a
 *     lane's accumulators c0, c1 (and c2, c3) are the high and low sums of one head, combined as
 *     hi + 2^-11 lo at the end. At GQA 1 and 2 the columns from 2 GQA on are zero (the lanes from 8 GQA load 0
 *     instead of B, so no stale shared memory enters them) and lanes t >= GQA write nothing: one mma a 16 x 16
 *     block serves 1, 2 or 4 heads at the same cost.
 * Shapes: GQA 1, 2 or 4, 128 threads (4 warps), head_dim a multiple of 64 (compiler/plan.c, mma_k_ok / mma_v_ok).
 * With g = lane / 4 and t = lane % 4, the fragment layout is the PTX ISA's (tests/emu/emu_abi.h, emu_mma_frag). */
#ifndef KVQ_MMA_CUH
#define KVQ_MMA_CUH

#include "kvq_unpack.cuh"

#define KVQ_MMA_ASCALE 16777216.0f /* 2^24: a code c is the fp16 subnormal c 2^-24 (kvq_mma_codes) */
#define KVQ_MMA_LO 2048.0f        /* the low part's scale 2^11 */
#define KVQ_MMA_LO_INV 4.8828125e-4f /* 2^-11 */
#define KVQ_MMA_NW (KVQ_THREADS / 32)
/* 32-bit words of one page's q.K B fragments: D / 16 k-blocks x KVQ_MMA_KBS entries (32 lanes) x 2 registers,
 * whatever the GQA */
#define KVQ_MMA_QPAGE (KVQ_D / 16 * KVQ_MMA_KBS * 2)
/* A k-block's 32 lanes of B fragments (8-byte entries) take KVQ_MMA_KBS entries, 2 more than 32: the fold's items
 * (kb, t) of a half-warp, which store entry 8 h + t (+ 4 for the low part) of k-blocks of one parity
 * (kvq_fold_item_kb), then reach 16 different bank pairs, one wavefront a phase, instead of the same four pairs from
 * all their k-blocks 256 bytes apart (8 wavefronts an instruction, as ncu counted on the H200). The reads of a block
 * take 32 consecutive entries: conflict-free at any offset (test_cuda_banks). compiler/plan.c sizes a page at D / 16
 * x KVQ_MMA_KBS x 8 bytes. */
#define KVQ_MMA_KBS 34
/* 16-channel blocks of p.V per warp (at least 1 so that the unit compiles for every plan) */
#define KVQ_MMA_MPW ((KVQ_D / 16 + KVQ_MMA_NW - 1) / KVQ_MMA_NW)

/* two fields of x under `mask` (one in each half) -> the half2 (c0 2^k 2^-24, c1 2^k 2^-24): subnormals, exact */
KVQ_DEV unsigned kvq_mma_codes(unsigned x, unsigned mask) { return x & mask; }

/* x -> (x_hi, x_lo) as above, two 16-bit patterns */
KVQ_DEV void kvq_mma_split(float x, unsigned short *hi, unsigned short *lo)
{
    const kvq_half h = kvq_f2h(x);
    *hi = h.bits;
    *lo = kvq_f2h((x - kvq_h2f(h)) * KVQ_MMA_LO).bits;
}

/* (x0, x1) -> the half2 registers (x0_hi, x1_hi) and (x0_lo, x1_lo): kvq_mma_split of a pair, one
 * cvt.rn.f16x2.f32 for each register (the fold's query, the weights of two tokens) */
KVQ_DEV void kvq_mma_split2(float x0, float x1, unsigned *hi, unsigned *lo)
{
    const kvq_half2 h = kvq_f2h2(x0, x1);
    *hi = kvq_h2_bits(h);
    *lo = kvq_h2_bits(kvq_f2h2((x0 - kvq_h2f(h.x)) * KVQ_MMA_LO, (x1 - kvq_h2f(h.y)) * KVQ_MMA_LO));
}

/* ---- q.K: A = 16 tokens x 16 channels of key codes, B = 16 channels x (4 heads x hi/lo) of the query ---- */

/* The channel order inside a 16-channel k-block is the one the unpacking gives (B follows it): lane t's
 * a0 = row g at k = 2t, 2t+1 and a2 = row g at k = 2t+8, 2t+9 come from one lop3 each.
 *   2 bits (one word of 16 codes): a0 = channels t, t+8 (mask at bits 2t and 2t+16), a2 = the word >> 8: channels
 *     t+4, t+12; k = 8r + 2t + h holds channel t + 4r + 8h, shifted by 2^(2t);
 *   4 bits (two words of 8 codes): a0 = word 0, a2 = word 1, each >> 8 for t >= 2, fields at nibble t mod 2 of
 *     each half: channels (t, t+4) of the word; k = 8r + 2t + h holds channel 8r + t + 4h, shifted by 2^(4 (t & 1)).
 * kvq_mma_kpos gives, for channel j (0..15) of a block, its lane's t, register r, half h and the shift k. */
KVQ_DEV void kvq_mma_kpos(int bits, int j, int *t, int *r, int *h, int *k)
{
    *t = j & 3;
    if (bits == 2) {
        *r = (j >> 2) & 1, *h = j >> 3, *k = 2 * (j & 3);
    } else {
        *r = j >> 3, *h = (j >> 2) & 1, *k = 4 * (j & 1);
    }
}

/* The k-block of fold item j (its t is j & 3). Where the k-blocks come in eights, the four items of a half-warp's
 * 16 lanes (j >> 2 = 4a .. 4a + 3) take k-blocks of one parity, 2 apart: their stores (entry 8 h + t of a block
 * KVQ_MMA_KBS = 34 entries long) then land on 16 different bank pairs, where consecutive k-blocks overlap (2-way). */
KVQ_DEV int kvq_fold_item_kb(int j)
{
    const int q = j >> 2;
    return KVQ_D % 128 == 0 ? (q & ~7) | (q & 3) << 1 | (q >> 2 & 1) : q;
}

/* The per-tile fold for q.K: B fragments of qk = q s_c 2^-k(c) qscale (qs pre-scaled, s the per-channel scales of
 * np pages: widened at ks + page D, or, kraw not null, where cp.async landed them, eb bytes each, kvq_kpar_raw),
 * high and low parts, as [page][D/16 k-blocks][KVQ_MMA_KBS entries: 32 lanes, 2 unused][2 registers] of half2 at qb
 * (KVQ_MMA_QPAGE words a page; lanes from 8 GQA are not written: kvq_scores_mma loads 0 there). qscale (a power of
 * two from the chunk's max |q|, kvq_mma_qscale) keeps |qk| < 2^15 for any fp16 scale. One item is a (k-block, t):
 * the four channels of lane t's two registers (r) and halves (h) for every head, i.e. the high pair of lane 8 head
 * + t and the low pair of lane 8 head + 4 + t, each one 8-byte store; the two halves of a register convert in one
 * cvt.rn.f16x2.f32. The item loads its four scales once for all heads (an item a head loaded them GQA times: 39
 * instructions a page and item of one head at KIVI-2's GQA 4, where this takes 114 for four), and where the items
 * divide the block (head_dim 64, 128, 256) a thread keeps its item's query (2^-k qscale q: powers of two, the same
 * product) in registers over the pages it folds. */
KVQ_DEV void kvq_fold_item_q(int bits, int j, const float *qs, float qscale, int cs[4], float qv[4][KVQ_GQA])
{
    const int kb = kvq_fold_item_kb(j), t = j & 3;
    const int k = bits == 2 ? 2 * t : 4 * (t & 1);
    const float sc = __uint_as_float((unsigned)(127 - k) << 23) * qscale; /* 2^-k qscale: a power of two */
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int r = e >> 1, hh = e & 1; /* kvq_mma_kpos inverted: the channel at (t, r, hh) */
        cs[e] = kb * 16 + (bits == 2 ? t + 4 * r + 8 * hh : 8 * r + 4 * hh + t);
#pragma unroll
        for (int h = 0; h < KVQ_GQA; h++) qv[e][h] = qs[cs[e] * KVQ_GQA + h] * sc;
    }
}
KVQ_DEV void kvq_fold_item_page(int j, const int cs[4], const float qv[4][KVQ_GQA], const float *ks,
                                const unsigned char *kraw, int eb, unsigned *qb, int pg)
{
    const int kb = kvq_fold_item_kb(j), t = j & 3;
    float s[4];
    if (kraw) {
        /* the scales where cp.async landed them (kvq_kpar_raw) */
        const unsigned char *kr = kraw + kvq_raw_page(pg * KVQ_D * eb, pg);
#pragma unroll
        for (int e = 0; e < 4; e++) s[e] = kvq_ld_par(kr, cs[e], eb);
    } else {
#pragma unroll
        for (int e = 0; e < 4; e++) s[e] = ks[pg * KVQ_D + cs[e]];
    }
    uint2 *dst = (uint2 *)qb + pg * (KVQ_MMA_QPAGE / 2) + kb * KVQ_MMA_KBS + t;
#pragma unroll
    for (int h = 0; h < KVQ_GQA; h++) {
        unsigned hi[2], lo[2];
#pragma unroll
        for (int r = 0; r < 2; r++)
            kvq_mma_split2(qv[2 * r][h] * s[2 * r], qv[2 * r + 1][h] * s[2 * r + 1], &hi[r], &lo[r]);
        dst[8 * h] = make_uint2(hi[0], hi[1]);
        dst[8 * h + 4] = make_uint2(lo[0], lo[1]);
    }
}
KVQ_DEV void kvq_fold_k_mma(int bits, const float *ks, const unsigned char *kraw, int eb, const float *qs, float qscale,
                            unsigned *qb, int np, int tid)
{
    const int NI = (KVQ_D / 16) * 4; /* items */
    int cs[4];
    float qv[4][KVQ_GQA];
    if (KVQ_THREADS % NI == 0) { /* a thread's item is the same on every page it takes */
        const int j = tid % NI;
        kvq_fold_item_q(bits, j, qs, qscale, cs, qv);
#pragma unroll 1
        for (int pg = tid / NI; pg < np; pg += KVQ_THREADS / NI) kvq_fold_item_page(j, cs, qv, ks, kraw, eb, qb, pg);
    } else {
#pragma unroll 1
        for (int i = tid; i < NI * np; i += KVQ_THREADS) {
            const int j = i % NI;
            kvq_fold_item_q(bits, j, qs, qscale, cs, qv);
            kvq_fold_item_page(j, cs, qv, ks, kraw, eb, qb, i / NI);
        }
    }
}

/* 2^E with E = -(floor(log2 qmax) + 2): |q| 65504 2^E < 2^15 (kvq_fold_k_mma); 1 for qmax 0 or not finite */
KVQ_DEV float kvq_mma_qscale(float qmax)
{
    const int e = (int)((__float_as_uint(qmax) >> 23) & 255u) - 127;
    if (!(qmax > 0.0f) || e >= 100 || e < -100) return 1.0f;
    return __uint_as_float((unsigned)(127 - (e + 2)) << 23);
}

/* Scores of tokens [0, n) of a tile, all GQA heads: warp w takes a quarter of the 16-token blocks; each lane t < GQA
 * ends with the scores of tokens g and g + 8 of its block for head t, (hi + 2^-11 lo) qinv + bias (qinv = 2^24 /
 * qscale: the codes' subnormal scale and the query's), written to ps
 * (-inf for masked slots); the warp's per-head maxima go to wmax[warp][GQA]. The bias of a page is the sum of
 * bred's eight partials (kvq_fold_k's per-channel zeros). A tile over several pages of a page run (kcap > 0, the
 * tile's first token at slot s0 of its first page) takes each block's page's fold (qb + page x KVQ_MMA_QPAGE
 * words) and bias: a block lies in one page (layout/tiles.h: such a tile begins at a page boundary, pages of 16k
 * tokens). */
KVQ_DEV void kvq_scores_mma(int bits, const unsigned char *rows, const unsigned char *mask, int masked,
                            const unsigned *qb, const float *bred, float qinv, int n, int s0, int kcap, int tid,
                            float *ps, float *wmax, int sw)
{
    const int G = KVQ_GQA, KB = KVQ_D / 16;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int cbpt = kvq_fmt_cbpt(bits, KVQ_D);
    /* rows g and g + 8 of every 16-token block have the same swizzle (kvq_row_swz: it repeats every 8 rows): chunk
     * q4 of the lane's rows sits at chunk q4 ^ kvq_row_swz(g, cbpt, q4), a byte offset fixed for the loop */
    unsigned b[KVQ_D / 16][2];
    int cur = -1; /* the page whose fold b holds */
    const unsigned msk = bits == 2 ? (3u << 2 * t) | (3u << (2 * t + 16)) : (15u << 4 * (t & 1)) | (15u << (4 * (t & 1) + 16));
    const int sh = bits == 2 ? 8 : t >= 2 ? 8 : 0;
    float bh = 0.0f;
    float mx = KVQ_NEG_INF;
    /* warp w takes the consecutive 16-token blocks [w per, (w + 1) per) of the tile's nb: as many a warp as
     * blocks w, w + 4, ... would give, and neighbours share a page of a page run, so the page (one division a
     * tile) advances by a compare and the query's fragments reload once a page */
    const int nb = (n + 15) >> 4, per = (nb + KVQ_MMA_NW - 1) / KVQ_MMA_NW, bend = min(nb, (warp + 1) * per);
    int pg = 0, off = 0;
    if (kcap > 0) {
        const int s = s0 + warp * per * 16;
        pg = kvq_divmod(s, kcap, &off); /* s0 < kcap: at most tile / 16 */
    }
#pragma unroll 1
    for (int m0 = warp * per * 16; m0 < bend * 16; m0 += 16) {
        if (pg != cur) {
            const uint2 *qp = (const uint2 *)(qb + pg * KVQ_MMA_QPAGE);
#pragma unroll
            for (int kb = 0; kb < KB; kb++) {
                /* columns past 2 GQA: 0 */
                const uint2 x = lane < 8 * G ? qp[kb * KVQ_MMA_KBS + lane] : make_uint2(0u, 0u);
                b[kb][0] = x.x, b[kb][1] = x.y;
            }
            /* the page's bias q . z of head t: the fold's eight partial sums in order (kvq_fold_k), added here
             * where the fragments reload instead of in a pass of warp 0 and a barrier of its own */
            const float4 *z4 = (const float4 *)(bred + kvq_bred_at(G, pg, t & (G - 1))); /* 16-byte aligned (plan.c) */
            const float4 za = z4[0], zc = z4[1];
            bh = 0.0f + za.x + za.y + za.z + za.w + zc.x + zc.y + zc.z + zc.w;
            cur = pg;
        }
        const unsigned char *r0 = rows + (m0 + g) * cbpt;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int q4 = 0; q4 < cbpt / 16; q4++) {
            const int pq = 16 * (sw ? q4 ^ kvq_row_swz(g, cbpt, q4) : q4);
            const uint4 x0 = *(const uint4 *)(r0 + pq), x1 = *(const uint4 *)(r0 + 8 * cbpt + pq);
            const unsigned w0[4] = {x0.x, x0.y, x0.z, x0.w}, w1[4] = {x1.x, x1.y, x1.z, x1.w};
            if (bits == 2) {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const unsigned a[4] = {kvq_mma_codes(w0[j], msk), kvq_mma_codes(w1[j], msk),
                                           kvq_mma_codes(w0[j] >> 8, msk), kvq_mma_codes(w1[j] >> 8, msk)};
                    kvq_mma_m16n8k16(acc, a, b[q4 * 4 + j]);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const unsigned a[4] = {kvq_mma_codes(w0[2 * j] >> sh, msk), kvq_mma_codes(w1[2 * j] >> sh, msk),
                                           kvq_mma_codes(w0[2 * j + 1] >> sh, msk),
                                           kvq_mma_codes(w1[2 * j + 1] >> sh, msk)};
                    kvq_mma_m16n8k16(acc, a, b[q4 * 2 + j]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int tok = m0 + g + 8 * u;
            float x = fmaf(fmaf(acc[2 * u + 1], KVQ_MMA_LO_INV, acc[2 * u]), qinv, bh);
            if (tok < n && t < G) {
                if (masked && mask[tok]) x = KVQ_NEG_INF;
                ps[tok * G + t] = x;
                mx = fmaxf(mx, x);
            }
        }
        off += 16; /* pages hold multiples of 16 tokens */
        if (kcap > 0 && off >= kcap) off -= kcap, pg++;
    }
    /* the warp's maximum of head t: a lane holds head t's only, so 3 shuffles over the lanes of one t (xor 4, 8,
     * 16) instead of 5 per head; lane t (< GQA) writes it for the block maximum (wmax[warp][GQA]) */
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(KVQ_FULL_MASK, mx, off));
    if (lane < G) wmax[warp * G + lane] = mx;
}

/* ---- p.V: A = 16 channels x 16 tokens of value codes, B = 16 tokens x (4 heads x hi/lo) of weights ---- */

/* The weights w = p s_t of token tt (one per value group gi and head h) as B fragments at wb, laid out
 * [tile / 16 blocks][groups][32 lanes][2 registers] of half2, a block's groups KVQ_MMA_WKS(ngv) words apart with 8
 * words after them: token k of a block sits at register k >> 3, half k & 1 of lane 4n + ((k & 7) >> 1) for column n
 * (2h high, 2h + 1 low). kvq_probs' lane l stores tokens 2l, 2l + 1 of block l / 8: without the 8 words the four
 * blocks of a warp's stores lay 64 words apart, in the same 8 banks (4-way, as ncu counted on the H200); with them
 * every lane of a store has a bank of its own. p.V's loads of a block's 32 lanes stay consecutive. */
#define KVQ_MMA_WKS(ngv) ((ngv) * 64 + 8)
KVQ_DEV void kvq_mma_put_w(unsigned short *wb, int wks, int gi, int tt, int h, float w)
{
    const int ks = tt >> 4, k = tt & 15;
    const int base = ks * wks + gi * 64 + ((k & 7) >> 1) * 2 + (k >> 3);
    unsigned short hi, lo;
    kvq_mma_split(w, &hi, &lo);
    wb[(base + 8 * (2 * h)) * 2 + (k & 1)] = hi;
    wb[(base + 8 * (2 * h + 1)) * 2 + (k & 1)] = lo;
}

/* kvq_mma_put_w for the even token tt and tt + 1, which share each 32-bit register: one store of the pair for
 * the high parts and one for the low parts */
KVQ_DEV void kvq_mma_put_w2(unsigned short *wb, int wks, int gi, int tt, int h, float w0, float w1)
{
    const int ks = tt >> 4, k = tt & 15;
    const int base = ks * wks + gi * 64 + ((k & 7) >> 1) * 2 + (k >> 3);
    unsigned *w = (unsigned *)wb + base + 16 * h;
    kvq_mma_split2(w0, w1, &w[0], &w[8]);
}

/* The value codes of the lane's channels 2g, 2g + 1 of a 16-channel block for two tokens: prmt brings the byte
 * holding both from each token's word into the two halves, then one lop3 per channel (2 bits: byte g / 2, fields
 * at 4 (g & 1) and 4 (g & 1) + 2; 4 bits: byte g mod 4 of word g / 4 of the block, nibbles 0 and 4). */
KVQ_DEV void kvq_mma_vcodes(unsigned x0, unsigned x1, unsigned sel, unsigned m0, unsigned m1, unsigned *a0,
                            unsigned *a1)
{
    const unsigned x = kvq_prmt(x0, x1, sel);
    *a0 = kvq_mma_codes(x, m0);
    *a1 = kvq_mma_codes(x, m1);
}

/* o += p v over tokens [0, n32) (n32 = n rounded up to 32, within the tile: quantized classes' tiles are multiples
 * of 32; the weights past n are 0, kvq_probs) for warp w's channel blocks w MPW .. w MPW + MPW - 1: acc[i] = the
 * lane's (head t; channel 2g hi, lo; channel 2g + 1 hi, lo) of block i. Two 16-token blocks an iteration: the loop's
 * own instructions once for both (26 instructions a block at KIVI-2 one at a time), and no remainder copy of the
 * body, so every copy of a line the cost model maps (compiler/sass_cost.c) is the same length. */
KVQ_DEV void kvq_values_mma(int bits, int group, int hidden, const unsigned char *rows, const unsigned *wb, int n,
                            int tid, float acc[KVQ_MMA_MPW][4], int sw)
{
    const int wks = KVQ_MMA_WKS(hidden ? 1 : KVQ_D / group); /* kvq_mma_put_w's layout */
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int cbpt = kvq_fmt_cbpt(bits, KVQ_D), cw = cbpt / 4;
    const unsigned byte = bits == 2 ? (unsigned)(g >> 1) : (unsigned)(g & 3);
    const unsigned sel = byte | (4u + byte) << 8;
    const unsigned m0 = bits == 2 ? (3u << 4 * (g & 1)) | (3u << (4 * (g & 1) + 16)) : 0x000F000Fu;
    const unsigned m1 = m0 << (bits == 2 ? 2 : 4);
    const unsigned *rp = (const unsigned *)rows + 2 * t * cw;
    const unsigned *bp = wb + 2 * lane;
    const int bcol = lane < 8 * KVQ_GQA; /* the lane's B column is a head's (kvq_mma_put_w), else 0 */
    /* 2 bits: the warp's blocks are consecutive words of a token's row, one 8-byte load of each of the four rows
     * when MPW is 2 (head_dim 128; rows are 16-byte aligned, cw even) */
    const int w2 = bits == 2 && KVQ_MMA_MPW == 2 && (cw & 1) == 0;
    /* the lane's rows 2t, 2t + 1, 2t + 8, 2t + 9 of a block: rows 2t + 8 and 2t + 9 have the swizzle of 2t and
     * 2t + 1 (kvq_row_swz repeats every 8 rows), word wo of row r is word KVQ_MMA_PW(r, wo) of its place (fixed for
     * the loop; for rows of at most 4 chunks, head_dim 128, the same for the even and the odd row) */
#define KVQ_MMA_PW(r, wo) (sw ? ((((wo) >> 2) ^ kvq_row_swz((r), cbpt, (wo) >> 2)) << 2) | ((wo) & 3) : (wo))
#pragma unroll 1
    for (int k0 = 0; k0 < n; k0 += 32) {
#pragma unroll
        for (int u = 0; u < 2; u++) {
            unsigned x[4][KVQ_MMA_MPW];
            if (w2) {
                const int rr[4] = {0, cw, 8 * cw, 9 * cw};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int pw = KVQ_MMA_PW(cw <= 16 ? 2 * t : 2 * t + (q & 1), warp * KVQ_MMA_MPW);
                    const uint2 y = *(const uint2 *)(rp + u * 16 * cw + rr[q] + pw);
                    x[q][0] = y.x, x[q][KVQ_MMA_MPW - 1] = y.y;
                }
            }
#pragma unroll
            for (int i = 0; i < KVQ_MMA_MPW; i++) {
                const int mb = warp * KVQ_MMA_MPW + i;
                const int wo = bits == 2 ? mb : 2 * mb + (g >> 2);
                /* the value group of the block: the warp's MPW blocks share one where groups hold them all (one
                 * load) */
                const int gi = hidden ? 0
                               : group % (16 * KVQ_MMA_MPW) == 0 ? warp * KVQ_MMA_MPW * 16 / group
                               : mb * 16 / group;
                const uint2 bw = bcol ? *(const uint2 *)(bp + u * wks + gi * 64) : make_uint2(0u, 0u);
                const unsigned b[2] = {bw.x, bw.y};
                unsigned a[4];
                const int pe = KVQ_MMA_PW(2 * t, wo), po = cw <= 16 ? pe : KVQ_MMA_PW(2 * t + 1, wo);
                const unsigned *ru = rp + u * 16 * cw;
                if (!w2) x[0][i] = ru[pe], x[1][i] = ru[cw + po], x[2][i] = ru[8 * cw + pe], x[3][i] = ru[9 * cw + po];
                kvq_mma_vcodes(x[0][i], x[1][i], sel, m0, m1, &a[0], &a[1]);
                kvq_mma_vcodes(x[2][i], x[3][i], sel, m0, m1, &a[2], &a[3]);
                kvq_mma_m16n8k16(acc[i], a, b);
            }
        }
        rp += 32 * cw, bp += 2 * wks; /* a line of its own, run once an iteration (the loop's line counts its exit) */
    }
#undef KVQ_MMA_PW
}

/* 2^(24 - k) for the value code of channel c (2g or 2g + 1 of a block) as kvq_values_mma unpacks it: c 2^k 2^-24 */
KVQ_DEV float kvq_mma_vinv(int bits, int c)
{
    const int k = bits == 2 ? 4 * ((c >> 1) & 1) + 2 * (c & 1) : 4 * (c & 1);
    return __uint_as_float((unsigned)(127 + 24 - k) << 23);
}

#endif
