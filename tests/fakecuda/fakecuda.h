/* The recording fake CUDA driver (tests/fakecuda/fakecuda.c, built as $(BUILD)/tests/fakecuda/libcuda.so.1):
 * the driver entry points runtime/cuda/cu_driver.c uses, which run no kernels, log every call and record each
 * breach of the driver API's documented rules as a violation (docs/testing.md "The fake CUDA driver").
 *
 * A test points the cuda backend at it with KVQ_LIBCUDA=<path> (cu_driver.c dlopens that path instead of
 * libcuda.so.1), then reads what it recorded through the fakecuda_* functions below, which fakecuda_api_open
 * looks up in the same library. Environment of the fake itself:
 *   FAKECUDA_ARCH=sm_80|sm_90|...  the device it reports (default sm_90: 132 SMs; sm_80: 108 SMs)
 *   FAKECUDA_DRIVER=13000          cuDriverGetVersion's answer (1000 * major + 10 * minor); the newest PTX ISA
 *                                  and cubin toolkit it loads follow from it
 *   FAKECUDA_LOG=<file>            every call appended to <file>, one line each
 *   FAKECUDA_VERBOSE=1             violations printed to stderr as they happen */
#ifndef KVQ_FAKECUDA_H
#define KVQ_FAKECUDA_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdlib.h>

/* A launch of `kernel`: params is the kernel's parameter block (its size from the cubin), host(dptr, bytes)
 * the fake's memory behind a device range (NULL when outside an allocation). The fake runs no kernel: a test
 * that needs a kernel's effect (kvq_params_sig's signature) models it here. */
typedef void (*fakecuda_launch_hook)(const char *kernel, const void *params, size_t size,
                                     void *(*host)(unsigned long long dptr, size_t bytes));

typedef struct {
    /* clears the log, the counters and the violations (not the driver's state) */
    void (*reset)(void);
    int (*n_violations)(void);
    const char *(*violation)(int i);
    /* calls of `name` ("cuMemFree_v2") since the last reset; NULL: every call */
    long (*calls)(const char *name);
    /* counters since the last reset: "ctx_activations" (a primary context made active from inactive),
     * "ctx_resets" (its last reference released), "implicit_syncs" (cuMemFree with work queued on a stream),
     * "host_syncs" (stream, event or context synchronisations), "captures" (ended captures); and the state
     * now: "live_allocs" (device and page-locked), "live_streams" (not the legacy ones), "primary_refs" */
    long (*counter)(const char *name);
    /* the i-th logged call since the reset ("cuLaunchKernel kvq_store_f16 stream=3 -> 0"), NULL past the end */
    const char *(*log_line)(long i);
    void (*set_launch_hook)(fakecuda_launch_hook hook);
    /* changes cuDriverGetVersion's answer now (as FAKECUDA_DRIVER at load) */
    void (*set_driver_version)(int version);
} fakecuda_api;

/* Opens the fake named by KVQ_LIBCUDA (the one the cuda backend loads: dlopen gives the same instance). */
static inline int fakecuda_api_open(fakecuda_api *api)
{
    const char *path = getenv("KVQ_LIBCUDA");
    void *h = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (!h) return 0;
    void *(*get)(void) = (void *(*)(void))dlsym(h, "fakecuda_get_api");
    const fakecuda_api *a = get ? (const fakecuda_api *)get() : NULL;
    if (!a) return 0;
    *api = *a;
    return 1;
}

#endif
