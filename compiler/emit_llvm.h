/* The cpu backend's code generator (DESIGN §6, docs/cpu.md): decode tile kernels built as LLVM IR with the C
 * API, every constant baked in (head_dim, GQA ratio, tile size, bits, groups, parameter dtypes, masks), optimised
 * with default<O3> for the host TargetMachine, compiled to an object and run through ORC LLJIT.
 *
 * A tile is up to `tile` tokens of one kv head whose K rows come from one source and whose V rows come from one
 * source (fp16 rows, or slots of one quantized page), K row i and V row i being the same token. A tile kernel
 * updates the online-softmax state of the kv head's g query heads over the tile:
 *   logits s_jt = q_j . k_t (q pre-multiplied by the softmax scale; masked slots get p = 0),
 *   m' = max(m, max_t s_jt), p_jt = e^(s_jt - m'), l' = l e^(m - m') + sum_t p_jt,
 *   acc_j' = acc_j e^(m - m') + sum_t p_jt v_t.
 * The (K kind, V kind) pair is fixed per kernel: the runtime dispatches once per tile, never per token. */
#ifndef KVQ_EMIT_LLVM_H
#define KVQ_EMIT_LLVM_H

#include <stddef.h>
#include <stdint.h>

#include "kvq.h"
#include "layout.h"
#include "plan.h"

/* The code generator's version: part of the JIT cache key (bump when the IR changes meaning). */
#define EMIT_LLVM_KVQ_VERSION "kvq-cpu-11"

/* Most tokens per tile: a multiple of every vector width the emitter uses (4, 8, 16). The runtime cuts tiles of
 * the plan's length (plan_class.tile, 128; at most this) by the one rule of layout/tiles.h. */
#define EMIT_LLVM_TILE 128

/* Where a tile's K or V rows come from. */
typedef struct {
    int fp16;            /* rows of fp16 values: windows, sinks, pools, bits-16 pages */
    kvq_page_format fmt; /* otherwise: the quantized page's format (capacity ignored) */
} emit_llvm_src;

typedef struct {
    int head_dim, gqa; /* channels; query heads per kv head */
    emit_llvm_src k, v;
} emit_llvm_kernel;

/* What a tile kernel reads and updates. The layout is part of the generated code's ABI (emit_llvm.c builds the
 * same struct type); every pointer is to bytes as stored (layout.h), little-endian.
 *   k, v:     fp16 rows: the tile's first row [n][D]; pages: the codes of the tile's first slot of this kv head
 *             (rows kvq_code_bytes apart).
 *   ks, kz:   per channel: this kv head's [D] scale / zero; per token: the tile's first slot's [n_groups] entries
 *             of this kv head (hidden: scale[slot]); kf: channel factors of this kv head [D] (channel-separable).
 *   kmask:    masked pages: this kv head's mask row; kmbit: the tile's first slot (bit index in that row). */
/* One key page of a tile whose keys are per-channel pages (emit_llvm_paged_keys): a tile of a page run spans
 * several pages (layout/tiles.h), each its own group, so the K phase folds the query once per page. k, ks, kz,
 * kmask, kmbit as below for the page's part of the tile; n its tokens (the tile's n is the sum). */
typedef struct {
    const uint8_t *k, *ks, *kz, *kmask;
    int32_t n, kmbit;
} emit_llvm_kpage;

typedef struct {
    const float *q; /* [g][D], times the softmax scale */
    float *acc;     /* [g][D] */
    float *ml;      /* [g][2]: running max m (start at -FLT_MAX), running sum l (start at 0) */
    float *p;       /* [g][EMIT_LLVM_TILE] scratch */
    const uint8_t *k, *ks, *kz, *kf, *kmask;
    const uint8_t *v, *vs, *vz, *vf;
    int32_t n;      /* tokens in the tile, 1..EMIT_LLVM_TILE */
    int32_t kmbit;
    const emit_llvm_kpage *kp; /* paged keys (emit_llvm_paged_keys): the tile's nkp key pages; k, ks, kz, kmask and
                                * kmbit above are then not read */
    int32_t nkp;
    const float *kt, *vt; /* element formats with a tensor scale (e4m3, e5m2, nvfp4): this kv head's fp32 T
                           * of the K / V page (layout.h's tscale section); else unused */
    /* TurboQuant prod keys (emit_llvm_turboquant.h): kqjl the QJL sign row of the tile's first slot of this kv
     * head (D / 8 bytes a slot); sq [g][D] this kv head's query heads' sqrt(pi/2)/m_j (S_j q_j), q the scaled
     * query above; else unused */
    const uint8_t *kqjl;
    const float *sq;
} emit_llvm_tile_args;

/* 1 if kernels with K source s read their keys through emit_llvm_tile_args.kp (per-channel quantized pages: the
 * scale and zero fold into the query once per page). */
int emit_llvm_paged_keys(const emit_llvm_src *s);

typedef void (*emit_llvm_tile_fn)(const emit_llvm_tile_args *a);

typedef struct emit_llvm_jit emit_llvm_jit;

/* KVQ_OK if this libkvq was built with LLVM and the host target initialises, else KVQ_ERR_UNAVAILABLE. */
kvq_status emit_llvm_probe(char *msg, size_t msg_size);

/* OR'd into a width argument (`force` below, emit_llvm_target.width, emit_llvm_compile's width): no int16 key
 * path even where AVX-512 VNNI is there (tests run the fp32 16-lane path on a VNNI host). */
#define EMIT_LLVM_NO_VNNI 0x100

/* Lanes of the vectors the emitter uses on this host: 16 with AVX-512F, 8 with AVX2, else 4. `force` (4, 8 or
 * 16, possibly | EMIT_LLVM_NO_VNNI) overrides it (tests run the narrower paths on an AVX-512 host); 0 = the
 * host's. With 16 lanes, AVX-512 VNNI and BW, folded (per-channel) keys take the int16 path (docs/cpu.md). */
int emit_llvm_host_width(int force);
/* OR'd into a width argument like EMIT_LLVM_NO_VNNI: no int8 key path (2-bit keys then take the int16 one). */
#define EMIT_LLVM_NO_INT8 0x200

/* 1 if the emitter can build a kernel for this pair (bits 1, 2, 3, 4, 8, 16, and 5 for q5_0/q5_1; every element
 * format of scheme_format.h; head_dim a multiple of 32). */
int emit_llvm_supported(const emit_llvm_kernel *k, char *msg, size_t msg_size);

/* ---- the kernels of a plan (emit_llvm_plan.c): what the cpu backend compiles and `kvqc build --target cpu`
 * writes, one list for both ---- */
#define EMIT_LLVM_MAX_SRC 3 /* fp16 rows, the high class's page format, the low class's */
typedef struct {
    int n_k, n_v; /* sources: [0] = fp16 rows, then page formats */
    kvq_page_format kf[EMIT_LLVM_MAX_SRC], vf[EMIT_LLVM_MAX_SRC];
} emit_llvm_sources;
/* Fills cls[c] for every class of p and, when ks is not NULL, ks with every class's (K source, V source) pairs
 * in class order, K source major (kernel i is symbol kvq_tile_<i>). Returns the number of kernels. */
int emit_llvm_plan_kernels(const kvq_plan *p, emit_llvm_sources *cls, emit_llvm_kernel *ks);
/* The source index of a page of format f among a class's K (which 0) or V (1) sources; -1 if not planned. */
int emit_llvm_source_index(const emit_llvm_sources *s, int which, const kvq_page_format *f);

/* ---- one module of kernels: IR, key, object (the JIT and `kvqc build --target cpu` share every step) ---- */
typedef struct {
    const char *cpu;      /* LLVM CPU name as LLVMGetHostCPUName spells it; NULL: this host's */
    const char *features; /* LLVM feature string; NULL: this host's when cpu is NULL, else "" (the CPU's own) */
    int width;            /* 4, 8 or 16; 0: from the features (+avx512f: 16, +avx2: 8, else 4); may carry
                           * EMIT_LLVM_NO_VNNI (else the int16 key path where +avx512vnni and +avx512bw) */
} emit_llvm_target;

typedef struct emit_llvm_module emit_llvm_module;
/* Builds and verifies the IR of n kernels for target t (NULL: the host) and its key: the SHA-256 of the
 * unoptimised IR (bitcode), LLVM's version, the target's CPU name and features, the pass pipeline and
 * EMIT_LLVM_KVQ_VERSION. Equal keys mean the same object: the key is what the JIT cache and the prebuilt
 * objects of generated/ are found by. */
kvq_status emit_llvm_module_build(const emit_llvm_kernel *kernels, int n, const emit_llvm_target *t,
                                  emit_llvm_module **out, char *msg, size_t msg_size);
const char *emit_llvm_module_key(const emit_llvm_module *m); /* 64 hex digits; "" if it could not be hashed */
const char *emit_llvm_module_cpu(const emit_llvm_module *m);
const char *emit_llvm_module_features(const emit_llvm_module *m);
int emit_llvm_module_width(const emit_llvm_module *m);
/* Optimises the module (default<O3>) for its target and emits the object: *obj is kvq_malloc'd. Once per
 * module (the passes change it). */
kvq_status emit_llvm_module_object(emit_llvm_module *m, void **obj, size_t *size, char *msg, size_t msg_size);
void emit_llvm_module_free(emit_llvm_module *m);
/* The LLVM version as "19.1.7". */
void emit_llvm_version(char *out, size_t size);

/* Loads an object of n kernels (built for this host) into a new LLJIT: fns[i] runs kvq_tile_<i>. An object LLVM
 * rejects is an error and leaves nothing behind. */
kvq_status emit_llvm_load(const void *obj, size_t size, int n, emit_llvm_jit **out, emit_llvm_tile_fn *fns,
                          char *msg, size_t msg_size);

/* Where the kernels of emit_llvm_compile came from. */
enum { EMIT_LLVM_FROM_JIT = 0, EMIT_LLVM_FROM_CACHE = 1, EMIT_LLVM_FROM_PREBUILT = 2 };
/* A store of prebuilt objects (generated/<scheme>/, runtime/cpu/cpu_aot.h): the object whose key is `key` as
 * kvq_malloc'd bytes, or NULL. */
typedef void *(*emit_llvm_prebuilt_fn)(void *arg, const char *key, size_t *size);

/* Builds the module of n kernels for this host and loads its object: from `prebuilt` (may be NULL) when it has
 * the key, else from the JIT cache (runtime/jit_cache.h), else optimised and compiled now (and cached). An
 * object that fails to load falls through to the next source. fns[i] runs kernels[i]; width: as
 * emit_llvm_host_width's argument; *origin (may be NULL) gets an EMIT_LLVM_FROM_ value. */
kvq_status emit_llvm_compile(const emit_llvm_kernel *kernels, int n, int width, emit_llvm_prebuilt_fn prebuilt,
                             void *prebuilt_arg, emit_llvm_jit **out, emit_llvm_tile_fn *fns, int *origin,
                             char *msg, size_t msg_size);
void emit_llvm_free(emit_llvm_jit *j);
/* The compile helper's half ($KVQ_LLVM_HELPER, tests/llvm_helper.c): optimises and compiles the module in bc
 * (unoptimised bitcode, as emit_llvm_compile hashes it) for cpu and features and stores the object in the JIT
 * cache under the key emit_llvm_module_build gives that module; KVQ_OK at once when the entry exists. */
kvq_status emit_llvm_cache_bitcode(const void *bc, size_t size, const char *cpu, const char *features, char *msg,
                                   size_t msg_size);

/* The textual IR of one kernel before optimisation (malloc'd; NULL when unavailable): for tests and docs. */
char *emit_llvm_ir_text(const emit_llvm_kernel *k, int width);

#endif
