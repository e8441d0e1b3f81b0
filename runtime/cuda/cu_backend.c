/* The cuda and emu backends' vtables (backend.h): engine preparation (plan, generated unit, module, parameter
 * layout check), sequences, batched prefill and decode (one fused decode kernel launch per layer step for the
 * whole batch, split over KV chunks with a merge when the grid would be small), accounting and read_cache. The
 * layer logic is in cu_qlayer.c and cu_slayer.c, the helpers below them in cu_base.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "half.h"
#include "cu_backend.h"
#include "turboquant.h"
#include "emit_cuda.h"
#include "quant.h"

/* The eager decode path's scratch (decode_run: queries, outputs, new rows, tiles, split-KV partials) for batches
 * of up to max_batch sequences of up to max_tokens tokens, sized once, so that no such step allocates (S: the
 * planned steps' bounds, cu_step_reserve's). */
kvq_status cu_scratch_reserve(kvq_backend_ctx *c, int max_batch, const cu_step *S, char *msg, size_t ms)
{
    size_t n = (size_t)max_batch, H = (size_t)c->H, Hq = (size_t)c->Hq, D = (size_t)c->D;
    int tiles = S->tiles_cap > 0 ? S->tiles_cap : 1;
    size_t part = 0;
    for (int k = 0; k < c->plan->n_classes; k++) {
        int ch = cu_chunks_max(c, k, max_batch);
        if (ch > tiles) ch = tiles;
        if ((size_t)ch * n * Hq * (D + 1) * sizeof(float) > part) part = (size_t)ch * n * Hq * (D + 1) * sizeof(float);
    }
    kvq_status st = cu_scratch(c, &c->qbuf, &c->qbuf_bytes, (2 * n * Hq * D + n * Hq) * sizeof(float), msg, ms);
    if (st == KVQ_OK) st = cu_scratch(c, &c->kvin, &c->kvin_bytes, n * 2 * H * D * 2, msg, ms);
    if (st == KVQ_OK) st = cu_scratch(c, &c->tiles, &c->tiles_bytes, n * (size_t)tiles * sizeof(kvq_tile), msg, ms);
    if (st == KVQ_OK) st = cu_scratch(c, &c->seqs, &c->seqs_bytes, n * sizeof(kvq_seq_tiles), msg, ms);
    if (st == KVQ_OK && part) st = cu_scratch(c, &c->part, &c->part_bytes, part, msg, ms);
    /* a sequence's policy work (its kernels' outputs, reused item after item) and one token's rows */
    if (st == KVQ_OK && S->pol_seq) st = cu_scratch(c, &c->pol, &c->pol_bytes, S->pol_seq + S->zaux_seq, msg, ms);
    if (st == KVQ_OK) st = cu_scratch(c, &c->stage, &c->stage_bytes, 2 * H * D * 2 + 64, msg, ms);
    /* an eager step's batched stores and quantizations (cu_batch.c): what a planned step's tables hold */
    size_t items = n * (size_t)(S->st1_cap + S->st2_cap) * sizeof(kvq_store_params) + 16 * 6;
    for (int s = 0; s < CU_STEP_STORES; s++) items += n * (size_t)S->q_cap[s] * sizeof(kvq_quant_params);
    if (st == KVQ_OK) st = cu_scratch(c, &c->bitems, &c->bitems_bytes, items, msg, ms);
    /* the page-locked staging of two steps' host data (tiles, tables, queries, outputs, new rows, policy items,
     * batched items): page-locked allocation synchronises too, and a capture refuses it */
    size_t hst = 2 * (n * (size_t)tiles * sizeof(kvq_tile) + n * sizeof(kvq_seq_tiles) +
                      2 * n * Hq * D * sizeof(float) + n * (4 * H * D * 2 + 4096) + items);
    if (st == KVQ_OK && hst > c->hst_bytes) {
        size_t cap = c->hst_bytes ? c->hst_bytes : 65536;
        while (cap < hst) cap *= 2;
        void *h = NULL;
        uint64_t hd = 0;
        st = cu_dev_sync(c->dev, msg, ms); /* the copies queued from the old staging have read it */
        if (st == KVQ_OK) st = cu_dev_alloc_host(c->dev, cap, &h, &hd, msg, ms);
        if (st == KVQ_OK) {
            cu_dev_free_host(c->dev, c->hst);
            c->hst = h, c->hst_dev = hd, c->hst_bytes = cap, c->hst_used = 0;
        }
    }
    if (st == KVQ_OK) cu_scratch_release(c); /* outside a step: what grew before is freed now */
    return st;
}

static uint64_t dev_addr(const void *p) { return (uint64_t)(uintptr_t)p; }

/* ---- vtable ---- */

static kvq_status probe_kind(cu_dev_kind kind, char *msg, size_t n)
{
    cu_dev *d = NULL;
    kvq_status st = cu_dev_open(kind, &d, msg, n);
    if (st == KVQ_OK) cu_dev_close(d);
    if (st == KVQ_OK && kind == CU_DEV_GPU) st = cu_nvrtc_load(msg, n);
    return st;
}
static kvq_status probe_cuda(char *msg, size_t n) { return probe_kind(CU_DEV_GPU, msg, n); }
static kvq_status probe_emu(char *msg, size_t n) { return probe_kind(CU_DEV_EMU, msg, n); }

/* Element formats (templates/kvq_format.cuh) the kernels run: every one of specs/formats/, per token (groups of
 * the block or the tensor's group) or per channel for e4m3/e5m2 (no group parameters), with a static tensor scale
 * or one from the prompt (kvq_tensor_amax). Refused, naming what: per-channel groups of formats with group
 * parameters, and formats combined with saliency classes or outlier pools. */
static kvq_status cu_formats_supported(int l, const kvq_quant_cfg *q, char *msg, size_t n)
{
    for (int w = 0; w < 2; w++) {
        const kvq_tensor_cfg *t = w ? &q->value : &q->key;
        const kvq_format_cfg *f = &t->format;
        const char *what = w ? "values" : "keys";
        if (kvq_bits_is_fp16(t->bits) || f->kind == KVQ_FMT_INT) continue;
        if (t->gran == KVQ_GRAN_CHANNEL && kvq_format_has_group_scale(f->kind)) {
            snprintf(msg, n, "layer %d: the %s' element format %s per channel is not supported by the cuda kernels "
                             "(per token is; the reference backend runs both)", l, what, kvq_format_name(f->kind));
            return KVQ_ERR_UNSUPPORTED;
        }
        if (q->saliency.metric != KVQ_SAL_NONE || q->outliers.keep > 0 ||
            (t->gran == KVQ_GRAN_TOKEN && t->group == KVQ_GROUP_HIDDEN)) {
            snprintf(msg, n, "layer %d: the %s' element format %s with saliency classes, outlier pools or hidden groups "
                             "is not supported by the cuda kernels (the reference backend runs it)",
                     l, what, kvq_format_name(f->kind));
            return KVQ_ERR_UNSUPPORTED;
        }
    }
    return KVQ_OK;
}

static kvq_status cu_supports(const kvq_be_engine *e, char *msg, size_t n)
{
    for (int l = 0; l < e->dims.layers; l++) {
        const kvq_layer_cfg *c = kvq_scheme_layer(e->scheme, l);
        if (c->mode == KVQ_MODE_SPARSE) continue;
        const kvq_quant_cfg *q = &c->quant;
        kvq_status st = cu_formats_supported(l, q, msg, n);
        if (st != KVQ_OK) return st;
        /* TurboQuant (templates/kvq_turboquant.cuh): mse keys and values, prod keys (QJL's score term); prod values
         * would need Algorithm 2's S^T sign(S r) per token in p.V */
        if (kvq_layer_turboquant(c) && q->value.turboquant == KVQ_TQ_PROD && !kvq_bits_is_fp16(q->value.bits)) {
            snprintf(msg, n, "layer %d: TurboQuant prod values (turboquant prod of the values: Algorithm 2's QJL "
                             "reconstruction) are not decoded by the cuda kernels (mse values and prod keys are; the "
                             "reference and cpu backends decode them)", l);
            return KVQ_ERR_UNSUPPORTED;
        }
        if (kvq_layer_turboquant(c) && q->outliers.keep > 0) {
            snprintf(msg, n, "layer %d: TurboQuant codes with an outlier pool are not supported by the cuda kernels "
                             "(the reference backend runs them)", l);
            return KVQ_ERR_UNSUPPORTED;
        }
        if (q->saliency.metric != KVQ_SAL_NONE && q->outliers.keep > 0) {
            snprintf(msg, n, "layer %d: outlier pools combined with saliency classes are not supported", l);
            return KVQ_ERR_UNSUPPORTED;
        }
        if (q->outliers.keep > 0 &&
            (q->flush != KVQ_FLUSH_GROUP || kvq_bits_is_fp16(q->key.bits) || kvq_bits_is_fp16(q->value.bits))) {
            snprintf(msg, n, "layer %d: an outlier pool needs keys and values quantized and flushed together", l);
            return KVQ_ERR_UNSUPPORTED;
        }
    }
    return KVQ_OK;
}

static void ctx_free(kvq_backend_ctx *c)
{
    if (!c) return;
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    cu_dev_free(c->dev, c->stage);
    cu_dev_free(c->dev, c->tiles);
    cu_dev_free(c->dev, c->seqs);
    cu_dev_free(c->dev, c->qbuf);
    cu_dev_free(c->dev, c->part);
    cu_dev_free(c->dev, c->aux);
    cu_dev_free(c->dev, c->pol);
    cu_dev_free(c->dev, c->kvin);
    for (int l = 0; c->tq_s && l < c->e.dims.layers; l++) cu_dev_free(c->dev, c->tq_s[l]);
    kvq_free(c->tq_s);
    cu_scratch_release(c);
    kvq_free(c->retired);
    cu_step_free(c);
    cu_batch_free(c);
    cu_pool_free(c);
    cu_dev_free_host(c->dev, c->hst);
    cu_module_free(c->mod);
    cu_dev_leave(c->dev, &cs);
    cu_dev_close(c->dev);
    kvq_free(c->plan);
    kvq_free(c->htiles);
    kvq_free(c);
}

/* TurboQuant prod keys (templates/kvq_turboquant.cuh): each such layer's QJL matrices, built as the reference
 * builds them (runtime/turboquant.c kvq_tqv_init: the keys' rotate seed, one matrix per part of the outlier split),
 * uploaded once as doubles, part 0's then part 1's. The quantize kernels compute the signs of S r with them (bit
 * for bit the reference's), the decode kernel S q once per block. */
static kvq_status tq_upload(kvq_backend_ctx *c, char *msg, size_t n)
{
    kvq_status st = KVQ_OK;
    for (int l = 0; l < c->e.dims.layers && st == KVQ_OK; l++) {
        const kvq_layer_cfg *lc = kvq_scheme_layer(c->e.scheme, l);
        const kvq_tensor_cfg *t = &lc->quant.key;
        if (lc->mode == KVQ_MODE_SPARSE || kvq_bits_is_fp16(t->bits) || t->turboquant != KVQ_TQ_PROD) continue;
        if (!c->tq_s && !(c->tq_s = kvq_calloc((size_t)c->e.dims.layers, sizeof *c->tq_s))) return KVQ_ERR_NOMEM;
        kvq_tqv v;
        st = kvq_tqv_init(&v, c->D, t->bits, 1, t->rotate_seed, t->tq_outliers, t->tq_outlier_bits);
        if (st != KVQ_OK) break;
        size_t bytes = 0;
        for (int j = 0; j < v.n_parts; j++) bytes += (size_t)v.part[j].D * v.part[j].D * sizeof(double);
        st = cu_dev_alloc(c->dev, bytes, &c->tq_s[l], msg, n);
        for (int j = 0, off = 0; j < v.n_parts && st == KVQ_OK; off += v.part[j].D * v.part[j].D, j++)
            st = cu_dev_h2d(c->dev, c->tq_s[l] + (uint64_t)off * sizeof(double), v.part[j].S,
                            (size_t)v.part[j].D * v.part[j].D * sizeof(double), msg, n);
        kvq_tqv_free(&v);
    }
    return st;
}

static kvq_status prepare_kind(cu_dev_kind kind, const kvq_be_engine *e, kvq_backend_ctx **out, char *msg, size_t n)
{
    *out = NULL;
    kvq_backend_ctx *c = kvq_calloc(1, sizeof *c);
    if (!c) return KVQ_ERR_NOMEM;
    c->e = *e;
    c->record = cu_step_record;
    c->H = e->dims.kv_heads, c->Hq = e->dims.heads, c->D = e->dims.head_dim;
    kvq_status st = cu_dev_open(kind, &c->dev, msg, n);
    char *src = NULL;
    cu_ctx_scope cs;
    if (st == KVQ_OK) cu_dev_enter(c->dev, &cs); /* the device's context, on this thread, until the end */
    if (st == KVQ_OK) {
        c->plan = kvq_malloc(sizeof *c->plan);
        st = c->plan ? plan_build(e->scheme, &e->dims, KVQ_F32, c->plan, msg, n) : KVQ_ERR_NOMEM;
    }
    if (st == KVQ_OK) { /* the device's limits (the emulator enforces sm_90's) */
        const char *arch = cu_dev_arch(c->dev);
        st = plan_check_target(c->plan, strncmp(arch, "sm_", 3) ? 90 : atoi(arch + 3), msg, n);
    }
    if (st == KVQ_OK) st = emit_cuda_source(c->plan, &src, NULL);
    if (st == KVQ_OK) st = cu_dev_load(c->dev, src, kvq_scheme_name(e->scheme), &c->mod, msg, n);
    kvq_free(src);
    if (st == KVQ_OK) { /* the layouts, and the tensor cores' subnormal inputs where a class decodes on them */
        int mma = 0;
        for (int k = 0; k < c->plan->n_classes; k++) mma |= c->plan->cls[k].mma_k | c->plan->cls[k].mma_v;
        st = cu_dev_check_params(c->dev, c->mod, mma != 0, msg, n);
    }
    if (st == KVQ_OK) st = tq_upload(c, msg, n);
    /* Once, at load, per decode class: the opt-in past the default 48 KiB of dynamic shared memory (not per
     * launch), and the occupancy that sizes split-KV (not per step). */
    for (int k = 0; st == KVQ_OK && k < c->plan->n_classes; k++) {
        char kname[32];
        snprintf(kname, sizeof kname, "kvq_decode_c%d", k);
        if (c->plan->cls[k].smem > 48 * 1024)
            st = cu_dev_func_max_dyn_smem(c->dev, c->mod, kname, (unsigned)c->plan->cls[k].smem, msg, n);
        if (st == KVQ_OK)
            c->decode_blocks_per_sm[k] =
                cu_dev_occupancy(c->dev, c->mod, kname, c->plan->threads, (size_t)c->plan->cls[k].smem);
    }
    c->sm_count = cu_dev_sm_count(c->dev) > 0 ? cu_dev_sm_count(c->dev) : 1;
    /* tuning knob (docs/cuda.md "Tuning knobs"): the split-KV rule; not a number from 0 to 64: the default */
    const char *waves = getenv("KVQ_DECODE_WAVES");
    c->decode_waves = waves && *waves >= '0' && *waves <= '9' ? atoi(waves) : 0;
    if (c->decode_waves > 64) c->decode_waves = 0;
    if (c->dev) cu_dev_leave(c->dev, &cs);
    if (st != KVQ_OK) {
        if (st == KVQ_ERR_NOMEM) snprintf(msg, n, "out of memory");
        ctx_free(c);
        return st;
    }
    *out = c;
    return KVQ_OK;
}
static kvq_status prepare_cuda(const kvq_be_engine *e, kvq_backend_ctx **out, char *msg, size_t n)
{
    return prepare_kind(CU_DEV_GPU, e, out, msg, n);
}
static kvq_status prepare_emu(const kvq_be_engine *e, kvq_backend_ctx **out, char *msg, size_t n)
{
    return prepare_kind(CU_DEV_EMU, e, out, msg, n);
}

static void layer_free(kvq_backend_ctx *c, cu_layer *L)
{
    if (!L) return;
    if (L->sparse)
        cu_slayer_free(c, &L->s);
    else
        cu_qlayer_free(c, &L->q);
    kvq_free(L);
}

static kvq_status cu_seq_create(kvq_backend_ctx *c, kvq_backend_seq **out, char *msg, size_t n)
{
    (void)msg, (void)n;
    kvq_backend_seq *s = kvq_calloc(1, sizeof *s);
    if (!s) return KVQ_ERR_NOMEM;
    s->n_layers = c->e.dims.layers;
    s->layers = kvq_calloc((size_t)s->n_layers, sizeof *s->layers);
    if (!s->layers) {
        kvq_free(s);
        return KVQ_ERR_NOMEM;
    }
    *out = s;
    return KVQ_OK;
}

static void cu_seq_free(kvq_backend_ctx *c, kvq_backend_seq *s)
{
    if (!s) return;
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    for (int l = 0; l < s->n_layers; l++) layer_free(c, s->layers[l]);
    cu_step_tiles_free(c, s);
    cu_dev_leave(c->dev, &cs);
    kvq_free(s->layers);
    kvq_free(s);
}

static int layer_length(const cu_layer *L) { return !L ? 0 : L->sparse ? L->s.length : L->q.length; }

static int cu_seq_length(const kvq_backend_seq *s, int layer)
{
    if (!s || layer < 0 || layer >= s->n_layers) return 0;
    return layer_length(s->layers[layer]);
}

/* Each sequence's new layer is built aside and installed only when every item succeeded. */
static kvq_status cu_prefill(kvq_backend_ctx *c, int layer, const kvq_be_prefill *items, int n, char *msg, size_t ms)
{
    cu_layer **built = kvq_calloc((size_t)n, sizeof *built);
    if (!built) {
        snprintf(msg, ms, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    kvq_status st = KVQ_OK;
    int i;
    for (i = 0; i < n && st == KVQ_OK; i++) {
        built[i] = kvq_calloc(1, sizeof **built);
        if (!built[i]) {
            st = KVQ_ERR_NOMEM;
            snprintf(msg, ms, "out of memory");
            break;
        }
        st = c->e.layer_sparse[layer] ? cu_slayer_prefill(c, built[i], layer, &items[i], msg, ms)
                                      : cu_qlayer_prefill(c, built[i], layer, &items[i], msg, ms);
        if (st != KVQ_OK) break;
    }
    if (st != KVQ_OK) {
        for (int j = 0; j < n; j++) layer_free(c, built[j]);
        kvq_free(built);
        char tmp[512];
        snprintf(tmp, sizeof tmp, "prefill item %d: %s", i, msg);
        snprintf(msg, ms, "%s", tmp);
        return st;
    }
    for (i = 0; i < n; i++) {
        layer_free(c, items[i].seq->layers[layer]);
        items[i].seq->layers[layer] = built[i];
        cu_step_tiles_forget(items[i].seq, layer); /* a new layer: its planned tiles are sent whole */
    }
    kvq_free(built);
    return KVQ_OK;
}

static kvq_status layer_save(cu_layer *L, cu_snap *s)
{
    if (!L->sparse) return cu_qlayer_save(&L->q, s);
    cu_slayer_save(&L->s, s);
    return KVQ_OK;
}


/* A decode step, all-or-nothing per sequence (backend.h): each item's layer metadata is saved first; the step then
 * writes on the device only where nothing lives yet (new pages, free window slots, the free copy of OTT's pool
 * state, free probe rows) while it updates the host metadata in place; when everything succeeded the items adopt
 * OTT's new copies (cu_qlayer_commit), otherwise every item is put back from its snapshot, which frees what the
 * step created and undoes OTT's unmasking (the only device write that is undone rather than avoided). */
/* A decode step (host items, or the device tensors dv: items then carry only their sequences). */
static kvq_status decode_run(kvq_backend_ctx *c, int layer, const kvq_be_decode *items, int n, const kvq_dev_decode *dv,
                             uint64_t *out_dev, int download, char *msg, size_t ms)
{
    int H = c->H, Hq = c->Hq, D = c->D, cls = c->plan->layer_class[layer], saved = 0, bad = -1;
    size_t qd = (size_t)n * Hq * D;
    cu_snap *snap = kvq_calloc((size_t)n, sizeof *snap);
    kvq_seq_tiles *sq = kvq_calloc((size_t)n, sizeof *sq);
    float *qh = kvq_malloc(qd * sizeof *qh), *oh = kvq_malloc(qd * sizeof *oh);
    int *first = kvq_calloc((size_t)n + 1, sizeof *first);
    kvq_status st = snap && sq && qh && oh && first ? KVQ_OK : KVQ_ERR_NOMEM;
    /* 0. snapshots, before anything changes */
    for (int i = 0; i < n && st == KVQ_OK; i++)
        if ((st = layer_save(items[i].seq->layers[layer], &snap[i])) == KVQ_OK) saved++;
    /* 1. the batch's queries on the device (TailorKV's retrieval and ZipCache's probe rows read them there);
     *    host data of the step goes through the page-locked staging from here on (cu_upload) */
    c->in_step = 1;
    if (c->hst_synced) c->hst_used = 0; /* every copy from the staging has completed */
    c->hst_synced = 0;
    if (st == KVQ_OK) st = cu_scratch(c, &c->qbuf, &c->qbuf_bytes, (2 * qd + (size_t)n * Hq) * sizeof(float), msg, ms);
    /* the batch's new K and V rows, fp16 [n][2][H][D] (K then V of each item) */
    size_t kvi = (size_t)2 * H * D * 2, hd = (size_t)H * D;
    if (st == KVQ_OK) st = cu_scratch(c, &c->kvin, &c->kvin_bytes, (size_t)n * kvi, msg, ms);
    if (!dv) {
        /* host rows: q as they are, k and v rounded to fp16 here; one copy each through the staging */
        uint16_t *kv16 = st == KVQ_OK ? kvq_malloc((size_t)n * kvi) : NULL;
        if (st == KVQ_OK && !kv16) st = KVQ_ERR_NOMEM;
        for (int i = 0; i < n && st == KVQ_OK; i++) {
            memcpy(qh + (size_t)i * Hq * D, items[i].q, (size_t)Hq * D * sizeof *qh);
            kvq_f16_from_f32_n(kv16 + 2 * i * hd, items[i].k, hd);
            kvq_f16_from_f32_n(kv16 + (2 * i + 1) * hd, items[i].v, hd);
        }
        if (st == KVQ_OK) st = cu_upload(c, c->qbuf, qh, qd * sizeof *qh, msg, ms);
        if (st == KVQ_OK) st = cu_upload(c, c->kvin, kv16, (size_t)n * kvi, msg, ms);
        kvq_free(kv16);
    }
    /* 2. append each sequence's token (quantize-and-append, flushes, policies); layers without policies as list
     *    launches over the batch (cu_batch.c), device rows converted in the batch's kvq_step_in with the new rows'
     *    stores; otherwise first, as the host path rounds them (q to fp32 [n][Hq][D], k and v to fp16 rows) */
    int batched = 1;
    for (int i = 0; i < n; i++) {
        const cu_layer *L = items[i].seq->layers[layer];
        if (L->sparse || L->q.saliency || L->q.has_pool) batched = 0;
    }
    if (st == KVQ_OK && dv && !batched) st = cu_step_in(c, dv, n, c->qbuf, c->kvin, 0, 0, 0, 0, msg, ms);
    if (st == KVQ_OK && batched)
        st = cu_batch_begin(c, cls, c->kvin, c->kvin + (uint64_t)n * kvi, dv, n, c->qbuf, msg, ms);
    uint64_t outd = c->qbuf + qd * sizeof(float), lsed = outd + qd * sizeof(float);
    const uint64_t outk = cu_out_rows(c, dv, outd); /* where the kernels write o */
    for (int i = 0; i < n && st == KVQ_OK; i++) {
        cu_layer *L = items[i].seq->layers[layer];
        uint64_t kv = c->kvin + (uint64_t)i * kvi;
        st = L->sparse ? cu_slayer_append(c, &L->s, kv, c->qbuf + (uint64_t)i * Hq * D * 4, msg, ms)
                       : cu_qlayer_append(c, &L->q, kv, msg, ms);
        if (st != KVQ_OK) bad = i;
    }
    st = cu_batch_end(c, st, msg, ms);
    /* 3. tiles of every sequence, one upload */
    int nt = 0, max_tiles = 1;
    for (int i = 0; i < n && st == KVQ_OK; i++) {
        const cu_layer *L = items[i].seq->layers[layer];
        first[i] = nt;
        if (L->sparse)
            cu_slayer_tiles(c, &L->s, &nt);
        else
            cu_qlayer_tiles(c, &L->q, &nt);
        if (nt < 0) {
            st = KVQ_ERR_NOMEM;
            break;
        }
        if (nt - first[i] > max_tiles) max_tiles = nt - first[i];
    }
    /* the decode kernel stages a tile in shared memory sized for the class's tile: a longer one would overrun it */
    for (int j = 0; j < nt && st == KVQ_OK; j++) {
        int kinds = c->htiles[j].kinds, lim = plan_tile_tokens(&c->plan->cls[cls], (kinds & 255) == KVQ_SRC_F16,
                                                                ((kinds >> 8) & 255) == KVQ_SRC_F16);
        if (c->htiles[j].n > lim) {
            snprintf(msg, ms, "cuda: internal error: a decode tile of %d tokens, the plan's tile is %d",
                     c->htiles[j].n, lim);
            st = KVQ_ERR_INTERNAL;
        }
    }
    int tpc = cu_tiles_per_chunk(c, cls, n, max_tiles), nch = (max_tiles + tpc - 1) / tpc;
    if (nch < 1) nch = 1;
    if (st == KVQ_OK)
        st = cu_scratch(c, &c->tiles, &c->tiles_bytes, (size_t)(nt > 0 ? nt : 1) * sizeof(kvq_tile), msg, ms);
    if (st == KVQ_OK) st = cu_scratch(c, &c->seqs, &c->seqs_bytes, (size_t)n * sizeof(kvq_seq_tiles), msg, ms);
    /* the partials: when they must grow, for as many chunks as the split can ever give this batch (cu_chunks_max),
     * not this step's. The chunks grow with the tiles (a flush, a window's new tile) and a warm step must not
     * allocate: 40 tokens of a 256-token-tile scheme went from 1 chunk to 2 on the third host step. A buffer that
     * holds this step's (a reservation's) is kept as it is. */
    const size_t part_row = (size_t)n * Hq * (D + 1) * sizeof(float);
    size_t part_need = part_row * (size_t)nch;
    if (part_need > c->part_bytes || !c->part) {
        const int chmax = cu_chunks_max(c, cls, n);
        if (chmax > nch) part_need = part_row * (size_t)chmax;
    }
    if (st == KVQ_OK) st = cu_scratch(c, &c->part, &c->part_bytes, part_need, msg, ms);
    for (int i = 0; i < n && st == KVQ_OK; i++) {
        sq[i].tiles = c->tiles + (uint64_t)first[i] * sizeof(kvq_tile);
        sq[i].n_tiles = (i + 1 < n ? first[i + 1] : nt) - first[i];
    }
    if (st == KVQ_OK) st = cu_upload(c, c->tiles, c->htiles, (size_t)nt * sizeof(kvq_tile), msg, ms);
    if (st == KVQ_OK) st = cu_upload(c, c->seqs, sq, (size_t)n * sizeof *sq, msg, ms);
    /* 4. the fused decode kernel for the whole batch, then the merge of the chunks */
    if (st == KVQ_OK)
        st = cu_decode_launch(c, cls, n, nch, tpc, c->qbuf, c->seqs, outk, lsed, c->part, c->tq_s ? c->tq_s[layer] : 0,
                              msg, ms);
    /* 5. ZipCache: probe rows over this step's tiles (its query on the device, docs/cuda.md "Determinism"),
     *    compression every W */
    for (int i = 0; i < n && st == KVQ_OK; i++) {
        cu_layer *L = items[i].seq->layers[layer];
        if (L->sparse) continue;
        st = cu_qlayer_after_attend(c, &L->q, c->qbuf + (uint64_t)i * Hq * D * 4, &sq[i], msg, ms);
        if (st != KVQ_OK) bad = i;
    }
    /* 6. device tensors: the outputs in the caller's dtype and strides; lse from base 2 to natural logarithms */
    if (st == KVQ_OK && dv) st = cu_convert_out(c, dv, n, outk, lsed, msg, ms);
    /* 7. the host-pointer API: the outputs through the staging, and the step's one synchronisation */
    float *oh_pinned = NULL;
    if (st == KVQ_OK && download) {
        st = cu_stage_take(c, qd * sizeof *oh, (void **)&oh_pinned, msg, ms);
        if (st == KVQ_OK) st = cu_dev_d2h_async(c->dev, oh_pinned, outd, qd * sizeof *oh, msg, ms);
        if (st == KVQ_OK) st = cu_dev_sync(c->dev, msg, ms);
        if (st == KVQ_OK) memcpy(oh, oh_pinned, qd * sizeof *oh);
        c->hst_synced = st == KVQ_OK;
    }
    c->in_step = 0;
    /* 8. adopt, or put every item back */
    if (st == KVQ_OK) {
        for (int i = 0; i < n; i++) {
            cu_layer *L = items[i].seq->layers[layer];
            if (!L->sparse) cu_qlayer_commit(c, &L->q);
            if (download) memcpy(items[i].out, oh + (size_t)i * Hq * D, (size_t)Hq * D * sizeof *oh);
        }
        if (out_dev) *out_dev = outd;
    } else {
        if (st == KVQ_ERR_NOMEM) snprintf(msg, ms, "out of memory");
        if (bad >= 0) {
            char tmp[512];
            snprintf(tmp, sizeof tmp, "decode item %d: %s", bad, msg);
            snprintf(msg, ms, "%s", tmp);
        }
        for (int i = saved - 1; i >= 0; i--) {
            cu_layer *L = items[i].seq->layers[layer];
            char um[256];
            if (L->sparse) {
                cu_slayer_restore(c, &L->s, &snap[i]);
            } else if (cu_qlayer_restore(c, &L->q, &snap[i], um, sizeof um) != KVQ_OK) {
                /* the device failed again: the unmasked slots could not be masked back */
                size_t len = strlen(msg);
                snprintf(msg + len, ms > len ? ms - len : 0, "; item %d could not be restored: %s", i, um);
                st = KVQ_ERR_INTERNAL;
            }
        }
    }
    for (int i = 0; snap && i < n; i++) kvq_free(snap[i].probe_pos);
    kvq_free(snap);
    kvq_free(sq);
    kvq_free(qh);
    kvq_free(oh);
    kvq_free(first);
    c->in_step = 0;
    return st;
}

kvq_status cu_decode_enqueue(kvq_backend_ctx *c, int layer, const kvq_be_decode *items, int n, uint64_t *out_dev,
                             char *msg, size_t ms)
{
    return decode_run(c, layer, items, n, NULL, out_dev, 0, msg, ms);
}

/* Statistics are derived when asked for: OTT's counts come from the device here (a synchronous copy, outside
 * any step), so this brackets its device calls like the other entry points. */
static void cu_seq_account(const kvq_backend_ctx *c, const kvq_backend_seq *s, kvq_mem_stats *out)
{
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    for (int l = 0; l < s->n_layers; l++) {
        cu_layer *L = s->layers[l];
        if (!L) continue;
        if (L->sparse)
            cu_slayer_account(c, &L->s, out);
        else
            cu_qlayer_account(c, &L->q, out);
    }
    cu_dev_leave(c->dev, &cs);
}

static kvq_status cu_read_cache(kvq_backend_ctx *c, const kvq_backend_seq *s, int layer, float *k, float *v,
                                int capacity, int *n_tokens, char *msg, size_t ms)
{
    const cu_layer *L = s->layers[layer];
    int len = layer_length(L);
    *n_tokens = len;
    if (capacity < len) {
        snprintf(msg, ms, "capacity %d is smaller than the %d tokens of layer %d", capacity, len, layer);
        return KVQ_ERR_INVALID;
    }
    if (!L) return KVQ_OK;
    return L->sparse ? cu_slayer_read(c, &L->s, k, v, capacity, msg, ms)
                     : cu_qlayer_read(c, &L->q, k, v, capacity, msg, ms);
}

/* ---- entry points that touch the device: any thread may call them (docs/cuda.md, "Threads") ---- */

static kvq_status be_prefill(kvq_backend_ctx *c, int layer, const kvq_be_prefill *items, int n, char *msg, size_t ms)
{
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    kvq_status st = cu_prefill(c, layer, items, n, msg, ms);
    cu_dev_leave(c->dev, &cs);
    return st;
}

static kvq_status be_decode(kvq_backend_ctx *c, int layer, const kvq_be_decode *items, int n, char *msg, size_t ms)
{
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    kvq_status st = decode_run(c, layer, items, n, NULL, NULL, 1, msg, ms);
    cu_dev_leave(c->dev, &cs);
    return st;
}

static kvq_status be_read_cache(kvq_backend_ctx *c, const kvq_backend_seq *s, int layer, float *k, float *v,
                                int capacity, int *n_tokens, char *msg, size_t ms)
{
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    kvq_status st = cu_read_cache(c, s, layer, k, v, capacity, n_tokens, msg, ms);
    cu_dev_leave(c->dev, &cs);
    return st;
}

static kvq_status be_dense_preference(kvq_backend_ctx *c, const float *q, const float *k, int n, int n_q, double top,
                                      double *score, char *msg, size_t ms)
{
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    kvq_status st = cu_dense_preference(c, q, k, n, n_q, top, score, msg, ms);
    cu_dev_leave(c->dev, &cs);
    return st;
}

/* kvq_decode_device: the caller's stream for the call (then the engine's own again), no synchronisation. */
static kvq_status be_decode_device(kvq_backend_ctx *c, int layer, kvq_backend_seq *const *seqs, int n,
                                   const kvq_dev_decode *b, char *msg, size_t ms)
{
    kvq_be_decode *items = kvq_calloc((size_t)n, sizeof *items);
    if (!items) {
        snprintf(msg, ms, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    for (int i = 0; i < n; i++) items[i].seq = seqs[i];
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    void *prev = cu_dev_stream(c->dev);
    if (b->stream) cu_dev_set_stream(c->dev, b->stream);
    kvq_status st = decode_run(c, layer, items, n, b, NULL, 0, msg, ms);
    cu_dev_set_stream(c->dev, prev);
    cu_dev_leave(c->dev, &cs);
    kvq_free(items);
    return st;
}

/* kvq_prefill_device's download of the prompt rows (a prefill is outside the steps: it may synchronise). */
static kvq_status be_download(kvq_backend_ctx *c, void *stream, void *dst, const void *src, size_t bytes, char *msg,
                              size_t ms)
{
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    void *prev = cu_dev_stream(c->dev);
    if (stream) cu_dev_set_stream(c->dev, stream);
    kvq_status st = cu_dev_d2h(c->dev, dst, dev_addr(src), bytes, msg, ms);
    cu_dev_set_stream(c->dev, prev);
    cu_dev_leave(c->dev, &cs);
    return st;
}

static kvq_status be_reserve(kvq_backend_ctx *c, size_t bytes, char *msg, size_t ms)
{
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    kvq_status st = cu_pool_reserve(c, bytes, msg, ms);
    if (st == KVQ_OK) cu_scratch_release(c); /* a reservation is outside the steps: outgrown scratch is freed */
    cu_dev_leave(c->dev, &cs);
    return st;
}

/* Planned steps (cu_step.c): kvq_engine_reserve_step, kvq_decode_plan, kvq_decode_run. */
static kvq_status be_reserve_step(kvq_backend_ctx *c, int max_batch, int max_tokens, char *msg, size_t ms)
{
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    kvq_status st = cu_step_reserve(c, max_batch, max_tokens, msg, ms);
    if (st == KVQ_OK) st = cu_scratch_reserve(c, max_batch, &c->step, msg, ms);
    cu_dev_leave(c->dev, &cs);
    return st;
}

static kvq_status be_decode_plan(kvq_backend_ctx *c, kvq_backend_seq *const *seqs, int n, void *stream, char *msg,
                                 size_t ms)
{
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    kvq_status st = cu_step_plan(c, seqs, n, stream, msg, ms);
    cu_dev_leave(c->dev, &cs);
    return st;
}

static kvq_status be_decode_run(kvq_backend_ctx *c, int layer, kvq_backend_seq *const *seqs, int n,
                                const kvq_dev_decode *b, char *msg, size_t ms)
{
    cu_ctx_scope cs;
    cu_dev_enter(c->dev, &cs);
    kvq_status st = cu_step_run(c, layer, seqs, n, b, msg, ms);
    cu_dev_leave(c->dev, &cs);
    return st;
}

const kvq_backend kvq_backend_cuda = {
    .name = "cuda",
    .probe = probe_cuda,
    .supports = cu_supports,
    .prepare = prepare_cuda,
    .destroy = ctx_free,
    .seq_create = cu_seq_create,
    .seq_free = cu_seq_free,
    .seq_length = cu_seq_length,
    .prefill = be_prefill,
    .prefill_f16 = 1,
    .decode = be_decode,
    .seq_account = cu_seq_account,
    .read_cache = be_read_cache,
    .dense_preference = be_dense_preference,
    .reserve = be_reserve,
    .decode_device = be_decode_device,
    .download = be_download,
    .reserve_step = be_reserve_step,
    .decode_plan = be_decode_plan,
    .decode_run = be_decode_run,
    .step_tiles = cu_step_tiles_info,
};

const kvq_backend kvq_backend_emu = {
    .name = "emu",
    .probe = probe_emu,
    .supports = cu_supports,
    .prepare = prepare_emu,
    .destroy = ctx_free,
    .seq_create = cu_seq_create,
    .seq_free = cu_seq_free,
    .seq_length = cu_seq_length,
    .prefill = be_prefill,
    .prefill_f16 = 1,
    .decode = be_decode,
    .seq_account = cu_seq_account,
    .read_cache = be_read_cache,
    .dense_preference = be_dense_preference,
    .reserve = be_reserve,
    .decode_device = be_decode_device,
    .download = be_download,
    .reserve_step = be_reserve_step,
    .decode_plan = be_decode_plan,
    .decode_run = be_decode_run,
    .step_tiles = cu_step_tiles_info,
};
