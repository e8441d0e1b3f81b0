/* A recording fake of the CUDA driver (libcuda.so.1) for tests: the entry points runtime/cuda/cu_driver.c uses,
 * plus the few a test needs to act as a caller (its own streams and contexts, stream capture). It runs no
 * kernels; it logs every call and enforces the driver API's documented rules, recording each breach as a
 * violation that the tests assert on (tests/fakecuda/fakecuda.h, docs/testing.md "The fake CUDA driver"):
 *
 * - contexts: primary-context reference counts (cuDevicePrimaryCtxRetain/Release: the last release resets the
 *   context and destroys everything made in it); the current context per thread; every object (allocation,
 *   stream, event, module) used only in the context that made it, and only while that context lives;
 * - stream order: each stream's work is ordered by a vector clock (in-stream order, cuStreamWaitEvent, the
 *   legacy stream's implicit waits, host synchronisations). Device ranges touched by copies, memsets and
 *   launches (the pointers in a launch's parameter block) are remembered per stream; work on one stream that
 *   touches a range another stream touched with nothing ordering the two is a violation;
 * - cuMemFree (and cuMemFreeHost, cuMemHostAlloc) synchronise implicitly: counted when work was queued;
 * - stream capture (global mode): what a capture refuses (synchronisation of a capturing stream, of a captured
 *   event, allocation or free or module load while any capture is active, an async copy with pageable host
 *   memory into a capture, waiting on a non-captured event without CU_EVENT_WAIT_EXTERNAL, the legacy stream)
 *   fails with CUDA_ERROR_STREAM_CAPTURE_* and invalidates the capture; a stream that waits on a captured event
 *   joins the capture and must be joined back before cuStreamEndCapture;
 * - modules: a cubin loads only for the reported device's sm and from a toolkit no newer than the driver, PTX
 *   only at an ISA version the driver knows (FAKECUDA_DRIVER); launches check the kernel's dynamic shared memory
 *   against its cuFuncSetAttribute opt-in and the grid limits.
 * Device memory is backed by anonymous mappings (touched pages only), so copies move real bytes. */
#include <elf.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "fakecuda.h"
#include "kvq_params.cuh"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
    OK = 0,
    E_INVALID_VALUE = 1,
    E_OUT_OF_MEMORY = 2,
    E_NOT_INITIALIZED = 3,
    E_INVALID_DEVICE = 101,
    E_NO_BINARY_FOR_GPU = 209,
    E_UNSUPPORTED_PTX_VERSION = 222,
    E_INVALID_IMAGE = 200,
    E_INVALID_CONTEXT = 201,
    E_INVALID_HANDLE = 400,
    E_NOT_FOUND = 500,
    E_NOT_READY = 600,
    E_ILLEGAL_ADDRESS = 700,
    E_LAUNCH_OUT_OF_RESOURCES = 701,
    E_CONTEXT_IS_DESTROYED = 709,
    E_CAPTURE_UNSUPPORTED = 900,
    E_CAPTURE_INVALIDATED = 901,
    E_CAPTURE_UNJOINED = 904,
    E_CAPTURE_ISOLATION = 905,
    E_CAPTURE_IMPLICIT = 906,
    E_CAPTURED_EVENT = 907,
};

#define MAX_STREAMS 256 /* stream ids over the process's life; 0 is each context's legacy stream */
#define MAX_DEV 2

typedef struct {
    uint32_t c[MAX_STREAMS];
} vclock;

typedef struct fc_ctx {
    int primary, dev;
    int refs;   /* primary: references (cuDevicePrimaryCtxRetain) */
    int active; /* primary: refs > 0; created: until cuCtxDestroy */
    int gen;    /* bumped at every reset: objects of an older generation are gone */
    int legacy; /* its legacy stream's id */
} fc_ctx;

typedef struct fc_stream {
    fc_ctx *ctx;
    int gen, id, live, blocking;
    int capture;      /* capture sequence id while capturing (or joined to one), else 0 */
    int capture_root; /* the stream cuStreamBeginCapture was called on */
    unsigned long capture_thread;
} fc_stream;

typedef struct {
    fc_ctx *ctx;
    int gen, live;
    vclock vc;    /* the work it captured at its last record */
    int recorded;
    int capture; /* recorded into capture sequence `capture` */
} fc_event;

typedef struct {
    CUdeviceptr lo, hi;
    int stream;
    uint32_t seq;
    const char *what;
} fc_access;

typedef struct {
    fc_ctx *ctx;
    int gen, live, pinned;
    CUdeviceptr addr;
    size_t bytes;
    unsigned char *mem;
    fc_access *acc;
    int n_acc, cap_acc;
} fc_alloc;

typedef struct fc_func {
    struct fc_mod *mod;
    char name[96];
    size_t param_size;
    int max_dyn; /* cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) */
} fc_func;

typedef struct fc_mod {
    fc_ctx *ctx;
    int gen, live;
    fc_func *fns;
    int n_fns;
} fc_mod;

typedef struct {
    int nodes;
} fc_graph;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int inited, driver_version = 13000, sm_major = 9, sm_minor = 0, sm_count = 132;
static fc_ctx primary[MAX_DEV];
static __thread fc_ctx *cur;
static fc_stream *streams[MAX_STREAMS];
static int n_streams = 1; /* id 0: unused */
static vclock vc[MAX_STREAMS]; /* each stream's clock: vc[s].c[s] is its last op */
static vclock host;           /* what the host has waited for */
static fc_alloc **allocs;
static int n_allocs, cap_allocs;
static CUdeviceptr next_addr = 0x7d0000000000ull;
static int captures_active, capture_seq, capture_invalid[1024];
static fakecuda_launch_hook launch_hook;
static FILE *log_file;
static int verbose;
/* CUDA does not survive fork: a child of a process that initialised the driver may not use it. */
static int forked_after_init;
/* every handle ever made, so that later uses of destroyed ones are reported, not crashes (and not leaks) */
static void **handles;
static int n_handles, cap_handles;
static void *keep(void *h)
{
    if (h && n_handles == cap_handles) {
        int c = cap_handles ? 2 * cap_handles : 256;
        void **n = realloc(handles, (size_t)c * sizeof *n);
        if (n) handles = n, cap_handles = c;
    }
    if (h && n_handles < cap_handles) handles[n_handles++] = h;
    return h;
}

/* ---- recording ---- */
static char **logv, **viols;
static long n_log, cap_log;
static int n_viols, cap_viols;
static struct {
    char name[48];
    long n;
} ncalls[128];
static int n_ncalls;
static long ctr_activations, ctr_resets, ctr_implicit, ctr_host_syncs, ctr_captures;

static void push_str(char ***v, long *n, long *cap, char *s)
{
    if (*n == *cap) {
        long c = *cap ? 2 * *cap : 1024;
        char **nv = realloc(*v, (size_t)c * sizeof *nv);
        if (!nv) {
            free(s);
            return;
        }
        *v = nv, *cap = c;
    }
    (*v)[(*n)++] = s;
}

static void count_call(const char *name)
{
    for (int i = 0; i < n_ncalls; i++)
        if (!strcmp(ncalls[i].name, name)) {
            ncalls[i].n++;
            return;
        }
    if (n_ncalls < 128) {
        snprintf(ncalls[n_ncalls].name, sizeof ncalls[0].name, "%s", name);
        ncalls[n_ncalls++].n = 1;
    }
}

static CUresult logged(CUresult r, const char *name, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static CUresult logged(CUresult r, const char *name, const char *fmt, ...)
{
    char args[256] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(args, sizeof args, fmt, ap);
        va_end(ap);
    }
    char *line = NULL;
    if (asprintf(&line, "%s%s%s -> %d", name, *args ? " " : "", args, r) < 0) return r;
    count_call(name);
    if (log_file) fprintf(log_file, "%s\n", line);
    push_str(&logv, &n_log, &cap_log, line);
    return r;
}

static void violation(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void violation(const char *fmt, ...)
{
    char *s = NULL;
    va_list ap;
    va_start(ap, fmt);
    int k = vasprintf(&s, fmt, ap);
    va_end(ap);
    if (k < 0) return;
    if (verbose) fprintf(stderr, "fakecuda: violation: %s\n", s);
    if (log_file) fprintf(log_file, "VIOLATION %s\n", s);
    long n = n_viols, cap = cap_viols;
    push_str(&viols, &n, &cap, s);
    n_viols = (int)n, cap_viols = (int)cap;
}

/* ---- configuration ---- */
static void configure(void)
{
    const char *a = getenv("FAKECUDA_ARCH");
    if (a && !strncmp(a, "sm_", 3) && strlen(a) >= 5) {
        int v = atoi(a + 3);
        sm_major = v / 10, sm_minor = v % 10;
        sm_count = v == 80 ? 108 : v == 86 ? 84 : v == 89 ? 128 : 132;
    }
    const char *d = getenv("FAKECUDA_DRIVER");
    if (d && atoi(d) > 0) driver_version = atoi(d);
    const char *l = getenv("FAKECUDA_LOG");
    if (l && *l && !log_file) log_file = fopen(l, "a");
    if (log_file) setvbuf(log_file, NULL, _IOLBF, 0);
    verbose = getenv("FAKECUDA_VERBOSE") && atoi(getenv("FAKECUDA_VERBOSE")) > 0;
}

/* The newest PTX ISA a driver JIT-compiles (the PTX ISA's release notes): 13.0 -> 9.0, 12.9 -> 8.8, ... */
static int driver_ptx_isa(int version)
{
    static const int map[][2] = {{13000, 90}, {12090, 88}, {12080, 87}, {12050, 85}, {12040, 84}, {12030, 83},
                                 {12020, 82}, {12010, 81}, {12000, 80}, {11080, 78}, {11070, 77}, {11000, 70}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (version >= map[i][0]) return map[i][1];
    return 60;
}

/* ---- context checks: every call that works in the current context ---- */
static const char *ctx_name(const fc_ctx *c)
{
    static __thread char buf[48];
    if (!c) return "none";
    snprintf(buf, sizeof buf, "%s%d", c->primary ? "primary" : "ctx@", c->primary ? c->dev : (int)(uintptr_t)c % 10000);
    return buf;
}

static CUresult need_ctx(const char *call)
{
    if (forked_after_init) {
        violation("%s in a child forked after its parent initialised the driver", call);
        return E_NOT_INITIALIZED;
    }
    if (!inited) {
        violation("%s before cuInit", call);
        return E_NOT_INITIALIZED;
    }
    if (!cur) {
        violation("%s with no current context on this thread", call);
        return E_INVALID_CONTEXT;
    }
    if (!cur->active) {
        violation("%s on %s after its last reference was released (the context was reset)", call, ctx_name(cur));
        return E_CONTEXT_IS_DESTROYED;
    }
    return OK;
}

/* An object made in context c (generation gen): usable only there, and only while that context lives. */
static CUresult same_ctx(const char *call, const char *what, fc_ctx *c, int gen, int live)
{
    if (!live || !c->active || c->gen != gen) {
        violation("%s: %s was destroyed (or its context reset)", call, what);
        return E_INVALID_HANDLE;
    }
    if (c != cur) {
        violation("%s: %s belongs to %s, the current context is %s", call, what, ctx_name(c), ctx_name(cur));
        return E_INVALID_CONTEXT;
    }
    return OK;
}

static void reset_ctx(fc_ctx *c)
{
    c->active = 0;
    c->gen++;
    ctr_resets++;
}

/* ---- streams and order ---- */
static fc_stream *new_stream(fc_ctx *c, int blocking)
{
    if (n_streams >= MAX_STREAMS) return NULL;
    fc_stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->ctx = c, s->gen = c->gen, s->id = n_streams, s->live = 1, s->blocking = blocking;
    streams[n_streams++] = s;
    return s;
}

static void vc_join(vclock *a, const vclock *b)
{
    for (int i = 0; i < n_streams; i++)
        if (b->c[i] > a->c[i]) a->c[i] = b->c[i];
}

/* The stream a call names (NULL: the current context's legacy stream, made on first use). */
static CUresult get_stream(const char *call, void *h, fc_stream **out)
{
    *out = NULL;
    if (!h) {
        if (!cur->legacy) {
            fc_stream *s = new_stream(cur, 1);
            if (!s) return E_OUT_OF_MEMORY;
            cur->legacy = s->id;
        }
        fc_stream *s = streams[cur->legacy];
        if (s->gen != cur->gen) s->gen = cur->gen; /* a reset context's legacy stream is new again */
        *out = s;
        return OK;
    }
    fc_stream *s = h;
    CUresult r = same_ctx(call, "the stream", s->ctx, s->gen, s->live);
    if (r) return r;
    *out = s;
    return OK;
}

/* A capture that a refused call invalidates. */
static void invalidate_capture(int id)
{
    if (id > 0 && id < 1024) capture_invalid[id] = 1;
}

/* Queues one operation on s: its clock ticks after what the host and (legacy semantics) the other streams
 * order before it. Returns its sequence number. */
static uint32_t enqueue(fc_stream *s)
{
    vclock *v = &vc[s->id];
    vc_join(v, &host);
    if (s->blocking) {
        fc_ctx *c = s->ctx;
        if (s->id == c->legacy) {
            for (int i = 1; i < n_streams; i++)
                if (streams[i] && streams[i]->live && streams[i]->ctx == c && streams[i]->blocking && i != s->id)
                    vc_join(v, &vc[i]);
        } else if (c->legacy) {
            vc_join(v, &vc[c->legacy]);
        }
    }
    return ++v->c[s->id];
}

static fc_alloc *find_alloc(CUdeviceptr p, int include_dead)
{
    for (int i = n_allocs - 1; i >= 0; i--) {
        fc_alloc *a = allocs[i];
        if (p >= a->addr && p < a->addr + (a->bytes ? a->bytes : 1) && (a->live || include_dead)) return a;
    }
    return NULL;
}

static const char *stream_name(int id)
{
    static __thread char buf[2][32];
    static __thread int k;
    k ^= 1;
    if (id > 0 && streams[id] && streams[id]->ctx->legacy == id)
        snprintf(buf[k], sizeof buf[k], "the legacy stream");
    else
        snprintf(buf[k], sizeof buf[k], "stream #%d", id);
    return buf[k];
}

/* Work on s touching [lo, hi) of allocation a: checked against what other streams did there unordered. */
static void touch(fc_alloc *a, CUdeviceptr lo, CUdeviceptr hi, fc_stream *s, uint32_t seq, const char *what)
{
    const vclock *v = &vc[s->id];
    for (int i = 0; i < a->n_acc; i++) {
        fc_access *x = &a->acc[i];
        if (x->stream == s->id || x->hi <= lo || x->lo >= hi) continue;
        if (x->seq > v->c[x->stream]) {
            violation("%s on %s touches device [0x%llx, 0x%llx), which %s on %s touched with nothing ordering "
                      "the two (no event wait or synchronisation between them)",
                      what, stream_name(s->id), lo, hi, x->what, stream_name(x->stream));
            x->seq = 0; /* once per pair */
        }
    }
    for (int i = 0; i < a->n_acc; i++)
        if (a->acc[i].stream == s->id && a->acc[i].lo == lo && a->acc[i].hi == hi) {
            a->acc[i].seq = seq, a->acc[i].what = what;
            return;
        }
    if (a->n_acc == a->cap_acc) {
        int c = a->cap_acc ? 2 * a->cap_acc : 16;
        fc_access *n = realloc(a->acc, (size_t)c * sizeof *n);
        if (!n) return;
        a->acc = n, a->cap_acc = c;
    }
    a->acc[a->n_acc++] = (fc_access){lo, hi, s->id, seq, what};
}

/* The host has waited for clock w: what every stream did up to it is done, so forget it. */
static void host_waited(const vclock *w)
{
    vc_join(&host, w);
    ctr_host_syncs++;
    for (int i = 0; i < n_allocs; i++) {
        fc_alloc *a = allocs[i];
        int k = 0;
        for (int j = 0; j < a->n_acc; j++)
            if (a->acc[j].seq > host.c[a->acc[j].stream]) a->acc[k++] = a->acc[j];
        a->n_acc = k;
    }
}

static int pending_work(const fc_ctx *c)
{
    for (int i = 1; i < n_streams; i++)
        if (streams[i] && streams[i]->ctx == c && vc[i].c[i] > host.c[i]) return 1;
    return 0;
}

/* A call stream capture refuses while any capture (global mode) is under way: an error, and the captures
 * are invalidated. */
static CUresult capture_refuses(const char *call)
{
    if (!captures_active) return OK;
    violation("%s while a stream capture is under way: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (the call is not "
              "allowed during capture in the global mode; the capture is invalidated)",
              call);
    for (int i = 1; i < n_streams; i++)
        if (streams[i] && streams[i]->capture) invalidate_capture(streams[i]->capture);
    return E_CAPTURE_UNSUPPORTED;
}

/* ---- the driver API ---- */
#define API __attribute__((visibility("default")))
#define LOCKED(expr)                                                                                           \
    do {                                                                                                       \
        pthread_mutex_lock(&mu);                                                                               \
        CUresult r_ = (expr);                                                                                  \
        pthread_mutex_unlock(&mu);                                                                             \
        return r_;                                                                                             \
    } while (0)

static void in_child(void)
{
    if (inited) forked_after_init = 1;
    pthread_mutex_init(&mu, NULL);
}

static CUresult do_init(unsigned flags)
{
    if (forked_after_init) {
        violation("cuInit in a child forked after its parent initialised the driver (CUDA does not survive fork)");
        return logged(E_NOT_INITIALIZED, "cuInit", "%u", flags);
    }
    if (!inited) {
        configure();
        pthread_atfork(NULL, NULL, in_child);
    }
    inited = 1;
    for (int d = 0; d < MAX_DEV; d++) primary[d].primary = 1, primary[d].dev = d;
    return logged(flags ? E_INVALID_VALUE : OK, "cuInit", "%u", flags);
}
API CUresult cuInit(unsigned flags) { LOCKED(do_init(flags)); }

API CUresult cuDriverGetVersion(int *v)
{
    pthread_mutex_lock(&mu);
    if (!inited) configure(); /* allowed before cuInit */
    *v = driver_version;
    CUresult r = logged(OK, "cuDriverGetVersion", "%d", *v);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuDeviceGetCount(int *n)
{
    pthread_mutex_lock(&mu);
    *n = inited ? 1 : 0;
    if (!inited) violation("cuDeviceGetCount before cuInit");
    CUresult r = logged(inited ? OK : E_NOT_INITIALIZED, "cuDeviceGetCount", "%d", *n);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuDeviceGet(int *dev, int ord)
{
    pthread_mutex_lock(&mu);
    CUresult r = !inited ? E_NOT_INITIALIZED : ord != 0 ? E_INVALID_DEVICE : OK;
    if (!r) *dev = ord;
    r = logged(r, "cuDeviceGet", "%d", ord);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuDeviceGetAttribute(int *v, int attr, int dev)
{
    pthread_mutex_lock(&mu);
    CUresult r = !inited ? E_NOT_INITIALIZED : dev != 0 ? E_INVALID_DEVICE : OK;
    if (!r) switch (attr) {
        case 16: *v = sm_count; break;                              /* MULTIPROCESSOR_COUNT */
        case 75: *v = sm_major; break;                              /* COMPUTE_CAPABILITY_MAJOR */
        case 76: *v = sm_minor; break;                              /* COMPUTE_CAPABILITY_MINOR */
        case 36: *v = sm_major >= 9 ? 2619000 : 1593000; break;     /* MEMORY_CLOCK_RATE, kHz */
        case 37: *v = 5120; break;                                  /* GLOBAL_MEMORY_BUS_WIDTH */
        case 97: *v = sm_major >= 9 ? 232448 : 166912; break;       /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
        default: *v = 0; break;
        }
    r = logged(r, "cuDeviceGetAttribute", "%d", attr);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev)
{
    pthread_mutex_lock(&mu);
    CUresult r = !inited ? E_NOT_INITIALIZED : dev != 0 ? E_INVALID_DEVICE : OK;
    if (!r) {
        fc_ctx *c = &primary[dev];
        if (c->refs++ == 0) {
            c->active = 1;
            ctr_activations++;
        }
        *ctx = c;
    }
    r = logged(r, "cuDevicePrimaryCtxRetain", "refs=%d", dev == 0 ? primary[0].refs : -1);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuDevicePrimaryCtxRelease_v2(int dev)
{
    pthread_mutex_lock(&mu);
    CUresult r = !inited ? E_NOT_INITIALIZED : dev != 0 ? E_INVALID_DEVICE : OK;
    if (!r) {
        fc_ctx *c = &primary[dev];
        if (c->refs <= 0) {
            violation("cuDevicePrimaryCtxRelease of device %d with no reference retained", dev);
            r = E_INVALID_CONTEXT;
        } else if (--c->refs == 0) {
            reset_ctx(c);
        }
    }
    r = logged(r, "cuDevicePrimaryCtxRelease_v2", "refs=%d", dev == 0 ? primary[0].refs : -1);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuDevicePrimaryCtxGetState(int dev, unsigned *flags, int *active)
{
    pthread_mutex_lock(&mu);
    CUresult r = !inited ? E_NOT_INITIALIZED : dev != 0 ? E_INVALID_DEVICE : OK;
    if (!r) *flags = 0, *active = primary[dev].active;
    r = logged(r, "cuDevicePrimaryCtxGetState", NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

/* A context of the caller's own (an inference engine's), for tests of borrowing. */
API CUresult cuCtxCreate_v2(void **ctx, unsigned flags, int dev)
{
    pthread_mutex_lock(&mu);
    (void)flags;
    CUresult r = !inited ? E_NOT_INITIALIZED : dev != 0 ? E_INVALID_DEVICE : OK;
    fc_ctx *c = r ? NULL : keep(calloc(1, sizeof *c));
    if (!r && !c) r = E_OUT_OF_MEMORY;
    if (!r) {
        c->dev = dev, c->active = 1, c->gen = 1;
        *ctx = c;
        cur = c; /* cuCtxCreate makes it current */
    }
    r = logged(r, "cuCtxCreate_v2", NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuCtxDestroy_v2(void *ctx)
{
    pthread_mutex_lock(&mu);
    fc_ctx *c = ctx;
    CUresult r = OK;
    if (!c || c->primary || !c->active) {
        violation("cuCtxDestroy of %s", !c ? "NULL" : c->primary ? "a primary context" : "a destroyed context");
        r = E_INVALID_CONTEXT;
    } else {
        reset_ctx(c);
        if (cur == c) cur = NULL;
    }
    r = logged(r, "cuCtxDestroy_v2", NULL);
    pthread_mutex_unlock(&mu);
    return r; /* the struct stays: later uses are reported, not crashes */
}

API CUresult cuCtxSetCurrent(void *ctx)
{
    pthread_mutex_lock(&mu);
    fc_ctx *c = ctx;
    CUresult r = OK;
    if (c && !c->active && !c->primary) {
        violation("cuCtxSetCurrent of a destroyed context");
        r = E_INVALID_CONTEXT;
    } else {
        cur = c; /* a primary context with no reference may be made current; using it is the error */
    }
    r = logged(r, "cuCtxSetCurrent", "%s", ctx_name(c));
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuCtxGetCurrent(void **ctx)
{
    pthread_mutex_lock(&mu);
    *ctx = cur;
    CUresult r = logged(inited ? OK : E_NOT_INITIALIZED, "cuCtxGetCurrent", "%s", ctx_name(cur));
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuCtxGetDevice(int *dev)
{
    pthread_mutex_lock(&mu);
    CUresult r = need_ctx("cuCtxGetDevice");
    if (!r) *dev = cur->dev;
    r = logged(r, "cuCtxGetDevice", NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuCtxSynchronize(void)
{
    pthread_mutex_lock(&mu);
    CUresult r = need_ctx("cuCtxSynchronize");
    if (!r) r = capture_refuses("cuCtxSynchronize");
    if (!r) {
        vclock all = host;
        for (int i = 1; i < n_streams; i++)
            if (streams[i] && streams[i]->ctx == cur) vc_join(&all, &vc[i]);
        host_waited(&all);
    }
    r = logged(r, "cuCtxSynchronize", NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

/* ---- memory ---- */
static fc_alloc *add_alloc(size_t bytes, int pinned)
{
    fc_alloc *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    size_t map = bytes ? bytes : 1;
    void *m = mmap(NULL, map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
        free(a);
        return NULL;
    }
    if (n_allocs == cap_allocs) {
        int c = cap_allocs ? 2 * cap_allocs : 256;
        fc_alloc **n = realloc(allocs, (size_t)c * sizeof *n);
        if (!n) {
            munmap(m, map);
            free(a);
            return NULL;
        }
        allocs = n, cap_allocs = c;
    }
    a->ctx = cur, a->gen = cur->gen, a->live = 1, a->pinned = pinned, a->bytes = bytes, a->mem = m;
    if (pinned) {
        a->addr = (CUdeviceptr)(uintptr_t)m; /* unified addressing: the host pointer is the device pointer */
    } else {
        a->addr = next_addr;
        next_addr += (bytes + 0xffff) & ~(CUdeviceptr)0xffff; /* never reused: a stale pointer stays stale */
    }
    allocs[n_allocs++] = a;
    return a;
}

static void drop_alloc(fc_alloc *a)
{
    a->live = 0;
    munmap(a->mem, a->bytes ? a->bytes : 1);
    a->mem = NULL;
    free(a->acc);
    a->acc = NULL, a->n_acc = a->cap_acc = 0;
}

/* A device range a call names: inside one allocation of the current context. */
static CUresult dev_range(const char *call, CUdeviceptr p, size_t n, fc_alloc **out)
{
    fc_alloc *a = find_alloc(p, 0);
    if (!a) {
        fc_alloc *d = find_alloc(p, 1);
        violation("%s: device address 0x%llx %s", call, p, d ? "was freed" : "is not in any allocation");
        return E_INVALID_VALUE;
    }
    CUresult r = same_ctx(call, "the device memory", a->ctx, a->gen, a->live);
    if (r) return r;
    if (p + n > a->addr + a->bytes) {
        violation("%s: [0x%llx, +%zu) runs past its allocation of %zu bytes", call, p, n, a->bytes);
        return E_INVALID_VALUE;
    }
    *out = a;
    return OK;
}

static CUresult mem_free_impl(const char *call, CUdeviceptr p, int pinned)
{
    CUresult r = need_ctx(call);
    if (r) return r;
    if ((r = capture_refuses(call))) return r;
    fc_alloc *a = find_alloc(p, 0);
    if (!a || a->addr != p || a->pinned != pinned) {
        violation("%s of 0x%llx: %s", call, p, !a ? "not a live allocation" : "not the start of one of its kind");
        return E_INVALID_VALUE;
    }
    if ((r = same_ctx(call, "the allocation", a->ctx, a->gen, a->live))) return r;
    /* implicit synchronisation: the free waits for the device */
    if (pending_work(cur)) ctr_implicit++;
    vclock all = host;
    for (int i = 1; i < n_streams; i++)
        if (streams[i] && streams[i]->ctx == cur) vc_join(&all, &vc[i]);
    host_waited(&all);
    drop_alloc(a);
    return OK;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t bytes)
{
    pthread_mutex_lock(&mu);
    CUresult r = need_ctx("cuMemAlloc");
    if (!r) r = capture_refuses("cuMemAlloc");
    fc_alloc *a = NULL;
    if (!r && !bytes) r = E_INVALID_VALUE;
    if (!r && !(a = add_alloc(bytes, 0))) r = E_OUT_OF_MEMORY;
    if (!r) *p = a->addr;
    r = logged(r, "cuMemAlloc_v2", "%zu -> 0x%llx", bytes, a ? a->addr : 0);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuMemFree_v2(CUdeviceptr p)
{
    pthread_mutex_lock(&mu);
    CUresult r = logged(mem_free_impl("cuMemFree", p, 0), "cuMemFree_v2", "0x%llx", p);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuMemHostAlloc(void **host_p, size_t bytes, unsigned flags)
{
    pthread_mutex_lock(&mu);
    CUresult r = need_ctx("cuMemHostAlloc");
    if (!r) r = capture_refuses("cuMemHostAlloc");
    fc_alloc *a = NULL;
    if (!r && !bytes) r = E_INVALID_VALUE;
    if (!r && !(a = add_alloc(bytes, 1))) r = E_OUT_OF_MEMORY;
    if (!r) *host_p = a->mem;
    r = logged(r, "cuMemHostAlloc", "%zu flags=%u", bytes, flags);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *p, void *host_p, unsigned flags)
{
    pthread_mutex_lock(&mu);
    CUresult r = need_ctx("cuMemHostGetDevicePointer");
    fc_alloc *a = r ? NULL : find_alloc((CUdeviceptr)(uintptr_t)host_p, 0);
    if (!r && (!a || !a->pinned || flags)) {
        violation("cuMemHostGetDevicePointer of memory not from cuMemHostAlloc");
        r = E_INVALID_VALUE;
    }
    if (!r) r = same_ctx("cuMemHostGetDevicePointer", "the host allocation", a->ctx, a->gen, a->live);
    if (!r) *p = (CUdeviceptr)(uintptr_t)host_p;
    r = logged(r, "cuMemHostGetDevicePointer_v2", NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuMemFreeHost(void *host_p)
{
    pthread_mutex_lock(&mu);
    CUresult r = logged(mem_free_impl("cuMemFreeHost", (CUdeviceptr)(uintptr_t)host_p, 1), "cuMemFreeHost", NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

/* Host memory of an async copy: page-locked (cuMemHostAlloc) or pageable. */
static int host_pinned(const void *h, size_t n)
{
    fc_alloc *a = find_alloc((CUdeviceptr)(uintptr_t)h, 0);
    return a && a->pinned && (CUdeviceptr)(uintptr_t)h + n <= a->addr + a->bytes;
}

/* Work queued on a stream: context and capture checks, then the clock. */
static CUresult stream_op(const char *call, void *hs, fc_stream **s, uint32_t *seq)
{
    CUresult r = need_ctx(call);
    if (!r) r = get_stream(call, hs, s);
    if (r) return r;
    if (captures_active && (*s)->id == cur->legacy && !(*s)->capture) {
        for (int i = 1; i < n_streams; i++)
            if (streams[i] && streams[i]->capture && streams[i]->blocking && streams[i]->ctx == cur) {
                violation("%s on the legacy stream while blocking %s is being captured: "
                          "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
                          call, stream_name(i));
                invalidate_capture(streams[i]->capture);
                return E_CAPTURE_IMPLICIT;
            }
    }
    *seq = enqueue(*s);
    return OK;
}

static CUresult copy_impl(const char *call, CUdeviceptr dptr, void *h, size_t n, void *hs, int to_dev)
{
    fc_stream *s = NULL;
    uint32_t seq = 0;
    CUresult r = stream_op(call, hs, &s, &seq);
    fc_alloc *a = NULL;
    if (!r) r = dev_range(call, dptr, n, &a);
    if (r) return r;
    int pinned = host_pinned(h, n);
    if (!pinned && s->capture) {
        violation("%s with pageable host memory into a stream capture: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", call);
        invalidate_capture(s->capture);
        return E_CAPTURE_UNSUPPORTED;
    }
    touch(a, dptr, dptr + n, s, seq, call);
    if (!s->capture) {
        if (to_dev)
            memcpy(a->mem + (dptr - a->addr), h, n);
        else
            memcpy(h, a->mem + (dptr - a->addr), n);
    }
    if (!pinned && !s->capture) { /* a pageable copy returns once it is done: the stream up to it */
        vclock w = vc[s->id];
        host_waited(&w);
    }
    return OK;
}

API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *hs)
{
    pthread_mutex_lock(&mu);
    CUresult r = copy_impl("cuMemcpyHtoDAsync", dst, (void *)src, n, hs, 1);
    r = logged(r, "cuMemcpyHtoDAsync_v2", "0x%llx %zu stream=%d", dst, n, hs ? ((fc_stream *)hs)->id : 0);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *hs)
{
    pthread_mutex_lock(&mu);
    CUresult r = copy_impl("cuMemcpyDtoHAsync", src, dst, n, hs, 0);
    r = logged(r, "cuMemcpyDtoHAsync_v2", "0x%llx %zu stream=%d", src, n, hs ? ((fc_stream *)hs)->id : 0);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void *hs)
{
    pthread_mutex_lock(&mu);
    fc_stream *s = NULL;
    uint32_t seq = 0;
    fc_alloc *a = NULL;
    CUresult r = stream_op("cuMemsetD8Async", hs, &s, &seq);
    if (!r) r = dev_range("cuMemsetD8Async", dst, n, &a);
    if (!r) {
        touch(a, dst, dst + n, s, seq, "cuMemsetD8Async");
        if (!s->capture) {
            unsigned char *m = a->mem + (dst - a->addr);
            /* zeroing whole pages gives them back (a 16 MiB slab's memset touches nothing) */
            uintptr_t lo = ((uintptr_t)m + 4095) & ~(uintptr_t)4095, hi = ((uintptr_t)m + n) & ~(uintptr_t)4095;
            if (v == 0 && hi > lo) {
                memset(m, 0, lo - (uintptr_t)m);
                madvise((void *)lo, hi - lo, MADV_DONTNEED);
                memset((void *)hi, 0, (uintptr_t)m + n - hi);
            } else {
                memset(m, v, n);
            }
        }
    }
    r = logged(r, "cuMemsetD8Async", "0x%llx %zu stream=%d", dst, n, s ? s->id : -1);
    pthread_mutex_unlock(&mu);
    return r;
}

/* ---- streams, events, capture ---- */
API CUresult cuStreamCreate(void **out, unsigned flags)
{
    pthread_mutex_lock(&mu);
    CUresult r = need_ctx("cuStreamCreate");
    fc_stream *s = NULL;
    if (!r && !(s = new_stream(cur, !(flags & 1)))) r = E_OUT_OF_MEMORY;
    if (!r) *out = s;
    r = logged(r, "cuStreamCreate", "flags=%u -> #%d", flags, s ? s->id : 0);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuStreamDestroy_v2(void *hs)
{
    pthread_mutex_lock(&mu);
    fc_stream *s = hs;
    CUresult r = need_ctx("cuStreamDestroy");
    if (!r && !s) r = E_INVALID_HANDLE;
    if (!r) r = same_ctx("cuStreamDestroy", "the stream", s->ctx, s->gen, s->live);
    if (!r && s->capture) {
        violation("cuStreamDestroy of %s while it is being captured", stream_name(s->id));
        r = E_CAPTURE_UNSUPPORTED;
    }
    if (!r) s->live = 0; /* its queued work still completes (the driver's rule) */
    r = logged(r, "cuStreamDestroy_v2", "#%d", s ? s->id : 0);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuStreamSynchronize(void *hs)
{
    pthread_mutex_lock(&mu);
    fc_stream *s = NULL;
    CUresult r = need_ctx("cuStreamSynchronize");
    if (!r) r = get_stream("cuStreamSynchronize", hs, &s);
    if (!r && s->capture) {
        violation("cuStreamSynchronize of %s while it is being captured: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                  stream_name(s->id));
        invalidate_capture(s->capture);
        r = E_CAPTURE_UNSUPPORTED;
    }
    if (!r) {
        vclock w = vc[s->id];
        host_waited(&w);
    }
    r = logged(r, "cuStreamSynchronize", "stream=%d", s ? s->id : -1);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuStreamIsCapturing(void *hs, int *status)
{
    pthread_mutex_lock(&mu);
    fc_stream *s = NULL;
    CUresult r = need_ctx("cuStreamIsCapturing");
    if (!r) r = get_stream("cuStreamIsCapturing", hs, &s);
    if (!r) *status = !s->capture ? 0 : capture_invalid[s->capture % 1024] ? 2 : 1;
    r = logged(r, "cuStreamIsCapturing", "stream=%d", s ? s->id : -1);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuStreamBeginCapture_v2(void *hs, int mode)
{
    pthread_mutex_lock(&mu);
    fc_stream *s = NULL;
    CUresult r = need_ctx("cuStreamBeginCapture");
    if (!r) r = get_stream("cuStreamBeginCapture", hs, &s);
    if (!r && (s->capture || s->id == cur->legacy || mode != 0 || capture_seq >= 1023)) {
        violation("cuStreamBeginCapture: %s", s->capture ? "the stream is already capturing"
                                              : mode   ? "the fake models the global mode only"
                                                       : "not on the legacy stream");
        r = E_INVALID_VALUE;
    }
    if (!r) {
        s->capture = ++capture_seq, s->capture_root = s->id, s->capture_thread = (unsigned long)pthread_self();
        captures_active++;
    }
    r = logged(r, "cuStreamBeginCapture_v2", "stream=%d", s ? s->id : -1);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuStreamEndCapture(void *hs, void **graph)
{
    pthread_mutex_lock(&mu);
    fc_stream *s = NULL;
    CUresult r = need_ctx("cuStreamEndCapture");
    if (!r) r = get_stream("cuStreamEndCapture", hs, &s);
    if (!r && (!s->capture || s->capture_root != s->id)) {
        violation("cuStreamEndCapture on %s, which did not begin a capture", stream_name(s->id));
        r = E_INVALID_VALUE;
    }
    *graph = NULL;
    if (!r) {
        int id = s->capture;
        for (int i = 1; i < n_streams; i++)
            if (streams[i] && streams[i]->capture == id && i != s->id) {
                violation("cuStreamEndCapture: %s joined the capture and was not joined back: "
                          "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
                          stream_name(i));
                streams[i]->capture = 0;
                r = E_CAPTURE_UNJOINED;
            }
        s->capture = 0;
        captures_active--;
        ctr_captures++;
        if (!r && capture_invalid[id]) r = E_CAPTURE_INVALIDATED;
        if (!r) {
            fc_graph *g = calloc(1, sizeof *g);
            *graph = g;
            if (!g) r = E_OUT_OF_MEMORY;
        }
    }
    r = logged(r, "cuStreamEndCapture", "stream=%d", s ? s->id : -1);
    pthread_mutex_unlock(&mu);
    return r;
}

/* An instantiated graph: made in the current context, launched only there. It replays nothing (the fake runs no
 * kernels); what it checks is that the caller instantiates and launches with that context current. */
typedef struct {
    fc_ctx *ctx;
    int gen, live;
} fc_graph_exec;

API CUresult cuGraphInstantiateWithFlags(void **out, void *g, unsigned long long flags)
{
    pthread_mutex_lock(&mu);
    CUresult r = need_ctx("cuGraphInstantiate");
    if (!r && !g) r = E_INVALID_VALUE;
    fc_graph_exec *x = r ? NULL : keep(calloc(1, sizeof *x));
    if (!r && !x) r = E_OUT_OF_MEMORY;
    if (!r) x->ctx = cur, x->gen = cur->gen, x->live = 1, *out = x;
    r = logged(r, "cuGraphInstantiateWithFlags", "flags=%llu", flags);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuGraphLaunch(void *hx, void *hs)
{
    pthread_mutex_lock(&mu);
    fc_graph_exec *x = hx;
    fc_stream *s = NULL;
    uint32_t seq = 0;
    CUresult r = need_ctx("cuGraphLaunch");
    if (!r && !x) r = E_INVALID_HANDLE;
    if (!r) r = same_ctx("cuGraphLaunch", "the graph", x->ctx, x->gen, x->live);
    if (!r) r = stream_op("cuGraphLaunch", hs, &s, &seq);
    r = logged(r, "cuGraphLaunch", "stream=%d", s ? s->id : -1);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuGraphExecDestroy(void *hx)
{
    pthread_mutex_lock(&mu);
    fc_graph_exec *x = hx;
    CUresult r = need_ctx("cuGraphExecDestroy");
    if (!r && !x) r = E_INVALID_HANDLE;
    if (!r) r = same_ctx("cuGraphExecDestroy", "the graph", x->ctx, x->gen, x->live);
    if (!r) x->live = 0;
    r = logged(r, "cuGraphExecDestroy", NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

/* The fake keeps no clock: two completed events of one context are 1 microsecond apart (a benchmark's figures
 * on the fake mean nothing; its calls are what is checked). */
API CUresult cuEventElapsedTime(float *ms, void *h0, void *h1)
{
    pthread_mutex_lock(&mu);
    fc_event *e[2] = {h0, h1};
    CUresult r = need_ctx("cuEventElapsedTime");
    for (int i = 0; i < 2 && !r; i++) {
        if (!e[i]) r = E_INVALID_HANDLE;
        if (!r) r = same_ctx("cuEventElapsedTime", "the event", e[i]->ctx, e[i]->gen, e[i]->live);
        if (!r && (!e[i]->recorded || e[i]->capture)) {
            violation("cuEventElapsedTime of an event %s", e[i]->capture ? "recorded in a capture" : "never recorded");
            r = E_INVALID_HANDLE;
        }
    }
    if (!r) *ms = 0.001f;
    r = logged(r, "cuEventElapsedTime", NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *hs)
{
    pthread_mutex_lock(&mu);
    fc_stream *s = NULL;
    uint32_t seq = 0;
    fc_alloc *ad = NULL, *as = NULL;
    CUresult r = stream_op("cuMemcpyDtoDAsync", hs, &s, &seq);
    if (!r) r = dev_range("cuMemcpyDtoDAsync", dst, n, &ad);
    if (!r) r = dev_range("cuMemcpyDtoDAsync", src, n, &as);
    if (!r) {
        touch(as, src, src + n, s, seq, "cuMemcpyDtoDAsync");
        touch(ad, dst, dst + n, s, seq, "cuMemcpyDtoDAsync");
        if (!s->capture) memmove(ad->mem + (dst - ad->addr), as->mem + (src - as->addr), n);
    }
    r = logged(r, "cuMemcpyDtoDAsync_v2", "0x%llx 0x%llx %zu stream=%d", dst, src, n, s ? s->id : -1);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuGraphDestroy(void *g)
{
    free(g);
    pthread_mutex_lock(&mu);
    CUresult r = logged(OK, "cuGraphDestroy", NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuEventCreate(void **out, unsigned flags)
{
    pthread_mutex_lock(&mu);
    CUresult r = need_ctx("cuEventCreate");
    fc_event *e = r ? NULL : keep(calloc(1, sizeof *e));
    if (!r && !e) r = E_OUT_OF_MEMORY;
    if (!r) e->ctx = cur, e->gen = cur->gen, e->live = 1, *out = e;
    r = logged(r, "cuEventCreate", "flags=%u", flags);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuEventDestroy_v2(void *he)
{
    pthread_mutex_lock(&mu);
    fc_event *e = he;
    CUresult r = need_ctx("cuEventDestroy");
    if (!r && !e) r = E_INVALID_HANDLE;
    if (!r) r = same_ctx("cuEventDestroy", "the event", e->ctx, e->gen, e->live);
    if (!r) e->live = 0;
    r = logged(r, "cuEventDestroy_v2", NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuEventRecord(void *he, void *hs)
{
    pthread_mutex_lock(&mu);
    fc_event *e = he;
    fc_stream *s = NULL;
    uint32_t seq = 0;
    CUresult r = need_ctx("cuEventRecord");
    if (!r && !e) r = E_INVALID_HANDLE;
    if (!r) r = same_ctx("cuEventRecord", "the event", e->ctx, e->gen, e->live);
    if (!r) r = stream_op("cuEventRecord", hs, &s, &seq);
    if (!r) e->vc = vc[s->id], e->recorded = 1, e->capture = s->capture;
    r = logged(r, "cuEventRecord", "stream=%d", s ? s->id : -1);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuEventSynchronize(void *he)
{
    pthread_mutex_lock(&mu);
    fc_event *e = he;
    CUresult r = need_ctx("cuEventSynchronize");
    if (!r && !e) r = E_INVALID_HANDLE;
    if (!r && (!e->live || e->gen != e->ctx->gen || !e->ctx->active)) {
        violation("cuEventSynchronize: the event was destroyed (or its context reset)");
        r = E_INVALID_HANDLE;
    }
    if (!r && e->capture) {
        violation("cuEventSynchronize of an event recorded in a stream capture: CUDA_ERROR_CAPTURED_EVENT");
        invalidate_capture(e->capture);
        r = E_CAPTURED_EVENT;
    }
    if (!r && e->recorded) host_waited(&e->vc);
    r = logged(r, "cuEventSynchronize", NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuStreamWaitEvent(void *hs, void *he, unsigned flags)
{
    pthread_mutex_lock(&mu);
    fc_event *e = he;
    fc_stream *s = NULL;
    uint32_t seq = 0;
    CUresult r = need_ctx("cuStreamWaitEvent");
    if (!r && !e) r = E_INVALID_HANDLE;
    if (!r && (!e->live || e->gen != e->ctx->gen || !e->ctx->active)) {
        violation("cuStreamWaitEvent: the event was destroyed (or its context reset)");
        r = E_INVALID_HANDLE;
    }
    if (!r) r = get_stream("cuStreamWaitEvent", hs, &s);
    if (!r && s->capture && !e->capture && !(flags & 1)) {
        violation("cuStreamWaitEvent: %s is being captured and the event was recorded outside the capture "
                  "(needs CU_EVENT_WAIT_EXTERNAL): CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
                  stream_name(s->id));
        invalidate_capture(s->capture);
        r = E_CAPTURE_ISOLATION;
    }
    if (!r && e->capture && s->capture && e->capture != s->capture) {
        violation("cuStreamWaitEvent merges two capture sequences: CUDA_ERROR_STREAM_CAPTURE_ISOLATION");
        r = E_CAPTURE_ISOLATION;
    }
    if (!r) { /* an external wait in a capture: the graph waits for the event's latest record at launch */
        if (e->capture && !s->capture) s->capture = e->capture; /* the stream joins the capture */
        seq = enqueue(s);
        vc_join(&vc[s->id], &e->vc);
    }
    (void)seq;
    r = logged(r, "cuStreamWaitEvent", "stream=%d flags=%u", s ? s->id : -1, flags);
    pthread_mutex_unlock(&mu);
    return r;
}

/* ---- modules ---- */
/* Kernels of a cubin: its FUNC symbols, the parameter block size from .nv.info.<name> (EIATTR_CBANK_PARAM_SIZE,
 * attribute 0x19); the sm and the toolkit that made it (.note.nv.tkinfo's "release X.Y"). */
static CUresult parse_cubin(const unsigned char *img, fc_mod *m, int *sm, int *tk_major)
{
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)img;
    if (eh->e_machine != 190 || eh->e_shentsize != sizeof(Elf64_Shdr)) return E_INVALID_IMAGE;
    const Elf64_Shdr *sh = (const Elf64_Shdr *)(img + eh->e_shoff);
    const char *shstr = (const char *)img + sh[eh->e_shstrndx].sh_offset;
    *sm = (int)((eh->e_flags >> 8) & 0xff);
    *tk_major = 0;
    const Elf64_Shdr *symtab = NULL;
    for (int i = 0; i < eh->e_shnum; i++) {
        if (sh[i].sh_type == SHT_SYMTAB) symtab = &sh[i];
        const char *nm = shstr + sh[i].sh_name;
        if (!strcmp(nm, ".note.nv.tkinfo")) {
            const char *p = memmem(img + sh[i].sh_offset, sh[i].sh_size, "release ", 8);
            if (p) *tk_major = atoi(p + 8);
        }
    }
    if (!symtab) return E_INVALID_IMAGE;
    const Elf64_Sym *sym = (const Elf64_Sym *)(img + symtab->sh_offset);
    const char *str = (const char *)img + sh[symtab->sh_link].sh_offset;
    int n = (int)(symtab->sh_size / sizeof *sym);
    m->fns = calloc((size_t)n + 1, sizeof *m->fns);
    if (!m->fns) return E_OUT_OF_MEMORY;
    for (int i = 0; i < n; i++) {
        if (ELF64_ST_TYPE(sym[i].st_info) != STT_FUNC || ELF64_ST_BIND(sym[i].st_info) != STB_GLOBAL) continue;
        fc_func *f = &m->fns[m->n_fns++];
        f->mod = m;
        snprintf(f->name, sizeof f->name, "%s", str + sym[i].st_name);
        char info[128];
        snprintf(info, sizeof info, ".nv.info.%s", f->name);
        for (int j = 0; j < eh->e_shnum; j++) {
            if (strcmp(shstr + sh[j].sh_name, info)) continue;
            const unsigned char *a = img + sh[j].sh_offset, *end = a + sh[j].sh_size;
            while (a + 2 <= end) {
                int fmt = a[0], attr = a[1];
                size_t len = fmt == 4 ? 4 + (size_t)(a[2] | a[3] << 8) : fmt == 3 ? 4 : fmt == 2 ? 3 : 2;
                if (fmt == 3 && attr == 0x19) f->param_size = (size_t)(a[2] | a[3] << 8);
                a += len;
            }
        }
    }
    return OK;
}

/* Kernels of a PTX text: its .entry names; its .version against the driver's, its .target against the device. */
static CUresult parse_ptx(const char *ptx, fc_mod *m)
{
    const char *v = strstr(ptx, ".version ");
    const char *t = strstr(ptx, ".target sm_");
    if (!v || !t) return E_INVALID_IMAGE;
    const char *dot = strchr(v + 9, '.');
    int isa = atoi(v + 9) * 10 + (dot ? atoi(dot + 1) : 0);
    if (isa > driver_ptx_isa(driver_version)) return E_UNSUPPORTED_PTX_VERSION;
    int sm = atoi(t + 11);
    if (sm > sm_major * 10 + sm_minor) return E_NO_BINARY_FOR_GPU;
    /* a target needs the ISA that introduced it (sm_80: 7.0, sm_86: 7.1, sm_89/sm_90: 7.8) */
    if (isa < (sm >= 89 ? 78 : sm >= 86 ? 71 : 70)) return 218; /* CUDA_ERROR_INVALID_PTX */
    int n = 0;
    for (const char *p = ptx; (p = strstr(p, ".entry ")); p++) n++;
    m->fns = calloc((size_t)n + 1, sizeof *m->fns);
    if (!m->fns) return E_OUT_OF_MEMORY;
    for (const char *p = ptx; (p = strstr(p, ".entry ")); p++) {
        fc_func *f = &m->fns[m->n_fns++];
        f->mod = m;
        const char *b = p + 7;
        size_t k = 0;
        while (b[k] && b[k] != '(' && b[k] != ' ' && b[k] != '\n' && k < sizeof f->name - 1) k++;
        memcpy(f->name, b, k);
        /* the parameter block: ".param .align A .b8 NAME_param_0[SIZE]" */
        const char *pb = strstr(b, "_param_0[");
        if (pb) f->param_size = (size_t)atol(pb + 9);
    }
    return OK;
}

API CUresult cuModuleLoadData(void **out, const void *image)
{
    pthread_mutex_lock(&mu);
    CUresult r = need_ctx("cuModuleLoadData");
    if (!r) r = capture_refuses("cuModuleLoadData");
    fc_mod *m = r ? NULL : calloc(1, sizeof *m);
    if (!r && !m) r = E_OUT_OF_MEMORY;
    const char *kind = "?";
    if (!r) {
        m->ctx = cur, m->gen = cur->gen, m->live = 1;
        const unsigned char *img = image;
        if (!memcmp(img, ELFMAG, SELFMAG)) {
            kind = "cubin";
            int sm = 0, tk = 0;
            r = parse_cubin(img, m, &sm, &tk);
            if (!r && sm != sm_major * 10 + sm_minor) r = E_NO_BINARY_FOR_GPU;
            if (!r && tk > driver_version / 1000) r = E_NO_BINARY_FOR_GPU; /* a newer toolkit's ABI */
        } else {
            kind = "ptx";
            r = parse_ptx(image, m);
        }
        if (r) {
            free(m->fns);
            free(m);
            m = NULL;
        } else {
            *out = keep(m);
        }
    }
    r = logged(r, "cuModuleLoadData", "%s", kind);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuModuleUnload(void *hm)
{
    pthread_mutex_lock(&mu);
    fc_mod *m = hm;
    CUresult r = need_ctx("cuModuleUnload");
    if (!r && !m) r = E_INVALID_HANDLE;
    if (!r) r = capture_refuses("cuModuleUnload");
    if (!r) r = same_ctx("cuModuleUnload", "the module", m->ctx, m->gen, m->live);
    if (!r) m->live = 0; /* kept: its functions' later uses are reported */
    r = logged(r, "cuModuleUnload", NULL);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuModuleGetFunction(void **out, void *hm, const char *name)
{
    pthread_mutex_lock(&mu);
    fc_mod *m = hm;
    CUresult r = need_ctx("cuModuleGetFunction");
    if (!r && !m) r = E_INVALID_HANDLE;
    if (!r) r = same_ctx("cuModuleGetFunction", "the module", m->ctx, m->gen, m->live);
    if (!r) {
        r = E_NOT_FOUND;
        for (int i = 0; i < m->n_fns; i++)
            if (!strcmp(m->fns[i].name, name)) *out = &m->fns[i], r = OK;
    }
    r = logged(r, "cuModuleGetFunction", "%s", name);
    pthread_mutex_unlock(&mu);
    return r;
}

static CUresult func_ok(const char *call, fc_func *f)
{
    CUresult r = need_ctx(call);
    if (!r && !f) r = E_INVALID_HANDLE;
    if (!r) r = same_ctx(call, "the function's module", f->mod->ctx, f->mod->gen, f->mod->live);
    return r;
}

API CUresult cuFuncGetAttribute(int *v, int attr, void *hf)
{
    pthread_mutex_lock(&mu);
    fc_func *f = hf;
    CUresult r = func_ok("cuFuncGetAttribute", f);
    /* NUM_REGS, MAX_DYNAMIC_SHARED_SIZE_BYTES, MAX_THREADS_PER_BLOCK */
    if (!r) *v = attr == 4 ? 96 : attr == 8 ? f->max_dyn : attr == 0 ? 1024 : 0;
    r = logged(r, "cuFuncGetAttribute", "%d", attr);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuFuncSetAttribute(void *hf, int attr, int v)
{
    pthread_mutex_lock(&mu);
    fc_func *f = hf;
    CUresult r = func_ok("cuFuncSetAttribute", f);
    if (!r && attr == 8) {
        if (v < 0 || v > (sm_major >= 9 ? 232448 : 166912))
            r = E_INVALID_VALUE;
        else
            f->max_dyn = v;
    }
    r = logged(r, "cuFuncSetAttribute", "%s %d %d", f ? f->name : "?", attr, v);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, void *hf, int threads, size_t smem)
{
    pthread_mutex_lock(&mu);
    fc_func *f = hf;
    CUresult r = func_ok("cuOccupancyMaxActiveBlocksPerMultiprocessor", f);
    if (!r) {
        size_t per_sm = sm_major >= 9 ? 233472 : 167936;
        int by_smem = smem ? (int)(per_sm / (smem + 1024)) : 32, by_threads = threads > 0 ? 2048 / threads : 0;
        *blocks = by_smem < by_threads ? by_smem : by_threads;
    }
    r = logged(r, "cuOccupancyMaxActiveBlocksPerMultiprocessor", "%d %zu", threads, smem);
    pthread_mutex_unlock(&mu);
    return r;
}

static void *host_of(CUdeviceptr p, size_t n)
{
    fc_alloc *a = find_alloc(p, 0);
    return a && p + n <= a->addr + a->bytes ? a->mem + (p - a->addr) : NULL;
}

API CUresult cuLaunchKernel(void *hf, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned smem, void *hs, void **params, void **extra)
{
    pthread_mutex_lock(&mu);
    fc_func *f = hf;
    fc_stream *s = NULL;
    uint32_t seq = 0;
    CUresult r = func_ok("cuLaunchKernel", f);
    if (!r && (!gx || !gy || !gz || gy > 65535 || gz > 65535 || !bx || !by || !bz || bx * by * bz > 1024 ||
               (extra && params)))
        r = E_INVALID_VALUE;
    if (!r && smem > 48 * 1024 && (int)smem > f->max_dyn) {
        violation("cuLaunchKernel %s: %u bytes of dynamic shared memory without the opt-in "
                  "(cuFuncSetAttribute MAX_DYNAMIC_SHARED_SIZE_BYTES is %d)",
                  f->name, smem, f->max_dyn);
        r = E_INVALID_VALUE;
    }
    if (!r) r = stream_op("cuLaunchKernel", hs, &s, &seq);
    if (!r && params && f->param_size) {
        /* the pointers the parameter block holds: device ranges this launch may touch */
        const unsigned char *pb = params[0];
        for (size_t o = 0; o + 8 <= f->param_size; o += 8) {
            CUdeviceptr p;
            memcpy(&p, pb + o, 8);
            fc_alloc *a = p ? find_alloc(p, 0) : NULL;
            if (a && a->ctx == cur && !a->pinned) touch(a, p, p + 1, s, seq, f->name);
            if (!a && p >= 0x7d0000000000ull && p < next_addr && find_alloc(p, 1))
                violation("cuLaunchKernel %s: parameter at offset %zu is freed device memory 0x%llx", f->name, o, p);
            else if (a && (a->ctx != cur || a->gen != cur->gen))
                violation("cuLaunchKernel %s: parameter at offset %zu is device memory of another context", f->name, o);
        }
        if (!strcmp(f->name, "kvq_params_sig") && f->param_size >= sizeof(kvq_sig_params)) {
            /* The one kernel effect kvq reads back (cu_dev_check_params, at every module load): thread 0 writes
             * KVQ_PARAMS_SIG_LIST as the module's compilation of templates/kvq_params.cuh sees it. The fake has no
             * device compiler; it answers with this library's compilation of the same header, which is what
             * NVRTC gives for these fixed-width POD structs on a 64-bit host (CUDA keeps host and device layouts
             * alike), so a kvq built from the same tree passes and every engine of a pre-fill loads. A module
             * built from another tree's header is not caught here (the emulator and a real GPU catch it). */
            const long long sig[] = {KVQ_PARAMS_SIG_LIST, KVQ_MMA_PROBE}; /* and the tensor cores' probe: a GPU's */
            kvq_sig_params sp;
            memcpy(&sp, pb, sizeof sp);
            void *out = sp.out ? host_of(sp.out, sizeof sig) : NULL;
            if (out) memcpy(out, sig, sizeof sig);
        }
        if (launch_hook && !s->capture) {
            fakecuda_launch_hook h = launch_hook;
            pthread_mutex_unlock(&mu);
            h(f->name, pb, f->param_size, host_of);
            pthread_mutex_lock(&mu);
        }
    }
    r = logged(r, "cuLaunchKernel", "%s grid=%u,%u,%u block=%u smem=%u stream=%d", f ? f->name : "?", gx, gy, gz,
               bx, smem, s ? s->id : -1);
    pthread_mutex_unlock(&mu);
    return r;
}

API CUresult cuGetErrorString(CUresult r, const char **s)
{
    switch (r) {
    case OK: *s = "no error"; break;
    case E_INVALID_VALUE: *s = "invalid argument"; break;
    case E_OUT_OF_MEMORY: *s = "out of memory"; break;
    case E_NOT_INITIALIZED: *s = "initialization error"; break;
    case E_NO_BINARY_FOR_GPU: *s = "no kernel image is available for execution on the device"; break;
    case E_UNSUPPORTED_PTX_VERSION: *s = "the provided PTX was compiled with an unsupported toolchain."; break;
    case E_INVALID_CONTEXT: *s = "invalid device context"; break;
    case E_CONTEXT_IS_DESTROYED: *s = "context is destroyed"; break;
    case E_INVALID_HANDLE: *s = "invalid resource handle"; break;
    case E_NOT_FOUND: *s = "named symbol not found"; break;
    case E_CAPTURE_UNSUPPORTED: *s = "operation not permitted when stream is capturing"; break;
    case E_CAPTURE_ISOLATION: *s = "dependency created on uncaptured work in another stream"; break;
    case E_CAPTURED_EVENT: *s = "operation not permitted on an event last recorded in a capturing stream"; break;
    default: *s = NULL; return E_INVALID_VALUE;
    }
    return OK;
}

/* ---- the tests' side (fakecuda.h) ---- */
static void api_reset(void)
{
    pthread_mutex_lock(&mu);
    for (long i = 0; i < n_log; i++) free(logv[i]);
    for (int i = 0; i < n_viols; i++) free(viols[i]);
    n_log = 0, n_viols = 0, n_ncalls = 0;
    ctr_activations = ctr_resets = ctr_implicit = ctr_host_syncs = ctr_captures = 0;
    pthread_mutex_unlock(&mu);
}
static int api_n_violations(void)
{
    pthread_mutex_lock(&mu);
    int n = n_viols;
    pthread_mutex_unlock(&mu);
    return n;
}
static const char *api_violation(int i)
{
    pthread_mutex_lock(&mu);
    const char *s = i >= 0 && i < n_viols ? viols[i] : NULL;
    pthread_mutex_unlock(&mu);
    return s;
}
static long api_calls(const char *name)
{
    pthread_mutex_lock(&mu);
    long n = 0;
    for (int i = 0; i < n_ncalls; i++)
        if (!name || !strcmp(ncalls[i].name, name)) n += ncalls[i].n;
    pthread_mutex_unlock(&mu);
    return n;
}
static long api_counter(const char *name)
{
    pthread_mutex_lock(&mu);
    long n = -1;
    if (!strcmp(name, "ctx_activations")) n = ctr_activations;
    else if (!strcmp(name, "ctx_resets")) n = ctr_resets;
    else if (!strcmp(name, "implicit_syncs")) n = ctr_implicit;
    else if (!strcmp(name, "host_syncs")) n = ctr_host_syncs;
    else if (!strcmp(name, "captures")) n = ctr_captures;
    else if (!strcmp(name, "primary_refs")) n = primary[0].refs;
    else if (!strcmp(name, "live_allocs")) {
        n = 0;
        for (int i = 0; i < n_allocs; i++)
            n += allocs[i]->live && allocs[i]->ctx->active && allocs[i]->gen == allocs[i]->ctx->gen;
    } else if (!strcmp(name, "live_streams")) {
        n = 0;
        for (int i = 1; i < n_streams; i++)
            n += streams[i] && streams[i]->live && streams[i]->id != streams[i]->ctx->legacy &&
                 streams[i]->ctx->active && streams[i]->gen == streams[i]->ctx->gen;
    }
    pthread_mutex_unlock(&mu);
    return n;
}
static const char *api_log_line(long i)
{
    pthread_mutex_lock(&mu);
    const char *s = i >= 0 && i < n_log ? logv[i] : NULL;
    pthread_mutex_unlock(&mu);
    return s;
}
static void api_set_launch_hook(fakecuda_launch_hook h)
{
    pthread_mutex_lock(&mu);
    launch_hook = h;
    pthread_mutex_unlock(&mu);
}
static void api_set_driver_version(int v)
{
    pthread_mutex_lock(&mu);
    driver_version = v;
    pthread_mutex_unlock(&mu);
}

API void *fakecuda_get_api(void)
{
    static const fakecuda_api api = {api_reset,   api_n_violations,    api_violation,         api_calls,
                                     api_counter, api_log_line,        api_set_launch_hook, api_set_driver_version};
    return (void *)&api;
}
