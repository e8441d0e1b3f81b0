/* The backend interface (ggml's pattern): a const table of functions. The engine (rt_engine.c) validates every
 * public call (shapes, states, arguments) and converts inputs to fp32 [.. ][D] arrays before a backend sees
 * them, so a backend only implements the semantics. A backend owns the cache state of its sequences. */
#ifndef KVQ_BACKEND_H
#define KVQ_BACKEND_H

#include <stddef.h>

#include "kvq.h"
#include "scheme.h"
#include "tiles.h"

typedef struct kvq_backend_seq kvq_backend_seq; /* a backend's per-sequence state (opaque to the engine) */
typedef struct kvq_backend_ctx kvq_backend_ctx; /* a backend's per-engine state */

/* What the engine hands a backend for one sequence of a prefill (fp32, C order). A backend with `prefill_f16` set
 * gets an fp16 engine's rows as the caller gave them instead, when nothing on the host changes them (no rotation,
 * no calibration): k16 and v16 set, k and v NULL. fp16 -> fp32 -> fp16 is the identity on the finite values the
 * engine lets through, so either form stores the same cache; this one spares the host two conversions and an
 * fp32 copy of the prompt (4 bytes an element). */
typedef struct {
    kvq_backend_seq *seq;
    int n_tokens;
    const float *k, *v; /* [kv_heads][n_tokens][D] */
    const float *q;     /* [heads][n_tokens][D], or NULL */
    const uint16_t *k16, *v16; /* [kv_heads][n_tokens][D] fp16, with prefill_f16 only (above) */
} kvq_be_prefill;

typedef struct {
    kvq_backend_seq *seq;
    const float *k, *v; /* [kv_heads][D] */
    const float *q;     /* [heads][D] */
    float *out;         /* [heads][D] */
} kvq_be_decode;

/* Fixed facts of an engine a backend needs. `layer_sparse[l]` is the decided mode of AUTO layers (or of the
 * scheme's fixed modes); the engine updates it after calibration, before the layer's first prefill. */
typedef struct {
    const kvq_scheme *scheme;
    kvq_dims dims;
    float softmax_scale;
    uint64_t seed;
    int threads;                 /* kvq_engine_config.threads: 0 = the machine's online cores */
    unsigned char *layer_sparse; /* [dims.layers] */
} kvq_be_engine;

typedef struct kvq_backend {
    const char *name;
    int prefill_f16; /* prefill reads kvq_be_prefill.k16 / v16 when they are set (above) */
    /* KVQ_OK if the backend can run on this machine, else KVQ_ERR_UNAVAILABLE with the reason in msg. */
    kvq_status (*probe)(char *msg, size_t msg_size);
    /* KVQ_OK if the backend implements everything `e` needs, else KVQ_ERR_UNSUPPORTED with the reason. */
    kvq_status (*supports)(const kvq_be_engine *e, char *msg, size_t msg_size);
    kvq_status (*prepare)(const kvq_be_engine *e, kvq_backend_ctx **ctx, char *msg, size_t msg_size);
    void (*destroy)(kvq_backend_ctx *ctx);

    kvq_status (*seq_create)(kvq_backend_ctx *ctx, kvq_backend_seq **out, char *msg, size_t msg_size);
    void (*seq_free)(kvq_backend_ctx *ctx, kvq_backend_seq *seq);
    int (*seq_length)(const kvq_backend_seq *seq, int layer);

    /* Each sequence of a batch is either fully updated or left as it was (allocate before mutating); on failure
     * msg names the failing item. */
    kvq_status (*prefill)(kvq_backend_ctx *ctx, int layer, const kvq_be_prefill *items, int n, char *msg,
                          size_t msg_size);
    kvq_status (*decode)(kvq_backend_ctx *ctx, int layer, const kvq_be_decode *items, int n, char *msg,
                         size_t msg_size);

    /* Adds the sequence's allocated bytes and token counts by segment into out->bytes / out->tokens. */
    void (*seq_account)(const kvq_backend_ctx *ctx, const kvq_backend_seq *seq, kvq_mem_stats *out);
    kvq_status (*read_cache)(kvq_backend_ctx *ctx, const kvq_backend_seq *seq, int layer, float *k, float *v,
                             int capacity, int *n_tokens, char *msg, size_t msg_size);

    /* Optional (NULL: the engine computes it on the host): TailorKV Eq. 9's P_l of one prompt, n_tokens queries
     * q [heads][n][D] and keys k [kv_heads][n][D], equal to kvq_dense_preference_layer(q, k, ..., n_q, top,
     * softmax_scale) bit for bit. */
    kvq_status (*dense_preference)(kvq_backend_ctx *ctx, const float *q, const float *k, int n_tokens, int n_q,
                                   double top, double *score, char *msg, size_t msg_size);

    /* Optional (NULL: nothing to reserve): makes room for `bytes` more of cache in the backend's device memory
     * pool, so that steps taking it allocate nothing (kvq_engine_reserve_device). */
    kvq_status (*reserve)(kvq_backend_ctx *ctx, size_t bytes, char *msg, size_t msg_size);

    /* Optional (NULL: the backend has no device tensors): kvq_decode_device after the engine's checks (the
     * sequences distinct, prefilled, of this engine; dtypes and pointers set). Same all-or-nothing contract as
     * decode. */
    kvq_status (*decode_device)(kvq_backend_ctx *ctx, int layer, kvq_backend_seq *const *seqs, int n,
                                const kvq_dev_decode *batch, char *msg, size_t msg_size);
    /* Optional, with decode_device: bytes of device memory to the host, ordered after `stream`'s work
     * (kvq_prefill_device). */
    kvq_status (*download)(kvq_backend_ctx *ctx, void *stream, void *dst, const void *src, size_t bytes, char *msg,
                           size_t msg_size);
    /* Optional (NULL: no planned steps): kvq_engine_reserve_step, kvq_decode_plan (the host half of the next step
     * of every layer; all-or-nothing over every layer of every sequence) and kvq_decode_run (the device half of
     * one layer of the planned step; no host state changes), after the engine's checks. */
    kvq_status (*reserve_step)(kvq_backend_ctx *ctx, int max_batch, int max_tokens, char *msg, size_t msg_size);
    kvq_status (*decode_plan)(kvq_backend_ctx *ctx, kvq_backend_seq *const *seqs, int n, void *stream, char *msg,
                              size_t msg_size);
    kvq_status (*decode_run)(kvq_backend_ctx *ctx, int layer, kvq_backend_seq *const *seqs, int n,
                             const kvq_dev_decode *batch, char *msg, size_t msg_size);
    /* Optional (NULL: no tile lists): the decode tiles of `seq` at `layer` as the layer's state makes them now,
     * i.e. as its last decode step read them (rt_step_tiles). *n = their count; at most cap written. */
    kvq_status (*step_tiles)(kvq_backend_ctx *ctx, const kvq_backend_seq *seq, int layer, kvq_tile_info *out,
                             int cap, int *n, char *msg, size_t msg_size);
} kvq_backend;

extern const kvq_backend kvq_backend_reference;

#endif
