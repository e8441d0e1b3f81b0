/* The resolved scheme: what semantic analysis produces from a .kvq spec and what every later stage (layout,
 * memory accounting, plan, backends, runtime) consumes. Plain data: no pointers into the AST, every default
 * filled in, inheritance and per-layer overrides applied, every value range-checked. Nothing here knows about
 * the spec language's syntax. */
#ifndef KVQ_SCHEME_H
#define KVQ_SCHEME_H

#include <stddef.h>

#include "scheme_format.h"

#define KVQ_NAME_MAX 64
#define KVQ_MAX_LAYER_RANGES 64

/* Group size sentinels (positive values are an explicit count). */
#define KVQ_GROUP_ALL (-1)    /* the whole grouped axis: all tokens of a flush (per channel), or head_dim (per token) */
#define KVQ_GROUP_HIDDEN (-2) /* per token only: one group spans every kv head of the layer (ZipCache's accounting) */

typedef enum { KVQ_GRAN_CHANNEL = 0, KVQ_GRAN_TOKEN = 1 } kvq_gran;
typedef enum { KVQ_DT_FP16 = 0, KVQ_DT_FP32 = 1 } kvq_param_dtype;

/* How the fp16 residual window drains into the quantized body. */
typedef enum {
    KVQ_FLUSH_KIVI = 0,  /* KIVI Alg. 1: keys quantized R at a time when the window holds R; values one token at a
                            a time as they leave a window of R */
    KVQ_FLUSH_GROUP = 1  /* OTT Sec. 3.2: keys and values both quantized G at a time, every G steps, keeping the
                            newest R tokens fp16 */
} kvq_flush;

typedef enum { KVQ_SAL_NONE = 0, KVQ_SAL_NORMALIZED = 1, KVQ_SAL_ACCUMULATED = 2 } kvq_saliency_metric;
typedef enum { KVQ_OUTLIER_KEY_L1_SMALLEST = 0, KVQ_OUTLIER_KEY_L1_LARGEST = 1 } kvq_outlier_metric;

/* What a layer does with its cache. AUTO: decided per layer by calibration (TailorKV dense preference score). */
typedef enum { KVQ_MODE_QUANT = 0, KVQ_MODE_SPARSE = 1, KVQ_MODE_AUTO = 2 } kvq_layer_mode;

/* Rotation of a tensor's head vectors before they are stored (docs/language.md, "Rotations"): QuaRot/SpinQuant's
 * Walsh-Hadamard, TurboQuant's Haar-random orthogonal matrix. The engine applies it (runtime/rt_rotate.c), so
 * every backend stores and attends rotated vectors and sees no rotation itself. */
typedef enum { KVQ_ROT_NONE = 0, KVQ_ROT_HADAMARD = 1, KVQ_ROT_RANDOM = 2 } kvq_rotation;
/* TurboQuant (arXiv 2504.19874, runtime/turboquant.h): per-token head vectors after `rotate random`, their norm
 * stored and each coordinate of the unit vector a Lloyd-Max level of N(0, 1/D) (MSE, Algorithm 1), or b - 1 such
 * bits plus a 1-bit QJL sketch of the residual (PROD, Algorithm 2). */
typedef enum { KVQ_TQ_NONE = 0, KVQ_TQ_MSE = 1, KVQ_TQ_PROD = 2 } kvq_turboquant;

/* Quantization of one tensor (keys or values). */
typedef struct {
    int bits;              /* 1, 2, 3, 4, 8, or 16 (= kept fp16, not quantized) */
    kvq_gran gran;         /* per channel: a group is `group` tokens of one channel; per token: `group` channels of one token */
    int channel_separable; /* per token only: ZipCache Eq. 6 channel normalisation before tokenwise quantization */
    int group;             /* > 0, KVQ_GROUP_ALL or KVQ_GROUP_HIDDEN */
    kvq_param_dtype scale_dtype;
    kvq_param_dtype zero_dtype;
    kvq_rotation rotate;   /* applied to quantized tensors (bits < 16) of quantize-mode layers */
    int rotate_seed;       /* hadamard: the seed of its random signs, -1 = no signs; random: the matrix's seed */
    kvq_turboquant turboquant; /* NONE: the format below; else TurboQuant codes (per token, group all, rotated;
                                  its QJL matrix is seeded by rotate_seed) */
    int tq_outliers;       /* TurboQuant's outlier channel split (arXiv 2504.19874 Sec. 4.3): 0 = off; else this many
                              channels (the largest by norm over the prompt, per sequence and kv head) form a second,
                              independent TurboQuant instance at tq_outlier_bits, the rest one at `bits` */
    int tq_outlier_bits;
    kvq_format_cfg format; /* element format (scheme_format.h); zero-initialised = asymmetric integers */
} kvq_tensor_cfg;

typedef struct {
    int keep;              /* pool capacity N; 0 = no outlier pool */
    kvq_outlier_metric metric;
    int spill;             /* spill pool capacity (fp16); tokens pushed out of the pool go here; 0 = discarded to body */
} kvq_outlier_cfg;

typedef struct {
    kvq_saliency_metric metric; /* NONE: no mixed precision */
    double probe_recent;   /* fraction of tokens (0..1) used as recent probe queries (ZipCache Eq. 9) */
    double probe_random;   /* fraction of tokens (0..1) drawn uniformly at random as probes */
    double salient;        /* fraction of tokens (0..1) kept at high_bits */
    int high_bits;         /* bits of salient tokens (keys and values) */
    int low_bits;          /* bits of the rest */
    int interval;          /* decode: new tokens wait in fp16 and are compressed every `interval` tokens */
} kvq_saliency_cfg;

/* A quantize-mode layer. */
typedef struct {
    kvq_tensor_cfg key, value;
    int sinks;             /* first tokens kept fp16 */
    int residual;          /* R: newest tokens kept fp16 */
    kvq_flush flush;
    kvq_outlier_cfg outliers;
    kvq_saliency_cfg saliency;
} kvq_quant_cfg;

/* A sparse-mode layer (TailorKV Sec. 4.3): full fp16 K/V offloaded to host memory; the device keeps sinks +
 * recent + generated tokens and fetches the top-k tokens scored on critical channels (Eq. 10) each step. */
typedef struct {
    int host_offload;
    int sinks;
    int recent;
    int topk;
    int critical_channels;
} kvq_sparse_cfg;

/* TailorKV Eq. 6-9: dense preference score from the last `queries` queries of the calibration prompt. */
typedef struct {
    int enabled;
    int queries;           /* n_q */
    double top;            /* fraction of the prompt's tokens summed per query row (top-k, k = ceil(top * n)) */
    double tau;            /* score > tau: quantize, else sparse */
} kvq_classify_cfg;

typedef struct {
    kvq_layer_mode mode;
    kvq_quant_cfg quant;   /* meaningful when mode is QUANT or AUTO */
    kvq_sparse_cfg sparse; /* meaningful when mode is SPARSE or AUTO */
} kvq_layer_cfg;

typedef struct {
    int lo, hi;            /* inclusive layer range */
    kvq_layer_cfg cfg;     /* the complete configuration of those layers (base with the override applied) */
} kvq_layer_range;

typedef struct {
    int layers, heads, kv_heads, head_dim; /* 0 = not given in the spec */
} kvq_model_dims;

typedef struct kvq_scheme {
    char name[KVQ_NAME_MAX];
    char parent[KVQ_NAME_MAX];  /* "" when the scheme does not inherit */
    char file[256];             /* where it was defined */
    int line;
    kvq_model_dims model;
    kvq_classify_cfg classify;
    kvq_layer_cfg base;         /* layers not covered by a range */
    int n_ranges;
    kvq_layer_range ranges[KVQ_MAX_LAYER_RANGES]; /* later ranges win where they overlap */
} kvq_scheme;

/* The configuration of one layer: the last range covering it, else the base. */
const kvq_layer_cfg *kvq_scheme_layer(const kvq_scheme *s, int layer);

/* 1 if bits means "kept fp16" (not quantized). */
static inline int kvq_bits_is_fp16(int bits) { return bits >= 16; }

/* 1 if a quantize-mode layer stores TurboQuant codes (runtime/turboquant.h). */
static inline int kvq_layer_turboquant(const kvq_layer_cfg *c)
{
    const kvq_quant_cfg *q = &c->quant;
    return c->mode != KVQ_MODE_SPARSE && ((q->key.turboquant != KVQ_TQ_NONE && !kvq_bits_is_fp16(q->key.bits)) ||
                                          (q->value.turboquant != KVQ_TQ_NONE && !kvq_bits_is_fp16(q->value.bits)));
}

#endif
