/* Codes to lanes for the cpu code generator (emit_llvm_build.h): the bit planes of layout.h unpacked to fp32,
 * int16 or byte lanes, q' and weights as the int16 pairs and int8 pieces of the VNNI paths (docs/cpu.md
 * "Accuracy"), the pages' scales, zeros and tensor scales, and a row dequantized as the reference does. */
#include <string.h>

#include "emit_llvm_format.h"
#include "quant.h"

#ifdef KVQ_HAVE_LLVM
#include "emit_llvm_build.h"
#include "emit_llvm_turboquant.h"

/* ------------------------------------------------------------------------------------ unpack/dequantize -- */

/* Lanes c0..c0+W-1 of a b-bit plane (b in 1, 2, 4, 8) of the row at `row`: layout.h's order, channel c at bits
 * [(c*b) % 32, +b) of 32-bit word (c*b)/32. The words covering the lanes are loaded once and spread. */
LLVMValueRef el_unpack_plane(E *e, LLVMValueRef row, int b, int c0)
{
    int W = e->W, first = (c0 * b) / 32, last = ((c0 + W - 1) * b) / 32, nw = last - first + 1;
    LLVMValueRef words;
    LLVMValueRef wp = el_gepc(e, row, (long)first * 4);
    LLVMValueRef idx[16], sh[16];
    for (int i = 0; i < W; i++) {
        idx[i] = el_ci32(e, ((c0 + i) * b) / 32 - first);
        sh[i] = el_ci32(e, ((c0 + i) * b) % 32);
    }
    if (nw == 1) {
        words = el_splat(e, el_load(e, e->i32, wp, 1));
    } else {
        LLVMTypeRef wt = LLVMVectorType(e->i32, (unsigned)nw);
        LLVMValueRef w = el_load(e, wt, wp, 1);
        words = LLVMBuildShuffleVector(e->b, w, LLVMGetPoison(wt), LLVMConstVector(idx, (unsigned)W), "");
    }
    LLVMValueRef v = LLVMBuildLShr(e->b, words, LLVMConstVector(sh, (unsigned)W), "");
    return LLVMBuildAnd(e->b, v, el_vic(e, (1L << b) - 1), "");
}

/* Codes of lanes c0.. of the row at `row` as i32 lanes. 3- and 5-bit codes are two planes (layout.h): the low
 * two (four) bits, then the high bit as a 1-bit plane. */
LLVMValueRef el_codes_int(E *e, const kvq_page_format *f, LLVMValueRef row, int c0)
{
    if (f->bits == 3 || f->bits == 5) {
        int lb = f->bits - 1;
        LLVMValueRef lo = el_unpack_plane(e, row, lb, c0);
        LLVMValueRef hi = el_unpack_plane(e, el_gepc(e, row, (long)f->head_dim * lb / 8), 1, c0);
        return LLVMBuildOr(e->b, lo, LLVMBuildShl(e->b, hi, el_vic(e, lb), ""), "");
    }
    return el_unpack_plane(e, row, f->bits, c0);
}

/* The levels L[code] of lanes c0.. (scheme_format.h): the codes as floats for asymmetric integers, else the
 * element format's decode (emit_llvm_format.c). */
LLVMValueRef el_codes_f32(E *e, const kvq_page_format *f, LLVMValueRef row, int c0)
{
    return emit_llvm_format_level(e->b, &f->format, f->bits, el_codes_int(e, f, row, c0), e->perm16);
}

/* Asymmetric integers: the formats the integer fast paths (folds, int16/int8 dot products) are written for. */
/* Integer codes with a scale and zero per group (not TurboQuant's level indices, which share the integer kind). */
int el_fmt_int(const kvq_page_format *f) { return f->format.kind == KVQ_FMT_INT && f->tq == KVQ_TQ_NONE; }

/* ---- int16 key dot products (AVX-512 VNNI, docs/cpu.md "Accuracy") ---- */

/* Channels c0..c0+31 of a b-bit plane (b in 1, 2, 4, 8) as 32 16-bit lanes: the 4b bytes covering them are
 * loaded once, byte (i*b)/8 goes to lane i's low byte (one byte permute), then a shift by (i*b)%8 and a mask. */
LLVMValueRef el_unpack_plane16(E *e, LLVMValueRef row, int b, int c0)
{
    int nbytes = 4 * b;
    LLVMTypeRef bt = LLVMVectorType(e->i8, (unsigned)nbytes), i16 = LLVMInt16TypeInContext(e->c);
    LLVMTypeRef wt = LLVMVectorType(i16, 32);
    LLVMValueRef bytes = el_load(e, bt, el_gepc(e, row, (long)c0 * b / 8), 1);
    LLVMValueRef idx[64], sh[32], msk[32];
    for (int i = 0; i < 32; i++) {
        idx[2 * i] = el_ci32(e, (i * b) / 8);
        idx[2 * i + 1] = el_ci32(e, nbytes); /* the high byte: a zero of the second operand */
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
LLVMValueRef el_codes16(E *e, const kvq_page_format *f, LLVMValueRef row, int c0)
{
    LLVMValueRef v;
    if (f->bits == 3) {
        LLVMValueRef lo = el_unpack_plane16(e, row, 2, c0);
        LLVMValueRef hi = el_unpack_plane16(e, el_gepc(e, row, f->head_dim / 4), 1, c0);
        LLVMValueRef two[32];
        for (int i = 0; i < 32; i++) two[i] = LLVMConstInt(LLVMInt16TypeInContext(e->c), 2, 0);
        v = LLVMBuildOr(e->b, lo, LLVMBuildShl(e->b, hi, LLVMConstVector(two, 32), ""), "");
    } else {
        v = el_unpack_plane16(e, row, f->bits, c0);
    }
    return LLVMBuildBitCast(e->b, v, e->vi, "");
}

/* acc + a VNNI dot product of a and b (three <16 x i32>): the intrinsic `name` (not overloaded). */
LLVMValueRef el_vnni_dot(E *e, const char *name, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b)
{
    unsigned id = LLVMLookupIntrinsicID(name, strlen(name));
    LLVMValueRef f = LLVMGetIntrinsicDeclaration(e->m, id, NULL, 0);
    LLVMTypeRef ft = LLVMIntrinsicGetType(e->c, id, NULL, 0);
    LLVMValueRef args[3] = {acc, a, b};
    return LLVMBuildCall2(e->b, ft, f, args, 3, "");
}

/* acc + the pairwise products of two vectors of 32 signed 16-bit lanes (vpdpwssd: 32 MACs, exact in int32). */
LLVMValueRef el_dpwssd(E *e, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b)
{
    return el_vnni_dot(e, "llvm.x86.avx512.vpdpwssd.512", acc, a, b);
}

/* Two 16-lane i32 vectors (values in int16 range) as the 32 16-bit lanes of one vector, viewed as 16 i32 lanes. */
LLVMValueRef el_pack16(E *e, LLVMValueRef a, LLVMValueRef b)
{
    LLVMValueRef idx[32];
    for (int i = 0; i < 32; i++) idx[i] = el_ci32(e, i);
    LLVMValueRef v = LLVMBuildShuffleVector(e->b, a, b, LLVMConstVector(idx, 32), "");
    v = LLVMBuildTrunc(e->b, v, LLVMVectorType(LLVMInt16TypeInContext(e->c), 32), "");
    return LLVMBuildBitCast(e->b, v, e->vi, "");
}

/* max |q[i] lane| over nb vectors: what the integer splits of q' scale against. */
LLVMValueRef el_abs_max(E *e, LLVMValueRef *q, int nb)
{
    LLVMValueRef mx = NULL;
    for (int i = 0; i < nb; i++) {
        LLVMValueRef a[1] = {q[i]};
        LLVMValueRef ab = el_call_intrinsic(e, "llvm.fabs", e->vf, a, 1);
        mx = mx ? el_fmax_sel(e, mx, ab) : ab;
    }
    return el_hmax(e, mx);
}

/* The folded query q' (nb vectors of 16) as a pair of int16 vectors per 32 channels:
 *   x = q' 32767 / max|q'|,  hi = rint(x),  lo = rint((x - hi) 2^15),  q' ~ sq hi + sql lo,
 * sq = max|q'| / 32767, sql = sq 2^-15. |hi| <= 32767 and |lo| <= 2^14 fit int16; the pair's error is at most
 * sq 2^-16 per channel (plus x's own fp32 rounding, relative 2^-24 of q'), so sum_c q'_c code_c =
 * sq H + sql L with H, L exact integer sums differs from the exact dot product by at most
 * max|q'| 2^-31 sum_c code_c: below the fp32 dot product's own rounding (docs/cpu.md "Accuracy"). */
void el_quant_q16(E *e, LLVMValueRef *q, int nb, LLVMValueRef *hi, LLVMValueRef *lo, LLVMValueRef *sq,
                      LLVMValueRef *sql)
{
    LLVMBuilderRef b = e->b;
    LLVMValueRef amax = el_abs_max(e, q, nb);
    LLVMValueRef pos = LLVMBuildFCmp(b, LLVMRealOGT, amax, el_cf(e, 0.0), "");
    LLVMValueRef inv = LLVMBuildSelect(b, pos, LLVMBuildFDiv(b, el_cf(e, 32767.0), amax, ""), el_cf(e, 0.0), "");
    *sq = LLVMBuildFDiv(b, amax, el_cf(e, 32767.0), "");
    *sql = LLVMBuildFMul(b, *sq, el_cf(e, 1.0 / 32768.0), "");
    LLVMValueRef iv = el_splat(e, inv), h32[16], l32[16];
    for (int i = 0; i < nb; i++) {
        LLVMValueRef x = LLVMBuildFMul(b, q[i], iv, "");
        LLVMValueRef ra[1] = {x};
        LLVMValueRef h = el_call_intrinsic(e, "llvm.rint", e->vf, ra, 1);
        LLVMValueRef la[1] = {LLVMBuildFMul(b, LLVMBuildFSub(b, x, h, ""), el_vfc(e, 32768.0), "")};
        LLVMValueRef l = el_call_intrinsic(e, "llvm.rint", e->vf, la, 1);
        h32[i] = LLVMBuildFPToSI(b, h, e->vi, "");
        l32[i] = LLVMBuildFPToSI(b, l, e->vi, "");
    }
    for (int u = 0; u < nb / 2; u++) {
        hi[u] = el_pack16(e, h32[2 * u], h32[2 * u + 1]);
        lo[u] = el_pack16(e, l32[2 * u], l32[2 * u + 1]);
    }
}

/* acc + the products of 64 unsigned bytes (a) and 64 signed bytes (b), four adjacent products to an i32 lane
 * (vpdpbusd: 64 MACs, exact in int32). */
LLVMValueRef el_dpbusd(E *e, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b)
{
    return el_vnni_dot(e, "llvm.x86.avx512.vpdpbusd.512", acc, a, b);
}

/* The int8 key path's byte order: the 2-bit codes of a token (32 bytes, byte j = channels 4j..4j+3, layout.h)
 * become two vectors of 64 unsigned bytes by shifts and a mask, without moving a byte: A = codes of channels 4j
 * (bytes 0..31) and 4j+1 (bytes 32..63), B = channels 4j+2 and 4j+3. The query's pieces are laid out in the same
 * order once per tile, so each vpdpbusd lane multiplies matching channels. */
int el_q8_channel(int byte, int vec) { return 4 * (byte % 32) + 2 * vec + byte / 32; }

void el_codes8(E *e, LLVMValueRef row, LLVMValueRef *A, LLVMValueRef *B)
{
    LLVMTypeRef b32 = LLVMVectorType(e->i8, 32), b64 = LLVMVectorType(e->i8, 64);
    LLVMTypeRef i16 = LLVMInt16TypeInContext(e->c), w32 = LLVMVectorType(i16, 32);
    LLVMValueRef bytes = el_load(e, b32, row, 1), idx[64], sa[32], sb[32], m3[64];
    for (int i = 0; i < 64; i++) {
        idx[i] = el_ci32(e, i % 32);
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
void el_q8_pieces(E *e, LLVMValueRef xs, LLVMValueRef ps[3])
{
    LLVMBuilderRef b = e->b;
    LLVMValueRef ra[1] = {xs};
    LLVMValueRef x = el_call_intrinsic(e, "llvm.rint", e->vf, ra, 1);
    LLVMValueRef ha[1] = {LLVMBuildFMul(b, x, el_vfc(e, 1.0 / 16384.0), "")};
    LLVMValueRef hi = el_call_intrinsic(e, "llvm.rint", e->vf, ha, 1);
    LLVMValueRef r = LLVMBuildFSub(b, x, LLVMBuildFMul(b, hi, el_vfc(e, 16384.0), ""), "");
    LLVMValueRef ma[1] = {LLVMBuildFMul(b, r, el_vfc(e, 1.0 / 128.0), "")};
    LLVMValueRef mid = el_call_intrinsic(e, "llvm.rint", e->vf, ma, 1);
    ps[0] = hi, ps[1] = mid, ps[2] = LLVMBuildFSub(b, r, LLVMBuildFMul(b, mid, el_vfc(e, 128.0), ""), "");
}

/* The folded query q' (8 vectors of 16: head_dim 128) as three signed 7-bit pieces in codes8's byte order:
 *   x_c = rint(q'_c / sq), sq = max|q'| / (127 2^14), so |x_c| <= 127 2^14 < 2^21 (exact in fp32);
 *   x = hi 2^14 + mid 2^7 + lo, hi = rint(x 2^-14) in [-127, 127], mid, lo in [-64, 64] (exact).
 * So q'_c = sq x_c within sq / 2 = max|q'| 2^-22 / 1.016, and sum_c q'_c code_c = sq (2^14 H + 2^7 M + L) with H, M,
 * L the exact integer dot products of the pieces (|.| <= 128 3 127 2^14 < 2^31 after the combination: 2-bit
 * codes only). Error per logit at most max|q'| 2^-22 sum_c code_c, against the int16 pair's 2^-31: ~1e-5 of
 * max|q'| at 128 channels, below the 1e-3 the tests hold every path to (docs/cpu.md "Accuracy"). */
void el_quant_q8(E *e, LLVMValueRef *q, int nb, LLVMValueRef *qa, LLVMValueRef *qb, LLVMValueRef *sq)
{
    LLVMBuilderRef b = e->b;
    const double R = 127.0 * 16384.0;
    LLVMValueRef amax = el_abs_max(e, q, nb);
    LLVMValueRef pos = LLVMBuildFCmp(b, LLVMRealOGT, amax, el_cf(e, 0.0), "");
    LLVMValueRef inv = LLVMBuildSelect(b, pos, LLVMBuildFDiv(b, el_cf(e, R), amax, ""), el_cf(e, 0.0), "");
    *sq = LLVMBuildFDiv(b, amax, el_cf(e, R), "");
    LLVMValueRef iv = el_splat(e, inv), piece[3][16];
    for (int i = 0; i < nb; i++) {
        LLVMValueRef ps[3];
        el_q8_pieces(e, LLVMBuildFMul(b, q[i], iv, ""), ps);
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
                for (int l = 0; l < 2 * w; l++) cat[l] = el_ci32(e, l);
                cur[i] = LLVMBuildShuffleVector(b, cur[2 * i], cur[2 * i + 1], LLVMConstVector(cat, (unsigned)(2 * w)), "");
            }
        LLVMValueRef ia[64], ib[64];
        for (int l = 0; l < 64; l++) {
            ia[l] = el_ci32(e, el_q8_channel(l, 0));
            ib[l] = el_ci32(e, el_q8_channel(l, 1));
        }
        LLVMValueRef all = cur[0], pz = LLVMGetPoison(LLVMTypeOf(all));
        qa[p] = LLVMBuildBitCast(b, LLVMBuildShuffleVector(b, all, pz, LLVMConstVector(ia, 64), ""), e->vi, "");
        qb[p] = LLVMBuildBitCast(b, LLVMBuildShuffleVector(b, all, pz, LLVMConstVector(ib, 64), ""), e->vi, "");
    }
}

/* A parameter stored in `bytes` (2: fp16, 4: fp32) as fp32: element `idx` (an i64) of the section at sec. */
LLVMValueRef el_param_scalar(E *e, LLVMValueRef sec, LLVMValueRef idx, int bytes)
{
    LLVMValueRef p = el_gep(e, sec, LLVMBuildMul(e->b, idx, el_ci64(e, bytes), ""));
    if (bytes == 4) return el_load(e, e->f32, p, 1);
    return LLVMBuildFPExt(e->b, el_load(e, e->f16, p, 1), e->f32, "");
}
/* n consecutive entries idx.. of a parameter section as a vector of n floats. */
LLVMValueRef el_param_group_vec(E *e, LLVMValueRef sec, LLVMValueRef idx, int n, int bytes)
{
    LLVMValueRef p = el_gep(e, sec, LLVMBuildMul(e->b, idx, el_ci64(e, bytes), ""));
    if (bytes == 4) return el_load(e, LLVMVectorType(e->f32, (unsigned)n), p, 1);
    return LLVMBuildFPExt(e->b, el_load(e, LLVMVectorType(e->f16, (unsigned)n), p, 1), LLVMVectorType(e->f32, (unsigned)n), "");
}
/* A scalar in every lane of an n-lane vector. */
LLVMValueRef el_splat_n(E *e, LLVMValueRef s, int n)
{
    LLVMTypeRef vt = LLVMVectorType(LLVMTypeOf(s), (unsigned)n);
    LLVMValueRef v = LLVMBuildInsertElement(e->b, LLVMGetUndef(vt), s, el_ci32(e, 0), "");
    return LLVMBuildShuffleVector(e->b, v, LLVMGetUndef(vt), LLVMConstNull(LLVMVectorType(e->i32, (unsigned)n)), "");
}
/* Lanes c0.. of a per-channel section [D]. */
LLVMValueRef el_param_vec(E *e, LLVMValueRef sec, int c0, int bytes)
{
    LLVMValueRef p = el_gepc(e, sec, (long)c0 * bytes);
    if (bytes == 4) return el_load(e, e->vf, p, 4);
    return LLVMBuildFPExt(e->b, el_load(e, LLVMVectorType(e->f16, (unsigned)e->W), p, 2), e->vf, "");
}

/* A parameter of a page of format f whose entries are `bytes` wide: 0 (the format stores none: `absent`, 1 for
 * the scale of e4m3 / e5m2, 0 for the zero of a symmetric format: kvq_format_dequant), 1 (nvfp4's e4m3 / mxfp4's
 * e8m0 scale), 2 or 4. Element idx, and lanes c0.. of a per-channel section. */
LLVMValueRef el_fparam_scalar(E *e, const kvq_page_format *f, LLVMValueRef sec, LLVMValueRef idx, int bytes,
                                  double absent)
{
    if (bytes == 0) return el_cf(e, absent);
    if (bytes == 1) return emit_llvm_format_scale8(e->b, f->format.kind, el_load(e, e->i8, el_gep(e, sec, idx), 1));
    return el_param_scalar(e, sec, idx, bytes);
}
LLVMValueRef el_fparam_vec(E *e, const kvq_page_format *f, LLVMValueRef sec, int c0, int bytes, double absent)
{
    if (bytes == 0) return el_vfc(e, absent);
    if (bytes == 1)
        return emit_llvm_format_scale8(e->b, f->format.kind,
                                       el_load(e, LLVMVectorType(e->i8, (unsigned)e->W), el_gepc(e, sec, c0), 1));
    return el_param_vec(e, sec, c0, bytes);
}

/* Per-token parameters of token t for lanes c0..: one group per lane set (broadcast), or per lane when a group
 * is narrower than the vector. */
LLVMValueRef el_token_param(E *e, const kvq_page_format *f, LLVMValueRef sec, LLVMValueRef t64, int c0,
                                int bytes, double absent)
{
    if (f->hidden) return el_splat(e, el_fparam_scalar(e, f, sec, t64, bytes, absent));
    int G = f->group, ng = f->head_dim / G;
    LLVMValueRef base = LLVMBuildMul(e->b, t64, el_ci64(e, ng), "");
    if (c0 / G == (c0 + e->W - 1) / G)
        return el_splat(e, el_fparam_scalar(e, f, sec, LLVMBuildAdd(e->b, base, el_ci64(e, c0 / G), ""), bytes, absent));
    LLVMValueRef v = LLVMGetPoison(e->vf), s = NULL;
    for (int i = 0; i < e->W; i++) {
        if (i == 0 || (c0 + i) / G != (c0 + i - 1) / G)
            s = el_fparam_scalar(e, f, sec, LLVMBuildAdd(e->b, base, el_ci64(e, (c0 + i) / G), ""), bytes, absent);
        v = LLVMBuildInsertElement(e->b, v, s, el_ci32(e, i), "");
    }
    return v;
}

/* The tensor scale T of a page of format f (the fp32 at t_sec: this kv head's), 1 for formats without one. */
LLVMValueRef el_tensor_scale(E *e, const kvq_page_format *f, LLVMValueRef t_sec)
{
    if (!kvq_format_has_tensor_scale(f->format.kind)) return el_cf(e, 1.0);
    return el_load(e, e->f32, t_sec, 4);
}

/* Lanes c0.. of row t (i32) of a source, dequantized to fp32 exactly as ref_page_read does: z + (s T) L[code]
 * (kvq_format_dequant; for integers z + s * code) in its roundings, times the channel factor when
 * channel-separable. */
LLVMValueRef el_row_f32(E *e, const emit_llvm_src *src, int D, LLVMValueRef base, LLVMValueRef s_sec,
                            LLVMValueRef z_sec, LLVMValueRef f_sec, LLVMValueRef t_sec, LLVMValueRef t, int c0)
{
    LLVMValueRef t64 = LLVMBuildZExt(e->b, t, e->i64, "");
    if (src->fp16) {
        LLVMValueRef p = el_gep(e, base, LLVMBuildAdd(e->b, LLVMBuildMul(e->b, t64, el_ci64(e, (long)D * 2), ""),
                                                     el_ci64(e, (long)c0 * 2), ""));
        return LLVMBuildFPExt(e->b, el_load(e, LLVMVectorType(e->f16, (unsigned)e->W), p, 2), e->vf, "");
    }
    const kvq_page_format *f = &src->fmt;
    if (f->tq != KVQ_TQ_NONE) { /* TurboQuant: norm_j L_j[code] (emit_llvm_turboquant.c) */
        LLVMValueRef tr = el_gep(e, base, LLVMBuildMul(e->b, t64, el_ci64(e, (long)emit_llvm_tq_row_bytes(f)), ""));
        LLVMValueRef tn = el_gep(e, s_sec, LLVMBuildMul(e->b, t64, el_ci64(e, f->tq_out ? 8 : 4), ""));
        return emit_llvm_tq_row(e->b, f, e->vf, tr, tn, c0, e->perm16);
    }
    LLVMValueRef row = el_gep(e, base, LLVMBuildMul(e->b, t64, el_ci64(e, (long)kvq_code_bytes(D, f->bits)), ""));
    LLVMValueRef code = el_codes_f32(e, f, row, c0), s, z;
    if (f->gran == KVQ_GRAN_CHANNEL) {
        s = el_fparam_vec(e, f, s_sec, c0, f->scale_bytes, 1.0);
        z = el_fparam_vec(e, f, z_sec, c0, f->zero_bytes, 0.0);
    } else {
        s = el_token_param(e, f, s_sec, t64, c0, f->scale_bytes, 1.0);
        z = el_token_param(e, f, z_sec, t64, c0, f->zero_bytes, 0.0);
    }
    if (kvq_format_has_tensor_scale(f->format.kind)) s = LLVMBuildFMul(e->b, s, el_splat(e, el_tensor_scale(e, f, t_sec)), "");
    LLVMValueRef x = LLVMBuildFMul(e->b, s, code, "");
    if (f->zero_bytes) x = LLVMBuildFAdd(e->b, z, x, ""); /* absent: z = 0, and 0 + x is x (up to the sign of 0) */
    if (f->channel_separable) x = LLVMBuildFMul(e->b, x, el_param_vec(e, f_sec, c0, f->scale_bytes), "");
    return x;
}

int el_src_fold(const emit_llvm_src *s) { return emit_llvm_paged_keys(s); }

#endif
