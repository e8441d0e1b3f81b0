/* The engine's internals, shared by rt_engine.c and rt_layer_map.c. Not part of the public API. */
#ifndef KVQ_RT_INTERNAL_H
#define KVQ_RT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "kvq.h"
#include "scheme.h"

#define RT_ERRMSG_MAX 512

struct kvq_seq {
    kvq_engine *engine;
    kvq_backend_seq *bseq;
    unsigned char *prefilled; /* [layers] */
    /* TurboQuant's outlier channel split (rt_rotate.c): [layers][2][kv_heads][head_dim] channel order, the
     * outlier channels (chosen from the prompt) first; NULL when the scheme splits no tensor */
    unsigned char *tq_perm;
    kvq_seq *prev, *next;     /* the engine's list of live sequences */
};

struct kvq_rot;
/* Vectors the engine has rotated, by kind (rt_rotate.c; test_rotate counts them). */
enum { RT_ROT_K, RT_ROT_V, RT_ROT_Q, RT_ROT_OUT, RT_ROT_KINDS };

struct kvq_engine {
    const kvq_scheme *scheme;
    kvq_engine_config cfg;
    const kvq_backend *be;
    kvq_backend_ctx *ctx;
    kvq_be_engine bee;           /* what the backend sees; bee.layer_sparse is layer_sparse below */
    unsigned char *layer_sparse; /* [layers] decided (or fixed) mode: 1 = sparse */
    unsigned char *layer_auto;   /* [layers] the scheme leaves the mode to calibration */
    unsigned char *layer_decided;/* [layers] an auto layer calibrated (always 1 for fixed layers) */
    unsigned char *layer_used;   /* [layers] some sequence has prefilled the layer: its mode is final */
    double *layer_score;         /* [layers] dense preference score of calibrated layers (NaN otherwise) */
    kvq_seq *seqs;
    /* Rotations (rt_rotate.c): the distinct matrices the scheme names, built once per engine, and each layer's
     * rotation of its keys (rot[2 l]) and values (rot[2 l + 1]) when it quantizes them, else NULL. */
    struct kvq_rot *rots;
    int n_rots;
    const struct kvq_rot **rot;
    uint64_t rot_count[RT_ROT_KINDS];
    /* TurboQuant's outlier split (rt_rotate.c): per (layer, tensor) the split rotation, or NULL */
    struct rt_tq_split *splits;
    int n_splits;
    const struct rt_tq_split **split;
    char errmsg[RT_ERRMSG_MAX];
};

/* Registers a backend that is not in rt_engine.c's table (one linked into a test program, such as the SIMT
 * emulator's): engines created afterwards with `kind` use it. At most 4; call before creating engines. */
kvq_status rt_backend_register(kvq_backend_kind kind, const kvq_backend *backend);

/* Sets the engine's message and returns st. */
kvq_status rt_error(kvq_engine *e, kvq_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The checks every batched call (kvq_prefill, kvq_decode and their device forms) makes of its sequences: the
 * layer in range, at least one item, each sequence non-NULL, of this engine, not yet prefilled (prefill) or
 * prefilled (decode) in that layer, none twice. seq_at(items, i) reads item i's sequence. */
kvq_status rt_check_batch(kvq_engine *e, const char *fn, int layer, const void *items, int n,
                          kvq_seq *(*seq_at)(const void *items, int i), int prefill);

/* rt_tiles.c: the decode tiles of sequence s at `layer` as its last decode step read them (the backend rebuilds
 * the list from the layer's state, which the step left as it read it; a ZipCache layer that compressed after its
 * attention is the exception): *n their count, at most cap written to out. For kvqc's cost model and the tests of
 * tile lengths (docs/layout.md "Tiles"). KVQ_ERR_UNSUPPORTED on a backend without tile lists (reference, cpu). */
kvq_status rt_step_tiles(kvq_engine *e, const kvq_seq *s, int layer, kvq_tile_info *out, int cap, int *n);

/* rt_convert.c: n elements of dtype to fp32. */
void rt_to_f32(kvq_dtype dt, const void *src, size_t n, float *dst);
size_t rt_dtype_size(kvq_dtype dt);

/* rt_check.c: the input policy of docs/runtime.md. K/V rows [kv_heads][n_tokens][head_dim] must be finite and
 * within fp16's range, Q rows [heads][n_tokens][head_dim] finite with bounded logits; pos0 is the first token's
 * position in the sequence. On a bad element: KVQ_ERR_INVALID with a message naming it. */
kvq_status rt_check_kv(kvq_engine *e, const char *fn, int item, int layer, const char *tensor, const float *x,
                       int n_tokens, int pos0);
/* rt_check_kv on fp16 rows: only non-finite elements can be refused (every finite fp16 value fits the cache). */
kvq_status rt_check_kv16(kvq_engine *e, const char *fn, int item, int layer, const char *tensor, const uint16_t *x,
                         int n_tokens, int pos0);
kvq_status rt_check_q(kvq_engine *e, const char *fn, int item, int layer, const float *q, int n_tokens, int pos0);

/* rt_rotate.c: rotations as an engine-level transform (docs/runtime.md, "Rotations").
 * init builds every rotation the scheme's layers name (at engine creation; msg says why on failure); configured:
 * the scheme rotates some tensor of the layer if it quantizes; active: it does now (the layer's mode decided
 * quantize). rotate_in rotates one item's K/V rows [kv_heads][n][D] and, with the keys, its queries
 * [heads][n][D] (q may be NULL), in place, then applies the input policy to what will be stored (refusing a
 * rotated element beyond fp16's range); rotate_out rotates `rows` output rows back; rotate_back rotates the
 * first n_tokens rows of each kv head of read_cache's arrays back. */
kvq_status rt_rotate_init(kvq_engine *e, char *msg, size_t msg_size);
void rt_rotate_free(kvq_engine *e);
int rt_rotate_configured(const kvq_engine *e, int layer);
int rt_rotate_active(const kvq_engine *e, int layer);
kvq_status rt_rotate_in(kvq_engine *e, const char *fn, kvq_seq *seq, int item, int layer, float *k, float *v,
                        float *q, int n_tokens, int pos0);
void rt_rotate_out(kvq_engine *e, const kvq_seq *seq, int layer, float *out, int rows);
void rt_rotate_back(const kvq_engine *e, const kvq_seq *seq, int layer, float *k, float *v, int capacity,
                    int n_tokens);
/* TurboQuant's outlier split: 1 if the scheme splits some tensor (sequences then carry tq_perm); the bytes of a
 * sequence's channel selection in a layer (a head_dim-bit mask per kv head and split tensor, counted with the
 * cache's parameters as kvq_scheme_account counts it). */
int rt_tq_split_any(const kvq_engine *e);
uint64_t rt_tq_split_bytes(const kvq_engine *e, int layer);

/* The folder of a scheme's kernels built ahead of time (kvqc build): $KVQ_GENERATED_DIR/<scheme>, else
 * kvq_data_dir()/generated/<scheme>. Used by the cpu and cuda backends alike. */
void kvq_generated_dir(const char *scheme, char *out, size_t size);

#endif
