/* The cpu backend's kernel list (emit_llvm.h): every (K source, V source) pair a layer class's storage can
 * present, from the plan (compiler/plan.h, the one the CUDA emitter uses). Sources: fp16 rows (sinks, windows,
 * pools, bits-16 pages) and the page format of each precision class. The runtime (runtime/cpu/cpu_kernels.c)
 * and `kvqc build --target cpu` both take it from here, so a prebuilt object has the runtime's kernels. */
#include <string.h>

#include "emit_llvm.h"

/* What the kernel's element decode depends on: the kind and a codebook's levels (the tensor scale is read from
 * the page). */
static int same_element_format(const kvq_format_cfg *a, const kvq_format_cfg *b)
{
    return a->kind == b->kind && a->n_levels == b->n_levels &&
           !memcmp(a->levels, b->levels, (size_t)a->n_levels * sizeof a->levels[0]);
}

static int same_format(const kvq_page_format *a, const kvq_page_format *b)
{
    /* A per-channel page is one group whatever its capacity: its group field is not part of the format. */
    int group_same = a->gran == KVQ_GRAN_CHANNEL || a->group == b->group;
    return a->bits == b->bits && a->gran == b->gran && a->channel_separable == b->channel_separable && group_same &&
           a->hidden == b->hidden && a->masked == b->masked && a->scale_bytes == b->scale_bytes &&
           a->zero_bytes == b->zero_bytes && a->kv_heads == b->kv_heads && a->head_dim == b->head_dim &&
           same_element_format(&a->format, &b->format) && a->tq == b->tq && a->tq_out == b->tq_out &&
           a->tq_out_bits == b->tq_out_bits;
}

int emit_llvm_source_index(const emit_llvm_sources *s, int which, const kvq_page_format *f)
{
    if (kvq_bits_is_fp16(f->bits)) return 0;
    const kvq_page_format *v = which ? s->vf : s->kf;
    int n = which ? s->n_v : s->n_k;
    for (int i = 1; i < n; i++)
        if (same_format(&v[i], f)) return i;
    return -1;
}

/* Adds the page format of store st (a quantized one; plan_store carries its element format) to a class's
 * sources unless present. */
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

int emit_llvm_plan_kernels(const kvq_plan *p, emit_llvm_sources *cls, emit_llvm_kernel *ks)
{
    int n = 0;
    for (int c = 0; c < p->n_classes; c++) {
        const plan_class *pc = &p->cls[c];
        emit_llvm_sources *cc = &cls[c];
        memset(cc, 0, sizeof *cc);
        cc->n_k = cc->n_v = 1; /* [0]: fp16 rows */
        if (pc->quant) {
            add_source(p, &pc->k_hi, cc->kf, &cc->n_k);
            add_source(p, &pc->k_lo, cc->kf, &cc->n_k);
            add_source(p, &pc->v_hi, cc->vf, &cc->n_v);
            add_source(p, &pc->v_lo, cc->vf, &cc->n_v);
        }
        for (int i = 0; i < cc->n_k; i++)
            for (int j = 0; j < cc->n_v; j++, n++) {
                if (!ks) continue;
                memset(&ks[n], 0, sizeof ks[n]);
                ks[n].head_dim = p->head_dim;
                ks[n].gqa = p->gqa;
                ks[n].k = source(cc->kf, i);
                ks[n].v = source(cc->vf, j);
            }
    }
    return n;
}
