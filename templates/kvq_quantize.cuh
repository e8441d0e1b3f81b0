/* Quantize-and-append: rows of K or V (the plan's input dtype, or fp16 from a window) into a page of
 * layout/layout.h, with the quantizer of runtime/quant.h reproduced step for step so codes and parameters are
 * bit-exact with the reference backend. Group statistics run sequentially in the reference's order (first
 * occurrence wins min/max ties, so a -0/+0 group keeps the same zero). Pages are zeroed when allocated; mask
 * bits are only ever set (atomicOr, since blocks may share a mask byte).
 *
 *   per token  grid (kv_heads, min(ceil(n / KVQ_QTOK), 65535)): each block stages its rows, fits one group per
 *              thread, packs one 32-bit code word per thread, and strides over the runs of KVQ_QTOK tokens.
 *   per channel grid (kv_heads): one thread per channel fits the group over the page's n tokens, then packs.
 *   hidden     grid (1, min(n, 65535)): one group spans every kv head of a token; blocks stride over tokens.
 *   factors    grid (kv_heads): ZipCache Eq. 6 c_i = sqrt(max_t |X_t,i|) over the n tokens, into the page.
 *   fp16 rows  grid (kv_heads, min(n, 65535)): kvq_store_f16, for windows, pools, fp16 pages and fetched sparse
 *              rows; blocks stride over tokens. */
#ifndef KVQ_QUANTIZE_CUH
#define KVQ_QUANTIZE_CUH

#include "kvq_format.cuh"
#include "kvq_turboquant.cuh"
#include "kvq_types.cuh"

#define KVQ_QTHREADS 128
#define KVQ_QTOK 8

/* Code word w of a token row (bit order of layout.h; for 3 bits the 2-bit plane's words come first).
 * val(c), sc(c), zc(c) give channel c's value and parameters. */
#define KVQ_PACK_WORD(bits, w, val, sc, zc, out)                                                               \
    do {                                                                                                       \
        unsigned word_ = 0;                                                                                    \
        if ((bits) == 3) {                                                                                     \
            if ((w) < KVQ_D / 16) {                                                                            \
                for (int k_ = 0; k_ < 16; k_++) {                                                              \
                    int c_ = (w) * 16 + k_;                                                                    \
                    word_ |= (kvq_code(val(c_), sc(c_), zc(c_), 3) & 3u) << (2 * k_);                          \
                }                                                                                              \
            } else {                                                                                           \
                for (int k_ = 0; k_ < 32; k_++) {                                                              \
                    int c_ = ((w) - KVQ_D / 16) * 32 + k_;                                                     \
                    word_ |= ((kvq_code(val(c_), sc(c_), zc(c_), 3) >> 2) & 1u) << k_;                         \
                }                                                                                              \
            }                                                                                                  \
        } else {                                                                                               \
            const int per_ = 32 / (bits);                                                                      \
            for (int k_ = 0; k_ < per_; k_++) {                                                                \
                int c_ = (w) * per_ + k_;                                                                      \
                word_ |= kvq_code(val(c_), sc(c_), zc(c_), (bits)) << ((bits) * k_);                           \
            }                                                                                                  \
        }                                                                                                      \
        (out) = word_;                                                                                         \
    } while (0)

KVQ_DEV void kvq_set_mask_bits(const kvq_quant_params *p, kvq_fmt f, kvq_page_off o, int h, int t_begin,
                               int t_end, int tid, int nthreads)
{
    if (!f.masked || !p->masked) return;
    unsigned char *mask = (unsigned char *)p->page + o.mask + (long long)h * o.mask_stride;
    for (int t = t_begin + tid; t < t_end; t += nthreads) {
        if (!((const unsigned char *)p->masked)[(long long)h * p->n + t]) continue;
        int slot = p->slot + t;
        kvq_u64 byte = (kvq_u64)(mask + (slot >> 3));
        unsigned *word = (unsigned *)(byte & ~(kvq_u64)3);
        atomicOr(word, 1u << ((unsigned)(byte & 3) * 8 + (slot & 7)));
    }
}

/* Per-token groups (not hidden), tokens [tb, tb + KVQ_QTOK). xs: [KVQ_QTOK][D] staged values, ps/pz:
 * [KVQ_QTOK][D / group]. */
KVQ_DEV void kvq_quant_token_run(const kvq_quant_params *p, kvq_fmt f, float *xs, float *ps, float *pz, int tb)
{
    const int h = blockIdx.x, tid = threadIdx.x;
    const int nt = min(KVQ_QTOK, p->n - tb);
    const kvq_page_off o = kvq_page_offsets(f, KVQ_HKV, KVQ_D, p->cap);
    unsigned char *page = (unsigned char *)p->page;
    for (int i = tid; i < nt * KVQ_D; i += KVQ_QTHREADS) {
        int t = i / KVQ_D, c = i % KVQ_D;
        float x = kvq_src_ld(&p->src, kvq_row_at(&p->src, h, tb + t, p->n), c);
        /* ZipCache Eq. 6: channel i divided by its factor before tokenwise quantization */
        if (f.sep) x = __fdiv_rn(x, kvq_ld_par(page + o.factor, (long long)h * KVQ_D + c, f.sbytes));
        xs[i] = x;
    }
    __syncthreads();
#if KVQ_TQ_ANY
    if (kvq_tq_is(f)) { /* TurboQuant (kvq_turboquant.cuh): a norm per part, Lloyd-Max codes */
        kvq_tq_quant_token_run(p, f, o, xs, ps, (unsigned *)pz, tb, nt, h, tid, KVQ_QTHREADS);
        return;
    }
#endif
#if KVQ_FMT_ANY
    if (f.kind) { /* element formats (kvq_format.cuh) */
        kvq_fmt_quant_token_run(p, f, o, xs, tb, nt, h, tid, KVQ_QTHREADS);
        kvq_set_mask_bits(p, f, o, h, tb, tb + nt, tid, KVQ_QTHREADS);
        return;
    }
#endif
    const int G = f.group, ng = KVQ_D / G;
    for (int i = tid; i < nt * ng; i += KVQ_QTHREADS) {
        int t = i / ng, g = i % ng;
        const float *x = xs + t * KVQ_D + g * G;
        float mn = x[0], mx = x[0];
        for (int c = 1; c < G; c++) {
            if (x[c] < mn) mn = x[c];
            if (x[c] > mx) mx = x[c];
        }
        float s, z;
        kvq_fit(mn, mx, f.bits, f.sbytes == 4, f.zbytes == 4, &s, &z);
        ps[i] = s, pz[i] = z;
        long long pi = ((long long)h * p->cap + p->slot + tb + t) * ng + g;
        kvq_st_par(page + o.scale, pi, f.sbytes, s);
        kvq_st_par(page + o.zero, pi, f.zbytes, z);
    }
    __syncthreads();
    const int W = o.cbpt / 4;
    unsigned *codes = (unsigned *)(page + o.codes);
    for (int i = tid; i < nt * W; i += KVQ_QTHREADS) {
        int t = i / W, w = i % W;
        const float *x = xs + t * KVQ_D;
        const float *s = ps + t * ng, *z = pz + t * ng;
#define KVQ_V_(c) x[c]
#define KVQ_S_(c) s[(c) / G]
#define KVQ_Z_(c) z[(c) / G]
        unsigned word;
        KVQ_PACK_WORD(f.bits, w, KVQ_V_, KVQ_S_, KVQ_Z_, word);
#undef KVQ_V_
#undef KVQ_S_
#undef KVQ_Z_
        codes[((long long)h * p->cap + p->slot + tb + t) * W + w] = word;
    }
    kvq_set_mask_bits(p, f, o, h, tb, tb + nt, tid, KVQ_QTHREADS);
}

/* The blocks of gridDim.y stride over the runs of KVQ_QTOK tokens, so that gridDim.y stays within its limit of
 * 65535 whatever n (the host launches min(runs, 65535)). */
KVQ_DEV void kvq_quant_token_body(const kvq_quant_params *p, kvq_fmt f, float *xs, float *ps, float *pz)
{
    for (int tb = blockIdx.y * KVQ_QTOK; tb < p->n; tb += gridDim.y * KVQ_QTOK) {
        kvq_quant_token_run(p, f, xs, ps, pz, tb);
        __syncthreads(); /* the next run overwrites xs, ps, pz */
    }
}

/* Value of token t, channel c of a per-channel group: masked tokens read as their channel's fill value. */
KVQ_DEV float kvq_pc_val(const kvq_quant_params *p, int h, int t, int c, const float *fill)
{
    if (p->mean_fill && p->masked && ((const unsigned char *)p->masked)[(long long)h * p->n + t]) return fill[c];
    return kvq_src_ld(&p->src, kvq_row_at(&p->src, h, t, p->n), c);
}

/* Per-channel groups: the page's n tokens form one group per channel. ps/pz/fill: [D]. */
KVQ_DEV void kvq_quant_channel_body(const kvq_quant_params *p, kvq_fmt f, float *ps, float *pz, float *fill)
{
    const int h = blockIdx.x, tid = threadIdx.x, n = p->n;
#if KVQ_FMT_ANY
    if (f.kind) { /* element formats without group parameters (kvq_format.cuh) */
        kvq_fmt_quant_channel(p, f, h, tid, KVQ_QTHREADS);
        return;
    }
#endif
    const kvq_page_off o = kvq_page_offsets(f, KVQ_HKV, KVQ_D, p->cap);
    unsigned char *page = (unsigned char *)p->page;
    for (int c = tid; c < KVQ_D; c += KVQ_QTHREADS) {
        /* OTT: a pooled token is replaced in its group by the mean of the group's other tokens */
        double sum = 0.0;
        int cnt = 0;
        if (p->mean_fill && p->masked) {
            for (int t = 0; t < n; t++)
                if (!((const unsigned char *)p->masked)[(long long)h * n + t]) {
                    sum += (double)kvq_src_ld(&p->src, kvq_row_at(&p->src, h, t, n), c);
                    cnt++;
                }
        }
        fill[c] = cnt > 0 ? (float)(sum / cnt) : 0.0f;
        float x0 = kvq_pc_val(p, h, 0, c, fill), mn = x0, mx = x0;
        for (int t = 1; t < n; t++) {
            float x = kvq_pc_val(p, h, t, c, fill);
            if (x < mn) mn = x;
            if (x > mx) mx = x;
        }
        float s, z;
        kvq_fit(mn, mx, f.bits, f.sbytes == 4, f.zbytes == 4, &s, &z);
        ps[c] = s, pz[c] = z;
        kvq_st_par(page + o.scale, (long long)h * KVQ_D + c, f.sbytes, s);
        kvq_st_par(page + o.zero, (long long)h * KVQ_D + c, f.zbytes, z);
    }
    __syncthreads();
    const int W = o.cbpt / 4;
    unsigned *codes = (unsigned *)(page + o.codes);
    for (int i = tid; i < n * W; i += KVQ_QTHREADS) {
        int t = i / W, w = i % W;
#define KVQ_V_(c) kvq_pc_val(p, h, t, (c), fill)
#define KVQ_S_(c) ps[c]
#define KVQ_Z_(c) pz[c]
        unsigned word;
        KVQ_PACK_WORD(f.bits, w, KVQ_V_, KVQ_S_, KVQ_Z_, word);
#undef KVQ_V_
#undef KVQ_S_
#undef KVQ_Z_
        codes[((long long)h * p->cap + p->slot + t) * W + w] = word;
    }
    kvq_set_mask_bits(p, f, o, h, 0, n, tid, KVQ_QTHREADS);
}

/* A hidden group's element (h, c) of token t, divided by its channel factor when separable (ZipCache Eq. 6). */
KVQ_DEV float kvq_hidden_val(const kvq_quant_params *p, kvq_fmt f, kvq_page_off o, int h, int t, int c)
{
    float x = kvq_src_ld(&p->src, kvq_row_at(&p->src, h, t, p->n), c);
    if (f.sep)
        x = __fdiv_rn(x, kvq_ld_par((const unsigned char *)p->page + o.factor, (long long)h * KVQ_D + c, f.sbytes));
    return x;
}

/* Hidden group of token t: one group over every kv head (h-major, channel-minor order). red: 4 * KVQ_QTHREADS
 * floats / ints of scratch. */
KVQ_DEV void kvq_quant_hidden_token(const kvq_quant_params *p, kvq_fmt f, float *redv, int *redi, int t)
{
    const int tid = threadIdx.x, N = KVQ_HKV * KVQ_D;
    const kvq_page_off o = kvq_page_offsets(f, KVQ_HKV, KVQ_D, p->cap);
    unsigned char *page = (unsigned char *)p->page;
    /* min and max with their first index: ties resolve to the earliest element as the sequential loop does */
    float mn = 0.0f, mx = 0.0f;
    int imn = N, imx = N;
    for (int i = tid; i < N; i += KVQ_QTHREADS) {
        float x = kvq_hidden_val(p, f, o, i / KVQ_D, t, i % KVQ_D);
        if (imn == N || x < mn) mn = x, imn = i;
        if (imx == N || x > mx) mx = x, imx = i;
    }
    float *vmn = redv, *vmx = redv + KVQ_QTHREADS;
    int *jmn = redi, *jmx = redi + KVQ_QTHREADS;
    vmn[tid] = mn, vmx[tid] = mx, jmn[tid] = imn, jmx[tid] = imx;
    __syncthreads();
    for (int half = KVQ_QTHREADS / 2; half > 0; half >>= 1) {
        if (tid < half) {
            int u = tid + half;
            if (jmn[u] < N && (jmn[tid] == N || vmn[u] < vmn[tid] || (vmn[u] == vmn[tid] && jmn[u] < jmn[tid])))
                vmn[tid] = vmn[u], jmn[tid] = jmn[u];
            if (jmx[u] < N && (jmx[tid] == N || vmx[u] > vmx[tid] || (vmx[u] == vmx[tid] && jmx[u] < jmx[tid])))
                vmx[tid] = vmx[u], jmx[tid] = jmx[u];
        }
        __syncthreads();
    }
    float s, z;
    kvq_fit(vmn[0], vmx[0], f.bits, f.sbytes == 4, f.zbytes == 4, &s, &z);
    if (tid == 0) {
        kvq_st_par(page + o.scale, p->slot + t, f.sbytes, s);
        kvq_st_par(page + o.zero, p->slot + t, f.zbytes, z);
    }
    const int W = o.cbpt / 4;
    unsigned *codes = (unsigned *)(page + o.codes);
    for (int i = tid; i < KVQ_HKV * W; i += KVQ_QTHREADS) {
        int h = i / W, w = i % W;
#define KVQ_V_(c) kvq_hidden_val(p, f, o, h, t, (c))
#define KVQ_S_(c) s
#define KVQ_Z_(c) z
        unsigned word;
        KVQ_PACK_WORD(f.bits, w, KVQ_V_, KVQ_S_, KVQ_Z_, word);
#undef KVQ_V_
#undef KVQ_S_
#undef KVQ_Z_
        codes[((long long)h * p->cap + p->slot + t) * W + w] = word;
    }
    for (int h = 0; h < KVQ_HKV; h++)
        if (tid == 0) kvq_set_mask_bits(p, f, o, h, t, t + 1, 0, 1);
}

/* Hidden groups: the blocks of gridDim.y stride over the tokens (gridDim.y <= 65535 whatever n). */
KVQ_DEV void kvq_quant_hidden_body(const kvq_quant_params *p, kvq_fmt f, float *redv, int *redi)
{
    for (int t = blockIdx.y; t < p->n; t += gridDim.y) {
        kvq_quant_hidden_token(p, f, redv, redi, t);
        __syncthreads(); /* the next token's reduction overwrites red, which this one's threads read last */
    }
}

/* ZipCache Eq. 6 channel factors over the n tokens of the call, written to the page. */
KVQ_DEV void kvq_factor_body(const kvq_quant_params *p, kvq_fmt f)
{
    const int h = blockIdx.x;
    const kvq_page_off o = kvq_page_offsets(f, KVQ_HKV, KVQ_D, p->cap);
    for (int c = threadIdx.x; c < KVQ_D; c += KVQ_QTHREADS) {
        float am = 0.0f;
        for (int t = 0; t < p->n; t++) {
            float x = fabsf(kvq_src_ld(&p->src, kvq_row_at(&p->src, h, t, p->n), c));
            if (x > am) am = x;
        }
        kvq_st_par((unsigned char *)p->page + o.factor, (long long)h * KVQ_D + c, f.sbytes,
                   kvq_factor(am, f.sbytes == 4));
    }
}

/* One item of a quantize list (kvq_quant_list_<store>_c<k>, kvq_quant_lists_c<k>): the direct kernel's body,
 * run by the list grid, the widest of the direct grids: a per-channel body on blockIdx.y 0 only, a hidden one on
 * blockIdx.x 0 only; per-token bodies stride over the tokens whatever gridDim.y (each token its own groups). */
KVQ_DEV void kvq_quant_item(const kvq_quant_params *it, kvq_fmt f, float *xs, float *ps, float *pz, float *fill,
                            int *ri)
{
    const kvq_quant_params p = *it;
    if (p.n <= 0) return;
    if (f.gran == 0) {
        if (blockIdx.y == 0) kvq_quant_channel_body(&p, f, ps, pz, fill);
    } else if (f.hidden) {
        if (blockIdx.x == 0) kvq_quant_hidden_body(&p, f, ps, ri);
    } else {
        kvq_quant_token_body(&p, f, xs, ps, pz);
    }
}

/* fp16 rows: window slot (slot + t) mod dst_ring of kv head blockIdx.x; the blocks of gridDim.y stride over the
 * tokens t (gridDim.y <= 65535 whatever n). */
KVQ_DEV kvq_half *kvq_store_dst(const kvq_store_params *p, int h, int t)
{
    long long r = p->dst_ring ? ((long long)p->slot + t) % p->dst_ring : (long long)p->slot + t;
    return (kvq_half *)p->dst + ((long long)h * p->dst_cap + r) * KVQ_D;
}

KVQ_DEV void kvq_store_f16_body(const kvq_store_params *p)
{
    const int h = blockIdx.x;
    for (int t = blockIdx.y; t < p->n; t += gridDim.y) {
        kvq_half *dst = kvq_store_dst(p, h, t);
        long long row0 = kvq_row_at(&p->src, h, t, p->n);
        for (int c = threadIdx.x; c < KVQ_D; c += blockDim.x) dst[c] = kvq_f2h(kvq_src_ld(&p->src, row0, c));
    }
}

#endif
