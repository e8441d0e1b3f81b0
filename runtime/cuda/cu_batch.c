/* An eager step's appends as list launches (cu_backend.h "cu_batch.c"; docs/cuda.md "Eager steps").
 *
 * A decode step appends each sequence's token on the host (cu_qlayer_append: window slots, flushes, pages), and
 * every store and quantization it decides was its own launch: for KIVI at batch n, 3n launches of a few blocks
 * (the new K and V rows into the windows, the value leaving its window), 99 a layer at batch 32. While a batch is
 * open, cu_launch hands those launches here; they become items of the list kernels a planned step launches
 * (kvq_store_f16_list, kvq_factor_list_*, kvq_quant_list_*: the same bodies over items), and are sent as the
 * planned run orders them (cu_step.c run_layer): the new rows' stores, the other stores, the separable stores'
 * factor lists, then every store's quantizations in one launch (kvq_quant_lists_c<k>). The planned steps give the
 * eager steps' bits in that order (test_cuda_replay); the same holds here, for the layers the caller batches (no
 * policy kernels). A launch of any other kernel sends what is pending first, then goes to the device. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cu_backend.h"

enum { B_ST1, B_ST2, B_Q0, B_LISTS = B_Q0 + CU_STEP_STORES };

struct cu_batch {
    int cls;
    uint64_t kvin, kvin_end;
    /* device rows still to convert (kvq_step_in, which then also runs the new rows' stores), else NULL */
    const kvq_dev_decode *dv;
    int n_seq;
    uint64_t q;
    unsigned char *item[B_LISTS]; /* host copies of each list's items */
    int n[B_LISTS], cap[B_LISTS], maxn[B_LISTS];
};

static const char *const store_names[CU_STEP_STORES] = {"k_hi", "k_lo", "v_hi", "v_lo"};

static size_t item_size(int list) { return list < B_Q0 ? sizeof(kvq_store_params) : sizeof(kvq_quant_params); }
static size_t al16(size_t n) { return (n + 15) & ~(size_t)15; }

static kvq_status push(cu_batch *b, int list, const void *params, int n_tok, char *msg, size_t ms)
{
    const size_t sz = item_size(list);
    if (b->n[list] == b->cap[list]) {
        int cap = b->cap[list] ? 2 * b->cap[list] : 64;
        unsigned char *p = kvq_realloc(b->item[list], (size_t)cap * sz);
        if (!p) {
            snprintf(msg, ms, "out of memory");
            return KVQ_ERR_NOMEM;
        }
        b->item[list] = p, b->cap[list] = cap;
    }
    memcpy(b->item[list] + (size_t)b->n[list]++ * sz, params, sz);
    if (n_tok > b->maxn[list]) b->maxn[list] = n_tok;
    return KVQ_OK;
}

static void clear(cu_batch *b)
{
    for (int l = 0; l < B_LISTS; l++) b->n[l] = 0, b->maxn[l] = 0;
}

/* A store list's launches, up to gridDim.z's limit of items each. */
static kvq_status list_launch(kvq_backend_ctx *c, const cu_batch *b, int list, uint64_t at, char *msg, size_t ms)
{
    kvq_status st = KVQ_OK;
    for (int i0 = 0; i0 < b->n[list] && st == KVQ_OK; i0 += (int)CU_GRID_YZ_MAX) {
        int k = b->n[list] - i0 < (int)CU_GRID_YZ_MAX ? b->n[list] - i0 : (int)CU_GRID_YZ_MAX;
        uint64_t items = at + (uint64_t)i0 * item_size(list);
        st = cu_list_launch(c, "kvq_store_f16_list", (unsigned)c->H, cu_grid_y(b->maxn[list]), items, k, msg, ms);
    }
    return st;
}

/* The pending items to the device in one copy, then their launches in the planned run's order; with device rows
 * not yet converted, kvq_step_in first, which takes the new rows' stores (they read the caller's rows). */
static kvq_status send(kvq_backend_ctx *c, char *msg, size_t ms)
{
    cu_batch *b = c->batch;
    size_t off[B_LISTS], bytes = 0;
    for (int l = 0; l < B_LISTS; l++) off[l] = bytes, bytes += al16((size_t)b->n[l] * item_size(l));
    c->batch = NULL; /* the uploads and launches below go to the device */
    if (!bytes) {
        kvq_status st = b->dv ? cu_step_in(c, b->dv, b->n_seq, b->q, b->kvin, 0, 0, 0, 0, msg, ms) : KVQ_OK;
        b->dv = NULL;
        c->batch = b;
        return st;
    }
    unsigned char *h = NULL;
    kvq_status st = cu_scratch(c, &c->bitems, &c->bitems_bytes, bytes, msg, ms);
    if (st == KVQ_OK && !(h = kvq_malloc(bytes))) st = KVQ_ERR_NOMEM, snprintf(msg, ms, "out of memory");
    if (st == KVQ_OK) {
        memset(h, 0, bytes); /* the alignment gaps too: the copy sends every byte */
        for (int l = 0; l < B_LISTS; l++)
            if (b->n[l]) memcpy(h + off[l], b->item[l], (size_t)b->n[l] * item_size(l));
        st = cu_upload(c, c->bitems, h, bytes, msg, ms);
    }
    kvq_free(h);
    /* the inputs with the new rows' stores, or those stores; the other stores; then every store's quantizations in
     * one launch (after the separable stores' factor lists, over the same items) */
    if (st == KVQ_OK && b->dv)
        st = cu_step_in(c, b->dv, b->n_seq, b->q, b->kvin, c->bitems + off[B_ST1], b->n[B_ST1], 0, 0, msg, ms);
    else if (st == KVQ_OK && b->n[B_ST1])
        st = list_launch(c, b, B_ST1, c->bitems + off[B_ST1], msg, ms);
    b->dv = NULL;
    if (st == KVQ_OK && b->n[B_ST2]) st = list_launch(c, b, B_ST2, c->bitems + off[B_ST2], msg, ms);
    uint64_t qi[CU_STEP_STORES];
    for (int q = 0; q < CU_STEP_STORES; q++) qi[q] = c->bitems + off[B_Q0 + q];
    if (st == KVQ_OK) st = cu_quant_lists_all(c, b->cls, qi, b->n + B_Q0, b->maxn + B_Q0, msg, ms);
    clear(b);
    c->batch = b;
    return st;
}

static kvq_status take(kvq_backend_ctx *c, const char *kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       const void *params, size_t size, char *msg, size_t ms)
{
    cu_batch *b = c->batch;
    if (!strcmp(kernel, "kvq_store_f16") && size == sizeof(kvq_store_params)) {
        kvq_store_params sp;
        memcpy(&sp, params, sizeof sp);
        int own = sp.src.base >= b->kvin && sp.src.base < b->kvin_end;
        return push(b, own ? B_ST1 : B_ST2, &sp, sp.n, msg, ms);
    }
    /* a separable store's factor launch: cu_quant_lists_all launches the factor list over the quantize items,
     * whose parameters are the factor launch's (page_write's pair), as a planned step does */
    if (!strncmp(kernel, "kvq_factor_", 11) && size == sizeof(kvq_quant_params)) return KVQ_OK;
    for (int s = 0; s < CU_STEP_STORES && size == sizeof(kvq_quant_params); s++) {
        char q[48];
        snprintf(q, sizeof q, "kvq_quant_%s_c%d", store_names[s], b->cls);
        if (!strcmp(kernel, q)) return push(b, B_Q0 + s, params, ((const kvq_quant_params *)params)->n, msg, ms);
    }
    /* another kernel: what is pending runs first */
    kvq_status st = send(c, msg, ms);
    if (st != KVQ_OK) return st;
    c->batch = NULL;
    st = cu_launch(c, kernel, gx, gy, gz, bx, params, size, msg, ms);
    c->batch = b;
    return st;
}

kvq_status cu_batch_begin(kvq_backend_ctx *c, int cls, uint64_t kvin, uint64_t kvin_end, const kvq_dev_decode *dv,
                          int n, uint64_t q, char *msg, size_t ms)
{
    if (!c->batch_store && !(c->batch_store = kvq_calloc(1, sizeof *c->batch_store))) {
        snprintf(msg, ms, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    cu_batch *b = c->batch_store;
    clear(b);
    b->cls = cls, b->kvin = kvin, b->kvin_end = kvin_end, b->dv = dv, b->n_seq = n, b->q = q;
    c->batch = b, c->batch_take = take;
    return KVQ_OK;
}

kvq_status cu_batch_end(kvq_backend_ctx *c, kvq_status st, char *msg, size_t ms)
{
    if (!c->batch) return st;
    if (st == KVQ_OK) st = send(c, msg, ms); /* the inputs too, with nothing else pending */
    clear(c->batch);
    c->batch->dv = NULL;
    c->batch = NULL;
    return st;
}

void cu_batch_free(kvq_backend_ctx *c)
{
    cu_batch *b = c->batch_store;
    for (int l = 0; b && l < B_LISTS; l++) kvq_free(b->item[l]);
    kvq_free(b);
    c->batch_store = NULL;
    cu_dev_free(c->dev, c->bitems);
    c->bitems = 0, c->bitems_bytes = 0;
}
