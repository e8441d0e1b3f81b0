/* LLVM IR for the cpu backend's decode tiles (emit_llvm.h, docs/cpu.md). One function per (K source, V source)
 * pair, everything known at emission time folded: head_dim, GQA ratio g, the vector width W, bits, group sizes,
 * parameter dtypes, the mask. Straight-line code where it is bounded; loops where its size grows with head_dim x
 * g (the K phase's channels at GQA > 1, docs/cpu.md "Compile time"). The kernel's three phases:
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
#include "emit_llvm_build.h"
#include "emit_llvm_ir.h"

/* The softmax of one query head: the tile's max m' against the running m, p = e^(s - m') over the tile's
 * occupied blocks of W lanes (lanes past n are not tokens: p = 0), l' = l e^(m - m') + sum p. mlp: the head's
 * (m, l) pair; prow: its row of the p scratch; mt: its max over the tile; iota_v, n_v: the lanes' indices and n
 * as vectors. Returns e^(m - m') as a vector (all lanes equal): acc's rescale happens where the V phase loads it. */
static LLVMValueRef softmax_head(E *e, LLVMValueRef n, LLVMValueRef iota_v, LLVMValueRef n_v, LLVMValueRef mlp,
                                 LLVMValueRef prow, LLVMValueRef mt)
{
    int W = e->W, N = EMIT_LLVM_TILE;
    LLVMBuilderRef b = e->b;
    LLVMValueRef m_old = el_load(e, e->f32, mlp, 4), l_old = el_load(e, e->f32, el_gepc(e, mlp, 4), 4);
    LLVMValueRef m_new = el_fmax_sel(e, m_old, mt); /* the max after the last token */
    LLVMValueRef mn_v = el_splat(e, m_new);
    LLVMValueRef alpha_v = el_vexp(e, LLVMBuildFSub(b, el_splat(e, m_old), mn_v, ""));
    LLVMValueRef sum = NULL;
    /* Only the blocks that hold tokens (a tile cut by a 32-token K page fills half of 64 lanes): block bl > 0
     * runs when bl W < n. */
    for (int bl = 0; bl < N / W; bl++) {
        LLVMBasicBlockRef before = LLVMGetInsertBlock(b), doit = NULL, after = NULL;
        if (bl > 0) {
            doit = LLVMAppendBasicBlockInContext(e->c, e->fn, "sblk");
            after = LLVMAppendBasicBlockInContext(e->c, e->fn, "snext");
            LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, el_ci32(e, (long)bl * W), n, ""), doit, after);
            LLVMPositionBuilderAtEnd(b, doit);
        }
        LLVMValueRef pp = el_gepc(e, prow, (long)bl * W * 4);
        LLVMValueRef x = el_load(e, e->vf, pp, 4);
        LLVMValueRef valid = LLVMBuildICmp(b, LLVMIntSLT, LLVMBuildAdd(b, iota_v, el_vic(e, (long)bl * W), ""), n_v, "");
        LLVMValueRef pv = LLVMBuildSelect(b, valid, el_vexp(e, LLVMBuildFSub(b, x, mn_v, "")), el_vfc(e, 0.0), "");
        el_store(e, pv, pp, 4);
        LLVMValueRef sum1 = sum ? el_fm(LLVMBuildFAdd(b, sum, pv, "")) : pv;
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
    LLVMValueRef alpha = LLVMBuildExtractElement(b, alpha_v, el_ci32(e, 0), "");
    LLVMValueRef l_new = el_fm(LLVMBuildFAdd(b, LLVMBuildFMul(b, l_old, alpha, ""), el_hsum(e, sum), ""));
    el_store(e, m_new, mlp, 4);
    el_store(e, l_new, el_gepc(e, mlp, 4), 4);
    return alpha_v;
}

/* The softmax of a tile, once per query head (softmax_head); alpha_h[j] gets e^(m - m') of head j as a splat.
 * At GQA > 1 a loop over the heads (the heads' tile maxima and alphas through smx, [2g] fp32): g straight-line
 * copies of the N/W exponentials were the longest part of a module (docs/cpu.md "Compile time"). */
static void softmax(E *e, const emit_llvm_kernel *k, LLVMValueRef *a, const LLVMValueRef *mtile, LLVMValueRef smx,
                    LLVMValueRef *alpha_h)
{
    int g = k->gqa, W = e->W, N = EMIT_LLVM_TILE;
    LLVMBuilderRef b = e->b;
    LLVMValueRef n = a[A_N];
    LLVMValueRef iota[16];
    for (int i = 0; i < W; i++) iota[i] = el_ci32(e, i);
    LLVMValueRef iota_v = LLVMConstVector(iota, (unsigned)W), n_v = el_splat(e, n);
    if (g == 1) {
        alpha_h[0] = softmax_head(e, n, iota_v, n_v, a[A_ML], a[A_P], mtile[0]);
        return;
    }
    for (int j = 0; j < g; j++) el_store(e, mtile[j], el_gepc(e, smx, (long)j * 4), 4);
    LLVMBasicBlockRef pre = LLVMGetInsertBlock(b), head = LLVMAppendBasicBlockInContext(e->c, e->fn, "shead");
    LLVMBasicBlockRef exit = LLVMAppendBasicBlockInContext(e->c, e->fn, "sdone");
    LLVMBuildBr(b, head);
    LLVMPositionBuilderAtEnd(b, head);
    LLVMValueRef j = LLVMBuildPhi(b, e->i32, "j"), zero = el_ci32(e, 0);
    LLVMValueRef j64 = LLVMBuildZExt(b, j, e->i64, "");
    LLVMValueRef mlp = el_gep(e, a[A_ML], LLVMBuildMul(b, j64, el_ci64(e, 8), ""));
    LLVMValueRef prow = el_gep(e, a[A_P], LLVMBuildMul(b, j64, el_ci64(e, (long)N * 4), ""));
    LLVMValueRef mt = el_load(e, e->f32, el_gep(e, smx, LLVMBuildMul(b, j64, el_ci64(e, 4), "")), 4);
    LLVMValueRef alpha_v = softmax_head(e, n, iota_v, n_v, mlp, prow, mt);
    LLVMValueRef ap = el_gep(e, smx, LLVMBuildMul(b, LLVMBuildAdd(b, j64, el_ci64(e, g), ""), el_ci64(e, 4), ""));
    el_store(e, LLVMBuildExtractElement(b, alpha_v, zero, ""), ap, 4);
    LLVMValueRef j1 = LLVMBuildAdd(b, j, el_ci32(e, 1), "");
    LLVMBasicBlockRef latch = LLVMGetInsertBlock(b);
    LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLT, j1, el_ci32(e, g), ""), head, exit);
    LLVMAddIncoming(j, &zero, &pre, 1);
    LLVMAddIncoming(j, &j1, &latch, 1);
    LLVMPositionBuilderAtEnd(b, exit);
    for (int h = 0; h < g; h++) alpha_h[h] = el_splat(e, el_load(e, e->f32, el_gepc(e, smx, (long)(g + h) * 4), 4));
}

/* One kernel: the entry (the argument fields, the V phase's scratch), the K phase, the softmax, the V phase. */
static void build_kernel(E *e, const emit_llvm_kernel *k, const char *name)
{
    LLVMBuilderRef b = e->b;
    LLVMTypeRef params[1] = {e->ptr};
    LLVMTypeRef fty = LLVMFunctionType(LLVMVoidTypeInContext(e->c), params, 1, 0);
    e->fn = LLVMAddFunction(e->m, name, fty);
    LLVMValueRef args = LLVMGetParam(e->fn, 0);
    unsigned noalias = LLVMGetEnumAttributeKindForName("noalias", 7);
    LLVMAddAttributeAtIndex(e->fn, 1, LLVMCreateEnumAttribute(e->c, noalias, 0));

    LLVMBasicBlockRef entry = LLVMAppendBasicBlockInContext(e->c, e->fn, "entry");
    LLVMPositionBuilderAtEnd(b, entry);
    LLVMValueRef a[A_COUNT];
    for (int i = 0; i < A_COUNT; i++) a[i] = el_field(e, args, i);
    LLVMValueRef wh, wl, mtile[MAXG], alpha_h[MAXG], smx = NULL;
    el_v_scratch(e, k, &wh, &wl);
    if (k->gqa > 1) { /* the softmax's tile maxima and alphas per head */
        smx = LLVMBuildAlloca(b, LLVMArrayType(e->f32, (unsigned)(2 * k->gqa)), "smx");
        LLVMSetAlignment(smx, 16);
    }
    el_k_phase(e, k, a, mtile);
    softmax(e, k, a, mtile, smx, alpha_h);
    el_v_phase(e, k, a, alpha_h, wh, wl);
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
