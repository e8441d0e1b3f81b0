/* TurboQuant pages as IR (emit_llvm_turboquant.h). Codes are unpacked from the little-endian 32-bit words of
 * layout.h's bit order (a 3-bit code: a 2-bit plane then a 1-bit plane), per part; levels come from
 * emit_llvm_format_level over the part's Lloyd-Max table (base/lloyd_max.h, the table runtime/turboquant.c
 * quantizes with), so the cpu kernels decode what the reference decodes. */
#include "emit_llvm_turboquant.h"

#ifdef KVQ_HAVE_LLVM
#include "emit_llvm_format.h"
#include "lloyd_max.h"

/* Part j of a page format: first channel, channels, code bits (the MSE bits: prod spends one on QJL). */
typedef struct {
    int off, m, bits;
    size_t byte; /* first byte of its codes in a token's row */
} tq_part;

static int parts_of(const kvq_page_format *f, tq_part *p)
{
    int qjl = f->tq == KVQ_TQ_PROD, D = f->head_dim;
    if (!f->tq_out) {
        p[0] = (tq_part){0, D, f->bits - qjl, 0};
        return 1;
    }
    p[0] = (tq_part){0, f->tq_out, f->tq_out_bits - qjl, 0};
    p[1] = (tq_part){f->tq_out, D - f->tq_out, f->bits - qjl, kvq_code_bytes(f->tq_out, f->tq_out_bits - qjl)};
    return 2;
}

static const tq_part *part_at(const tq_part *p, int n, int c0) { return n == 2 && c0 >= p[1].off ? &p[1] : &p[0]; }

size_t emit_llvm_tq_row_bytes(const kvq_page_format *f)
{
    tq_part p[2];
    int n = parts_of(f, p);
    return p[n - 1].byte + kvq_code_bytes(p[n - 1].m, p[n - 1].bits);
}

static LLVMValueRef ci32(LLVMContextRef c, long v) { return LLVMConstInt(LLVMInt32TypeInContext(c), (unsigned long long)v, 1); }

static LLVMValueRef splat_i32(LLVMContextRef c, int W, long v)
{
    LLVMValueRef el[64];
    for (int i = 0; i < W; i++) el[i] = ci32(c, v);
    return LLVMConstVector(el, (unsigned)W);
}

/* Channels cp .. cp + W - 1 of a plane of b bits (1, 2, 4) that starts at `plane`, as W i32 lanes: channel c at
 * bits [(c b) % 32, +b) of word (c b) / 32. The plane is m b bits with m a multiple of 32, so every word read
 * lies inside it. */
static LLVMValueRef plane_codes(LLVMBuilderRef b, LLVMValueRef plane, int bits, int cp, int W)
{
    LLVMContextRef c = LLVMGetTypeContext(LLVMTypeOf(plane));
    LLVMTypeRef i8 = LLVMInt8TypeInContext(c), i32 = LLVMInt32TypeInContext(c);
    int w0 = cp * bits / 32, w1 = ((cp + W) * bits - 1) / 32, nw = w1 - w0 + 1;
    LLVMValueRef off = LLVMConstInt(LLVMInt64TypeInContext(c), (unsigned long long)w0 * 4, 0);
    LLVMValueRef p = LLVMBuildGEP2(b, i8, plane, &off, 1, "");
    LLVMTypeRef wt = LLVMVectorType(i32, (unsigned)nw);
    LLVMValueRef words = LLVMBuildLoad2(b, wt, p, "");
    LLVMSetAlignment(words, 1);
    LLVMValueRef idx[64], sh[64];
    for (int i = 0; i < W; i++) {
        int ch = cp + i;
        idx[i] = ci32(c, ch * bits / 32 - w0);
        sh[i] = ci32(c, (ch * bits) % 32);
    }
    LLVMValueRef v = LLVMBuildShuffleVector(b, words, LLVMGetPoison(wt), LLVMConstVector(idx, (unsigned)W), "");
    v = LLVMBuildLShr(b, v, LLVMConstVector(sh, (unsigned)W), "");
    return LLVMBuildAnd(b, v, splat_i32(c, W, (1L << bits) - 1), "");
}

static LLVMValueRef gep_bytes(LLVMBuilderRef b, LLVMValueRef base, size_t off)
{
    if (!off) return base;
    LLVMContextRef c = LLVMGetTypeContext(LLVMTypeOf(base));
    LLVMValueRef o = LLVMConstInt(LLVMInt64TypeInContext(c), (unsigned long long)off, 0);
    return LLVMBuildGEP2(b, LLVMInt8TypeInContext(c), base, &o, 1, "");
}

/* The fp32 entry j at p, in every lane. */
static LLVMValueRef entry_splat(LLVMBuilderRef b, LLVMValueRef p, int j, LLVMTypeRef vf)
{
    LLVMContextRef c = LLVMGetTypeContext(vf);
    LLVMTypeRef f32 = LLVMFloatTypeInContext(c);
    LLVMValueRef x = LLVMBuildLoad2(b, f32, gep_bytes(b, p, (size_t)j * 4), "");
    LLVMSetAlignment(x, 4);
    unsigned W = LLVMGetVectorSize(vf);
    LLVMValueRef v = LLVMBuildInsertElement(b, LLVMGetPoison(vf), x, ci32(c, 0), "");
    LLVMValueRef z[64];
    for (unsigned i = 0; i < W; i++) z[i] = ci32(c, 0);
    return LLVMBuildShuffleVector(b, v, LLVMGetPoison(vf), LLVMConstVector(z, W), "");
}

LLVMValueRef emit_llvm_tq_row(LLVMBuilderRef b, const kvq_page_format *f, LLVMTypeRef vf, LLVMValueRef row,
                              LLVMValueRef norms, int c0, int permute16)
{
    tq_part ps[2];
    int n = parts_of(f, ps), W = (int)LLVMGetVectorSize(vf);
    const tq_part *p = part_at(ps, n, c0);
    int cp = c0 - p->off;
    LLVMValueRef base = gep_bytes(b, row, p->byte), code;
    if (p->bits == 3) { /* a 2-bit plane of m / 4 bytes, then the high bits' 1-bit plane */
        LLVMValueRef lo = plane_codes(b, base, 2, cp, W);
        LLVMValueRef hi = plane_codes(b, gep_bytes(b, base, (size_t)p->m / 4), 1, cp, W);
        code = LLVMBuildOr(b, lo, LLVMBuildShl(b, hi, splat_i32(LLVMGetTypeContext(vf), W, 2), ""), "");
    } else {
        code = plane_codes(b, base, p->bits, cp, W);
    }
    /* The part's levels: the Lloyd-Max levels of N(0, 1/m) at its bits, as kvq_tq_init computes them */
    double lv[16];
    kvq_format_cfg cb = {.kind = KVQ_FMT_CODEBOOK, .n_levels = 1 << p->bits};
    kvq_lloyd_max_normal_dim(p->bits, p->m, lv, NULL);
    for (int i = 0; i < cb.n_levels; i++) cb.levels[i] = (float)lv[i];
    LLVMValueRef level = emit_llvm_format_level(b, &cb, p->bits, code, permute16);
    return LLVMBuildFMul(b, entry_splat(b, norms, p == &ps[1], vf), level, "");
}

LLVMValueRef emit_llvm_tq_qjl(LLVMBuilderRef b, const kvq_page_format *f, LLVMTypeRef vf, LLVMValueRef signs,
                              LLVMValueRef rnorms, int c0)
{
    tq_part ps[2];
    int n = parts_of(f, ps), W = (int)LLVMGetVectorSize(vf);
    const tq_part *p = part_at(ps, n, c0);
    LLVMContextRef c = LLVMGetTypeContext(vf);
    /* the parts' sign bits are consecutive in the token's D-bit row (offsets are multiples of 32) */
    LLVMValueRef bit = plane_codes(b, signs, 1, c0, W);
    LLVMValueRef set = LLVMBuildICmp(b, LLVMIntNE, bit, splat_i32(c, W, 0), "");
    LLVMValueRef r = entry_splat(b, rnorms, p == &ps[1], vf);
    return LLVMBuildSelect(b, set, r, LLVMBuildFNeg(b, r, ""), "");
}
#else
typedef int emit_llvm_turboquant_unused; /* ISO C: no empty translation unit */
#endif
