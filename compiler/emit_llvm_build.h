/* Internal to the cpu code generator (emit_llvm.h, docs/cpu.md): the emitter's state and the IR building blocks
 * that its files share. emit_llvm.c builds a tile kernel from the key phase (emit_llvm_key.c), the softmax and the
 * value phase (emit_llvm_value.c); emit_llvm_ops.c holds the generic IR helpers (constants, addresses, sums,
 * reductions, e^x), emit_llvm_codes.c the unpacking of codes, the integer pieces of the VNNI paths and the
 * dequantization parameters. */
#ifndef KVQ_EMIT_LLVM_BUILD_H
#define KVQ_EMIT_LLVM_BUILD_H

#ifdef KVQ_HAVE_LLVM
#include <llvm-c/Core.h>

#include "emit_llvm.h"

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
static inline int arg_is_i32(int i) { return i == A_N || i == A_KMBIT || i == A_NKP; }

#define MAXG 64 /* query heads per kv head */
#define MAXB 64 /* D / W blocks: 256 / 4 */

/* ---- emit_llvm_ops.c: constants, addresses, loads and stores, free-order sums, reductions, e^x ---- */
LLVMValueRef el_ci32(E *e, long v);
LLVMValueRef el_ci64(E *e, long v);
LLVMValueRef el_cf(E *e, double v);
LLVMValueRef el_splat_const(LLVMValueRef s, int W);
LLVMValueRef el_vfc(E *e, double v);
LLVMValueRef el_vic(E *e, long v);
LLVMValueRef el_splat(E *e, LLVMValueRef s);
LLVMValueRef el_gep(E *e, LLVMValueRef base, LLVMValueRef off);
LLVMValueRef el_gepc(E *e, LLVMValueRef base, long off);
LLVMValueRef el_load(E *e, LLVMTypeRef ty, LLVMValueRef p, unsigned align);
void el_store(E *e, LLVMValueRef v, LLVMValueRef p, unsigned align);
LLVMValueRef el_fm(LLVMValueRef v);
LLVMValueRef el_fma_sum(E *e, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b);
LLVMValueRef el_call_intrinsic(E *e, const char *name, LLVMTypeRef overload, LLVMValueRef *args, unsigned n);
int el_is_int_vec(LLVMValueRef v);
LLVMValueRef el_hsum(E *e, LLVMValueRef v);
LLVMValueRef el_pair_fold(E *e, LLVMValueRef a, LLVMValueRef b);
void el_hsum_many(E *e, LLVMValueRef *v, int g, LLVMValueRef *out);
LLVMValueRef el_fmax_sel(E *e, LLVMValueRef a, LLVMValueRef b);
LLVMValueRef el_hmax(E *e, LLVMValueRef v);
LLVMValueRef el_vexp(E *e, LLVMValueRef x);
LLVMValueRef el_field(E *e, LLVMValueRef args, int i);

/* The lane-sum tree fed one vector at a time (W vectors in all, W a power of two): a pair folds as soon as both
 * of its halves exist, so few partial vectors are live while a block of tokens is computed. After the W-th push
 * v[0] is one vector whose lane i is the lane sum of the i-th vector pushed. */
typedef struct {
    LLVMValueRef v[8];
    int lvl[8], n;
} sum_tree;
void el_tree_push(E *e, sum_tree *tr, LLVMValueRef x);

/* ---- emit_llvm_codes.c: codes to lanes, q' and weights as int16/int8 pieces, page parameters ---- */
LLVMValueRef el_unpack_plane(E *e, LLVMValueRef row, int b, int c0);
LLVMValueRef el_codes_int(E *e, const kvq_page_format *f, LLVMValueRef row, int c0);
LLVMValueRef el_codes_f32(E *e, const kvq_page_format *f, LLVMValueRef row, int c0);
int el_fmt_int(const kvq_page_format *f);
LLVMValueRef el_unpack_plane16(E *e, LLVMValueRef row, int b, int c0);
LLVMValueRef el_codes16(E *e, const kvq_page_format *f, LLVMValueRef row, int c0);
LLVMValueRef el_vnni_dot(E *e, const char *name, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b);
LLVMValueRef el_dpwssd(E *e, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b);
LLVMValueRef el_pack16(E *e, LLVMValueRef a, LLVMValueRef b);
LLVMValueRef el_abs_max(E *e, LLVMValueRef *q, int nb);
void el_quant_q16(E *e, LLVMValueRef *q, int nb, LLVMValueRef *hi, LLVMValueRef *lo, LLVMValueRef *sq, LLVMValueRef *sql);
LLVMValueRef el_dpbusd(E *e, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b);
int el_q8_channel(int byte, int vec);
void el_codes8(E *e, LLVMValueRef row, LLVMValueRef *A, LLVMValueRef *B);
void el_q8_pieces(E *e, LLVMValueRef xs, LLVMValueRef ps[3]);
void el_quant_q8(E *e, LLVMValueRef *q, int nb, LLVMValueRef *qa, LLVMValueRef *qb, LLVMValueRef *sq);
LLVMValueRef el_param_scalar(E *e, LLVMValueRef sec, LLVMValueRef idx, int bytes);
LLVMValueRef el_param_group_vec(E *e, LLVMValueRef sec, LLVMValueRef idx, int n, int bytes);
LLVMValueRef el_splat_n(E *e, LLVMValueRef s, int n);
LLVMValueRef el_param_vec(E *e, LLVMValueRef sec, int c0, int bytes);
LLVMValueRef el_fparam_scalar(E *e, const kvq_page_format *f, LLVMValueRef sec, LLVMValueRef idx, int bytes, double absent);
LLVMValueRef el_fparam_vec(E *e, const kvq_page_format *f, LLVMValueRef sec, int c0, int bytes, double absent);
LLVMValueRef el_token_param(E *e, const kvq_page_format *f, LLVMValueRef sec, LLVMValueRef t64, int c0, int bytes, double absent);
LLVMValueRef el_tensor_scale(E *e, const kvq_page_format *f, LLVMValueRef t_sec);
LLVMValueRef el_row_f32(E *e, const emit_llvm_src *src, int D, LLVMValueRef base, LLVMValueRef s_sec, LLVMValueRef z_sec, LLVMValueRef f_sec, LLVMValueRef t_sec, LLVMValueRef t, int c0);
int el_src_fold(const emit_llvm_src *s);

/* ---- the phases of a tile kernel ---- */
/* The K phase (emit_llvm_key.c), from the entry block: the logits of every key page of the tile into the p
 * scratch, and the tile's max per query head in mtile[0..g). Leaves the builder in the block after it. */
void el_k_phase(E *e, const emit_llvm_kernel *k, LLVMValueRef *a, LLVMValueRef *mtile);
/* The V phase's weight scratch (emit_llvm_value.c): static allocas at the entry for the int16 / int8 P.V, NULL
 * where the kernel takes the fp32 path. */
void el_v_scratch(E *e, const emit_llvm_kernel *k, LLVMValueRef *wh, LLVMValueRef *wl);
/* The V phase: acc_j = acc_j alpha_j + sum_t p_jt v_t for the g heads (alpha_h: e^(m - m') per head, splat). */
void el_v_phase(E *e, const emit_llvm_kernel *k, LLVMValueRef *a, LLVMValueRef *alpha_h, LLVMValueRef wh,
                LLVMValueRef wl);
#endif

#endif
