/* nvrtc-helper ARCH LINEINFO FILE: compiles the CUDA unit in FILE with NVRTC for ARCH (with line info when
 * LINEINFO is 1) into the JIT cache ($KVQ_CACHE_DIR), exit status 0 when it compiled. Built without the
 * sanitizers (the plain build's build/tests/nvrtc-helper); tests/run.sh names it in $KVQ_NVRTC_HELPER so that the
 * sanitized test programs have NVRTC run at full speed outside ASan's allocator (runtime/cuda/cu_nvrtc.c,
 * helper_compile; docs/testing.md, "Test time"). Not a user tool. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cuda/cu.h"

int main(int argc, char **argv)
{
    if (argc != 4 || (strcmp(argv[2], "0") && strcmp(argv[2], "1"))) {
        fprintf(stderr, "usage: nvrtc-helper ARCH 0|1 FILE\n");
        return 2;
    }
    FILE *f = fopen(argv[3], "rb");
    if (!f) {
        fprintf(stderr, "nvrtc-helper: cannot open %s\n", argv[3]);
        return 1;
    }
    size_t cap = 1 << 20, len = 0;
    char *src = kvq_malloc(cap);
    size_t k;
    while (src && (k = fread(src + len, 1, cap - len - 1, f)) > 0) {
        len += k;
        if (len + 1 == cap) {
            char *t = kvq_realloc(src, cap *= 2);
            if (!t) kvq_free(src);
            src = t;
        }
    }
    fclose(f);
    if (!src) return 1;
    src[len] = 0;
    cu_compiled out;
    char msg[1024];
    kvq_status st = argv[2][0] == '1' ? cu_nvrtc_compile_lineinfo(src, argv[1], 1, &out, NULL, msg, sizeof msg)
                                      : cu_nvrtc_compile(src, argv[1], 1, &out, NULL, msg, sizeof msg);
    kvq_free(src);
    if (st != KVQ_OK) {
        fprintf(stderr, "nvrtc-helper: %s\n", msg);
        return 1;
    }
    cu_compiled_free(&out);
    return 0;
}
