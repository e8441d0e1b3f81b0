/* The JIT cache on disk (DESIGN §7): compiled kernels keyed by a hash of everything that determines them, shared
 * by the cuda backend (NVRTC cubins, runtime/cuda/cu_nvrtc.c) and the cpu backend (LLVM objects,
 * compiler/emit_llvm.c). */
#ifndef KVQ_JIT_CACHE_H
#define KVQ_JIT_CACHE_H

#include <stddef.h>

/* $KVQ_CACHE_DIR or ~/.cache/kvq, created if missing; "" when neither can be used (caching off). */
const char *kvq_cache_dir(void);
/* Entries are a header (magic, payload size, SHA-256 of the payload) and a payload of sections. A missing,
 * truncated or corrupt entry is a miss (the corrupt file is removed); writes go to a temporary file renamed into
 * place, so a reader never sees half an entry. */
typedef struct {
    const void *data;
    size_t size;
} kvq_cache_section;
/* Returns 1 and fills up to n sections (allocated copies; free with kvq_free) on a hit, 0 on a miss. */
int kvq_cache_get(const char *key, const char *ext, void **sections, size_t *sizes, int n);
/* Best effort: 0 written, -1 not (the cache is an optimisation). */
int kvq_cache_put(const char *key, const char *ext, const kvq_cache_section *sections, int n);
/* Path of an entry, for diagnostics. */
void kvq_cache_path(const char *key, const char *ext, char *out, size_t size);
/* An exclusive lock on `name` in the cache directory, between processes (flock on <dir>/<name>.lock): a process
 * about to compile an entry takes it, looks again, and compiles only if the entry is still missing, so that two
 * programs sharing a cold cache (make test's) do not compile the same unit at once. Returns a handle for
 * kvq_cache_unlock, or -1 when there is no cache or no lock (the caller compiles without one). The lock file is
 * removed when released; the lock dies with the process. */
int kvq_cache_lock(const char *name);
void kvq_cache_unlock(const char *name, int handle);
/* Runs a compile helper (argv[0], a path) outside this process, which is under the sanitizers in the tests: with
 * this process's environment plus `child_var` when not NULL ("NAME=1": e.g. the NVRTC helper neither locks nor calls a helper itself), its
 * stdout and stderr to /dev/null. Returns 1 when it exited with status 0 (the caller still reads the entry from
 * the cache and compiles in-process when it is not there), 0 otherwise (not started, failed, killed). Used by
 * $KVQ_NVRTC_HELPER (runtime/cuda/cu_nvrtc.c) and $KVQ_LLVM_HELPER (compiler/emit_llvm_jit.c). */
int kvq_cache_run_helper(char *const argv[], const char *child_var);

#endif
