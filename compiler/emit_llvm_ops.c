/* The generic IR building blocks of the cpu code generator (emit_llvm_build.h): constants and splats, byte
 * addresses, loads and stores, sums whose order is free (the only fast-math flags the kernels carry), lane sums
 * and maxima as shuffle trees, e^x. */
#include <string.h>

#ifdef KVQ_HAVE_LLVM
#include "emit_llvm_build.h"

LLVMValueRef el_ci32(E *e, long v) { return LLVMConstInt(e->i32, (unsigned long long)v, 1); }
LLVMValueRef el_ci64(E *e, long v) { return LLVMConstInt(e->i64, (unsigned long long)v, 1); }
LLVMValueRef el_cf(E *e, double v) { return LLVMConstReal(e->f32, v); }

LLVMValueRef el_splat_const(LLVMValueRef s, int W)
{
    LLVMValueRef el[16];
    for (int i = 0; i < W; i++) el[i] = s;
    return LLVMConstVector(el, (unsigned)W);
}
LLVMValueRef el_vfc(E *e, double v) { return el_splat_const(el_cf(e, v), e->W); }
LLVMValueRef el_vic(E *e, long v) { return el_splat_const(el_ci32(e, v), e->W); }

/* A scalar broadcast to every lane. */
LLVMValueRef el_splat(E *e, LLVMValueRef s)
{
    LLVMTypeRef vt = LLVMVectorType(LLVMTypeOf(s), (unsigned)e->W);
    LLVMValueRef v = LLVMBuildInsertElement(e->b, LLVMGetPoison(vt), s, el_ci32(e, 0), "");
    LLVMValueRef zeros[16];
    for (int i = 0; i < e->W; i++) zeros[i] = el_ci32(e, 0);
    return LLVMBuildShuffleVector(e->b, v, LLVMGetPoison(vt), LLVMConstVector(zeros, (unsigned)e->W), "");
}

/* base + off bytes (off an i64 value). */
LLVMValueRef el_gep(E *e, LLVMValueRef base, LLVMValueRef off)
{
    return LLVMBuildGEP2(e->b, e->i8, base, &off, 1, "");
}
LLVMValueRef el_gepc(E *e, LLVMValueRef base, long off) { return off ? el_gep(e, base, el_ci64(e, off)) : base; }

LLVMValueRef el_load(E *e, LLVMTypeRef ty, LLVMValueRef p, unsigned align)
{
    LLVMValueRef v = LLVMBuildLoad2(e->b, ty, p, "");
    LLVMSetAlignment(v, align);
    return v;
}
void el_store(E *e, LLVMValueRef v, LLVMValueRef p, unsigned align)
{
    LLVMValueRef s = LLVMBuildStore(e->b, v, p);
    LLVMSetAlignment(s, align);
}

static const LLVMFastMathFlags FM_SUM = LLVMFastMathAllowReassoc | LLVMFastMathAllowContract;

LLVMValueRef el_fm(LLVMValueRef v)
{
    LLVMSetFastMathFlags(v, FM_SUM);
    return v;
}
/* acc + a * b with contraction allowed (an FMA): only in sums whose order is free. */
LLVMValueRef el_fma_sum(E *e, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b)
{
    return el_fm(LLVMBuildFAdd(e->b, acc, el_fm(LLVMBuildFMul(e->b, a, b, "")), ""));
}

LLVMValueRef el_call_intrinsic(E *e, const char *name, LLVMTypeRef overload, LLVMValueRef *args, unsigned n)
{
    unsigned id = LLVMLookupIntrinsicID(name, strlen(name));
    LLVMTypeRef tys[1] = {overload};
    LLVMValueRef f = LLVMGetIntrinsicDeclaration(e->m, id, tys, 1);
    LLVMTypeRef ft = LLVMIntrinsicGetType(e->c, id, tys, 1);
    return LLVMBuildCall2(e->b, ft, f, args, n, "");
}

int el_is_int_vec(LLVMValueRef v)
{
    return LLVMGetTypeKind(LLVMGetElementType(LLVMTypeOf(v))) == LLVMIntegerTypeKind;
}

/* Sum of a vector's lanes (reassociation allowed: the lanes are terms of one dot product; integer sums are
 * exact). */
LLVMValueRef el_hsum(E *e, LLVMValueRef v)
{
    if (el_is_int_vec(v)) {
        LLVMValueRef args[1] = {v};
        return el_call_intrinsic(e, "llvm.vector.reduce.add", LLVMTypeOf(v), args, 1);
    }
    LLVMValueRef args[2] = {el_cf(e, -0.0), v};
    return el_fm(el_call_intrinsic(e, "llvm.vector.reduce.fadd", e->vf, args, 2));
}

/* (a, b) -> evens(a ++ b) + odds(a ++ b): lanes [0, W/2) hold a's lanes summed in pairs, [W/2, W) b's. */
LLVMValueRef el_pair_fold(E *e, LLVMValueRef a, LLVMValueRef b)
{
    LLVMValueRef ev[16], od[16];
    for (int i = 0; i < e->W; i++) {
        ev[i] = el_ci32(e, 2 * i);
        od[i] = el_ci32(e, 2 * i + 1);
    }
    LLVMValueRef x = LLVMBuildShuffleVector(e->b, a, b, LLVMConstVector(ev, (unsigned)e->W), "");
    LLVMValueRef y = LLVMBuildShuffleVector(e->b, a, b, LLVMConstVector(od, (unsigned)e->W), "");
    return el_is_int_vec(a) ? LLVMBuildAdd(e->b, x, y, "") : el_fm(LLVMBuildFAdd(e->b, x, y, ""));
}

/* The lane sums of g vectors at once (the g heads' dot products of one token): pairs fold into one vector whose
 * segment j (W/g2 lanes) holds head j's partial sums, then the segments fold within themselves; about half the
 * shuffles of g separate reductions. g2 = g rounded up to a power of two (padding with zeros); beyond W heads
 * the reductions are separate. Float or integer vectors. */
void el_hsum_many(E *e, LLVMValueRef *v, int g, LLVMValueRef *out)
{
    int g2 = 1;
    while (g2 < g) g2 *= 2;
    if (g2 == 1 || g2 > e->W) {
        for (int j = 0; j < g; j++) out[j] = el_hsum(e, v[j]);
        return;
    }
    LLVMValueRef cur[64];
    for (int j = 0; j < g2; j++) cur[j] = j < g ? v[j] : LLVMConstNull(LLVMTypeOf(v[0]));
    for (int n = g2; n > 1; n /= 2)
        for (int j = 0; j < n / 2; j++) cur[j] = el_pair_fold(e, cur[2 * j], cur[2 * j + 1]);
    /* Segment j: lanes [j*S, (j+1)*S), S = W / g2; fold each segment onto its first lane... */
    LLVMValueRef x = cur[0];
    for (int S = e->W / g2; S > 1; S /= 2) x = el_pair_fold(e, x, x);
    /* ...after which head j's sum is lane j. */
    for (int j = 0; j < g; j++) out[j] = LLVMBuildExtractElement(e->b, x, el_ci32(e, j), "");
}

void el_tree_push(E *e, sum_tree *tr, LLVMValueRef x)
{
    tr->v[tr->n] = x;
    tr->lvl[tr->n++] = 0;
    while (tr->n >= 2 && tr->lvl[tr->n - 1] == tr->lvl[tr->n - 2]) {
        tr->v[tr->n - 2] = el_pair_fold(e, tr->v[tr->n - 2], tr->v[tr->n - 1]);
        tr->lvl[tr->n - 2]++;
        tr->n--;
    }
}

LLVMValueRef el_fmax_sel(E *e, LLVMValueRef a, LLVMValueRef b)
{
    return LLVMBuildSelect(e->b, LLVMBuildFCmp(e->b, LLVMRealOGT, a, b, ""), a, b, "");
}

/* The max of a vector's lanes (no NaN among them): a tree of shuffles and vector maxima; llvm.vector.reduce.fmax
 * lowers to a scalar chain with NaN checks per lane. */
LLVMValueRef el_hmax(E *e, LLVMValueRef v)
{
    int n = (int)LLVMGetVectorSize(LLVMTypeOf(v));
    for (int h = n / 2; h >= 1; h /= 2) {
        LLVMValueRef idx[64];
        for (int i = 0; i < n; i++) idx[i] = el_ci32(e, i < h ? i + h : i);
        v = el_fmax_sel(e, v, LLVMBuildShuffleVector(e->b, v, LLVMGetPoison(LLVMTypeOf(v)), LLVMConstVector(idx, (unsigned)n), ""));
    }
    return LLVMBuildExtractElement(e->b, v, el_ci32(e, 0), "");
}

/* e^x for x <= 0, lanes below -87.3 (and -inf) give 0: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, and
 * Cephes expf's degree-6 polynomial (relative error ~1e-7), scaled by 2^n built in the exponent bits. */
LLVMValueRef el_vexp(E *e, LLVMValueRef x)
{
    LLVMBuilderRef b = e->b;
    LLVMValueRef under = LLVMBuildFCmp(b, LLVMRealOLT, x, el_vfc(e, -87.3f), "");
    LLVMValueRef xc = LLVMBuildSelect(b, under, el_vfc(e, -87.0), x, "");
    LLVMValueRef args[1] = {LLVMBuildFMul(b, xc, el_vfc(e, 1.44269504088896341), "")};
    LLVMValueRef n = el_call_intrinsic(e, "llvm.rint", e->vf, args, 1);
    LLVMValueRef r = LLVMBuildFSub(b, xc, LLVMBuildFMul(b, n, el_vfc(e, 0.693359375), ""), "");
    r = LLVMBuildFSub(b, r, LLVMBuildFMul(b, n, el_vfc(e, -2.12194440e-4), ""), "");
    static const double c[] = {1.9875691500E-4, 1.3981999507E-3, 8.3334519073E-3,
                               4.1665795894E-2, 1.6666665459E-1, 5.0000001201E-1};
    LLVMValueRef p = el_vfc(e, c[0]);
    for (int i = 1; i < 6; i++) p = LLVMBuildFAdd(b, LLVMBuildFMul(b, p, r, ""), el_vfc(e, c[i]), "");
    p = LLVMBuildFMul(b, p, LLVMBuildFMul(b, r, r, ""), "");
    p = LLVMBuildFAdd(b, LLVMBuildFAdd(b, p, r, ""), el_vfc(e, 1.0), "");
    LLVMValueRef ni = LLVMBuildFPToSI(b, n, e->vi, "");
    LLVMValueRef pw = LLVMBuildShl(b, LLVMBuildAdd(b, ni, el_vic(e, 127), ""), el_vic(e, 23), "");
    LLVMValueRef res = LLVMBuildFMul(b, p, LLVMBuildBitCast(b, pw, e->vf, ""), "");
    return LLVMBuildSelect(b, under, el_vfc(e, 0.0), res, "");
}

LLVMValueRef el_field(E *e, LLVMValueRef args, int i)
{
    LLVMValueRef p = LLVMBuildStructGEP2(e->b, e->args_ty, args, (unsigned)i, "");
    return el_load(e, arg_is_i32(i) ? e->i32 : e->ptr, p, arg_is_i32(i) ? 4 : 8);
}

#endif
