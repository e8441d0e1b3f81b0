/* The device front: dispatch to the GPU or emulator implementation, and the parameter-layout check. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cu_counters.h"
#include "cu_dev.h"
#include "kvq_params.cuh"

kvq_status cu_dev_open(cu_dev_kind kind, cu_dev **out, char *msg, size_t n)
{
    *out = NULL;
    cu_dev *d = kvq_calloc(1, sizeof *d);
    if (!d) {
        snprintf(msg, n, "cuda: out of memory");
        return KVQ_ERR_NOMEM;
    }
    d->kind = kind;
    kvq_status st = kind == CU_DEV_EMU ? cu_emu_open(d, msg, n) : cu_driver_open(d, msg, n);
    if (st != KVQ_OK) {
        kvq_free(d);
        return st;
    }
    *out = d;
    return KVQ_OK;
}

static int graph_uses(const cu_dev *d);
void cu_dev_close(cu_dev *d)
{
    if (!d) return;
    if (graph_uses(d)) cu_dev_graph_reset(); /* a recorded graph must not outlive a device it runs on */
    d->ops->close(d);
    kvq_free(d->pinned);
    kvq_free(d);
}

cu_dev_kind cu_dev_kind_of(const cu_dev *d) { return d->kind; }
const char *cu_dev_arch(const cu_dev *d) { return d->arch; }
int cu_dev_sm_count(const cu_dev *d) { return d->sm_count; }

/* The failure injection of cu_dev_fail_after: counted down by every allocation, copy, memset, launch and sync. */
static long fail_countdown, fail_count;

void cu_dev_fail_after(long n) { fail_countdown = n > 0 ? n : 0; }
long cu_dev_failures(void) { return fail_count; }

static int injected(char *msg, size_t n)
{
    if (fail_countdown <= 0 || --fail_countdown > 0) return 0;
    fail_count++;
    snprintf(msg, n, "cuda: injected device failure");
    return 1;
}

/* ---- counters and capture mode (cu_counters.h) ---- */

static cu_dev_counters counters;
static int capture_on;

#define COUNT(field) __atomic_add_fetch(&counters.field, 1, __ATOMIC_RELAXED)
#define COUNT_BYTES(field, n) __atomic_add_fetch(&counters.field, (long)(n), __ATOMIC_RELAXED)

void cu_dev_counters_get(cu_dev_counters *out)
{
    long *o = (long *)out;
    const long *c = (const long *)&counters;
    for (size_t i = 0; i < sizeof counters / sizeof(long); i++) o[i] = __atomic_load_n(&c[i], __ATOMIC_RELAXED);
}

void cu_dev_counters_diff(const cu_dev_counters *a, const cu_dev_counters *b, cu_dev_counters *d)
{
    const long *x = (const long *)a, *y = (const long *)b;
    long *z = (long *)d;
    for (size_t i = 0; i < sizeof *d / sizeof(long); i++) z[i] = x[i] - y[i];
}

/* ---- the emulated graph: what capture mode recorded, replayed by cu_dev_graph_replay ---- */

typedef enum { NODE_LAUNCH, NODE_H2D, NODE_D2H, NODE_MEMSET } node_kind;
typedef struct {
    node_kind kind;
    cu_dev *dev;
    cu_module *mod;
    char kernel[64];
    unsigned grid[3], block[3], smem;
    void *params; /* a copy of the parameter bytes, as cuLaunchKernel's node keeps them */
    size_t size;
    uint64_t daddr;
    void *host; /* H2D / D2H: the page-locked host side, read / written at replay time */
    size_t bytes;
    int byte;
} cu_node;
static cu_node *graph;
static int n_graph, cap_graph;

void cu_dev_graph_reset(void)
{
    for (int i = 0; i < n_graph; i++) kvq_free(graph[i].params);
    kvq_free(graph);
    graph = NULL, n_graph = cap_graph = 0;
}

int cu_dev_graph_nodes(void) { return n_graph; }

static int graph_uses(const cu_dev *d)
{
    for (int i = 0; i < n_graph; i++)
        if (graph[i].dev == d) return 1;
    return 0;
}

/* Appends a node when an emulated device is capturing; a node that cannot be stored (out of host memory) makes the
 * call fail, as a capture that cannot record its node fails the call. */
static kvq_status record(const cu_node *nd, const void *params, char *msg, size_t n)
{
    if (nd->dev->kind != CU_DEV_EMU || !cu_dev_capturing()) return KVQ_OK;
    if (n_graph == cap_graph) {
        int cap = cap_graph ? 2 * cap_graph : 64;
        cu_node *ng = kvq_realloc(graph, (size_t)cap * sizeof *ng);
        if (!ng) goto nomem;
        graph = ng, cap_graph = cap;
    }
    cu_node x = *nd;
    x.params = NULL;
    if (nd->kind == NODE_LAUNCH) {
        x.params = kvq_malloc(nd->size ? nd->size : 1);
        if (!x.params) goto nomem;
        memcpy(x.params, params, nd->size);
    }
    graph[n_graph++] = x;
    return KVQ_OK;
nomem:
    snprintf(msg, n, "emu: out of host memory recording the captured graph");
    return KVQ_ERR_NOMEM;
}

kvq_status cu_dev_graph_replay(char *msg, size_t n)
{
    COUNT(replays);
    kvq_status st = KVQ_OK;
    for (int i = 0; i < n_graph && st == KVQ_OK; i++) {
        cu_node *x = &graph[i];
        cu_ctx_scope cs;
        cu_dev_enter(x->dev, &cs);
        const cu_dev_ops *o = x->dev->ops;
        switch (x->kind) {
        case NODE_LAUNCH:
            st = o->launch(x->dev, x->mod, x->kernel, x->grid, x->block, x->smem, x->params, x->size, msg, n);
            break;
        case NODE_H2D: st = o->h2d_async(x->dev, x->daddr, x->host, x->bytes, msg, n); break;
        case NODE_D2H: st = o->d2h_async(x->dev, x->host, x->daddr, x->bytes, msg, n); break;
        case NODE_MEMSET: st = o->memset(x->dev, x->daddr, x->byte, x->bytes, msg, n); break;
        }
        cu_dev_leave(x->dev, &cs);
        COUNT(replayed_nodes);
    }
    return st;
}

/* Capture on starts a new graph: the one recorded before is dropped. */
void cu_dev_capture(int on)
{
    if (on) cu_dev_graph_reset();
    __atomic_store_n(&capture_on, on != 0, __ATOMIC_RELAXED);
}
int cu_dev_capturing(void) { return __atomic_load_n(&capture_on, __ATOMIC_RELAXED); }

/* A call stream capture refuses, made on an emulated device in capture mode: counted, and an error. */
static int refused(const cu_dev *d, const char *what, char *msg, size_t n)
{
    if (d->kind != CU_DEV_EMU || !cu_dev_capturing()) return 0;
    COUNT(capture_refused);
    snprintf(msg, n,
             "emu: %s during stream capture: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900): the call is not allowed "
             "while the stream is being captured into a graph",
             what);
    return 1;
}

int cu_dev_is_pinned(const cu_dev *d, const void *p, size_t n)
{
    uintptr_t a = (uintptr_t)p;
    for (int i = 0; i < d->n_pinned; i++) {
        uintptr_t b = (uintptr_t)d->pinned[i].host;
        if (a >= b && a - b <= d->pinned[i].bytes && n <= d->pinned[i].bytes - (a - b)) return 1;
    }
    return 0;
}

kvq_status cu_dev_alloc(cu_dev *d, size_t bytes, uint64_t *addr, char *msg, size_t n)
{
    if (refused(d, "cuMemAlloc", msg, n) || injected(msg, n)) return KVQ_ERR_INTERNAL;
    COUNT(allocs);
    return d->ops->alloc(d, bytes ? bytes : 16, addr, msg, n);
}
void cu_dev_free(cu_dev *d, uint64_t addr)
{
    if (!addr) return;
    char msg[200];
    refused(d, "cuMemFree", msg, sizeof msg); /* counted; the memory is freed all the same, so nothing leaks */
    COUNT(frees);
    d->ops->free(d, addr);
}
kvq_status cu_dev_alloc_host(cu_dev *d, size_t bytes, void **host, uint64_t *addr, char *msg, size_t n)
{
    if (refused(d, "cuMemHostAlloc", msg, n) || injected(msg, n)) return KVQ_ERR_INTERNAL;
    if (d->n_pinned == d->cap_pinned) {
        int cap = d->cap_pinned ? 2 * d->cap_pinned : 8;
        struct cu_pinned *np = kvq_realloc(d->pinned, (size_t)cap * sizeof *np);
        if (!np) {
            snprintf(msg, n, "out of memory");
            return KVQ_ERR_NOMEM;
        }
        d->pinned = np, d->cap_pinned = cap;
    }
    COUNT(host_allocs);
    bytes = bytes ? bytes : 16;
    kvq_status st = d->ops->alloc_host(d, bytes, host, addr, msg, n);
    if (st == KVQ_OK) d->pinned[d->n_pinned++] = (struct cu_pinned){*host, bytes};
    return st;
}
void cu_dev_free_host(cu_dev *d, void *host)
{
    if (!host) return;
    char msg[200];
    refused(d, "cuMemFreeHost", msg, sizeof msg); /* as cu_dev_free */
    COUNT(host_frees);
    for (int i = 0; i < d->n_pinned; i++)
        if (d->pinned[i].host == host) {
            d->pinned[i] = d->pinned[--d->n_pinned];
            break;
        }
    d->ops->free_host(d, host);
}
kvq_status cu_dev_h2d_async(cu_dev *d, uint64_t dst, const void *src, size_t n, char *msg, size_t ms)
{
    if (!n) return KVQ_OK;
    int pinned = cu_dev_is_pinned(d, src, n);
    if ((!pinned && refused(d, "cuMemcpyHtoDAsync from pageable host memory", msg, ms)) || injected(msg, ms))
        return KVQ_ERR_INTERNAL;
    COUNT(h2d);
    COUNT_BYTES(h2d_bytes, n);
    if (!pinned) COUNT(syncs);
    kvq_status st = d->ops->h2d_async(d, dst, src, n, msg, ms);
    cu_node nd = {.kind = NODE_H2D, .dev = d, .daddr = dst, .host = (void *)(uintptr_t)src, .bytes = n};
    return st == KVQ_OK ? record(&nd, NULL, msg, ms) : st;
}
kvq_status cu_dev_d2h_async(cu_dev *d, void *dst, uint64_t src, size_t n, char *msg, size_t ms)
{
    if (!n) return KVQ_OK;
    int pinned = cu_dev_is_pinned(d, dst, n);
    if ((!pinned && refused(d, "cuMemcpyDtoHAsync into pageable host memory", msg, ms)) || injected(msg, ms))
        return KVQ_ERR_INTERNAL;
    COUNT(d2h);
    if (!pinned) COUNT(syncs);
    kvq_status st = d->ops->d2h_async(d, dst, src, n, msg, ms);
    cu_node nd = {.kind = NODE_D2H, .dev = d, .daddr = src, .host = dst, .bytes = n};
    return st == KVQ_OK ? record(&nd, NULL, msg, ms) : st;
}
kvq_status cu_dev_sync(cu_dev *d, char *msg, size_t ms)
{
    if (refused(d, "cuStreamSynchronize", msg, ms) || injected(msg, ms)) return KVQ_ERR_INTERNAL;
    COUNT(syncs);
    return d->ops->sync(d, msg, ms);
}
kvq_status cu_dev_h2d(cu_dev *d, uint64_t dst, const void *src, size_t n, char *msg, size_t ms)
{
    if (!n) return KVQ_OK;
    if (refused(d, "cuMemcpyHtoD (synchronous)", msg, ms) || injected(msg, ms)) return KVQ_ERR_INTERNAL;
    COUNT(h2d), COUNT(syncs);
    COUNT_BYTES(h2d_bytes, n);
    kvq_status st = d->ops->h2d_async(d, dst, src, n, msg, ms);
    return st == KVQ_OK ? d->ops->sync(d, msg, ms) : st;
}
kvq_status cu_dev_d2h(cu_dev *d, void *dst, uint64_t src, size_t n, char *msg, size_t ms)
{
    if (!n) return KVQ_OK;
    if (refused(d, "cuMemcpyDtoH (synchronous)", msg, ms) || injected(msg, ms)) return KVQ_ERR_INTERNAL;
    COUNT(d2h), COUNT(syncs);
    kvq_status st = d->ops->d2h_async(d, dst, src, n, msg, ms);
    return st == KVQ_OK ? d->ops->sync(d, msg, ms) : st;
}

kvq_status cu_dev_memset(cu_dev *d, uint64_t dst, int byte, size_t n, char *msg, size_t ms)
{
    if (n && injected(msg, ms)) return KVQ_ERR_INTERNAL;
    if (!n) return KVQ_OK;
    COUNT(memsets);
    kvq_status st = d->ops->memset(d, dst, byte, n, msg, ms);
    cu_node nd = {.kind = NODE_MEMSET, .dev = d, .daddr = dst, .bytes = n, .byte = byte};
    return st == KVQ_OK ? record(&nd, NULL, msg, ms) : st;
}

kvq_status cu_dev_event_create(cu_dev *d, void **ev, char *msg, size_t ms)
{
    *ev = NULL;
    if (refused(d, "cuEventCreate", msg, ms)) return KVQ_ERR_INTERNAL;
    return d->ops->event_create(d, ev, msg, ms);
}
void cu_dev_event_destroy(cu_dev *d, void *ev)
{
    if (ev) d->ops->event_destroy(d, ev);
}
kvq_status cu_dev_event_record(cu_dev *d, void *ev, char *msg, size_t ms)
{
    return d->ops->event_record(d, ev, msg, ms);
}
kvq_status cu_dev_event_wait(cu_dev *d, void *ev, char *msg, size_t ms)
{
    if (refused(d, "cuEventSynchronize", msg, ms)) return KVQ_ERR_INTERNAL;
    COUNT(event_waits);
    return d->ops->event_wait(d, ev, msg, ms);
}

void cu_dev_set_stream(cu_dev *d, void *stream)
{
    void *to = stream ? stream : d->own_stream;
    if (to != d->stream && d->ops->join) d->ops->join(d, d->stream, to);
    d->stream = to;
}
void *cu_dev_stream(const cu_dev *d) { return d->stream; }

double cu_dev_peak_gbps(const cu_dev *d) { return d->peak_gbps; }

kvq_status cu_dev_load(cu_dev *d, const char *src, const char *scheme, cu_module **out, char *msg, size_t n)
{
    *out = NULL;
    if (refused(d, "cuModuleLoadData", msg, n)) return KVQ_ERR_INTERNAL;
    COUNT(loads);
    return d->ops->load(d, src, scheme, out, msg, n);
}

void cu_module_free(cu_module *m)
{
    if (m) m->dev->ops->module_free(m);
}

const char *cu_module_origin(const cu_module *m) { return m->origin; }

int cu_dev_occupancy(cu_dev *d, cu_module *m, const char *kernel, int threads, size_t smem)
{
    if (threads <= 0) return 0;
    return d->kind == CU_DEV_GPU ? cu_driver_occupancy(m, kernel, threads, smem)
                                 : cu_emu_occupancy(m, kernel, threads, smem);
}

kvq_status cu_dev_launch_smem(cu_dev *d, cu_module *m, const char *kernel, const unsigned grid[3],
                              const unsigned block[3], unsigned smem, const void *params, size_t size, char *msg,
                              size_t n)
{
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) return KVQ_OK; /* nothing to do */
    if (injected(msg, n)) return KVQ_ERR_INTERNAL;
    COUNT(launches);
    kvq_status st = d->ops->launch(d, m, kernel, grid, block, smem, params, size, msg, n);
    cu_node nd = {.kind = NODE_LAUNCH, .dev = d, .mod = m, .smem = smem, .size = size};
    snprintf(nd.kernel, sizeof nd.kernel, "%s", kernel);
    memcpy(nd.grid, grid, sizeof nd.grid), memcpy(nd.block, block, sizeof nd.block);
    return st == KVQ_OK ? record(&nd, params, msg, n) : st;
}

kvq_status cu_dev_launch(cu_dev *d, cu_module *m, const char *kernel, const unsigned grid[3], const unsigned block[3],
                         const void *params, size_t size, char *msg, size_t n)
{
    return cu_dev_launch_smem(d, m, kernel, grid, block, 0, params, size, msg, n);
}

kvq_status cu_dev_func_max_dyn_smem(cu_dev *d, cu_module *m, const char *kernel, unsigned bytes, char *msg, size_t n)
{
    return d->ops->max_dyn_smem(d, m, kernel, bytes, msg, n);
}

void cu_dev_enter(cu_dev *d, cu_ctx_scope *s)
{
    s->prev = NULL, s->changed = 0;
    if (d) d->ops->enter(d, s);
}

void cu_dev_leave(cu_dev *d, const cu_ctx_scope *s)
{
    if (d && s->changed) d->ops->leave(d, s);
}

kvq_status cu_dev_check_params(cu_dev *d, cu_module *m, int need_mma, char *msg, size_t n)
{
    const long long want[] = {KVQ_PARAMS_SIG_LIST};
    long long got[KVQ_PARAMS_SIG_N + 1];
    uint64_t buf = 0;
    kvq_status st = cu_dev_alloc(d, sizeof got, &buf, msg, n);
    if (st != KVQ_OK) return st;
    kvq_sig_params p = {buf};
    const unsigned one[3] = {1, 1, 1}, block[3] = {32, 1, 1};
    st = cu_dev_launch(d, m, "kvq_params_sig", one, block, &p, sizeof p, msg, n);
    if (st == KVQ_OK) st = cu_dev_d2h(d, got, buf, sizeof got, msg, n);
    cu_dev_free(d, buf);
    if (st != KVQ_OK) return st;
    for (int i = 0; i < KVQ_PARAMS_SIG_N; i++)
        if (got[i] != want[i]) {
            snprintf(msg, n,
                     "cuda: parameter layout differs between host and kernels (entry %d: host %lld, device %lld)", i,
                     want[i], got[i]);
            return KVQ_ERR_INTERNAL;
        }
    if (need_mma && got[KVQ_PARAMS_SIG_N] != KVQ_MMA_PROBE) {
        float g, w;
        const uint32_t gb = (uint32_t)got[KVQ_PARAMS_SIG_N], wb = (uint32_t)KVQ_MMA_PROBE;
        memcpy(&g, &gb, sizeof g), memcpy(&w, &wb, sizeof w);
        snprintf(msg, n,
                 "cuda: this GPU's tensor cores do not take fp16 subnormal inputs exactly (an mma.sync of 3 x 2^-24 "
                 "by 1.5 over 16 gave %g, not %g); the scheme's decode unpacks codes into them on the tensor cores "
                 "(docs/cuda.md, \"Tensor cores\")", (double)g, (double)w);
        return KVQ_ERR_UNSUPPORTED;
    }
    return KVQ_OK;
}
