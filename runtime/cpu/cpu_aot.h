/* The cpu backend's kernels built ahead of time (docs/cpu.md, "Ahead of time"): `kvqc build --target cpu`
 * writes the object of a scheme's kernels to generated/<scheme>/cpu-<cpu>-<key16>.o and a line per object to
 * generated/<scheme>/cpu.json (key, SHA-256 and size of the object, LLVM version, CPU, features, width,
 * kernels); an engine whose module has the same key (emit_llvm_module_key: IR, LLVM, CPU and features, pipeline,
 * emitter version) loads that object instead of compiling. Internal: not part of kvq.h. This header needs no
 * runtime/ref include path (kvqc build includes it). */
#ifndef KVQ_CPU_AOT_H
#define KVQ_CPU_AOT_H

#include <stddef.h>

#include "emit_llvm.h"
#include "kvq.h"

/* The prebuilt objects' folder of a scheme: $KVQ_GENERATED_DIR/<scheme>, else kvq_data_dir()/generated/<scheme>
 * (the cuda backend's cubins' folder). */
void cpu_aot_dir(const char *scheme, char *out, size_t size);

/* The object dir/cpu.json lists under `key`, read and checked against the SHA-256 and size listed with it:
 * kvq_malloc'd bytes, or NULL (no manifest, no such key, missing, truncated or corrupt object: a miss). */
void *cpu_aot_find(const char *dir, const char *key, size_t *size);

/* Writes the object of module m (its bytes obj/size, the kernels of plan p) to dir as cpu-<cpu>-<key16>.o and
 * its line to dir/cpu.json, keeping the lines of other keys whose objects are present. The object's file name
 * goes to name. 0, or -1 with the reason in msg. */
int cpu_aot_write(const char *dir, const emit_llvm_module *m, const kvq_plan *p, const void *obj, size_t size,
                  char *name, size_t name_size, char *msg, size_t msg_size);

/* For tests: where a cpu engine's kernels came from, "generated", "cache" or "jit"; NULL if e is not a cpu
 * engine. */
const char *cpu_engine_origin(const kvq_engine *e);

#endif
