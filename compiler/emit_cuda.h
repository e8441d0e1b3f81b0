/* CUDA code generation (DESIGN §6): a kernel plan -> one self-contained CUDA translation unit made of a prelude
 * of #defines and the text of the templates/ files (embedded in libkvq at build time), plus the C header and the
 * manifest `kvqc build` writes beside it. Output is a pure function of the plan: byte-identical on every run,
 * which is what lets generated/ be committed and checked for staleness. */
#ifndef KVQ_EMIT_CUDA_H
#define KVQ_EMIT_CUDA_H

#include <stddef.h>

#include "kvq.h"
#include "plan.h"

/* kvq's own version, part of every JIT cache key (DESIGN §7). */
#define EMIT_CUDA_KVQ_VERSION "kvq-cuda-1"

#define EMIT_CUDA_MAX_KERNELS (20 + 10 * PLAN_MAX_CLASSES)

typedef enum {
    EMIT_K_DECODE = 0, /* fused decode attention of one layer class */
    EMIT_K_MERGE,      /* split-KV merge */
    EMIT_K_STORE,      /* fp16 row store */
    EMIT_K_SIG,        /* parameter-layout signature */
    EMIT_K_QUANT,      /* quantize-and-append into a page */
    EMIT_K_FACTOR,     /* channel-separable factors */
    EMIT_K_POLICY      /* policy kernels */
} emit_cuda_kind;

typedef struct {
    char name[64];
    emit_cuda_kind kind;
    int cls;            /* layer class; -1 for kernels common to the plan */
    const char *params; /* name of its parameter struct (kvq_params.cuh) */
    int param_size;     /* bytes */
    unsigned block[3];
    const char *grid; /* how a host sizes the grid */
} emit_cuda_kernel;

/* The kernels a plan's translation unit defines, in a stable order. Returns the count. */
int emit_cuda_kernels(const kvq_plan *p, emit_cuda_kernel *out, int max);

/* Derived per-class sizes the class block defines (also in the manifest). */
int emit_cuda_par_floats(const kvq_plan *p, const plan_class *c, int key);
int emit_cuda_sbuf_bytes(const kvq_plan *p, const plan_class *c);

/* The translation unit, NUL-terminated, allocated with kvq_malloc (caller frees with kvq_free). */
kvq_status emit_cuda_source(const kvq_plan *p, char **out, size_t *len);

/* A C header for host programs: the parameter structs, the plan's constants, the kernel table and the layer ->
 * class map. source_hash: hex SHA-256 of the translation unit. */
kvq_status emit_cuda_header(const kvq_plan *p, const char *source_hash, char **out, size_t *len);

/* manifest.json: plan, kernels with parameters and launch shapes, source hash; `resources` (a JSON object
 * text, or NULL) is appended last under the key "resources". */
kvq_status emit_cuda_manifest(const kvq_plan *p, const char *source_hash, const char *resources, char **out,
                              size_t *len);

/* The text part of a `kvqc build` of one plan (what generated/<scheme>/ commits): kernels.cu, kernels.h and
 * manifest.json (with `resources` appended when given). hash: SHA-256 of the source, hex. */
typedef struct {
    char *source, *header, *manifest;
    size_t source_len, header_len, manifest_len;
    char hash[65];
} emit_cuda_text;
kvq_status emit_cuda_text_build(const kvq_plan *p, const char *resources, emit_cuda_text *out);
void emit_cuda_text_free(emit_cuda_text *t);

/* SHA-256 (FIPS 180-4), for source hashes and JIT cache keys. */
void emit_cuda_sha256(const void *data, size_t n, unsigned char out[32]);
void emit_cuda_sha256_hex(const void *data, size_t n, char out[65]);

/* A growable text buffer (also used by runtime/cuda to build messages and cache keys). */
typedef struct {
    char *s;
    size_t len, cap;
    int failed; /* an allocation failed: the text is incomplete */
} emit_buf;
void emit_buf_printf(emit_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void emit_buf_put(emit_buf *b, const char *s, size_t n);
void emit_buf_free(emit_buf *b);

#endif
