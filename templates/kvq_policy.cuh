/* The policy kernels: the decisions of OTT, ZipCache and TailorKV (runtime/policy.h, runtime/ref/) on the
 * device, equal to the host's. emit_cuda sets KVQ_POL_OTT, KVQ_POL_ZIP, KVQ_POL_TK and KVQ_POL_DENSE to the
 * sections a plan needs.
 *
 * Why the decisions are the host's (docs/cuda.md, "Determinism"): every sum the host accumulates sequentially
 * in double is accumulated here by one thread, in the same order, in double; products of two floats are exact
 * in double, so whether a compiler fuses them into an fma does not matter, and where a double product is
 * followed by a subtraction (the logit scale) kvq_dmul keeps it separately rounded as on the host; conversions
 * to float and fp16 round to nearest on both sides; maxima and rankings are exact (kvq_select.cuh). Threads
 * split the independent items (tokens, channels, rows), never a sum, except ZipCache's probe-row normaliser, an
 * integer sum (kvq_prob_fixed) whose value does not depend on the order. There are no library calls: ZipCache and
 * TailorKV take e^x from kvq_exp_det, which both sides compute from the same additions and multiplications, so the
 * decisions are bit-identical on a GPU too. */
#ifndef KVQ_POLICY_CUH
#define KVQ_POLICY_CUH

#include "kvq_select.cuh"

#define KVQ_NEG_INF_D (__longlong_as_double((long long)0xfff0000000000000ull))

#if KVQ_POL_ZIP || KVQ_POL_DENSE
/* kvq_exp_det (runtime/policy_tailorkv.c), constant for constant and operation for operation; kvq_dmul keeps every
 * product that feeds an addition separately rounded, as the host (-ffp-contract=off) computes it. */
KVQ_DEV double kvq_exp_det(double x)
{
    if (x != x) return x;
    if (x > 709.782712893384) return __longlong_as_double(0x7ff0000000000000LL);
    if (x < -745.1332191019412) return 0.0;
    double kd = kvq_dmul(x, 1.4426950408889634);
    kd = (kd + 6755399441055744.0) - 6755399441055744.0;
    double r = (x - kvq_dmul(kd, 0.6931471803691238)) - kvq_dmul(kd, 1.9082149292705877e-10);
    double p = 1.6059043836821613e-10;
    p = kvq_dmul(p, r) + 2.08767569878681e-09;
    p = kvq_dmul(p, r) + 2.505210838544172e-08;
    p = kvq_dmul(p, r) + 2.755731922398589e-07;
    p = kvq_dmul(p, r) + 2.7557319223985893e-06;
    p = kvq_dmul(p, r) + 2.48015873015873e-05;
    p = kvq_dmul(p, r) + 0.0001984126984126984;
    p = kvq_dmul(p, r) + 0.001388888888888889;
    p = kvq_dmul(p, r) + 0.008333333333333333;
    p = kvq_dmul(p, r) + 0.041666666666666664;
    p = kvq_dmul(p, r) + 0.16666666666666666;
    p = kvq_dmul(p, r) + 0.5;
    p = kvq_dmul(p, r) + 1.0;
    p = kvq_dmul(p, r) + 1.0;
    int k = (int)kd;
    if (k < -1021) /* subnormal result: 2^(k + 54), then 2^-54 (the one rounding) */
        return kvq_dmul(kvq_dmul(p, __longlong_as_double((long long)(k + 54 + 1023) << 52)), 5.551115123125783e-17);
    if (k > 1023) /* x within 0.35 of the overflow threshold */
        return kvq_dmul(kvq_dmul(p, __longlong_as_double((long long)(k - 1 + 1023) << 52)), 2.0);
    return kvq_dmul(p, __longlong_as_double((long long)(k + 1023) << 52));
}
#endif

/* ---------------------------------------------------------------------------------- OTT (App. E) ---- */
#if KVQ_POL_OTT

KVQ_DEV char *kvq_om(kvq_u64 base, int keep, int spill, int field)
{
    return (char *)base + kvq_ott_meta_off(KVQ_HKV, keep, spill, field);
}

/* ref_outlier.c's rank order: smaller score first, NaN last, ties to the earlier position. */
KVQ_DEV int kvq_ott_before(float sa, int pa, float sb, int pb)
{
    int na = kvq_isnan(sa), nb = kvq_isnan(sb);
    if (na != nb) return nb;
    if (!na && sa != sb) return sa < sb;
    return pa < pb;
}

/* Index of flush token i's pooled flag: key page c = i / G holds tokens [c*G, c*G + n_c), flags [H][n_c]. */
KVQ_DEV long long kvq_ott_flag(int i, int h, int B, int G)
{
    int c0 = i / G * G, nc = min(G, B - c0);
    return (long long)c0 * KVQ_HKV + (long long)h * nc + (i - c0);
}

/* Raw fp16 element x of row t of head h of a (fp16) row source. */
KVQ_DEV kvq_half kvq_raw16(const kvq_rows *r, int h, int t, int n, int x)
{
    return ((const kvq_half *)r->base)[kvq_row_at(r, h, t, n) + x];
}

/* A pool row's source: >= 0 flush token, < 0 the input copy's slot -1 - src. */
KVQ_DEV kvq_half kvq_ott_src16(const kvq_ott_params *p, int w, int h, int src, int x)
{
    if (src >= 0) return kvq_raw16(w ? &p->v : &p->k, h, src, p->B, x);
    long long off = ((long long)h * p->keep + (-1 - src)) * KVQ_D + x;
    return ((const kvq_half *)p->pool_in)[(w ? (long long)KVQ_HKV * p->keep * KVQ_D : 0) + off];
}

/* The competition of one kv head (blockIdx.x) of one flush; smp and nsh: the block's shared memory. */
KVQ_DEV void kvq_ott_compete_body(const kvq_ott_params p, kvq_sel_smem *smp, int *nsh)
{
    const int h = blockIdx.x, tid = threadIdx.x, B = p.B, N = p.keep, S = p.spill_cap, D = KVQ_D;
    const int G = p.group > 0 ? p.group : B;
    int *wk = (int *)p.work + (long long)h * (2 * B + 4 * N + 8);
    unsigned *keys = (unsigned *)wk;
    float *score = (float *)(wk + B);
    int *sel = wk + 2 * B, *ord = sel + N + 1, *src = ord + N + 1, *sp = src + N;
    unsigned char *flags = (unsigned char *)p.flags;

    /* 1. S_i = ||K_i||_1 in double, channel by channel (kvq_key_l1); flags cleared */
    for (int i = tid; i < B; i += KVQ_PTHREADS) {
        long long r0 = kvq_row_at(&p.k, h, i, B);
        double s = 0.0;
#pragma unroll 8
        for (int x = 0; x < D; x++) s += fabs((double)kvq_src_ld(&p.k, r0, x));
        float l1 = (float)s, sc = p.largest ? -l1 : l1;
        score[i] = sc;
        keys[i] = kvq_fkey_low(sc);
        flags[kvq_ott_flag(i, h, B, G)] = 0;
    }
    __syncthreads();
    /* 2. the flush in rank order (kvq_bottomk): a competition admits at most `keep` tokens, so at most keep + 1
     *    of them are ever looked at (docs/cuda.md) */
    const int m = min(B, N + 1);
    kvq_block_select(keys, B, m, sel, smp);
    __syncthreads();
    kvq_block_rank(keys, sel, m, ord, 0);
    __syncthreads();

    /* 3. ref_outlier_step's admissions, one thread, on this head's copy of the state */
    if (tid == 0) {
        const int *pc_i = (const int *)kvq_om(p.meta_in, N, S, KVQ_OM_COUNT);
        const int *sc_i = (const int *)kvq_om(p.meta_in, N, S, KVQ_OM_SCOUNT);
        const int *pos_i = (const int *)kvq_om(p.meta_in, N, S, KVQ_OM_POS) + h * N;
        const float *scr_i = (const float *)kvq_om(p.meta_in, N, S, KVQ_OM_SCORE) + h * N;
        const int *spos_i = (const int *)kvq_om(p.meta_in, N, S, KVQ_OM_SPOS) + h * S;
        const float *sscr_i = (const float *)kvq_om(p.meta_in, N, S, KVQ_OM_SSCORE) + h * S;
        const kvq_u64 *mask_i = (const kvq_u64 *)kvq_om(p.meta_in, N, S, KVQ_OM_MASK) + h * N;
        int *pos = (int *)kvq_om(p.meta_out, N, S, KVQ_OM_POS) + h * N;
        float *scr = (float *)kvq_om(p.meta_out, N, S, KVQ_OM_SCORE) + h * N;
        int *spos = (int *)kvq_om(p.meta_out, N, S, KVQ_OM_SPOS) + h * S;
        float *sscr = (float *)kvq_om(p.meta_out, N, S, KVQ_OM_SSCORE) + h * S;
        kvq_u64 *mask = (kvq_u64 *)kvq_om(p.meta_out, N, S, KVQ_OM_MASK) + h * N;
        kvq_u64 *ev = (kvq_u64 *)kvq_om(p.meta_out, N, S, KVQ_OM_EVICT) + h * N;
        int pc = pc_i[h], sc = sc_i[h], ne = 0, nsp = 0;
        for (int s = 0; s < N; s++) {
            pos[s] = pos_i[s], scr[s] = scr_i[s], mask[s] = mask_i[s], ev[s] = 0;
            src[s] = -1 - s;
        }
        for (int s = 0; s < S; s++) spos[s] = spos_i[s], sscr[s] = sscr_i[s];
        nsh[1] = sc;
        for (int r = 0; r < m; r++) {
            int i = ord[r], at = p.first_pos + i, slot;
            if (pc < N) {
                slot = pc++;
            } else {
                int w = 0; /* the pool's worst member: last in rank order */
                for (int j = 1; j < N; j++)
                    if (kvq_ott_before(scr[w], pos[w], scr[j], pos[j])) w = j;
                if (!kvq_ott_before(score[i], at, scr[w], pos[w])) break;
                if (S > 0) {
                    if (sc == S) break; /* spill full: no more outliers (Sec. 3.2) */
                    spos[sc] = pos[w], sscr[sc] = scr[w], sp[nsp++] = src[w];
                    sc++;
                } else {
                    ev[ne++] = mask[w]; /* back to the body: its key slot is unmasked below */
                }
                slot = w;
            }
            pos[slot] = at, scr[slot] = score[i], src[slot] = i, mask[slot] = 0;
            if (p.mask) {
                int c0 = i / G * G, nc = min(G, B - c0), s = i - c0;
                kvq_u64 byte = ((const kvq_u64 *)p.mask)[i / G] + (kvq_u64)h * ((nc + 7) / 8) + (kvq_u64)(s / 8);
                mask[slot] = byte << 3 | (kvq_u64)(s & 7);
            }
            flags[kvq_ott_flag(i, h, B, G)] = 1;
        }
        ((int *)kvq_om(p.meta_out, N, S, KVQ_OM_COUNT))[h] = pc;
        ((int *)kvq_om(p.meta_out, N, S, KVQ_OM_SCOUNT))[h] = sc;
        ((int *)kvq_om(p.meta_out, N, S, KVQ_OM_NEVICT))[h] = ne;
        nsh[0] = nsp;
    }
    __syncthreads();

    /* 4. evicted members' key slots back to the body (spill 0), recorded in meta_out for kvq_ott_undo */
    const int ne = ((const int *)kvq_om(p.meta_out, N, S, KVQ_OM_NEVICT))[h];
    const kvq_u64 *ev = (const kvq_u64 *)kvq_om(p.meta_out, N, S, KVQ_OM_EVICT) + h * N;
    for (int e = tid; e < ne; e += KVQ_PTHREADS) {
        kvq_u64 enc = ev[e], byte = enc >> 3;
        if (!enc) continue;
        atomicAnd((unsigned *)(byte & ~(kvq_u64)3), ~(1u << ((unsigned)(byte & 3) * 8 + (unsigned)(enc & 7))));
    }
    /* 5. the pool copy written whole; evicted members appended to the spill pool (free slots) */
    kvq_half *po = (kvq_half *)p.pool_out, *so = (kvq_half *)p.spill;
    const long long pv = (long long)KVQ_HKV * N * D, sv = (long long)KVQ_HKV * S * D;
    for (int e = tid; e < N * D; e += KVQ_PTHREADS) {
        int s = e / D, x = e % D;
        long long o = ((long long)h * N + s) * D + x;
        po[o] = kvq_ott_src16(&p, 0, h, src[s], x);
        po[pv + o] = kvq_ott_src16(&p, 1, h, src[s], x);
    }
    for (int e = tid; e < nsh[0] * D; e += KVQ_PTHREADS) {
        int a = e / D, x = e % D;
        long long o = ((long long)h * S + nsh[1] + a) * D + x;
        so[o] = kvq_ott_src16(&p, 0, h, sp[a], x);
        so[sv + o] = kvq_ott_src16(&p, 1, h, sp[a], x);
    }
    /* 6. the rows to quantize: a pooled token is replaced by the mean of its key page's tokens that stay (all of
     *    them when none stays), keys and values, in double token by token, rounded to fp16 (ref_outlier.c) */
    kvq_half *ok = (kvq_half *)p.out_k, *ov = (kvq_half *)p.out_v;
    for (int g0 = 0; g0 < B; g0 += G) {
        int gn = min(G, B - g0), kept = 0;
        for (int i = g0; i < g0 + gn; i++) kept += !flags[kvq_ott_flag(i, h, B, G)];
        for (int x = tid; x < D; x += KVQ_PTHREADS) {
            kvq_half mk = kvq_f2h(0.0f), mv = mk;
            if (kept < gn) {
                double ak = 0.0, av = 0.0;
                for (int i = g0; i < g0 + gn; i++) {
                    if (kept && flags[kvq_ott_flag(i, h, B, G)]) continue;
                    ak += (double)kvq_h2f(kvq_raw16(&p.k, h, i, B, x));
                    av += (double)kvq_h2f(kvq_raw16(&p.v, h, i, B, x));
                }
                int cnt = kept ? kept : gn;
                mk = kvq_f2h((float)(ak / cnt));
                mv = kvq_f2h((float)(av / cnt));
            }
            for (int i = g0; i < g0 + gn; i++) {
                int pooled = flags[kvq_ott_flag(i, h, B, G)];
                long long o = ((long long)h * B + i) * D + x;
                ok[o] = pooled ? mk : kvq_raw16(&p.k, h, i, B, x);
                ov[o] = pooled ? mv : kvq_raw16(&p.v, h, i, B, x);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_ott_compete(const kvq_ott_params p)
{
    __shared__ kvq_sel_smem sm;
    __shared__ int nsh[2];
    kvq_ott_compete_body(p, &sm, nsh);
}
KVQ_KERNEL_EXPORT(kvq_ott_compete);

/* A planned step's competitions (kvq_list_params over kvq_ott_params, docs/cuda.md "Planned steps"): item
 * blockIdx.z is one sequence's flush of an OTT layer, B = 0 when the step flushes nothing there. Launched at every
 * step of an OTT layer with the same grid (kv_heads, 1, items) and parameter bytes; which copy of the pool state
 * an item reads and writes is in its parameters, decided by the plan. */
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_ott_compete_list(const kvq_list_params lp)
{
    __shared__ kvq_sel_smem sm;
    __shared__ int nsh[2];
    if ((int)blockIdx.z >= lp.n_items) return;
    const kvq_ott_params p = ((const kvq_ott_params *)lp.items)[blockIdx.z];
    if (p.B > 0) kvq_ott_compete_body(p, &sm, nsh);
}
KVQ_KERNEL_EXPORT(kvq_ott_compete_list);

extern "C" __global__ void kvq_ott_undo(const kvq_ott_params p)
{
    const int h = blockIdx.x, N = p.keep, S = p.spill_cap;
    const int ne = ((const int *)kvq_om(p.meta_out, N, S, KVQ_OM_NEVICT))[h];
    const kvq_u64 *ev = (const kvq_u64 *)kvq_om(p.meta_out, N, S, KVQ_OM_EVICT) + h * N;
    for (int e = threadIdx.x; e < ne && e < N; e += blockDim.x) {
        kvq_u64 enc = ev[e], byte = enc >> 3;
        if (!enc) continue;
        atomicOr((unsigned *)(byte & ~(kvq_u64)3), 1u << ((unsigned)(byte & 3) * 8 + (unsigned)(enc & 7)));
    }
}
KVQ_KERNEL_EXPORT(kvq_ott_undo);

#endif

/* ---------------------------------------------------------------------- ZipCache (Eq. 7-9) ---- */
#if KVQ_POL_ZIP

/* q . k in double, channel by channel (ref_saliency.c's softmax_add, cu_saliency's probe rows). */
KVQ_DEV double kvq_dot_qk(const float *q, const kvq_rows *r, long long row0)
{
    double s = 0.0;
#pragma unroll 8
    for (int x = 0; x < KVQ_D; x++) s += (double)q[x] * (double)kvq_src_ld(r, row0, x);
    return s;
}

/* kvq_prob_fixed (runtime/policy.h): a weight e in [0, 1] in integer units of 2^-40, truncated. */
#define KVQ_PROB_FIXED_UNIT 9.094947017729282e-13
KVQ_DEV unsigned long long kvq_prob_fixed(double e) { return (unsigned long long)(e * 1099511627776.0); }

/* A double's order key: unsigned comparison of keys is the comparison of the doubles (-0 below +0; NaN never
 * enters: the callers skip it as ref_saliency.c's `>` does), so atomicMax on keys is the maximum in any order. */
KVQ_DEV unsigned long long kvq_dkey(double x)
{
    unsigned long long b = (unsigned long long)__double_as_longlong(x);
    return (b >> 63) ? ~b : b | 0x8000000000000000ull;
}
KVQ_DEV double kvq_dkey_val(unsigned long long k)
{
    return __longlong_as_double((long long)((k >> 63) ? k & 0x7fffffffffffffffull : ~k));
}

/* Eq. 9's prefill probe rows, softmax(q K^T * scale) over keys 0..pos, over (probe, query head, key chunk) grids:
 * block z takes keys [z * chunk, (z + 1) * chunk) of the row. kvq_zip_stats_max: the row's max logit, kvq_zip_stats
 * then its denominator as the integer sum of kvq_prob_fixed(e^(l - m)) (ref_saliency.c sums the same integers).
 * A maximum and an integer sum are the same whatever order the chunks run in, so the result does not depend on
 * the chunking. stats: u64 [heads][np][2] = (order key of the max logit, fixed-point sum), zeroed before (key 0
 * is below every double's). */
KVQ_DEV int kvq_zip_stats_begin(const kvq_zip_params *p, float *qs, int *t0, int *t1)
{
    const int r = blockIdx.x, hq = blockIdx.y, n = ((const int *)p->pos)[r] + 1;
    *t0 = blockIdx.z * p->chunk;
    *t1 = min(n, *t0 + p->chunk);
    if (*t0 >= n) return 0; /* a chunk past the probe: it cannot see those keys (uniform per block) */
    for (int x = threadIdx.x; x < KVQ_D; x += KVQ_PTHREADS)
        qs[x] = ((const float *)p->q)[((long long)hq * p->np + r) * KVQ_D + x];
    __syncthreads();
    return 1;
}
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_stats_max(const kvq_zip_params p)
{
    __shared__ float qs[KVQ_D];
    __shared__ double red[KVQ_PTHREADS];
    const int hq = blockIdx.y, h = hq / KVQ_GQA, tid = threadIdx.x;
    int t0, t1;
    if (!kvq_zip_stats_begin(&p, qs, &t0, &t1)) return;
    double mx = KVQ_NEG_INF_D;
    for (int t = t0 + tid; t < t1; t += KVQ_PTHREADS) {
        double l = kvq_dmul(kvq_dot_qk(qs, &p.k, kvq_row_at(&p.k, h, t, 0)), p.scale);
        if (l > mx) mx = l;
    }
    red[tid] = mx;
    __syncthreads();
    for (int s = KVQ_PTHREADS / 2; s > 0; s >>= 1) {
        if (tid < s && red[tid + s] > red[tid]) red[tid] = red[tid + s];
        __syncthreads();
    }
    if (tid == 0) {
        mx = red[0] == 0.0 ? 0.0 : red[0]; /* +0 for -0, as the reference */
        atomicMax((unsigned long long *)p.stats + ((long long)hq * p.np + blockIdx.x) * 2, kvq_dkey(mx));
    }
}
KVQ_KERNEL_EXPORT(kvq_zip_stats_max);
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_stats(const kvq_zip_params p)
{
    __shared__ float qs[KVQ_D];
    __shared__ unsigned long long zsum;
    const int hq = blockIdx.y, h = hq / KVQ_GQA, tid = threadIdx.x;
    if (tid == 0) zsum = 0;
    int t0, t1;
    if (!kvq_zip_stats_begin(&p, qs, &t0, &t1)) return;
    unsigned long long *st = (unsigned long long *)p.stats + ((long long)hq * p.np + blockIdx.x) * 2;
    const double mx = kvq_dkey_val(st[0]);
    unsigned long long z = 0;
    for (int t = t0 + tid; t < t1; t += KVQ_PTHREADS)
        z += kvq_prob_fixed(kvq_exp_det(kvq_dmul(kvq_dot_qk(qs, &p.k, kvq_row_at(&p.k, h, t, 0)), p.scale) - mx));
    atomicAdd(&zsum, z);
    __syncthreads();
    if (tid == 0) atomicAdd(st + 1, zsum);
}
KVQ_KERNEL_EXPORT(kvq_zip_stats);

KVQ_DEV float kvq_zip_finish(double sum, int nnz, int accumulated)
{
    if (accumulated) return (float)sum;           /* Eq. 7 */
    return nnz ? (float)(sum / nnz) : 0.0f;       /* Eq. 8; a token no probe sees: 0 */
}

/* Eq. 7/8 of one prompt token: A[r][t] summed over the group's query heads in fp32 (as the host's rows hold
 * it), then over the probes that see the token in probe order, in double (kvq_saliency). */
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_saliency(const kvq_zip_params p)
{
    const int h = blockIdx.y, i = blockIdx.x * KVQ_PTHREADS + threadIdx.x;
    if (i >= p.n) return;
    const int t = p.first + i, *pos = (const int *)p.pos;
    const long long row0 = kvq_row_at(&p.k, h, t, 0);
    const unsigned long long *st = (const unsigned long long *)p.stats;
    double sum = 0.0;
    int nnz = 0;
    for (int r = 0; r < p.np; r++) {
        if (pos[r] < t) continue; /* causal: the probe at pos sees tokens 0..pos */
        float a = 0.0f;
        for (int j = 0; j < KVQ_GQA; j++) {
            long long qr = (long long)(h * KVQ_GQA + j) * p.np + r;
            double e = kvq_exp_det(kvq_dmul(kvq_dot_qk((const float *)p.q + qr * KVQ_D, &p.k, row0), p.scale) -
                                   kvq_dkey_val(st[2 * qr]));
            a = (float)((double)a + e / ((double)st[2 * qr + 1] * KVQ_PROB_FIXED_UNIT));
        }
        sum += (double)a;
        nnz++;
    }
    ((float *)p.sal)[(long long)h * p.n + i] = kvq_zip_finish(sum, nnz, p.accumulated);
}
KVQ_KERNEL_EXPORT(kvq_zip_saliency);

/* Alg. 3: a probe step's row over the waiting tokens, p_i = sum over the group's heads of e^(l_i - m) / Z with
 * (m, Z) from kvq_zip_norm_{max,sum,fin} over the whole cache, rounded as ref_attend rounds its probabilities (docs/cuda.md
 * "Determinism"). */
KVQ_DEV void kvq_zip_row_body(const kvq_zip_params p)
{
    const int h = blockIdx.x;
    const double *nm = (const double *)p.norm;
    float *row = (float *)p.rows + ((long long)p.row * KVQ_HKV + h) * p.wcap;
    for (int sl = threadIdx.x; sl < p.wcap; sl += KVQ_PTHREADS) {
        float v = 0.0f; /* tokens after the probe: it cannot see them */
        if (sl < p.count) {
            long long r0 = kvq_row_at(&p.k, h, sl, 0);
            double acc = 0.0;
            for (int j = 0; j < KVQ_GQA; j++) {
                int hq = h * KVQ_GQA + j;
                double s = kvq_dot_qk((const float *)p.q + (long long)hq * KVQ_D, &p.k, r0);
                float e = (float)kvq_exp_det(kvq_dmul(s, p.scale) - nm[2 * hq]);
                acc += (double)(float)((double)e / nm[2 * hq + 1]);
            }
            v = (float)acc;
        }
        row[sl] = v;
    }
}
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_row(const kvq_zip_params p) { kvq_zip_row_body(p); }
KVQ_KERNEL_EXPORT(kvq_zip_row);

/* The list forms of ZipCache's decode kernels for a planned step (kvq_list_params, item blockIdx.z of
 * kvq_zip_params; docs/cuda.md "Planned steps"): a probe step's row (rows 0: not a probe step), a compression's
 * classes (n 0: none; kvq_zip_rowsal then kvq_zip_select over the same item) and its pages' gathers (n 0: none).
 * Launched at every step of a ZipCache layer with the same grids. */
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_row_list(const kvq_list_params lp)
{
    if ((int)blockIdx.z >= lp.n_items) return;
    const kvq_zip_params p = ((const kvq_zip_params *)lp.items)[blockIdx.z];
    if (p.rows) kvq_zip_row_body(p);
}
KVQ_KERNEL_EXPORT(kvq_zip_row_list);


/* Key k_c of token t of tile T (kv head h) as ref_page_read dequantizes it: z + s * code (two roundings), times
 * the channel factor when separable; fp16 rows and pages as they are. */
KVQ_DEV float kvq_norm_key(const unsigned char *b, int kind, kvq_fmt f, kvq_page_off o, int h, int cap, int slot,
                           int c, float code)
{
    if (kind == KVQ_SRC_F16)
        return kvq_h2f(((const kvq_half *)b)[((long long)h * cap + slot) * KVQ_D + c]);
    if (f.bits >= 16) return kvq_h2f(((const kvq_half *)(b + o.codes))[((long long)h * cap + slot) * KVQ_D + c]);
    long long i = f.gran == 0 ? (long long)h * KVQ_D + c
                  : f.hidden  ? (long long)slot
                              : ((long long)h * cap + slot) * o.n_groups + c / f.group;
    float r = __fadd_rn(kvq_ld_par(b + o.zero, i, f.zbytes), __fmul_rn(kvq_ld_par(b + o.scale, i, f.sbytes), code));
    if (f.sep) r = __fmul_rn(r, kvq_ld_par(b + o.factor, (long long)h * KVQ_D + c, f.sbytes));
    return r;
}

/* The logit q . k * scale of slot `slot` of a tile's key container (kind, format f, offsets o) in double, channel
 * by channel (ref_attend); -inf for a masked slot (the reference skips it). Not unrolled: a policy kernel, kept
 * within its registers. */
KVQ_DEV double kvq_norm_logit(const unsigned char *b, int kind, kvq_fmt f, kvq_page_off o, int cap, int h, int slot,
                              const float *q, double scale)
{
    if (kind != KVQ_SRC_F16 && f.masked && ((b[o.mask + (long long)h * o.mask_stride + (slot >> 3)] >> (slot & 7)) & 1))
        return KVQ_NEG_INF_D;
    double s = 0.0;
    float cv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll 1
    for (int c0 = 0; c0 < KVQ_D; c0 += 8) {
        if (kind != KVQ_SRC_F16 && f.bits < 16)
            kvq_unpack8(b + o.codes + ((long long)h * cap + slot) * o.cbpt, c0, f.bits, KVQ_D, cv);
#pragma unroll
        for (int v = 0; v < 8; v++)
            s += (double)q[c0 + v] * (double)kvq_norm_key(b, kind, f, o, h, cap, slot, c0 + v, cv[v]);
    }
    return kvq_dmul(s, scale);
}

/* One pass of a decode probe's normaliser over this block's share of the sequence's tiles (tiles blockIdx.y,
 * + KVQ_ZN_CHUNKS, ...) for the query in qs (shared): with z NULL the max logit of the thread's tokens (exact in any
 * order), else *z = the sum of kvq_prob_fixed(e^(l - mx)) over them (an integer: the same in any order), which is
 * what ref_attend computes for a probe over the cache it materialises. */
KVQ_DEV double kvq_zip_norm_scan(const kvq_zip_norm_params *p, kvq_fmt khi, kvq_fmt klo, const float *qs, double mx,
                                 unsigned long long *z)
{
    const int h = blockIdx.x;
    const kvq_tile *tiles = (const kvq_tile *)p->tiles;
    double m = KVQ_NEG_INF_D;
    unsigned long long zz = 0;
    for (int ti = blockIdx.y; ti < p->n_tiles; ti += KVQ_ZN_CHUNKS) {
        const kvq_tile T = tiles[ti];
        int n = T.n;
        if (T.count) n = max(0, min(n, ((const int *)T.count)[h] - T.k_slot));
        const int kind = T.kinds & 255;
        const kvq_fmt f = kind == KVQ_SRC_LO ? klo : khi;
        const kvq_page_off o = kvq_page_offsets(f, KVQ_HKV, KVQ_D, T.k_cap);
        for (int t = threadIdx.x; t < n; t += KVQ_PTHREADS) {
            double l = kvq_norm_logit((const unsigned char *)T.k, kind, f, o, T.k_cap, h, T.k_slot + t, qs, p->scale);
            if (z) {
                if (l != KVQ_NEG_INF_D) zz += kvq_prob_fixed(kvq_exp_det(l - mx));
            } else if (l > m) {
                m = l;
            }
        }
    }
    if (z) *z = zz;
    return m;
}

/* The chunks' partials of query head hq: maxima [heads][KVQ_ZN_CHUNKS] after norm's [heads][2], then sums. */
KVQ_DEV double *kvq_zn_max(const kvq_zip_norm_params *p, int hq)
{
    return (double *)p->norm + 2 * KVQ_HQ + (long long)hq * KVQ_ZN_CHUNKS;
}
KVQ_DEV unsigned long long *kvq_zn_sum(const kvq_zip_norm_params *p, int hq)
{
    return (unsigned long long *)p->norm + 2 * KVQ_HQ + (long long)KVQ_HQ * KVQ_ZN_CHUNKS + (long long)hq * KVQ_ZN_CHUNKS;
}
/* The maximum of the chunks' maxima (exact; NaN never enters: a chunk's maximum skips it as the host does). */
KVQ_DEV double kvq_zn_max_of(const kvq_zip_norm_params *p, int hq)
{
    const double *pm = kvq_zn_max(p, hq);
    double m = KVQ_NEG_INF_D;
    for (int y = 0; y < KVQ_ZN_CHUNKS; y++)
        if (pm[y] > m) m = pm[y];
    return m;
}

/* kvq_zip_norm_max_c<k>, grid (kv_heads, KVQ_ZN_CHUNKS): per query head of kv head blockIdx.x the maximum logit
 * of chunk blockIdx.y. qs: [D] floats, red: [KVQ_PTHREADS] doubles, shared. */
KVQ_DEV void kvq_zip_norm_max_body(const kvq_zip_norm_params *p, kvq_fmt khi, kvq_fmt klo, float *qs, double *red)
{
    const int h = blockIdx.x, tid = threadIdx.x;
    for (int j = 0; j < KVQ_GQA; j++) {
        const int hq = h * KVQ_GQA + j;
        for (int x = tid; x < KVQ_D; x += KVQ_PTHREADS) qs[x] = ((const float *)p->q)[(long long)hq * KVQ_D + x];
        __syncthreads();
        red[tid] = kvq_zip_norm_scan(p, khi, klo, qs, 0.0, NULL);
        __syncthreads();
        for (int s = KVQ_PTHREADS / 2; s > 0; s >>= 1) {
            if (tid < s && red[tid + s] > red[tid]) red[tid] = red[tid + s];
            __syncthreads();
        }
        if (tid == 0) kvq_zn_max(p, hq)[blockIdx.y] = red[0];
        __syncthreads(); /* qs and red are the next head's */
    }
}

/* kvq_zip_norm_sum_c<k>, grid (kv_heads, KVQ_ZN_CHUNKS): per query head the integer sum of chunk blockIdx.y at the
 * maximum of all chunks. zsum: one u64, shared. */
KVQ_DEV void kvq_zip_norm_sum_body(const kvq_zip_norm_params *p, kvq_fmt khi, kvq_fmt klo, float *qs,
                                   unsigned long long *zsum)
{
    const int h = blockIdx.x, tid = threadIdx.x;
    for (int j = 0; j < KVQ_GQA; j++) {
        const int hq = h * KVQ_GQA + j;
        for (int x = tid; x < KVQ_D; x += KVQ_PTHREADS) qs[x] = ((const float *)p->q)[(long long)hq * KVQ_D + x];
        if (tid == 0) *zsum = 0;
        __syncthreads();
        unsigned long long z = 0;
        kvq_zip_norm_scan(p, khi, klo, qs, kvq_zn_max_of(p, hq), &z);
        atomicAdd(zsum, z);
        __syncthreads();
        if (tid == 0) kvq_zn_sum(p, hq)[blockIdx.y] = *zsum;
        __syncthreads();
    }
}

/* kvq_zip_norm_fin, grid (kv_heads): norm[hq] = (m, Z * 2^-40) from the chunks' partials. */
KVQ_DEV void kvq_zip_norm_fin_body(const kvq_zip_norm_params *p)
{
    for (int j = threadIdx.x; j < KVQ_GQA; j += blockDim.x) {
        const int hq = blockIdx.x * KVQ_GQA + j;
        const unsigned long long *pz = kvq_zn_sum(p, hq);
        unsigned long long z = 0;
        for (int y = 0; y < KVQ_ZN_CHUNKS; y++) z += pz[y];
        ((double *)p->norm)[2 * hq] = kvq_zn_max_of(p, hq);
        ((double *)p->norm)[2 * hq + 1] = (double)z * KVQ_PROB_FIXED_UNIT;
    }
}
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_norm_fin(const kvq_zip_norm_params p)
{
    kvq_zip_norm_fin_body(&p);
}
KVQ_KERNEL_EXPORT(kvq_zip_norm_fin);
/* A planned step's (kvq_list_params over kvq_zip_norm_params; q 0: not a probe step). */
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_norm_fin_list(const kvq_list_params lp)
{
    if ((int)blockIdx.z >= lp.n_items) return;
    const kvq_zip_norm_params p = ((const kvq_zip_norm_params *)lp.items)[blockIdx.z];
    if (p.q) kvq_zip_norm_fin_body(&p);
}
KVQ_KERNEL_EXPORT(kvq_zip_norm_fin_list);

/* Eq. 7/8 of the window's token i from the cycle's rows (kvq_saliency over rows restricted to the batch). */
KVQ_DEV void kvq_zip_rowsal_body(const kvq_zip_params p)
{
    const int h = blockIdx.y, i = blockIdx.x * KVQ_PTHREADS + threadIdx.x;
    if (i >= p.n) return;
    const int *pos = (const int *)p.pos;
    double sum = 0.0;
    int nnz = 0;
    for (int r = 0; r < p.np; r++) {
        if (pos[r] < i) continue;
        sum += (double)((const float *)p.rows)[((long long)r * KVQ_HKV + h) * p.wcap + i];
        nnz++;
    }
    ((float *)p.sal)[(long long)h * p.n + i] = kvq_zip_finish(sum, nnz, p.accumulated);
}
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_rowsal(const kvq_zip_params p)
{
    kvq_zip_rowsal_body(p);
}
KVQ_KERNEL_EXPORT(kvq_zip_rowsal);

extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_rowsal_list(const kvq_list_params lp)
{
    if ((int)blockIdx.z >= lp.n_items) return;
    const kvq_zip_params p = ((const kvq_zip_params *)lp.items)[blockIdx.z];
    if (p.n > 0) kvq_zip_rowsal_body(p);
}
KVQ_KERNEL_EXPORT(kvq_zip_rowsal_list);

/* Alg. 2 Split: the n_high most salient tokens (kvq_select_salient, ties to the earlier token). */
KVQ_DEV void kvq_zip_select_body(const kvq_zip_params p, kvq_sel_smem *smp)
{
    const int h = blockIdx.x, n = p.n;
    unsigned *keys = (unsigned *)p.work + (long long)h * n;
    int *sel = (int *)p.work + (long long)KVQ_HKV * n + (long long)h * n;
    unsigned char *hi = (unsigned char *)p.is_high + (long long)h * n;
    const float *sal = (const float *)p.sal + (long long)h * n;
    for (int i = threadIdx.x; i < n; i += KVQ_PTHREADS) {
        keys[i] = kvq_fkey(sal[i]);
        hi[i] = 0;
    }
    __syncthreads();
    int m = kvq_block_select(keys, n, p.n_high, sel, smp);
    __syncthreads();
    for (int a = threadIdx.x; a < m; a += KVQ_PTHREADS) hi[sel[a]] = 1;
}
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_select(const kvq_zip_params p)
{
    __shared__ kvq_sel_smem sm;
    kvq_zip_select_body(p, &sm);
}
KVQ_KERNEL_EXPORT(kvq_zip_select);

extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_select_list(const kvq_list_params lp)
{
    __shared__ kvq_sel_smem sm;
    if ((int)blockIdx.z >= lp.n_items) return;
    const kvq_zip_params p = ((const kvq_zip_params *)lp.items)[blockIdx.z];
    if (p.n > 0) kvq_zip_select_body(p, &sm);
}
KVQ_KERNEL_EXPORT(kvq_zip_select_list);

/* kvq_zip_gather: the members of one page of a compression's class, from kvq_zip_select's flags, so that the
 * classes never leave the device (docs/cuda.md "Policy decisions"). Class p.row (0: high, flag set; 1: low) of the
 * batch of p.n tokens is its members in position order (ref_class_split), split into pages; this page holds
 * members [p.count, p.count + p.np) of the class. Per kv head (blockIdx.x) a prefix sum of the class flags ranks
 * each member: deterministic (integer counts, one order). Fields of kvq_zip_params: is_high the flags [H][n],
 * work the page's gather rows int [H][np] (window ring slot (first + i) mod wcap, wcap 0: first + i), pos the
 * page's member indices int [H][np] (batch index i: the slot's position is the batch's first position + i,
 * derived on the host only when read_cache asks). grid (kv_heads), block KVQ_PTHREADS. */
KVQ_DEV void kvq_zip_gather_body(const kvq_zip_params p, int *part)
{
    const int h = blockIdx.x, n = p.n, t = threadIdx.x;
    const unsigned char *hi = (const unsigned char *)p.is_high + (long long)h * n;
    int *gather = (int *)p.work + (long long)h * p.np, *mem = (int *)p.pos + (long long)h * p.np;
    /* thread t owns the contiguous chunk [lo, hi_) of the batch: count, exclusive scan of the counts, then rank */
    const int chunk = (n + KVQ_PTHREADS - 1) / KVQ_PTHREADS, lo = t * chunk;
    const int end = lo + chunk < n ? lo + chunk : n;
    int cnt = 0;
    for (int i = lo; i < end; i++) cnt += (hi[i] != 0) == (p.row == 0);
    part[t] = cnt;
    __syncthreads();
    if (t == 0) {
        int run = 0;
        for (int a = 0; a < KVQ_PTHREADS; a++) {
            int v = part[a];
            part[a] = run;
            run += v;
        }
    }
    __syncthreads();
    int r = part[t];
    for (int i = lo; i < end; i++) {
        if ((hi[i] != 0) != (p.row == 0)) continue;
        int j = r++ - p.count;
        if (j >= 0 && j < p.np) {
            gather[j] = p.wcap ? (p.first + i) % p.wcap : p.first + i;
            mem[j] = i;
        }
    }
}
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_gather(const kvq_zip_params p)
{
    __shared__ int part[KVQ_PTHREADS];
    kvq_zip_gather_body(p, part);
}
KVQ_KERNEL_EXPORT(kvq_zip_gather);

extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_zip_gather_list(const kvq_list_params lp)
{
    __shared__ int part[KVQ_PTHREADS];
    if ((int)blockIdx.z >= lp.n_items) return;
    const kvq_zip_params p = ((const kvq_zip_params *)lp.items)[blockIdx.z];
    if (p.n > 0) kvq_zip_gather_body(p, part);
}
KVQ_KERNEL_EXPORT(kvq_zip_gather_list);

#endif

/* ------------------------------------------------------------- TailorKV retrieval (Eq. 10, App. I) ---- */
#if KVQ_POL_TK

/* KVQ_TK_CHUNKS (kvq_params.cuh): blocks per kv head of the chunked TailorKV kernels: kv_heads x 16 blocks fill
 * an H100's 132 SMs where one block per kv head used 8 of them. A block takes tokens y*KVQ_PTHREADS + tid, then
 * every KVQ_TK_CHUNKS*KVQ_PTHREADS-th: consecutive threads read consecutive tokens of a channel (channel-major
 * keys: coalesced reads of host memory over PCIe). The results do not depend on the split: a maximum is exact in
 * any order, and a candidate's score is its own. */

/* App. I absmax_k: max_t |K_t,i| per channel over the prompt (kvq_key_absmax), grid (kv_heads, KVQ_TK_CHUNKS).
 * absmax must hold zeros before the launch (cu_dev_alloc's fill): each warp's maximum of a channel goes in with
 * atomicMax on the float's bits, which order as the floats do for the non-negative, non-NaN values it takes (a
 * NaN never wins, as in the host's `a > m`). */
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_tk_absmax(const kvq_tk_params p)
{
    const int h = blockIdx.x, t0 = blockIdx.y * KVQ_PTHREADS + threadIdx.x;
    const kvq_half *k = (const kvq_half *)p.k + (long long)h * KVQ_D * p.T; /* channel-major: [D][T] */
    unsigned *am = (unsigned *)p.absmax + (long long)h * KVQ_D;
    for (int d = 0; d < KVQ_D; d++) {
        float m = 0.0f;
        for (int t = t0; t < p.T; t += KVQ_TK_CHUNKS * KVQ_PTHREADS) {
            float a = fabsf(kvq_h2f(k[(long long)d * p.T + t]));
            if (a > m) m = a;
        }
        for (int o = 16; o > 0; o >>= 1) {
            float x = __shfl_xor_sync(0xffffffffu, m, o);
            if (x > m) m = x;
        }
        if ((threadIdx.x & 31) == 0 && m > 0.0f) atomicMax(am + d, __float_as_uint(m));
    }
}
KVQ_KERNEL_EXPORT(kvq_tk_absmax);

/* App. I reduce_q (kvq_reduce_q_group) and Eq. 10's critical channels (kvq_critical_channels) of kv head
 * blockIdx.x, into the block's shared qm [D] and ch [nch] (rank order); returns nch. */
KVQ_DEV int kvq_tk_channels(const kvq_tk_params *p, float *qm, unsigned *ck, int *csel, int *ch, kvq_sel_smem *smp)
{
    const int h = blockIdx.x, tid = threadIdx.x;
    const float *q = (const float *)p->q;
    for (int d = tid; d < KVQ_D; d += KVQ_PTHREADS) {
        double s = 0.0; /* the mean of signed values; |.| is taken after (App. I) */
        for (int j = 0; j < KVQ_GQA; j++) s += q[(long long)(h * KVQ_GQA + j) * KVQ_D + d];
        qm[d] = (float)(s / KVQ_GQA);
    }
    __syncthreads();
    for (int d = tid; d < KVQ_D; d += KVQ_PTHREADS)
        ck[d] = kvq_fkey(__fmul_rn(fabsf(qm[d]), ((const float *)p->absmax)[(long long)h * KVQ_D + d]));
    __syncthreads();
    const int nch = kvq_block_select(ck, KVQ_D, p->n_ch, csel, smp);
    __syncthreads();
    kvq_block_rank(ck, csel, nch, ch, 0);
    __syncthreads();
    return nch;
}

/* approximate_attn on the critical channels (kvq_critical_scores) of this block's candidates, reading only those
 * channels from the channel-major copy in host memory, as selection keys into work. grid (kv_heads,
 * KVQ_TK_CHUNKS): every block finds the same channels (the same arithmetic on the same inputs), then scores its
 * share of the candidates. */
KVQ_DEV void kvq_tk_score_body(const kvq_tk_params p, float *qm, unsigned *ck, int *csel, int *ch, kvq_sel_smem *smp)
{
    const int h = blockIdx.x, nc = p.nc;
    const int nch = kvq_tk_channels(&p, qm, ck, csel, ch, smp);
    unsigned *keys = (unsigned *)p.work + (long long)h * nc;
    const kvq_half *k = (const kvq_half *)p.k + (long long)h * KVQ_D * p.T + p.first;
    for (int t = blockIdx.y * KVQ_PTHREADS + threadIdx.x; t < nc; t += KVQ_TK_CHUNKS * KVQ_PTHREADS) {
        double s = 0.0; /* in the channels' rank order, as the host sums them */
        for (int c = 0; c < nch; c++) s += (double)qm[ch[c]] * (double)kvq_h2f(k[(long long)ch[c] * p.T + t]);
        keys[t] = kvq_fkey((float)s);
    }
}

/* The top nf of kvq_tk_score's keys (kvq_topk) as gather rows for kvq_store_f16, grid (kv_heads). */
KVQ_DEV void kvq_tk_select_body(const kvq_tk_params p, kvq_sel_smem *smp)
{
    const int h = blockIdx.x, nc = p.nc;
    const unsigned *keys = (const unsigned *)p.work + (long long)h * nc;
    int *sel = (int *)p.work + (long long)KVQ_HKV * nc + (long long)h * nc;
    const int m = kvq_block_select(keys, nc, p.nf, sel, smp);
    __syncthreads();
    kvq_block_rank(keys, sel, m, (int *)p.gather + (long long)h * p.nf, p.first);
}

/* One retrieval is kvq_tk_score then kvq_tk_select with the same parameters. */
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_tk_score(const kvq_tk_params p)
{
    __shared__ float qm[KVQ_D];
    __shared__ unsigned ck[KVQ_D];
    __shared__ int csel[KVQ_D], ch[KVQ_D];
    __shared__ kvq_sel_smem sm;
    kvq_tk_score_body(p, qm, ck, csel, ch, &sm);
}
KVQ_KERNEL_EXPORT(kvq_tk_score);

extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_tk_select(const kvq_tk_params p)
{
    __shared__ kvq_sel_smem sm;
    kvq_tk_select_body(p, &sm);
}
KVQ_KERNEL_EXPORT(kvq_tk_select);

/* A planned step's retrievals (kvq_list_params over kvq_tk_params): item blockIdx.z is one sequence's retrieval
 * of a sparse layer, nf = 0 when it fetches nothing. Grids (kv_heads, KVQ_TK_CHUNKS, items) and (kv_heads, 1,
 * items), the same at every step. */
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_tk_score_list(const kvq_list_params lp)
{
    __shared__ float qm[KVQ_D];
    __shared__ unsigned ck[KVQ_D];
    __shared__ int csel[KVQ_D], ch[KVQ_D];
    __shared__ kvq_sel_smem sm;
    if ((int)blockIdx.z >= lp.n_items) return;
    const kvq_tk_params p = ((const kvq_tk_params *)lp.items)[blockIdx.z];
    if (p.nf > 0) kvq_tk_score_body(p, qm, ck, csel, ch, &sm);
}
KVQ_KERNEL_EXPORT(kvq_tk_score_list);

extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_tk_select_list(const kvq_list_params lp)
{
    __shared__ kvq_sel_smem sm;
    if ((int)blockIdx.z >= lp.n_items) return;
    const kvq_tk_params p = ((const kvq_tk_params *)lp.items)[blockIdx.z];
    if (p.nf > 0) kvq_tk_select_body(p, &sm);
}
KVQ_KERNEL_EXPORT(kvq_tk_select_list);

#endif

/* --------------------------------------------------------- TailorKV calibration (Eq. 6-8) ---- */
#if KVQ_POL_DENSE

/* The sparse error of one query row (policy_tailorkv.c row_sparse_error): logits q . k * scale (double dot,
 * rounded once to fp32), their max, the k-th largest logit, then the softmax mass outside the top kk summed
 * with the total by one thread in key order. */
extern "C" __global__ void __launch_bounds__(KVQ_PTHREADS, 2) kvq_tk_dense(const kvq_dense_params p)
{
    __shared__ float qs[KVQ_D];
    __shared__ float fred[KVQ_PTHREADS];
    __shared__ double ev[KVQ_PTHREADS];
    __shared__ unsigned char inv[KVQ_PTHREADS];
    __shared__ kvq_sel_smem sm;
    const int r = blockIdx.x, tid = threadIdx.x, n = p.n, v = n - p.n_q + r + 1;
    if (p.kk >= v) { /* the row keeps all its mass */
        if (tid == 0) ((double *)p.err)[r] = 0.0;
        return;
    }
    for (int x = tid; x < KVQ_D; x += KVQ_PTHREADS) qs[x] = ((const float *)p.q)[(long long)r * KVQ_D + x];
    __syncthreads();
    float *lg = (float *)p.logits + (long long)r * n;
    unsigned *keys = (unsigned *)p.keys + (long long)r * n;
    const float *k = (const float *)p.k;
    float mx = KVQ_NEG_INF;
    for (int j = tid; j < v; j += KVQ_PTHREADS) {
        double d = 0.0;
#pragma unroll 8
        for (int x = 0; x < KVQ_D; x++) d += (double)qs[x] * (double)k[(long long)j * KVQ_D + x];
        float l = (float)kvq_dmul(d, (double)p.scale);
        lg[j] = l;
        keys[j] = kvq_fkey(l);
        if (l > mx) mx = l;
    }
    fred[tid] = mx;
    __syncthreads();
    for (int s = KVQ_PTHREADS / 2; s > 0; s >>= 1) {
        if (tid < s && fred[tid + s] > fred[tid]) fred[tid] = fred[tid + s];
        __syncthreads();
    }
    const float m = fred[0];
    int ties = 0, run_eq = 0;
    unsigned T = 0;
    if (p.kk > 0) T = kvq_block_kth(keys, v, p.kk, &ties, &sm);
    double z = 0.0, rest = 0.0;
    for (int base = 0; base < v; base += KVQ_PTHREADS) {
        int j = base + tid, valid = j < v;
        unsigned x = valid ? keys[j] : 0u;
        int in = p.kk > 0 ? kvq_block_member(x, valid, T, ties, &run_eq, &sm) : 0;
        ev[tid] = valid ? kvq_exp_det((double)lg[j] - (double)m) : 0.0;
        inv[tid] = (unsigned char)in;
        __syncthreads();
        if (tid == 0)
            for (int a = 0; a < min(KVQ_PTHREADS, v - base); a++) {
                z += ev[a];
                if (!inv[a]) rest += ev[a];
            }
        __syncthreads();
    }
    if (tid == 0) ((double *)p.err)[r] = z > 0 ? rest / z : 0.0;
}
KVQ_KERNEL_EXPORT(kvq_tk_dense);

#endif

#endif
