/* The emulator's executor: runs every block of a launch, one after the other, on the calling thread.
 *
 * A block starts "plain": one fiber runs its threads to completion one after the other, which is all a block
 * without barriers ever needs. The first time a thread reaches a switch point (a barrier, or a warp collective
 * that must wait for other lanes) the block is promoted: that thread keeps the fiber it runs on, every thread not
 * yet started gets a fiber of its own, and from then on a scheduler (this file, on the launching thread's own
 * stack) resumes ready fibers one at a time until all have returned. The result is the same as if every thread
 * had had a fiber from the start: the threads run before the promotion had simply returned before reaching any
 * switch point.
 *
 * A barrier completes when every thread of the block waits at the same __syncthreads (same file and line, same
 * kind). When nothing is ready and some threads still wait, the block can never finish: the launch fails with a
 * message listing who waits where and who exited, instead of hanging. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "emu_internal.h"

__thread struct emu_thread_pub *emu_self_;
__thread struct emu_block_pub *emu_blk_;
void (*emu_block_end_hook)(unsigned n_threads, unsigned long long weight);
int emu_profiling;
struct emu_sample_rec emu_samples[EMU_SAMPLES];
int emu_n_samples;
struct emu_run *emu_run_;

static pthread_mutex_t launch_lock = PTHREAD_MUTEX_INITIALIZER;

/* Kept between launches (under launch_lock): per-thread records and fiber stacks, grown on demand. */
static struct {
    unsigned cap;
    struct emu_thr *thr;
    struct emu_warpst *warps;
    unsigned *order, *queue;
    struct emu_fiber *fibers;
    size_t stack_size;
} cache;

#if defined(__SANITIZE_ADDRESS__)
#define DEFAULT_STACK (256u * 1024u)
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DEFAULT_STACK (256u * 1024u)
#endif
#endif
#ifndef DEFAULT_STACK
#define DEFAULT_STACK (64u * 1024u)
#endif

const char *emu_status_str(emu_status s)
{
    switch (s) {
    case EMU_OK: return "ok";
    case EMU_ERR_CONFIG: return "bad launch configuration";
    case EMU_ERR_NOMEM: return "out of memory";
    case EMU_ERR_BARRIER: return "barrier or collective cannot complete";
    case EMU_ERR_WARP: return "warp collective misused";
    case EMU_ERR_ASYNC: return "cp.async misused";
    case EMU_ERR_TRAP: return "kernel trapped";
    case EMU_ERR_RESOURCES: return "too many resources requested for launch";
    }
    return "unknown status";
}

void emu_cat(char *buf, size_t size, const char *fmt, ...)
{
    size_t len = strlen(buf);
    if (len + 1 >= size) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + len, size - len, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n >= size - len && size > 4) memcpy(buf + size - 4, "...", 4);
}

void emu_cat_ids(char *buf, size_t size, const char *noun, const unsigned char *bits, unsigned n)
{
    unsigned count = 0;
    for (unsigned i = 0; i < n; i++) count += bits[i] != 0;
    emu_cat(buf, size, "%s%s ", noun, count == 1 ? "" : "s");
    int first = 1;
    for (unsigned i = 0; i < n; i++) {
        if (!bits[i]) continue;
        unsigned j = i;
        while (j + 1 < n && bits[j + 1]) j++;
        if (j == i)
            emu_cat(buf, size, "%s%u", first ? "" : ",", i);
        else
            emu_cat(buf, size, "%s%u-%u", first ? "" : ",", i, j);
        first = 0;
        i = j;
    }
}

static void cat_where(struct emu_run *R)
{
    const struct emu_idx3 *b = &R->blk.bid;
    emu_cat(R->msg, R->msg_size, "kernel '%s' block (%u,%u,%u)", R->k->name, b->x, b->y, b->z);
}

void emu_fail(struct emu_run *R, emu_status s, const char *fmt, ...)
{
    struct emu_thr *t = R->cur;
    R->msg[0] = 0;
    cat_where(R);
    const struct emu_idx3 *i = &t->pub.tid;
    emu_cat(R->msg, R->msg_size, " thread %u (threadIdx %u,%u,%u): ", t->pub.linear, i->x, i->y, i->z);
    size_t len = strlen(R->msg);
    if (len + 1 < R->msg_size) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(R->msg + len, R->msg_size - len, fmt, ap);
        va_end(ap);
    }
    R->status = s;
    /* This thread never resumes: its stack keeps its frames (and, under ASan, their poisoned redzones). */
    t->fiber->dirty = 1;
    emu_fiber_switch(t->fiber, &R->main);
    abort(); /* the scheduler never switches back to a failed thread */
}

uint64_t emu_rand(struct emu_run *R)
{
    /* splitmix64: small, seedable with anything, good enough to shuffle */
    uint64_t z = (R->rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void shuffle(struct emu_run *R, unsigned *a, unsigned n)
{
    for (unsigned i = n; i > 1; i--) {
        unsigned j = (unsigned)(emu_rand(R) % i);
        unsigned x = a[i - 1];
        a[i - 1] = a[j];
        a[j] = x;
    }
}

void emu_ready(struct emu_run *R, struct emu_thr *t)
{
    unsigned at = R->qhead + R->qlen;
    if (at >= R->n) at -= R->n;
    R->queue[at] = (unsigned)(t - R->thr);
    R->qlen++;
    t->state = T_READY;
}

static struct emu_thr *pop_ready(struct emu_run *R)
{
    struct emu_thr *t = &R->thr[R->queue[R->qhead]];
    if (++R->qhead == R->n) R->qhead = 0;
    R->qlen--;
    return t;
}

static void start_thread(struct emu_run *R, struct emu_thr *t)
{
    t->state = T_RUNNING;
    R->cur = t;
    emu_self_ = &t->pub;
}

static void thread_exit(struct emu_run *R, struct emu_thr *t)
{
    t->state = T_EXITED;
    R->exited++;
    R->warps[t->pub.linear >> 5].exited |= 1u << t->pub.lane;
    emu_cp_reset(t); /* copies never waited for never land */
}

/* The body of every fiber. In plain mode it runs threads until the block is done or it is promoted; a fiber
 * started after promotion (or promoted) runs its one thread to the end. */
static void fiber_entry(void *arg)
{
    struct emu_run *R = arg;
    emu_fiber_started(&R->main);
    struct emu_fiber *self = R->cur->fiber;
    for (;;) {
        R->k->entry(R->params);
        thread_exit(R, R->cur);
        if (R->mode != MODE_PLAIN || R->plain_pos == R->n) break;
        struct emu_thr *t = &R->thr[R->order[R->plain_pos++]];
        t->fiber = self;
        start_thread(R, t);
    }
    R->st.switches++;
    emu_fiber_exit(self, &R->main);
}

void emu_block_self(struct emu_run *R, struct emu_thr *t)
{
    if (R->mode == MODE_PLAIN) {
        /* Promotion: the threads not yet started queue up in the block's order, behind those already made ready
         * by this switch point. */
        R->mode = MODE_FIBERS;
        while (R->plain_pos < R->n) emu_ready(R, &R->thr[R->order[R->plain_pos++]]);
    }
    R->st.switches++;
    emu_fiber_switch(t->fiber, &R->main);
}

int emu_barrier(int kind, int pred, const char *file, int line)
{
    struct emu_run *R = emu_run_;
    struct emu_thr *t = R->cur;
    if (R->bar_n == 0) {
        R->bar_file = file;
        R->bar_line = line;
        R->bar_kind = kind;
        R->bar_mismatch = 0;
        R->bar_count = 0;
        R->bar_and = 1;
        R->bar_or = 0;
    } else if (line != R->bar_line || kind != R->bar_kind || (file != R->bar_file && strcmp(file, R->bar_file))) {
        R->bar_mismatch = 1; /* can never complete; reported when the block runs dry */
    }
    pred = pred != 0;
    R->bar_count += pred;
    R->bar_and &= pred;
    R->bar_or |= pred;
    t->state = T_WAIT_BAR;
    t->wfile = file;
    t->wline = line;
    if (++R->bar_n == R->n && !R->bar_mismatch) {
        R->bar_result = kind == EMU_BAR_COUNT ? R->bar_count
                        : kind == EMU_BAR_AND ? R->bar_and
                        : kind == EMU_BAR_OR  ? R->bar_or
                                              : 0;
        R->bar_n = 0;
        R->st.barrier_crossings += R->n;
        if (R->shuffle) shuffle(R, R->order, R->n);
        for (unsigned i = 0; i < R->n; i++) emu_ready(R, &R->thr[R->shuffle ? R->order[i] : i]);
    }
    emu_block_self(R, t);
    return R->bar_result;
}

void emu_trap(const char *file, int line)
{
    emu_fail(emu_run_, EMU_ERR_TRAP, "__trap() at %s:%d", file, line);
}

/* Nothing is ready and not every thread returned: say who waits where. */
static void diagnose(struct emu_run *R)
{
    unsigned char *bits = calloc(R->n, 1), *done = calloc(R->n, 1);
    R->msg[0] = 0;
    cat_where(R);
    if (!bits || !done) {
        emu_cat(R->msg, R->msg_size, ": deadlock (no memory to describe it)");
        free(bits);
        free(done);
        return;
    }
    unsigned bar_sites = 0, bar_waiters = 0;
    for (unsigned i = 0; i < R->n; i++) {
        struct emu_thr *t = &R->thr[i];
        if (t->state != T_WAIT_BAR) continue;
        bar_waiters++;
        int seen = 0;
        for (unsigned j = 0; j < i && !seen; j++) {
            struct emu_thr *u = &R->thr[j];
            seen = u->state == T_WAIT_BAR && u->wline == t->wline && !strcmp(u->wfile, t->wfile);
        }
        bar_sites += !seen;
    }
    emu_cat(R->msg, R->msg_size, ": %s: ",
            bar_sites > 1   ? "divergent barrier"
            : bar_waiters   ? "barrier never completes"
                            : "warp collective never completes");
    int first = 1;
    for (unsigned i = 0; i < R->n; i++) {
        struct emu_thr *t = &R->thr[i];
        if (done[i] || t->state == T_EXITED) continue;
        memset(bits, 0, R->n);
        for (unsigned j = i; j < R->n; j++) {
            struct emu_thr *u = &R->thr[j];
            if (done[j] || u->state != t->state || u->wline != t->wline || strcmp(u->wfile, t->wfile)) continue;
            if (t->state == T_WAIT_WARP && (u->req->op != t->req->op || u->req->mask != t->req->mask)) continue;
            bits[j] = done[j] = 1;
        }
        emu_cat(R->msg, R->msg_size, "%s", first ? "" : "; ");
        emu_cat_ids(R->msg, R->msg_size, "thread", bits, R->n);
        if (t->state == T_WAIT_BAR)
            emu_cat(R->msg, R->msg_size, " waiting at %s:%d (__syncthreads)", t->wfile, t->wline);
        else
            emu_cat(R->msg, R->msg_size, " waiting at %s:%d (%s, mask 0x%08x)", t->wfile, t->wline,
                    emu_warp_op_name(t->req->op), t->req->mask);
        first = 0;
    }
    if (R->exited) {
        for (unsigned i = 0; i < R->n; i++) bits[i] = R->thr[i].state == T_EXITED;
        emu_cat(R->msg, R->msg_size, "; ");
        emu_cat_ids(R->msg, R->msg_size, "thread", bits, R->n);
        emu_cat(R->msg, R->msg_size, " exited");
    }
    free(bits);
    free(done);
}

static int fiber_ready(struct emu_run *R, struct emu_fiber *f)
{
    if (!f->map && emu_fiber_alloc(f, R->stack_size) != 0) return -1;
    emu_fiber_scrub(f);
    emu_fiber_init(f, fiber_entry, R);
    return 0;
}

static emu_status run_block(struct emu_run *R, unsigned long long b, unsigned long long weight)
{
    struct emu_block_pub *B = &R->blk;
    B->bid.x = (unsigned)(b % B->gdim.x);
    B->bid.y = (unsigned)(b / B->gdim.x % B->gdim.y);
    B->bid.z = (unsigned)(b / B->gdim.x / B->gdim.y);
    unsigned bx = B->bdim.x, bxy = B->bdim.x * B->bdim.y;
    for (unsigned i = 0; i < R->n; i++) {
        struct emu_thr *t = &R->thr[i];
        t->pub.tid.x = i % bx;
        t->pub.tid.y = i % bxy / bx;
        t->pub.tid.z = i / bxy;
        t->pub.linear = i;
        t->pub.lane = i & 31;
        t->state = T_UNSTARTED;
        t->fiber = NULL;
        t->req = NULL;
        emu_cp_reset(t);
        R->order[i] = i;
    }
    for (unsigned w = 0; w < R->nwarps; w++) {
        unsigned lanes = R->n - w * 32 >= 32 ? 32 : R->n - w * 32;
        R->warps[w].exists = lanes == 32 ? ~0u : (1u << lanes) - 1;
        R->warps[w].exited = R->warps[w].waiting = 0;
    }
    if (R->shuffle) shuffle(R, R->order, R->n);
    /* Shared memory is not cleared between blocks on a GPU: a block must not read what it did not write. */
    if (B->dyn_smem) memset(B->dyn_smem, R->shuffle ? (int)(emu_rand(R) & 0xff) : 0xa5, R->blk_smem);
    R->qhead = R->qlen = 0;
    R->exited = 0;
    R->bar_n = 0;
    R->mode = MODE_PLAIN;
    R->plain_pos = 1;
    R->fibers_used = 1;
    if (fiber_ready(R, &R->fibers[0]) != 0) goto nomem;
    struct emu_thr *t = &R->thr[R->order[0]];
    t->fiber = &R->fibers[0];
    start_thread(R, t);
    R->st.switches++;
    emu_fiber_switch(&R->main, t->fiber);
    while (R->status == EMU_OK && R->qlen) {
        t = pop_ready(R);
        if (!t->fiber) {
            t->fiber = &R->fibers[R->fibers_used++];
            if (fiber_ready(R, t->fiber) != 0) goto nomem;
        }
        start_thread(R, t);
        R->st.switches++;
        emu_fiber_switch(&R->main, t->fiber);
    }
    if (emu_block_end_hook) emu_block_end_hook(R->n, weight); /* profile.c: a profiled module's warp counts */
    R->st.blocks++;
    R->st.threads += R->n;
    R->st.plain_blocks += R->mode == MODE_PLAIN;
    if (R->status == EMU_OK && R->exited != R->n) {
        diagnose(R);
        R->status = EMU_ERR_BARRIER;
    }
    if (R->status != EMU_OK)
        for (unsigned i = 0; i < R->fibers_used; i++) R->fibers[i].dirty = 1;
    return R->status;
nomem:
    snprintf(R->msg, R->msg_size, "kernel '%s': cannot map fiber stacks", R->k->name);
    for (unsigned i = 0; i < R->fibers_used; i++) R->fibers[i].dirty = 1;
    return R->status = EMU_ERR_NOMEM;
}

static void release_cache(void)
{
    for (unsigned i = 0; i < cache.cap; i++) {
        emu_cp_free(&cache.thr[i]);
        emu_fiber_free(&cache.fibers[i]);
    }
    free(cache.thr);
    free(cache.warps);
    free(cache.order);
    free(cache.queue);
    free(cache.fibers);
    memset(&cache, 0, sizeof cache);
}

void emu_release(void)
{
    pthread_mutex_lock(&launch_lock);
    release_cache();
    pthread_mutex_unlock(&launch_lock);
}

static int reserve(unsigned n, size_t stack_size)
{
    if (cache.stack_size != stack_size)
        for (unsigned i = 0; i < cache.cap; i++) emu_fiber_free(&cache.fibers[i]);
    cache.stack_size = stack_size;
    if (n <= cache.cap) return 0;
    release_cache();
    cache.stack_size = stack_size;
    cache.thr = calloc(n, sizeof *cache.thr);
    cache.warps = calloc((n + 31) / 32, sizeof *cache.warps);
    cache.order = calloc(n, sizeof *cache.order);
    cache.queue = calloc(n, sizeof *cache.queue);
    cache.fibers = calloc(n, sizeof *cache.fibers);
    if (!cache.thr || !cache.warps || !cache.order || !cache.queue || !cache.fibers) {
        release_cache();
        return -1;
    }
    cache.cap = n;
    return 0;
}

/* The driver's checks of a launch (cuLaunchKernel): CUDA_ERROR_INVALID_VALUE for a block, grid or shared memory
 * size out of range, CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES for a block that needs more registers than an SM has. */
static emu_status check_config(const struct emu_kernel *k, emu_dim3 grid, emu_dim3 block, size_t dyn_smem,
                               const void *params, size_t param_size, const struct emu_options *opt, char *msg,
                               size_t size)
{
    const char *name = k && k->name ? k->name : "?";
    if (!k || !k->entry) {
        snprintf(msg, size, "no kernel given");
        return EMU_ERR_CONFIG;
    }
    if (param_size != k->param_size || (param_size && !params) || param_size > EMU_MAX_PARAM) {
        snprintf(msg, size, "kernel '%s' takes %zu bytes of parameters, launched with %zu%s", name, k->param_size,
                 param_size, param_size && !params ? " at NULL" : "");
        return EMU_ERR_CONFIG;
    }
    unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    if (!block.x || !block.y || !block.z || block.x > 1024 || block.y > 1024 || block.z > 64 ||
        threads > EMU_MAX_THREADS) {
        snprintf(msg, size,
                 "kernel '%s': block (%u,%u,%u) is not 1..1024 threads within (1024,1024,64) "
                 "(CUDA_ERROR_INVALID_VALUE)",
                 name, block.x, block.y, block.z);
        return EMU_ERR_CONFIG;
    }
    if (!grid.x || !grid.y || !grid.z || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
        snprintf(msg, size,
                 "kernel '%s': grid (%u,%u,%u) is outside (2^31-1,65535,65535): gridDim.%c %u (CUDA_ERROR_INVALID_VALUE)",
                 name, grid.x, grid.y, grid.z,
                 !grid.x || grid.x > 0x7fffffffu ? 'x' : !grid.y || grid.y > 65535 ? 'y' : 'z',
                 !grid.x || grid.x > 0x7fffffffu ? grid.x : !grid.y || grid.y > 65535 ? grid.y : grid.z);
        return EMU_ERR_CONFIG;
    }
    const struct emu_func_attrs none = {0, 0, 0}, *a = opt->attrs ? opt->attrs : &none;
    unsigned optin = opt->smem_optin ? opt->smem_optin : EMU_SMEM_OPTIN_SM90;
    if (a->static_smem > EMU_MAX_STATIC_SMEM) {
        snprintf(msg, size, "kernel '%s': %u bytes of static shared memory, more than the %u a kernel may declare", name,
                 a->static_smem, EMU_MAX_STATIC_SMEM);
        return EMU_ERR_CONFIG;
    }
    unsigned long long max_dyn = a->max_dyn_smem ? a->max_dyn_smem : EMU_DEFAULT_DYN_SMEM - a->static_smem;
    if (dyn_smem > max_dyn || a->static_smem + (unsigned long long)dyn_smem > optin) {
        if (dyn_smem > max_dyn)
            snprintf(msg, size,
                     "kernel '%s': %zu bytes of dynamic shared memory, more than its maximum of %llu (%s) "
                     "(CUDA_ERROR_INVALID_VALUE)",
                     name, dyn_smem, max_dyn,
                     a->max_dyn_smem ? "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES"
                                     : "48 KiB less its static shared memory, the attribute not set");
        else
            snprintf(msg, size,
                     "kernel '%s': %u bytes of static and %zu of dynamic shared memory, more than the device's %u a "
                     "block (CUDA_ERROR_INVALID_VALUE)",
                     name, a->static_smem, dyn_smem, optin);
        return EMU_ERR_CONFIG;
    }
    if (a->regs) {
        /* registers are allocated per warp in units of 256 (8 a thread) */
        unsigned long long warps = (threads + 31) / 32, per_warp = ((unsigned long long)a->regs * 32 + 255) / 256 * 256;
        if (warps * per_warp > EMU_REGS_PER_BLOCK) {
            snprintf(msg, size,
                     "kernel '%s': %u registers a thread x %llu threads (%llu allocated) exceed the %u registers of a "
                     "block (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)",
                     name, a->regs, threads, warps * per_warp, EMU_REGS_PER_BLOCK);
            return EMU_ERR_RESOURCES;
        }
    }
    return EMU_OK;
}

static unsigned long long gcd(unsigned long long a, unsigned long long b)
{
    while (b) {
        unsigned long long r = a % b;
        a = b;
        b = r;
    }
    return a;
}

/* Whether `name` starts with one of the comma-separated prefixes of `list`; *dims gets what follows a prefix's ':'
 * (NULL without one). */
static int name_listed(const char *list, const char *name, const char **dims)
{
    for (const char *p = list; p && *p;) {
        size_t n = strcspn(p, ",:");
        if (n && !strncmp(name, p, n)) {
            *dims = p[n] == ':' ? p + n + 1 : NULL;
            return 1;
        }
        p = strchr(p, ',');
        p = p ? p + 1 : NULL;
    }
    return 0;
}

/* Hooks of kvqc build's cost model (docs/cuda.md, "Cost model"), read at every launch:
 * - $KVQ_EMU_PROFILE_KERNELS (prefixes, comma-separated): only launches of those kernels are profiled
 *   (profile.c); unset: every launch;
 * - $KVQ_EMU_SAMPLE ("prefix:DIMS", DIMS some of x, y, z; comma-separated): a launch of such a kernel runs only
 *   its blocks whose index along each of DIMS is 0, each standing for the product of gridDim along DIMS in the
 *   profile (the caller makes the blocks along them alike: the same work on the same data; the profile names
 *   every sampled launch and dimension);
 * - $KVQ_EMU_SKIP=1: launches return at once, running nothing (work whose results the sampled launches never
 *   read). */
static void note_sample(const char *name, char d, unsigned n)
{
    int i = 0;
    while (i < emu_n_samples &&
           !(emu_samples[i].dim == d && emu_samples[i].n == n && !strcmp(emu_samples[i].kernel, name)))
        i++;
    if (i == emu_n_samples && i < EMU_SAMPLES) {
        snprintf(emu_samples[i].kernel, sizeof emu_samples[i].kernel, "%s", name);
        emu_samples[i].dim = d, emu_samples[i].n = n;
        emu_n_samples++;
    }
}

/* sampled[0..2]: whether x, y, z are sampled; *weight: the blocks each run block stands for */
static void cost_hooks(const struct emu_kernel *k, emu_dim3 grid, int sampled[3], unsigned long long *weight,
                       int *skip)
{
    const char *name = k && k->name ? k->name : "";
    const char *only = getenv("KVQ_EMU_PROFILE_KERNELS"), *sample = getenv("KVQ_EMU_SAMPLE"),
               *sk = getenv("KVQ_EMU_SKIP");
    const char *dims = NULL;
    emu_profiling = !only || !*only || name_listed(only, name, &dims);
    *skip = sk && !strcmp(sk, "1");
    sampled[0] = sampled[1] = sampled[2] = 0;
    *weight = 1;
    if (sample && name_listed(sample, name, &dims) && dims) {
        const unsigned g[3] = {grid.x, grid.y, grid.z};
        for (const char *d = dims; *d == 'x' || *d == 'y' || *d == 'z'; d++) {
            const int i = *d - 'x';
            if (sampled[i]) continue;
            sampled[i] = 1;
            *weight *= g[i];
            note_sample(name, *d, g[i]);
        }
    }
}

emu_status emu_launch(const struct emu_kernel *k, emu_dim3 grid, emu_dim3 block, size_t dyn_smem, const void *params,
                      size_t param_size, const struct emu_options *opt, struct emu_error *err)
{
    static const struct emu_options defaults;
    char local_msg[sizeof err->msg];
    char *msg = err ? err->msg : local_msg;
    size_t msg_size = sizeof local_msg;
    msg[0] = 0;
    if (!opt) opt = &defaults;
    if (opt->stats) memset(opt->stats, 0, sizeof *opt->stats);
    emu_status s = check_config(k, grid, block, dyn_smem, params, param_size, opt, msg, msg_size);
    if (s != EMU_OK) {
        if (err) err->code = s;
        return s;
    }
    struct emu_run R;
    memset(&R, 0, sizeof R);
    R.k = k;
    R.n = block.x * block.y * block.z;
    R.nwarps = (R.n + 31) / 32;
    R.blk.bdim = (struct emu_idx3){block.x, block.y, block.z};
    R.blk.gdim = (struct emu_idx3){grid.x, grid.y, grid.z};
    R.stack_size = opt->stack_size ? opt->stack_size : DEFAULT_STACK;
    R.shuffle = opt->shuffle_seed != 0;
    R.rng = opt->shuffle_seed;
    R.msg = msg;
    R.msg_size = msg_size;
    R.blk_smem = dyn_smem;
    /* The kernel gets its own aligned copy: GPU parameter space is aligned, a caller's buffer may not be. */
    void *pcopy = NULL;
    if (param_size && posix_memalign(&pcopy, 16, param_size) != 0) pcopy = NULL;
    if (dyn_smem && posix_memalign(&R.blk.dyn_smem, 128, dyn_smem) != 0) R.blk.dyn_smem = NULL;
    pthread_mutex_lock(&launch_lock);
    if ((param_size && !pcopy) || (dyn_smem && !R.blk.dyn_smem) || reserve(R.n, R.stack_size) != 0) {
        snprintf(msg, msg_size, "kernel '%s': out of memory setting up the launch", k->name);
        R.status = EMU_ERR_NOMEM;
        goto out;
    }
    if (param_size) memcpy(pcopy, params, param_size);
    R.params = pcopy;
    R.thr = cache.thr;
    R.warps = cache.warps;
    R.order = cache.order;
    R.queue = cache.queue;
    R.fibers = cache.fibers;
    emu_run_ = &R;
    emu_blk_ = &R.blk;
    unsigned long long nblocks = (unsigned long long)grid.x * grid.y * grid.z, mul = 1, add = 0;
    int sampled[3], skip = 0;
    unsigned long long weight = 1;
    cost_hooks(k, grid, sampled, &weight, &skip);
    if (skip) nblocks = 0;
    if (R.shuffle && nblocks > 1) {
        /* Block order b -> (mul*b + add) mod nblocks, a permutation when mul is coprime with nblocks. */
        do mul = emu_rand(&R) % nblocks;
        while (mul == 0 || gcd(mul, nblocks) != 1);
        add = emu_rand(&R) % nblocks;
    }
    for (unsigned long long b = 0; b < nblocks && R.status == EMU_OK; b++) {
        unsigned long long lin = (unsigned long long)(((unsigned __int128)mul * b + add) % nblocks);
        if ((sampled[0] && lin % grid.x != 0) || (sampled[1] && lin / grid.x % grid.y != 0) ||
            (sampled[2] && lin / grid.x / grid.y != 0))
            continue;
        run_block(&R, lin, weight);
    }
    emu_profiling = 0;
    emu_run_ = NULL;
    emu_blk_ = NULL;
    emu_self_ = NULL;
out:
    pthread_mutex_unlock(&launch_lock);
    free(pcopy);
    free(R.blk.dyn_smem);
    if (opt->stats) *opt->stats = R.st;
    if (err) err->code = R.status;
    return R.status;
}
