/* Internal to the cpu code generator: the decode of TurboQuant pages (arXiv 2504.19874; runtime/turboquant.h,
 * layout.h) as IR, for emit_llvm.c's tile kernels. A stored vector has one or two parts (the outlier channel
 * split, `outlier_channels`): part j covers channels [off_j, off_j + m_j) and holds m_j level indices at bits_j
 * (prod: bits_j - 1), packed as kvq_pack_codes packs m_j channels, the parts back to back; its fp32 norm is scale
 * entry j of the token, its fp32 residual norm (prod) zero entry j, and its QJL signs bits off_j.. of the token's
 * D-bit sign row.
 *   Q_mse (Algorithm 1):  x_c = norm_j * L_j[code_c], L_j the Lloyd-Max levels of N(0, 1/m_j) at the part's bits;
 *   Q_prod (Algorithm 2): q.k = q.k_mse + sum_j rnorm_j * sqrt(pi/2)/m_j * <S_j q_j, sign(S_j r_j)>.
 * The runtime computes sq_c = sqrt(pi/2)/m_j (S_j q_j)_c once per step and query head (cpu_attend.c), so a key's
 * QJL term is one more dot product over D lanes: sum_c sq_c * (sign_c ? rnorm_j : -rnorm_j). */
#ifndef KVQ_EMIT_LLVM_TURBOQUANT_H
#define KVQ_EMIT_LLVM_TURBOQUANT_H

#ifdef KVQ_HAVE_LLVM
#include <llvm-c/Core.h>

#include "layout.h"

/* Bytes of one token's codes of one kv head (the row stride of a TurboQuant page). */
size_t emit_llvm_tq_row_bytes(const kvq_page_format *f);

/* Lanes c0 .. c0 + W - 1 (W: the lanes of vector type vf; c0 a multiple of W) of the MSE reconstruction of the
 * token whose codes start at `row` (i8 pointer) and whose norms start at `norms` (the token's first fp32 scale
 * entry): norm_j * L_j[code]. permute16: vpermps for the levels (AVX-512F, 16 lanes). */
LLVMValueRef emit_llvm_tq_row(LLVMBuilderRef b, const kvq_page_format *f, LLVMTypeRef vf, LLVMValueRef row,
                              LLVMValueRef norms, int c0, int permute16);

/* Lanes c0 .. of the QJL vector of a prod key: sign_c ? rnorm_j : -rnorm_j, from the token's sign row `signs`
 * (i8 pointer) and its residual norms `rnorms` (the token's first fp32 zero entry). */
LLVMValueRef emit_llvm_tq_qjl(LLVMBuilderRef b, const kvq_page_format *f, LLVMTypeRef vf, LLVMValueRef signs,
                              LLVMValueRef rnorms, int c0);
#endif

#endif
