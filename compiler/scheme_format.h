/* The element format of a quantized tensor (part of the resolved scheme, compiler/scheme.h): what a code means
 * and how a group's scale is stored. Every format decodes an element as
 *
 *     x = z + s * T * L[code]
 *
 * with z the group's stored zero (asymmetric integers and llama.cpp's q4_1/q5_1 only, else 0), s the group's
 * stored scale (fp16/fp32, e4m3 for NVFP4, e8m0 for MXFP4; 1 for fp8 e4m3/e5m2, which have none), T the
 * tensor scale (fp8 and NVFP4: static in the spec or computed from the prompt; else 1) and L the format's level
 * table: L[c] = c for asymmetric integers, c - 2^(b-1) for symmetric ones (the implied zero that is not
 * stored), the e4m3/e5m2/e2m1 values, or a codebook's levels. runtime/quant.h implements each format's own
 * rounding; docs/language.md ("Element formats") and specs/formats/ document them with their sources. */
#ifndef KVQ_SCHEME_FORMAT_H
#define KVQ_SCHEME_FORMAT_H

typedef enum {
    KVQ_FMT_INT = 0,  /* asymmetric uniform integers (DESIGN §4; the default) */
    KVQ_FMT_INT_SYM,  /* symmetric uniform integers: codes 1 .. 2^b - 1, L = c - 2^(b-1), s = absmax / (2^(b-1) - 1) */
    KVQ_FMT_Q8_0,     /* llama.cpp / ggml block types: 32 channels of one token, fp16 scale d (and min m for _1) */
    KVQ_FMT_Q4_0,
    KVQ_FMT_Q4_1,
    KVQ_FMT_Q5_0,
    KVQ_FMT_Q5_1,
    KVQ_FMT_E4M3,     /* OCP fp8 e4m3 (float8_e4m3fn) elements, one tensor scale (vLLM --kv-cache-dtype fp8) */
    KVQ_FMT_E5M2,     /* OCP fp8 e5m2 elements, one tensor scale */
    KVQ_FMT_NVFP4,    /* e2m1 elements, blocks of 16 with an e4m3 scale, an fp32 tensor scale */
    KVQ_FMT_MXFP4,    /* OCP MX v1.0 MXFP4: e2m1 elements, blocks of 32 with an e8m0 (power of two) scale */
    KVQ_FMT_CODEBOOK, /* nearest of 2^bits (or fewer) levels times the group's scale */
    KVQ_FMT_COUNT
} kvq_format_kind;

#define KVQ_CODEBOOK_MAX 16     /* levels of a codebook (bits 1..4) */
#define KVQ_TENSOR_SCALE_PROMPT 0.0f

typedef struct {
    kvq_format_kind kind;
    /* Codebooks: n_levels ascending levels (n_levels <= 2^bits); `normal`: Lloyd-Max for N(0,1) at the
     * tensor's bits (base/lloyd_max.h), filled in by sema, and the group scale is the group's root mean square
     * instead of absmax / max |L|. */
    int codebook_normal;
    int n_levels;
    float levels[KVQ_CODEBOOK_MAX];
    /* E4M3, E5M2, NVFP4: the tensor scale T (> 0, static), or KVQ_TENSOR_SCALE_PROMPT: computed from the
     * layer's first quantized batch (the prompt), amax / (largest element * largest block scale). */
    float tensor_scale;
} kvq_format_cfg;

/* The format's name as the spec writes it ("int", "q4_0", "nvfp4", ...). */
static inline const char *kvq_format_name(kvq_format_kind k)
{
    static const char *const names[KVQ_FMT_COUNT] = {"int", "int symmetric", "q8_0", "q4_0", "q4_1", "q5_0",
                                                      "q5_1", "e4m3", "e5m2", "nvfp4", "mxfp4", "codebook"};
    return (unsigned)k < KVQ_FMT_COUNT ? names[k] : "?";
}

#endif
