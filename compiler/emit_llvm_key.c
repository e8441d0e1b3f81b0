/* The K phase of the cpu backend's tile kernels (emit_llvm_build.h, docs/cpu.md "The kernel"): per key page of
 * the tile, q folded with the page's per-channel scales and zeros, the logits of blocks of tokens through one
 * reduction tree (fp32, or int16 / int8 pieces with AVX-512 VNNI at GQA 1), the tokens past the last block one at
 * a time, masked slots at -inf, and the tile's max per query head. */
#include "quant.h"

#ifdef KVQ_HAVE_LLVM
#include "emit_llvm_build.h"
#include "emit_llvm_turboquant.h"

/* What the K phase of a kernel knows once per tile. */
typedef struct {
    const emit_llvm_kernel *k;
    LLVMValueRef *a;      /* the argument fields */
    int fold, vn, v8, g2, P; /* folded keys; int16 path; int8 path (2-bit, within vn); g rounded up to a power of
                              * two; partial sums per head */
    LLVMValueRef qv[MAXG][MAXB];                               /* q (times s when folded), fp32 */
    LLVMValueRef qhi[MAXG][MAXB / 4], qlo[MAXG][MAXB / 4];     /* vn: q' as int16 pairs per 32 channels */
    LLVMValueRef sq[MAXG], sql[MAXG];                          /* vn: their scales */
    LLVMValueRef qa[MAXG][3], qb[MAXG][3];                     /* v8: q' as three byte pieces (quant_q8) */
    int qjl;                                                   /* TurboQuant prod keys: the QJL term */
    LLVMValueRef jq[MAXG][MAXB];                               /* qjl: sqrt(pi/2)/m S q, per head (A_SQ) */
} KPhase;

/* One token t (i32) of the K phase for all g heads: per head either an fp32 vector whose lane sum is the dot
 * product (dv), or (vn) the int32 vectors whose lane sums are H and L (hv, lv; q'.k = sq H + sql L). The codes of
 * the row are unpacked once and serve every head. row: the token's code row when the caller has its address (a
 * block's rows at constant offsets from one base), else NULL. */
static void k_token(E *e, const KPhase *kp, LLVMValueRef t, LLVMValueRef row, LLVMValueRef *dv, LLVMValueRef *hv,
                    LLVMValueRef *lv)
{
    const emit_llvm_kernel *k = kp->k;
    int D = k->head_dim, g = k->gqa, W = e->W, NB = D / W, P = kp->P;
    LLVMBuilderRef b = e->b;
    LLVMValueRef *a = kp->a;
    LLVMValueRef t64 = LLVMBuildZExt(b, t, e->i64, "");
    if (!row && (kp->v8 || kp->vn || kp->fold))
        row = el_gep(e, a[A_K], LLVMBuildMul(b, t64, el_ci64(e, (long)kvq_code_bytes(D, k->k.fmt.bits)), ""));
    if (kp->v8) {
        LLVMValueRef A, B;
        el_codes8(e, row, &A, &B);
        for (int j = 0; j < g; j++) {
            /* 2^14 H + 2^7 M + L = ((H << 7) + M << 7) + L, exact (quant_q8): Horner's rule through the
             * accumulators, so that each piece's pair starts from the shifted sum of the pieces above it instead
             * of a zeroed register and an add */
            LLVMValueRef x = NULL;
            for (int p = 0; p < 3; p++) {
                LLVMValueRef acc0 = p ? LLVMBuildShl(b, x, el_vic(e, 7), "") : LLVMConstNull(e->vi);
                x = el_dpbusd(e, el_dpbusd(e, acc0, A, kp->qa[j][p]), B, kp->qb[j][p]);
            }
            hv[j] = x;
        }
        return;
    }
    if (kp->vn) {
        for (int u = 0; u < D / 32; u++) {
            LLVMValueRef c = el_codes16(e, &k->k.fmt, row, 32 * u);
            for (int j = 0; j < g; j++) {
                hv[j] = el_dpwssd(e, u ? hv[j] : LLVMConstNull(e->vi), c, kp->qhi[j][u]);
                lv[j] = el_dpwssd(e, u ? lv[j] : LLVMConstNull(e->vi), c, kp->qlo[j][u]);
            }
        }
        return;
    }
    LLVMValueRef part[MAXG][4];
    for (int bl = 0; bl < NB; bl++) {
        LLVMValueRef kv;
        if (kp->fold) {
            kv = el_codes_f32(e, &k->k.fmt, row, bl * W);
        } else {
            kv = el_row_f32(e, &k->k, D, a[A_K], a[A_KS], a[A_KZ], a[A_KF], a[A_KT], t, bl * W);
        }
        for (int j = 0; j < g; j++) {
            LLVMValueRef *pc = &part[j][bl % P];
            *pc = bl >= P ? el_fma_sum(e, *pc, kp->qv[j][bl], kv) : el_fm(LLVMBuildFMul(b, kp->qv[j][bl], kv, ""));
        }
    }
    for (int bl = 0; kp->qjl && bl < NB; bl++) {
        /* TurboQuant Q_prod: + sum_j rnorm_j sqrt(pi/2)/m_j <S_j q_j, sign(S_j r_j)> (Algorithm 2) */
        LLVMValueRef sg = el_gep(e, a[A_KQJL], LLVMBuildMul(b, t64, el_ci64(e, D / 8), ""));
        LLVMValueRef rn = el_gep(e, a[A_KZ], LLVMBuildMul(b, t64, el_ci64(e, k->k.fmt.tq_out ? 8 : 4), ""));
        LLVMValueRef jv = emit_llvm_tq_qjl(b, &k->k.fmt, e->vf, sg, rn, bl * W);
        for (int j = 0; j < g; j++) part[j][bl % P] = el_fma_sum(e, part[j][bl % P], kp->jq[j][bl], jv);
    }
    for (int j = 0; j < g; j++) {
        for (int w = P; w > 1; w = (w + 1) / 2) /* a tree over the partial sums */
            for (int c = 0; c + (w + 1) / 2 < w; c++)
                part[j][c] = el_fm(LLVMBuildFAdd(b, part[j][c], part[j][c + (w + 1) / 2], ""));
        dv[j] = part[j][0];
    }
}

/* ---- GQA > 1: blocks of W tokens in the lanes ---- */

/* Per-channel integer keys of 1, 2, 4 or 8 bits at GQA > 1 with 16 lanes: a block of 16 tokens has its tokens in
 * the lanes, so the g heads' logits of the block are g vectors with no reduction at all (the lane-sum tree of
 * the token blocks costs ~15 shuffle-and-add pairs per 16 dot products, and its g x D/W query vectors do not fit
 * the 32 registers at GQA 4: the compiler spilled them). Per 32-bit word column of the block's 16 code rows
 * (one transposition: the rows are one 16 rb-byte load), per channel c of the word: its code kept in place by
 * one AND (code 2^(b i), i = c mod 32/b: exact in fp32), one conversion, and g FMAs against the broadcast
 * q''_jc = q'_jc 2^-(b i) from a scratch (a power-of-two scaling: the same products, the same roundings).
 * D/W x (AND, conversion) + D g FMAs per 16 tokens: 16 + 8 g instructions a token where the tree path takes
 * ~32 + 8 g + ~10 and the spills. Up to 16 heads (g accumulators, or 8 / g partial sums each, in registers). */
static int k_lanes(const E *e, const emit_llvm_kernel *k)
{
    int b = k->k.fmt.bits;
    if (!el_src_fold(&k->k) || k->gqa == 1 || k->gqa > 16 || e->W != 16 || k->k.fmt.masked ||
        (b != 1 && b != 2 && b != 4 && b != 8))
        return 0;
    return 1;
}

/* The block loop of k_lanes over the page's whole blocks of 16 tokens (from the current block; leaves the builder
 * in the block after it with *t_start the first token it did not do): logits to the p scratch, each head's max
 * vector in lmx. */
static void k_lanes_blocks(E *e, const KPhase *kp, LLVMValueRef qs, LLVMValueRef cols, const LLVMValueRef *qz,
                           LLVMValueRef nk, LLVMValueRef *lmx, LLVMValueRef *t_start)
{
    const emit_llvm_kernel *k = kp->k;
    LLVMBuilderRef b = e->b;
    int D = k->head_dim, g = k->gqa, W = 16, NB = D / W, N = EMIT_LLVM_TILE, bits = k->k.fmt.bits;
    int per = 32 / bits, rb = (int)kvq_code_bytes(D, bits), nw = rb / 4; /* channels per word, row bytes, words */
    /* q'' per page: q' times 2^-(b (c mod per)) */
    for (int j = 0; j < g; j++)
        for (int bl = 0; bl < NB; bl++) {
            LLVMValueRef f[16];
            for (int i = 0; i < W; i++) f[i] = el_cf(e, 1.0 / (double)(1ull << (bits * ((bl * W + i) % per))));
            el_store(e, LLVMBuildFMul(b, kp->qv[j][bl], LLVMConstVector(f, 16), ""),
                     el_gepc(e, qs, ((long)j * D + (long)bl * W) * 4), 4);
        }
    LLVMBasicBlockRef kentry = LLVMGetInsertBlock(b);
    LLVMBasicBlockRef blk = LLVMAppendBasicBlockInContext(e->c, e->fn, "klanes");
    LLVMBasicBlockRef end = LLVMAppendBasicBlockInContext(e->c, e->fn, "klanes_end");
    LLVMValueRef zero_i = el_ci32(e, 0), ninf_v = el_vfc(e, -__builtin_inf());
    LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, el_ci32(e, W), nk, ""), blk, end);
    LLVMPositionBuilderAtEnd(b, blk);
    LLVMValueRef t0 = LLVMBuildPhi(b, e->i32, "t0"), mx[MAXG], mx1[MAXG];
    for (int j = 0; j < g; j++) mx[j] = LLVMBuildPhi(b, e->vf, "");
    LLVMValueRef t64 = LLVMBuildZExt(b, t0, e->i64, "");
    LLVMTypeRef rows_t = LLVMVectorType(e->i32, (unsigned)(W * nw));
    LLVMValueRef rows = el_load(e, rows_t, el_gep(e, kp->a[A_K], LLVMBuildMul(b, t64, el_ci64(e, rb), "")), 1);
    /* The transposition: word column kc of the 16 rows to cols[kc] (16 lanes), so that the channel loop below can
     * take its columns by a variable index. */
    for (int kc = 0; kc < nw; kc++) {
        LLVMValueRef idx[16];
        for (int t = 0; t < W; t++) idx[t] = el_ci32(e, (long)t * nw + kc);
        el_store(e, LLVMBuildShuffleVector(b, rows, LLVMGetPoison(rows_t), LLVMConstVector(idx, 16), ""),
                 el_gepc(e, cols, (long)kc * W * 4), 64);
    }
    /* q'' read through a pointer the optimiser cannot see through (an empty asm with a side effect, in the loop):
     * else it hoists the D g loop-invariant broadcasts out of the loop into D g vectors on the stack (per page: D g
     * broadcasts and stores, 64-byte reloads), where each FMA can take its q'' as a 4-byte broadcast operand. */
    LLVMTypeRef pty = LLVMFunctionType(e->ptr, &e->ptr, 1, 0);
    LLVMValueRef launder = LLVMGetInlineAsm(pty, "", 0, "=r,0", 4, 1, 0, LLVMInlineAsmDialectATT, 0);
    LLVMValueRef qsl = LLVMBuildCall2(b, pty, launder, &qs, 1, "");
    /* NP partial sums per head: at least ~4 independent FMA chains */
    int NP = g >= 8 ? 1 : 8 / g > 4 ? 4 : 8 / g;
    /* The channels as a loop over groups of U word columns (U per channels each, U per g FMAs: at least 64, so
     * that the loop's own instructions and the column's load are a few percent): the block's D g FMAs in one
     * basic block made LLVM's instruction selection superlinear in D g (36 s for a module of GQA 8, head_dim
     * 256: docs/cpu.md "Compile time"). per is a multiple of NP, so partial sum c mod NP is i mod NP. */
    int U = 1;
    while (U < nw && (U * per * g < 64 || nw % U)) U++;
    LLVMBasicBlockRef wpre = LLVMGetInsertBlock(b);
    LLVMBasicBlockRef wloop = LLVMAppendBasicBlockInContext(e->c, e->fn, "klanes_w");
    LLVMBasicBlockRef wend = LLVMAppendBasicBlockInContext(e->c, e->fn, "klanes_wend");
    LLVMBuildBr(b, wloop);
    LLVMPositionBuilderAtEnd(b, wloop);
    LLVMValueRef wi = LLVMBuildPhi(b, e->i32, "kc"), acc[MAXG][4], acc1[MAXG][4];
    for (int j = 0; j < g; j++)
        for (int p = 0; p < NP; p++) acc[j][p] = acc1[j][p] = LLVMBuildPhi(b, e->vf, "");
    LLVMValueRef wi64 = LLVMBuildZExt(b, wi, e->i64, "");
    LLVMValueRef colp = el_gep(e, cols, LLVMBuildMul(b, wi64, el_ci64(e, W * 4), ""));
    LLVMValueRef qw = el_gep(e, qsl, LLVMBuildMul(b, wi64, el_ci64(e, (long)per * 4), "")); /* q'' of channel kc per */
    for (int u = 0; u < U; u++) {
        LLVMValueRef col = el_load(e, e->vi, el_gepc(e, colp, (long)u * W * 4), 64);
        for (int i = 0; i < per; i++) {
            LLVMValueRef x = LLVMBuildAnd(b, col, el_vic(e, (long)(((1ull << bits) - 1) << (bits * i))), "");
            LLVMValueRef xf = LLVMBuildUIToFP(b, x, e->vf, "");
            for (int j = 0; j < g; j++) {
                LLVMValueRef qp = el_gepc(e, qw, ((long)j * D + (long)u * per + i) * 4);
                LLVMValueRef qc = el_splat(e, el_load(e, e->f32, qp, 4));
                acc1[j][i % NP] = el_fma_sum(e, acc1[j][i % NP], qc, xf);
            }
        }
    }
    LLVMValueRef wn = LLVMBuildAdd(b, wi, el_ci32(e, U), "");
    LLVMBasicBlockRef wlast = LLVMGetInsertBlock(b);
    LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, wn, el_ci32(e, nw), ""), wloop, wend);
    LLVMAddIncoming(wi, &zero_i, &wpre, 1);
    LLVMAddIncoming(wi, &wn, &wlast, 1);
    LLVMValueRef vzero = LLVMConstNull(e->vf);
    for (int j = 0; j < g; j++)
        for (int p = 0; p < NP; p++) {
            LLVMAddIncoming(acc[j][p], &vzero, &wpre, 1);
            LLVMAddIncoming(acc[j][p], &acc1[j][p], &wlast, 1);
        }
    LLVMPositionBuilderAtEnd(b, wend);
    for (int j = 0; j < g; j++) {
        LLVMValueRef lg = acc1[j][0];
        for (int p = 1; p < NP; p++) lg = el_fm(LLVMBuildFAdd(b, lg, acc1[j][p], ""));
        lg = el_fm(LLVMBuildFAdd(b, lg, el_splat(e, qz[j]), ""));
        LLVMValueRef off = LLVMBuildMul(b, LLVMBuildAdd(b, t64, el_ci64(e, (long)j * N), ""), el_ci64(e, 4), "");
        el_store(e, lg, el_gep(e, kp->a[A_P], off), 4);
        mx1[j] = el_fmax_sel(e, mx[j], lg);
    }
    LLVMValueRef t0n = LLVMBuildAdd(b, t0, el_ci32(e, W), "");
    LLVMBasicBlockRef last = LLVMGetInsertBlock(b);
    LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, LLVMBuildAdd(b, t0n, el_ci32(e, W), ""), nk, ""), blk, end);
    LLVMAddIncoming(t0, &zero_i, &kentry, 1);
    LLVMAddIncoming(t0, &t0n, &last, 1);
    for (int j = 0; j < g; j++) {
        LLVMAddIncoming(mx[j], &ninf_v, &kentry, 1);
        LLVMAddIncoming(mx[j], &mx1[j], &last, 1);
    }
    LLVMPositionBuilderAtEnd(b, end);
    *t_start = LLVMBuildPhi(b, e->i32, "");
    LLVMValueRef ts[2] = {zero_i, t0n};
    LLVMBasicBlockRef fr[2] = {kentry, last};
    LLVMAddIncoming(*t_start, ts, fr, 2);
    for (int j = 0; j < g; j++) {
        lmx[j] = LLVMBuildPhi(b, e->vf, "");
        LLVMValueRef ms[2] = {ninf_v, mx1[j]};
        LLVMAddIncoming(lmx[j], ms, fr, 2);
    }
}

/* The K phase of a tile (emit_llvm_build.h). */
void el_k_phase(E *e, const emit_llvm_kernel *k, LLVMValueRef *a, LLVMValueRef *mtile)
{
    int D = k->head_dim, g = k->gqa, W = e->W, NB = D / W, N = EMIT_LLVM_TILE;
    LLVMBuilderRef b = e->b;
    LLVMValueRef n = a[A_N];
    LLVMBasicBlockRef entry = LLVMGetInsertBlock(b);
    LLVMBasicBlockRef kloop = LLVMAppendBasicBlockInContext(e->c, e->fn, "kloop");
    LLVMBasicBlockRef soft = LLVMAppendBasicBlockInContext(e->c, e->fn, "softmax");

    /* Paged keys (emit_llvm_paged_keys): the K phase below runs once per key page of the tile, each page its own
     * group (scale and zero per channel), on a copy of the arguments (ak) that points at the page, with nk its
     * tokens and its logits stored from slot poff of the scratch; the running max of the pages goes to the
     * softmax, which (with the V phase) runs once per tile. */
    int fold = el_src_fold(&k->k), paged = fold;
    int lanes = k_lanes(e, k);
    LLVMValueRef qs = NULL, cols = NULL; /* lanes: q'' of the page, [g][D] fp32; a block's word columns */
    if (lanes) {
        qs = LLVMBuildAlloca(b, LLVMArrayType(e->f32, (unsigned)(g * D)), "qs");
        LLVMSetAlignment(qs, 64);
        cols = LLVMBuildAlloca(b, LLVMArrayType(e->i32, (unsigned)(W * kvq_code_bytes(D, k->k.fmt.bits) / 4)), "cols");
        LLVMSetAlignment(cols, 64);
    }
    LLVMValueRef ak[A_COUNT], nk = n, pg_i = NULL, pg_off = NULL, pg_max[MAXG];
    for (int i = 0; i < A_COUNT; i++) ak[i] = a[i];
    LLVMBasicBlockRef kpage = NULL, pg_from = entry;
    if (paged) {
        kpage = LLVMAppendBasicBlockInContext(e->c, e->fn, "kpage");
        LLVMBuildBr(b, kpage);
        LLVMPositionBuilderAtEnd(b, kpage);
        pg_i = LLVMBuildPhi(b, e->i32, "pg");
        pg_off = LLVMBuildPhi(b, e->i32, "pgoff");
        for (int j = 0; j < g; j++) pg_max[j] = LLVMBuildPhi(b, e->f32, "pgmax");
        LLVMValueRef zero32 = el_ci32(e, 0), ninf0 = el_cf(e, -__builtin_inf());
        LLVMAddIncoming(pg_i, &zero32, &pg_from, 1);
        LLVMAddIncoming(pg_off, &zero32, &pg_from, 1);
        for (int j = 0; j < g; j++) LLVMAddIncoming(pg_max[j], &ninf0, &pg_from, 1);
        /* emit_llvm_kpage: k, ks, kz, kmask at 0, 8, 16, 24; n, kmbit at 32, 36 */
        LLVMValueRef d = el_gep(e, a[A_KPG], LLVMBuildMul(b, LLVMBuildZExt(b, pg_i, e->i64, ""), el_ci64(e, 40), ""));
        ak[A_K] = el_load(e, e->ptr, d, 8);
        ak[A_KS] = el_load(e, e->ptr, el_gepc(e, d, 8), 8);
        ak[A_KZ] = el_load(e, e->ptr, el_gepc(e, d, 16), 8);
        ak[A_KMASK] = el_load(e, e->ptr, el_gepc(e, d, 24), 8);
        nk = el_load(e, e->i32, el_gepc(e, d, 32), 4);
        ak[A_KMBIT] = el_load(e, e->i32, el_gepc(e, d, 36), 4);
        ak[A_P] = el_gep(e, a[A_P], LLVMBuildMul(b, LLVMBuildZExt(b, pg_off, e->i64, ""), el_ci64(e, 4), ""));
    }
    /* q (and its fold with per-channel scales and zeros) once per tile, or per page of paged keys. */
    LLVMValueRef qv[MAXG][MAXB];
    LLVMValueRef qz[MAXG];
    for (int j = 0; j < g; j++) {
        LLVMValueRef zsum = NULL;
        for (int bl = 0; bl < NB; bl++) {
            LLVMValueRef q = el_load(e, e->vf, el_gepc(e, a[A_Q], ((long)j * D + (long)bl * W) * 4), 4);
            if (fold) {
                LLVMValueRef s = el_param_vec(e, ak[A_KS], bl * W, k->k.fmt.scale_bytes);
                LLVMValueRef z = el_param_vec(e, ak[A_KZ], bl * W, k->k.fmt.zero_bytes);
                zsum = zsum ? el_fma_sum(e, zsum, q, z) : el_fm(LLVMBuildFMul(b, q, z, ""));
                q = LLVMBuildFMul(b, q, s, "");
            }
            qv[j][bl] = q;
        }
        qz[j] = fold ? el_hsum(e, zsum) : NULL;
    }
    /* The K phase's shape. kq: folded keys on a VNNI host take the int16 path (q' as a hi/lo pair of int16
     * vectors per 32 channels, quant_q16). TB: tokens per block; a block's TB x g2 dot products (g2 = g rounded
     * up to a power of two, TB g2 = W) reduce in one tree whose result is a vector of logits, lane t g2 + j for
     * token t and head j: no horizontal sum per token (masked pages take the token loop, one token at a time). */
    KPhase kp = {0};
    kp.k = k;
    kp.a = ak;
    kp.fold = fold;
    kp.vn = e->vnni && fold && W == 16 && g == 1; /* GQA 1 only: see v_int16 */
    /* 2-bit keys at head_dim 128 take int8 pieces (vpdpbusd: 64 MACs, codes unpacked by two shifts and a mask per
     * token); the combined integer sum fits int32 only for 2-bit codes (quant_q8) */
    kp.v8 = kp.vn && e->int8 && k->k.fmt.bits == 2 && D == 128;
    kp.g2 = 1;
    while (kp.g2 < g) kp.g2 *= 2;
    int masked_fmt = !k->k.fp16 && k->k.fmt.masked;
    int TB = !masked_fmt && kp.g2 * 2 <= W ? W / kp.g2 : 1;
    /* Each head's dot product in P interleaved partial sums (blocks b = c mod P), so that the FMA chains are
     * short: an FMA's latency is ~4 cycles and two issue per cycle, so about 8 independent chains keep the
     * units busy (a block of tokens has TB g independent chains already). */
    kp.P = TB > 1 ? 2 : g >= 8 ? 1 : 8 / g;
    if (kp.P > 4) kp.P = 4;
    if (kp.P > NB) kp.P = NB;
    for (int j = 0; j < g; j++)
        for (int bl = 0; bl < NB; bl++) kp.qv[j][bl] = qv[j][bl];
    kp.qjl = !k->k.fp16 && k->k.fmt.tq == KVQ_TQ_PROD;
    for (int j = 0; kp.qjl && j < g; j++)
        for (int bl = 0; bl < NB; bl++)
            kp.jq[j][bl] = el_load(e, e->vf, el_gepc(e, a[A_SQ], ((long)j * D + (long)bl * W) * 4), 4);
    if (kp.v8)
        for (int j = 0; j < g; j++) el_quant_q8(e, qv[j], NB, kp.qa[j], kp.qb[j], &kp.sq[j]);
    else if (kp.vn)
        for (int j = 0; j < g; j++) el_quant_q16(e, qv[j], NB, kp.qhi[j], kp.qlo[j], &kp.sq[j], &kp.sql[j]);

    LLVMValueRef ninf = el_cf(e, -__builtin_inf()), zero_i = el_ci32(e, 0);
    LLVMValueRef mx_next[MAXG];
    LLVMBasicBlockRef kentry = LLVMGetInsertBlock(b), from = kentry;
    LLVMValueRef t_start = zero_i, mxv_fin = NULL;
    LLVMBasicBlockRef kbend = NULL;
    LLVMValueRef lmx[MAXG]; /* lanes: each head's max over the blocks, a vector */
    if (lanes) {
        k_lanes_blocks(e, &kp, qs, cols, qz, nk, lmx, &t_start);
        kbend = LLVMGetInsertBlock(b);
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, t_start, nk, ""), kloop, soft);
        from = kbend;
        TB = W;
    } else if (TB > 1) {
        /* Per-lane constants of a block's logits vector: lane l is head l % g2. */
        LLVMValueRef sqv = LLVMGetPoison(e->vf), sqlv = LLVMGetPoison(e->vf), qzv = LLVMGetPoison(e->vf);
        for (int l = 0; l < W; l++) {
            int j = l % kp.g2 < g ? l % kp.g2 : 0;
            if (kp.vn) sqv = LLVMBuildInsertElement(b, sqv, kp.sq[j], el_ci32(e, l), "");
            if (kp.vn && !kp.v8) sqlv = LLVMBuildInsertElement(b, sqlv, kp.sql[j], el_ci32(e, l), "");
            if (fold) qzv = LLVMBuildInsertElement(b, qzv, qz[j], el_ci32(e, l), "");
        }
        LLVMBasicBlockRef kblk = LLVMAppendBasicBlockInContext(e->c, e->fn, "kblock");
        kbend = LLVMAppendBasicBlockInContext(e->c, e->fn, "kbend");
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, el_ci32(e, TB), nk, ""), kblk, kbend);
        LLVMPositionBuilderAtEnd(b, kblk);
        LLVMValueRef t0 = LLVMBuildPhi(b, e->i32, "t0"), mxv = LLVMBuildPhi(b, e->vf, "");
        sum_tree th = {0}, tl = {0};
        long krb = kvq_code_bytes(D, k->k.fmt.bits);
        LLVMValueRef rbase = fold ? el_gep(e, ak[A_K], LLVMBuildMul(b, LLVMBuildZExt(b, t0, e->i64, ""), el_ci64(e, krb), ""))
                                  : NULL;
        for (int t = 0; t < TB; t++) {
            LLVMValueRef dv[MAXG], hv[MAXG], lv[MAXG];
            k_token(e, &kp, LLVMBuildAdd(b, t0, el_ci32(e, t), ""), fold ? el_gepc(e, rbase, t * krb) : NULL, dv, hv, lv);
            for (int j = 0; j < kp.g2; j++) {
                LLVMValueRef zero = LLVMConstNull(kp.vn ? e->vi : e->vf);
                el_tree_push(e, &th, j < g ? (kp.vn ? hv[j] : dv[j]) : zero);
                if (kp.vn && !kp.v8) el_tree_push(e, &tl, j < g ? lv[j] : zero);
            }
        }
        LLVMValueRef x;
        if (kp.vn) {
            x = LLVMBuildFMul(b, LLVMBuildSIToFP(b, th.v[0], e->vf, ""), sqv, "");
            if (!kp.v8)
                x = el_fm(LLVMBuildFAdd(b, x, el_fm(LLVMBuildFMul(b, LLVMBuildSIToFP(b, tl.v[0], e->vf, ""), sqlv, "")), ""));
        } else {
            x = th.v[0];
        }
        if (fold) x = el_fm(LLVMBuildFAdd(b, x, qzv, ""));
        for (int j = 0; j < g; j++) {
            LLVMValueRef lanes = x;
            if (kp.g2 > 1) {
                LLVMValueRef idx[16];
                for (int t = 0; t < TB; t++) idx[t] = el_ci32(e, t * kp.g2 + j);
                lanes = LLVMBuildShuffleVector(b, x, LLVMGetPoison(e->vf), LLVMConstVector(idx, (unsigned)TB), "");
            }
            LLVMValueRef off = LLVMBuildMul(b, LLVMBuildAdd(b, LLVMBuildZExt(b, t0, e->i64, ""), el_ci64(e, (long)j * N), ""),
                                            el_ci64(e, 4), "");
            el_store(e, lanes, el_gep(e, ak[A_P], off), 4);
        }
        LLVMValueRef mxv1 = el_fmax_sel(e, mxv, x);
        LLVMValueRef t0n = LLVMBuildAdd(b, t0, el_ci32(e, TB), "");
        LLVMBasicBlockRef last = LLVMGetInsertBlock(b);
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, LLVMBuildAdd(b, t0n, el_ci32(e, TB), ""), nk, ""), kblk, kbend);
        LLVMValueRef ninf_v = el_vfc(e, -__builtin_inf());
        LLVMAddIncoming(t0, &zero_i, &kentry, 1);
        LLVMAddIncoming(t0, &t0n, &last, 1);
        LLVMAddIncoming(mxv, &ninf_v, &kentry, 1);
        LLVMAddIncoming(mxv, &mxv1, &last, 1);
        LLVMPositionBuilderAtEnd(b, kbend);
        t_start = LLVMBuildPhi(b, e->i32, "");
        mxv_fin = LLVMBuildPhi(b, e->vf, "");
        LLVMValueRef ts[2] = {zero_i, t0n}, ms[2] = {ninf_v, mxv1};
        LLVMBasicBlockRef fr[2] = {kentry, last};
        LLVMAddIncoming(t_start, ts, fr, 2);
        LLVMAddIncoming(mxv_fin, ms, fr, 2);
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, t_start, nk, ""), kloop, soft);
        from = kbend;
    } else {
        LLVMBuildBr(b, kloop);
    }

    /* The token loop (the tokens after the last whole block, or all of them): logits of one token for all g
     * heads, the running max. */
    LLVMPositionBuilderAtEnd(b, kloop);
    LLVMValueRef t = LLVMBuildPhi(b, e->i32, "t");
    LLVMValueRef mx[MAXG];
    for (int j = 0; j < g; j++) mx[j] = LLVMBuildPhi(b, e->f32, "");
    LLVMValueRef masked = NULL;
    if (masked_fmt) {
        LLVMValueRef bit = LLVMBuildAdd(b, ak[A_KMBIT], t, "");
        LLVMValueRef byte = el_load(e, e->i8, el_gep(e, ak[A_KMASK], LLVMBuildZExt(b, LLVMBuildLShr(b, bit, el_ci32(e, 3), ""),
                                                                             e->i64, "")), 1);
        LLVMValueRef sh = LLVMBuildTrunc(b, LLVMBuildAnd(b, bit, el_ci32(e, 7), ""), e->i8, "");
        LLVMValueRef m1 = LLVMBuildAnd(b, LLVMBuildLShr(b, byte, sh, ""), LLVMConstInt(e->i8, 1, 0), "");
        masked = LLVMBuildICmp(b, LLVMIntNE, m1, LLVMConstInt(e->i8, 0, 0), "");
    }
    LLVMValueRef dv[MAXG], hv[MAXG], lv[MAXG], sums[MAXG], lsums[MAXG];
    k_token(e, &kp, t, NULL, dv, hv, lv);
    el_hsum_many(e, kp.vn ? hv : dv, g, sums);
    if (kp.vn && !kp.v8) el_hsum_many(e, lv, g, lsums);
    LLVMValueRef t64 = LLVMBuildZExt(b, t, e->i64, "");
    for (int j = 0; j < g; j++) {
        LLVMValueRef s = sums[j];
        if (kp.vn) {
            s = LLVMBuildFMul(b, LLVMBuildSIToFP(b, s, e->f32, ""), kp.sq[j], "");
            if (!kp.v8)
                s = el_fm(LLVMBuildFAdd(b, s, el_fm(LLVMBuildFMul(b, LLVMBuildSIToFP(b, lsums[j], e->f32, ""), kp.sql[j], "")), ""));
        }
        if (fold) s = el_fm(LLVMBuildFAdd(b, s, qz[j], ""));
        if (masked) s = LLVMBuildSelect(b, masked, ninf, s, "");
        LLVMValueRef off = LLVMBuildMul(b, LLVMBuildAdd(b, t64, el_ci64(e, (long)j * N), ""), el_ci64(e, 4), "");
        el_store(e, s, el_gep(e, ak[A_P], off), 4);
        mx_next[j] = el_fmax_sel(e, mx[j], s);
    }
    LLVMValueRef t1 = LLVMBuildAdd(b, t, el_ci32(e, 1), "");
    LLVMBasicBlockRef klast = LLVMGetInsertBlock(b);
    LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, t1, nk, ""), kloop, soft);
    LLVMAddIncoming(t, &t_start, &from, 1);
    LLVMAddIncoming(t, &t1, &klast, 1);
    for (int j = 0; j < g; j++) {
        LLVMAddIncoming(mx[j], &ninf, &from, 1);
        LLVMAddIncoming(mx[j], &mx_next[j], &klast, 1);
    }

    /* The tile's max per head: the token loop's and the blocks'. */
    LLVMPositionBuilderAtEnd(b, soft);
    for (int j = 0; j < g; j++) {
        if (TB == 1) {
            mtile[j] = mx_next[j];
            continue;
        }
        LLVMValueRef ph = LLVMBuildPhi(b, e->f32, "");
        LLVMValueRef ins[2] = {ninf, mx_next[j]};
        LLVMBasicBlockRef fr[2] = {kbend, klast};
        LLVMAddIncoming(ph, ins, fr, 2);
        mtile[j] = ph;
    }
    for (int j = 0; j < g && lanes; j++) mtile[j] = el_fmax_sel(e, mtile[j], el_hmax(e, lmx[j]));
    for (int j = 0; j < g && TB > 1 && !lanes; j++) {
        LLVMValueRef idx[16];
        for (int t = 0; t < TB; t++) idx[t] = el_ci32(e, t * kp.g2 + j);
        LLVMValueRef lanes = LLVMBuildShuffleVector(b, mxv_fin, LLVMGetPoison(e->vf), LLVMConstVector(idx, (unsigned)TB), "");
        mtile[j] = el_fmax_sel(e, mtile[j], TB > 1 ? el_hmax(e, lanes) : LLVMBuildExtractElement(b, lanes, el_ci32(e, 0), ""));
    }

    if (paged) {
        /* the next key page, or the softmax with the max over the tile's pages */
        LLVMValueRef pm1[MAXG], pi1 = LLVMBuildAdd(b, pg_i, el_ci32(e, 1), ""), po1 = LLVMBuildAdd(b, pg_off, nk, "");
        for (int j = 0; j < g; j++) pm1[j] = el_fmax_sel(e, pg_max[j], mtile[j]);
        LLVMBasicBlockRef pl = LLVMGetInsertBlock(b), kdone = LLVMAppendBasicBlockInContext(e->c, e->fn, "kdone");
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, pi1, a[A_NKP], ""), kpage, kdone);
        LLVMAddIncoming(pg_i, &pi1, &pl, 1);
        LLVMAddIncoming(pg_off, &po1, &pl, 1);
        for (int j = 0; j < g; j++) {
            LLVMAddIncoming(pg_max[j], &pm1[j], &pl, 1);
            mtile[j] = pm1[j];
        }
        LLVMPositionBuilderAtEnd(b, kdone);
    }
}

#endif
