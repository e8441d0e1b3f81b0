/* The engine: the public runtime API of kvq.h. It validates every call (arguments, shapes, the per-layer state
 * of each sequence), converts the host's tensors to fp32, decides TailorKV layers by calibration, and dispatches
 * to a backend (backend.h) found in the registry below. Errors are a status plus a message kept on the engine
 * (SQLite's errmsg pattern); nothing is printed, nothing aborts, and a failed call changes nothing. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "layout.h"
#include "policy.h"
#include "rt_internal.h"
#include "status.h"

/* ---- backend registry: a backend built into libkvq adds one line here ---- */
typedef struct {
    kvq_backend_kind kind;
    const kvq_backend *backend;
} rt_registered;

extern const kvq_backend kvq_backend_cuda, kvq_backend_emu; /* runtime/cuda/cu_backend.c */
extern const kvq_backend kvq_backend_cpu;                    /* runtime/cpu/cpu_backend.c */
static const rt_registered registry[] = {
    {KVQ_BACKEND_REFERENCE, &kvq_backend_reference},
    {KVQ_BACKEND_CUDA, &kvq_backend_cuda},
    {KVQ_BACKEND_EMU, &kvq_backend_emu},
    {KVQ_BACKEND_CPU, &kvq_backend_cpu},
};

const char *kvq_backend_name(kvq_backend_kind kind)
{
    switch (kind) {
    case KVQ_BACKEND_REFERENCE: return "reference";
    case KVQ_BACKEND_CUDA: return "cuda";
    case KVQ_BACKEND_EMU: return "emu";
    case KVQ_BACKEND_CPU: return "cpu";
    }
    return "?";
}

/* Backends that live outside libkvq (a test program's emulator backend) register themselves at start-up; they
 * take precedence over the table. Not thread-safe: call before creating engines. */
static rt_registered extra[4];
static int n_extra;

kvq_status rt_backend_register(kvq_backend_kind kind, const kvq_backend *backend)
{
    if (!backend) return KVQ_ERR_INVALID;
    for (int i = 0; i < n_extra; i++)
        if (extra[i].kind == kind) {
            extra[i].backend = backend;
            return KVQ_OK;
        }
    if (n_extra == (int)(sizeof extra / sizeof extra[0])) return KVQ_ERR_NOMEM;
    extra[n_extra++] = (rt_registered){kind, backend};
    return KVQ_OK;
}

static const kvq_backend *find_backend(kvq_backend_kind kind)
{
    for (int i = 0; i < n_extra; i++)
        if (extra[i].kind == kind) return extra[i].backend;
    for (size_t i = 0; i < sizeof registry / sizeof registry[0]; i++)
        if (registry[i].kind == kind) return registry[i].backend;
    return NULL;
}

kvq_status rt_error(kvq_engine *e, kvq_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->errmsg, sizeof e->errmsg, fmt, ap);
    va_end(ap);
    return st;
}

void kvq_engine_config_init(kvq_engine_config *cfg)
{
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    cfg->backend = KVQ_BACKEND_REFERENCE;
    cfg->dtype = KVQ_F16;
}

kvq_status kvq_engine_create(const kvq_scheme *scheme, const kvq_engine_config *cfg, kvq_engine **out, char *errbuf,
                             size_t errbuf_size)
{
    if (errbuf && errbuf_size) errbuf[0] = '\0';
    if (!out) return kvq_status_msg(errbuf, errbuf_size, KVQ_ERR_INVALID, "out is NULL");
    *out = NULL;
    if (!scheme || !cfg)
        return kvq_status_msg(errbuf, errbuf_size, KVQ_ERR_INVALID, "%s is NULL", scheme ? "cfg" : "scheme");
    const kvq_dims *d = &cfg->dims;
    /* The one check of a scheme against dims that kvqc report and kvq eval make too (scheme_dims.c). */
    kvq_status st = kvq_scheme_check_dims(scheme, d, errbuf, errbuf_size);
    if (st != KVQ_OK) return st;
    if (cfg->dtype != KVQ_F32 && cfg->dtype != KVQ_F16 && cfg->dtype != KVQ_BF16)
        return kvq_status_msg(errbuf, errbuf_size, KVQ_ERR_INVALID, "unknown dtype %d", (int)cfg->dtype);
    if (!(cfg->softmax_scale >= 0.0f) || isinf(cfg->softmax_scale))
        return kvq_status_msg(errbuf, errbuf_size, KVQ_ERR_INVALID, "softmax_scale %g is not a finite value >= 0",
                            (double)cfg->softmax_scale);
    if (cfg->threads < 0 || cfg->threads > 1024)
        return kvq_status_msg(errbuf, errbuf_size, KVQ_ERR_INVALID, "threads %d is not in 0..1024 (0 = every core)",
                            cfg->threads);

    const kvq_backend *be = find_backend(cfg->backend);
    if (!be)
        return kvq_status_msg(errbuf, errbuf_size, KVQ_ERR_UNSUPPORTED,
                            "the %s backend is not built into this libkvq", kvq_backend_name(cfg->backend));
    char msg[RT_ERRMSG_MAX] = "";
    st = be->probe(msg, sizeof msg);
    if (st != KVQ_OK)
        return kvq_status_msg(errbuf, errbuf_size, st, "the %s backend cannot run here: %s", be->name, msg);

    kvq_engine *e = kvq_calloc(1, sizeof *e);
    if (!e) return kvq_status_msg(errbuf, errbuf_size, KVQ_ERR_NOMEM, "out of memory");
    size_t L = (size_t)d->layers;
    e->layer_sparse = kvq_calloc(L, 1);
    e->layer_auto = kvq_calloc(L, 1);
    e->layer_decided = kvq_calloc(L, 1);
    e->layer_used = kvq_calloc(L, 1);
    e->layer_score = kvq_malloc(L * sizeof *e->layer_score);
    if (!e->layer_sparse || !e->layer_auto || !e->layer_decided || !e->layer_used || !e->layer_score) {
        kvq_engine_free(e);
        return kvq_status_msg(errbuf, errbuf_size, KVQ_ERR_NOMEM, "out of memory");
    }
    e->scheme = scheme;
    e->cfg = *cfg;
    e->be = be;
    for (int l = 0; l < d->layers; l++) {
        kvq_layer_mode m = kvq_scheme_layer(scheme, l)->mode;
        e->layer_sparse[l] = m == KVQ_MODE_SPARSE;
        e->layer_auto[l] = m == KVQ_MODE_AUTO;
        e->layer_decided[l] = m != KVQ_MODE_AUTO;
        e->layer_score[l] = NAN;
    }
    e->bee.scheme = scheme;
    e->bee.dims = *d;
    e->bee.softmax_scale = cfg->softmax_scale > 0 ? cfg->softmax_scale : 1.0f / sqrtf((float)d->head_dim);
    e->bee.seed = cfg->seed;
    e->bee.threads = cfg->threads;
    e->bee.layer_sparse = e->layer_sparse;
    st = rt_rotate_init(e, msg, sizeof msg);
    if (st != KVQ_OK) {
        kvq_status_msg(errbuf, errbuf_size, st, "%s", msg[0] ? msg : "out of memory");
        kvq_engine_free(e);
        return st;
    }

    st = be->supports(&e->bee, msg, sizeof msg);
    if (st == KVQ_OK) st = be->prepare(&e->bee, &e->ctx, msg, sizeof msg);
    if (st != KVQ_OK) {
        if (st == KVQ_ERR_NOMEM && !msg[0]) snprintf(msg, sizeof msg, "out of memory");
        kvq_status_msg(errbuf, errbuf_size, st, "%s backend: %s", be->name, msg);
        kvq_engine_free(e);
        return st;
    }
    *out = e;
    return KVQ_OK;
}

void kvq_engine_free(kvq_engine *e)
{
    if (!e) return;
    while (e->seqs) kvq_seq_free(e, e->seqs);
    if (e->ctx) e->be->destroy(e->ctx);
    rt_rotate_free(e);
    kvq_free(e->layer_sparse);
    kvq_free(e->layer_auto);
    kvq_free(e->layer_decided);
    kvq_free(e->layer_used);
    kvq_free(e->layer_score);
    kvq_free(e);
}

const char *kvq_engine_errmsg(const kvq_engine *e) { return e ? e->errmsg : "engine is NULL"; }

/* ------------------------------------------------------------------------------------------- sequences -- */

kvq_status kvq_seq_create(kvq_engine *e, kvq_seq **out)
{
    if (!e) return KVQ_ERR_INVALID;
    if (!out) return rt_error(e, KVQ_ERR_INVALID, "kvq_seq_create: out is NULL");
    *out = NULL;
    kvq_seq *s = kvq_calloc(1, sizeof *s);
    if (!s) return rt_error(e, KVQ_ERR_NOMEM, "kvq_seq_create: out of memory");
    const kvq_dims *d = &e->cfg.dims;
    s->prefilled = kvq_calloc((size_t)d->layers, 1);
    if (rt_tq_split_any(e)) s->tq_perm = kvq_calloc((size_t)d->layers * 2 * (size_t)d->kv_heads, (size_t)d->head_dim);
    char msg[RT_ERRMSG_MAX] = "out of memory";
    kvq_status st = s->prefilled && (s->tq_perm || !rt_tq_split_any(e)) ? e->be->seq_create(e->ctx, &s->bseq, msg, sizeof msg)
                                                                         : KVQ_ERR_NOMEM;
    if (st != KVQ_OK) {
        kvq_free(s->tq_perm);
        kvq_free(s->prefilled);
        kvq_free(s);
        return rt_error(e, st, "kvq_seq_create: %s", msg);
    }
    s->engine = e;
    s->next = e->seqs;
    if (e->seqs) e->seqs->prev = s;
    e->seqs = s;
    *out = s;
    return KVQ_OK;
}

void kvq_seq_free(kvq_engine *e, kvq_seq *s)
{
    if (!e || !s || s->engine != e) return;
    if (s->prev)
        s->prev->next = s->next;
    else
        e->seqs = s->next;
    if (s->next) s->next->prev = s->prev;
    e->be->seq_free(e->ctx, s->bseq);
    kvq_free(s->tq_perm);
    kvq_free(s->prefilled);
    kvq_free(s);
}

int kvq_seq_length(const kvq_seq *s, int layer)
{
    if (!s || layer < 0 || layer >= s->engine->cfg.dims.layers) return -1;
    return s->engine->be->seq_length(s->bseq, layer);
}

/* ---------------------------------------------------------------------------------------- prefill/decode -- */

static int layer_needs_q(const kvq_engine *e, int layer)
{
    if (!e->layer_decided[layer]) return 1; /* calibration from this prefill's queries */
    if (e->layer_sparse[layer]) return 0;
    return kvq_scheme_layer(e->scheme, layer)->quant.saliency.metric != KVQ_SAL_NONE; /* ZipCache probes */
}

int kvq_prefill_needs_queries(const kvq_engine *e, int layer)
{
    if (!e || layer < 0 || layer >= e->cfg.dims.layers) return -1;
    return layer_needs_q(e, layer);
}

static kvq_status check_layer(kvq_engine *e, const char *fn, int layer)
{
    if (layer < 0 || layer >= e->cfg.dims.layers)
        return rt_error(e, KVQ_ERR_INVALID, "%s: layer %d is out of range (the engine has %d)", fn, layer,
                        e->cfg.dims.layers);
    return KVQ_OK;
}

kvq_status rt_check_batch(kvq_engine *e, const char *fn, int layer, const void *items, int n,
                          kvq_seq *(*seq_at)(const void *items, int i), int prefill)
{
    kvq_status st = check_layer(e, fn, layer);
    if (st != KVQ_OK) return st;
    if (!items || n < 1)
        return rt_error(e, KVQ_ERR_INVALID, "%s: no items (items %p, n_items %d)", fn, items, n);
    for (int i = 0; i < n; i++) {
        const kvq_seq *s = seq_at(items, i);
        if (!s) return rt_error(e, KVQ_ERR_INVALID, "%s: item %d: seq is NULL", fn, i);
        if (s->engine != e)
            return rt_error(e, KVQ_ERR_INVALID, "%s: item %d: the sequence belongs to another engine", fn, i);
        if (prefill && s->prefilled[layer])
            return rt_error(e, KVQ_ERR_STATE, "%s: item %d: layer %d of this sequence is already prefilled", fn, i,
                            layer);
        if (!prefill && !s->prefilled[layer])
            return rt_error(e, KVQ_ERR_STATE, "%s: item %d: layer %d of this sequence has not been prefilled", fn, i,
                            layer);
        for (int j = 0; j < i; j++)
            if (seq_at(items, j) == s)
                return rt_error(e, KVQ_ERR_INVALID, "%s: items %d and %d are the same sequence", fn, j, i);
    }
    return KVQ_OK;
}

static kvq_seq *prefill_seq(const void *items, int i) { return ((const kvq_prefill_item *)items)[i].seq; }
static kvq_seq *decode_seq(const void *items, int i) { return ((const kvq_decode_item *)items)[i].seq; }

/* TailorKV Eq. 6-9 for the engine's layer: P_l from the last n_q queries of one prompt. A backend that has it
 * computes it (the cuda/emu backends' kvq_tk_dense kernel, equal to the host's value bit for bit). */
static kvq_status dense_preference(kvq_engine *e, const float *q, const float *k, int n, float *scratch, double *out,
                                   char *msg, size_t msg_size)
{
    const kvq_classify_cfg *c = &e->scheme->classify;
    const kvq_dims *d = &e->cfg.dims;
    if (e->be->dense_preference)
        return e->be->dense_preference(e->ctx, q, k, n, c->queries, c->top, out, msg, msg_size);
    *out = kvq_dense_preference_layer(q, k, d->heads, d->kv_heads, n, d->head_dim, c->queries, c->top,
                                      e->bee.softmax_scale, scratch);
    return KVQ_OK;
}

static void decide(kvq_engine *e, int layer, double score)
{
    /* TailorKV Eq. 9: P_l > tau is quantization-friendly, otherwise sparsity-friendly. */
    e->layer_sparse[layer] = !(score > e->scheme->classify.tau);
    e->layer_decided[layer] = 1;
    e->layer_score[layer] = score;
}

kvq_status kvq_prefill(kvq_engine *e, int layer, const kvq_prefill_item *items, int n_items)
{
    static const char fn[] = "kvq_prefill";
    if (!e) return KVQ_ERR_INVALID;
    kvq_status st = rt_check_batch(e, fn, layer, items, n_items, prefill_seq, 1);
    if (st != KVQ_OK) return st;
    int need_q = layer_needs_q(e, layer);
    for (int i = 0; i < n_items; i++) {
        const kvq_prefill_item *it = &items[i];
        if (it->n_tokens < 1)
            return rt_error(e, KVQ_ERR_SHAPE, "%s: item %d: n_tokens is %d, must be at least 1", fn, i, it->n_tokens);
        if (!it->k || !it->v) return rt_error(e, KVQ_ERR_INVALID, "%s: item %d: %s is NULL", fn, i, it->k ? "v" : "k");
        if (need_q && !it->q)
            return rt_error(e, KVQ_ERR_INVALID, "%s: item %d: layer %d needs the prompt's queries (%s), q is NULL", fn,
                            i, layer, e->layer_decided[layer] ? "saliency probes" : "calibration");
    }

    const kvq_dims *d = &e->cfg.dims;
    size_t D = (size_t)d->head_dim;
    kvq_be_prefill *bi = kvq_calloc((size_t)n_items, sizeof *bi);
    float **bufs = kvq_calloc((size_t)n_items * 3, sizeof *bufs);
    float *scratch = NULL;
    int calibrate = !e->layer_decided[layer];
    int rotate = rt_rotate_configured(e, layer); /* rotated in place: fp32 inputs are copied too */
    /* fp16 rows go to the backend as they are when it takes them and the host changes nothing (backend.h) */
    int rows16 = e->cfg.dtype == KVQ_F16 && e->be->prefill_f16 && !rotate && !calibrate;
    int max_n = 0;
    for (int i = 0; i < n_items; i++) max_n = items[i].n_tokens > max_n ? items[i].n_tokens : max_n;
    if (calibrate) scratch = kvq_malloc((size_t)max_n * sizeof *scratch);
    st = bi && bufs && (!calibrate || scratch) ? KVQ_OK : KVQ_ERR_NOMEM;
    for (int i = 0; i < n_items && st == KVQ_OK; i++) {
        const kvq_prefill_item *it = &items[i];
        size_t nkv = (size_t)d->kv_heads * (size_t)it->n_tokens * D, nq = (size_t)d->heads * (size_t)it->n_tokens * D;
        bi[i].seq = it->seq->bseq;
        bi[i].n_tokens = it->n_tokens;
        const void *src[3] = {it->k, it->v, it->q};
        size_t cnt[3] = {nkv, nkv, nq};
        for (int t = 0; t < 3 && st == KVQ_OK; t++) {
            if (!src[t]) continue;
            if (e->cfg.dtype == KVQ_F32 && !rotate) continue; /* used in place */
            if (rows16 && t < 2) continue;
            bufs[3 * i + t] = kvq_malloc(cnt[t] * sizeof(float));
            if (!bufs[3 * i + t])
                st = KVQ_ERR_NOMEM;
            else
                rt_to_f32(e->cfg.dtype, src[t], cnt[t], bufs[3 * i + t]);
        }
        if (rows16) {
            bi[i].k16 = it->k, bi[i].v16 = it->v;
        } else {
            bi[i].k = bufs[3 * i] ? bufs[3 * i] : it->k;
            bi[i].v = bufs[3 * i + 1] ? bufs[3 * i + 1] : it->v;
        }
        bi[i].q = it->q ? (bufs[3 * i + 2] ? bufs[3 * i + 2] : it->q) : NULL;
    }
    /* The input policy (rt_check.c): one bad element refuses the whole batch before anything is stored. */
    int input_refused = 0;
    for (int i = 0; i < n_items && st == KVQ_OK; i++) {
        if (rows16) {
            st = rt_check_kv16(e, fn, i, layer, "k", bi[i].k16, bi[i].n_tokens, 0);
            if (st == KVQ_OK) st = rt_check_kv16(e, fn, i, layer, "v", bi[i].v16, bi[i].n_tokens, 0);
        } else {
            st = rt_check_kv(e, fn, i, layer, "k", bi[i].k, bi[i].n_tokens, 0);
            if (st == KVQ_OK) st = rt_check_kv(e, fn, i, layer, "v", bi[i].v, bi[i].n_tokens, 0);
        }
        if (st == KVQ_OK && bi[i].q) st = rt_check_q(e, fn, i, layer, bi[i].q, bi[i].n_tokens, 0);
        input_refused = st != KVQ_OK;
    }
    int calibration_failed = 0;
    if (st == KVQ_OK && calibrate) {
        /* A layer left undecided is calibrated from its first prefill: the mean score of the batch's prompts. */
        double sum = 0, one = 0;
        char msg[RT_ERRMSG_MAX] = "";
        for (int i = 0; i < n_items && st == KVQ_OK; i++) {
            st = dense_preference(e, bi[i].q, bi[i].k, bi[i].n_tokens, scratch, &one, msg, sizeof msg);
            sum += one;
        }
        if (st == KVQ_OK)
            decide(e, layer, sum / n_items);
        else
            rt_error(e, st, "%s: layer %d: calibration: %s", fn, layer, msg[0] ? msg : kvq_status_str(st));
        calibration_failed = st != KVQ_OK;
    }
    if (st == KVQ_OK) {
        char msg[RT_ERRMSG_MAX] = "";
        /* Rotations (rt_rotate.c) once the layer's mode is known; a refusal names the rotated element. */
        for (int i = 0; i < n_items && st == KVQ_OK && rt_rotate_active(e, layer); i++)
            st = rt_rotate_in(e, fn, items[i].seq, i, layer, bufs[3 * i], bufs[3 * i + 1], bufs[3 * i + 2],
                              bi[i].n_tokens, 0);
        if (st == KVQ_OK) {
            st = e->be->prefill(e->ctx, layer, bi, n_items, msg, sizeof msg);
            if (st != KVQ_OK) rt_error(e, st, "%s: layer %d: %s", fn, layer, msg[0] ? msg : kvq_status_str(st));
        }
        if (st != KVQ_OK) {
            if (calibrate) { /* as before the call */
                e->layer_decided[layer] = 0;
                e->layer_sparse[layer] = 0;
                e->layer_score[layer] = NAN;
            }
        }
    } else if (!calibration_failed && !input_refused) {
        rt_error(e, st, "%s: out of memory", fn);
    }
    if (st == KVQ_OK) {
        for (int i = 0; i < n_items; i++) items[i].seq->prefilled[layer] = 1;
        e->layer_used[layer] = 1;
    }
    if (bufs)
        for (int i = 0; i < 3 * n_items; i++) kvq_free(bufs[i]);
    kvq_free(bufs);
    kvq_free(bi);
    kvq_free(scratch);
    return st;
}

kvq_status kvq_decode(kvq_engine *e, int layer, const kvq_decode_item *items, int n_items)
{
    static const char fn[] = "kvq_decode";
    if (!e) return KVQ_ERR_INVALID;
    kvq_status st = rt_check_batch(e, fn, layer, items, n_items, decode_seq, 0);
    if (st != KVQ_OK) return st;
    for (int i = 0; i < n_items; i++) {
        const kvq_decode_item *it = &items[i];
        if (!it->k || !it->v || !it->q || !it->out)
            return rt_error(e, KVQ_ERR_INVALID, "%s: item %d: %s is NULL", fn, i,
                            !it->k ? "k" : !it->v ? "v" : !it->q ? "q" : "out");
    }
    const kvq_dims *d = &e->cfg.dims;
    size_t nkv = (size_t)d->kv_heads * (size_t)d->head_dim, nq = (size_t)d->heads * (size_t)d->head_dim;
    size_t per = 2 * nkv + nq;
    kvq_be_decode *bi = kvq_calloc((size_t)n_items, sizeof *bi);
    float *buf = kvq_malloc((size_t)n_items * per * sizeof *buf);
    if (!bi || !buf) {
        kvq_free(bi);
        kvq_free(buf);
        return rt_error(e, KVQ_ERR_NOMEM, "%s: out of memory", fn);
    }
    for (int i = 0; i < n_items; i++) {
        float *b = buf + (size_t)i * per;
        rt_to_f32(e->cfg.dtype, items[i].k, nkv, b);
        rt_to_f32(e->cfg.dtype, items[i].v, nkv, b + nkv);
        rt_to_f32(e->cfg.dtype, items[i].q, nq, b + 2 * nkv);
        bi[i] = (kvq_be_decode){items[i].seq->bseq, b, b + nkv, b + 2 * nkv, items[i].out};
    }
    /* The input policy (rt_check.c): the new token is at position seq_length; nothing is stored on a refusal. */
    for (int i = 0; i < n_items; i++) {
        int pos = e->be->seq_length(items[i].seq->bseq, layer);
        st = rt_check_kv(e, fn, i, layer, "k", bi[i].k, 1, pos);
        if (st == KVQ_OK) st = rt_check_kv(e, fn, i, layer, "v", bi[i].v, 1, pos);
        if (st == KVQ_OK) st = rt_check_q(e, fn, i, layer, bi[i].q, 1, pos);
        /* Rotations: each item's new K/V rows and its query rows, once per step (rt_rotate.c). */
        float *b = buf + (size_t)i * per;
        if (st == KVQ_OK && rt_rotate_active(e, layer))
            st = rt_rotate_in(e, fn, items[i].seq, i, layer, b, b + nkv, b + 2 * nkv, 1, pos);
        if (st != KVQ_OK) {
            kvq_free(bi);
            kvq_free(buf);
            return st;
        }
    }
    char msg[RT_ERRMSG_MAX] = "";
    st = e->be->decode(e->ctx, layer, bi, n_items, msg, sizeof msg);
    if (st != KVQ_OK) rt_error(e, st, "%s: layer %d: %s", fn, layer, msg[0] ? msg : kvq_status_str(st));
    for (int i = 0; i < n_items && st == KVQ_OK; i++) rt_rotate_out(e, items[i].seq, layer, items[i].out, d->heads);
    kvq_free(bi);
    kvq_free(buf);
    return st;
}

/* ------------------------------------------------------------------------------------------- statistics -- */

static void add_seq(const kvq_engine *e, const kvq_seq *s, kvq_mem_stats *out, uint64_t *elems)
{
    e->be->seq_account(e->ctx, s->bseq, out);
    const kvq_dims *d = &e->cfg.dims;
    for (int l = 0; l < d->layers && s->tq_perm; l++)
        if (s->prefilled[l]) {
            out->bytes[KVQ_SEG_PARAMS] += rt_tq_split_bytes(e, l);
        }
    for (int l = 0; l < d->layers; l++)
        *elems += (uint64_t)e->be->seq_length(s->bseq, l) * (uint64_t)d->kv_heads * (uint64_t)d->head_dim * 2;
}

/* The derived figures exactly as kvq_scheme_account computes them. */
static void finish_stats(kvq_mem_stats *out, uint64_t elems)
{
    out->device_bytes = 0;
    for (int k = 0; k < KVQ_SEG_COUNT; k++)
        if (k != KVQ_SEG_HOST) out->device_bytes += out->bytes[k];
    out->fp16_bytes = elems * 2;
    out->effective_bits = elems ? (double)out->device_bytes * 8.0 / (double)elems : 0.0;
    out->compression_ratio = out->device_bytes ? (double)out->fp16_bytes / (double)out->device_bytes : 0.0;
}

/* The statistics calls take a const handle (they change no state) but still keep their failure's message on
 * it: errmsg is the engine's one mutable field, and every engine is allocated non-const, so writing it through
 * a cast is well-defined. */
static kvq_status stats_error(const kvq_engine *e, const char *msg)
{
    return rt_error((kvq_engine *)e, KVQ_ERR_INVALID, "%s", msg);
}

kvq_status kvq_engine_stats(const kvq_engine *e, kvq_mem_stats *out)
{
    if (!e) return KVQ_ERR_INVALID;
    if (!out) return stats_error(e, "kvq_engine_stats: out is NULL");
    memset(out, 0, sizeof *out);
    uint64_t elems = 0;
    for (const kvq_seq *s = e->seqs; s; s = s->next) add_seq(e, s, out, &elems);
    finish_stats(out, elems);
    return KVQ_OK;
}

kvq_status kvq_seq_stats(const kvq_engine *e, const kvq_seq *s, kvq_mem_stats *out)
{
    if (!e) return KVQ_ERR_INVALID;
    if (!s || !out) return stats_error(e, !s ? "kvq_seq_stats: seq is NULL" : "kvq_seq_stats: out is NULL");
    if (s->engine != e) return stats_error(e, "kvq_seq_stats: the sequence belongs to another engine");
    memset(out, 0, sizeof *out);
    uint64_t elems = 0;
    add_seq(e, s, out, &elems);
    finish_stats(out, elems);
    return KVQ_OK;
}

kvq_status kvq_seq_read_cache(kvq_engine *e, const kvq_seq *s, int layer, float *k, float *v, int capacity,
                              int *n_tokens)
{
    static const char fn[] = "kvq_seq_read_cache";
    if (!e) return KVQ_ERR_INVALID;
    kvq_status st = check_layer(e, fn, layer);
    if (st != KVQ_OK) return st;
    if (!s || !k || !v || !n_tokens)
        return rt_error(e, KVQ_ERR_INVALID, "%s: %s is NULL", fn, !s ? "seq" : !k ? "k" : !v ? "v" : "n_tokens");
    if (s->engine != e) return rt_error(e, KVQ_ERR_INVALID, "%s: the sequence belongs to another engine", fn);
    if (capacity < 0) return rt_error(e, KVQ_ERR_INVALID, "%s: capacity %d is negative", fn, capacity);
    char msg[RT_ERRMSG_MAX] = "";
    st = e->be->read_cache(e->ctx, s->bseq, layer, k, v, capacity, n_tokens, msg, sizeof msg);
    if (st != KVQ_OK) return rt_error(e, st, "%s: %s", fn, msg[0] ? msg : kvq_status_str(st));
    rt_rotate_back(e, s, layer, k, v, capacity, *n_tokens); /* the cache in the caller's basis */
    return KVQ_OK;
}

/* ------------------------------------------------------------------------------------------ calibration -- */

kvq_status kvq_calibrate_layer(kvq_engine *e, int layer, int n_tokens, const void *k, const void *q,
                               double *score_out)
{
    static const char fn[] = "kvq_calibrate_layer";
    if (!e) return KVQ_ERR_INVALID;
    kvq_status st = check_layer(e, fn, layer);
    if (st != KVQ_OK) return st;
    if (!e->layer_auto[layer])
        return rt_error(e, KVQ_ERR_INVALID, "%s: layer %d's mode is fixed by scheme '%s' (only mode auto calibrates)",
                        fn, layer, e->scheme->name);
    if (e->layer_used[layer])
        return rt_error(e, KVQ_ERR_STATE, "%s: layer %d is already in use (prefilled): its mode is final", fn, layer);
    if (n_tokens < 1) return rt_error(e, KVQ_ERR_SHAPE, "%s: n_tokens is %d, must be at least 1", fn, n_tokens);
    if (!k || !q) return rt_error(e, KVQ_ERR_INVALID, "%s: %s is NULL", fn, k ? "q" : "k");
    const kvq_dims *d = &e->cfg.dims;
    size_t nk = (size_t)d->kv_heads * (size_t)n_tokens * (size_t)d->head_dim;
    size_t nq = (size_t)d->heads * (size_t)n_tokens * (size_t)d->head_dim;
    float *fk = kvq_malloc(nk * sizeof *fk), *fq = kvq_malloc(nq * sizeof *fq);
    float *scratch = kvq_malloc((size_t)n_tokens * sizeof *scratch);
    if (!fk || !fq || !scratch) {
        kvq_free(fk);
        kvq_free(fq);
        kvq_free(scratch);
        return rt_error(e, KVQ_ERR_NOMEM, "%s: out of memory", fn);
    }
    rt_to_f32(e->cfg.dtype, k, nk, fk);
    rt_to_f32(e->cfg.dtype, q, nq, fq);
    double score = 0;
    char msg[RT_ERRMSG_MAX] = "";
    st = rt_check_kv(e, fn, 0, layer, "k", fk, n_tokens, 0);
    if (st == KVQ_OK) st = rt_check_q(e, fn, 0, layer, fq, n_tokens, 0);
    if (st != KVQ_OK) {
        kvq_free(fk);
        kvq_free(fq);
        kvq_free(scratch);
        return st;
    }
    st = dense_preference(e, fq, fk, n_tokens, scratch, &score, msg, sizeof msg);
    kvq_free(fk);
    kvq_free(fq);
    kvq_free(scratch);
    if (st != KVQ_OK) return rt_error(e, st, "%s: %s", fn, msg[0] ? msg : kvq_status_str(st));
    if (isnan(score)) return rt_error(e, KVQ_ERR_INTERNAL, "%s: the dense preference score is NaN", fn);
    decide(e, layer, score);
    if (score_out) *score_out = score;
    return KVQ_OK;
}

kvq_layer_state kvq_engine_layer_state(const kvq_engine *e, int layer)
{
    if (!e || layer < 0 || layer >= e->cfg.dims.layers || !e->layer_decided[layer]) return KVQ_LAYER_UNDECIDED;
    return e->layer_sparse[layer] ? KVQ_LAYER_SPARSE : KVQ_LAYER_QUANTIZED;
}

/* ------------------------------------------------------------------------------------ device memory -- */

kvq_status kvq_engine_reserve_device(kvq_engine *e, size_t bytes)
{
    if (!e) return KVQ_ERR_INVALID;
    if (!e->be->reserve || bytes == 0) return KVQ_OK;
    char msg[RT_ERRMSG_MAX] = "";
    kvq_status st = e->be->reserve(e->ctx, bytes, msg, sizeof msg);
    if (st != KVQ_OK)
        return rt_error(e, st, "kvq_engine_reserve_device: %zu bytes: %s", bytes, msg[0] ? msg : kvq_status_str(st));
    return KVQ_OK;
}
