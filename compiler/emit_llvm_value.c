/* The V phase of the cpu backend's tile kernels (emit_llvm_build.h, docs/cpu.md "The kernel"): acc_j = acc_j
 * e^(m - m') + sum_t p_jt v_t. fp32 (each V row dequantized once for the g heads, or at GQA 1 the per-token scale
 * folded into the weight), the int16 P.V (token pairs per vpdpwssd) and the int8 P.V (four tokens per vpdpbusd)
 * with AVX-512 VNNI. */
#include "quant.h"

#ifdef KVQ_HAVE_LLVM
#include "emit_llvm_build.h"

/* ---- int16 P.V (AVX-512 VNNI): per-token value groups, token pairs in one vpdpwssd ---- */

/* The V rows of an int16 P.V: per-token groups of whole 16-channel blocks, no hidden group, no channel factor.
 *
 * GQA 1 only, like the int16 keys: the hi/lo pair doubles the multiply-adds (vpdpwssd's 32 MACs are 16 per
 * half) while the codes' unpacking, which the int16 paths halve, is shared by the g heads anyway; at GQA 4 the
 * heads' MACs dominate and the int16 keys measured ~10 % slower than fp32 on Zen 4 (docs/cpu.md "Speed"). The
 * emitter itself handles g <= 8 (2 g x blocks int32 accumulators, scratch of g x groups x 64 weights). */
static int v_int16(const E *e, const emit_llvm_kernel *k)
{
    const kvq_page_format *f = &k->v.fmt;
    return e->vnni && e->W == 16 && !k->v.fp16 && el_fmt_int(f) && f->gran == KVQ_GRAN_TOKEN && !f->hidden &&
           !f->channel_separable &&
           f->group % 16 == 0 && k->gqa == 1 && k->gqa * (k->head_dim / f->group) <= 32;
}

/* Channels c0..c0+15 of a b-bit plane (b in 1, 2, 4, 8) at byte `pl` of two V rows held in `rows` (row t at byte
 * 0, row t+1 at byte rb) as 16 i32 lanes of two 16-bit codes each: lane c = code_t[c0+c] | code_t+1[c0+c] << 16,
 * the layout vpdpwssd pairs with a broadcast (w_t, w_t+1). One byte permute, a shift and a mask. */
static LLVMValueRef pair_plane(E *e, LLVMValueRef rows, int rb, int pl, int b, int c0)
{
    LLVMTypeRef i16 = LLVMInt16TypeInContext(e->c);
    LLVMValueRef idx[64], sh[32], msk[32];
    for (int c = 0; c < 16; c++) {
        int byte = pl + ((c0 + c) * b) / 8;
        idx[4 * c] = idx[4 * c + 1] = el_ci32(e, byte);       /* the high byte: masked off below */
        idx[4 * c + 2] = idx[4 * c + 3] = el_ci32(e, rb + byte);
        sh[2 * c] = sh[2 * c + 1] = LLVMConstInt(i16, (unsigned long long)(((c0 + c) * b) % 8), 0);
        msk[2 * c] = msk[2 * c + 1] = LLVMConstInt(i16, (1ull << b) - 1, 0);
    }
    LLVMValueRef v = LLVMBuildShuffleVector(e->b, rows, LLVMGetPoison(LLVMTypeOf(rows)), LLVMConstVector(idx, 64), "");
    v = LLVMBuildBitCast(e->b, v, LLVMVectorType(i16, 32), "");
    if (b < 8) v = LLVMBuildLShr(e->b, v, LLVMConstVector(sh, 32), "");
    return LLVMBuildAnd(e->b, v, LLVMConstVector(msk, 32), "");
}

static LLVMValueRef pair_codes(E *e, const kvq_page_format *f, LLVMValueRef rows, int rb, int c0)
{
    LLVMValueRef v;
    if (f->bits == 3) {
        LLVMValueRef two[32];
        for (int i = 0; i < 32; i++) two[i] = LLVMConstInt(LLVMInt16TypeInContext(e->c), 2, 0);
        LLVMValueRef lo = pair_plane(e, rows, rb, 0, 2, c0);
        LLVMValueRef hi = pair_plane(e, rows, rb, f->head_dim / 4, 1, c0);
        v = LLVMBuildOr(e->b, lo, LLVMBuildShl(e->b, hi, LLVMConstVector(two, 32), ""), "");
    } else {
        v = pair_plane(e, rows, rb, 0, f->bits, c0);
    }
    return LLVMBuildBitCast(e->b, v, e->vi, "");
}

/* A masked load of n_lanes elements of type ty at p, lanes [0, valid) only (the rest 0): a block of tokens that
 * may run past the tile's last slot, and past its page. */
static LLVMValueRef masked_load(E *e, LLVMTypeRef ty, int n_lanes, LLVMValueRef p, LLVMValueRef valid, int per)
{
    LLVMTypeRef vt = LLVMVectorType(ty, (unsigned)n_lanes);
    LLVMValueRef iota[256];
    for (int i = 0; i < n_lanes; i++) iota[i] = el_ci32(e, i / per);
    LLVMValueRef lim = el_splat_n(e, valid, n_lanes);
    LLVMValueRef mask = LLVMBuildICmp(e->b, LLVMIntSLT, LLVMConstVector(iota, (unsigned)n_lanes), lim, "");
    unsigned id = LLVMLookupIntrinsicID("llvm.masked.load", 16);
    LLVMTypeRef tys[2] = {vt, e->ptr};
    LLVMValueRef f = LLVMGetIntrinsicDeclaration(e->m, id, tys, 2);
    LLVMTypeRef ft = LLVMIntrinsicGetType(e->c, id, tys, 2);
    LLVMValueRef args[4] = {p, el_ci32(e, 1), mask, LLVMConstNull(vt)};
    return LLVMBuildCall2(e->b, ft, f, args, 4, "");
}

/* The int16 weights of the tile's first nbl blocks of 16 tokens (the rest not stored: the pair loop reads no
 * weight past slot n of a tile with n <= 16 nbl) and their scales sw, swl, and sum_t p_t z_tq, per (head, group). */
static void v_weights(E *e, const emit_llvm_kernel *k, LLVMValueRef *a, LLVMValueRef wh, LLVMValueRef wl, int nbl,
                      int int8, LLVMValueRef sw[8][16], LLVMValueRef swl[8][16], LLVMValueRef zsum[8][16])
{
    LLVMBuilderRef b = e->b;
    const kvq_page_format *vf = &k->v.fmt;
    int D = k->head_dim, g = k->gqa, W = 16, N = EMIT_LLVM_TILE, G = vf->group, ngr = D / G;
    int sbytes = vf->scale_bytes, zbytes = vf->zero_bytes;
    LLVMValueRef n = a[A_N];
    LLVMTypeRef v16s = LLVMVectorType(LLVMInt16TypeInContext(e->c), 16);
    /* Weights of 16 tokens per block, every block (masked loads: lanes past n have p = 0 and read nothing). */
    LLVMValueRef wv[8][16][EMIT_LLVM_TILE / 16], wmax[8][16], zs[8][16];
    for (int bl = 0; bl < nbl; bl++) {
        LLVMValueRef valid = LLVMBuildSub(b, n, el_ci32(e, (long)bl * W), "");
        LLVMValueRef off = el_ci64(e, (long)bl * W * ngr);
        LLVMTypeRef st = sbytes == 4 ? e->f32 : e->f16, zt = zbytes == 4 ? e->f32 : e->f16;
        LLVMValueRef sv = masked_load(e, st, W * ngr, el_gep(e, a[A_VS], LLVMBuildMul(b, off, el_ci64(e, sbytes), "")), valid, ngr);
        LLVMValueRef zv = masked_load(e, zt, W * ngr, el_gep(e, a[A_VZ], LLVMBuildMul(b, off, el_ci64(e, zbytes), "")), valid, ngr);
        for (int q = 0; q < ngr; q++) {
            LLVMValueRef idx[16];
            for (int i = 0; i < W; i++) idx[i] = el_ci32(e, i * ngr + q);
            LLVMValueRef s_q = LLVMBuildShuffleVector(b, sv, LLVMGetPoison(LLVMTypeOf(sv)), LLVMConstVector(idx, 16), "");
            LLVMValueRef z_q = LLVMBuildShuffleVector(b, zv, LLVMGetPoison(LLVMTypeOf(zv)), LLVMConstVector(idx, 16), "");
            if (sbytes == 2) s_q = LLVMBuildFPExt(b, s_q, e->vf, "");
            if (zbytes == 2) z_q = LLVMBuildFPExt(b, z_q, e->vf, "");
            for (int j = 0; j < g; j++) {
                /* Masked too: the scratch past the tile's occupied blocks holds whatever an earlier tile left. */
                LLVMValueRef pv = masked_load(e, e->f32, W, el_gepc(e, a[A_P], ((long)j * N + (long)bl * W) * 4), valid, 1);
                LLVMValueRef w = LLVMBuildFMul(b, pv, s_q, "");
                LLVMValueRef fa[1] = {w};
                LLVMValueRef aw = el_call_intrinsic(e, "llvm.fabs", e->vf, fa, 1);
                wv[j][q][bl] = w;
                wmax[j][q] = bl ? el_fmax_sel(e, wmax[j][q], aw) : aw;
                zs[j][q] = bl ? el_fma_sum(e, zs[j][q], pv, z_q) : el_fm(LLVMBuildFMul(b, pv, z_q, ""));
            }
        }
    }
    for (int j = 0; j < g; j++)
        for (int q = 0; q < ngr; q++) {
            LLVMValueRef amax = el_hmax(e, wmax[j][q]);
            LLVMValueRef pos = LLVMBuildFCmp(b, LLVMRealOGT, amax, el_cf(e, 0.0), "");
            zsum[j][q] = el_hsum(e, zs[j][q]);
            if (int8) {
                /* three signed 7-bit pieces (quant_q8's split): w_t = sw (2^14 hi + 2^7 mid + lo) within
                 * max|w| 2^-22 / 1.016; pieces [p][t] at wh + ((j ngr + q) 3 + p) N */
                const double R = 127.0 * 16384.0;
                LLVMValueRef inv = LLVMBuildSelect(b, pos, LLVMBuildFDiv(b, el_cf(e, R), amax, ""), el_cf(e, 0.0), "");
                sw[j][q] = LLVMBuildFDiv(b, amax, el_cf(e, R), "");
                swl[j][q] = NULL;
                LLVMValueRef iv = el_splat(e, inv);
                LLVMTypeRef v16b = LLVMVectorType(e->i8, 16);
                for (int bl = 0; bl < nbl; bl++) {
                    LLVMValueRef ps[3];
                    el_q8_pieces(e, LLVMBuildFMul(b, wv[j][q][bl], iv, ""), ps);
                    for (int pc = 0; pc < 3; pc++) {
                        long o = (((long)j * ngr + q) * 3 + pc) * N + (long)bl * W;
                        el_store(e, LLVMBuildTrunc(b, LLVMBuildFPToSI(b, ps[pc], e->vi, ""), v16b, ""), el_gepc(e, wh, o), 1);
                    }
                }
                continue;
            }
            LLVMValueRef inv = LLVMBuildSelect(b, pos, LLVMBuildFDiv(b, el_cf(e, 32767.0), amax, ""), el_cf(e, 0.0), "");
            sw[j][q] = LLVMBuildFDiv(b, amax, el_cf(e, 32767.0), "");
            swl[j][q] = LLVMBuildFMul(b, sw[j][q], el_cf(e, 1.0 / 32768.0), "");
            LLVMValueRef iv = el_splat(e, inv);
            for (int bl = 0; bl < nbl; bl++) {
                LLVMValueRef x = LLVMBuildFMul(b, wv[j][q][bl], iv, "");
                LLVMValueRef ra[1] = {x};
                LLVMValueRef h = el_call_intrinsic(e, "llvm.rint", e->vf, ra, 1);
                LLVMValueRef la[1] = {LLVMBuildFMul(b, LLVMBuildFSub(b, x, h, ""), el_vfc(e, 32768.0), "")};
                LLVMValueRef l = el_call_intrinsic(e, "llvm.rint", e->vf, la, 1);
                long o = (((long)j * ngr + q) * N + (long)bl * W) * 2;
                el_store(e, LLVMBuildFPToSI(b, h, v16s, ""), el_gepc(e, wh, o), 2);
                el_store(e, LLVMBuildFPToSI(b, l, v16s, ""), el_gepc(e, wl, o), 2);
            }
        }

}

/* The tile's weights (v_weights) of its occupied blocks of 16 tokens only: a tile of at most 32 slots quantises
 * two blocks, of at most 64 four, else all EMIT_LLVM_TILE / 16 (tiles are 128 tokens where pages allow, shorter
 * at the ends of runs and windows). */
static void v_weights_tile(E *e, const emit_llvm_kernel *k, LLVMValueRef *a, LLVMValueRef wh, LLVMValueRef wl,
                           int int8, LLVMValueRef sw[8][16], LLVMValueRef swl[8][16], LLVMValueRef zsum[8][16])
{
    LLVMBuilderRef b = e->b;
    int g = k->gqa, W = 16, N = EMIT_LLVM_TILE, ngr = k->head_dim / k->v.fmt.group;
    enum { NV = 3 };
    int nbl[NV] = {2, 4, N / W}, nv = 0;
    while (nv < NV && (nv == 0 || nbl[nv] > nbl[nv - 1]) && nbl[nv] <= N / W) nv++;
    LLVMValueRef SW[NV][8][16], SWL[NV][8][16], ZS[NV][8][16];
    LLVMBasicBlockRef wb[NV], wj = LLVMAppendBasicBlockInContext(e->c, e->fn, "vw_join");
    for (int h = 0; h < nv; h++) {
        wb[h] = LLVMAppendBasicBlockInContext(e->c, e->fn, "vw");
        if (h + 1 < nv) {
            LLVMBasicBlockRef next = LLVMAppendBasicBlockInContext(e->c, e->fn, "vw_more");
            LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, a[A_N], el_ci32(e, (long)nbl[h] * W), ""), wb[h], next);
            LLVMPositionBuilderAtEnd(b, next);
        } else {
            LLVMBuildBr(b, wb[h]);
        }
    }
    for (int h = 0; h < nv; h++) {
        LLVMPositionBuilderAtEnd(b, wb[h]);
        v_weights(e, k, a, wh, wl, nbl[h], int8, SW[h], SWL[h], ZS[h]);
        wb[h] = LLVMGetInsertBlock(b);
        LLVMBuildBr(b, wj);
    }
    LLVMPositionBuilderAtEnd(b, wj);
    for (int j = 0; j < g; j++)
        for (int q = 0; q < ngr; q++) {
            LLVMValueRef *dst[3] = {&sw[j][q], &swl[j][q], &zsum[j][q]};
            LLVMValueRef(*src[3])[8][16] = {SW, SWL, ZS};
            for (int x = 0; x < 3; x++) {
                if (int8 && x == 1) {
                    *dst[x] = NULL;
                    continue;
                }
                LLVMValueRef in[NV];
                for (int h = 0; h < nv; h++) in[h] = src[x][h][j][q];
                *dst[x] = LLVMBuildPhi(b, e->f32, "");
                LLVMAddIncoming(*dst[x], in, wb, (unsigned)nv);
            }
        }
}

/* The V phase with int16 weights (docs/cpu.md "Accuracy"): per head j and value group q, the tile's weights
 * w_t = p_t s_tq (per-token value scales folded in, as the fp32 path's vfold does) are quantised once per tile
 * as hi/lo int16 pairs relative to their max (the key path's quant_q16), and the token loop takes two tokens
 * per vpdpwssd: sum_t w_t code_tc = sw H_c + swl L_c with exact integer sums H, L. The zero points add
 * sum_t p_t z_tq once per tile. wh, wl: scratch [g][ngr][64] int16. */
static void v_phase_int16(E *e, const emit_llvm_kernel *k, LLVMValueRef *a, LLVMValueRef *alpha_h, LLVMValueRef wh,
                          LLVMValueRef wl)
{
    LLVMBuilderRef b = e->b;
    const kvq_page_format *vf = &k->v.fmt;
    int D = k->head_dim, g = k->gqa, W = 16, NB = D / W, N = EMIT_LLVM_TILE, G = vf->group, ngr = D / G;
    int rb = kvq_code_bytes(D, vf->bits);
    LLVMValueRef n = a[A_N];
    LLVMValueRef sw[8][16], swl[8][16], zsum[8][16];
    v_weights_tile(e, k, a, wh, wl, 0, sw, swl, zsum);

    /* Token pairs, per group of m blocks of 16 channels (2 g m int32 accumulators); an odd last token pairs with
     * a zero row (its partner's weight is 0 anyway: p = 0 past n). */
    int m = 8 / g;
    if (m > NB) m = NB;
    LLVMTypeRef rows_t = LLVMVectorType(e->i8, (unsigned)(2 * rb)), row_t = LLVMVectorType(e->i8, (unsigned)rb);
    for (int b0 = 0; b0 < NB; b0 += m) {
        int b1 = b0 + m < NB ? b0 + m : NB, mm = b1 - b0;
        LLVMValueRef hacc[16], lacc[16], hnext[16], lnext[16];
        LLVMBasicBlockRef pre = LLVMGetInsertBlock(b);
        LLVMBasicBlockRef loop = LLVMAppendBasicBlockInContext(e->c, e->fn, "vpair");
        LLVMBasicBlockRef after = LLVMAppendBasicBlockInContext(e->c, e->fn, "vpair_end");
        LLVMBasicBlockRef odd = LLVMAppendBasicBlockInContext(e->c, e->fn, "vodd");
        LLVMBasicBlockRef done = LLVMAppendBasicBlockInContext(e->c, e->fn, "vdone");
        LLVMValueRef zero_i = el_ci32(e, 0), zero_v = LLVMConstNull(e->vi);
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSGE, n, el_ci32(e, 2), ""), loop, after);
        /* One step: rows t, t+1 (`rows`), weights of pair t. */
#define V_PAIR_STEP(rows, t, hin, lin, hout, lout)                                                                 \
    do {                                                                                                          \
        LLVMValueRef t64_ = LLVMBuildZExt(b, t, e->i64, "");                                                      \
        for (int i = 0; i < mm; i++) {                                                                            \
            int c0 = (b0 + i) * W, q = c0 / G;                                                                    \
            LLVMValueRef cd = pair_codes(e, vf, rows, rb, c0);                                                    \
            for (int j = 0; j < g; j++) {                                                                         \
                LLVMValueRef wo = LLVMBuildAdd(b, LLVMBuildMul(b, t64_, el_ci64(e, 2), ""),                          \
                                               el_ci64(e, (((long)j * ngr + q) * N) * 2), "");                       \
                LLVMValueRef h2 = el_splat(e, el_load(e, e->i32, el_gep(e, wh, wo), 2));                                   \
                LLVMValueRef l2 = el_splat(e, el_load(e, e->i32, el_gep(e, wl, wo), 2));                                   \
                hout[j * mm + i] = el_dpwssd(e, hin[j * mm + i], cd, h2);                                            \
                lout[j * mm + i] = el_dpwssd(e, lin[j * mm + i], cd, l2);                                            \
            }                                                                                                     \
        }                                                                                                         \
    } while (0)
        LLVMPositionBuilderAtEnd(b, loop);
        LLVMValueRef tp = LLVMBuildPhi(b, e->i32, "tp");
        for (int x = 0; x < g * mm; x++) {
            hacc[x] = LLVMBuildPhi(b, e->vi, "");
            lacc[x] = LLVMBuildPhi(b, e->vi, "");
        }
        {
            LLVMValueRef rowp = el_gep(e, a[A_V], LLVMBuildMul(b, LLVMBuildZExt(b, tp, e->i64, ""), el_ci64(e, rb), ""));
            LLVMValueRef rows = el_load(e, rows_t, rowp, 1);
            V_PAIR_STEP(rows, tp, hacc, lacc, hnext, lnext);
        }
        LLVMValueRef tp2 = LLVMBuildAdd(b, tp, el_ci32(e, 2), "");
        LLVMBasicBlockRef loop_last = LLVMGetInsertBlock(b);
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, LLVMBuildAdd(b, tp2, el_ci32(e, 2), ""), n, ""), loop, after);
        LLVMAddIncoming(tp, &zero_i, &pre, 1);
        LLVMAddIncoming(tp, &tp2, &loop_last, 1);
        for (int x = 0; x < g * mm; x++) {
            LLVMAddIncoming(hacc[x], &zero_v, &pre, 1);
            LLVMAddIncoming(hacc[x], &hnext[x], &loop_last, 1);
            LLVMAddIncoming(lacc[x], &zero_v, &pre, 1);
            LLVMAddIncoming(lacc[x], &lnext[x], &loop_last, 1);
        }
        /* after: the pairs' sums; an odd n has one token left. */
        LLVMPositionBuilderAtEnd(b, after);
        LLVMValueRef t_end = LLVMBuildPhi(b, e->i32, "");
        LLVMValueRef ins2[2] = {zero_i, tp2};
        LLVMBasicBlockRef fr2[2] = {pre, loop_last};
        LLVMAddIncoming(t_end, ins2, fr2, 2);
        LLVMValueRef ha[16], la[16], ho[16], lo_[16];
        for (int x = 0; x < g * mm; x++) {
            ha[x] = LLVMBuildPhi(b, e->vi, "");
            la[x] = LLVMBuildPhi(b, e->vi, "");
            LLVMValueRef hi2[2] = {zero_v, hnext[x]}, li2[2] = {zero_v, lnext[x]};
            LLVMAddIncoming(ha[x], hi2, fr2, 2);
            LLVMAddIncoming(la[x], li2, fr2, 2);
        }
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, t_end, n, ""), odd, done);
        LLVMPositionBuilderAtEnd(b, odd);
        {
            LLVMValueRef rowp = el_gep(e, a[A_V], LLVMBuildMul(b, LLVMBuildZExt(b, t_end, e->i64, ""), el_ci64(e, rb), ""));
            LLVMValueRef one = el_load(e, row_t, rowp, 1);
            LLVMValueRef cat[512];
            for (int i = 0; i < 2 * rb; i++) cat[i] = el_ci32(e, i);
            LLVMValueRef rows = LLVMBuildShuffleVector(b, one, LLVMConstNull(row_t), LLVMConstVector(cat, (unsigned)(2 * rb)), "");
            V_PAIR_STEP(rows, t_end, ha, la, ho, lo_);
        }
#undef V_PAIR_STEP
        LLVMBasicBlockRef odd_last = LLVMGetInsertBlock(b);
        LLVMBuildBr(b, done);
        LLVMPositionBuilderAtEnd(b, done);
        for (int j = 0; j < g; j++)
            for (int i = 0; i < mm; i++) {
                int x = j * mm + i, q = (b0 + i) * W / G;
                LLVMValueRef hf = LLVMBuildPhi(b, e->vi, ""), lf = LLVMBuildPhi(b, e->vi, "");
                LLVMValueRef hv2[2] = {ha[x], ho[x]}, lv2[2] = {la[x], lo_[x]};
                LLVMBasicBlockRef fr3[2] = {after, odd_last};
                LLVMAddIncoming(hf, hv2, fr3, 2);
                LLVMAddIncoming(lf, lv2, fr3, 2);
                hacc[x] = hf;
                lacc[x] = lf;
                (void)q;
            }
        for (int j = 0; j < g; j++)
            for (int i = 0; i < mm; i++) {
                int x = j * mm + i, q = (b0 + i) * W / G;
                LLVMValueRef ap = el_gepc(e, a[A_ACC], ((long)j * D + (long)(b0 + i) * W) * 4);
                LLVMValueRef v = LLVMBuildFMul(b, el_load(e, e->vf, ap, 4), alpha_h[j], "");
                v = el_fma_sum(e, v, LLVMBuildSIToFP(b, hacc[x], e->vf, ""), el_splat(e, sw[j][q]));
                v = el_fma_sum(e, v, LLVMBuildSIToFP(b, lacc[x], e->vf, ""), el_splat(e, swl[j][q]));
                v = el_fm(LLVMBuildFAdd(b, v, el_splat(e, zsum[j][q]), ""));
                el_store(e, v, ap, 4);
            }
    }
}

/* The V rows of an int8 P.V: those of the int16 one (v_int16) with 2- or 4-bit codes and head_dim a multiple of
 * 64 up to 256, on a host with AVX-512 VBMI (the rows' byte permute is one vpermt2b per 16 channels). */
static int v_int8(const E *e, const emit_llvm_kernel *k)
{
    int bits = k->v.fmt.bits, D = k->head_dim;
    return v_int16(e, k) && e->int8 && e->vbmi && (bits == 2 || bits == 4) && D % 64 == 0 && D <= 256;
}

/* The V phase with int8 weights (2- and 4-bit codes): four tokens per vpdpbusd (64 MACs: u8 codes x s8 weight pieces, the four products
 * of a dword lane summed), against the int16 path's two per vpdpwssd.
 * - Codes: the rows t..t+3 (v8_rows: 128 bytes, two vectors, or the pass's bytes of each) are permuted (vpermt2b)
 *   so that dword lane c of vector i holds, for each of the four tokens, the byte that holds channel 16 i + c's
 *   code, and masked in place, not shifted: the byte is code << s_c, s_c = b c mod 8 its bit offset (layout.h),
 *   a factor of 2^s_c constant per lane, divided out once per tile (exactly: every term of the lane's sums is a
 *   multiple of it). A byte is at most 3 << 6 or 15 << 4 = 240.
 * - Weights: w_t = p_t s_tq as three signed 7-bit pieces per tile, group and token (v_weights, quant_q8's split):
 *   w_t = sw (2^14 hi + 2^7 mid + lo) within max|w| 2^-22 / 1.016; a piece's four tokens are one broadcast dword.
 * - One accumulator per piece and vector: |sum| <= 128 tokens x 240 x 127 < 2^22, so the three sums convert to
 *   fp32 exactly and combine there, once per tile: sum_t w_t code_tc = sw 2^-s_c (2^14 H + 2^7 M + L).
 * Past the last whole group of four tokens the rows are a masked load (the page may end there); their weights are
 * 0 (p = 0 past n). w8: scratch [ngr][3][64] bytes. */
/* Four V rows from rowp (rb bytes apart) as one byte vector: whole rows (seg == rb) or the seg bytes at `off` of
 * each; with `valid` (rows left, 1..3) the rows past it read nothing and are 0. */
static LLVMValueRef v8_rows(E *e, LLVMValueRef rowp, int rb, int seg, int off, LLVMTypeRef rows_t, LLVMTypeRef seg_t,
                            LLVMValueRef valid)
{
    LLVMBuilderRef b = e->b;
    if (seg == rb) return valid ? masked_load(e, e->i8, 4 * rb, rowp, valid, rb) : el_load(e, rows_t, rowp, 1);
    LLVMValueRef part[4];
    for (int t = 0; t < 4; t++) {
        LLVMValueRef p = el_gepc(e, rowp, (long)t * rb + off);
        if (!valid) {
            part[t] = el_load(e, seg_t, p, 1);
        } else {
            LLVMValueRef on = LLVMBuildICmp(b, LLVMIntSGT, valid, el_ci32(e, t), "");
            part[t] = masked_load(e, e->i8, seg, p, LLVMBuildSelect(b, on, el_ci32(e, 1), el_ci32(e, 0), ""), seg);
        }
    }
    LLVMValueRef idx[256];
    for (int i = 0; i < 2 * seg; i++) idx[i] = el_ci32(e, i);
    LLVMValueRef lo = LLVMBuildShuffleVector(b, part[0], part[1], LLVMConstVector(idx, (unsigned)(2 * seg)), "");
    LLVMValueRef hi = LLVMBuildShuffleVector(b, part[2], part[3], LLVMConstVector(idx, (unsigned)(2 * seg)), "");
    for (int i = 0; i < 4 * seg; i++) idx[i] = el_ci32(e, i);
    return LLVMBuildShuffleVector(b, lo, hi, LLVMConstVector(idx, (unsigned)(4 * seg)), "");
}

static void v_phase_int8(E *e, const emit_llvm_kernel *k, LLVMValueRef *a, LLVMValueRef alpha, LLVMValueRef w8)
{
    LLVMBuilderRef b = e->b;
    const kvq_page_format *vf = &k->v.fmt;
    int D = k->head_dim, W = 16, NB = D / W, N = EMIT_LLVM_TILE, G = vf->group, bits = vf->bits;
    int rb = kvq_code_bytes(D, bits), m = 4; /* vectors a pass: 3 m accumulators, the rows and the weights */
    LLVMValueRef n = a[A_N];
    LLVMValueRef sw[8][16], swl[8][16], zsum[8][16];
    v_weights_tile(e, k, a, w8, NULL, 1, sw, swl, zsum);
    /* The bytes a pass permutes: the four whole rows when they fit two vectors (2-bit codes at head_dim <= 128),
     * else per row the seg bytes of the pass's 64 channels, four loads (4-bit codes, head_dim 256) */
    int whole = 4 * rb <= 128, seg = whole ? rb : 64 * bits / 8;
    LLVMTypeRef rows_t = LLVMVectorType(e->i8, (unsigned)(4 * seg)), seg_t = LLVMVectorType(e->i8, (unsigned)seg);
    LLVMValueRef perm[MAXB], mask[MAXB];
    for (int i = 0; i < NB; i++) {
        LLVMValueRef idx[64], mk[64];
        for (int c = 0; c < 16; c++)
            for (int t = 0; t < 4; t++) {
                int ch = 16 * i + c, byte = ch * bits / 8 - (whole ? 0 : (i / m) * seg);
                idx[4 * c + t] = el_ci32(e, (long)t * seg + byte);
                mk[4 * c + t] = LLVMConstInt(e->i8, (unsigned long long)(((1 << bits) - 1) << (ch * bits % 8)), 0);
            }
        perm[i] = LLVMConstVector(idx, 64);
        mask[i] = LLVMConstVector(mk, 64);
    }
    LLVMValueRef zero_i = el_ci32(e, 0), zero_v = LLVMConstNull(e->vi);
    for (int b0 = 0; b0 < NB; b0 += m) {
        int mm = b0 + m < NB ? m : NB - b0;
        LLVMBasicBlockRef pre = LLVMGetInsertBlock(b);
        LLVMBasicBlockRef loop = LLVMAppendBasicBlockInContext(e->c, e->fn, "v8loop");
        LLVMBasicBlockRef after = LLVMAppendBasicBlockInContext(e->c, e->fn, "v8after");
        LLVMBasicBlockRef tail = LLVMAppendBasicBlockInContext(e->c, e->fn, "v8tail");
        LLVMBasicBlockRef done = LLVMAppendBasicBlockInContext(e->c, e->fn, "v8done");
        /* One group: rows of tokens t..t+3 into the 3 mm accumulators. */
#define V8_STEP(rows, t, in, out)                                                                                   \
    do {                                                                                                           \
        LLVMValueRef t64_ = LLVMBuildZExt(b, t, e->i64, "");                                                       \
        for (int i = 0; i < mm; i++) {                                                                             \
            LLVMValueRef cd = LLVMBuildShuffleVector(b, rows, LLVMGetPoison(rows_t), perm[b0 + i], "");            \
            cd = LLVMBuildBitCast(b, LLVMBuildAnd(b, cd, mask[b0 + i], ""), e->vi, "");                            \
            int q = (b0 + i) * W / G;                                                                              \
            for (int pc = 0; pc < 3; pc++) {                                                                       \
                LLVMValueRef wp = el_gep(e, w8, LLVMBuildAdd(b, t64_, el_ci64(e, ((long)q * 3 + pc) * N), ""));          \
                out[pc * m + i] = el_dpbusd(e, in[pc * m + i], cd, el_splat(e, el_load(e, e->i32, wp, 1)));                 \
            }                                                                                                      \
        }                                                                                                          \
    } while (0)
        LLVMValueRef acc[3 * 4], nxt[3 * 4], acc2[3 * 4], fin[3 * 4];
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSGE, n, el_ci32(e, 4), ""), loop, after);
        LLVMPositionBuilderAtEnd(b, loop);
        LLVMValueRef t = LLVMBuildPhi(b, e->i32, "t");
        for (int x = 0; x < 3 * mm; x++) acc[x / mm * m + x % mm] = LLVMBuildPhi(b, e->vi, "");
        {
            LLVMValueRef rowp = el_gep(e, a[A_V], LLVMBuildMul(b, LLVMBuildZExt(b, t, e->i64, ""), el_ci64(e, rb), ""));
            LLVMValueRef rows = v8_rows(e, rowp, rb, seg, whole ? 0 : (b0 / m) * seg, rows_t, seg_t, NULL);
            V8_STEP(rows, t, acc, nxt);
        }
        LLVMValueRef t4 = LLVMBuildAdd(b, t, el_ci32(e, 4), "");
        LLVMBasicBlockRef loop_last = LLVMGetInsertBlock(b);
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, LLVMBuildAdd(b, t4, el_ci32(e, 4), ""), n, ""), loop, after);
        LLVMAddIncoming(t, &zero_i, &pre, 1);
        LLVMAddIncoming(t, &t4, &loop_last, 1);
        for (int x = 0; x < 3 * mm; x++) {
            int y = x / mm * m + x % mm;
            LLVMAddIncoming(acc[y], &zero_v, &pre, 1);
            LLVMAddIncoming(acc[y], &nxt[y], &loop_last, 1);
        }
        /* after: the tokens past the last whole group, if any */
        LLVMPositionBuilderAtEnd(b, after);
        LLVMValueRef t_end = LLVMBuildPhi(b, e->i32, "");
        LLVMValueRef ins2[2] = {zero_i, t4};
        LLVMBasicBlockRef fr2[2] = {pre, loop_last};
        LLVMAddIncoming(t_end, ins2, fr2, 2);
        for (int x = 0; x < 3 * mm; x++) {
            int y = x / mm * m + x % mm;
            acc2[y] = LLVMBuildPhi(b, e->vi, "");
            LLVMValueRef v2[2] = {zero_v, nxt[y]};
            LLVMAddIncoming(acc2[y], v2, fr2, 2);
        }
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, t_end, n, ""), tail, done);
        LLVMPositionBuilderAtEnd(b, tail);
        LLVMValueRef tacc[3 * 4];
        {
            LLVMValueRef rowp = el_gep(e, a[A_V], LLVMBuildMul(b, LLVMBuildZExt(b, t_end, e->i64, ""), el_ci64(e, rb), ""));
            LLVMValueRef rows = v8_rows(e, rowp, rb, seg, whole ? 0 : (b0 / m) * seg, rows_t, seg_t,
                                        LLVMBuildSub(b, n, t_end, ""));
            V8_STEP(rows, t_end, acc2, tacc);
        }
#undef V8_STEP
        LLVMBasicBlockRef tail_last = LLVMGetInsertBlock(b);
        LLVMBuildBr(b, done);
        LLVMPositionBuilderAtEnd(b, done);
        for (int x = 0; x < 3 * mm; x++) {
            int y = x / mm * m + x % mm;
            fin[y] = LLVMBuildPhi(b, e->vi, "");
            LLVMValueRef v2[2] = {acc2[y], tacc[y]};
            LLVMBasicBlockRef f2[2] = {after, tail_last};
            LLVMAddIncoming(fin[y], v2, f2, 2);
        }
        for (int i = 0; i < mm; i++) {
            int c0 = (b0 + i) * W, q = c0 / G;
            LLVMValueRef fac[16];
            for (int c = 0; c < 16; c++) fac[c] = el_cf(e, 1.0 / (double)(1 << ((c0 + c) * bits % 8)));
            LLVMValueRef h = LLVMBuildSIToFP(b, fin[i], e->vf, ""), mi = LLVMBuildSIToFP(b, fin[m + i], e->vf, "");
            LLVMValueRef lo = LLVMBuildSIToFP(b, fin[2 * m + i], e->vf, "");
            LLVMValueRef x = el_fma_sum(e, el_fma_sum(e, lo, mi, el_vfc(e, 128.0)), h, el_vfc(e, 16384.0));
            LLVMValueRef sc = LLVMBuildFMul(b, el_splat(e, sw[0][q]), LLVMConstVector(fac, 16), "");
            LLVMValueRef ap = el_gepc(e, a[A_ACC], (long)c0 * 4);
            LLVMValueRef v = LLVMBuildFMul(b, el_load(e, e->vf, ap, 4), alpha, "");
            v = el_fma_sum(e, v, x, sc);
            v = el_fm(LLVMBuildFAdd(b, v, el_splat(e, zsum[0][q]), ""));
            el_store(e, v, ap, 4);
        }
    }
}

/* ---- fp32 P.V at GQA > 1 with the value scales folded into the weights ---- */

/* Per-token integer values in groups of whole vectors at GQA > 1 (KIVI's values at GQA 4): the scale folds into
 * the weight and the zero point into a sum, as at GQA 1 (DESIGN §6),
 *   sum_t p_jt (z_tq + s_tq code_tc) = sum_t w_jqt code_tc + sum_t p_jt z_tq,   w_jqt = p_jt s_tq,
 * but the weights of the g heads are made once per tile, W tokens per vector (a masked load of the tokens' scales
 * and zeros, a stride shuffle per group, one multiply per head and group), into a scratch [g][ngr][N]; the token
 * loop then does one FMA per head and vector, its weight a broadcast load, and the V row is unpacked once for the
 * g heads with no dequantization. Per token and vector of channels: the unpacking and g FMAs, where the
 * dequantizing loop did the unpacking, the scale and zero loads, a multiply and an add, and g FMAs. */
static int v_wfold(const E *e, const emit_llvm_kernel *k)
{
    const kvq_page_format *f = &k->v.fmt;
    if (k->gqa == 1 || k->v.fp16 || !el_fmt_int(f) || f->gran != KVQ_GRAN_TOKEN || f->hidden ||
        f->channel_separable || f->group % e->W)
        return 0;
    int ngr = k->head_dim / f->group;
    return (f->scale_bytes == 2 || f->scale_bytes == 4) && (f->zero_bytes == 2 || f->zero_bytes == 4) &&
           k->gqa * ngr <= 64;
}

/* The weights w_jqt of the tile's tokens into wf ([g][ngr][N] fp32) and zs[j][q] = sum_t p_jt z_tq. p is 0 past
 * n in every block of W lanes the softmax ran (blocks bl W < n), and the masked loads read no scale past n. */
static void v_wfold_weights(E *e, const emit_llvm_kernel *k, LLVMValueRef *a, LLVMValueRef wf, LLVMValueRef zs[MAXG][16])
{
    LLVMBuilderRef b = e->b;
    const kvq_page_format *vf = &k->v.fmt;
    int g = k->gqa, W = e->W, N = EMIT_LLVM_TILE, ngr = k->head_dim / vf->group;
    LLVMValueRef n = a[A_N], zero_i = el_ci32(e, 0);
    LLVMTypeRef st = vf->scale_bytes == 4 ? e->f32 : e->f16, zt = vf->zero_bytes == 4 ? e->f32 : e->f16;
    LLVMBasicBlockRef pre = LLVMGetInsertBlock(b);
    LLVMBasicBlockRef loop = LLVMAppendBasicBlockInContext(e->c, e->fn, "vwloop");
    LLVMBasicBlockRef done = LLVMAppendBasicBlockInContext(e->c, e->fn, "vwdone");
    LLVMBuildBr(b, loop);
    LLVMPositionBuilderAtEnd(b, loop);
    LLVMValueRef t0 = LLVMBuildPhi(b, e->i32, "t0"), zacc[MAXG * 16], zacc1[MAXG * 16];
    for (int x = 0; x < g * ngr; x++) zacc[x] = LLVMBuildPhi(b, e->vf, "");
    LLVMValueRef t64 = LLVMBuildZExt(b, t0, e->i64, ""), valid = LLVMBuildSub(b, n, t0, "");
    LLVMValueRef off = LLVMBuildMul(b, t64, el_ci64(e, ngr), "");
    LLVMValueRef sv = masked_load(e, st, W * ngr, el_gep(e, a[A_VS], LLVMBuildMul(b, off, el_ci64(e, vf->scale_bytes), "")),
                                  valid, ngr);
    LLVMValueRef zv = masked_load(e, zt, W * ngr, el_gep(e, a[A_VZ], LLVMBuildMul(b, off, el_ci64(e, vf->zero_bytes), "")),
                                  valid, ngr);
    LLVMTypeRef fv = LLVMVectorType(e->f32, (unsigned)(W * ngr));
    if (st != e->f32) sv = LLVMBuildFPExt(b, sv, fv, "");
    if (zt != e->f32) zv = LLVMBuildFPExt(b, zv, fv, "");
    LLVMValueRef sq[16], zq[16];
    for (int q = 0; q < ngr; q++) {
        LLVMValueRef idx[16];
        for (int i = 0; i < W; i++) idx[i] = el_ci32(e, (long)i * ngr + q);
        sq[q] = ngr == 1 ? sv : LLVMBuildShuffleVector(b, sv, LLVMGetPoison(fv), LLVMConstVector(idx, (unsigned)W), "");
        zq[q] = ngr == 1 ? zv : LLVMBuildShuffleVector(b, zv, LLVMGetPoison(fv), LLVMConstVector(idx, (unsigned)W), "");
    }
    for (int j = 0; j < g; j++) {
        LLVMValueRef pj = el_load(e, e->vf, el_gep(e, a[A_P], LLVMBuildMul(b, LLVMBuildAdd(b, t64, el_ci64(e, (long)j * N), ""),
                                                                     el_ci64(e, 4), "")), 4);
        for (int q = 0; q < ngr; q++) {
            LLVMValueRef w = LLVMBuildFMul(b, pj, sq[q], "");
            LLVMValueRef wo = LLVMBuildAdd(b, t64, el_ci64(e, (long)(j * ngr + q) * N), "");
            el_store(e, w, el_gep(e, wf, LLVMBuildMul(b, wo, el_ci64(e, 4), "")), 4);
            zacc1[j * ngr + q] = el_fma_sum(e, zacc[j * ngr + q], pj, zq[q]);
        }
    }
    LLVMValueRef t1 = LLVMBuildAdd(b, t0, el_ci32(e, W), "");
    LLVMBasicBlockRef last = LLVMGetInsertBlock(b);
    LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, t1, n, ""), loop, done);
    LLVMAddIncoming(t0, &zero_i, &pre, 1);
    LLVMAddIncoming(t0, &t1, &last, 1);
    LLVMValueRef vzero = LLVMConstNull(e->vf);
    for (int x = 0; x < g * ngr; x++) {
        LLVMAddIncoming(zacc[x], &vzero, &pre, 1);
        LLVMAddIncoming(zacc[x], &zacc1[x], &last, 1);
    }
    LLVMPositionBuilderAtEnd(b, done);
    for (int j = 0; j < g; j++)
        for (int q = 0; q < ngr; q++) zs[j][q] = el_hsum(e, zacc1[j * ngr + q]);
}

/* Lanes c0..c0+W-1 of a b-bit plane (b in 1, 2, 4, 8) with each code kept in place: lane c is code_c 2^((c b) mod
 * 32), as a float (exact: at most 8 significant bits below 2^32). The words covering the lanes are loaded once
 * and spread (el_unpack_plane without its shift). */
static LLVMValueRef codes_in_place(E *e, LLVMValueRef row, int b, int c0)
{
    int W = e->W, first = (c0 * b) / 32, nw = ((c0 + W - 1) * b) / 32 - first + 1;
    LLVMValueRef idx[16], msk[16], words, wp = el_gepc(e, row, (long)first * 4);
    for (int i = 0; i < W; i++) {
        idx[i] = el_ci32(e, ((c0 + i) * b) / 32 - first);
        msk[i] = el_ci32(e, (long)(((1ull << b) - 1) << (((c0 + i) * b) % 32)));
    }
    if (nw == 1) {
        words = el_splat(e, el_load(e, e->i32, wp, 1));
    } else {
        LLVMTypeRef wt = LLVMVectorType(e->i32, (unsigned)nw);
        words = LLVMBuildShuffleVector(e->b, el_load(e, wt, wp, 1), LLVMGetPoison(wt), LLVMConstVector(idx, (unsigned)W), "");
    }
    return LLVMBuildUIToFP(e->b, LLVMBuildAnd(e->b, words, LLVMConstVector(msk, (unsigned)W), ""), e->vf, "");
}

/* The token loop of v_wfold: per pass of nb vectors of channels, g x nb accumulators in registers. Codes of 1, 2,
 * 4 or 8 bits stay in place (codes_in_place: one AND and a conversion, no shift), the factors 2^-(b c mod 32) of
 * the sums applied once per tile (a power of two: the same products). */
static void v_phase_wfold(E *e, const emit_llvm_kernel *k, LLVMValueRef *a, LLVMValueRef *alpha_h, LLVMValueRef wf)
{
    LLVMBuilderRef b = e->b;
    const kvq_page_format *vf = &k->v.fmt;
    int D = k->head_dim, g = k->gqa, W = e->W, NB = D / W, N = EMIT_LLVM_TILE, G = vf->group, ngr = D / G;
    long rb = kvq_code_bytes(D, vf->bits);
    LLVMValueRef n = a[A_N], zero_i = el_ci32(e, 0), zs[MAXG][16];
    int inplace = vf->bits == 1 || vf->bits == 2 || vf->bits == 4 || vf->bits == 8;
    v_wfold_weights(e, k, a, wf, zs);
    int nb = 16 / g;
    if (nb < 1) nb = 1;
    if (nb > NB) nb = NB;
    for (int b0 = 0; b0 < NB; b0 += nb) {
        int m = b0 + nb < NB ? nb : NB - b0;
        LLVMBasicBlockRef pre = LLVMGetInsertBlock(b);
        LLVMBasicBlockRef loop = LLVMAppendBasicBlockInContext(e->c, e->fn, "vwfloop");
        LLVMBasicBlockRef end = LLVMAppendBasicBlockInContext(e->c, e->fn, "vwfend");
        LLVMValueRef acc0[MAXG * 16], acc[MAXG * 16], acc1[MAXG * 16];
        for (int j = 0; j < g; j++)
            for (int i = 0; i < m; i++)
                acc0[j * m + i] = LLVMBuildFMul(
                    b, el_load(e, e->vf, el_gepc(e, a[A_ACC], ((long)j * D + (long)(b0 + i) * W) * 4), 4), alpha_h[j], "");
        LLVMBuildBr(b, loop);
        LLVMPositionBuilderAtEnd(b, loop);
        LLVMValueRef t = LLVMBuildPhi(b, e->i32, "t");
        for (int x = 0; x < g * m; x++) acc[x] = LLVMBuildPhi(b, e->vf, "");
        LLVMValueRef t64 = LLVMBuildZExt(b, t, e->i64, "");
        LLVMValueRef row = el_gep(e, a[A_V], LLVMBuildMul(b, t64, el_ci64(e, rb), ""));
        LLVMValueRef t4 = LLVMBuildMul(b, t64, el_ci64(e, 4), "");
        for (int i = 0; i < m; i++) {
            int q = (b0 + i) * W / G;
            LLVMValueRef code = inplace ? codes_in_place(e, row, vf->bits, (b0 + i) * W) : el_codes_f32(e, vf, row, (b0 + i) * W);
            for (int j = 0; j < g; j++) {
                LLVMValueRef wp = el_gep(e, el_gepc(e, wf, (long)(j * ngr + q) * N * 4), t4);
                acc1[j * m + i] = el_fma_sum(e, acc[j * m + i], el_splat(e, el_load(e, e->f32, wp, 4)), code);
            }
        }
        LLVMValueRef t1 = LLVMBuildAdd(b, t, el_ci32(e, 1), "");
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, t1, n, ""), loop, end);
        LLVMAddIncoming(t, &zero_i, &pre, 1);
        LLVMAddIncoming(t, &t1, &loop, 1);
        for (int x = 0; x < g * m; x++) {
            LLVMValueRef a0 = inplace ? LLVMConstNull(e->vf) : acc0[x];
            LLVMAddIncoming(acc[x], &a0, &pre, 1);
            LLVMAddIncoming(acc[x], &acc1[x], &loop, 1);
        }
        LLVMPositionBuilderAtEnd(b, end);
        for (int j = 0; j < g; j++)
            for (int i = 0; i < m; i++) {
                LLVMValueRef v = acc1[j * m + i];
                if (inplace) { /* the loop's sums are of code 2^(b c mod 32): scale back, add acc e^(m - m') */
                    LLVMValueRef f[16];
                    for (int c = 0; c < W; c++)
                        f[c] = el_cf(e, 1.0 / (double)(1ull << (((b0 + i) * W + c) * vf->bits % 32)));
                    v = el_fma_sum(e, acc0[j * m + i], v, LLVMConstVector(f, (unsigned)W));
                }
                v = el_fm(LLVMBuildFAdd(b, v, el_splat(e, zs[j][(b0 + i) * W / G]), ""));
                el_store(e, v, el_gepc(e, a[A_ACC], ((long)j * D + (long)(b0 + i) * W) * 4), 4);
            }
    }
}

/* The int16 / int8 P.V's weight scratch (emit_llvm_build.h). */
void el_v_scratch(E *e, const emit_llvm_kernel *k, LLVMValueRef *wh, LLVMValueRef *wl)
{
    LLVMBuilderRef b = e->b;
    int D = k->head_dim, g = k->gqa;
    int vq = v_int16(e, k), v8 = v_int8(e, k);
    *wh = *wl = NULL;
    if (v8) {
        *wh = LLVMBuildAlloca(b, LLVMArrayType(e->i8, (unsigned)(3 * (D / k->v.fmt.group) * EMIT_LLVM_TILE)), "w8");
        LLVMSetAlignment(*wh, 64);
    } else if (vq) {
        LLVMTypeRef at = LLVMArrayType(LLVMInt16TypeInContext(e->c),
                                       (unsigned)(g * (D / k->v.fmt.group) * EMIT_LLVM_TILE));
        *wh = LLVMBuildAlloca(b, at, "wh");
        *wl = LLVMBuildAlloca(b, at, "wl");
        LLVMSetAlignment(*wh, 64);
        LLVMSetAlignment(*wl, 64);
    } else if (v_wfold(e, k)) {
        *wh = LLVMBuildAlloca(b, LLVMArrayType(e->f32, (unsigned)(g * (D / k->v.fmt.group) * EMIT_LLVM_TILE)), "wf");
        LLVMSetAlignment(*wh, 64);
    }
}

/* The V phase (emit_llvm_build.h): the int8 or int16 P.V where they apply, else fp32. */
void el_v_phase(E *e, const emit_llvm_kernel *k, LLVMValueRef *a, LLVMValueRef *alpha_h, LLVMValueRef vq_wh,
                LLVMValueRef vq_wl)
{
    int D = k->head_dim, g = k->gqa, W = e->W, NB = D / W, N = EMIT_LLVM_TILE;
    LLVMBuilderRef b = e->b;
    LLVMValueRef n = a[A_N], zero_i = el_ci32(e, 0);
    int vq = v_int16(e, k), v8 = v_int8(e, k);
    if (v8) {
        v_phase_int8(e, k, a, alpha_h[0], vq_wh);
        return;
    }
    if (vq) {
        v_phase_int16(e, k, a, alpha_h, vq_wh, vq_wl);
        return;
    }
    if (v_wfold(e, k)) {
        v_phase_wfold(e, k, a, alpha_h, vq_wh);
        return;
    }

    /* V phase: per group of blocks of W channels, a token loop with the group's g x nb accumulators in registers
     * (at most 16: enough independent FMA chains, and room for the row and the weights in 32 registers). */
    int nb = 16 / g;
    if (nb < 1) nb = 1;
    if (nb > NB) nb = NB;
    /* Per-token values in groups of whole vectors fold their scale into the weight and their zero point into a
     * scalar sum (DESIGN §6): sum_t p_t (z_t + s_t code_t) = sum_t (p_t s_t) code_t + sum_t p_t z_t, one FMA per
     * head and vector instead of a dequantization plus an FMA. */
    const kvq_page_format *vf = &k->v.fmt;
    int vfold = !k->v.fp16 && vf->tq == KVQ_TQ_NONE && vf->gran == KVQ_GRAN_TOKEN && !vf->hidden && !vf->channel_separable &&
                vf->group % W == 0 && g == 1; /* with more heads the per-group scalars cost more than they save */
    int G = vfold ? vf->group : 0, ngr = vfold ? D / G : 0;
    LLVMValueRef vt_scale = vfold && !k->v.fp16 ? el_tensor_scale(e, vf, a[A_VT]) : NULL;
    for (int b0 = 0; b0 < NB; b0 += nb) {
        int b1 = b0 + nb < NB ? b0 + nb : NB, m = b1 - b0;
        int g0 = vfold ? b0 * W / G : 0, g1 = vfold ? ((b1 * W) - 1) / G + 1 : 0, mg = g1 - g0;
        LLVMBasicBlockRef pre = LLVMGetInsertBlock(b);
        LLVMBasicBlockRef vloop = LLVMAppendBasicBlockInContext(e->c, e->fn, "vloop");
        LLVMBasicBlockRef vend = LLVMAppendBasicBlockInContext(e->c, e->fn, "vend");
        LLVMValueRef acc0[MAXG * 16], acc[MAXG * 16], acc1[MAXG * 16];
        LLVMValueRef zacc[8 * 16], zacc1[8 * 16]; /* [j][group] sum_t p_t z_t (vfold) */
        for (int j = 0; j < g; j++)
            for (int i = 0; i < m; i++)
                acc0[j * m + i] = LLVMBuildFMul(
                    b, el_load(e, e->vf, el_gepc(e, a[A_ACC], ((long)j * D + (long)(b0 + i) * W) * 4), 4), alpha_h[j], "");
        LLVMBuildBr(b, vloop);
        LLVMPositionBuilderAtEnd(b, vloop);
        LLVMValueRef tv = LLVMBuildPhi(b, e->i32, "t");
        for (int x = 0; x < g * m; x++) acc[x] = LLVMBuildPhi(b, e->vf, "");
        /* More than one group per block range: the token's mg scales and zeros as one vector each (a load and a
         * conversion instead of mg scalar ones), sum_t p_t z_t as one vector accumulator (g == 1 here). */
        int gvec = vfold && mg > 1 && el_fmt_int(vf);
        LLVMTypeRef gty = LLVMVectorType(e->f32, (unsigned)(mg > 1 ? mg : 1));
        LLVMValueRef zaccv = NULL, zaccv1 = NULL;
        if (gvec) zaccv = LLVMBuildPhi(b, gty, "");
        else
            for (int x = 0; x < g * mg; x++) zacc[x] = LLVMBuildPhi(b, e->f32, "");
        LLVMValueRef tv64 = LLVMBuildZExt(b, tv, e->i64, "");
        LLVMValueRef pw[MAXG], ps[8 * 16];
        for (int j = 0; j < g; j++) {
            LLVMValueRef off = LLVMBuildMul(b, LLVMBuildAdd(b, tv64, el_ci64(e, (long)j * N), ""), el_ci64(e, 4), "");
            LLVMValueRef pj = el_load(e, e->f32, el_gep(e, a[A_P], off), 4);
            pw[j] = el_splat(e, pj);
            if (gvec) {
                LLVMValueRef idx = LLVMBuildAdd(b, LLVMBuildMul(b, tv64, el_ci64(e, ngr), ""), el_ci64(e, g0), "");
                LLVMValueRef sv = el_param_group_vec(e, a[A_VS], idx, mg, vf->scale_bytes);
                LLVMValueRef zv = el_param_group_vec(e, a[A_VZ], idx, mg, vf->zero_bytes);
                LLVMValueRef pg = el_splat_n(e, pj, mg);
                LLVMValueRef psv = LLVMBuildFMul(b, pg, sv, "");
                zaccv1 = el_fma_sum(e, zaccv, pg, zv);
                for (int q = 0; q < mg; q++) ps[q] = el_splat(e, LLVMBuildExtractElement(b, psv, el_ci32(e, q), ""));
            }
            for (int q = 0; q < mg && !gvec; q++) {
                LLVMValueRef idx = LLVMBuildAdd(b, LLVMBuildMul(b, tv64, el_ci64(e, ngr), ""), el_ci64(e, g0 + q), "");
                /* element formats: s T (kvq_format_dequant), and no zero sum where none is stored */
                LLVMValueRef sc = el_fparam_scalar(e, vf, a[A_VS], idx, vf->scale_bytes, 1.0);
                if (kvq_format_has_tensor_scale(vf->format.kind)) sc = LLVMBuildFMul(b, sc, vt_scale, "");
                ps[j * mg + q] = el_splat(e, LLVMBuildFMul(b, pj, sc, ""));
                zacc1[j * mg + q] = vf->zero_bytes
                                        ? el_fma_sum(e, zacc[j * mg + q], pj, el_param_scalar(e, a[A_VZ], idx, vf->zero_bytes))
                                        : zacc[j * mg + q];
            }
        }
        for (int i = 0; i < m; i++) {
            if (vfold) {
                LLVMValueRef row = el_gep(e, a[A_V], LLVMBuildMul(b, tv64, el_ci64(e, (long)kvq_code_bytes(D, vf->bits)), ""));
                LLVMValueRef code = el_codes_f32(e, vf, row, (b0 + i) * W);
                int q = (b0 + i) * W / G - g0;
                for (int j = 0; j < g; j++) acc1[j * m + i] = el_fma_sum(e, acc[j * m + i], ps[j * mg + q], code);
            } else {
                LLVMValueRef vv = el_row_f32(e, &k->v, D, a[A_V], a[A_VS], a[A_VZ], a[A_VF], a[A_VT], tv, (b0 + i) * W);
                for (int j = 0; j < g; j++) acc1[j * m + i] = el_fma_sum(e, acc[j * m + i], pw[j], vv);
            }
        }
        LLVMValueRef tv1 = LLVMBuildAdd(b, tv, el_ci32(e, 1), "");
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, tv1, n, ""), vloop, vend);
        LLVMAddIncoming(tv, &zero_i, &pre, 1);
        LLVMAddIncoming(tv, &tv1, &vloop, 1);
        LLVMValueRef fzero = el_cf(e, 0.0);
        for (int x = 0; x < g * m; x++) {
            LLVMAddIncoming(acc[x], &acc0[x], &pre, 1);
            LLVMAddIncoming(acc[x], &acc1[x], &vloop, 1);
        }
        if (gvec) {
            LLVMValueRef vzero = LLVMConstNull(gty);
            LLVMAddIncoming(zaccv, &vzero, &pre, 1);
            LLVMAddIncoming(zaccv, &zaccv1, &vloop, 1);
        } else {
            for (int x = 0; x < g * mg; x++) {
                LLVMAddIncoming(zacc[x], &fzero, &pre, 1);
                LLVMAddIncoming(zacc[x], &zacc1[x], &vloop, 1);
            }
        }
        LLVMPositionBuilderAtEnd(b, vend);
        if (gvec)
            for (int q = 0; q < mg; q++) zacc1[q] = LLVMBuildExtractElement(b, zaccv1, el_ci32(e, q), "");
        for (int j = 0; j < g; j++)
            for (int i = 0; i < m; i++) {
                LLVMValueRef v = acc1[j * m + i];
                if (vfold) v = el_fm(LLVMBuildFAdd(b, v, el_splat(e, zacc1[j * mg + (b0 + i) * W / G - g0]), ""));
                el_store(e, v, el_gepc(e, a[A_ACC], ((long)j * D + (long)(b0 + i) * W) * 4), 4);
            }
    }
}

#endif
