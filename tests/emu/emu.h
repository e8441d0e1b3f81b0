/* The SIMT emulator's launch API: runs a kernel compiled from CUDA C by the host compiler (against emu_cuda.h,
 * which kvq_intrin.cuh includes when __CUDACC__ is not defined) on the CPU, one fiber per GPU thread.
 *
 * A kernel source exports each entry point with KVQ_KERNEL_EXPORT(name) after its definition; under the emulator
 * that defines `const struct emu_kernel name__emu` with C linkage, which is what emu_launch takes (a program that
 * links the kernel object declares it with EMU_KERNEL_DECLARE(name); one that dlopens a kernel .so looks up
 * "name__emu" with dlsym).
 *
 * Launches never abort: misuse (bad configuration, divergent barriers, misused warp collectives, misaligned
 * cp.async, __trap) comes back as a status and a message naming the kernel, the block and the threads. Launches
 * are serialised by a process-wide lock: __shared__ variables are static storage, one instance at a time. */
#ifndef EMU_H
#define EMU_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What KVQ_KERNEL_EXPORT defines for each entry point. */
struct emu_kernel {
    const char *name;
    void (*entry)(const void *params); /* calls the kernel with *(const P *)params as its one argument */
    size_t param_size;                 /* sizeof(P); 0 for a kernel without parameters */
};

#define EMU_KERNEL_DECLARE(name) extern const struct emu_kernel name##__emu
#define EMU_KERNEL(name) (&name##__emu)

typedef struct {
    unsigned x, y, z;
} emu_dim3;

typedef enum {
    EMU_OK = 0,
    EMU_ERR_CONFIG = 1,  /* bad launch configuration: block or grid size, shared memory, parameter size */
    EMU_ERR_NOMEM = 2,   /* stacks or bookkeeping could not be allocated */
    EMU_ERR_BARRIER = 3, /* a barrier or warp collective that cannot complete: divergence, exited threads */
    EMU_ERR_WARP = 4,    /* a warp collective misused: caller not in its mask, lanes that disagree, bad width */
    EMU_ERR_ASYNC = 5,   /* a cp.async with a bad size or alignment */
    EMU_ERR_TRAP = 6,    /* the kernel called __trap() */
    EMU_ERR_RESOURCES = 7 /* the block needs more registers than an SM has (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES) */
} emu_status;

struct emu_stats {
    uint64_t blocks;            /* blocks run */
    uint64_t plain_blocks;      /* blocks that never reached a switch point and ran their threads plainly */
    uint64_t threads;           /* threads run */
    uint64_t barrier_crossings; /* thread-barrier crossings: threads released from __syncthreads */
    uint64_t warp_collectives;  /* lane participations in warp collectives */
    uint64_t switches;          /* fiber switches */
};

/* What the driver knows of a kernel beyond its code (cuFuncGetAttribute / cuFuncSetAttribute), from ptxas's
 * resource report: a launch is checked against them as the driver checks it. */
struct emu_func_attrs {
    unsigned regs;         /* registers per thread (0: unknown, not checked) */
    unsigned static_smem;  /* bytes of static __shared__ memory */
    unsigned max_dyn_smem; /* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (0: not set, 48 KiB - static) */
};

struct emu_options {
    /* 0: threads start and resume in thread order. Otherwise the seed of a shuffle of that order at the start of
     * each block and at every barrier (and of the block order), so that a shared-memory race gives results that
     * change with the seed. */
    uint64_t shuffle_seed;
    size_t stack_size;        /* per-thread fiber stack; 0 = 64 KiB (256 KiB under ASan) */
    struct emu_stats *stats;  /* when set, receives this launch's counts */
    /* The kernel's attributes; NULL: none set, resources unknown (dynamic shared memory up to 48 KiB, registers
     * and static shared memory not checked). */
    const struct emu_func_attrs *attrs;
    /* The device's shared memory per block with opt-in (EMU_SMEM_OPTIN_SM80 / _SM90); 0: sm_90's. */
    unsigned smem_optin;
};

struct emu_error {
    emu_status code;
    char msg[1024];
};

/* Runs `k` over grid x block threads with `dyn_smem` bytes of dynamic shared memory, passing a copy of the
 * param_size bytes at params (which must equal k->param_size). opt may be NULL. On failure returns the status
 * and, when err is set, fills it; the launch stops at the first failing block. Global memory the kernel wrote
 * before the failure stays written. */
emu_status emu_launch(const struct emu_kernel *k, emu_dim3 grid, emu_dim3 block, size_t dyn_smem, const void *params,
                      size_t param_size, const struct emu_options *opt, struct emu_error *err);

const char *emu_status_str(emu_status s);

/* Returns the cached stacks and bookkeeping to the system. The next launch allocates them again. */
void emu_release(void);

/* Limits the emulator enforces, those of sm_80 / sm_90 (docs/emulator.md, "Hardware limits"). */
#define EMU_MAX_THREADS 1024u
#define EMU_MAX_DYN_SMEM (227u * 1024u)       /* sm_90's opt-in maximum per block */
#define EMU_SMEM_OPTIN_SM80 (163u * 1024u)
#define EMU_SMEM_OPTIN_SM90 (227u * 1024u)
#define EMU_MAX_STATIC_SMEM (48u * 1024u)     /* ptxas refuses more static __shared__ memory */
#define EMU_DEFAULT_DYN_SMEM (48u * 1024u)    /* static + dynamic without the attribute */
#define EMU_REGS_PER_BLOCK 65536u
#define EMU_MAX_PARAM 32764u

#ifdef __cplusplus
}
#endif

#endif
