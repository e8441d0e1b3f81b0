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
 * The inner-product variant of the keys (prod, Algorithm 2) adds the QJL signs of the residual, sign(S r), and
 * ||r|| (the zero entry); at decode, sq = sqrt(pi/2)/m S q is computed once per block (kvq_tq_sketch_q, O(D^2 GQA))
 * and each key's term gamma <sq, sign> once per token and head while its tile is staged, so a score is the
 * reference's estimator; nothing of S is applied per token (the cpu backend's scheme, docs/cpu.md). Prod values
 * (Algorithm 2's reconstruction in p.V) are refused on CUDA (compiler/plan.c plan_cuda_ok). KVQ_TQ_ANY (compiler/emit_cuda.c) is 0 in a unit whose plan has no
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
    kvq_fmt g = {32, 0, 0, 0, 0, 4, 4, 0, 0, 0, 0, 0.0f, 0, {0}, 0, 0, 0, {{0}}};
    g.tq = f.tq; /* prod keys: kvq_scores adds the staged QJL term (bits 32: not a page, kvq_tq_is is 0) */
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

/* nn (a double) of item i kept in shared memory as two 32-bit halves (the kernel's float scratch). */
KVQ_DEV void kvq_tq_put_nn(unsigned *nnb, int i, double nn)
{
    const long long b = __double_as_longlong(nn);
    nnb[2 * i] = (unsigned)b, nnb[2 * i + 1] = (unsigned)((unsigned long long)b >> 32);
}
KVQ_DEV double kvq_tq_get_nn(const unsigned *nnb, int i)
{
    return __longlong_as_double((long long)((unsigned long long)nnb[2 * i + 1] << 32 | nnb[2 * i]));
}

/* Quantize-and-append of tokens [tb, tb + nt) staged in xs ([KVQ_QTOK][D], the caller synchronised after them),
 * runtime/turboquant.c kvq_tq_quantize step for step: one item per (token, part) takes the norm (kept in nnb, two
 * words an item), one per (token, code word) packs the word. Prod (Algorithm 2) then takes ym = the MSE
 * reconstruction per element (into ym, [KVQ_QTOK][D] floats), the residual r = y - ym in double, ||r|| per
 * (token, part) as the zero entry, and per (token, 32 QJL rows) the signs of S r (S: p->tq_s, double, part by part)
 * as one word of the token's D-bit sign row. */
KVQ_DEV void kvq_tq_quant_token_run(const kvq_quant_params *p, kvq_fmt f, kvq_page_off o, const float *xs,
                                    float *ym, unsigned *nnb, int tb, int nt, int h, int tid, int nthreads)
{
    unsigned char *page = (unsigned char *)p->page;
    const int np = f.tq_out ? 2 : 1, ng = o.n_groups;
    for (int i = tid; i < nt * np; i += nthreads) {
        const int t = i / np, j = i % np;
        const double nn = kvq_tq_norm(xs + t * KVQ_D, kvq_tq_part_of(f, j));
        kvq_tq_put_nn(nnb, i, nn);
        kvq_st_par(page + o.scale, ((long long)h * p->cap + p->slot + tb + t) * ng + j, 4, (float)nn);
    }
    __syncthreads();
    const int W = o.cbpt / 4, w0 = f.tq_out ? kvq_tq_part_of(f, 1).byte / 4 : W;
    unsigned *codes = (unsigned *)(page + o.codes);
    for (int i = tid; i < nt * W; i += nthreads) {
        const int t = i / W, w = i % W, j = w >= w0;
        const kvq_tq_part pt = kvq_tq_part_of(f, j);
        const float *x = xs + t * KVQ_D + pt.off;
        const double nn = kvq_tq_get_nn(nnb, t * np + j);
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
    if (f.tq != 2) return;
    /* Algorithm 2: ym = DeQuant_mse(idx) with the stored (fp32) norm */
    for (int e = tid; e < nt * KVQ_D; e += nthreads) {
        const int t = e / KVQ_D, c = e % KVQ_D, j = f.tq_out && c >= f.tq_out;
        const kvq_tq_part pt = kvq_tq_part_of(f, j);
        const double nn = kvq_tq_get_nn(nnb, t * np + j);
        const unsigned code = kvq_tq_nearest(&f, j, pt.bits, nn > 0.0 ? (double)xs[e] / nn : 0.0);
        ym[e] = (float)kvq_dmul((double)(float)nn, kvq_tq_level(&f, j, code));
    }
    __syncthreads();
    /* gamma = ||r||, r = y - ym in double, channel order */
    for (int i = tid; i < nt * np; i += nthreads) {
        const int t = i / np, j = i % np;
        const kvq_tq_part pt = kvq_tq_part_of(f, j);
        double rr = 0.0;
        for (int c = pt.off; c < pt.off + pt.m; c++) {
            const double r = (double)xs[t * KVQ_D + c] - (double)ym[t * KVQ_D + c];
            rr = rr + kvq_dmul(r, r);
        }
        kvq_st_par(page + o.zero, ((long long)h * p->cap + p->slot + tb + t) * ng + j, 4, (float)sqrt(rr));
    }
    /* qjl = sign(S r): bit i of part j's rows is (sum_c S_j[i][c] r_c >= 0), the sum in channel order */
    const double *S = (const double *)p->tq_s;
    unsigned *signs = (unsigned *)(page + o.qjl);
    for (int i = tid; i < nt * (KVQ_D / 32); i += nthreads) {
        const int t = i / (KVQ_D / 32), w = i % (KVQ_D / 32), j = f.tq_out && 32 * w >= f.tq_out;
        const kvq_tq_part pt = kvq_tq_part_of(f, j);
        const double *Sj = S + (j ? (long long)f.tq_out * f.tq_out : 0);
        const float *x = xs + t * KVQ_D + pt.off, *y = ym + t * KVQ_D + pt.off;
        unsigned word = 0;
        for (int k = 0; k < 32; k++) {
            const double *row = Sj + (long long)(32 * w + k - pt.off) * pt.m;
            double acc = 0.0;
            for (int c = 0; c < pt.m; c++) acc = acc + kvq_dmul(row[c], (double)x[c] - (double)y[c]);
            word |= (unsigned)(acc >= 0.0) << k;
        }
        signs[((long long)h * p->cap + p->slot + tb + t) * (KVQ_D / 32) + w] = word;
    }
}

/* The QJL estimator's query side, once per decode block (Algorithm 2, Lemma 3): sq[i][h] = sqrt(pi/2) / m_j *
 * (S_j q_j)_i for QJL row i of part j, [D][GQA] like qs (the log2-domain query), so that a prod key's term is
 * sum_j gamma_j sum_{i in j} (sign_i ? sq_i : -sq_i). */
KVQ_DEV void kvq_tq_sketch_q(kvq_u64 s, kvq_fmt f, const float *qs, float *sq, int tid, int nthreads)
{
    const double *S = (const double *)s;
    for (int e = tid; e < KVQ_D * KVQ_GQA; e += nthreads) {
        const int i = e / KVQ_GQA, hh = e % KVQ_GQA, j = f.tq_out && i >= f.tq_out;
        const kvq_tq_part pt = kvq_tq_part_of(f, j);
        const double *row = S + (j ? (long long)f.tq_out * f.tq_out : 0) + (long long)(i - pt.off) * pt.m;
        float acc = 0.0f;
        for (int c = 0; c < pt.m; c++) acc = fmaf((float)row[c], qs[(pt.off + c) * KVQ_GQA + hh], acc);
        sq[e] = acc * (1.2533141373155003f / (float)pt.m); /* sqrt(pi / 2) / m_j */
    }
}

/* Stages tokens [slot, slot + n) of a TurboQuant page for kv head h as fp32 rows norm_j * L_j[code]
 * (runtime/turboquant.c kvq_tq_dequant_mse). Per-token pages never form page runs: one page. */
KVQ_DEV void kvq_tq_stage_page(unsigned char *rows, float *qjl, const float *sq, const unsigned char *b, kvq_fmt f,
                               int slot, int cap, int n, int h, int tid, int nthreads)
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
    if (f.tq != 2) return;
    /* prod keys: each token's QJL term per head into qjl[t][GQA] (kvq_scores adds it to the score) */
#pragma unroll 1
    for (int e = tid; e < n * KVQ_GQA; e += nthreads) {
        const int t = e / KVQ_GQA, hh = e % KVQ_GQA;
        const long long tok = (long long)h * cap + slot + t;
        const unsigned char *sg = b + o.qjl + tok * (KVQ_D / 8);
        float acc = 0.0f;
        for (int j = 0; j < (f.tq_out ? 2 : 1); j++) {
            const kvq_tq_part pt = kvq_tq_part_of(f, j);
            float part = 0.0f;
            for (int c = pt.off; c < pt.off + pt.m; c++) {
                const float v = sq[c * KVQ_GQA + hh];
                part += (sg[c >> 3] >> (c & 7)) & 1u ? v : -v;
            }
            acc = fmaf(kvq_ld_par(b + o.zero, tok * o.n_groups + j, 4), part, acc);
        }
        qjl[e] = acc;
    }
}

#endif
