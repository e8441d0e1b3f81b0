/* A private timing program of the cpu backend's tile kernel alone (docs/cpu.md "GQA > 1"): no engine, no memory
 * walk. One kernel for KIVI's page pair (per-channel keys of KBITS bits in pages of 32 tokens, per-token values of
 * VBITS bits in groups of 32, fp16 parameters, head_dim D, GQA g) runs over 128-token tiles of 4 key pages, cycling
 * over 64 tiles (~0.5 MiB of codes at 2 bits: L2-resident), so what it times is the kernel's instructions. Prints
 * the thread CPU time per token and kv head, best of 5 passes of ITERS tiles.
 *   bench_cpu_tile [KBITS=2] [VBITS=2] [g=4] [ITERS=20000] [D=128] */
#include <float.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "emit_llvm.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv)
{
    int kb = argc > 1 ? atoi(argv[1]) : 2, vb = argc > 2 ? atoi(argv[2]) : 2, g = argc > 3 ? atoi(argv[3]) : 4;
    int iters = argc > 4 ? atoi(argv[4]) : 20000, D = argc > 5 ? atoi(argv[5]) : 128;
    enum { N = EMIT_LLVM_TILE, NT = 64, PG = 32, NP = N / PG };
    if (g < 1 || g > 64 || D < 32 || D > 256 || D % 32 || iters < 1) {
        fprintf(stderr, "usage: bench_cpu_tile [KBITS] [VBITS] [g 1..64] [ITERS] [D: 32..256, multiple of 32]\n");
        return 2;
    }
    kvq_tensor_cfg kc = {.bits = kb, .gran = KVQ_GRAN_CHANNEL, .group = PG, .scale_dtype = KVQ_DT_FP16,
                         .zero_dtype = KVQ_DT_FP16};
    kvq_tensor_cfg vc = {.bits = vb, .gran = KVQ_GRAN_TOKEN, .group = 32, .scale_dtype = KVQ_DT_FP16,
                         .zero_dtype = KVQ_DT_FP16};
    emit_llvm_kernel k = {.head_dim = D, .gqa = g};
    kvq_page_format_init(&k.k.fmt, &kc, kb, 0, 8, D, PG);
    kvq_page_format_init(&k.v.fmt, &vc, vb, 0, 8, D, N);
    char msg[256];
    if (!emit_llvm_supported(&k, msg, sizeof msg)) {
        fprintf(stderr, "bench_cpu_tile: %s\n", msg);
        return 1;
    }
    emit_llvm_jit *jit = NULL;
    emit_llvm_tile_fn fn;
    if (emit_llvm_compile(&k, 1, 0, NULL, NULL, &jit, &fn, NULL, msg, sizeof msg) != KVQ_OK) {
        fprintf(stderr, "bench_cpu_tile: %s\n", msg);
        return 1;
    }
    size_t kr = kvq_code_bytes(D, kb), vr = kvq_code_bytes(D, vb), ng = (size_t)D / 32;
    uint8_t *K = malloc(NT * N * kr), *V = malloc(NT * N * vr);
    uint16_t *ks = malloc(NT * NP * (size_t)D * 2), *kz = malloc(NT * NP * (size_t)D * 2);
    uint16_t *vs = malloc(NT * N * ng * 2), *vz = malloc(NT * N * ng * 2);
    float *q = malloc((size_t)g * D * 4), *acc = calloc((size_t)g * D, 4), *ml = malloc((size_t)g * 8);
    float *p = aligned_alloc(64, (size_t)g * N * 4);
    if (!K || !V || !ks || !kz || !vs || !vz || !q || !acc || !ml || !p) {
        fprintf(stderr, "bench_cpu_tile: out of memory\n");
        return 1;
    }
    uint32_t r = 12345;
#define RND() (r = r * 1664525u + 1013904223u, r >> 8)
    for (size_t i = 0; i < NT * N * kr; i++) K[i] = (uint8_t)RND();
    for (size_t i = 0; i < NT * N * vr; i++) V[i] = (uint8_t)RND();
    for (size_t i = 0; i < NT * NP * (size_t)D; i++) ks[i] = (uint16_t)(0x3000 + RND() % 0x400), kz[i] = 0xbc00;
    for (size_t i = 0; i < NT * N * ng; i++) vs[i] = (uint16_t)(0x3000 + RND() % 0x400), vz[i] = 0xbc00;
    for (int i = 0; i < g * D; i++) q[i] = (float)((int)(RND() % 200) - 100) * 1e-3f;
    emit_llvm_kpage kp[NP];
    double best = 1e30;
    for (int pass = 0; pass < 5; pass++) {
        double t0 = now();
        for (int it = 0; it < iters; it++) {
            int tl = it % NT;
            for (int j = 0; j < g; j++) ml[2 * j] = -FLT_MAX, ml[2 * j + 1] = 0;
            for (int pg = 0; pg < NP; pg++)
                kp[pg] = (emit_llvm_kpage){.k = K + ((size_t)tl * N + (size_t)pg * PG) * kr,
                                           .ks = (const uint8_t *)(ks + ((size_t)tl * NP + pg) * D),
                                           .kz = (const uint8_t *)(kz + ((size_t)tl * NP + pg) * D),
                                           .n = PG};
            emit_llvm_tile_args a = {.q = q, .acc = acc, .ml = ml, .p = p, .v = V + (size_t)tl * N * vr,
                                     .vs = (const uint8_t *)(vs + (size_t)tl * N * ng),
                                     .vz = (const uint8_t *)(vz + (size_t)tl * N * ng), .n = N, .kp = kp, .nkp = NP};
            fn(&a);
        }
        double t = (now() - t0) / iters / N * 1e9;
        if (t < best) best = t;
    }
    printf("tile kernel: %d-bit keys, %d-bit values, head_dim %d, GQA %d: %.2f ns per token and kv head (best of 5 "
           "x %d tiles of %d tokens; checksum %g)\n", kb, vb, D, g, best, iters, N, (double)acc[0]);
    emit_llvm_free(jit);
    free(K), free(V), free(ks), free(kz), free(vs), free(vz), free(q), free(acc), free(ml), free(p);
    return 0;
}
