/* TurboQuant pages on the device (arXiv 2504.19874; runtime/turboquant.h, layout/layout.h): the MSE quantizer of
 * rotated head vectors (Algorithm 1), reproduced operation by operation from runtime/turboquant.c so that codes and
 * norms are bit-exact with the reference backend, and the decode's staging of a page as fp32 rows
 * x_c = norm_j * L_j[code_c] (Algorithm 1's DeQuant: the reference's value, bit for bit), on which the decode
 * kernel runs its element formats' fp32 path (kvq_format.cuh kvq_fmt_staged). The engine rotates K/V and q
 * (runtime/rt_rotate.c), so nothing here knows the rotation.
 *
 * A stored vector has one part, or two with the outlier channel split (`outlier_channels N bits B`): part 0 the N
 * outlier coordinates at B bits, part 1 the other D - N at `bits`; each part's codes packed as kvq_pack_codes packs
 * m_j channels (3 bits: a 2-bit plane then a 1-bit plane), the parts back to back, its fp32 norm scale entry j of
 * the token. Parts are multiples of 32 channels, so a 32-bit code word never straddles them.
 *
 * The arithmetic the reference does in double is done in double here (kvq_dmul: never fused into an fma):
 *   ||y|| = sqrt(sum_c y_c y_c) in channel order; u_c = y_c / ||y|| (0 when the norm is 0); the code is the number
 *   of cell bounds (L_i + L_{i+1}) / 2 at or below u_c; x_c = (float)(norm * L[code]).
 * The inner-product variant (prod: QJL signs of the residual, Algorithm 2) is not decoded here: the plan refuses
 * it on CUDA (compiler/plan.c plan_cuda_ok). KVQ_TQ_ANY (compiler/emit_cuda.c) is 0 in a unit whose plan has no
 * TurboQuant page, and the hooks in kvq_quantize.cuh and kvq_decode.cuh are then left out before compiling. */
#ifndef KVQ_TURBOQUANT_CUH
#define KVQ_TURBOQUANT_CUH

#include "kvq_format.cuh"

#ifndef KVQ_TQ_ANY
#define KVQ_TQ_ANY 1
#endif

KVQ_DEV int kvq_tq_is(kvq_fmt f) { return KVQ_TQ_ANY && f.tq != 0 && f.bits > 0 && f.bits < 16; }

/* The decode kernel's view of a store (kvq_fmt_staged): TurboQuant pages as fp32 rows, like the element
 * formats that are not linear; and whether the kernel stages a store's rows itself, unswizzled (kvq_decode.cuh). */
KVQ_DEV kvq_fmt kvq_dec_staged(kvq_fmt f)
{
    if (!kvq_tq_is(f)) return kvq_fmt_staged(f);
    kvq_fmt g = {32, 0, 0, 0, 0, 4, 4, 0, 0, 0, 0, 0.0f, 0, {0}};
    return g;
}
KVQ_DEV int kvq_dec_rows_own(kvq_fmt f) { return kvq_fmt_is(f) || kvq_tq_is(f); }

/* Part j of a TurboQuant format: first channel, channels, code bits, first byte of its codes in a token row. */
typedef struct {
    int off, m, bits, byte;
} kvq_tq_part;

KVQ_DEV kvq_tq_part kvq_tq_part_of(kvq_fmt f, int j)
{
    const int qjl = f.tq == 2;
    kvq_tq_part p;
    if (!f.tq_out) {
        p.off = 0, p.m = KVQ_D, p.bits = f.bits - qjl, p.byte = 0;
    } else if (j == 0) {
        p.off = 0, p.m = f.tq_out, p.bits = f.tq_ob - qjl, p.byte = 0;
    } else {
        p.off = f.tq_out, p.m = KVQ_D - f.tq_out, p.bits = f.bits - qjl;
        p.byte = kvq_fmt_cbpt(f.tq_ob - qjl, f.tq_out);
    }
    return p;
}

/* L_j[code] by selects over constant indices (a table indexed by a code would live in local memory). */
KVQ_DEV double kvq_tq_level(const kvq_fmt *f, int j, unsigned code)
{
    double v = 0.0;
#pragma unroll
    for (int i = 0; i < 16; i++)
        if ((int)code == i) v = j ? f->tl[1][i] : f->tl[0][i];
    return v;
}

/* runtime/turboquant.c nearest(): the number of cell bounds at or below u (ties to the upper cell; the bounds
 * ascend, so this is where the reference's scan stops; NaN: 0 as there). Constant indices only: a level table
 * indexed at run time would put the format in local memory. */
KVQ_DEV unsigned kvq_tq_nearest(const kvq_fmt *f, int j, int bits, double u)
{
    const int n = 1 << bits;
    unsigned code = 0;
#pragma unroll
    for (int i = 0; i + 1 < 16; i++) {
        const double lo = j ? f->tl[1][i] : f->tl[0][i], hi = j ? f->tl[1][i + 1] : f->tl[0][i + 1];
        if (i + 1 < n && u >= (lo + hi) / 2) code = (unsigned)i + 1;
    }
    return code;
}

/* ||y|| of part p of a staged row, in the reference's order and rounding. */
KVQ_DEV double kvq_tq_norm(const float *x, kvq_tq_part p)
{
    double nn = 0.0;
    for (int c = 0; c < p.m; c++) {
        const double y = (double)x[p.off + c];
        nn = nn + kvq_dmul(y, y);
    }
    return sqrt(nn);
}

/* Quantize-and-append of tokens [tb, tb + nt) staged in xs ([KVQ_QTOK][D], the caller synchronised after them):
 * one item per (token, part) stores the norm, one per (token, code word) packs the word (recomputing its part's
 * norm: a part's words need it, and a double per word costs less than a second barrier and a staging array). */
KVQ_DEV void kvq_tq_quant_token_run(const kvq_quant_params *p, kvq_fmt f, kvq_page_off o, const float *xs, int tb,
                                    int nt, int h, int tid, int nthreads)
{
    unsigned char *page = (unsigned char *)p->page;
    const int np = f.tq_out ? 2 : 1, ng = o.n_groups;
    for (int i = tid; i < nt * np; i += nthreads) {
        const int t = i / np, j = i % np;
        const float norm = (float)kvq_tq_norm(xs + t * KVQ_D, kvq_tq_part_of(f, j));
        kvq_st_par(page + o.scale, ((long long)h * p->cap + p->slot + tb + t) * ng + j, 4, norm);
    }
    const int W = o.cbpt / 4, w0 = f.tq_out ? kvq_tq_part_of(f, 1).byte / 4 : W;
    unsigned *codes = (unsigned *)(page + o.codes);
    for (int i = tid; i < nt * W; i += nthreads) {
        const int t = i / W, w = i % W, j = w >= w0;
        const kvq_tq_part pt = kvq_tq_part_of(f, j);
        const float *x = xs + t * KVQ_D + pt.off;
        const double nn = kvq_tq_norm(xs + t * KVQ_D, pt);
        const int lw = w - (j ? w0 : 0); /* the word within the part */
#define KVQ_TQC_(c) kvq_tq_nearest(&f, j, pt.bits, nn > 0.0 ? (double)x[c] / nn : 0.0)
        unsigned word = 0;
        if (pt.bits == 3) { /* a 2-bit plane of m / 16 words, then the high bits' 1-bit plane */
            if (lw < pt.m / 16)
                for (int k = 0; k < 16; k++) word |= (KVQ_TQC_(lw * 16 + k) & 3u) << (2 * k);
            else
                for (int k = 0; k < 32; k++) word |= ((KVQ_TQC_((lw - pt.m / 16) * 32 + k) >> 2) & 1u) << k;
        } else {
            const int per = 32 / pt.bits;
            for (int k = 0; k < per; k++) word |= KVQ_TQC_(lw * per + k) << (pt.bits * k);
        }
#undef KVQ_TQC_
        codes[((long long)h * p->cap + p->slot + tb + t) * W + w] = word;
    }
}

/* Stages tokens [slot, slot + n) of a TurboQuant page for kv head h as fp32 rows norm_j * L_j[code]
 * (runtime/turboquant.c kvq_tq_dequant_mse). Per-token pages never form page runs: one page. */
KVQ_DEV void kvq_tq_stage_page(unsigned char *rows, const unsigned char *b, kvq_fmt f, int slot, int cap, int n,
                               int h, int tid, int nthreads)
{
    const kvq_page_off o = kvq_page_offsets(f, KVQ_HKV, KVQ_D, cap);
    const kvq_tq_part p0 = kvq_tq_part_of(f, 0), p1 = kvq_tq_part_of(f, 1);
    float *out = (float *)rows;
#pragma unroll 1
    for (int e = tid; e < n * KVQ_D; e += nthreads) {
        const int t = e / KVQ_D, c = e % KVQ_D, j = f.tq_out && c >= f.tq_out;
        const kvq_tq_part pt = j ? p1 : p0;
        const long long tok = (long long)h * cap + slot + t;
        const unsigned code = kvq_fmt_code_at(b + o.codes + tok * o.cbpt + pt.byte, pt.bits, pt.m, c - pt.off);
        const float norm = kvq_ld_par(b + o.scale, tok * o.n_groups + j, 4);
        out[(long long)t * KVQ_D + c] = (float)kvq_dmul((double)norm, kvq_tq_level(&f, j, code));
    }
}

#endif
