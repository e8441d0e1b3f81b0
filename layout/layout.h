/* The storage layout of the cache: one definition used by every backend, by the runtime's allocation and by the
 * memory accounting of `kvqc report`. docs/layout.md describes it with pictures; keep the two in step.
 *
 * A page holds the tokens of one quantization batch of one tensor (K or V) and one precision class, for every
 * kv head of one (sequence, layer), with their metadata. Pages are allocated once and filled either all at once
 * (a flush) or one token at a time (appendable per-token pages); nothing stored is ever moved or re-packed.
 * Within a page every section starts on a 16-byte boundary so a GPU thread can load codes 16 bytes at a time:
 *
 *   codes   [kv_head][capacity][code_bytes_per_token]     token-major; see kvq_code_bytes() for bit order
 *   scale   per channel: [kv_head][head_dim]               per token: [kv_head][capacity][n_groups]
 *           per token, group hidden: [capacity]
 *   zero    same shape as scale
 *   factor  channel-separable only: [kv_head][head_dim]    ZipCache Eq. 6 channel factors c_i (scale dtype)
 *   qjl     TurboQuant prod only: [kv_head][capacity][head_dim / 8] the QJL sign bits, 1-bit plane order
 *   mask    keys of layers with an outlier pool: [kv_head][ceil(capacity/8)] bytes, bit t%8 of byte t/8 set when
 *           token t's quantized slot is masked out of attention (the token lives in the outlier/spill pool)
 *   tscale  element formats with a tensor scale (e4m3, e5m2, nvfp4): the fp32 tensor scale T the page's codes
 *           were made with, [1] or (per head) [kv_head]
 *
 * Element formats (scheme_format.h) change only the sizes: scale entries are 1 byte (nvfp4: e4m3, mxfp4: e8m0)
 * or absent (e4m3/e5m2 elements), zero entries absent for the symmetric formats; q5_0/q5_1 codes are 5 bits, a
 * 4-bit plane (D/2 bytes) followed by the fifth bits as a 1-bit plane (D/8 bytes).
 *
 * Bit order of codes: a token's codes for channels 0..D-1 are packed little-endian into 32-bit words, channel c
 * at bits [(c*b) % 32, +b) of word (c*b)/32, for b in {1, 2, 4, 8}. A 3-bit code is two planes: the low two bits
 * as a 2-bit plane (D/4 bytes) followed by the high bit as a 1-bit plane (D/8 bytes). b = 16 stores fp16 values
 * (no scale/zero). TurboQuant pages (turboquant.h) store the level indices at b bits (mse) or b - 1 bits (prod),
 * the vector's norm as the per-token scale, and for prod the residual's norm as the per-token zero (none for
 * mse). With TurboQuant's outlier channel split (`outlier_channels N bits B`, turboquant.h kvq_tqv) a token has
 * two parts: codes = [the N outlier coordinates at B (prod: B - 1) bits | the other D - N at b (b - 1)], each
 * part packed as above; scale and zero hold two entries per token (n_groups 2: outlier part, regular part); the
 * qjl signs are the outlier part's N bits then the regular part's D - N.
 *
 * fp16 windows (sinks, residual, outlier and spill pools, sparse local and host copies) are
 * [kv_head][capacity][head_dim] fp16 for K and the same for V. */
#ifndef KVQ_LAYOUT_H
#define KVQ_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "scheme.h"

#define KVQ_ALIGN 16
/* Capacity of a page of a sparse layer's generated tokens (fp16, filled one token a step). */
#define KVQ_APPEND_PAGE_TOKENS 64
/* Pages that decode fills one token at a time in a quantized layer (per-token values, fp16 tensors) end at
 * multiples of KVQ_APPEND_ALIGN tokens past the sinks (kvq_append_page_tokens): the longest decode tile, and a
 * multiple of KIVI's key flushes (R tokens past the sinks), so that tiles are not cut between them. */
#define KVQ_APPEND_ALIGN 128

static inline size_t kvq_align16(size_t n) { return (n + (KVQ_ALIGN - 1)) & ~(size_t)(KVQ_ALIGN - 1); }

/* What one page stores: fixed by the tensor's configuration, the class's bits and the page capacity. */
typedef struct {
    int bits;            /* of this precision class; 16 = fp16 values */
    kvq_gran gran;
    int channel_separable;
    int group;           /* resolved: tokens per group (per channel) or channels per group (per token); 0 = hidden */
    int hidden;          /* per token, one group over every kv head */
    int masked;          /* keys of a layer with an outlier pool */
    kvq_turboquant tq;   /* TurboQuant codes (per token, one group of head_dim) */
    int tq_out, tq_out_bits; /* TurboQuant's outlier split: outlier channels (0 = none) and their bits */
    int scale_bytes;     /* 2 (fp16) or 4 (fp32) */
    int zero_bytes;
    int kv_heads, head_dim, capacity;
    kvq_format_cfg format; /* element format (scheme_format.h); bits above is its code width */
} kvq_page_format;

/* Byte offsets of each section from the start of the page, and the total size. Absent sections have size 0. */
typedef struct {
    size_t codes, scale, zero, factor, mask, total;
    size_t codes_size, scale_size, zero_size, factor_size, mask_size;
    size_t qjl, qjl_size;        /* TurboQuant prod's sign bits */
    size_t code_bytes_per_token; /* for one kv head */
    int n_groups;                /* per token: scale/zero entries per token per kv head (1 when hidden) */
    size_t tscale, tscale_size;  /* element formats with a tensor scale (e4m3, e5m2, nvfp4): fp32 T, one per
                                    page or (tensor_scale prompt per head) one per kv head */
} kvq_page_layout;

/* Bytes of one token's codes for one kv head (head_dim channels at `bits`). head_dim is a multiple of 32. */
size_t kvq_code_bytes(int head_dim, int bits);

/* Fills `fmt` for tensor `t` of a quant-mode layer at the given class bits and capacity (a named element
 * format's own code width replaces the bits). */
void kvq_page_format_init(kvq_page_format *fmt, const kvq_tensor_cfg *t, int bits, int masked, int kv_heads,
                          int head_dim, int capacity);
void kvq_page_layout_compute(const kvq_page_format *fmt, kvq_page_layout *out);

/* Parameter bytes of a page that are per-channel (shared along the token axis: per-channel scale/zero and
 * channel factors), i.e. the part ZipCache's accounting shares across a batch. */
size_t kvq_page_channel_param_bytes(const kvq_page_layout *lay, const kvq_page_format *fmt);

/* Bytes of an fp16 window of `capacity` tokens holding K and V for every kv head. */
static inline size_t kvq_window_tensor_bytes(int kv_heads, int head_dim, int capacity)
{
    return kvq_align16((size_t)kv_heads * (size_t)capacity * (size_t)head_dim * 2);
}
static inline size_t kvq_window_bytes(int kv_heads, int head_dim, int capacity)
{
    return 2 * kvq_window_tensor_bytes(kv_heads, head_dim, capacity);
}

/* ---- streaming rules: how the fp16 window drains into the body (DESIGN §4) ---- */

/* A window keeps the `keep` newest tokens fp16 and quantizes the `batch` oldest ones together when it holds
 * keep + batch. A prefill of n tokens (after sinks) quantizes the oldest q of them, q = the largest multiple of
 * `prefill_multiple` with q <= n - keep (0 when n <= keep), and leaves the rest in the window. */
typedef struct {
    int keep, batch, prefill_multiple;
    int capacity; /* keep + batch; 0 when every token is flushed on arrival (no window) */
} kvq_window_rule;

/* The rule of tensor `which` (0 = keys, 1 = values) of a quant-mode layer. */
void kvq_window_rule_of(const kvq_quant_cfg *q, int which, kvq_window_rule *out);
/* Tokens of a prefill of n (after sinks) that the rule quantizes. */
int kvq_window_prefill_quantized(const kvq_window_rule *r, int n);

/* Tokens of a flush batch of n in the high-precision class (saliency policies): kvq_frac_round(salient, n). */
int kvq_saliency_high_count(const kvq_saliency_cfg *s, int n);

/* Resolved group along the token axis of a per-channel tensor for a batch of n tokens: the group size, or n
 * for group all. */
int kvq_channel_group_tokens(const kvq_tensor_cfg *t, int n);

/* Capacity of the next page of a flush class with `remaining` tokens left to store (a page holds one group):
 * per channel the group (the whole flush for group all), at most what remains; per token, and for bits 16 (not
 * quantized, so no groups), one page of all of them. So a class of n tokens is n / c pages of c = kvq_flush_page_tokens(t, n) and one of n % c. The one rule
 * the backends' page writes and the accounting share. */
int kvq_flush_page_tokens(const kvq_tensor_cfg *t, int remaining);

/* Capacity of an appendable page whose first slot takes the token at position `first` of a layer with `sinks`
 * sinks: up to the next multiple of KVQ_APPEND_ALIGN past the sinks (KVQ_APPEND_ALIGN when first is one). The
 * backends' appends and the accounting share it. */
int kvq_append_page_tokens(int first, int sinks);

#endif
