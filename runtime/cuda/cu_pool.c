/* The device memory of an engine's cache (docs/cuda.md "The host protocol"): pages, windows and TailorKV's pages
 * of generated tokens come from a pool of slabs, never from cuMemAlloc inside a decode step. A block is a run of
 * a slab (256-byte aligned, as cuMemAlloc's); freed blocks go to a free list of their size, zeroed at free time
 * so that a block taken inside a step needs no memset (the cache's sections rely on zero-filled memory, as
 * cu_dev_alloc gives). A slab is cuMemAlloc'd only when no free block and no slab tail fits: the pool grows at
 * most once per doubling (slabs of at least CU_POOL_MIN_SLAB, each at least the size of all before it), so after
 * warm-up a step allocates nothing; cu_pool_reserve takes a slab up front (the hook for a public reservation, for
 * an engine that must never allocate in a step: a captured graph). Slabs are freed with the engine. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cu_backend.h"

#define CU_POOL_ALIGN 256u
#define CU_POOL_MIN_SLAB ((size_t)16 << 20)

static size_t round_up(size_t b) { return (b + CU_POOL_ALIGN - 1) & ~(size_t)(CU_POOL_ALIGN - 1); }

static kvq_status add_slab(kvq_backend_ctx *c, size_t need, char *msg, size_t n)
{
    cu_pool *p = &c->pool;
    if (p->n_slabs == p->cap_slabs) {
        int cap = p->cap_slabs ? 2 * p->cap_slabs : 8;
        cu_slab *ns = kvq_realloc(p->slabs, (size_t)cap * sizeof *ns);
        if (!ns) {
            snprintf(msg, n, "out of memory");
            return KVQ_ERR_NOMEM;
        }
        p->slabs = ns, p->cap_slabs = cap;
    }
    size_t bytes = p->total > CU_POOL_MIN_SLAB ? p->total : CU_POOL_MIN_SLAB;
    if (bytes < need) bytes = round_up(need);
    uint64_t a = 0;
    kvq_status st = cu_dev_alloc(c->dev, bytes, &a, msg, n); /* zero-filled */
    if (st != KVQ_OK) return st;
    p->slabs[p->n_slabs++] = (cu_slab){a, bytes, 0};
    p->total += bytes;
    return KVQ_OK;
}

static cu_free_list *list_of(cu_pool *p, size_t bytes, int create)
{
    for (int i = 0; i < p->n_lists; i++)
        if (p->lists[i].bytes == bytes) return &p->lists[i];
    if (!create) return NULL;
    if (p->n_lists == p->cap_lists) {
        int cap = p->cap_lists ? 2 * p->cap_lists : 8;
        cu_free_list *nl = kvq_realloc(p->lists, (size_t)cap * sizeof *nl);
        if (!nl) return NULL;
        p->lists = nl, p->cap_lists = cap;
    }
    cu_free_list *l = &p->lists[p->n_lists++];
    memset(l, 0, sizeof *l);
    l->bytes = bytes;
    return l;
}

kvq_status cu_pool_get(kvq_backend_ctx *c, size_t bytes, uint64_t *addr, char *msg, size_t n)
{
    cu_pool *p = &c->pool;
    bytes = round_up(bytes ? bytes : 1);
    cu_free_list *l = list_of(p, bytes, 0);
    if (l && l->n > 0) {
        *addr = l->addr[--l->n];
        p->used += bytes;
        return KVQ_OK;
    }
    /* the tail of the newest slab that fits (older tails are small leftovers: not worth a search) */
    cu_slab *s = p->n_slabs ? &p->slabs[p->n_slabs - 1] : NULL;
    if (!s || s->bytes - s->used < bytes) {
        kvq_status st = add_slab(c, bytes, msg, n);
        if (st != KVQ_OK) return st;
        s = &p->slabs[p->n_slabs - 1];
    }
    *addr = s->addr + s->used;
    s->used += bytes;
    p->used += bytes;
    return KVQ_OK;
}

void cu_pool_put(kvq_backend_ctx *c, uint64_t addr, size_t bytes)
{
    if (!addr) return;
    cu_pool *p = &c->pool;
    bytes = round_up(bytes ? bytes : 1);
    p->used -= bytes;
    char msg[160];
    /* zeroed now, on the stream, so that taking it inside a step needs no memset; a failed memset (the device is
     * failing) leaves the block out of the pool rather than handing out dirty memory */
    if (cu_dev_memset(c->dev, addr, 0, bytes, msg, sizeof msg) != KVQ_OK) return;
    cu_free_list *l = list_of(p, bytes, 1);
    if (!l) return; /* host out of memory: the block is lost to the pool until the engine is freed */
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 16;
        uint64_t *na = kvq_realloc(l->addr, (size_t)cap * sizeof *na);
        if (!na) return;
        l->addr = na, l->cap = cap;
    }
    l->addr[l->n++] = addr;
}

kvq_status cu_pool_reserve(kvq_backend_ctx *c, size_t bytes, char *msg, size_t n)
{
    cu_pool *p = &c->pool;
    size_t room = p->n_slabs ? p->slabs[p->n_slabs - 1].bytes - p->slabs[p->n_slabs - 1].used : 0;
    if (room >= bytes) return KVQ_OK;
    return add_slab(c, bytes, msg, n);
}

void cu_pool_free(kvq_backend_ctx *c)
{
    cu_pool *p = &c->pool;
    for (int i = 0; i < p->n_slabs; i++) cu_dev_free(c->dev, p->slabs[i].addr);
    for (int i = 0; i < p->n_lists; i++) kvq_free(p->lists[i].addr);
    kvq_free(p->slabs);
    kvq_free(p->lists);
    memset(p, 0, sizeof *p);
}
