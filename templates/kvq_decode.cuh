/* The fused decode-attention kernel body and the merge of split-KV partial results (DESIGN §6).
 *
 * One block serves one kv head of one sequence over one chunk of its tiles, for all GQA query heads of that kv
 * head. A tile is a run of tokens whose keys and values each sit in one container (kvq_tile): a quantized page
 * of either precision class, or fp16 rows (sinks, residual window, outlier and spill pools, sparse rows). For
 * each tile the block stages the codes (16-byte cp.async) and the tile's scales, zeros, factors and mask bits
 * into shared memory once; every thread then reads only its VEC channels of a token:
 *
 *   thread (tx, ty, tz): channels [tx*VEC, tx*VEC+VEC), query heads ty*HPT .. ty*HPT+HPT-1, tokens tz, tz+TZ, ...
 *   score  = sum over lanes tx of the partial dot products (shuffle-xor within TX lanes), log2 domain
 *   online softmax per head (m, d), o += p * v over the thread's channels
 *   end of chunk: the TZ token lanes merge (m, d, o) through shared memory; with one chunk the block writes
 *   o / d, with several it writes (o / d, lse) and kvq_merge combines the chunks.
 *
 * Algebra keeps scales out of the inner loops: per-channel key scales and zeros fold into the query once per
 * tile (q'_c = q_c s_c, bias = sum_c q_c z_c); per-token key parameters multiply the code dot product once per
 * token; per-token value scales fold into the attention weight (w = p s_t) and the zeros accumulate as one
 * scalar per head (sum p z_t) added back at the end of the tile. Plan constants: KVQ_D, KVQ_HQ, KVQ_HKV,
 * KVQ_GQA, KVQ_VEC (8), KVQ_TX, KVQ_TY, KVQ_HPT, KVQ_TZ, KVQ_THREADS. */
#ifndef KVQ_DECODE_CUH
#define KVQ_DECODE_CUH

#include "kvq_unpack.cuh"

/* Staged tile of one tensor in shared memory. */
typedef struct {
    unsigned char *rows; /* [tile][row bytes] */
    float *s, *z;        /* per channel: [D]; per token: [tile][n_groups] */
    float *f;            /* channel-separable factors [D] */
    unsigned char *mask; /* keys: [tile], 1 = masked slot */
} kvq_stage_buf;

KVQ_DEV void kvq_stage_page(const kvq_stage_buf *sb, const unsigned char *b, kvq_fmt f, int slot, int cap, int n,
                            int h, int tid)
{
    kvq_page_off o = kvq_page_offsets(f, KVQ_HKV, KVQ_D, cap);
    kvq_stage_bytes(sb->rows, b + o.codes + ((long long)h * cap + slot) * o.cbpt, n * o.cbpt, tid, KVQ_THREADS);
    if (f.bits >= 16) return;
    if (f.gran == 0) {
        for (int c = tid; c < KVQ_D; c += KVQ_THREADS) {
            sb->s[c] = kvq_ld_par(b + o.scale, (long long)h * KVQ_D + c, f.sbytes);
            sb->z[c] = kvq_ld_par(b + o.zero, (long long)h * KVQ_D + c, f.zbytes);
        }
    } else {
        long long first = f.hidden ? slot : ((long long)h * cap + slot) * o.n_groups;
        for (int j = tid; j < n * o.n_groups; j += KVQ_THREADS) {
            sb->s[j] = kvq_ld_par(b + o.scale, first + j, f.sbytes);
            sb->z[j] = kvq_ld_par(b + o.zero, first + j, f.zbytes);
        }
    }
    if (f.sep)
        for (int c = tid; c < KVQ_D; c += KVQ_THREADS)
            sb->f[c] = kvq_ld_par(b + o.factor, (long long)h * KVQ_D + c, f.sbytes);
    if (f.masked)
        for (int t = tid; t < n; t += KVQ_THREADS)
            sb->mask[t] = (b[o.mask + (long long)h * o.mask_stride + ((slot + t) >> 3)] >> ((slot + t) & 7)) & 1;
}

KVQ_DEV void kvq_stage(const kvq_stage_buf *sb, kvq_u64 base, int kind, int slot, int cap, int n, int h,
                       kvq_fmt hi, kvq_fmt lo, int tid)
{
    const unsigned char *b = (const unsigned char *)base;
    if (kind == KVQ_SRC_F16)
        kvq_stage_bytes(sb->rows, b + ((long long)h * cap + slot) * (2 * KVQ_D), n * 2 * KVQ_D, tid, KVQ_THREADS);
    else if (kind == KVQ_SRC_HI && hi.bits)
        kvq_stage_page(sb, b, hi, slot, cap, n, h, tid);
    else if (kind == KVQ_SRC_LO && lo.bits)
        kvq_stage_page(sb, b, lo, slot, cap, n, h, tid);
}

/* Per-tile fold of the query into the key format: qk (the vector dotted with the codes) and qb (per channel:
 * this lane's share of q.z; per token: this lane's sum of qk, multiplied by the token's zero later). */
KVQ_DEV void kvq_fold_q(kvq_fmt f, const kvq_stage_buf *sb, int c0, int act, float q[KVQ_HPT][KVQ_VEC],
                        float qk[KVQ_HPT][KVQ_VEC], float qb[KVQ_HPT])
{
#pragma unroll
    for (int i = 0; i < KVQ_HPT; i++) {
        qb[i] = 0.0f;
#pragma unroll
        for (int v = 0; v < KVQ_VEC; v++) {
            float s = 1.0f, z = 0.0f;
            if (act && f.bits < 16) {
                if (f.gran == 0) {
                    s = sb->s[c0 + v];
                    z = sb->z[c0 + v];
                } else if (f.sep) {
                    s = sb->f[c0 + v];
                }
            }
            qk[i][v] = q[i][v] * s;
            qb[i] += f.bits < 16 && f.gran == 0 ? q[i][v] * z : qk[i][v];
        }
    }
}

/* This lane's partial score of staged key t for each head. */
KVQ_DEV void kvq_key_partial(kvq_fmt f, const kvq_stage_buf *sb, int t, int c0, int act,
                             float qk[KVQ_HPT][KVQ_VEC], float qb[KVQ_HPT], float sc[KVQ_HPT])
{
    float cv[KVQ_VEC];
    int cbpt = kvq_fmt_cbpt(f.bits, KVQ_D);
#pragma unroll
    for (int i = 0; i < KVQ_HPT; i++) sc[i] = 0.0f;
    if (!act) return;
    if (f.bits >= 16)
        kvq_unpack8_half(sb->rows + t * cbpt + 2 * c0, cv);
    else
        kvq_unpack8(sb->rows + t * cbpt, c0, f.bits, KVQ_D, cv);
    if (f.bits >= 16 || f.gran == 0) {
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++) {
            float acc = f.bits >= 16 ? 0.0f : qb[i];
#pragma unroll
            for (int v = 0; v < KVQ_VEC; v++) acc = fmaf(qk[i][v], cv[v], acc);
            sc[i] = acc;
        }
    } else if (f.hidden || f.group % KVQ_VEC == 0) {
        /* the lane's channels share one group: s_t * (qk . codes) + z_t * sum(qk) */
        int ng = f.hidden ? 1 : KVQ_D / f.group, g = f.hidden ? 0 : c0 / f.group;
        float s = sb->s[t * ng + g], z = sb->z[t * ng + g];
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++) {
            float acc = 0.0f;
#pragma unroll
            for (int v = 0; v < KVQ_VEC; v++) acc = fmaf(qk[i][v], cv[v], acc);
            sc[i] = fmaf(s, acc, z * qb[i]);
        }
    } else {
        int ng = KVQ_D / f.group;
#pragma unroll
        for (int v = 0; v < KVQ_VEC; v++) {
            int g = (c0 + v) / f.group;
            cv[v] = fmaf(sb->s[t * ng + g], cv[v], sb->z[t * ng + g]);
        }
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++) {
            float acc = 0.0f;
#pragma unroll
            for (int v = 0; v < KVQ_VEC; v++) acc = fmaf(qk[i][v], cv[v], acc);
            sc[i] = acc;
        }
    }
}

/* Per-tile value parameters kept in registers: per channel scale and zero, channel-separable factors. */
KVQ_DEV void kvq_fold_v(kvq_fmt f, const kvq_stage_buf *sb, int c0, int act, float vs[KVQ_VEC],
                        float vz[KVQ_VEC], float vf[KVQ_VEC])
{
#pragma unroll
    for (int v = 0; v < KVQ_VEC; v++) {
        vs[v] = 1.0f, vz[v] = 0.0f, vf[v] = 1.0f;
        if (act && f.bits < 16 && f.gran == 0) vs[v] = sb->s[c0 + v], vz[v] = sb->z[c0 + v];
        if (act && f.bits < 16 && f.sep) vf[v] = sb->f[c0 + v];
    }
}

/* o = o * a + p * v_t over the lane's channels; oz collects p * z_t for per-token groups covering the lane. */
KVQ_DEV void kvq_value_acc(kvq_fmt f, const kvq_stage_buf *sb, int t, int c0, int act, int live,
                           const float a[KVQ_HPT], const float p[KVQ_HPT], float o[KVQ_HPT][KVQ_VEC],
                           float oz[KVQ_HPT], const float vs[KVQ_VEC], const float vz[KVQ_VEC],
                           const float vf[KVQ_VEC])
{
    float cv[KVQ_VEC];
    int cbpt = kvq_fmt_cbpt(f.bits, KVQ_D);
#pragma unroll
    for (int v = 0; v < KVQ_VEC; v++) cv[v] = 0.0f;
    if (act && live) {
        if (f.bits >= 16)
            kvq_unpack8_half(sb->rows + t * cbpt + 2 * c0, cv);
        else
            kvq_unpack8(sb->rows + t * cbpt, c0, f.bits, KVQ_D, cv);
    }
    if (f.bits >= 16 || f.gran == 0) {
        if (f.bits < 16)
#pragma unroll
            for (int v = 0; v < KVQ_VEC; v++) cv[v] = fmaf(vs[v], cv[v], vz[v]);
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++)
#pragma unroll
            for (int v = 0; v < KVQ_VEC; v++) o[i][v] = fmaf(p[i], cv[v], o[i][v] * a[i]);
    } else if (f.hidden || f.group % KVQ_VEC == 0) {
        int ng = f.hidden ? 1 : KVQ_D / f.group, g = f.hidden ? 0 : c0 / f.group;
        float s = 0.0f, z = 0.0f;
        if (act && live) s = sb->s[t * ng + g], z = sb->z[t * ng + g];
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++) {
            float w = p[i] * s;
            oz[i] = fmaf(p[i], z, oz[i] * a[i]);
#pragma unroll
            for (int v = 0; v < KVQ_VEC; v++) o[i][v] = fmaf(f.sep ? w * vf[v] : w, cv[v], o[i][v] * a[i]);
        }
    } else {
        int ng = KVQ_D / f.group;
        if (act && live)
#pragma unroll
            for (int v = 0; v < KVQ_VEC; v++) {
                int g = (c0 + v) / f.group;
                cv[v] = fmaf(sb->s[t * ng + g], cv[v], sb->z[t * ng + g]) * vf[v];
            }
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++)
#pragma unroll
            for (int v = 0; v < KVQ_VEC; v++) o[i][v] = fmaf(p[i], cv[v], o[i][v] * a[i]);
    }
}

KVQ_DEV kvq_fmt kvq_fmt_f16(void)
{
    kvq_fmt f = {16, 0, 0, 0, 0, 2, 2, 0};
    return f;
}

/* Dispatch on a tile's (uniform) kind so that each call below is specialised on constant formats. The low
 * class is tested only when the class has one (lo.bits is a constant). */
#define KVQ_BY_KIND(kind, hi, lo, CALL)                                                                        \
    do {                                                                                                       \
        if ((kind) == KVQ_SRC_HI) {                                                                            \
            const kvq_fmt F_ = (hi);                                                                           \
            CALL;                                                                                              \
        } else if ((lo).bits && (kind) == KVQ_SRC_LO) {                                                        \
            const kvq_fmt F_ = (lo);                                                                           \
            CALL;                                                                                              \
        } else {                                                                                               \
            const kvq_fmt F_ = kvq_fmt_f16();                                                                  \
            CALL;                                                                                              \
        }                                                                                                      \
    } while (0)

/* One tile: scores, online softmax and value accumulation for tokens [0, n) of the staged tile. */
KVQ_DEV void kvq_tile_run(int kk, int vk, kvq_fmt khi, kvq_fmt klo, kvq_fmt vhi, kvq_fmt vlo,
                          const kvq_stage_buf *kb, const kvq_stage_buf *vb, int n, int c0, int act, int tz,
                          float q[KVQ_HPT][KVQ_VEC], float m[KVQ_HPT], float d[KVQ_HPT], float o[KVQ_HPT][KVQ_VEC])
{
    float qk[KVQ_HPT][KVQ_VEC], qb[KVQ_HPT], oz[KVQ_HPT], vs[KVQ_VEC], vz[KVQ_VEC], vfac[KVQ_VEC];
    KVQ_BY_KIND(kk, khi, klo, kvq_fold_q(F_, kb, c0, act, q, qk, qb));
    KVQ_BY_KIND(vk, vhi, vlo, kvq_fold_v(F_, vb, c0, act, vs, vz, vfac));
    const int masked = kk != KVQ_SRC_F16 && khi.masked;
#pragma unroll
    for (int i = 0; i < KVQ_HPT; i++) oz[i] = 0.0f;
    /* Every thread runs the same trip count: the shuffles below need the whole warp. Not unrolled: one
     * iteration is TZ tokens, which kvqc build's instruction count relies on. */
#pragma unroll 1
    for (int base = 0; base < n; base += KVQ_TZ) {
        int t = base + tz, live = t < n, tt = live ? t : 0;
        float sc[KVQ_HPT], a[KVQ_HPT], p[KVQ_HPT];
        KVQ_BY_KIND(kk, khi, klo, kvq_key_partial(F_, kb, tt, c0, act && live, qk, qb, sc));
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++) {
#pragma unroll
            for (int off = KVQ_TX / 2; off > 0; off >>= 1) sc[i] += __shfl_xor_sync(KVQ_FULL_MASK, sc[i], off);
            if (!live || (masked && kb->mask[t])) sc[i] = KVQ_NEG_INF;
            float mn = fmaxf(m[i], sc[i]);
            a[i] = mn == KVQ_NEG_INF ? 1.0f : exp2f(m[i] - mn);
            p[i] = sc[i] == KVQ_NEG_INF ? 0.0f : exp2f(sc[i] - mn);
            m[i] = mn;
            d[i] = fmaf(d[i], a[i], p[i]);
        }
        KVQ_BY_KIND(vk, vhi, vlo, kvq_value_acc(F_, vb, tt, c0, act, live, a, p, o, oz, vs, vz, vfac));
    }
    /* per-token value zeros: sum_t p_t z_t, times the channel factors when separable */
    KVQ_BY_KIND(vk, vhi, vlo, {
        if (F_.bits < 16 && F_.gran != 0 && (F_.hidden || F_.group % KVQ_VEC == 0))
            for (int i = 0; i < KVQ_HPT; i++)
                for (int v = 0; v < KVQ_VEC; v++) o[i][v] = fmaf(oz[i], vfac[v], o[i][v]);
    });
}

/* The whole decode kernel of a layer class; hi/lo are the class's page formats (constants after inlining),
 * sbuf holds max(tile * (krow + vrow), merge scratch) bytes, kpar/vpar 2 * par + D floats, kmask tile bytes. */
KVQ_DEV void kvq_decode_body(const kvq_decode_params *p, unsigned char *sbuf, float *kpar, float *vpar,
                             unsigned char *kmask, kvq_fmt khi, kvq_fmt klo, kvq_fmt vhi, kvq_fmt vlo, int tile,
                             int krow, int kparn, int vparn)
{
    const int tx = threadIdx.x, ty = threadIdx.y, tz = threadIdx.z;
    const int tid = tx + KVQ_TX * (ty + KVQ_TY * tz);
    const int hk = blockIdx.x, chunk = blockIdx.y, b = blockIdx.z;
    const kvq_seq_tiles st = ((const kvq_seq_tiles *)p->seqs)[b];
    const int t0 = chunk * p->tiles_per_chunk;
    const int t1 = min(st.n_tiles, t0 + p->tiles_per_chunk);
    if (t0 >= t1 && t0 > 0) return; /* a chunk past this sequence's tiles: kvq_merge ignores it */
    const int c0 = tx * KVQ_VEC, act = c0 < KVQ_D;

    float q[KVQ_HPT][KVQ_VEC], o[KVQ_HPT][KVQ_VEC], m[KVQ_HPT], d[KVQ_HPT];
#pragma unroll
    for (int i = 0; i < KVQ_HPT; i++) {
        int head = hk * KVQ_GQA + ty * KVQ_HPT + i;
        const float *qp = (const float *)p->q + ((long long)b * KVQ_HQ + head) * KVQ_D + c0;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f), y = x;
        if (act) x = ((const float4 *)qp)[0], y = ((const float4 *)qp)[1];
        q[i][0] = x.x * p->scale, q[i][1] = x.y * p->scale, q[i][2] = x.z * p->scale, q[i][3] = x.w * p->scale;
        q[i][4] = y.x * p->scale, q[i][5] = y.y * p->scale, q[i][6] = y.z * p->scale, q[i][7] = y.w * p->scale;
        m[i] = KVQ_NEG_INF, d[i] = 0.0f;
#pragma unroll
        for (int v = 0; v < KVQ_VEC; v++) o[i][v] = 0.0f;
    }

    kvq_stage_buf kb, vb;
    kb.rows = sbuf, kb.s = kpar, kb.z = kpar + kparn, kb.f = kpar + 2 * kparn, kb.mask = kmask;
    vb.rows = sbuf + tile * krow, vb.s = vpar, vb.z = vpar + vparn, vb.f = vpar + 2 * vparn, vb.mask = 0;

    for (int ti = t0; ti < t1; ti++) {
        const kvq_tile T = ((const kvq_tile *)st.tiles)[ti];
#ifdef KVQ_MEASURE_KINDS
        /* kvqc build's instruction count (docs/cuda.md) compiles the unit once more with every tile on the
         * body's pages, so that the token loop of the quantized path is the only one left to count */
        const int kk = KVQ_SRC_HI, vk = KVQ_SRC_HI;
#else
        const int kk = T.kinds & 255, vk = (T.kinds >> 8) & 255;
#endif
        int n = T.n;
        if (T.count) n = min(n, ((const int *)T.count)[hk]);
        __syncthreads(); /* the previous tile's readers are done with the buffers */
        kvq_stage(&kb, T.k, kk, T.k_slot, T.k_cap, n, hk, khi, klo, tid);
        kvq_stage(&vb, T.v, vk, T.v_slot, T.v_cap, n, hk, vhi, vlo, tid);
        kvq_cp_async_wait_all();
        __syncthreads();
        kvq_tile_run(kk, vk, khi, klo, vhi, vlo, &kb, &vb, n, c0, act, tz, q, m, d, o);
    }

    /* Merge the TZ token lanes: scratch [TZ][GQA] m and d, then [TZ][GQA][D] o. */
    float *sm = (float *)sbuf, *sd = sm + KVQ_TZ * KVQ_GQA, *so = sd + KVQ_TZ * KVQ_GQA;
    if (KVQ_TZ > 1) {
        __syncthreads();
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++) {
            int hl = ty * KVQ_HPT + i;
            if (tx == 0) sm[tz * KVQ_GQA + hl] = m[i], sd[tz * KVQ_GQA + hl] = d[i];
            if (act)
#pragma unroll
                for (int v = 0; v < KVQ_VEC; v++) so[(tz * KVQ_GQA + hl) * KVQ_D + c0 + v] = o[i][v];
        }
        __syncthreads();
        if (tz != 0) return;
#pragma unroll
        for (int i = 0; i < KVQ_HPT; i++) {
            int hl = ty * KVQ_HPT + i;
            float mx = KVQ_NEG_INF;
            for (int z = 0; z < KVQ_TZ; z++) mx = fmaxf(mx, sm[z * KVQ_GQA + hl]);
            float dd = 0.0f;
#pragma unroll
            for (int v = 0; v < KVQ_VEC; v++) o[i][v] = 0.0f;
            if (mx != KVQ_NEG_INF)
                for (int z = 0; z < KVQ_TZ; z++) {
                    float w = exp2f(sm[z * KVQ_GQA + hl] - mx);
                    dd = fmaf(sd[z * KVQ_GQA + hl], w, dd);
                    if (act)
#pragma unroll
                        for (int v = 0; v < KVQ_VEC; v++)
                            o[i][v] = fmaf(so[(z * KVQ_GQA + hl) * KVQ_D + c0 + v], w, o[i][v]);
                }
            m[i] = mx, d[i] = dd;
        }
    }
    if (!act) return;
#pragma unroll
    for (int i = 0; i < KVQ_HPT; i++) {
        int head = hk * KVQ_GQA + ty * KVQ_HPT + i;
        float inv = d[i] > 0.0f ? __fdividef(1.0f, d[i]) : 0.0f; /* d >= 1: the max term is 1 */
        float *dst;
        if (p->n_chunks == 1) {
            dst = (float *)p->out + ((long long)b * KVQ_HQ + head) * KVQ_D + c0;
            if (p->lse && tx == 0)
                ((float *)p->lse)[(long long)b * KVQ_HQ + head] = d[i] > 0.0f ? m[i] + log2f(d[i]) : KVQ_NEG_INF;
        } else {
            long long pi = ((long long)b * KVQ_HQ + head) * p->n_chunks + chunk;
            dst = (float *)p->part_o + pi * KVQ_D + c0;
            if (tx == 0) ((float *)p->part_lse)[pi] = d[i] > 0.0f ? m[i] + log2f(d[i]) : KVQ_NEG_INF;
        }
        ((float4 *)dst)[0] = make_float4(o[i][0] * inv, o[i][1] * inv, o[i][2] * inv, o[i][3] * inv);
        ((float4 *)dst)[1] = make_float4(o[i][4] * inv, o[i][5] * inv, o[i][6] * inv, o[i][7] * inv);
    }
}

/* kvq_merge: out = sum_j 2^(lse_j - M) o_j / sum_j 2^(lse_j - M) over the chunks sequence b has. */
KVQ_DEV void kvq_merge_body(const kvq_decode_params *p)
{
    const int head = blockIdx.x, b = blockIdx.y, c = threadIdx.x;
    const kvq_seq_tiles st = ((const kvq_seq_tiles *)p->seqs)[b];
    int nch = (st.n_tiles + p->tiles_per_chunk - 1) / p->tiles_per_chunk;
    if (nch < 1) nch = 1;
    if (nch > p->n_chunks) nch = p->n_chunks;
    long long pi = ((long long)b * KVQ_HQ + head) * p->n_chunks;
    const float *lse = (const float *)p->part_lse + pi;
    float mx = KVQ_NEG_INF;
    for (int j = 0; j < nch; j++) mx = fmaxf(mx, lse[j]);
    float num = 0.0f, den = 0.0f;
    if (mx != KVQ_NEG_INF)
        for (int j = 0; j < nch; j++) {
            float w = exp2f(lse[j] - mx);
            den += w;
            num = fmaf(w, ((const float *)p->part_o)[(pi + j) * KVQ_D + c], num);
        }
    if (c < KVQ_D)
        ((float *)p->out)[((long long)b * KVQ_HQ + head) * KVQ_D + c] = den > 0.0f ? __fdividef(num, den) : 0.0f;
    if (c == 0 && p->lse)
        ((float *)p->lse)[(long long)b * KVQ_HQ + head] = den > 0.0f ? mx + log2f(den) : KVQ_NEG_INF;
}

#endif
