/* A "device" the cuda and emu backends run the generated kernels on: a GPU through the driver API (libcuda,
 * loaded with dlopen), or the SIMT emulator (the same translation unit compiled by the host C++ compiler into a
 * shared object, cached like NVRTC's cubins). Device memory is addressed by 64-bit integers; on the emulator they
 * are host addresses. Modules come from generated/<scheme>/ when a build there matches the source hash, else
 * from the JIT. Internal to libkvq. */
#ifndef KVQ_CU_DEV_H
#define KVQ_CU_DEV_H

#include <stddef.h>
#include <stdint.h>

#include "cu.h"
#include "kvq.h"

typedef struct cu_dev cu_dev;
typedef struct cu_module cu_module;

typedef enum { CU_DEV_GPU = 0, CU_DEV_EMU = 1 } cu_dev_kind;

/* KVQ_ERR_UNAVAILABLE with the reason when the kind cannot run here (no driver, no GPU, no C++ compiler). */
kvq_status cu_dev_open(cu_dev_kind kind, cu_dev **out, char *msg, size_t msg_size);
void cu_dev_close(cu_dev *d);
cu_dev_kind cu_dev_kind_of(const cu_dev *d);
/* "sm_90", or "emu". */
const char *cu_dev_arch(const cu_dev *d);
int cu_dev_sm_count(const cu_dev *d);

/* Zero-filled device memory (cuMemAlloc + a memset on the device's stream). Not inside a decode step after
 * warm-up: the backends take pages and windows from their pool (cu_pool.c). */
kvq_status cu_dev_alloc(cu_dev *d, size_t bytes, uint64_t *addr, char *msg, size_t msg_size);
void cu_dev_free(cu_dev *d, uint64_t addr);
/* Page-locked host memory the device reads directly (TailorKV's offloaded K/V) and the staging of the async
 * copies: *host for the CPU, *addr for kernels. The device remembers these ranges: an async copy from or to any
 * other host memory is pageable (synchronous on a GPU, refused in capture). */
kvq_status cu_dev_alloc_host(cu_dev *d, size_t bytes, void **host, uint64_t *addr, char *msg, size_t msg_size);
void cu_dev_free_host(cu_dev *d, void *host);
/* Synchronous copies: queued on the device's stream, then the stream is synchronised (so they see, and are seen
 * by, every launch before and after them). Outside decode steps only (read_cache, prefill's inputs, load). */
kvq_status cu_dev_h2d(cu_dev *d, uint64_t dst, const void *src, size_t n, char *msg, size_t msg_size);
kvq_status cu_dev_d2h(cu_dev *d, void *dst, uint64_t src, size_t n, char *msg, size_t msg_size);
/* cuMemsetD8Async on the device's stream (ordered with the launches; no synchronisation). */
kvq_status cu_dev_memset(cu_dev *d, uint64_t dst, int byte, size_t n, char *msg, size_t msg_size);

/* ---- the stream (docs/cuda.md "The host protocol"): launches, async copies and memsets of a device are queued
 * on one stream in order, the device's own (created at open, non-blocking) or the caller's (a CUstream passed as
 * void *). Nothing waits for them until cu_dev_sync or a synchronous copy. ---- */
/* Binds the device to `stream` (NULL: back to the device's own). The caller keeps its stream alive. The two
 * streams are joined (ops->join): the new stream's work waits for the old one's, so a pool block zeroed on the
 * engine's stream is zeroed before a caller's stream writes it, and a block a caller's stream used is zeroed
 * only after that use; without a synchronisation. */
void cu_dev_set_stream(cu_dev *d, void *stream);
void *cu_dev_stream(const cu_dev *d);
/* cuMemcpyHtoDAsync / cuMemcpyDtoHAsync on the stream. The host side should be page-locked
 * (cu_dev_alloc_host): a pageable one makes the GPU copy synchronous, and it is counted as a synchronisation. */
kvq_status cu_dev_h2d_async(cu_dev *d, uint64_t dst, const void *src, size_t n, char *msg, size_t msg_size);
kvq_status cu_dev_d2h_async(cu_dev *d, void *dst, uint64_t src, size_t n, char *msg, size_t msg_size);
/* cuStreamSynchronize: the host waits for everything queued so far; a kernel's failure shows here. */
kvq_status cu_dev_sync(cu_dev *d, char *msg, size_t msg_size);
/* Events (cuEventCreate without timing, cuEventRecord on the stream, cuEventSynchronize): the host waits for the
 * stream's work up to the record only (a planned step's staging is written again only after the copy that read it
 * has run). Counted in event_waits; refused in capture mode like the other host waits. */
kvq_status cu_dev_event_create(cu_dev *d, void **ev, char *msg, size_t msg_size);
void cu_dev_event_destroy(cu_dev *d, void *ev);
kvq_status cu_dev_event_record(cu_dev *d, void *ev, char *msg, size_t msg_size);
kvq_status cu_dev_event_wait(cu_dev *d, void *ev, char *msg, size_t msg_size);
/* Whether [p, p + n) lies in one page-locked allocation of d. */
int cu_dev_is_pinned(const cu_dev *d, const void *p, size_t n);
/* Peak memory bandwidth from the device's memory clock and bus width, GB/s (0 when unknown, e.g. emulator). */
double cu_dev_peak_gbps(const cu_dev *d);

/* Loads the kernels of translation unit `src` (scheme name for generated/ lookup, may be NULL). */
kvq_status cu_dev_load(cu_dev *d, const char *src, const char *scheme, cu_module **out, char *msg, size_t msg_size);
void cu_module_free(cu_module *m);
/* Where the module came from: "generated", "cache", "jit", or "ptx" (the driver refused the cubin: older than
 * NVRTC; its PTX was JIT-compiled by the driver instead). */
const char *cu_module_origin(const cu_module *m);
/* generated/<scheme>/<arch>.cubin when generated/<scheme>/kernels.cu is the code of `src` (comments aside:
 * cu_source_same_code), else NULL (cu_generated.c). */
unsigned char *cu_generated_cubin(const char *src, const char *scheme, const char *arch, size_t *size);
/* 1 when generated/<scheme>/kernels.cu ($KVQ_GENERATED_DIR, else kvq_data_dir()) is the code of `src`. */
int cu_generated_matches(const char *src, const char *scheme);
/* 1 when C sources a and b are the same code: equal byte for byte once each comment is one space. */
int cu_source_same_code(const char *a, size_t na, const char *b, size_t nb);

/* Launches `kernel` of m with one parameter struct on the device's stream, asynchronously (cuLaunchKernel; no
 * synchronisation: a fault inside the kernel shows at the next cu_dev_sync or synchronous copy; on the emulator
 * the kernel has run when the call returns, so its faults show at once). The CUfunction is looked up once per
 * module and name and cached (cu_module's table), not per launch. A launch the device refuses (grid, block,
 * shared memory or registers beyond its limits) is KVQ_ERR_INTERNAL with the kernel, the limit and the value. */
kvq_status cu_dev_launch(cu_dev *d, cu_module *m, const char *kernel, const unsigned grid[3], const unsigned block[3],
                         const void *params, size_t param_size, char *msg, size_t msg_size);
/* The same with `smem` bytes of dynamic shared memory (cuLaunchKernel's sharedMemBytes): more than 48 KiB less
 * the kernel's static shared memory needs cu_dev_func_max_dyn_smem first. */
kvq_status cu_dev_launch_smem(cu_dev *d, cu_module *m, const char *kernel, const unsigned grid[3],
                              const unsigned block[3], unsigned smem, const void *params, size_t param_size, char *msg,
                              size_t msg_size);
/* cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes): refused when static + bytes exceeds
 * the device's opt-in maximum (sm_80 163 KiB, sm_90 227 KiB). */
kvq_status cu_dev_func_max_dyn_smem(cu_dev *d, cu_module *m, const char *kernel, unsigned bytes, char *msg,
                                    size_t msg_size);

/* The device's context is current on one thread at a time per thread, as the CUDA driver's is: every entry point
 * of the backends (which any thread may call), engine preparation included, brackets its device calls with
 * cu_dev_enter / cu_dev_leave, which make it current on the calling thread and then put back the thread's
 * previous context (on a GPU, cu_dev_open too leaves the thread's current context as it found it). A device call on a thread where the context is not current fails as the
 * driver's do (CUDA_ERROR_INVALID_CONTEXT); the emulated device models this too. */
typedef struct {
    void *prev;
    int changed;
} cu_ctx_scope;
void cu_dev_enter(cu_dev *d, cu_ctx_scope *s);
void cu_dev_leave(cu_dev *d, const cu_ctx_scope *s);

/* Blocks of `kernel` (threads per block, smem bytes of dynamic shared memory) one SM holds at once: the
 * occupancy API on a GPU; on the emulator, sm_90's limits (2048 threads, 227 KiB, 32 blocks). 0 when unknown. */
int cu_dev_occupancy(cu_dev *d, cu_module *m, const char *kernel, int threads, size_t smem);
int cu_driver_occupancy(cu_module *m, const char *kernel, int threads, size_t smem);
/* The emulator's answer: the GPU's rule (plan_ctas_per_sm) for the emulated arch, with ptxas's registers and static
 * shared memory where the module has them (not under $KVQ_EMU_RESOURCES=0 or without NVRTC: then shared memory
 * and threads alone). */
int cu_emu_occupancy(cu_module *m, const char *kernel, int threads, size_t smem);

/* Test hook: after cu_dev_fail_after(n), the n-th following device call (allocation, copy, memset or launch;
 * 1-based) fails with KVQ_ERR_INTERNAL without doing anything, once; 0 disarms it. cu_dev_failures() counts the
 * failures injected so far. Like kvq_alloc_fail_after, process-wide. */
void cu_dev_fail_after(long n);
long cu_dev_failures(void);

/* Checks the parameter-struct layout of the module against this compilation's (kvq_params_sig), and, need_mma
 * (a plan with tensor-core classes), that the tensor cores take fp16 subnormal inputs (KVQ_MMA_PROBE; else
 * KVQ_ERR_UNSUPPORTED with the reason). */
kvq_status cu_dev_check_params(cu_dev *d, cu_module *m, int need_mma, char *msg, size_t msg_size);

/* ---- implementations (cu_driver.c, cu_emu.c) behind cu_dev ---- */
typedef struct {
    kvq_status (*alloc)(cu_dev *, size_t, uint64_t *, char *, size_t);
    void (*free)(cu_dev *, uint64_t);
    kvq_status (*alloc_host)(cu_dev *, size_t, void **, uint64_t *, char *, size_t);
    void (*free_host)(cu_dev *, void *);
    kvq_status (*memset)(cu_dev *, uint64_t, int, size_t, char *, size_t); /* async, on the stream */
    kvq_status (*h2d_async)(cu_dev *, uint64_t, const void *, size_t, char *, size_t);
    kvq_status (*d2h_async)(cu_dev *, void *, uint64_t, size_t, char *, size_t);
    kvq_status (*sync)(cu_dev *, char *, size_t);
    kvq_status (*event_create)(cu_dev *, void **, char *, size_t);
    void (*event_destroy)(cu_dev *, void *);
    kvq_status (*event_record)(cu_dev *, void *, char *, size_t); /* on the stream */
    kvq_status (*event_wait)(cu_dev *, void *, char *, size_t);
    kvq_status (*load)(cu_dev *, const char *, const char *, cu_module **, char *, size_t);
    void (*module_free)(cu_module *);
    kvq_status (*launch)(cu_dev *, cu_module *, const char *, const unsigned[3], const unsigned[3], unsigned,
                         const void *, size_t, char *, size_t);
    kvq_status (*max_dyn_smem)(cu_dev *, cu_module *, const char *, unsigned, char *, size_t);
    void (*enter)(cu_dev *, cu_ctx_scope *);
    void (*leave)(cu_dev *, const cu_ctx_scope *);
    void (*close)(cu_dev *);
    /* Orders stream `to`'s later work after `from`'s work so far (an event recorded on from, waited for by to);
     * NULL where streams need no joining (the emulator runs everything at once). */
    void (*join)(cu_dev *, void *from, void *to);
} cu_dev_ops;
/* The front (cu_dev.c) does the rest: synchronous copies are async copies + sync, and the counters and the
 * capture checks (cu_counters.h) are kept there, for both implementations. */

struct cu_dev {
    const cu_dev_ops *ops;
    cu_dev_kind kind;
    char arch[16];
    int sm_count;
    double peak_gbps;
    void *stream;     /* the stream work goes on (NULL on the emulator's own) */
    void *own_stream; /* the device's own stream */
    struct cu_pinned {
        const void *host;
        size_t bytes;
    } *pinned; /* page-locked ranges (cu_dev_alloc_host) */
    int n_pinned, cap_pinned;
    void *impl;
};

struct cu_module {
    cu_dev *dev;
    char origin[16];
    void *impl;
};

kvq_status cu_driver_open(cu_dev *d, char *msg, size_t msg_size);
kvq_status cu_emu_open(cu_dev *d, char *msg, size_t msg_size);

#endif
