/* The device front: dispatch to the GPU or emulator implementation, and the parameter-layout check. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cu_dev.h"
#include "kvq_params.cuh"

const char *cu_source_dir(void) { return kvq_data_dir(); }

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

void cu_dev_close(cu_dev *d)
{
    if (!d) return;
    d->ops->close(d);
    kvq_free(d);
}

cu_dev_kind cu_dev_kind_of(const cu_dev *d) { return d->kind; }
const char *cu_dev_arch(const cu_dev *d) { return d->arch; }
int cu_dev_sm_count(const cu_dev *d) { return d->sm_count; }

/* The failure injection of cu_dev_fail_after: counted down by every allocation, copy, memset and launch. */
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

kvq_status cu_dev_alloc(cu_dev *d, size_t bytes, uint64_t *addr, char *msg, size_t n)
{
    if (injected(msg, n)) return KVQ_ERR_INTERNAL;
    return d->ops->alloc(d, bytes ? bytes : 16, addr, msg, n);
}
void cu_dev_free(cu_dev *d, uint64_t addr)
{
    if (addr) d->ops->free(d, addr);
}
kvq_status cu_dev_alloc_host(cu_dev *d, size_t bytes, void **host, uint64_t *addr, char *msg, size_t n)
{
    if (injected(msg, n)) return KVQ_ERR_INTERNAL;
    return d->ops->alloc_host(d, bytes ? bytes : 16, host, addr, msg, n);
}
void cu_dev_free_host(cu_dev *d, void *host)
{
    if (host) d->ops->free_host(d, host);
}
kvq_status cu_dev_h2d(cu_dev *d, uint64_t dst, const void *src, size_t n, char *msg, size_t ms)
{
    if (n && injected(msg, ms)) return KVQ_ERR_INTERNAL;
    return n ? d->ops->h2d(d, dst, src, n, msg, ms) : KVQ_OK;
}
kvq_status cu_dev_d2h(cu_dev *d, void *dst, uint64_t src, size_t n, char *msg, size_t ms)
{
    if (n && injected(msg, ms)) return KVQ_ERR_INTERNAL;
    return n ? d->ops->d2h(d, dst, src, n, msg, ms) : KVQ_OK;
}

kvq_status cu_dev_memset(cu_dev *d, uint64_t dst, int byte, size_t n, char *msg, size_t ms)
{
    if (n && injected(msg, ms)) return KVQ_ERR_INTERNAL;
    return n ? d->ops->memset(d, dst, byte, n, msg, ms) : KVQ_OK;
}

double cu_dev_peak_gbps(const cu_dev *d) { return d->peak_gbps; }

kvq_status cu_dev_load(cu_dev *d, const char *src, const char *scheme, cu_module **out, char *msg, size_t n)
{
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
    if (d->kind == CU_DEV_GPU) return cu_driver_occupancy(m, kernel, threads, smem);
    int by_threads = 2048 / threads, by_smem = smem ? (int)((227u * 1024u) / smem) : 32;
    int b = by_threads < by_smem ? by_threads : by_smem;
    return b > 32 ? 32 : b;
}

kvq_status cu_dev_launch_smem(cu_dev *d, cu_module *m, const char *kernel, const unsigned grid[3],
                              const unsigned block[3], unsigned smem, const void *params, size_t size, char *msg,
                              size_t n)
{
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) return KVQ_OK; /* nothing to do */
    if (injected(msg, n)) return KVQ_ERR_INTERNAL;
    return d->ops->launch(d, m, kernel, grid, block, smem, params, size, msg, n);
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

kvq_status cu_dev_check_params(cu_dev *d, cu_module *m, char *msg, size_t n)
{
    const long long want[] = {KVQ_PARAMS_SIG_LIST};
    long long got[KVQ_PARAMS_SIG_N];
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
    return KVQ_OK;
}
