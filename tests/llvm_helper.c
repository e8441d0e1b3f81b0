/* llvm-helper CPU FEATURES FILE: optimises and compiles the cpu backend's module whose unoptimised bitcode is in
 * FILE for the LLVM CPU name and feature string given (default<O3>, the object for that TargetMachine) into the JIT
 * cache ($KVQ_CACHE_DIR), under the key the cpu backend computes for it; exit status 0 when the entry is there.
 * Built without the sanitizers (the plain build's build/tests/llvm-helper); tests/run.sh names it in
 * $KVQ_LLVM_HELPER so that the sanitized test programs have LLVM's passes and code generation run at full speed
 * outside ASan's allocator (compiler/emit_llvm_jit.c, helper_compile; docs/testing.md, "Test time"). Not a user
 * tool. */
#include <stdio.h>

#include "alloc.h"
#include "emit_llvm.h"

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: llvm-helper CPU FEATURES FILE\n");
        return 2;
    }
    FILE *f = fopen(argv[3], "rb");
    if (!f) {
        fprintf(stderr, "llvm-helper: cannot open %s\n", argv[3]);
        return 1;
    }
    size_t cap = 1 << 20, len = 0, k;
    char *bc = kvq_malloc(cap);
    while (bc && (k = fread(bc + len, 1, cap - len, f)) > 0) {
        len += k;
        if (len == cap) {
            char *t = kvq_realloc(bc, cap *= 2);
            if (!t) kvq_free(bc);
            bc = t;
        }
    }
    int bad = ferror(f);
    fclose(f);
    if (!bc || bad) {
        kvq_free(bc);
        fprintf(stderr, "llvm-helper: cannot read %s\n", argv[3]);
        return 1;
    }
    char msg[1024];
    kvq_status st = emit_llvm_cache_bitcode(bc, len, argv[1], argv[2], msg, sizeof msg);
    kvq_free(bc);
    if (st != KVQ_OK) {
        fprintf(stderr, "llvm-helper: %s\n", msg);
        return 1;
    }
    return 0;
}
