/* Internal to the cpu code generator: the IR side (emit_llvm.c) as the module side (emit_llvm_jit.c) uses it. */
#ifndef KVQ_EMIT_LLVM_IR_H
#define KVQ_EMIT_LLVM_IR_H

#ifdef KVQ_HAVE_LLVM
#include <llvm-c/Core.h>

#include "emit_llvm.h"

/* The unoptimised, unverified module of n kernels (symbols kvq_tile_0..n-1) in ctx: `width` lanes (4, 8, 16),
 * `vnni` EMIT_LLVM_IR_VNNI for the int16 paths (16 lanes with AVX-512 VNNI and BW), | EMIT_LLVM_IR_INT8 for the
 * int8 keys (2-bit, emit_llvm.c), | EMIT_LLVM_IR_VBMI (with INT8) for the int8 P.V (2-bit values), 0 for none. The kernels must be emit_llvm_supported. */
/* EMIT_LLVM_IR_PERM16: 16 lanes on an AVX-512F target (vpermps: a codebook's levels, emit_llvm_format.c). */
enum { EMIT_LLVM_IR_VNNI = 1, EMIT_LLVM_IR_INT8 = 2, EMIT_LLVM_IR_VBMI = 4, EMIT_LLVM_IR_PERM16 = 8 };
LLVMModuleRef emit_llvm_ir_module(LLVMContextRef ctx, const emit_llvm_kernel *ks, int n, int width, int vnni);
#endif

#endif
