/* LLVM IR for the cpu backend's decode tiles (emit_llvm.h, docs/cpu.md). One function per (K source, V source)
 * pair, everything known at emission time unrolled or folded: head_dim, GQA ratio g, the vector width W, bits,
 * group sizes, parameter dtypes, the mask. The kernel's three phases:
 *
 *   K: for each token t of the tile, the codes of K row t are unpacked once into D/W vectors and serve all g
 *      query heads. Per-channel keys fold their scale and zero into the query once per tile (DESIGN §6):
 *        q . k = sum_c q_c (z_c + s_c code_c) = sum_c q_c z_c + sum_c (q_c s_c) code_c,
 *      so the token loop multiplies codes by q' = q (.) s. Other formats dequantize the row (z + s * code, the
 *      reference's two roundings) and take the dot product. Tokens run in blocks of W / g2 whose dot products
 *      reduce in one shuffle tree to a vector of logits (no horizontal sum per token). At GQA 1 on an AVX-512
 *      VNNI host the folded dot products run in int16: q' as a hi/lo pair of int16 per tile, vpdpwssd, exact
 *      int32 sums (quant_q16).
 *   softmax: once per tile and query head: the tile's max, e^(s - m') over the tile in vectors, one rescale of
 *      l and acc by e^(m - m').
 *   V: for each block of W channels, a loop over the tile's tokens: the block of V row t is dequantized once
 *      (z + s * code, the per-token parameters broadcast) and accumulated into the g heads' accumulators, kept in
 *      registers across the loop. At GQA 1 with VNNI, per-token value groups run in int16 instead: the tile's
 *      weights p_t s_t as hi/lo int16 pairs, two tokens per vpdpwssd (v_phase_int16).
 *
 * Fast-math flags (reassociation and contraction) are set only on the dot products, the probability sums and
 * the P.V accumulation: sums whose order the reference does not fix either (its double sum is the oracle; fp32
 * reassociation over D <= 256 terms stays within ~1e-6 relative). The dequantization (z + s * code) and the
 * exponential keep IEEE semantics. */
#include "emit_llvm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef KVQ_HAVE_LLVM
#include <llvm-c/Core.h>

#include "emit_llvm_format.h"
#include "emit_llvm_ir.h"
#include "emit_llvm_turboquant.h"
#include "quant.h"

/* ------------------------------------------------------------------------------------------ IR helpers -- */

typedef struct {
    LLVMContextRef c;
    LLVMModuleRef m;
    LLVMBuilderRef b;
    LLVMTypeRef f32, f16, i1, i8, i32, i64, ptr, vf, vi, args_ty;
    int W;
    int vnni; /* AVX-512 VNNI + BW: the folded key dot products in int16 (vpdpwssd) */
    int int8; /* ...and those of 2-bit keys in int8 pieces (vpdpbusd) */
    int vbmi; /* ...and AVX-512 VBMI (vpermt2b): the int8 P.V of 2- and 4-bit values */
    int perm16; /* 16 lanes on AVX-512F: vpermps for a codebook's levels (emit_llvm_format.c) */
    LLVMValueRef fn;
} E;

enum { A_Q, A_ACC, A_ML, A_P, A_K, A_KS, A_KZ, A_KF, A_KMASK, A_V, A_VS, A_VZ, A_VF, A_N, A_KMBIT, A_KPG, A_NKP, A_KT, A_VT,
       A_KQJL, A_SQ, A_COUNT };
static int arg_is_i32(int i) { return i == A_N || i == A_KMBIT || i == A_NKP; }

static LLVMValueRef ci32(E *e, long v) { return LLVMConstInt(e->i32, (unsigned long long)v, 1); }
static LLVMValueRef ci64(E *e, long v) { return LLVMConstInt(e->i64, (unsigned long long)v, 1); }
static LLVMValueRef cf(E *e, double v) { return LLVMConstReal(e->f32, v); }

static LLVMValueRef splat_const(LLVMValueRef s, int W)
{
    LLVMValueRef el[16];
    for (int i = 0; i < W; i++) el[i] = s;
    return LLVMConstVector(el, (unsigned)W);
}
static LLVMValueRef vfc(E *e, double v) { return splat_const(cf(e, v), e->W); }
static LLVMValueRef vic(E *e, long v) { return splat_const(ci32(e, v), e->W); }

/* A scalar broadcast to every lane. */
static LLVMValueRef splat(E *e, LLVMValueRef s)
{
    LLVMTypeRef vt = LLVMVectorType(LLVMTypeOf(s), (unsigned)e->W);
    LLVMValueRef v = LLVMBuildInsertElement(e->b, LLVMGetPoison(vt), s, ci32(e, 0), "");
    LLVMValueRef zeros[16];
    for (int i = 0; i < e->W; i++) zeros[i] = ci32(e, 0);
    return LLVMBuildShuffleVector(e->b, v, LLVMGetPoison(vt), LLVMConstVector(zeros, (unsigned)e->W), "");
}

/* base + off bytes (off an i64 value). */
static LLVMValueRef gep(E *e, LLVMValueRef base, LLVMValueRef off)
{
    return LLVMBuildGEP2(e->b, e->i8, base, &off, 1, "");
}
static LLVMValueRef gepc(E *e, LLVMValueRef base, long off) { return off ? gep(e, base, ci64(e, off)) : base; }

static LLVMValueRef load(E *e, LLVMTypeRef ty, LLVMValueRef p, unsigned align)
{
    LLVMValueRef v = LLVMBuildLoad2(e->b, ty, p, "");
    LLVMSetAlignment(v, align);
    return v;
}
static void store(E *e, LLVMValueRef v, LLVMValueRef p, unsigned align)
{
    LLVMValueRef s = LLVMBuildStore(e->b, v, p);
    LLVMSetAlignment(s, align);
}

static const LLVMFastMathFlags FM_SUM = LLVMFastMathAllowReassoc | LLVMFastMathAllowContract;

static LLVMValueRef fm(LLVMValueRef v)
{
    LLVMSetFastMathFlags(v, FM_SUM);
    return v;
}
/* acc + a * b with contraction allowed (an FMA): only in sums whose order is free. */
static LLVMValueRef fma_sum(E *e, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b)
{
    return fm(LLVMBuildFAdd(e->b, acc, fm(LLVMBuildFMul(e->b, a, b, "")), ""));
}

static LLVMValueRef call_intrinsic(E *e, const char *name, LLVMTypeRef overload, LLVMValueRef *args, unsigned n)
{
    unsigned id = LLVMLookupIntrinsicID(name, strlen(name));
    LLVMTypeRef tys[1] = {overload};
    LLVMValueRef f = LLVMGetIntrinsicDeclaration(e->m, id, tys, 1);
    LLVMTypeRef ft = LLVMIntrinsicGetType(e->c, id, tys, 1);
    return LLVMBuildCall2(e->b, ft, f, args, n, "");
}

static int is_int_vec(LLVMValueRef v)
{
    return LLVMGetTypeKind(LLVMGetElementType(LLVMTypeOf(v))) == LLVMIntegerTypeKind;
}

/* Sum of a vector's lanes (reassociation allowed: the lanes are terms of one dot product; integer sums are
 * exact). */
static LLVMValueRef hsum(E *e, LLVMValueRef v)
{
    if (is_int_vec(v)) {
        LLVMValueRef args[1] = {v};
        return call_intrinsic(e, "llvm.vector.reduce.add", LLVMTypeOf(v), args, 1);
    }
    LLVMValueRef args[2] = {cf(e, -0.0), v};
    return fm(call_intrinsic(e, "llvm.vector.reduce.fadd", e->vf, args, 2));
}

/* (a, b) -> evens(a ++ b) + odds(a ++ b): lanes [0, W/2) hold a's lanes summed in pairs, [W/2, W) b's. */
static LLVMValueRef pair_fold(E *e, LLVMValueRef a, LLVMValueRef b)
{
    LLVMValueRef ev[16], od[16];
    for (int i = 0; i < e->W; i++) {
        ev[i] = ci32(e, 2 * i);
        od[i] = ci32(e, 2 * i + 1);
    }
    LLVMValueRef x = LLVMBuildShuffleVector(e->b, a, b, LLVMConstVector(ev, (unsigned)e->W), "");
    LLVMValueRef y = LLVMBuildShuffleVector(e->b, a, b, LLVMConstVector(od, (unsigned)e->W), "");
    return is_int_vec(a) ? LLVMBuildAdd(e->b, x, y, "") : fm(LLVMBuildFAdd(e->b, x, y, ""));
}

/* The lane sums of g vectors at once (the g heads' dot products of one token): pairs fold into one vector whose
 * segment j (W/g2 lanes) holds head j's partial sums, then the segments fold within themselves; about half the
 * shuffles of g separate reductions. g2 = g rounded up to a power of two (padding with zeros); beyond W heads
 * the reductions are separate. Float or integer vectors. */
static void hsum_many(E *e, LLVMValueRef *v, int g, LLVMValueRef *out)
{
    int g2 = 1;
    while (g2 < g) g2 *= 2;
    if (g2 == 1 || g2 > e->W) {
        for (int j = 0; j < g; j++) out[j] = hsum(e, v[j]);
        return;
    }
    LLVMValueRef cur[64];
    for (int j = 0; j < g2; j++) cur[j] = j < g ? v[j] : LLVMConstNull(LLVMTypeOf(v[0]));
    for (int n = g2; n > 1; n /= 2)
        for (int j = 0; j < n / 2; j++) cur[j] = pair_fold(e, cur[2 * j], cur[2 * j + 1]);
    /* Segment j: lanes [j*S, (j+1)*S), S = W / g2; fold each segment onto its first lane... */
    LLVMValueRef x = cur[0];
    for (int S = e->W / g2; S > 1; S /= 2) x = pair_fold(e, x, x);
    /* ...after which head j's sum is lane j. */
    for (int j = 0; j < g; j++) out[j] = LLVMBuildExtractElement(e->b, x, ci32(e, j), "");
}

/* The same tree fed one vector at a time (W vectors in all, W a power of two): a pair folds as soon as both of
 * its halves exist, so few partial vectors are live while a block of tokens is computed. After the W-th push
 * v[0] is one vector whose lane i is the lane sum of the i-th vector pushed. */
typedef struct {
    LLVMValueRef v[8];
    int lvl[8], n;
} sum_tree;
static void tree_push(E *e, sum_tree *tr, LLVMValueRef x)
{
    tr->v[tr->n] = x;
    tr->lvl[tr->n++] = 0;
    while (tr->n >= 2 && tr->lvl[tr->n - 1] == tr->lvl[tr->n - 2]) {
        tr->v[tr->n - 2] = pair_fold(e, tr->v[tr->n - 2], tr->v[tr->n - 1]);
        tr->lvl[tr->n - 2]++;
        tr->n--;
    }
}

static LLVMValueRef fmax_sel(E *e, LLVMValueRef a, LLVMValueRef b)
{
    return LLVMBuildSelect(e->b, LLVMBuildFCmp(e->b, LLVMRealOGT, a, b, ""), a, b, "");
}

/* The max of a vector's lanes (no NaN among them): a tree of shuffles and vector maxima; llvm.vector.reduce.fmax
 * lowers to a scalar chain with NaN checks per lane. */
static LLVMValueRef hmax(E *e, LLVMValueRef v)
{
    int n = (int)LLVMGetVectorSize(LLVMTypeOf(v));
    for (int h = n / 2; h >= 1; h /= 2) {
        LLVMValueRef idx[64];
        for (int i = 0; i < n; i++) idx[i] = ci32(e, i < h ? i + h : i);
        v = fmax_sel(e, v, LLVMBuildShuffleVector(e->b, v, LLVMGetPoison(LLVMTypeOf(v)), LLVMConstVector(idx, (unsigned)n), ""));
    }
    return LLVMBuildExtractElement(e->b, v, ci32(e, 0), "");
}

/* e^x for x <= 0, lanes below -87.3 (and -inf) give 0: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, and
 * Cephes expf's degree-6 polynomial (relative error ~1e-7), scaled by 2^n built in the exponent bits. */
static LLVMValueRef vexp(E *e, LLVMValueRef x)
{
    LLVMBuilderRef b = e->b;
    LLVMValueRef under = LLVMBuildFCmp(b, LLVMRealOLT, x, vfc(e, -87.3f), "");
    LLVMValueRef xc = LLVMBuildSelect(b, under, vfc(e, -87.0), x, "");
    LLVMValueRef args[1] = {LLVMBuildFMul(b, xc, vfc(e, 1.44269504088896341), "")};
    LLVMValueRef n = call_intrinsic(e, "llvm.rint", e->vf, args, 1);
    LLVMValueRef r = LLVMBuildFSub(b, xc, LLVMBuildFMul(b, n, vfc(e, 0.693359375), ""), "");
    r = LLVMBuildFSub(b, r, LLVMBuildFMul(b, n, vfc(e, -2.12194440e-4), ""), "");
    static const double c[] = {1.9875691500E-4, 1.3981999507E-3, 8.3334519073E-3,
                               4.1665795894E-2, 1.6666665459E-1, 5.0000001201E-1};
    LLVMValueRef p = vfc(e, c[0]);
    for (int i = 1; i < 6; i++) p = LLVMBuildFAdd(b, LLVMBuildFMul(b, p, r, ""), vfc(e, c[i]), "");
    p = LLVMBuildFMul(b, p, LLVMBuildFMul(b, r, r, ""), "");
    p = LLVMBuildFAdd(b, LLVMBuildFAdd(b, p, r, ""), vfc(e, 1.0), "");
    LLVMValueRef ni = LLVMBuildFPToSI(b, n, e->vi, "");
    LLVMValueRef pw = LLVMBuildShl(b, LLVMBuildAdd(b, ni, vic(e, 127), ""), vic(e, 23), "");
    LLVMValueRef res = LLVMBuildFMul(b, p, LLVMBuildBitCast(b, pw, e->vf, ""), "");
    return LLVMBuildSelect(b, under, vfc(e, 0.0), res, "");
}

static LLVMValueRef field(E *e, LLVMValueRef args, int i)
{
    LLVMValueRef p = LLVMBuildStructGEP2(e->b, e->args_ty, args, (unsigned)i, "");
    return load(e, arg_is_i32(i) ? e->i32 : e->ptr, p, arg_is_i32(i) ? 4 : 8);
}

/* ------------------------------------------------------------------------------------ unpack/dequantize -- */

/* Lanes c0..c0+W-1 of a b-bit plane (b in 1, 2, 4, 8) of the row at `row`: layout.h's order, channel c at bits
 * [(c*b) % 32, +b) of 32-bit word (c*b)/32. The words covering the lanes are loaded once and spread. */
static LLVMValueRef unpack_plane(E *e, LLVMValueRef row, int b, int c0)
{
    int W = e->W, first = (c0 * b) / 32, last = ((c0 + W - 1) * b) / 32, nw = last - first + 1;
    LLVMValueRef words;
    LLVMValueRef wp = gepc(e, row, (long)first * 4);
    LLVMValueRef idx[16], sh[16];
    for (int i = 0; i < W; i++) {
        idx[i] = ci32(e, ((c0 + i) * b) / 32 - first);
        sh[i] = ci32(e, ((c0 + i) * b) % 32);
    }
    if (nw == 1) {
        words = splat(e, load(e, e->i32, wp, 1));
    } else {
        LLVMTypeRef wt = LLVMVectorType(e->i32, (unsigned)nw);
        LLVMValueRef w = load(e, wt, wp, 1);
        words = LLVMBuildShuffleVector(e->b, w, LLVMGetPoison(wt), LLVMConstVector(idx, (unsigned)W), "");
    }
    LLVMValueRef v = LLVMBuildLShr(e->b, words, LLVMConstVector(sh, (unsigned)W), "");
    return LLVMBuildAnd(e->b, v, vic(e, (1L << b) - 1), "");
}

/* Codes of lanes c0.. of the row at `row` as i32 lanes. 3- and 5-bit codes are two planes (layout.h): the low
 * two (four) bits, then the high bit as a 1-bit plane. */
static LLVMValueRef codes_int(E *e, const kvq_page_format *f, LLVMValueRef row, int c0)
{
    if (f->bits == 3 || f->bits == 5) {
        int lb = f->bits - 1;
        LLVMValueRef lo = unpack_plane(e, row, lb, c0);
        LLVMValueRef hi = unpack_plane(e, gepc(e, row, (long)f->head_dim * lb / 8), 1, c0);
        return LLVMBuildOr(e->b, lo, LLVMBuildShl(e->b, hi, vic(e, lb), ""), "");
    }
    return unpack_plane(e, row, f->bits, c0);
}

/* The levels L[code] of lanes c0.. (scheme_format.h): the codes as floats for asymmetric integers, else the
 * element format's decode (emit_llvm_format.c). */
static LLVMValueRef codes_f32(E *e, const kvq_page_format *f, LLVMValueRef row, int c0)
{
    return emit_llvm_format_level(e->b, &f->format, f->bits, codes_int(e, f, row, c0), e->perm16);
}

/* Asymmetric integers: the formats the integer fast paths (folds, int16/int8 dot products) are written for. */
static int fmt_int(const kvq_page_format *f) { return f->format.kind == KVQ_FMT_INT; }

/* ---- int16 key dot products (AVX-512 VNNI, docs/cpu.md "Accuracy") ---- */

/* Channels c0..c0+31 of a b-bit plane (b in 1, 2, 4, 8) as 32 16-bit lanes: the 4b bytes covering them are
 * loaded once, byte (i*b)/8 goes to lane i's low byte (one byte permute), then a shift by (i*b)%8 and a mask. */
static LLVMValueRef unpack_plane16(E *e, LLVMValueRef row, int b, int c0)
{
    int nbytes = 4 * b;
    LLVMTypeRef bt = LLVMVectorType(e->i8, (unsigned)nbytes), i16 = LLVMInt16TypeInContext(e->c);
    LLVMTypeRef wt = LLVMVectorType(i16, 32);
    LLVMValueRef bytes = load(e, bt, gepc(e, row, (long)c0 * b / 8), 1);
    LLVMValueRef idx[64], sh[32], msk[32];
    for (int i = 0; i < 32; i++) {
        idx[2 * i] = ci32(e, (i * b) / 8);
        idx[2 * i + 1] = ci32(e, nbytes); /* the high byte: a zero of the second operand */
        sh[i] = LLVMConstInt(i16, (unsigned long long)((i * b) % 8), 0);
        msk[i] = LLVMConstInt(i16, (1ull << b) - 1, 0);
    }
    LLVMValueRef v = LLVMBuildShuffleVector(e->b, bytes, LLVMConstNull(bt), LLVMConstVector(idx, 64), "");
    v = LLVMBuildBitCast(e->b, v, wt, "");
    if (b < 8) {
        v = LLVMBuildLShr(e->b, v, LLVMConstVector(sh, 32), "");
        v = LLVMBuildAnd(e->b, v, LLVMConstVector(msk, 32), "");
    }
    return v;
}

/* Codes of channels c0..c0+31 of the row at `row` as 32 16-bit lanes, viewed as the 16 i32 lanes vpdpwssd
 * takes (lane i = channels c0+2i, c0+2i+1). */
static LLVMValueRef codes16(E *e, const kvq_page_format *f, LLVMValueRef row, int c0)
{
    LLVMValueRef v;
    if (f->bits == 3) {
        LLVMValueRef lo = unpack_plane16(e, row, 2, c0);
        LLVMValueRef hi = unpack_plane16(e, gepc(e, row, f->head_dim / 4), 1, c0);
        LLVMValueRef two[32];
        for (int i = 0; i < 32; i++) two[i] = LLVMConstInt(LLVMInt16TypeInContext(e->c), 2, 0);
        v = LLVMBuildOr(e->b, lo, LLVMBuildShl(e->b, hi, LLVMConstVector(two, 32), ""), "");
    } else {
        v = unpack_plane16(e, row, f->bits, c0);
    }
    return LLVMBuildBitCast(e->b, v, e->vi, "");
}

/* acc + a VNNI dot product of a and b (three <16 x i32>): the intrinsic `name` (not overloaded). */
static LLVMValueRef vnni_dot(E *e, const char *name, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b)
{
    unsigned id = LLVMLookupIntrinsicID(name, strlen(name));
    LLVMValueRef f = LLVMGetIntrinsicDeclaration(e->m, id, NULL, 0);
    LLVMTypeRef ft = LLVMIntrinsicGetType(e->c, id, NULL, 0);
    LLVMValueRef args[3] = {acc, a, b};
    return LLVMBuildCall2(e->b, ft, f, args, 3, "");
}

/* acc + the pairwise products of two vectors of 32 signed 16-bit lanes (vpdpwssd: 32 MACs, exact in int32). */
static LLVMValueRef dpwssd(E *e, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b)
{
    return vnni_dot(e, "llvm.x86.avx512.vpdpwssd.512", acc, a, b);
}

/* Two 16-lane i32 vectors (values in int16 range) as the 32 16-bit lanes of one vector, viewed as 16 i32 lanes. */
static LLVMValueRef pack16(E *e, LLVMValueRef a, LLVMValueRef b)
{
    LLVMValueRef idx[32];
    for (int i = 0; i < 32; i++) idx[i] = ci32(e, i);
    LLVMValueRef v = LLVMBuildShuffleVector(e->b, a, b, LLVMConstVector(idx, 32), "");
    v = LLVMBuildTrunc(e->b, v, LLVMVectorType(LLVMInt16TypeInContext(e->c), 32), "");
    return LLVMBuildBitCast(e->b, v, e->vi, "");
}

/* max |q[i] lane| over nb vectors: what the integer splits of q' scale against. */
static LLVMValueRef abs_max(E *e, LLVMValueRef *q, int nb)
{
    LLVMValueRef mx = NULL;
    for (int i = 0; i < nb; i++) {
        LLVMValueRef a[1] = {q[i]};
        LLVMValueRef ab = call_intrinsic(e, "llvm.fabs", e->vf, a, 1);
        mx = mx ? fmax_sel(e, mx, ab) : ab;
    }
    return hmax(e, mx);
}

/* The folded query q' (nb vectors of 16) as a pair of int16 vectors per 32 channels:
 *   x = q' 32767 / max|q'|,  hi = rint(x),  lo = rint((x - hi) 2^15),  q' ~ sq hi + sql lo,
 * sq = max|q'| / 32767, sql = sq 2^-15. |hi| <= 32767 and |lo| <= 2^14 fit int16; the pair's error is at most
 * sq 2^-16 per channel (plus x's own fp32 rounding, relative 2^-24 of q'), so sum_c q'_c code_c =
 * sq H + sql L with H, L exact integer sums differs from the exact dot product by at most
 * max|q'| 2^-31 sum_c code_c: below the fp32 dot product's own rounding (docs/cpu.md "Accuracy"). */
static void quant_q16(E *e, LLVMValueRef *q, int nb, LLVMValueRef *hi, LLVMValueRef *lo, LLVMValueRef *sq,
                      LLVMValueRef *sql)
{
    LLVMBuilderRef b = e->b;
    LLVMValueRef amax = abs_max(e, q, nb);
    LLVMValueRef pos = LLVMBuildFCmp(b, LLVMRealOGT, amax, cf(e, 0.0), "");
    LLVMValueRef inv = LLVMBuildSelect(b, pos, LLVMBuildFDiv(b, cf(e, 32767.0), amax, ""), cf(e, 0.0), "");
    *sq = LLVMBuildFDiv(b, amax, cf(e, 32767.0), "");
    *sql = LLVMBuildFMul(b, *sq, cf(e, 1.0 / 32768.0), "");
    LLVMValueRef iv = splat(e, inv), h32[16], l32[16];
    for (int i = 0; i < nb; i++) {
        LLVMValueRef x = LLVMBuildFMul(b, q[i], iv, "");
        LLVMValueRef ra[1] = {x};
        LLVMValueRef h = call_intrinsic(e, "llvm.rint", e->vf, ra, 1);
        LLVMValueRef la[1] = {LLVMBuildFMul(b, LLVMBuildFSub(b, x, h, ""), vfc(e, 32768.0), "")};
        LLVMValueRef l = call_intrinsic(e, "llvm.rint", e->vf, la, 1);
        h32[i] = LLVMBuildFPToSI(b, h, e->vi, "");
        l32[i] = LLVMBuildFPToSI(b, l, e->vi, "");
    }
    for (int u = 0; u < nb / 2; u++) {
        hi[u] = pack16(e, h32[2 * u], h32[2 * u + 1]);
        lo[u] = pack16(e, l32[2 * u], l32[2 * u + 1]);
    }
}

/* acc + the products of 64 unsigned bytes (a) and 64 signed bytes (b), four adjacent products to an i32 lane
 * (vpdpbusd: 64 MACs, exact in int32). */
static LLVMValueRef dpbusd(E *e, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b)
{
    return vnni_dot(e, "llvm.x86.avx512.vpdpbusd.512", acc, a, b);
}

/* The int8 key path's byte order: the 2-bit codes of a token (32 bytes, byte j = channels 4j..4j+3, layout.h)
 * become two vectors of 64 unsigned bytes by shifts and a mask, without moving a byte: A = codes of channels 4j
 * (bytes 0..31) and 4j+1 (bytes 32..63), B = channels 4j+2 and 4j+3. The query's pieces are laid out in the same
 * order once per tile, so each vpdpbusd lane multiplies matching channels. */
static int q8_channel(int byte, int vec) { return 4 * (byte % 32) + 2 * vec + byte / 32; }

static void codes8(E *e, LLVMValueRef row, LLVMValueRef *A, LLVMValueRef *B)
{
    LLVMTypeRef b32 = LLVMVectorType(e->i8, 32), b64 = LLVMVectorType(e->i8, 64);
    LLVMTypeRef i16 = LLVMInt16TypeInContext(e->c), w32 = LLVMVectorType(i16, 32);
    LLVMValueRef bytes = load(e, b32, row, 1), idx[64], sa[32], sb[32], m3[64];
    for (int i = 0; i < 64; i++) {
        idx[i] = ci32(e, i % 32);
        m3[i] = LLVMConstInt(e->i8, 3, 0);
    }
    for (int i = 0; i < 32; i++) {
        sa[i] = LLVMConstInt(i16, i < 16 ? 0 : 2, 0); /* 16-bit lanes 0..15 are bytes 0..31 */
        sb[i] = LLVMConstInt(i16, i < 16 ? 4 : 6, 0);
    }
    LLVMValueRef x = LLVMBuildBitCast(e->b, LLVMBuildShuffleVector(e->b, bytes, LLVMGetPoison(b32), LLVMConstVector(idx, 64), ""),
                                      w32, "");
    /* (x >> s) & 3 per byte with 16-bit shifts: s <= 6, so bits s, s+1 of a byte come from that byte */
    LLVMValueRef a = LLVMBuildBitCast(e->b, LLVMBuildLShr(e->b, x, LLVMConstVector(sa, 32), ""), b64, "");
    LLVMValueRef bb = LLVMBuildBitCast(e->b, LLVMBuildLShr(e->b, x, LLVMConstVector(sb, 32), ""), b64, "");
    *A = LLVMBuildBitCast(e->b, LLVMBuildAnd(e->b, a, LLVMConstVector(m3, 64), ""), e->vi, "");
    *B = LLVMBuildBitCast(e->b, LLVMBuildAnd(e->b, bb, LLVMConstVector(m3, 64), ""), e->vi, "");
}

/* x (|x| <= 127 2^14, fp32) rounded to an integer and split exactly into hi 2^14 + mid 2^7 + lo, hi in [-127, 127],
 * mid and lo in [-64, 64] (fp32 vectors holding integers): quant_q8's and the int8 P.V's split. */
static void q8_pieces(E *e, LLVMValueRef xs, LLVMValueRef ps[3])
{
    LLVMBuilderRef b = e->b;
    LLVMValueRef ra[1] = {xs};
    LLVMValueRef x = call_intrinsic(e, "llvm.rint", e->vf, ra, 1);
    LLVMValueRef ha[1] = {LLVMBuildFMul(b, x, vfc(e, 1.0 / 16384.0), "")};
    LLVMValueRef hi = call_intrinsic(e, "llvm.rint", e->vf, ha, 1);
    LLVMValueRef r = LLVMBuildFSub(b, x, LLVMBuildFMul(b, hi, vfc(e, 16384.0), ""), "");
    LLVMValueRef ma[1] = {LLVMBuildFMul(b, r, vfc(e, 1.0 / 128.0), "")};
    LLVMValueRef mid = call_intrinsic(e, "llvm.rint", e->vf, ma, 1);
    ps[0] = hi, ps[1] = mid, ps[2] = LLVMBuildFSub(b, r, LLVMBuildFMul(b, mid, vfc(e, 128.0), ""), "");
}

/* The folded query q' (8 vectors of 16: head_dim 128) as three signed 7-bit pieces in codes8's byte order:
 *   x_c = rint(q'_c / sq), sq = max|q'| / (127 2^14), so |x_c| <= 127 2^14 < 2^21 (exact in fp32);
 *   x = hi 2^14 + mid 2^7 + lo, hi = rint(x 2^-14) in [-127, 127], mid, lo in [-64, 64] (exact).
 * So q'_c = sq x_c within sq / 2 = max|q'| 2^-22 / 1.016, and sum_c q'_c code_c = sq (2^14 H + 2^7 M + L) with H, M,
 * L the exact integer dot products of the pieces (|.| <= 128 3 127 2^14 < 2^31 after the combination: 2-bit
 * codes only). Error per logit at most max|q'| 2^-22 sum_c code_c, against the int16 pair's 2^-31: ~1e-5 of
 * max|q'| at 128 channels, below the 1e-3 the tests hold every path to (docs/cpu.md "Accuracy"). */
static void quant_q8(E *e, LLVMValueRef *q, int nb, LLVMValueRef *qa, LLVMValueRef *qb, LLVMValueRef *sq)
{
    LLVMBuilderRef b = e->b;
    const double R = 127.0 * 16384.0;
    LLVMValueRef amax = abs_max(e, q, nb);
    LLVMValueRef pos = LLVMBuildFCmp(b, LLVMRealOGT, amax, cf(e, 0.0), "");
    LLVMValueRef inv = LLVMBuildSelect(b, pos, LLVMBuildFDiv(b, cf(e, R), amax, ""), cf(e, 0.0), "");
    *sq = LLVMBuildFDiv(b, amax, cf(e, R), "");
    LLVMValueRef iv = splat(e, inv), piece[3][16];
    for (int i = 0; i < nb; i++) {
        LLVMValueRef ps[3];
        q8_pieces(e, LLVMBuildFMul(b, q[i], iv, ""), ps);
        for (int p = 0; p < 3; p++) piece[p][i] = LLVMBuildTrunc(b, LLVMBuildFPToSI(b, ps[p], e->vi, ""),
                                                                 LLVMVectorType(e->i8, 16), "");
    }
    for (int p = 0; p < 3; p++) {
        /* the 128 channels' bytes in one vector, then codes8's order */
        LLVMValueRef cur[16];
        int n = nb;
        for (int i = 0; i < n; i++) cur[i] = piece[p][i];
        for (int w = 16; n > 1; w *= 2, n /= 2)
            for (int i = 0; i < n / 2; i++) {
                LLVMValueRef cat[256];
                for (int l = 0; l < 2 * w; l++) cat[l] = ci32(e, l);
                cur[i] = LLVMBuildShuffleVector(b, cur[2 * i], cur[2 * i + 1], LLVMConstVector(cat, (unsigned)(2 * w)), "");
            }
        LLVMValueRef ia[64], ib[64];
        for (int l = 0; l < 64; l++) {
            ia[l] = ci32(e, q8_channel(l, 0));
            ib[l] = ci32(e, q8_channel(l, 1));
        }
        LLVMValueRef all = cur[0], pz = LLVMGetPoison(LLVMTypeOf(all));
        qa[p] = LLVMBuildBitCast(b, LLVMBuildShuffleVector(b, all, pz, LLVMConstVector(ia, 64), ""), e->vi, "");
        qb[p] = LLVMBuildBitCast(b, LLVMBuildShuffleVector(b, all, pz, LLVMConstVector(ib, 64), ""), e->vi, "");
    }
}

/* A parameter stored in `bytes` (2: fp16, 4: fp32) as fp32: element `idx` (an i64) of the section at sec. */
static LLVMValueRef param_scalar(E *e, LLVMValueRef sec, LLVMValueRef idx, int bytes)
{
    LLVMValueRef p = gep(e, sec, LLVMBuildMul(e->b, idx, ci64(e, bytes), ""));
    if (bytes == 4) return load(e, e->f32, p, 1);
    return LLVMBuildFPExt(e->b, load(e, e->f16, p, 1), e->f32, "");
}
/* n consecutive entries idx.. of a parameter section as a vector of n floats. */
static LLVMValueRef param_group_vec(E *e, LLVMValueRef sec, LLVMValueRef idx, int n, int bytes)
{
    LLVMValueRef p = gep(e, sec, LLVMBuildMul(e->b, idx, ci64(e, bytes), ""));
    if (bytes == 4) return load(e, LLVMVectorType(e->f32, (unsigned)n), p, 1);
    return LLVMBuildFPExt(e->b, load(e, LLVMVectorType(e->f16, (unsigned)n), p, 1), LLVMVectorType(e->f32, (unsigned)n), "");
}
/* A scalar in every lane of an n-lane vector. */
static LLVMValueRef splat_n(E *e, LLVMValueRef s, int n)
{
    LLVMTypeRef vt = LLVMVectorType(LLVMTypeOf(s), (unsigned)n);
    LLVMValueRef v = LLVMBuildInsertElement(e->b, LLVMGetUndef(vt), s, ci32(e, 0), "");
    return LLVMBuildShuffleVector(e->b, v, LLVMGetUndef(vt), LLVMConstNull(LLVMVectorType(e->i32, (unsigned)n)), "");
}
/* Lanes c0.. of a per-channel section [D]. */
static LLVMValueRef param_vec(E *e, LLVMValueRef sec, int c0, int bytes)
{
    LLVMValueRef p = gepc(e, sec, (long)c0 * bytes);
    if (bytes == 4) return load(e, e->vf, p, 4);
    return LLVMBuildFPExt(e->b, load(e, LLVMVectorType(e->f16, (unsigned)e->W), p, 2), e->vf, "");
}

/* A parameter of a page of format f whose entries are `bytes` wide: 0 (the format stores none: `absent`, 1 for
 * the scale of e4m3 / e5m2, 0 for the zero of a symmetric format: kvq_format_dequant), 1 (nvfp4's e4m3 / mxfp4's
 * e8m0 scale), 2 or 4. Element idx, and lanes c0.. of a per-channel section. */
static LLVMValueRef fparam_scalar(E *e, const kvq_page_format *f, LLVMValueRef sec, LLVMValueRef idx, int bytes,
                                  double absent)
{
    if (bytes == 0) return cf(e, absent);
    if (bytes == 1) return emit_llvm_format_scale8(e->b, f->format.kind, load(e, e->i8, gep(e, sec, idx), 1));
    return param_scalar(e, sec, idx, bytes);
}
static LLVMValueRef fparam_vec(E *e, const kvq_page_format *f, LLVMValueRef sec, int c0, int bytes, double absent)
{
    if (bytes == 0) return vfc(e, absent);
    if (bytes == 1)
        return emit_llvm_format_scale8(e->b, f->format.kind,
                                       load(e, LLVMVectorType(e->i8, (unsigned)e->W), gepc(e, sec, c0), 1));
    return param_vec(e, sec, c0, bytes);
}

/* Per-token parameters of token t for lanes c0..: one group per lane set (broadcast), or per lane when a group
 * is narrower than the vector. */
static LLVMValueRef token_param(E *e, const kvq_page_format *f, LLVMValueRef sec, LLVMValueRef t64, int c0,
                                int bytes, double absent)
{
    if (f->hidden) return splat(e, fparam_scalar(e, f, sec, t64, bytes, absent));
    int G = f->group, ng = f->head_dim / G;
    LLVMValueRef base = LLVMBuildMul(e->b, t64, ci64(e, ng), "");
    if (c0 / G == (c0 + e->W - 1) / G)
        return splat(e, fparam_scalar(e, f, sec, LLVMBuildAdd(e->b, base, ci64(e, c0 / G), ""), bytes, absent));
    LLVMValueRef v = LLVMGetPoison(e->vf), s = NULL;
    for (int i = 0; i < e->W; i++) {
        if (i == 0 || (c0 + i) / G != (c0 + i - 1) / G)
            s = fparam_scalar(e, f, sec, LLVMBuildAdd(e->b, base, ci64(e, (c0 + i) / G), ""), bytes, absent);
        v = LLVMBuildInsertElement(e->b, v, s, ci32(e, i), "");
    }
    return v;
}

/* The tensor scale T of a page of format f (the fp32 at t_sec: this kv head's), 1 for formats without one. */
static LLVMValueRef tensor_scale(E *e, const kvq_page_format *f, LLVMValueRef t_sec)
{
    if (!kvq_format_has_tensor_scale(f->format.kind)) return cf(e, 1.0);
    return load(e, e->f32, t_sec, 4);
}

/* Lanes c0.. of row t (i32) of a source, dequantized to fp32 exactly as ref_page_read does: z + (s T) L[code]
 * (kvq_format_dequant; for integers z + s * code) in its roundings, times the channel factor when
 * channel-separable. */
static LLVMValueRef row_f32(E *e, const emit_llvm_src *src, int D, LLVMValueRef base, LLVMValueRef s_sec,
                            LLVMValueRef z_sec, LLVMValueRef f_sec, LLVMValueRef t_sec, LLVMValueRef t, int c0)
{
    LLVMValueRef t64 = LLVMBuildZExt(e->b, t, e->i64, "");
    if (src->fp16) {
        LLVMValueRef p = gep(e, base, LLVMBuildAdd(e->b, LLVMBuildMul(e->b, t64, ci64(e, (long)D * 2), ""),
                                                     ci64(e, (long)c0 * 2), ""));
        return LLVMBuildFPExt(e->b, load(e, LLVMVectorType(e->f16, (unsigned)e->W), p, 2), e->vf, "");
    }
    const kvq_page_format *f = &src->fmt;
    if (f->tq != KVQ_TQ_NONE) { /* TurboQuant: norm_j L_j[code] (emit_llvm_turboquant.c) */
        LLVMValueRef tr = gep(e, base, LLVMBuildMul(e->b, t64, ci64(e, (long)emit_llvm_tq_row_bytes(f)), ""));
        LLVMValueRef tn = gep(e, s_sec, LLVMBuildMul(e->b, t64, ci64(e, f->tq_out ? 8 : 4), ""));
        return emit_llvm_tq_row(e->b, f, e->vf, tr, tn, c0, e->perm16);
    }
    LLVMValueRef row = gep(e, base, LLVMBuildMul(e->b, t64, ci64(e, (long)kvq_code_bytes(D, f->bits)), ""));
    LLVMValueRef code = codes_f32(e, f, row, c0), s, z;
    if (f->gran == KVQ_GRAN_CHANNEL) {
        s = fparam_vec(e, f, s_sec, c0, f->scale_bytes, 1.0);
        z = fparam_vec(e, f, z_sec, c0, f->zero_bytes, 0.0);
    } else {
        s = token_param(e, f, s_sec, t64, c0, f->scale_bytes, 1.0);
        z = token_param(e, f, z_sec, t64, c0, f->zero_bytes, 0.0);
    }
    if (kvq_format_has_tensor_scale(f->format.kind)) s = LLVMBuildFMul(e->b, s, splat(e, tensor_scale(e, f, t_sec)), "");
    LLVMValueRef x = LLVMBuildFMul(e->b, s, code, "");
    if (f->zero_bytes) x = LLVMBuildFAdd(e->b, z, x, ""); /* absent: z = 0, and 0 + x is x (up to the sign of 0) */
    if (f->channel_separable) x = LLVMBuildFMul(e->b, x, param_vec(e, f_sec, c0, f->scale_bytes), "");
    return x;
}

static int src_fold(const emit_llvm_src *s) { return emit_llvm_paged_keys(s); }

/* ------------------------------------------------------------------------------------------- the kernel -- */

#define MAXG 64
#define MAXB 64 /* D / W blocks: 256 / 4 */

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
        row = gep(e, a[A_K], LLVMBuildMul(b, t64, ci64(e, (long)kvq_code_bytes(D, k->k.fmt.bits)), ""));
    if (kp->v8) {
        LLVMValueRef A, B;
        codes8(e, row, &A, &B);
        for (int j = 0; j < g; j++) {
            /* 2^14 H + 2^7 M + L = ((H << 7) + M << 7) + L, exact (quant_q8): Horner's rule through the
             * accumulators, so that each piece's pair starts from the shifted sum of the pieces above it instead
             * of a zeroed register and an add */
            LLVMValueRef x = NULL;
            for (int p = 0; p < 3; p++) {
                LLVMValueRef acc0 = p ? LLVMBuildShl(b, x, vic(e, 7), "") : LLVMConstNull(e->vi);
                x = dpbusd(e, dpbusd(e, acc0, A, kp->qa[j][p]), B, kp->qb[j][p]);
            }
            hv[j] = x;
        }
        return;
    }
    if (kp->vn) {
        for (int u = 0; u < D / 32; u++) {
            LLVMValueRef c = codes16(e, &k->k.fmt, row, 32 * u);
            for (int j = 0; j < g; j++) {
                hv[j] = dpwssd(e, u ? hv[j] : LLVMConstNull(e->vi), c, kp->qhi[j][u]);
                lv[j] = dpwssd(e, u ? lv[j] : LLVMConstNull(e->vi), c, kp->qlo[j][u]);
            }
        }
        return;
    }
    LLVMValueRef part[MAXG][4];
    for (int bl = 0; bl < NB; bl++) {
        LLVMValueRef kv;
        if (kp->fold) {
            kv = codes_f32(e, &k->k.fmt, row, bl * W);
        } else {
            kv = row_f32(e, &k->k, D, a[A_K], a[A_KS], a[A_KZ], a[A_KF], a[A_KT], t, bl * W);
        }
        for (int j = 0; j < g; j++) {
            LLVMValueRef *pc = &part[j][bl % P];
            *pc = bl >= P ? fma_sum(e, *pc, kp->qv[j][bl], kv) : fm(LLVMBuildFMul(b, kp->qv[j][bl], kv, ""));
        }
    }
    for (int bl = 0; kp->qjl && bl < NB; bl++) {
        /* TurboQuant Q_prod: + sum_j rnorm_j sqrt(pi/2)/m_j <S_j q_j, sign(S_j r_j)> (Algorithm 2) */
        LLVMValueRef sg = gep(e, a[A_KQJL], LLVMBuildMul(b, t64, ci64(e, D / 8), ""));
        LLVMValueRef rn = gep(e, a[A_KZ], LLVMBuildMul(b, t64, ci64(e, k->k.fmt.tq_out ? 8 : 4), ""));
        LLVMValueRef jv = emit_llvm_tq_qjl(b, &k->k.fmt, e->vf, sg, rn, bl * W);
        for (int j = 0; j < g; j++) part[j][bl % P] = fma_sum(e, part[j][bl % P], kp->jq[j][bl], jv);
    }
    for (int j = 0; j < g; j++) {
        for (int w = P; w > 1; w = (w + 1) / 2) /* a tree over the partial sums */
            for (int c = 0; c + (w + 1) / 2 < w; c++)
                part[j][c] = fm(LLVMBuildFAdd(b, part[j][c], part[j][c + (w + 1) / 2], ""));
        dv[j] = part[j][0];
    }
}

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
    return e->vnni && e->W == 16 && !k->v.fp16 && fmt_int(f) && f->tq == KVQ_TQ_NONE && f->gran == KVQ_GRAN_TOKEN && !f->hidden &&
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
        idx[4 * c] = idx[4 * c + 1] = ci32(e, byte);       /* the high byte: masked off below */
        idx[4 * c + 2] = idx[4 * c + 3] = ci32(e, rb + byte);
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
    for (int i = 0; i < n_lanes; i++) iota[i] = ci32(e, i / per);
    LLVMValueRef lim = splat_n(e, valid, n_lanes);
    LLVMValueRef mask = LLVMBuildICmp(e->b, LLVMIntSLT, LLVMConstVector(iota, (unsigned)n_lanes), lim, "");
    unsigned id = LLVMLookupIntrinsicID("llvm.masked.load", 16);
    LLVMTypeRef tys[2] = {vt, e->ptr};
    LLVMValueRef f = LLVMGetIntrinsicDeclaration(e->m, id, tys, 2);
    LLVMTypeRef ft = LLVMIntrinsicGetType(e->c, id, tys, 2);
    LLVMValueRef args[4] = {p, ci32(e, 1), mask, LLVMConstNull(vt)};
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
        LLVMValueRef valid = LLVMBuildSub(b, n, ci32(e, (long)bl * W), "");
        LLVMValueRef off = ci64(e, (long)bl * W * ngr);
        LLVMTypeRef st = sbytes == 4 ? e->f32 : e->f16, zt = zbytes == 4 ? e->f32 : e->f16;
        LLVMValueRef sv = masked_load(e, st, W * ngr, gep(e, a[A_VS], LLVMBuildMul(b, off, ci64(e, sbytes), "")), valid, ngr);
        LLVMValueRef zv = masked_load(e, zt, W * ngr, gep(e, a[A_VZ], LLVMBuildMul(b, off, ci64(e, zbytes), "")), valid, ngr);
        for (int q = 0; q < ngr; q++) {
            LLVMValueRef idx[16];
            for (int i = 0; i < W; i++) idx[i] = ci32(e, i * ngr + q);
            LLVMValueRef s_q = LLVMBuildShuffleVector(b, sv, LLVMGetPoison(LLVMTypeOf(sv)), LLVMConstVector(idx, 16), "");
            LLVMValueRef z_q = LLVMBuildShuffleVector(b, zv, LLVMGetPoison(LLVMTypeOf(zv)), LLVMConstVector(idx, 16), "");
            if (sbytes == 2) s_q = LLVMBuildFPExt(b, s_q, e->vf, "");
            if (zbytes == 2) z_q = LLVMBuildFPExt(b, z_q, e->vf, "");
            for (int j = 0; j < g; j++) {
                /* Masked too: the scratch past the tile's occupied blocks holds whatever an earlier tile left. */
                LLVMValueRef pv = masked_load(e, e->f32, W, gepc(e, a[A_P], ((long)j * N + (long)bl * W) * 4), valid, 1);
                LLVMValueRef w = LLVMBuildFMul(b, pv, s_q, "");
                LLVMValueRef fa[1] = {w};
                LLVMValueRef aw = call_intrinsic(e, "llvm.fabs", e->vf, fa, 1);
                wv[j][q][bl] = w;
                wmax[j][q] = bl ? fmax_sel(e, wmax[j][q], aw) : aw;
                zs[j][q] = bl ? fma_sum(e, zs[j][q], pv, z_q) : fm(LLVMBuildFMul(b, pv, z_q, ""));
            }
        }
    }
    for (int j = 0; j < g; j++)
        for (int q = 0; q < ngr; q++) {
            LLVMValueRef amax = hmax(e, wmax[j][q]);
            LLVMValueRef pos = LLVMBuildFCmp(b, LLVMRealOGT, amax, cf(e, 0.0), "");
            zsum[j][q] = hsum(e, zs[j][q]);
            if (int8) {
                /* three signed 7-bit pieces (quant_q8's split): w_t = sw (2^14 hi + 2^7 mid + lo) within
                 * max|w| 2^-22 / 1.016; pieces [p][t] at wh + ((j ngr + q) 3 + p) N */
                const double R = 127.0 * 16384.0;
                LLVMValueRef inv = LLVMBuildSelect(b, pos, LLVMBuildFDiv(b, cf(e, R), amax, ""), cf(e, 0.0), "");
                sw[j][q] = LLVMBuildFDiv(b, amax, cf(e, R), "");
                swl[j][q] = NULL;
                LLVMValueRef iv = splat(e, inv);
                LLVMTypeRef v16b = LLVMVectorType(e->i8, 16);
                for (int bl = 0; bl < nbl; bl++) {
                    LLVMValueRef ps[3];
                    q8_pieces(e, LLVMBuildFMul(b, wv[j][q][bl], iv, ""), ps);
                    for (int pc = 0; pc < 3; pc++) {
                        long o = (((long)j * ngr + q) * 3 + pc) * N + (long)bl * W;
                        store(e, LLVMBuildTrunc(b, LLVMBuildFPToSI(b, ps[pc], e->vi, ""), v16b, ""), gepc(e, wh, o), 1);
                    }
                }
                continue;
            }
            LLVMValueRef inv = LLVMBuildSelect(b, pos, LLVMBuildFDiv(b, cf(e, 32767.0), amax, ""), cf(e, 0.0), "");
            sw[j][q] = LLVMBuildFDiv(b, amax, cf(e, 32767.0), "");
            swl[j][q] = LLVMBuildFMul(b, sw[j][q], cf(e, 1.0 / 32768.0), "");
            LLVMValueRef iv = splat(e, inv);
            for (int bl = 0; bl < nbl; bl++) {
                LLVMValueRef x = LLVMBuildFMul(b, wv[j][q][bl], iv, "");
                LLVMValueRef ra[1] = {x};
                LLVMValueRef h = call_intrinsic(e, "llvm.rint", e->vf, ra, 1);
                LLVMValueRef la[1] = {LLVMBuildFMul(b, LLVMBuildFSub(b, x, h, ""), vfc(e, 32768.0), "")};
                LLVMValueRef l = call_intrinsic(e, "llvm.rint", e->vf, la, 1);
                long o = (((long)j * ngr + q) * N + (long)bl * W) * 2;
                store(e, LLVMBuildFPToSI(b, h, v16s, ""), gepc(e, wh, o), 2);
                store(e, LLVMBuildFPToSI(b, l, v16s, ""), gepc(e, wl, o), 2);
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
            LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, a[A_N], ci32(e, (long)nbl[h] * W), ""), wb[h], next);
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
        LLVMValueRef zero_i = ci32(e, 0), zero_v = LLVMConstNull(e->vi);
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSGE, n, ci32(e, 2), ""), loop, after);
        /* One step: rows t, t+1 (`rows`), weights of pair t. */
#define V_PAIR_STEP(rows, t, hin, lin, hout, lout)                                                                 \
    do {                                                                                                          \
        LLVMValueRef t64_ = LLVMBuildZExt(b, t, e->i64, "");                                                      \
        for (int i = 0; i < mm; i++) {                                                                            \
            int c0 = (b0 + i) * W, q = c0 / G;                                                                    \
            LLVMValueRef cd = pair_codes(e, vf, rows, rb, c0);                                                    \
            for (int j = 0; j < g; j++) {                                                                         \
                LLVMValueRef wo = LLVMBuildAdd(b, LLVMBuildMul(b, t64_, ci64(e, 2), ""),                          \
                                               ci64(e, (((long)j * ngr + q) * N) * 2), "");                       \
                LLVMValueRef h2 = splat(e, load(e, e->i32, gep(e, wh, wo), 2));                                   \
                LLVMValueRef l2 = splat(e, load(e, e->i32, gep(e, wl, wo), 2));                                   \
                hout[j * mm + i] = dpwssd(e, hin[j * mm + i], cd, h2);                                            \
                lout[j * mm + i] = dpwssd(e, lin[j * mm + i], cd, l2);                                            \
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
            LLVMValueRef rowp = gep(e, a[A_V], LLVMBuildMul(b, LLVMBuildZExt(b, tp, e->i64, ""), ci64(e, rb), ""));
            LLVMValueRef rows = load(e, rows_t, rowp, 1);
            V_PAIR_STEP(rows, tp, hacc, lacc, hnext, lnext);
        }
        LLVMValueRef tp2 = LLVMBuildAdd(b, tp, ci32(e, 2), "");
        LLVMBasicBlockRef loop_last = LLVMGetInsertBlock(b);
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, LLVMBuildAdd(b, tp2, ci32(e, 2), ""), n, ""), loop, after);
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
            LLVMValueRef rowp = gep(e, a[A_V], LLVMBuildMul(b, LLVMBuildZExt(b, t_end, e->i64, ""), ci64(e, rb), ""));
            LLVMValueRef one = load(e, row_t, rowp, 1);
            LLVMValueRef cat[512];
            for (int i = 0; i < 2 * rb; i++) cat[i] = ci32(e, i);
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
                LLVMValueRef ap = gepc(e, a[A_ACC], ((long)j * D + (long)(b0 + i) * W) * 4);
                LLVMValueRef v = LLVMBuildFMul(b, load(e, e->vf, ap, 4), alpha_h[j], "");
                v = fma_sum(e, v, LLVMBuildSIToFP(b, hacc[x], e->vf, ""), splat(e, sw[j][q]));
                v = fma_sum(e, v, LLVMBuildSIToFP(b, lacc[x], e->vf, ""), splat(e, swl[j][q]));
                v = fm(LLVMBuildFAdd(b, v, splat(e, zsum[j][q]), ""));
                store(e, v, ap, 4);
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
    if (seg == rb) return valid ? masked_load(e, e->i8, 4 * rb, rowp, valid, rb) : load(e, rows_t, rowp, 1);
    LLVMValueRef part[4];
    for (int t = 0; t < 4; t++) {
        LLVMValueRef p = gepc(e, rowp, (long)t * rb + off);
        if (!valid) {
            part[t] = load(e, seg_t, p, 1);
        } else {
            LLVMValueRef on = LLVMBuildICmp(b, LLVMIntSGT, valid, ci32(e, t), "");
            part[t] = masked_load(e, e->i8, seg, p, LLVMBuildSelect(b, on, ci32(e, 1), ci32(e, 0), ""), seg);
        }
    }
    LLVMValueRef idx[256];
    for (int i = 0; i < 2 * seg; i++) idx[i] = ci32(e, i);
    LLVMValueRef lo = LLVMBuildShuffleVector(b, part[0], part[1], LLVMConstVector(idx, (unsigned)(2 * seg)), "");
    LLVMValueRef hi = LLVMBuildShuffleVector(b, part[2], part[3], LLVMConstVector(idx, (unsigned)(2 * seg)), "");
    for (int i = 0; i < 4 * seg; i++) idx[i] = ci32(e, i);
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
                idx[4 * c + t] = ci32(e, (long)t * seg + byte);
                mk[4 * c + t] = LLVMConstInt(e->i8, (unsigned long long)(((1 << bits) - 1) << (ch * bits % 8)), 0);
            }
        perm[i] = LLVMConstVector(idx, 64);
        mask[i] = LLVMConstVector(mk, 64);
    }
    LLVMValueRef zero_i = ci32(e, 0), zero_v = LLVMConstNull(e->vi);
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
                LLVMValueRef wp = gep(e, w8, LLVMBuildAdd(b, t64_, ci64(e, ((long)q * 3 + pc) * N), ""));          \
                out[pc * m + i] = dpbusd(e, in[pc * m + i], cd, splat(e, load(e, e->i32, wp, 1)));                 \
            }                                                                                                      \
        }                                                                                                          \
    } while (0)
        LLVMValueRef acc[3 * 4], nxt[3 * 4], acc2[3 * 4], fin[3 * 4];
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSGE, n, ci32(e, 4), ""), loop, after);
        LLVMPositionBuilderAtEnd(b, loop);
        LLVMValueRef t = LLVMBuildPhi(b, e->i32, "t");
        for (int x = 0; x < 3 * mm; x++) acc[x / mm * m + x % mm] = LLVMBuildPhi(b, e->vi, "");
        {
            LLVMValueRef rowp = gep(e, a[A_V], LLVMBuildMul(b, LLVMBuildZExt(b, t, e->i64, ""), ci64(e, rb), ""));
            LLVMValueRef rows = v8_rows(e, rowp, rb, seg, whole ? 0 : (b0 / m) * seg, rows_t, seg_t, NULL);
            V8_STEP(rows, t, acc, nxt);
        }
        LLVMValueRef t4 = LLVMBuildAdd(b, t, ci32(e, 4), "");
        LLVMBasicBlockRef loop_last = LLVMGetInsertBlock(b);
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, LLVMBuildAdd(b, t4, ci32(e, 4), ""), n, ""), loop, after);
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
            LLVMValueRef rowp = gep(e, a[A_V], LLVMBuildMul(b, LLVMBuildZExt(b, t_end, e->i64, ""), ci64(e, rb), ""));
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
            for (int c = 0; c < 16; c++) fac[c] = cf(e, 1.0 / (double)(1 << ((c0 + c) * bits % 8)));
            LLVMValueRef h = LLVMBuildSIToFP(b, fin[i], e->vf, ""), mi = LLVMBuildSIToFP(b, fin[m + i], e->vf, "");
            LLVMValueRef lo = LLVMBuildSIToFP(b, fin[2 * m + i], e->vf, "");
            LLVMValueRef x = fma_sum(e, fma_sum(e, lo, mi, vfc(e, 128.0)), h, vfc(e, 16384.0));
            LLVMValueRef sc = LLVMBuildFMul(b, splat(e, sw[0][q]), LLVMConstVector(fac, 16), "");
            LLVMValueRef ap = gepc(e, a[A_ACC], (long)c0 * 4);
            LLVMValueRef v = LLVMBuildFMul(b, load(e, e->vf, ap, 4), alpha, "");
            v = fma_sum(e, v, x, sc);
            v = fm(LLVMBuildFAdd(b, v, splat(e, zsum[0][q]), ""));
            store(e, v, ap, 4);
        }
    }
}

static void build_kernel(E *e, const emit_llvm_kernel *k, const char *name)
{
    int D = k->head_dim, g = k->gqa, W = e->W, NB = D / W, N = EMIT_LLVM_TILE;
    LLVMBuilderRef b = e->b;
    LLVMTypeRef params[1] = {e->ptr};
    LLVMTypeRef fty = LLVMFunctionType(LLVMVoidTypeInContext(e->c), params, 1, 0);
    e->fn = LLVMAddFunction(e->m, name, fty);
    LLVMValueRef args = LLVMGetParam(e->fn, 0);
    unsigned noalias = LLVMGetEnumAttributeKindForName("noalias", 7);
    LLVMAddAttributeAtIndex(e->fn, 1, LLVMCreateEnumAttribute(e->c, noalias, 0));

    LLVMBasicBlockRef entry = LLVMAppendBasicBlockInContext(e->c, e->fn, "entry");
    LLVMBasicBlockRef kloop = LLVMAppendBasicBlockInContext(e->c, e->fn, "kloop");
    LLVMBasicBlockRef soft = LLVMAppendBasicBlockInContext(e->c, e->fn, "softmax");
    LLVMPositionBuilderAtEnd(b, entry);
    LLVMValueRef a[A_COUNT];
    for (int i = 0; i < A_COUNT; i++) a[i] = field(e, args, i);
    LLVMValueRef n = a[A_N];
    /* The int16 P.V's weight scratch: static allocas at the entry. */
    int vq = v_int16(e, k), v8 = v_int8(e, k);
    LLVMValueRef vq_wh = NULL, vq_wl = NULL;
    if (v8) {
        vq_wh = LLVMBuildAlloca(b, LLVMArrayType(e->i8, (unsigned)(3 * (D / k->v.fmt.group) * EMIT_LLVM_TILE)), "w8");
        LLVMSetAlignment(vq_wh, 64);
    } else if (vq) {
        LLVMTypeRef at = LLVMArrayType(LLVMInt16TypeInContext(e->c),
                                       (unsigned)(g * (D / k->v.fmt.group) * EMIT_LLVM_TILE));
        vq_wh = LLVMBuildAlloca(b, at, "wh");
        vq_wl = LLVMBuildAlloca(b, at, "wl");
        LLVMSetAlignment(vq_wh, 64);
        LLVMSetAlignment(vq_wl, 64);
    }

    /* Paged keys (emit_llvm_paged_keys): the K phase below runs once per key page of the tile, each page its own
     * group (scale and zero per channel), on a copy of the arguments (ak) that points at the page, with nk its
     * tokens and its logits stored from slot poff of the scratch; the running max of the pages goes to the
     * softmax, which (with the V phase) runs once per tile. */
    int fold = src_fold(&k->k), paged = fold;
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
        LLVMValueRef zero32 = ci32(e, 0), ninf0 = cf(e, -__builtin_inf());
        LLVMAddIncoming(pg_i, &zero32, &pg_from, 1);
        LLVMAddIncoming(pg_off, &zero32, &pg_from, 1);
        for (int j = 0; j < g; j++) LLVMAddIncoming(pg_max[j], &ninf0, &pg_from, 1);
        /* emit_llvm_kpage: k, ks, kz, kmask at 0, 8, 16, 24; n, kmbit at 32, 36 */
        LLVMValueRef d = gep(e, a[A_KPG], LLVMBuildMul(b, LLVMBuildZExt(b, pg_i, e->i64, ""), ci64(e, 40), ""));
        ak[A_K] = load(e, e->ptr, d, 8);
        ak[A_KS] = load(e, e->ptr, gepc(e, d, 8), 8);
        ak[A_KZ] = load(e, e->ptr, gepc(e, d, 16), 8);
        ak[A_KMASK] = load(e, e->ptr, gepc(e, d, 24), 8);
        nk = load(e, e->i32, gepc(e, d, 32), 4);
        ak[A_KMBIT] = load(e, e->i32, gepc(e, d, 36), 4);
        ak[A_P] = gep(e, a[A_P], LLVMBuildMul(b, LLVMBuildZExt(b, pg_off, e->i64, ""), ci64(e, 4), ""));
    }
    /* q (and its fold with per-channel scales and zeros) once per tile, or per page of paged keys. */
    LLVMValueRef qv[MAXG][MAXB];
    LLVMValueRef qz[MAXG];
    for (int j = 0; j < g; j++) {
        LLVMValueRef zsum = NULL;
        for (int bl = 0; bl < NB; bl++) {
            LLVMValueRef q = load(e, e->vf, gepc(e, a[A_Q], ((long)j * D + (long)bl * W) * 4), 4);
            if (fold) {
                LLVMValueRef s = param_vec(e, ak[A_KS], bl * W, k->k.fmt.scale_bytes);
                LLVMValueRef z = param_vec(e, ak[A_KZ], bl * W, k->k.fmt.zero_bytes);
                zsum = zsum ? fma_sum(e, zsum, q, z) : fm(LLVMBuildFMul(b, q, z, ""));
                q = LLVMBuildFMul(b, q, s, "");
            }
            qv[j][bl] = q;
        }
        qz[j] = fold ? hsum(e, zsum) : NULL;
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
        for (int bl = 0; bl < NB; bl++) kp.jq[j][bl] = load(e, e->vf, gepc(e, a[A_SQ], ((long)j * D + (long)bl * W) * 4), 4);
    if (kp.v8)
        for (int j = 0; j < g; j++) quant_q8(e, qv[j], NB, kp.qa[j], kp.qb[j], &kp.sq[j]);
    else if (kp.vn)
        for (int j = 0; j < g; j++) quant_q16(e, qv[j], NB, kp.qhi[j], kp.qlo[j], &kp.sq[j], &kp.sql[j]);

    LLVMValueRef ninf = cf(e, -__builtin_inf()), zero_i = ci32(e, 0);
    LLVMValueRef mtile[MAXG], mx_next[MAXG];
    LLVMBasicBlockRef kentry = LLVMGetInsertBlock(b), from = kentry;
    LLVMValueRef t_start = zero_i, mxv_fin = NULL;
    LLVMBasicBlockRef kbend = NULL;
    if (TB > 1) {
        /* Per-lane constants of a block's logits vector: lane l is head l % g2. */
        LLVMValueRef sqv = LLVMGetPoison(e->vf), sqlv = LLVMGetPoison(e->vf), qzv = LLVMGetPoison(e->vf);
        for (int l = 0; l < W; l++) {
            int j = l % kp.g2 < g ? l % kp.g2 : 0;
            if (kp.vn) sqv = LLVMBuildInsertElement(b, sqv, kp.sq[j], ci32(e, l), "");
            if (kp.vn && !kp.v8) sqlv = LLVMBuildInsertElement(b, sqlv, kp.sql[j], ci32(e, l), "");
            if (fold) qzv = LLVMBuildInsertElement(b, qzv, qz[j], ci32(e, l), "");
        }
        LLVMBasicBlockRef kblk = LLVMAppendBasicBlockInContext(e->c, e->fn, "kblock");
        kbend = LLVMAppendBasicBlockInContext(e->c, e->fn, "kbend");
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, ci32(e, TB), nk, ""), kblk, kbend);
        LLVMPositionBuilderAtEnd(b, kblk);
        LLVMValueRef t0 = LLVMBuildPhi(b, e->i32, "t0"), mxv = LLVMBuildPhi(b, e->vf, "");
        sum_tree th = {0}, tl = {0};
        long krb = kvq_code_bytes(D, k->k.fmt.bits);
        LLVMValueRef rbase = fold ? gep(e, ak[A_K], LLVMBuildMul(b, LLVMBuildZExt(b, t0, e->i64, ""), ci64(e, krb), ""))
                                  : NULL;
        for (int t = 0; t < TB; t++) {
            LLVMValueRef dv[MAXG], hv[MAXG], lv[MAXG];
            k_token(e, &kp, LLVMBuildAdd(b, t0, ci32(e, t), ""), fold ? gepc(e, rbase, t * krb) : NULL, dv, hv, lv);
            for (int j = 0; j < kp.g2; j++) {
                LLVMValueRef zero = LLVMConstNull(kp.vn ? e->vi : e->vf);
                tree_push(e, &th, j < g ? (kp.vn ? hv[j] : dv[j]) : zero);
                if (kp.vn && !kp.v8) tree_push(e, &tl, j < g ? lv[j] : zero);
            }
        }
        LLVMValueRef x;
        if (kp.vn) {
            x = LLVMBuildFMul(b, LLVMBuildSIToFP(b, th.v[0], e->vf, ""), sqv, "");
            if (!kp.v8)
                x = fm(LLVMBuildFAdd(b, x, fm(LLVMBuildFMul(b, LLVMBuildSIToFP(b, tl.v[0], e->vf, ""), sqlv, "")), ""));
        } else {
            x = th.v[0];
        }
        if (fold) x = fm(LLVMBuildFAdd(b, x, qzv, ""));
        for (int j = 0; j < g; j++) {
            LLVMValueRef lanes = x;
            if (kp.g2 > 1) {
                LLVMValueRef idx[16];
                for (int t = 0; t < TB; t++) idx[t] = ci32(e, t * kp.g2 + j);
                lanes = LLVMBuildShuffleVector(b, x, LLVMGetPoison(e->vf), LLVMConstVector(idx, (unsigned)TB), "");
            }
            LLVMValueRef off = LLVMBuildMul(b, LLVMBuildAdd(b, LLVMBuildZExt(b, t0, e->i64, ""), ci64(e, (long)j * N), ""),
                                            ci64(e, 4), "");
            store(e, lanes, gep(e, ak[A_P], off), 4);
        }
        LLVMValueRef mxv1 = fmax_sel(e, mxv, x);
        LLVMValueRef t0n = LLVMBuildAdd(b, t0, ci32(e, TB), "");
        LLVMBasicBlockRef last = LLVMGetInsertBlock(b);
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, LLVMBuildAdd(b, t0n, ci32(e, TB), ""), nk, ""), kblk, kbend);
        LLVMValueRef ninf_v = vfc(e, -__builtin_inf());
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
        LLVMValueRef byte = load(e, e->i8, gep(e, ak[A_KMASK], LLVMBuildZExt(b, LLVMBuildLShr(b, bit, ci32(e, 3), ""),
                                                                             e->i64, "")), 1);
        LLVMValueRef sh = LLVMBuildTrunc(b, LLVMBuildAnd(b, bit, ci32(e, 7), ""), e->i8, "");
        LLVMValueRef m1 = LLVMBuildAnd(b, LLVMBuildLShr(b, byte, sh, ""), LLVMConstInt(e->i8, 1, 0), "");
        masked = LLVMBuildICmp(b, LLVMIntNE, m1, LLVMConstInt(e->i8, 0, 0), "");
    }
    LLVMValueRef dv[MAXG], hv[MAXG], lv[MAXG], sums[MAXG], lsums[MAXG];
    k_token(e, &kp, t, NULL, dv, hv, lv);
    hsum_many(e, kp.vn ? hv : dv, g, sums);
    if (kp.vn && !kp.v8) hsum_many(e, lv, g, lsums);
    LLVMValueRef t64 = LLVMBuildZExt(b, t, e->i64, "");
    for (int j = 0; j < g; j++) {
        LLVMValueRef s = sums[j];
        if (kp.vn) {
            s = LLVMBuildFMul(b, LLVMBuildSIToFP(b, s, e->f32, ""), kp.sq[j], "");
            if (!kp.v8)
                s = fm(LLVMBuildFAdd(b, s, fm(LLVMBuildFMul(b, LLVMBuildSIToFP(b, lsums[j], e->f32, ""), kp.sql[j], "")), ""));
        }
        if (fold) s = fm(LLVMBuildFAdd(b, s, qz[j], ""));
        if (masked) s = LLVMBuildSelect(b, masked, ninf, s, "");
        LLVMValueRef off = LLVMBuildMul(b, LLVMBuildAdd(b, t64, ci64(e, (long)j * N), ""), ci64(e, 4), "");
        store(e, s, gep(e, ak[A_P], off), 4);
        mx_next[j] = fmax_sel(e, mx[j], s);
    }
    LLVMValueRef t1 = LLVMBuildAdd(b, t, ci32(e, 1), "");
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
    for (int j = 0; j < g && TB > 1; j++) {
        LLVMValueRef idx[16];
        for (int t = 0; t < TB; t++) idx[t] = ci32(e, t * kp.g2 + j);
        LLVMValueRef lanes = LLVMBuildShuffleVector(b, mxv_fin, LLVMGetPoison(e->vf), LLVMConstVector(idx, (unsigned)TB), "");
        mtile[j] = fmax_sel(e, mtile[j], TB > 1 ? hmax(e, lanes) : LLVMBuildExtractElement(b, lanes, ci32(e, 0), ""));
    }

    if (paged) {
        /* the next key page, or the softmax with the max over the tile's pages */
        LLVMValueRef pm1[MAXG], pi1 = LLVMBuildAdd(b, pg_i, ci32(e, 1), ""), po1 = LLVMBuildAdd(b, pg_off, nk, "");
        for (int j = 0; j < g; j++) pm1[j] = fmax_sel(e, pg_max[j], mtile[j]);
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

    /* Softmax: once per tile and head. Lanes past n are not tokens: p = 0. */
    LLVMValueRef iota[16];
    for (int i = 0; i < W; i++) iota[i] = ci32(e, i);
    LLVMValueRef iota_v = LLVMConstVector(iota, (unsigned)W), n_v = splat(e, n);
    LLVMValueRef alpha_h[MAXG];
    for (int j = 0; j < g; j++) {
        LLVMValueRef mlp = gepc(e, a[A_ML], (long)j * 8);
        LLVMValueRef m_old = load(e, e->f32, mlp, 4), l_old = load(e, e->f32, gepc(e, mlp, 4), 4);
        LLVMValueRef m_new = fmax_sel(e, m_old, mtile[j]); /* the max after the last token */
        LLVMValueRef mn_v = splat(e, m_new);
        LLVMValueRef alpha_v = vexp(e, LLVMBuildFSub(b, splat(e, m_old), mn_v, ""));
        LLVMValueRef sum = NULL;
        /* Only the blocks that hold tokens (a tile cut by a 32-token K page fills half of 64 lanes): block bl > 0
         * runs when bl W < n. */
        for (int bl = 0; bl < N / W; bl++) {
            LLVMBasicBlockRef before = LLVMGetInsertBlock(b), doit = NULL, after = NULL;
            if (bl > 0) {
                doit = LLVMAppendBasicBlockInContext(e->c, e->fn, "sblk");
                after = LLVMAppendBasicBlockInContext(e->c, e->fn, "snext");
                LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, ci32(e, (long)bl * W), n, ""), doit, after);
                LLVMPositionBuilderAtEnd(b, doit);
            }
            LLVMValueRef pp = gepc(e, a[A_P], ((long)j * N + (long)bl * W) * 4);
            LLVMValueRef x = load(e, e->vf, pp, 4);
            LLVMValueRef valid = LLVMBuildICmp(b, LLVMIntSLT, LLVMBuildAdd(b, iota_v, vic(e, (long)bl * W), ""), n_v, "");
            LLVMValueRef pv = LLVMBuildSelect(b, valid, vexp(e, LLVMBuildFSub(b, x, mn_v, "")), vfc(e, 0.0), "");
            store(e, pv, pp, 4);
            LLVMValueRef sum1 = sum ? fm(LLVMBuildFAdd(b, sum, pv, "")) : pv;
            if (bl > 0) {
                LLVMBasicBlockRef done = LLVMGetInsertBlock(b);
                LLVMBuildBr(b, after);
                LLVMPositionBuilderAtEnd(b, after);
                LLVMValueRef ph = LLVMBuildPhi(b, e->vf, "");
                LLVMValueRef ins[2] = {sum, sum1};
                LLVMBasicBlockRef from[2] = {before, done};
                LLVMAddIncoming(ph, ins, from, 2);
                sum1 = ph;
            }
            sum = sum1;
        }
        LLVMValueRef alpha = LLVMBuildExtractElement(b, alpha_v, ci32(e, 0), "");
        LLVMValueRef l_new = fm(LLVMBuildFAdd(b, LLVMBuildFMul(b, l_old, alpha, ""), hsum(e, sum), ""));
        store(e, m_new, mlp, 4);
        store(e, l_new, gepc(e, mlp, 4), 4);
        alpha_h[j] = alpha_v; /* acc's rescale happens where the V phase loads it */
    }

    if (v8) {
        v_phase_int8(e, k, a, alpha_h[0], vq_wh);
        LLVMBuildRetVoid(b);
        return;
    }
    if (vq) {
        v_phase_int16(e, k, a, alpha_h, vq_wh, vq_wl);
        LLVMBuildRetVoid(b);
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
    LLVMValueRef vt_scale = vfold && !k->v.fp16 ? tensor_scale(e, vf, a[A_VT]) : NULL;
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
                    b, load(e, e->vf, gepc(e, a[A_ACC], ((long)j * D + (long)(b0 + i) * W) * 4), 4), alpha_h[j], "");
        LLVMBuildBr(b, vloop);
        LLVMPositionBuilderAtEnd(b, vloop);
        LLVMValueRef tv = LLVMBuildPhi(b, e->i32, "t");
        for (int x = 0; x < g * m; x++) acc[x] = LLVMBuildPhi(b, e->vf, "");
        /* More than one group per block range: the token's mg scales and zeros as one vector each (a load and a
         * conversion instead of mg scalar ones), sum_t p_t z_t as one vector accumulator (g == 1 here). */
        int gvec = vfold && mg > 1 && fmt_int(vf);
        LLVMTypeRef gty = LLVMVectorType(e->f32, (unsigned)(mg > 1 ? mg : 1));
        LLVMValueRef zaccv = NULL, zaccv1 = NULL;
        if (gvec) zaccv = LLVMBuildPhi(b, gty, "");
        else
            for (int x = 0; x < g * mg; x++) zacc[x] = LLVMBuildPhi(b, e->f32, "");
        LLVMValueRef tv64 = LLVMBuildZExt(b, tv, e->i64, "");
        LLVMValueRef pw[MAXG], ps[8 * 16];
        for (int j = 0; j < g; j++) {
            LLVMValueRef off = LLVMBuildMul(b, LLVMBuildAdd(b, tv64, ci64(e, (long)j * N), ""), ci64(e, 4), "");
            LLVMValueRef pj = load(e, e->f32, gep(e, a[A_P], off), 4);
            pw[j] = splat(e, pj);
            if (gvec) {
                LLVMValueRef idx = LLVMBuildAdd(b, LLVMBuildMul(b, tv64, ci64(e, ngr), ""), ci64(e, g0), "");
                LLVMValueRef sv = param_group_vec(e, a[A_VS], idx, mg, vf->scale_bytes);
                LLVMValueRef zv = param_group_vec(e, a[A_VZ], idx, mg, vf->zero_bytes);
                LLVMValueRef pg = splat_n(e, pj, mg);
                LLVMValueRef psv = LLVMBuildFMul(b, pg, sv, "");
                zaccv1 = fma_sum(e, zaccv, pg, zv);
                for (int q = 0; q < mg; q++) ps[q] = splat(e, LLVMBuildExtractElement(b, psv, ci32(e, q), ""));
            }
            for (int q = 0; q < mg && !gvec; q++) {
                LLVMValueRef idx = LLVMBuildAdd(b, LLVMBuildMul(b, tv64, ci64(e, ngr), ""), ci64(e, g0 + q), "");
                /* element formats: s T (kvq_format_dequant), and no zero sum where none is stored */
                LLVMValueRef sc = fparam_scalar(e, vf, a[A_VS], idx, vf->scale_bytes, 1.0);
                if (kvq_format_has_tensor_scale(vf->format.kind)) sc = LLVMBuildFMul(b, sc, vt_scale, "");
                ps[j * mg + q] = splat(e, LLVMBuildFMul(b, pj, sc, ""));
                zacc1[j * mg + q] = vf->zero_bytes
                                        ? fma_sum(e, zacc[j * mg + q], pj, param_scalar(e, a[A_VZ], idx, vf->zero_bytes))
                                        : zacc[j * mg + q];
            }
        }
        for (int i = 0; i < m; i++) {
            if (vfold) {
                LLVMValueRef row = gep(e, a[A_V], LLVMBuildMul(b, tv64, ci64(e, (long)kvq_code_bytes(D, vf->bits)), ""));
                LLVMValueRef code = codes_f32(e, vf, row, (b0 + i) * W);
                int q = (b0 + i) * W / G - g0;
                for (int j = 0; j < g; j++) acc1[j * m + i] = fma_sum(e, acc[j * m + i], ps[j * mg + q], code);
            } else {
                LLVMValueRef vv = row_f32(e, &k->v, D, a[A_V], a[A_VS], a[A_VZ], a[A_VF], a[A_VT], tv, (b0 + i) * W);
                for (int j = 0; j < g; j++) acc1[j * m + i] = fma_sum(e, acc[j * m + i], pw[j], vv);
            }
        }
        LLVMValueRef tv1 = LLVMBuildAdd(b, tv, ci32(e, 1), "");
        LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, tv1, n, ""), vloop, vend);
        LLVMAddIncoming(tv, &zero_i, &pre, 1);
        LLVMAddIncoming(tv, &tv1, &vloop, 1);
        LLVMValueRef fzero = cf(e, 0.0);
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
            for (int q = 0; q < mg; q++) zacc1[q] = LLVMBuildExtractElement(b, zaccv1, ci32(e, q), "");
        for (int j = 0; j < g; j++)
            for (int i = 0; i < m; i++) {
                LLVMValueRef v = acc1[j * m + i];
                if (vfold) v = fm(LLVMBuildFAdd(b, v, splat(e, zacc1[j * mg + (b0 + i) * W / G - g0]), ""));
                store(e, v, gepc(e, a[A_ACC], ((long)j * D + (long)(b0 + i) * W) * 4), 4);
            }
    }
    LLVMBuildRetVoid(b);
}

/* ------------------------------------------------------------------------------------------- module -- */

static void module_init(E *e, LLVMContextRef ctx, int width, int vnni)
{
    memset(e, 0, sizeof *e);
    e->c = ctx;
    e->m = LLVMModuleCreateWithNameInContext("kvq_cpu", ctx);
    e->b = LLVMCreateBuilderInContext(ctx);
    e->f32 = LLVMFloatTypeInContext(ctx);
    e->f16 = LLVMHalfTypeInContext(ctx);
    e->i1 = LLVMInt1TypeInContext(ctx);
    e->i8 = LLVMInt8TypeInContext(ctx);
    e->i32 = LLVMInt32TypeInContext(ctx);
    e->i64 = LLVMInt64TypeInContext(ctx);
    e->ptr = LLVMPointerTypeInContext(ctx, 0);
    e->W = width;
    e->vnni = (vnni & EMIT_LLVM_IR_VNNI) != 0;
    e->int8 = e->vnni && (vnni & EMIT_LLVM_IR_INT8);
    e->vbmi = e->int8 && (vnni & EMIT_LLVM_IR_VBMI);
    e->perm16 = width == 16 && (vnni & EMIT_LLVM_IR_PERM16);
    e->vf = LLVMVectorType(e->f32, (unsigned)width);
    e->vi = LLVMVectorType(e->i32, (unsigned)width);
    LLVMTypeRef fields[A_COUNT];
    for (int i = 0; i < A_COUNT; i++) fields[i] = arg_is_i32(i) ? e->i32 : e->ptr;
    e->args_ty = LLVMStructTypeInContext(ctx, fields, A_COUNT, 0);
}

int emit_llvm_supported(const emit_llvm_kernel *k, char *msg, size_t msg_size)
{
    if (k->head_dim % 32 || k->head_dim > 256 || k->gqa < 1 || k->gqa > MAXG) {
        snprintf(msg, msg_size, "cpu kernels: head_dim %d / GQA %d out of range (multiple of 32 up to 256; 1..%d)",
                 k->head_dim, k->gqa, MAXG);
        return 0;
    }
    const emit_llvm_src *s[2] = {&k->k, &k->v};
    for (int i = 0; i < 2; i++) {
        if (s[i]->fp16) continue;
        int bits = s[i]->fmt.bits;
        kvq_format_kind fk = s[i]->fmt.format.kind;
        int q5 = bits == 5 && (fk == KVQ_FMT_Q5_0 || fk == KVQ_FMT_Q5_1);
        if (bits != 1 && bits != 2 && bits != 3 && bits != 4 && bits != 8 && !q5) {
            snprintf(msg, msg_size, "cpu kernels: %d-bit %s codes", bits, i ? "value" : "key");
            return 0;
        }
        if (s[i]->fmt.channel_separable && s[i]->fmt.scale_bytes != 2 && s[i]->fmt.scale_bytes != 4) {
            snprintf(msg, msg_size, "cpu kernels: channel-separable %s with the element format %s (no fp16/fp32 "
                     "scale for the channel factors)", i ? "values" : "keys", kvq_format_name(fk));
            return 0;
        }
        if (s[i]->fmt.gran == KVQ_GRAN_TOKEN && !s[i]->fmt.hidden &&
            (s[i]->fmt.group <= 0 || k->head_dim % s[i]->fmt.group)) {
            snprintf(msg, msg_size, "cpu kernels: per-token group %d does not divide head_dim %d", s[i]->fmt.group,
                     k->head_dim);
            return 0;
        }
    }
    return 1;
}

static void build_module(E *e, const emit_llvm_kernel *ks, int n)
{
    for (int i = 0; i < n; i++) {
        char name[32];
        snprintf(name, sizeof name, "kvq_tile_%d", i);
        build_kernel(e, &ks[i], name);
    }
}

/* The unoptimised module of n kernels (emit_llvm_ir.h). */
LLVMModuleRef emit_llvm_ir_module(LLVMContextRef ctx, const emit_llvm_kernel *ks, int n, int width, int vnni)
{
    E e;
    module_init(&e, ctx, width, vnni);
    build_module(&e, ks, n);
    LLVMDisposeBuilder(e.b);
    return e.m;
}

#endif

/* Per-channel integer pages: their scale and zero fold into q once per page (other element formats decode each
 * token's codes through their levels, emit_llvm_format.c). */
int emit_llvm_paged_keys(const emit_llvm_src *s)
{
    return !s->fp16 && s->fmt.gran == KVQ_GRAN_CHANNEL && s->fmt.format.kind == KVQ_FMT_INT;
}

#ifndef KVQ_HAVE_LLVM /* built without LLVM */

int emit_llvm_supported(const emit_llvm_kernel *k, char *msg, size_t msg_size)
{
    (void)k;
    emit_llvm_probe(msg, msg_size);
    return 0;
}

#endif
