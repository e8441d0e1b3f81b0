/* The cpu backend's vtable (backend.h, docs/cpu.md). Sequences, prefill, accounting and read_cache are the
 * reference backend's own functions over the reference's storage, so pages, stats and read_cache are the
 * reference's by construction. A decode step:
 *   1. reserves every item's pages and scratch (the reference's reservation plus the attention's), so a failure
 *      changes nothing (all-or-nothing, as kvq.h promises);
 *   2. runs each item's step_begin (fp16 rounding, windows, KIVI/OTT flushes) in order;
 *   3. runs the attention of the batch on the thread pool: spans of every (item, kv head), tiles of every
 *      (item, kv head, KV chunk) through the compiled kernels, the (o, lse) merge of every (item, kv head);
 *      TailorKV's sparse layers run the reference's step per item (their attention covers a few hundred fp16
 *      rows), and a ZipCache probe step runs the reference's attention, which gives the probability rows that
 *      Alg. 3 records (one step in ~10: probes are 5% recent + 5% random);
 *   4. runs each item's step_end (ZipCache: record the probe row, compress every W). */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cpu.h"

static kvq_status cpu_probe(char *msg, size_t msg_size) { return emit_llvm_probe(msg, msg_size); }

static kvq_status cpu_supports(const kvq_be_engine *e, char *msg, size_t msg_size)
{
    kvq_status st = kvq_backend_reference.supports(e, msg, msg_size);
    if (st != KVQ_OK) return st;
    kvq_plan *p = kvq_malloc(sizeof *p);
    if (!p) {
        snprintf(msg, msg_size, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    st = plan_build(e->scheme, &e->dims, KVQ_F32, p, msg, msg_size);
    if (st != KVQ_OK && st != KVQ_ERR_NOMEM) st = KVQ_ERR_UNSUPPORTED;
    kvq_free(p);
    return st;
}

static void state_free(cpu_state *s)
{
    if (!s) return;
    emit_llvm_free(s->jit);
    cpu_pool_free(s->pool);
    kvq_free(s);
}

static kvq_status cpu_prepare(const kvq_be_engine *e, kvq_backend_ctx **out, char *msg, size_t msg_size)
{
    kvq_backend_ctx *c = kvq_calloc(1, sizeof *c);
    cpu_state *s = kvq_calloc(1, sizeof *s);
    if (!c || !s) {
        kvq_free(c);
        kvq_free(s);
        snprintf(msg, msg_size, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    c->e = *e;
    c->ext = s;
    kvq_status st = cpu_pool_create(e->threads, &s->pool);
    if (st != KVQ_OK) snprintf(msg, msg_size, "could not start %d worker threads", e->threads);
    if (st == KVQ_OK) st = cpu_kernels_build(e, s, msg, msg_size);
    if (st != KVQ_OK) {
        state_free(s);
        kvq_free(c);
        return st;
    }
    *out = c;
    return KVQ_OK;
}

static void cpu_destroy(kvq_backend_ctx *ctx)
{
    if (!ctx) return;
    state_free(ctx->ext);
    kvq_free(ctx);
}

/* ------------------------------------------------------------------------------------------------ decode -- */

enum { ATT_CPU = 0, ATT_REF = 1, ATT_SPARSE = 2 };

typedef struct {
    cpu_state *s;
    int layer, n, H;
    const kvq_be_decode *items;
    ref_reserve *res;
    ref_arena *arena;
    cpu_item *ci;
    ref_qstep *qs;
    unsigned char *kind;
    kvq_status *st;
    float **probs; /* ATT_REF items: the probability rows for step_end */
    int *off; /* [n + 1]: first tile task of each item */
} dec_job;

static ref_layer *layer_of(const dec_job *d, int i) { return d->items[i].seq->layers[d->layer]; }

static void job_spans(void *arg, int t)
{
    dec_job *d = arg;
    int i = t / d->H, h = t % d->H;
    ref_layer *L = layer_of(d, i);
    const kvq_be_decode *it = &d->items[i];
    switch (d->kind[i]) {
    case ATT_CPU:
        cpu_item_spans(&d->ci[i], h);
        break;
    case ATT_REF:
        if (h == 0) {
            float *probs = d->qs[i].saliency
                               ? ref_arena_take(&d->res[i].arena, (size_t)L->q.Hq * (size_t)L->q.length * sizeof(float))
                               : NULL;
            d->st[i] = ref_qlayer_attend_all(&L->q, it->q, it->out, probs, &d->res[i].arena);
            d->probs[i] = probs;
        }
        break;
    case ATT_SPARSE:
        if (h == 0) ref_slayer_step(&L->s, &d->res[i], it->k, it->v, it->q, it->out);
        break;
    }
}

static void job_tiles(void *arg, int t)
{
    dec_job *d = arg;
    int lo = 0, hi = d->n - 1;
    while (lo < hi) { /* the item whose tasks hold t: last i with off[i] <= t */
        int mid = (lo + hi + 1) / 2;
        if (d->off[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    cpu_item *it = &d->ci[lo];
    int local = t - d->off[lo];
    cpu_item_tiles(it, local / it->chunks, local % it->chunks);
}

static void job_merge(void *arg, int t)
{
    dec_job *d = arg;
    int i = t / d->H;
    if (d->kind[i] == ATT_CPU) cpu_item_merge(&d->ci[i], t % d->H);
}

static kvq_status cpu_decode(kvq_backend_ctx *ctx, int layer, const kvq_be_decode *items, int n, char *msg,
                             size_t msg_size)
{
    cpu_state *s = ctx->ext;
    int threads = cpu_pool_threads(s->pool);
    dec_job d;
    memset(&d, 0, sizeof d);
    d.s = s;
    d.layer = layer;
    d.n = n;
    d.H = ctx->e.dims.kv_heads;
    d.items = items;
    d.res = kvq_calloc((size_t)n, sizeof *d.res);
    d.arena = kvq_calloc((size_t)n, sizeof *d.arena);
    d.ci = kvq_calloc((size_t)n, sizeof *d.ci);
    d.qs = kvq_calloc((size_t)n, sizeof *d.qs);
    d.kind = kvq_calloc((size_t)n, 1);
    d.st = kvq_calloc((size_t)n, sizeof *d.st);
    d.probs = kvq_calloc((size_t)n, sizeof *d.probs);
    d.off = kvq_calloc((size_t)n + 1, sizeof *d.off);
    kvq_status st = d.res && d.arena && d.ci && d.qs && d.kind && d.st && d.probs && d.off ? KVQ_OK : KVQ_ERR_NOMEM;
    int i = 0;
    for (; i < n && st == KVQ_OK; i++) {
        ref_layer *L = items[i].seq->layers[layer];
        if (L->sparse) {
            st = ref_slayer_reserve(&L->s, &d.res[i]);
            continue;
        }
        st = ref_qlayer_reserve(&L->q, &d.res[i]);
        if (st == KVQ_OK) st = ref_arena_init(&d.arena[i], cpu_item_size(&d.ci[i], &L->q, d.res[i].n_pages, threads, n));
    }
    if (st != KVQ_OK) {
        if (d.res)
            for (int j = 0; j < n; j++) ref_reserve_free(&d.res[j]);
        if (d.arena)
            for (int j = 0; j < n; j++) ref_arena_free(&d.arena[j]);
        snprintf(msg, msg_size, i > 0 ? "decode item %d: out of memory" : "out of memory", i - 1);
        goto done;
    }

    /* Everything is allocated: the state changes from here on. */
    const cpu_class *cls_of_layer = &s->cls[s->plan.layer_class[layer]];
    for (i = 0; i < n; i++) {
        ref_layer *L = items[i].seq->layers[layer];
        if (L->sparse) {
            d.kind[i] = ATT_SPARSE;
            continue;
        }
        d.st[i] = ref_qlayer_step_begin(&L->q, &d.res[i], items[i].k, items[i].v, &d.qs[i]);
        if (d.qs[i].probe) {
            d.kind[i] = ATT_REF;
            continue;
        }
        d.ci[i].q = items[i].q;
        d.ci[i].out = items[i].out;
        cpu_item_init(&d.ci[i], &L->q, cls_of_layer, &d.arena[i]);
    }
    for (i = 0; i < n; i++) d.off[i + 1] = d.off[i] + (d.kind[i] == ATT_CPU ? d.H * d.ci[i].chunks : 0);
    cpu_pool_run(s->pool, job_spans, &d, n * d.H);
    cpu_pool_run(s->pool, job_tiles, &d, d.off[n]);
    cpu_pool_run(s->pool, job_merge, &d, n * d.H);
    for (i = 0; i < n; i++) {
        ref_layer *L = items[i].seq->layers[layer];
        if (d.kind[i] == ATT_CPU && !cpu_item_ok(&d.ci[i]) && d.st[i] == KVQ_OK) d.st[i] = KVQ_ERR_INTERNAL;
        if (d.kind[i] != ATT_SPARSE) {
            kvq_status s2 = ref_qlayer_step_end(&L->q, &d.res[i], &d.qs[i], d.probs[i]);
            if (d.st[i] == KVQ_OK) d.st[i] = s2;
        }
        if (d.st[i] != KVQ_OK && st == KVQ_OK) {
            st = d.st[i];
            snprintf(msg, msg_size, "decode item %d: the cache broke an invariant (a token missing or counted twice)",
                     i);
        }
    }
    for (i = 0; i < n; i++) {
        ref_reserve_free(&d.res[i]);
        ref_arena_free(&d.arena[i]);
    }
done:
    kvq_free(d.res);
    kvq_free(d.arena);
    kvq_free(d.ci);
    kvq_free(d.qs);
    kvq_free(d.kind);
    kvq_free(d.st);
    kvq_free(d.probs);
    kvq_free(d.off);
    return st;
}

/* The tiles of kv head 0 of `seq` at `layer` as a decode step cuts them over the storage as it stands (the
 * cpu_item of a batch of one on this pool, no query): rt_step_tiles, test_cpu_tiles. */
static kvq_status cpu_step_tiles(kvq_backend_ctx *ctx, const kvq_backend_seq *seq, int layer, kvq_tile_info *out,
                                 int cap, int *n, char *msg, size_t msg_size)
{
    cpu_state *s = ctx->ext;
    ref_layer *RL = seq->layers[layer];
    if (RL->sparse) {
        snprintf(msg, msg_size, "layer %d is sparse: its steps run the reference's attention", layer);
        return KVQ_ERR_UNSUPPORTED;
    }
    ref_qlayer *L = &RL->q;
    cpu_item it;
    memset(&it, 0, sizeof it);
    ref_arena a = {0};
    kvq_status st = ref_arena_init(&a, cpu_item_size(&it, L, 0, cpu_pool_threads(s->pool), 1));
    if (st != KVQ_OK) {
        snprintf(msg, msg_size, "out of memory");
        return st;
    }
    cpu_item_init(&it, L, &s->cls[s->plan.layer_class[layer]], &a);
    cpu_item_spans(&it, 0);
    int got = cpu_item_tile_list(&it, 0, out, cap);
    ref_arena_free(&a);
    if (got < 0) {
        snprintf(msg, msg_size, "the cache broke an invariant (a token missing or counted twice)");
        return KVQ_ERR_INTERNAL;
    }
    *n = got;
    return KVQ_OK;
}

const kvq_backend kvq_backend_cpu = {
    .name = "cpu",
    .probe = cpu_probe,
    .supports = cpu_supports,
    .prepare = cpu_prepare,
    .destroy = cpu_destroy,
    .seq_create = ref_seq_create,
    .seq_free = ref_seq_free,
    .seq_length = ref_seq_length,
    .prefill = ref_prefill,
    .decode = cpu_decode,
    .seq_account = ref_seq_account,
    .read_cache = ref_read_cache,
    .step_tiles = cpu_step_tiles,
};
