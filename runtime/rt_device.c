/* The device-tensor entry points (kvq.h, "Device tensors"; docs/cuda.md): the public checks, then the backend's
 * decode_device (everything stays on the device, on the caller's stream), or for a prefill the prompt rows read
 * once into host memory in the engine's dtype and kvq_prefill's path (its checks, calibration and all). */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "rt_internal.h"

static kvq_status check_tensor(kvq_engine *e, const char *fn, const char *name, const kvq_dev_tensor *t, int out)
{
    if (!t->data) return rt_error(e, KVQ_ERR_INVALID, "%s: %s.data is NULL", fn, name);
    if (!(t->dtype == KVQ_F16 || t->dtype == KVQ_BF16 || (out && t->dtype == KVQ_F32)))
        return rt_error(e, KVQ_ERR_INVALID, "%s: %s.dtype is %d: must be fp16 or bf16%s", fn, name, (int)t->dtype,
                        out ? " or fp32" : "");
    if (t->token_stride < 0 || t->head_stride < 0)
        return rt_error(e, KVQ_ERR_INVALID, "%s: %s: negative stride (token %lld, head %lld)", fn, name,
                        t->token_stride, t->head_stride);
    return KVQ_OK;
}

/* The output's n x heads rows of D elements must not overlap: heads within a token, tokens apart, or the
 * transpose. */
static int rows_disjoint(const kvq_dev_tensor *t, int n, int heads, int D)
{
    long long ts = t->token_stride, hs = t->head_stride;
    if (heads == 1) hs = D;
    if (n == 1) ts = (long long)heads * hs;
    return (hs >= D && ts >= (long long)heads * hs) || (ts >= D && hs >= (long long)n * ts);
}

static kvq_seq *seq_of(const void *seqs, int i) { return ((kvq_seq *const *)seqs)[i]; }

static kvq_status check_seqs(kvq_engine *e, const char *fn, int layer, kvq_seq *const *seqs, int n, int prefill)
{
    kvq_status st = rt_check_batch(e, fn, layer, seqs, n, seq_of, prefill);
    if (st == KVQ_OK && (!e->be->decode_device || !e->be->download))
        st = rt_error(e, KVQ_ERR_UNSUPPORTED, "%s: the %s backend has no device tensors (use cuda or emu)", fn,
                      e->be->name);
    return st;
}

/* Rotations are applied by the engine on host rows (rt_rotate.c): a device step would need q rotated and the
 * output rotated back on the device, which no backend does yet. Refused, not silently wrong. */
static kvq_status no_rotations(kvq_engine *e, const char *fn, int layer)
{
    return rt_error(e, KVQ_ERR_UNSUPPORTED,
                    "%s: layer %d of scheme '%s' rotates its keys or values (rotate): device tensors do not apply "
                    "rotations yet; use kvq_decode (host tensors), which does",
                    fn, layer, e->scheme->name);
}

/* The checks of a device decode batch (kvq_decode_device, kvq_decode_run). */
static kvq_status check_decode(kvq_engine *e, const char *fn, int layer, const kvq_dev_decode *b)
{
    if (!b) return rt_error(e, KVQ_ERR_INVALID, "%s: batch is NULL", fn);
    kvq_status st = check_seqs(e, fn, layer, b->seqs, b->n_seqs, 0);
    const kvq_dims *d = &e->cfg.dims;
    if (st == KVQ_OK) st = check_tensor(e, fn, "q", &b->q, 0);
    if (st == KVQ_OK) st = check_tensor(e, fn, "k", &b->k, 0);
    if (st == KVQ_OK) st = check_tensor(e, fn, "v", &b->v, 0);
    if (st == KVQ_OK) st = check_tensor(e, fn, "out", &b->out, 1);
    if (st == KVQ_OK && rt_rotate_active(e, layer)) st = no_rotations(e, fn, layer);
    if (st == KVQ_OK && !rows_disjoint(&b->out, b->n_seqs, d->heads, d->head_dim))
        st = rt_error(e, KVQ_ERR_INVALID, "%s: out's rows overlap (token stride %lld, head stride %lld)", fn,
                      b->out.token_stride, b->out.head_stride);
    return st;
}

kvq_status kvq_decode_device(kvq_engine *e, int layer, const kvq_dev_decode *b)
{
    static const char fn[] = "kvq_decode_device";
    if (!e) return KVQ_ERR_INVALID;
    kvq_status st = check_decode(e, fn, layer, b);
    if (st != KVQ_OK) return st;
    kvq_backend_seq **bs = kvq_malloc((size_t)b->n_seqs * sizeof *bs);
    if (!bs) return rt_error(e, KVQ_ERR_NOMEM, "%s: out of memory", fn);
    for (int i = 0; i < b->n_seqs; i++) bs[i] = b->seqs[i]->bseq;
    char msg[RT_ERRMSG_MAX] = "";
    st = e->be->decode_device(e->ctx, layer, bs, b->n_seqs, b, msg, sizeof msg);
    kvq_free(bs);
    if (st != KVQ_OK) rt_error(e, st, "%s: layer %d: %s", fn, layer, msg[0] ? msg : kvq_status_str(st));
    return st;
}

/* Rows [t0, t1) of t (heads x D each) from the device into dst [heads][t1 - t0][D] in dtype `want` (the engine's:
 * t's own dtype, or fp32). */
static kvq_status read_rows(kvq_engine *e, const kvq_dev_tensor *t, void *stream, int t0, int t1, int heads,
                            kvq_dtype want, void *dst, char *msg, size_t ms)
{
    int D = e->cfg.dims.head_dim, T = t1 - t0;
    size_t es = rt_dtype_size(t->dtype), ws = rt_dtype_size(want);
    long long first = (long long)t0 * t->token_stride;
    long long last = (long long)(t1 - 1) * t->token_stride + (long long)(heads - 1) * t->head_stride + D - 1;
    size_t span = (size_t)(last - first + 1);
    unsigned char *tmp = kvq_malloc(span * es);
    if (!tmp) return KVQ_ERR_NOMEM;
    kvq_status st = e->be->download(e->ctx, stream, tmp, (const unsigned char *)t->data + (size_t)first * es,
                                    span * es, msg, ms);
    for (int h = 0; h < heads && st == KVQ_OK; h++)
        for (int r = 0; r < T; r++) {
            const unsigned char *src = tmp + ((size_t)r * t->token_stride + (size_t)h * t->head_stride) * es;
            unsigned char *out = (unsigned char *)dst + ((size_t)h * T + r) * D * ws;
            if (want == t->dtype)
                memcpy(out, src, (size_t)D * es);
            else
                rt_to_f32(t->dtype, src, (size_t)D, (float *)out);
        }
    kvq_free(tmp);
    return st;
}

kvq_status kvq_prefill_device(kvq_engine *e, int layer, const kvq_dev_prefill *b)
{
    static const char fn[] = "kvq_prefill_device";
    if (!e) return KVQ_ERR_INVALID;
    if (!b) return rt_error(e, KVQ_ERR_INVALID, "%s: batch is NULL", fn);
    kvq_status st = check_seqs(e, fn, layer, b->seqs, b->n_seqs, 1);
    if (st != KVQ_OK) return st;
    if (!b->cu_seqlens) return rt_error(e, KVQ_ERR_INVALID, "%s: cu_seqlens is NULL", fn);
    if (b->cu_seqlens[0] != 0) return rt_error(e, KVQ_ERR_SHAPE, "%s: cu_seqlens[0] is %d, must be 0", fn, b->cu_seqlens[0]);
    for (int i = 0; i < b->n_seqs; i++)
        if (b->cu_seqlens[i + 1] <= b->cu_seqlens[i])
            return rt_error(e, KVQ_ERR_SHAPE, "%s: sequence %d: cu_seqlens %d then %d: a prompt needs a token", fn, i,
                            b->cu_seqlens[i], b->cu_seqlens[i + 1]);
    st = check_tensor(e, fn, "k", &b->k, 0);
    if (st == KVQ_OK) st = check_tensor(e, fn, "v", &b->v, 0);
    if (st == KVQ_OK && b->q.data) st = check_tensor(e, fn, "q", &b->q, 0);
    if (st != KVQ_OK) return st;
    kvq_dtype want = e->cfg.dtype;
    const kvq_dev_tensor *ts[3] = {&b->k, &b->v, &b->q};
    for (int x = 0; x < 3; x++)
        if (ts[x]->data && want != KVQ_F32 && ts[x]->dtype != want)
            return rt_error(e, KVQ_ERR_INVALID, "%s: %s is dtype %d, the engine's is %d (or make the engine fp32)", fn,
                            x == 0 ? "k" : x == 1 ? "v" : "q", (int)ts[x]->dtype, (int)want);
    const kvq_dims *d = &e->cfg.dims;
    int n = b->n_seqs;
    kvq_prefill_item *items = kvq_calloc((size_t)n, sizeof *items);
    void **bufs = kvq_calloc((size_t)n * 3, sizeof *bufs);
    char msg[RT_ERRMSG_MAX] = "";
    st = items && bufs ? KVQ_OK : KVQ_ERR_NOMEM;
    for (int i = 0; i < n && st == KVQ_OK; i++) {
        int t0 = b->cu_seqlens[i], t1 = b->cu_seqlens[i + 1], T = t1 - t0;
        for (int x = 0; x < 3 && st == KVQ_OK; x++) {
            if (!ts[x]->data) continue;
            int heads = x == 2 ? d->heads : d->kv_heads;
            bufs[3 * i + x] = kvq_malloc((size_t)heads * T * d->head_dim * rt_dtype_size(want));
            st = bufs[3 * i + x] ? read_rows(e, ts[x], b->stream, t0, t1, heads, want, bufs[3 * i + x], msg, sizeof msg)
                                 : KVQ_ERR_NOMEM;
        }
        items[i] = (kvq_prefill_item){b->seqs[i], T, bufs[3 * i], bufs[3 * i + 1], bufs[3 * i + 2]};
    }
    if (st == KVQ_OK)
        st = kvq_prefill(e, layer, items, n); /* its message names kvq_prefill and the item */
    else
        rt_error(e, st, "%s: layer %d: %s", fn, layer, st == KVQ_ERR_NOMEM ? "out of memory" : msg);
    for (int i = 0; bufs && i < 3 * n; i++) kvq_free(bufs[i]);
    kvq_free(bufs);
    kvq_free(items);
    return st;
}

/* ---- planned steps (kvq.h "Planned decode steps"; cu_step.c) ---- */

static kvq_status no_steps(kvq_engine *e, const char *fn)
{
    return rt_error(e, KVQ_ERR_UNSUPPORTED, "%s: the %s backend has no planned steps (use cuda or emu)", fn,
                    e->be->name);
}

kvq_status kvq_engine_reserve_step(kvq_engine *e, int max_batch, int max_tokens)
{
    static const char fn[] = "kvq_engine_reserve_step";
    if (!e) return KVQ_ERR_INVALID;
    if (!e->be->reserve_step) return no_steps(e, fn);
    if (max_batch < 1 || max_tokens < 1)
        return rt_error(e, KVQ_ERR_INVALID, "%s: max_batch %d and max_tokens %d must be at least 1", fn, max_batch,
                        max_tokens);
    char msg[RT_ERRMSG_MAX] = "";
    kvq_status st = e->be->reserve_step(e->ctx, max_batch, max_tokens, msg, sizeof msg);
    if (st != KVQ_OK) rt_error(e, st, "%s: %d x %d: %s", fn, max_batch, max_tokens, msg[0] ? msg : kvq_status_str(st));
    return st;
}

static kvq_status backend_seqs(kvq_engine *e, const char *fn, kvq_seq *const *seqs, int n, kvq_backend_seq ***out)
{
    *out = kvq_malloc((size_t)n * sizeof **out);
    if (!*out) return rt_error(e, KVQ_ERR_NOMEM, "%s: out of memory", fn);
    for (int i = 0; i < n; i++) (*out)[i] = seqs[i]->bseq;
    return KVQ_OK;
}

kvq_status kvq_decode_plan(kvq_engine *e, kvq_seq *const *seqs, int n_seqs, void *stream)
{
    static const char fn[] = "kvq_decode_plan";
    if (!e) return KVQ_ERR_INVALID;
    if (!e->be->decode_plan) return no_steps(e, fn);
    kvq_status st = KVQ_OK;
    for (int l = 0; l < e->cfg.dims.layers && st == KVQ_OK; l++) {
        st = rt_check_batch(e, fn, l, seqs, n_seqs, seq_of, 0);
        if (st == KVQ_OK && rt_rotate_active(e, l)) st = no_rotations(e, fn, l);
    }
    kvq_backend_seq **bs = NULL;
    if (st == KVQ_OK) st = backend_seqs(e, fn, seqs, n_seqs, &bs);
    if (st != KVQ_OK) return st;
    char msg[RT_ERRMSG_MAX] = "";
    st = e->be->decode_plan(e->ctx, bs, n_seqs, stream, msg, sizeof msg);
    kvq_free(bs);
    if (st != KVQ_OK) rt_error(e, st, "%s: %s", fn, msg[0] ? msg : kvq_status_str(st));
    return st;
}

kvq_status kvq_decode_run(kvq_engine *e, int layer, const kvq_dev_decode *b)
{
    static const char fn[] = "kvq_decode_run";
    if (!e) return KVQ_ERR_INVALID;
    if (!e->be->decode_run) return no_steps(e, fn);
    kvq_status st = check_decode(e, fn, layer, b);
    kvq_backend_seq **bs = NULL;
    if (st == KVQ_OK) st = backend_seqs(e, fn, b->seqs, b->n_seqs, &bs);
    if (st != KVQ_OK) return st;
    char msg[RT_ERRMSG_MAX] = "";
    st = e->be->decode_run(e->ctx, layer, bs, b->n_seqs, b, msg, sizeof msg);
    kvq_free(bs);
    if (st != KVQ_OK) rt_error(e, st, "%s: layer %d: %s", fn, layer, msg[0] ? msg : kvq_status_str(st));
    return st;
}
