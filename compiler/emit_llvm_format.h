/* Internal to the cpu code generator: the element decode of the formats beyond asymmetric integers
 * (compiler/scheme_format.h), as IR. An element is x = z + (s * T) * L[code] (kvq_format_dequant); these
 * functions give L[code] and the one-byte group scales, equal to the reference's tables (kvq_format_levels,
 * kvq_format_scale8_decode) for every code, so the cpu backend decodes what the reference decodes. The
 * quantizer is not here: the cpu backend stores its pages with the reference's (runtime/quant.c). */
#ifndef KVQ_EMIT_LLVM_FORMAT_H
#define KVQ_EMIT_LLVM_FORMAT_H

#ifdef KVQ_HAVE_LLVM
#include <llvm-c/Core.h>

#include "scheme_format.h"

/* L[code] for integer codes `code` (i32, scalar or vector) of format f at code width `bits`, as floats of the
 * same shape. permute16: the target has AVX-512F (a codebook's levels are then one vpermps of 16-lane codes;
 * else a select tree). */
LLVMValueRef emit_llvm_format_level(LLVMBuilderRef b, const kvq_format_cfg *f, int bits, LLVMValueRef code,
                                    int permute16);

/* A one-byte group scale (i8, scalar or vector) as floats: nvfp4's e4m3, mxfp4's e8m0. */
LLVMValueRef emit_llvm_format_scale8(LLVMBuilderRef b, kvq_format_kind k, LLVMValueRef byte);
#endif

#endif
