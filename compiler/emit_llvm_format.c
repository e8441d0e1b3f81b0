/* The element decode of kvq's formats beyond asymmetric integers as IR (emit_llvm_format.h): the level L[code]
 * of every format and the one-byte group scales, by bit manipulation where a format is a bit pattern (no table
 * load in the inner loop, no fp32 subnormal operand) and by a select tree over a codebook's levels. Every function equals the reference's
 * table (runtime/quant.c: kvq_format_levels, kvq_format_scale8_decode) on every code; test_cpu_formats checks
 * the decoded attention of every spec in specs/formats/ against the reference backend. */
#include "emit_llvm_format.h"

#ifdef KVQ_HAVE_LLVM
#include <math.h>
#include <string.h>

#include "quant.h"

/* The type with `like`'s shape (scalar or vector) and element `el`. */
static LLVMTypeRef shaped(LLVMTypeRef like, LLVMTypeRef el)
{
    if (LLVMGetTypeKind(like) == LLVMVectorTypeKind) return LLVMVectorType(el, LLVMGetVectorSize(like));
    return el;
}

/* The scalar constant k in every lane of type ty (or k itself when ty is scalar). */
static LLVMValueRef cshape(LLVMTypeRef ty, LLVMValueRef k)
{
    if (LLVMGetTypeKind(ty) != LLVMVectorTypeKind) return k;
    unsigned n = LLVMGetVectorSize(ty);
    LLVMValueRef el[64];
    for (unsigned i = 0; i < n && i < 64; i++) el[i] = k;
    return LLVMConstVector(el, n);
}

typedef struct {
    LLVMBuilderRef b;
    LLVMTypeRef ity, fty, i32, f32;
} Sh;

static Sh shape_of(LLVMBuilderRef b, LLVMValueRef code)
{
    LLVMTypeRef ty = LLVMTypeOf(code);
    LLVMContextRef c = LLVMGetTypeContext(ty);
    Sh s = {b, ty, NULL, LLVMInt32TypeInContext(c), LLVMFloatTypeInContext(c)};
    s.fty = shaped(ty, s.f32);
    return s;
}
static LLVMValueRef ki(const Sh *s, long v) { return cshape(s->ity, LLVMConstInt(s->i32, (unsigned long long)v, 1)); }
static LLVMValueRef kf(const Sh *s, double v) { return cshape(s->fty, LLVMConstReal(s->f32, v)); }

/* A minifloat of e exponent bits above m mantissa bits (exponent bias `bias`; inf/NaN encodings not handled
 * here), in integer operations and one exact conversion, never an arithmetic on an fp32 subnormal (x86 takes a
 * microcode assist of ~100 cycles per such operation: e2m1's 0 and 0.5 are subnormal codes, and a kernel that
 * multiplied them measured ~20x slower): a normal code's magnitude bits shifted to the top of fp32's mantissa
 * plus (127 - bias) in the exponent field are its fp32 bits; a subnormal code (exponent field 0) is its
 * mantissa M times 2^(1 - bias - m), exact. The sign bit goes to bit 31. */
static LLVMValueRef minifloat(const Sh *s, LLVMValueRef code, int e, int m, int bias)
{
    LLVMBuilderRef b = s->b;
    int nb = 1 + e + m;
    LLVMValueRef mag = LLVMBuildAnd(b, code, ki(s, (1L << (nb - 1)) - 1), "");
    LLVMValueRef nbits = LLVMBuildAdd(b, LLVMBuildShl(b, mag, ki(s, 23 - m), ""), ki(s, (long)(127 - bias) << 23), "");
    LLVMValueRef normal = LLVMBuildBitCast(b, nbits, s->fty, "");
    LLVMValueRef sub = LLVMBuildFMul(b, LLVMBuildUIToFP(b, mag, s->fty, ""), kf(s, ldexp(1.0, 1 - bias - m)), "");
    LLVMValueRef is_sub = LLVMBuildICmp(b, LLVMIntULT, mag, ki(s, 1L << m), "");
    LLVMValueRef v = LLVMBuildSelect(b, is_sub, sub, normal, "");
    LLVMValueRef sign = LLVMBuildShl(b, LLVMBuildAnd(b, code, ki(s, 1L << (nb - 1)), ""), ki(s, 32 - nb), "");
    return LLVMBuildBitCast(b, LLVMBuildOr(b, LLVMBuildBitCast(b, v, s->ity, ""), sign, ""), s->fty, "");
}

/* e4m3 (float8_e4m3fn, bias 7): 0x7f and 0xff are NaN; `nan` is what they decode to. */
static LLVMValueRef e4m3(const Sh *s, LLVMValueRef code, LLVMValueRef nan)
{
    LLVMValueRef x = minifloat(s, code, 4, 3, 7);
    LLVMValueRef isnan = LLVMBuildICmp(s->b, LLVMIntEQ, LLVMBuildAnd(s->b, code, ki(s, 0x7f), ""), ki(s, 0x7f), "");
    return LLVMBuildSelect(s->b, isnan, nan, x, "");
}

/* Levels of a codebook (the reference's table): a select tree on the code's bits, lowest bit first. */
static LLVMValueRef table_select(const Sh *s, const float *table, int bits, LLVMValueRef code)
{
    LLVMValueRef v[256];
    int n = 1 << bits;
    for (int i = 0; i < n; i++) v[i] = kf(s, table[i]);
    for (int k = 0; k < bits; k++, n /= 2) {
        LLVMValueRef bit = LLVMBuildAnd(s->b, code, ki(s, 1L << k), "");
        LLVMValueRef set = LLVMBuildICmp(s->b, LLVMIntNE, bit, ki(s, 0), "");
        for (int j = 0; j < n / 2; j++) v[j] = LLVMBuildSelect(s->b, set, v[2 * j + 1], v[2 * j], "");
    }
    return v[0];
}

LLVMValueRef emit_llvm_format_level(LLVMBuilderRef b, const kvq_format_cfg *f, int bits, LLVMValueRef code,
                                    int permute16)
{
    Sh s = shape_of(b, code);
    switch (f->kind) {
    case KVQ_FMT_INT:
    case KVQ_FMT_Q4_1:
    case KVQ_FMT_Q5_1: return LLVMBuildUIToFP(b, code, s.fty, "");
    case KVQ_FMT_INT_SYM:
    case KVQ_FMT_Q8_0:
    case KVQ_FMT_Q4_0:
    case KVQ_FMT_Q5_0: /* the implied zero 2^(b-1) (kvq_format_levels) */
        return LLVMBuildSIToFP(b, LLVMBuildSub(b, code, ki(&s, 1L << (bits - 1)), ""), s.fty, "");
    case KVQ_FMT_E4M3: return e4m3(&s, code, kf(&s, 0.0)); /* NaN codes decode to 0, as the reference's table */
    case KVQ_FMT_E5M2: {
        /* e5m2 is fp16's upper byte; its infinities and NaNs (exponent 31) decode to 0, as the table */
        LLVMContextRef c = LLVMGetTypeContext(s.ity);
        LLVMTypeRef i16 = shaped(s.ity, LLVMInt16TypeInContext(c)), h = shaped(s.ity, LLVMHalfTypeInContext(c));
        LLVMValueRef hb = LLVMBuildShl(b, LLVMBuildTrunc(b, code, i16, ""), cshape(i16, LLVMConstInt(LLVMInt16TypeInContext(c), 8, 0)), "");
        LLVMValueRef x = LLVMBuildFPExt(b, LLVMBuildBitCast(b, hb, h, ""), s.fty, "");
        LLVMValueRef special = LLVMBuildICmp(b, LLVMIntEQ, LLVMBuildAnd(b, code, ki(&s, 0x7c), ""), ki(&s, 0x7c), "");
        return LLVMBuildSelect(b, special, kf(&s, 0.0), x, "");
    }
    case KVQ_FMT_NVFP4:
    case KVQ_FMT_MXFP4: return minifloat(&s, code, 2, 1, 1); /* e2m1: no inf/NaN encodings */
    default: {
        float table[256];
        kvq_format_levels(f, bits, table);
        if (permute16 && bits <= 4 && LLVMGetTypeKind(s.ity) == LLVMVectorTypeKind &&
            LLVMGetVectorSize(s.ity) == 16) {
            /* AVX-512: the (up to 16) levels in one register, one vpermps per vector of codes */
            LLVMValueRef lv[16];
            for (int i = 0; i < 16; i++) lv[i] = LLVMConstReal(s.f32, i < (1 << bits) ? table[i] : 0.0);
            LLVMModuleRef m = LLVMGetGlobalParent(LLVMGetBasicBlockParent(LLVMGetInsertBlock(b)));
            const char *name = "llvm.x86.avx512.permvar.sf.512";
            unsigned id = LLVMLookupIntrinsicID(name, strlen(name));
            LLVMValueRef fn = LLVMGetIntrinsicDeclaration(m, id, NULL, 0);
            LLVMTypeRef ft = LLVMIntrinsicGetType(LLVMGetTypeContext(s.ity), id, NULL, 0);
            LLVMValueRef args[2] = {LLVMConstVector(lv, 16), code};
            return LLVMBuildCall2(b, ft, fn, args, 2, "");
        }
        return table_select(&s, table, bits, code);
    }
    }
}

LLVMValueRef emit_llvm_format_scale8(LLVMBuilderRef b, kvq_format_kind k, LLVMValueRef byte)
{
    LLVMContextRef c = LLVMGetTypeContext(LLVMTypeOf(byte));
    LLVMValueRef code = LLVMBuildZExt(b, byte, shaped(LLVMTypeOf(byte), LLVMInt32TypeInContext(c)), "");
    Sh s = shape_of(b, code);
    LLVMValueRef nan = kf(&s, NAN); /* as kvq_f32_from_e4m3 / _e8m0: never stored by the quantizer */
    if (k != KVQ_FMT_MXFP4) return e4m3(&s, code, nan);
    /* e8m0: 2^(c - 127); c = 0 is fp32's subnormal 2^-127 (bit 22), 0xff NaN */
    LLVMValueRef x = LLVMBuildBitCast(b, LLVMBuildShl(b, code, ki(&s, 23), ""), s.fty, "");
    LLVMValueRef zero = LLVMBuildICmp(b, LLVMIntEQ, code, ki(&s, 0), "");
    x = LLVMBuildSelect(b, zero, LLVMBuildBitCast(b, ki(&s, 1L << 22), s.fty, ""), x, "");
    LLVMValueRef top = LLVMBuildICmp(b, LLVMIntEQ, code, ki(&s, 0xff), "");
    return LLVMBuildSelect(b, top, nan, x, "");
}
#else
typedef int emit_llvm_format_unused; /* ISO C: no empty translation unit */
#endif
