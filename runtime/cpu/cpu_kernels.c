/* The cpu backend's kernels: the engine's plan (compiler/plan.h, the one the CUDA emitter uses) gives the layer
 * classes and each class's page formats; every (K source, V source) pair a class's storage can present becomes
 * one tile kernel (compiler/emit_llvm.h). Sources: fp16 rows (sinks, windows, pools, bits-16 pages) and the
 * page format of each precision class. All kernels of an engine are one module: one optimisation, one object. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cpu.h"

static int same_format(const kvq_page_format *a, const kvq_page_format *b)
{
    /* A per-channel page is one group whatever its capacity: its group field is not part of the format. */
    int group_same = a->gran == KVQ_GRAN_CHANNEL || a->group == b->group;
    return a->bits == b->bits && a->gran == b->gran && a->channel_separable == b->channel_separable && group_same && a->hidden == b->hidden && a->masked == b->masked &&
           a->scale_bytes == b->scale_bytes && a->zero_bytes == b->zero_bytes && a->kv_heads == b->kv_heads &&
           a->head_dim == b->head_dim;
}

int cpu_class_source(const cpu_class *c, int which, const kvq_page_format *f)
{
    if (kvq_bits_is_fp16(f->bits)) return 0;
    const kvq_page_format *v = which ? c->vf : c->kf;
    int n = which ? c->n_v : c->n_k;
    for (int i = 1; i < n; i++)
        if (same_format(&v[i], f)) return i;
    return -1;
}

/* Adds the page format of store st (a quantized one) to a class's sources unless present. */
static void add_source(const kvq_plan *p, const plan_store *st, kvq_page_format *list, int *n)
{
    if (!st->bits || kvq_bits_is_fp16(st->bits)) return;
    kvq_page_format f;
    plan_page_format(p, st, 1, &f);
    for (int i = 1; i < *n; i++)
        if (same_format(&list[i], &f)) return;
    list[(*n)++] = f;
}

static emit_llvm_src source(const kvq_page_format *list, int i)
{
    emit_llvm_src s;
    memset(&s, 0, sizeof s);
    s.fp16 = i == 0;
    if (i) s.fmt = list[i];
    return s;
}

/* KVQ_CPU_VECTOR_WIDTH (4, 8 or 16) narrows the vectors, so the generic paths can be tested on a wide host. */
static int forced_width(void)
{
    const char *w = getenv("KVQ_CPU_VECTOR_WIDTH");
    return w ? atoi(w) : 0;
}

kvq_status cpu_kernels_build(const kvq_be_engine *e, cpu_state *s, char *msg, size_t msg_size)
{
    kvq_status st = plan_build(e->scheme, &e->dims, KVQ_F32, &s->plan, msg, msg_size);
    if (st != KVQ_OK) return st == KVQ_ERR_NOMEM ? st : KVQ_ERR_UNSUPPORTED;
    const kvq_plan *p = &s->plan;
    int total = 0;
    for (int c = 0; c < p->n_classes; c++) {
        const plan_class *pc = &p->cls[c];
        cpu_class *cc = &s->cls[c];
        cc->n_k = cc->n_v = 1; /* [0]: fp16 rows */
        if (pc->quant) {
            add_source(p, &pc->k_hi, cc->kf, &cc->n_k);
            add_source(p, &pc->k_lo, cc->kf, &cc->n_k);
            add_source(p, &pc->v_hi, cc->vf, &cc->n_v);
            add_source(p, &pc->v_lo, cc->vf, &cc->n_v);
        }
        total += cc->n_k * cc->n_v;
    }
    emit_llvm_kernel *ks = kvq_calloc((size_t)total, sizeof *ks);
    emit_llvm_tile_fn *fns = kvq_calloc((size_t)total, sizeof *fns);
    if (!ks || !fns) {
        kvq_free(ks);
        kvq_free(fns);
        snprintf(msg, msg_size, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    int n = 0;
    for (int c = 0; c < p->n_classes; c++) {
        cpu_class *cc = &s->cls[c];
        for (int i = 0; i < cc->n_k; i++)
            for (int j = 0; j < cc->n_v; j++, n++) {
                ks[n].head_dim = p->head_dim;
                ks[n].gqa = p->gqa;
                ks[n].k = source(cc->kf, i);
                ks[n].v = source(cc->vf, j);
            }
    }
    st = emit_llvm_compile(ks, n, forced_width(), &s->jit, fns, &s->from_cache, msg, msg_size);
    if (st == KVQ_OK) {
        n = 0;
        for (int c = 0; c < p->n_classes; c++) {
            cpu_class *cc = &s->cls[c];
            for (int i = 0; i < cc->n_k; i++)
                for (int j = 0; j < cc->n_v; j++) cc->fn[i][j] = fns[n++];
        }
    }
    kvq_free(ks);
    kvq_free(fns);
    return st;
}
