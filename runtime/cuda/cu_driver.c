/* The GPU device: the CUDA driver API through dlopen("libcuda.so.1") with the few declarations it needs (no
 * toolkit header), modules from generated/<scheme>/ when their source matches, else NVRTC for the device's sm.
 * Without a driver or a GPU, cu_driver_open answers KVQ_ERR_UNAVAILABLE with the reason. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "read_file.h"
#include "rt_internal.h"
#include "cu_dev.h"
#include "emit_cuda.h"

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef unsigned long long CUdeviceptr;

#define CU_ATTR_SM_COUNT 16
#define CU_ATTR_CC_MAJOR 75
#define CU_ATTR_CC_MINOR 76
#define CU_ATTR_MEM_CLOCK 36 /* kHz */
#define CU_ATTR_BUS_WIDTH 37 /* bits */
#define CU_FUNC_ATTR_SHARED_SIZE_BYTES 1
#define CU_FUNC_ATTR_NUM_REGS 4
#define CU_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES 8
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES 701
#define CU_HOSTALLOC_PORTABLE 1
#define CU_HOSTALLOC_DEVICEMAP 2

static struct {
    int loaded;
    CUresult (*init)(unsigned);
    CUresult (*dev_count)(int *);
    CUresult (*dev_get)(CUdevice *, int);
    CUresult (*dev_attr)(int *, int, CUdevice);
    CUresult (*ctx_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_release)(CUdevice);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*ctx_get)(CUcontext *);
    CUresult (*fn_attr_get)(int *, int, CUfunction);
    CUresult (*fn_attr_set)(CUfunction, int, int);
    CUresult (*mod_load)(CUmodule *, const void *);
    CUresult (*mod_fn)(CUfunction *, CUmodule, const char *);
    CUresult (*mod_unload)(CUmodule);
    CUresult (*occupancy)(int *, CUfunction, int, size_t);
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                       void **, void **);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*host_alloc)(void **, size_t, unsigned);
    CUresult (*host_dptr)(CUdeviceptr *, void *, unsigned);
    CUresult (*host_free)(void *);
    CUresult (*err_str)(CUresult, const char **);
    CUresult (*h2d_async)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*d2h_async)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*memset8_async)(CUdeviceptr, unsigned char, size_t, CUstream);
    CUresult (*stream_sync)(CUstream);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*ctx_device)(CUdevice *);
    CUresult (*event_create)(CUevent *, unsigned);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_sync)(CUevent);
    CUresult (*event_destroy)(CUevent);
    CUresult (*driver_version)(int *);
    CUresult (*ctx_state)(CUdevice, unsigned *, int *);
    CUresult (*stream_wait)(CUstream, CUevent, unsigned);
    CUresult (*stream_capturing)(CUstream, int *);
} cu;

typedef struct {
    CUdevice dev;
    CUcontext ctx;
    int borrowed; /* the caller's current context: not ours to release */
    CUevent join_ev; /* drv_join's */
} drv_dev;

/* The module's CUfunctions, looked up once per name (cuModuleGetFunction) and kept, not per launch. */
typedef struct {
    CUmodule mod;
    struct drv_fn {
        char name[64];
        CUfunction f;
    } *fns;
    int n_fns, cap_fns;
} drv_mod;

#define CU_STREAM_NON_BLOCKING 1
#define CU_EVENT_DISABLE_TIMING 2

static CUresult drv_function(drv_mod *dm, const char *kernel, CUfunction *out)
{
    for (int i = 0; i < dm->n_fns; i++)
        if (!strcmp(dm->fns[i].name, kernel)) {
            *out = dm->fns[i].f;
            return 0;
        }
    CUresult r = cu.mod_fn(out, dm->mod, kernel);
    if (r) return r;
    if (dm->n_fns == dm->cap_fns) {
        int cap = dm->cap_fns ? 2 * dm->cap_fns : 32;
        struct drv_fn *nf = kvq_realloc(dm->fns, (size_t)cap * sizeof *nf);
        if (!nf) return 0; /* not cached: looked up again next time */
        dm->fns = nf, dm->cap_fns = cap;
    }
    if (strlen(kernel) < sizeof dm->fns[0].name) {
        snprintf(dm->fns[dm->n_fns].name, sizeof dm->fns[0].name, "%s", kernel);
        dm->fns[dm->n_fns++].f = *out;
    }
    return 0;
}

static const char *err_text(CUresult r)
{
    const char *s = NULL;
    if (cu.err_str) cu.err_str(r, &s);
    return s ? s : "unknown CUDA error";
}

/* "CUDA 12.4" from cuDriverGetVersion (1000 * major + 10 * minor): every driver error names it. */
static const char *driver_text(char *buf, size_t n)
{
    int v = 0;
    if (!cu.driver_version || cu.driver_version(&v) != 0 || v <= 0)
        snprintf(buf, n, "driver version unknown");
    else
        snprintf(buf, n, "driver CUDA %d.%d", v / 1000, v % 1000 / 10);
    return buf;
}

static kvq_status fail(CUresult r, const char *what, char *msg, size_t n)
{
    char dv[48];
    snprintf(msg, n, "cuda: %s: %s (%d) [%s]", what, err_text(r), r, driver_text(dv, sizeof dv));
    return r == 2 ? KVQ_ERR_NOMEM : KVQ_ERR_INTERNAL; /* 2: CUDA_ERROR_OUT_OF_MEMORY */
}

#define CUDA_ERROR_INVALID_PTX 218
#define CUDA_ERROR_NO_BINARY_FOR_GPU 209
#define CUDA_ERROR_UNSUPPORTED_PTX_VERSION 222

/* The newest PTX ISA (10 * major + minor) a driver JIT-compiles, by its version (the PTX ISA release notes). */
static int driver_ptx_isa(int version)
{
    static const int map[][2] = {{13000, 90}, {12090, 88}, {12080, 87}, {12050, 85}, {12040, 84}, {12030, 83},
                                 {12020, 82}, {12010, 81}, {12000, 80}, {11080, 78}, {11070, 77}, {11060, 76},
                                 {11050, 75}, {11040, 74}, {11030, 73}, {11020, 72}, {11010, 71}, {11000, 70}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (version >= map[i][0]) return map[i][1];
    return 0;
}

/* The oldest PTX ISA that has the target (sm_80: 7.0, sm_86: 7.1, sm_89 and sm_90: 7.8, sm_100: 8.6, sm_120: 8.7). */
static int target_min_isa(const char *arch)
{
    int sm = atoi(arch + 3);
    return sm >= 120 ? 87 : sm >= 100 ? 86 : sm >= 89 ? 78 : sm >= 86 ? 71 : 70;
}

/* When the driver refuses the cubin (NVRTC newer than the driver: CUDA_ERROR_NO_BINARY_FOR_GPU, or an ISA it
 * does not know), the module from the PTX instead, its ".version" lowered to the newest ISA the driver knows when
 * NVRTC's is newer (the generated kernels use nothing past the target's first ISA; the driver's JIT checks).
 * A driver too old for the target's ISA, or a PTX the driver refuses too, is an error that names both. */
static CUresult load_ptx(cu_dev *d, const char *ptx, CUresult cubin_err, CUmodule *mod, char *msg, size_t n)
{
    int ver = 0;
    if (cu.driver_version(&ver) != 0) ver = 0;
    const char *vl = ptx ? strstr(ptx, ".version ") : NULL;
    int isa = vl ? atoi(vl + 9) * 10 + (strchr(vl + 9, '.') ? atoi(strchr(vl + 9, '.') + 1) : 0) : 0;
    int have = driver_ptx_isa(ver), need = target_min_isa(d->arch);
    char dv[48];
    driver_text(dv, sizeof dv);
    if (!vl || have < need) {
        snprintf(msg, n,
                 "cuda: cuModuleLoadData: the %s cubin from NVRTC %s was refused: %s (%d); the %s (newest PTX ISA "
                 "%d.%d) cannot run %s code (PTX ISA %d.%d or newer): update the driver to CUDA %s or newer",
                 d->arch, cu_nvrtc_version(), err_text(cubin_err), cubin_err, dv, have / 10, have % 10, d->arch,
                 need / 10, need % 10, cu_nvrtc_version());
        return cubin_err;
    }
    char *text = kvq_malloc(strlen(ptx) + 1);
    if (!text) return 2;
    strcpy(text, ptx);
    if (isa > have) { /* ".version 9.0" -> ".version 8.4": same length for one-digit minors */
        char *v = text + (vl - ptx) + 9;
        char buf[16];
        int len = (int)strcspn(v, " \t\r\n");
        int k = snprintf(buf, sizeof buf, "%d.%d", have / 10, have % 10);
        if (k == len) memcpy(v, buf, (size_t)k);
    }
    CUresult r = cu.mod_load(mod, text);
    kvq_free(text);
    if (r)
        snprintf(msg, n,
                 "cuda: cuModuleLoadData: the %s cubin from NVRTC %s was refused: %s (%d), and its PTX (ISA %d.%d%s) "
                 "too: %s (%d) [%s]: update the driver to CUDA %s or newer",
                 d->arch, cu_nvrtc_version(), err_text(cubin_err), cubin_err, isa / 10, isa % 10,
                 isa > have ? ", lowered to the driver's newest" : "", err_text(r), r, dv, cu_nvrtc_version());
    return r;
}

static kvq_status load_driver(char *msg, size_t n)
{
    if (cu.loaded) return KVQ_OK;
    /* KVQ_LIBCUDA names the driver library explicitly (the tests' recording fake, tests/fakecuda) */
    const char *lib = getenv("KVQ_LIBCUDA");
    void *h = NULL;
    if (lib && *lib) {
        if (!(h = dlopen(lib, RTLD_NOW | RTLD_LOCAL))) {
            snprintf(msg, n, "cuda: unavailable: KVQ_LIBCUDA=%s cannot be loaded: %s", lib, dlerror());
            return KVQ_ERR_UNAVAILABLE;
        }
    } else {
        h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!h) h = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    }
    if (!h) {
        snprintf(msg, n, "cuda: unavailable: no CUDA driver (libcuda.so.1 not found)");
        return KVQ_ERR_UNAVAILABLE;
    }
    struct {
        void *slot;
        const char *name;
    } syms[] = {
        {&cu.init, "cuInit"},
        {&cu.dev_count, "cuDeviceGetCount"},
        {&cu.dev_get, "cuDeviceGet"},
        {&cu.dev_attr, "cuDeviceGetAttribute"},
        {&cu.ctx_retain, "cuDevicePrimaryCtxRetain"},
        {&cu.ctx_release, "cuDevicePrimaryCtxRelease_v2"},
        {&cu.ctx_set, "cuCtxSetCurrent"},
        {&cu.ctx_get, "cuCtxGetCurrent"},
        {&cu.fn_attr_get, "cuFuncGetAttribute"},
        {&cu.fn_attr_set, "cuFuncSetAttribute"},
        {&cu.mod_load, "cuModuleLoadData"},
        {&cu.mod_fn, "cuModuleGetFunction"},
        {&cu.mod_unload, "cuModuleUnload"},
        {&cu.occupancy, "cuOccupancyMaxActiveBlocksPerMultiprocessor"},
        {&cu.launch, "cuLaunchKernel"},
        {&cu.mem_alloc, "cuMemAlloc_v2"},
        {&cu.mem_free, "cuMemFree_v2"},
        {&cu.host_alloc, "cuMemHostAlloc"},
        {&cu.host_dptr, "cuMemHostGetDevicePointer_v2"},
        {&cu.host_free, "cuMemFreeHost"},
        {&cu.err_str, "cuGetErrorString"},
        {&cu.h2d_async, "cuMemcpyHtoDAsync_v2"},
        {&cu.d2h_async, "cuMemcpyDtoHAsync_v2"},
        {&cu.memset8_async, "cuMemsetD8Async"},
        {&cu.stream_sync, "cuStreamSynchronize"},
        {&cu.stream_create, "cuStreamCreate"},
        {&cu.stream_destroy, "cuStreamDestroy_v2"},
        {&cu.ctx_device, "cuCtxGetDevice"},
        {&cu.event_create, "cuEventCreate"},
        {&cu.event_record, "cuEventRecord"},
        {&cu.event_sync, "cuEventSynchronize"},
        {&cu.event_destroy, "cuEventDestroy_v2"},
        {&cu.driver_version, "cuDriverGetVersion"},
        {&cu.ctx_state, "cuDevicePrimaryCtxGetState"},
        {&cu.stream_wait, "cuStreamWaitEvent"},
        {&cu.stream_capturing, "cuStreamIsCapturing"},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *f = dlsym(h, syms[i].name);
        if (!f) {
            snprintf(msg, n, "cuda: unavailable: libcuda lacks %s (driver too old)", syms[i].name);
            dlclose(h);
            return KVQ_ERR_UNAVAILABLE;
        }
        memcpy(syms[i].slot, &f, sizeof f);
    }
    cu.loaded = 1;
    return KVQ_OK;
}

static kvq_status drv_alloc(cu_dev *d, size_t bytes, uint64_t *addr, char *msg, size_t n)
{
    CUdeviceptr p = 0;
    CUresult r = cu.mem_alloc(&p, bytes);
    if (r) return fail(r, "cuMemAlloc", msg, n);
    r = cu.memset8_async(p, 0, bytes, (CUstream)d->stream); /* ordered before the stream's uses of it */
    if (r) {
        cu.mem_free(p);
        return fail(r, "cuMemsetD8Async", msg, n);
    }
    *addr = p;
    return KVQ_OK;
}

static void drv_free(cu_dev *d, uint64_t addr)
{
    (void)d;
    cu.mem_free(addr);
}

static kvq_status drv_alloc_host(cu_dev *d, size_t bytes, void **host, uint64_t *addr, char *msg, size_t n)
{
    (void)d;
    CUresult r = cu.host_alloc(host, bytes, CU_HOSTALLOC_PORTABLE | CU_HOSTALLOC_DEVICEMAP);
    if (r) return fail(r, "cuMemHostAlloc", msg, n);
    memset(*host, 0, bytes);
    CUdeviceptr p = 0;
    r = cu.host_dptr(&p, *host, 0);
    if (r) {
        cu.host_free(*host);
        *host = NULL;
        return fail(r, "cuMemHostGetDevicePointer", msg, n);
    }
    *addr = p;
    return KVQ_OK;
}

static void drv_free_host(cu_dev *d, void *host)
{
    (void)d;
    cu.host_free(host);
}

/* Copies and memsets on the device's stream (asynchronous; the front adds cuStreamSynchronize where a copy
 * must be synchronous). */
static kvq_status drv_h2d_async(cu_dev *d, uint64_t dst, const void *src, size_t n, char *msg, size_t ms)
{
    CUresult r = cu.h2d_async(dst, src, n, (CUstream)d->stream);
    return r ? fail(r, "cuMemcpyHtoDAsync", msg, ms) : KVQ_OK;
}

static kvq_status drv_d2h_async(cu_dev *d, void *dst, uint64_t src, size_t n, char *msg, size_t ms)
{
    CUresult r = cu.d2h_async(dst, src, n, (CUstream)d->stream);
    return r ? fail(r, "cuMemcpyDtoHAsync", msg, ms) : KVQ_OK;
}

static kvq_status drv_memset(cu_dev *d, uint64_t dst, int byte, size_t n, char *msg, size_t ms)
{
    CUresult r = cu.memset8_async(dst, (unsigned char)byte, n, (CUstream)d->stream);
    return r ? fail(r, "cuMemsetD8Async", msg, ms) : KVQ_OK;
}

/* Events without timing (cuEventCreate(CU_EVENT_DISABLE_TIMING)): recorded on the stream, waited for by the host. */
static kvq_status drv_event_create(cu_dev *d, void **ev, char *msg, size_t ms)
{
    (void)d;
    CUevent e = NULL;
    CUresult r = cu.event_create(&e, CU_EVENT_DISABLE_TIMING);
    if (r) return fail(r, "cuEventCreate", msg, ms);
    *ev = e;
    return KVQ_OK;
}
static void drv_event_destroy(cu_dev *d, void *ev)
{
    (void)d;
    cu.event_destroy((CUevent)ev);
}
static kvq_status drv_event_record(cu_dev *d, void *ev, char *msg, size_t ms)
{
    CUresult r = cu.event_record((CUevent)ev, (CUstream)d->stream);
    return r ? fail(r, "cuEventRecord", msg, ms) : KVQ_OK;
}
static kvq_status drv_event_wait(cu_dev *d, void *ev, char *msg, size_t ms)
{
    (void)d;
    CUresult r = cu.event_sync((CUevent)ev);
    return r ? fail(r, "cuEventSynchronize", msg, ms) : KVQ_OK;
}

static kvq_status drv_sync(cu_dev *d, char *msg, size_t ms)
{
    CUresult r = cu.stream_sync((CUstream)d->stream);
    return r ? fail(r, "cuStreamSynchronize (a kernel or copy queued before it failed)", msg, ms) : KVQ_OK;
}

static kvq_status drv_load(cu_dev *d, const char *src, const char *scheme, cu_module **out, char *msg, size_t n)
{
    *out = NULL;
    size_t size = 0;
    const char *origin = "generated";
    unsigned char *cubin = cu_generated_cubin(src, scheme, d->arch, &size);
    cu_compiled c;
    memset(&c, 0, sizeof c);
    if (!cubin) {
        kvq_status st = cu_nvrtc_compile(src, d->arch, 1, &c, NULL, msg, n);
        if (st != KVQ_OK) return st;
        origin = c.from_cache ? "cache" : "jit";
    }
    CUmodule mod;
    CUresult r = cu.mod_load(&mod, cubin ? cubin : c.cubin);
    kvq_free(cubin);
    if (r == CUDA_ERROR_NO_BINARY_FOR_GPU || r == CUDA_ERROR_UNSUPPORTED_PTX_VERSION || r == CUDA_ERROR_INVALID_PTX) {
        /* the PTX of the same source (generated/ has cubins only: NVRTC's, through the cache) */
        if (!c.ptx) {
            kvq_status st = cu_nvrtc_compile(src, d->arch, 1, &c, NULL, msg, n);
            if (st != KVQ_OK) return st;
        }
        CUresult r2 = load_ptx(d, c.ptx, r, &mod, msg, n);
        cu_compiled_free(&c);
        if (r2) return r2 == 2 ? KVQ_ERR_NOMEM : KVQ_ERR_INTERNAL;
        origin = "ptx";
        r = 0;
    }
    cu_compiled_free(&c);
    if (r) return fail(r, "cuModuleLoadData", msg, n);
    cu_module *m = kvq_calloc(1, sizeof *m);
    drv_mod *dm = kvq_calloc(1, sizeof *dm);
    if (!m || !dm) {
        kvq_free(m);
        kvq_free(dm);
        cu.mod_unload(mod);
        return KVQ_ERR_NOMEM;
    }
    dm->mod = mod;
    m->dev = d;
    m->impl = dm;
    snprintf(m->origin, sizeof m->origin, "%s", origin);
    *out = m;
    return KVQ_OK;
}

static void drv_module_free(cu_module *m)
{
    drv_mod *dm = m->impl;
    cu.mod_unload(dm->mod);
    kvq_free(dm->fns);
    kvq_free(dm);
    kvq_free(m);
}

static kvq_status drv_launch(cu_dev *d, cu_module *m, const char *kernel, const unsigned grid[3],
                             const unsigned block[3], unsigned smem, const void *params, size_t size, char *msg,
                             size_t n)
{
    (void)size;
    drv_mod *dm = m->impl;
    CUfunction f;
    CUresult r = drv_function(dm, kernel, &f);
    if (r) return fail(r, kernel, msg, n);
    /* kernelParams: the driver copies the struct at the call, so `params` may change after it returns */
    void *args[1] = {(void *)params};
    r = cu.launch(f, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, (CUstream)d->stream, args, NULL);
    if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES) {
        /* a launch beyond the device's limits: say what was asked of which kernel */
        int regs = -1, sstat = -1, maxdyn = -1;
        cu.fn_attr_get(&regs, CU_FUNC_ATTR_NUM_REGS, f);
        cu.fn_attr_get(&sstat, CU_FUNC_ATTR_SHARED_SIZE_BYTES, f);
        cu.fn_attr_get(&maxdyn, CU_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES, f);
        snprintf(msg, n,
                 "cuda: launch of %s refused: %s (%d): grid (%u,%u,%u), block (%u,%u,%u), %u bytes of dynamic shared "
                 "memory; the kernel has %d registers a thread, %d bytes of static shared memory, a dynamic maximum of %d",
                 kernel, err_text(r), r, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, regs, sstat,
                 maxdyn);
        return KVQ_ERR_INTERNAL;
    }
    if (r) {
        char what[128];
        snprintf(what, sizeof what, "launch of %s", kernel);
        return fail(r, what, msg, n);
    }
    return KVQ_OK;
}

static kvq_status drv_max_dyn_smem(cu_dev *d, cu_module *m, const char *kernel, unsigned bytes, char *msg, size_t n)
{
    (void)d;
    drv_mod *dm = m->impl;
    CUfunction f;
    CUresult r = drv_function(dm, kernel, &f);
    if (!r) r = cu.fn_attr_set(f, CU_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)bytes);
    if (r) {
        char what[160];
        snprintf(what, sizeof what, "cuFuncSetAttribute(%s, MAX_DYNAMIC_SHARED_SIZE_BYTES, %u)", kernel, bytes);
        return fail(r, what, msg, n);
    }
    return KVQ_OK;
}

/* The calling thread's current context becomes this device's for the duration of an entry point. */
static void drv_enter(cu_dev *d, cu_ctx_scope *s)
{
    drv_dev *dd = d->impl;
    CUcontext prev = NULL;
    if (cu.ctx_get(&prev) != 0) prev = NULL;
    s->prev = prev;
    s->changed = prev != dd->ctx && cu.ctx_set(dd->ctx) == 0;
}

static void drv_leave(cu_dev *d, const cu_ctx_scope *s)
{
    (void)d;
    cu.ctx_set((CUcontext)s->prev);
}

int cu_driver_occupancy(cu_module *m, const char *kernel, int threads, size_t smem)
{
    drv_mod *dm = m->impl;
    CUfunction f;
    int blocks = 0;
    if (drv_function(dm, kernel, &f)) return 0;
    if (smem > 48 * 1024 && cu.fn_attr_set(f, CU_FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)smem)) return 0;
    if (cu.occupancy(&blocks, f, threads, smem)) return 0;
    return blocks;
}

static void drv_close(cu_dev *d)
{
    drv_dev *dd = d->impl;
    cu_ctx_scope cs;
    drv_enter(d, &cs);
    if (d->own_stream) {
        cu.stream_sync((CUstream)d->own_stream);
        cu.stream_destroy((CUstream)d->own_stream);
    }
    if (dd->join_ev) cu.event_destroy(dd->join_ev);
    drv_leave(d, &cs);
    if (!dd->borrowed) cu.ctx_release(dd->dev);
    /* the thread must not keep a context whose last reference is gone (it was reset: every call on it fails) */
    CUcontext now = NULL;
    unsigned flags = 0;
    int active = 1;
    if (!dd->borrowed && cu.ctx_get(&now) == 0 && now == dd->ctx && cu.ctx_state(dd->dev, &flags, &active) == 0 &&
        !active)
        cu.ctx_set(NULL);
    kvq_free(dd);
}

#define CU_EVENT_WAIT_EXTERNAL 1
/* Stream `to` waits for `from`'s work so far (cu_dev_set_stream). Stream capture allows no dependency across
 * its boundary: into a capturing stream the wait is an external event node (the graph waits for the event's
 * latest record when it is launched); out of a capturing stream there is none (it would pull the engine's
 * stream into the capture): the caller orders a captured graph's launches before the engine's next use of
 * the memory they touch (docs/cuda.md "Streams"). If the event cannot be used, the host waits instead. */
static void drv_join(cu_dev *d, void *from, void *to)
{
    drv_dev *dd = d->impl;
    int cap_from = 0, cap_to = 0;
    if (cu.stream_capturing((CUstream)from, &cap_from)) cap_from = 0;
    if (cu.stream_capturing((CUstream)to, &cap_to)) cap_to = 0;
    if (cap_from) return;
    if (dd->join_ev && cu.event_record(dd->join_ev, (CUstream)from) == 0 &&
        cu.stream_wait((CUstream)to, dd->join_ev, cap_to ? CU_EVENT_WAIT_EXTERNAL : 0) == 0)
        return;
    cu.stream_sync((CUstream)from);
}

static const cu_dev_ops drv_ops = {
    .alloc = drv_alloc,
    .free = drv_free,
    .alloc_host = drv_alloc_host,
    .free_host = drv_free_host,
    .memset = drv_memset,
    .h2d_async = drv_h2d_async,
    .d2h_async = drv_d2h_async,
    .sync = drv_sync,
    .event_create = drv_event_create,
    .event_destroy = drv_event_destroy,
    .event_record = drv_event_record,
    .event_wait = drv_event_wait,
    .load = drv_load,
    .module_free = drv_module_free,
    .launch = drv_launch,
    .max_dyn_smem = drv_max_dyn_smem,
    .enter = drv_enter,
    .leave = drv_leave,
    .close = drv_close,
    .join = drv_join,
};

/* The process's own reference to a device's primary context, taken with the first engine (or probe) on it and
 * kept: an engine's open and close retain and release theirs, so without it the backend's probe (open, close)
 * would create and reset the context just before the engine creates it again, and every engine freed last
 * would reset it (cudart's own reference behaves the same way: it is never released). */
#define DRV_MAX_DEVICES 64
static int process_ref[DRV_MAX_DEVICES];

/* The context an engine opened on this thread runs in, and its reference: the caller's current context when
 * there is one (an inference engine's: its device pointers and streams belong to it), else the primary context
 * of device `ord`. A current primary context is retained like any other use of it (it is the caller's only while
 * the caller holds its own reference); only a context the caller created (cuCtxCreate) is borrowed, and the
 * caller keeps it alive while the engine lives. */
static CUresult bind_context(drv_dev *dd, int ord, int use_current)
{
    CUcontext cur = NULL;
    CUresult r;
    if (use_current && cu.ctx_get(&cur) == 0 && cur && cu.ctx_device(&dd->dev) == 0) {
        CUcontext prim = NULL;
        if ((r = cu.ctx_retain(&prim, dd->dev))) return r;
        if (prim == cur) {
            dd->ctx = prim;
        } else {
            cu.ctx_release(dd->dev);
            dd->ctx = cur, dd->borrowed = 1;
        }
    } else {
        if ((r = cu.dev_get(&dd->dev, ord)) || (r = cu.ctx_retain(&dd->ctx, dd->dev))) return r;
    }
    if (!dd->borrowed && dd->dev >= 0 && dd->dev < DRV_MAX_DEVICES && !process_ref[dd->dev]) {
        CUcontext again = NULL;
        if (cu.ctx_retain(&again, dd->dev) == 0) process_ref[dd->dev] = 1;
    }
    return 0;
}

kvq_status cu_driver_open(cu_dev *d, char *msg, size_t n)
{
    kvq_status st = load_driver(msg, n);
    if (st != KVQ_OK) return st;
    CUresult r = cu.init(0);
    if (r) {
        snprintf(msg, n, "cuda: unavailable: cuInit failed: %s (no GPU or driver not loaded)", err_text(r));
        return KVQ_ERR_UNAVAILABLE;
    }
    int count = 0;
    if (cu.dev_count(&count) || count == 0) {
        snprintf(msg, n, "cuda: unavailable: no CUDA device");
        return KVQ_ERR_UNAVAILABLE;
    }
    drv_dev *dd = kvq_calloc(1, sizeof *dd);
    if (!dd) return KVQ_ERR_NOMEM;
    int major = 0, minor = 0;
    const char *env = getenv("KVQ_CUDA_DEVICE");
    int ord = env && *env ? atoi(env) : 0;
    CUcontext prev = NULL;
    if (cu.ctx_get(&prev) != 0) prev = NULL;
    if ((r = bind_context(dd, ord, !(env && *env)))) {
        kvq_free(dd);
        snprintf(msg, n, "cuda: unavailable: device %d: %s", ord, err_text(r));
        return KVQ_ERR_UNAVAILABLE;
    }
    if ((r = cu.dev_attr(&major, CU_ATTR_CC_MAJOR, dd->dev)) || (r = cu.dev_attr(&minor, CU_ATTR_CC_MINOR, dd->dev)) ||
        (r = cu.dev_attr(&d->sm_count, CU_ATTR_SM_COUNT, dd->dev)) || (r = cu.ctx_set(dd->ctx))) {
        if (!dd->borrowed) cu.ctx_release(dd->dev);
        cu.ctx_set(prev);
        snprintf(msg, n, "cuda: unavailable: device %d: %s", (int)dd->dev, err_text(r));
        kvq_free(dd);
        return KVQ_ERR_UNAVAILABLE;
    }
    if (major < 8) {
        if (!dd->borrowed) cu.ctx_release(dd->dev);
        cu.ctx_set(prev);
        kvq_free(dd);
        snprintf(msg, n, "cuda: unavailable: device is sm_%d%d, the kernels need sm_80 or newer", major, minor);
        return KVQ_ERR_UNAVAILABLE;
    }
    snprintf(d->arch, sizeof d->arch, "sm_%d%d", major, minor);
    int clk = 0, bus = 0;
    if (!cu.dev_attr(&clk, CU_ATTR_MEM_CLOCK, dd->dev) && !cu.dev_attr(&bus, CU_ATTR_BUS_WIDTH, dd->dev))
        d->peak_gbps = 2.0 * clk * 1e3 * (bus / 8.0) / 1e9; /* double data rate */
    /* the engine's own stream, non-blocking: it does not wait for (or hold up) the legacy default stream of the
     * rest of the process; cu_dev_set_stream puts the caller's in its place */
    CUstream s = NULL;
    if ((r = cu.stream_create(&s, CU_STREAM_NON_BLOCKING))) {
        if (!dd->borrowed) cu.ctx_release(dd->dev);
        cu.ctx_set(prev);
        kvq_free(dd);
        snprintf(msg, n, "cuda: cuStreamCreate: %s", err_text(r));
        return KVQ_ERR_INTERNAL;
    }
    if ((r = cu.event_create(&dd->join_ev, CU_EVENT_DISABLE_TIMING))) dd->join_ev = NULL; /* drv_join syncs */
    /* the thread's context as it was: the backend brackets its device calls (cu_dev_enter / cu_dev_leave) */
    cu.ctx_set(prev);
    d->own_stream = d->stream = s;
    d->ops = &drv_ops;
    d->impl = dd;
    return KVQ_OK;
}
