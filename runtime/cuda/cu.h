/* The CUDA side of the runtime (docs/cuda.md): libnvrtc and libcuda loaded with dlopen (no link-time
 * dependency), the NVRTC JIT with its on-disk cache (DESIGN §7), the emulator "device" that runs the same
 * generated kernels compiled by the host C++ compiler, and the launch helpers the cuda/emu backends share.
 * Everything returns a kvq_status with a message; nothing prints. Internal to libkvq: prefix cu_. */
#ifndef KVQ_CU_H
#define KVQ_CU_H

#include <stddef.h>
#include <stdint.h>

#include "jit_cache.h"
#include "kvq.h"

/* ---- NVRTC (cu_nvrtc.c) ---- */

/* Resources of one kernel as ptxas reports them (NVRTC -Xptxas -v). */
typedef struct {
    char name[64];
    char arch[16];
    int regs, stack, spill_stores, spill_loads, smem, lmem, barriers;
} cu_kernel_res;

typedef struct {
    unsigned char *cubin;
    size_t cubin_size;
    char *ptx; /* NUL-terminated */
    size_t ptx_size;
    char *log; /* NVRTC log: ptxas's resource lines */
    cu_kernel_res *res;
    int n_res;
    int from_cache;
} cu_compiled;

void cu_compiled_free(cu_compiled *c);

/* KVQ_OK when libnvrtc can be loaded (KVQ_NVRTC names it explicitly), else KVQ_ERR_UNAVAILABLE + reason. */
kvq_status cu_nvrtc_load(char *msg, size_t msg_size);
/* "13.0" (after a successful load). */
const char *cu_nvrtc_version(void);

/* Compiles `src` for `arch` ("sm_90") to a cubin plus PTX, through the JIT cache when use_cache (key: source,
 * options, NVRTC version, arch, kvq version). A failed compile returns KVQ_ERR_INTERNAL; *diag (when diag is
 * set) then receives an allocated text with the options, the NVRTC log and the numbered source, and the same
 * text is written to <cache>/failed-<key>.txt whose path msg names. */
kvq_status cu_nvrtc_compile(const char *src, const char *arch, int use_cache, cu_compiled *out, char **diag, char *msg,
                            size_t msg_size);

/* The same with NVRTC's --generate-line-info (SASS -> source lines for kvqc build's cost model; the code is the
 * same as without it). */
kvq_status cu_nvrtc_compile_lineinfo(const char *src, const char *arch, int use_cache, cu_compiled *out, char **diag,
                                     char *msg, size_t msg_size);

/* Parses ptxas -v lines ("Compiling entry function 'X' for 'sm_90'", "N bytes stack frame, ...", "Used N
 * registers, ... N bytes smem") into per-kernel figures. Returns the count, or -1 on allocation failure. */
int cu_parse_resources(const char *log, cu_kernel_res **out);

#endif
