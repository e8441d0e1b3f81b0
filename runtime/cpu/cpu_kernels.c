/* The cpu backend's kernels: the engine's plan (compiler/plan.h, the one the CUDA emitter uses) gives the layer
 * classes and each class's page formats; every (K source, V source) pair a class's storage can present becomes
 * one tile kernel (compiler/emit_llvm_plan.c, the list `kvqc build --target cpu` compiles too). All kernels of an
 * engine are one module: one optimisation, one object, taken from generated/<scheme>/ when an object built ahead
 * of time has its key (cpu_aot.c), else from the JIT cache, else compiled now. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cpu.h"
#include "cpu_aot.h"

int cpu_class_source(const cpu_class *c, int which, const kvq_page_format *f)
{
    return emit_llvm_source_index(&c->src, which, f);
}

/* KVQ_CPU_VECTOR_WIDTH (4, 8 or 16) narrows the vectors, KVQ_CPU_VNNI=0 turns the integer paths off and
 * KVQ_CPU_INT8=0 the int8 paths only (2-bit keys and values then take the int16 ones), so the other paths can be tested and
 * timed on a wide VNNI host. */
static int forced_width(void)
{
    const char *w = getenv("KVQ_CPU_VECTOR_WIDTH"), *v = getenv("KVQ_CPU_VNNI"), *i8 = getenv("KVQ_CPU_INT8");
    return (w ? atoi(w) & 0xff : 0) | (v && !strcmp(v, "0") ? EMIT_LLVM_NO_VNNI : 0) |
           (i8 && !strcmp(i8, "0") ? EMIT_LLVM_NO_INT8 : 0);
}

static void *prebuilt(void *arg, const char *key, size_t *size)
{
    char dir[4200];
    cpu_aot_dir(kvq_scheme_name(((const kvq_be_engine *)arg)->scheme), dir, sizeof dir);
    return cpu_aot_find(dir, key, size);
}

kvq_status cpu_kernels_build(const kvq_be_engine *e, cpu_state *s, char *msg, size_t msg_size)
{
    kvq_status st = plan_build(e->scheme, &e->dims, KVQ_F32, &s->plan, msg, msg_size);
    if (st != KVQ_OK) return st == KVQ_ERR_NOMEM ? st : KVQ_ERR_UNSUPPORTED;
    const kvq_plan *p = &s->plan;
    emit_llvm_sources src[PLAN_MAX_CLASSES];
    int total = emit_llvm_plan_kernels(p, src, NULL);
    emit_llvm_kernel *ks = kvq_calloc((size_t)total, sizeof *ks);
    emit_llvm_tile_fn *fns = kvq_calloc((size_t)total, sizeof *fns);
    if (!ks || !fns) {
        kvq_free(ks);
        kvq_free(fns);
        snprintf(msg, msg_size, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    int n = emit_llvm_plan_kernels(p, src, ks), origin = EMIT_LLVM_FROM_JIT;
    st = emit_llvm_compile(ks, n, forced_width(), prebuilt, (void *)e, &s->jit, fns, &origin, msg, msg_size);
    if (st == KVQ_OK) {
        s->origin = origin == EMIT_LLVM_FROM_PREBUILT ? "generated" : origin == EMIT_LLVM_FROM_CACHE ? "cache" : "jit";
        n = 0;
        for (int c = 0; c < p->n_classes; c++) {
            cpu_class *cc = &s->cls[c];
            cc->src = src[c];
            cc->tile = p->cls[c].tile < EMIT_LLVM_TILE ? p->cls[c].tile : EMIT_LLVM_TILE;
            for (int i = 0; i < cc->src.n_k; i++)
                for (int j = 0; j < cc->src.n_v; j++) cc->fn[i][j] = fns[n++];
        }
    }
    kvq_free(ks);
    kvq_free(fns);
    return st;
}
